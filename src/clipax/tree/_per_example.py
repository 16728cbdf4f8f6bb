"""Per-example clipping for DP-SGD: clip each example's gradient, then sum."""

from __future__ import annotations

import math
from typing import Any

import chex
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from clipax import _checks, _engine

CLIP_ACCEPTED = "a scalar >= 0; inf means no clipping, 0 zeroes every nonzero example"


def _example_norms(leaves: list[jax.Array]) -> list[jax.Array]:
    """Each leaf's per-example L2 norms, shape [batch] each, float32 or wider,
    from the engine, in one pass over each leaf."""
    axes = [tuple(range(1, x.ndim)) for x in leaves]
    norms = _engine.tensor_norms([jnp.asarray(x) for x in leaves], axes)
    return [n.reshape(x.shape[0]) for n, x in zip(norms, leaves, strict=True)]


def _weighted_sum(scales: jax.Array, x: jax.Array) -> jax.Array:
    """`sum_i scales[i] * x[i]`, in float32 or wider, cast back to x's dtype.

    Written as a product reduced over the batch axis, which XLA fuses into one
    pass over `x` (no scaled copy is made), and which, unlike a `tensordot`,
    also works when the batch axis is sharded with explicit mesh axes.
    """
    weights = scales.reshape(scales.shape + (1,) * (x.ndim - scales.ndim))
    return jnp.sum(x * weights, axis=0).astype(x.dtype)


def _scales(norms: jax.Array, clip: ArrayLike) -> tuple[jax.Array, jax.Array]:
    """Each example's clip factor, and how many examples were scaled down (per
    layer, for the norms of a stacked leaf: [batch, layers...])."""
    scales = _engine.clip_factor(norms, clip)
    # As optax counts them, but for a non-finite norm (its example is NaN).
    clipped = (norms > jnp.asarray(clip, norms.dtype)) & jnp.isfinite(norms)
    return scales, jnp.sum(clipped, axis=0).astype(jnp.int32)


def per_example_global_norm_clip(
    grads: chex.ArrayTree, l2_norm_clip: ArrayLike
) -> tuple[chex.ArrayTree, jax.Array]:
    """Clips each example's gradient to global norm `l2_norm_clip`, then sums.

    The clipping step of DP-SGD, equal to `optax.per_example_global_norm_clip`
    on the same inputs: every leaf holds per-example gradients on axis 0, example
    `i` of global norm `n_i` is weighted by `l2_norm_clip / max(n_i,
    l2_norm_clip)`, and the weighted examples are summed, with no clipped copy of
    the gradients (docs/semantics.md, "Per-example clipping"). Norms accumulate in
    float32 (float64 for float64 leaves), each summed leaf keeps its dtype, and an
    example whose norm is NaN or inf makes every output NaN.

    Args:
      grads: a pytree of float arrays, each with the batch on axis 0.
      l2_norm_clip: the largest global norm of one example: a scalar >= 0,
        `inf`, or an array.

    Returns:
      `(summed, num_clipped)`: the sum over the batch of the clipped
      per-example gradients, and an int32 scalar, how many examples were
      scaled down.

    Raises:
      ValueError: if `l2_norm_clip` is not accepted, or a leaf has no axis 0 or
        another batch size than the first leaf's.
      TypeError: if a leaf is not a float array.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> grads = {"w": jnp.array([[0.0, 0.0], [3.0, 4.0], [0.6, 0.8]])}
      >>> summed, num_clipped = clipax.tree.per_example_global_norm_clip(grads, 1.0)
      >>> summed["w"], num_clipped  # [3, 4] is clipped to [0.6, 0.8]
      (Array([1.2, 1.6], dtype=float32), Array(1, dtype=int32))

    References:
      Abadi et al., `Deep Learning with Differential Privacy
      <https://arxiv.org/abs/1607.00133>`_, 2016.
    """
    _checks.nonnegative("l2_norm_clip", l2_norm_clip, CLIP_ACCEPTED)
    leaves = _checks.batched_leaves(grads, "per_example_global_norm_clip").arrays
    if not leaves:
        return grads, jnp.zeros((), jnp.int32)
    dtype = _engine.tree_accum_dtype(leaves)
    per_leaf = jnp.stack([n.astype(dtype) for n in _example_norms(leaves)])
    norms = _engine.norm_of_norms(per_leaf)
    scales, num_clipped = _scales(norms, l2_norm_clip)
    summed = jax.tree.map(lambda x: _weighted_sum(scales, x), grads)
    return summed, num_clipped


def per_example_layer_norm_clip(
    grads: chex.ArrayTree,
    global_l2_norm_clip: ArrayLike,
    uniform: bool = True,
    *,
    stacked: Any = None,
) -> tuple[chex.ArrayTree, chex.ArrayTree]:
    """Clips each example's gradient leaf by leaf (layer by layer), then sums.

    Per-layer clipping for DP training (McMahan et al. 2017), equal to
    `optax.per_example_layer_norm_clip` on the same inputs: each of the `K`
    leaves is clipped per example, as `per_example_global_norm_clip` does, to its
    share of `C = global_l2_norm_clip`: `C / sqrt(K)` when `uniform`, else
    `C * sqrt(D_i / D)` (`D_i` the leaf's size per example, `D` the total).
    Either way a clipped example's global norm is at most `C`. With
    `stacked`, each layer of a stacked leaf is a layer of its own; its
    stacked axes follow the batch axis (docs/stacked-layers.md).

    Args:
      grads: a pytree of float arrays, each with the batch on axis 0.
      global_l2_norm_clip: the bound `C`: a scalar >= 0, `inf`, or an array.
      uniform: whether every leaf gets the same share of `C` (default) or a
        share by its size.
      stacked: None, or a prefix of `grads` holding, per subtree, how many
        axes after the batch axis index stacked layers, or a callable that
        returns one.

    Returns:
      `(summed, num_clipped)`: the sum over the batch of the clipped
      per-example gradients, and a tree with an int32 scalar per leaf (one
      per layer of a stacked leaf): how many examples it was scaled down for.

    Raises:
      ValueError: if `global_l2_norm_clip` is not accepted, or a leaf has no
        axis 0 or another batch size than the first leaf's.
      TypeError: if a leaf is not a float array, or `uniform` is not a bool.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> grads = {"a": jnp.array([[3.0, 4.0], [0.3, 0.4]]),
      ...          "b": jnp.array([[0.0], [2.0]])}
      >>> _, num_clipped = clipax.tree.per_example_layer_norm_clip(grads, 2**0.5)
      >>> num_clipped["a"], num_clipped["b"]  # each leaf clipped to norm 1
      (Array(1, dtype=int32), Array(1, dtype=int32))

    References:
      McMahan et al., `Learning Differentially Private Recurrent Language
      Models <https://arxiv.org/abs/1710.06963>`_, 2017.
    """
    _checks.nonnegative("global_l2_norm_clip", global_l2_norm_clip, CLIP_ACCEPTED)
    uniform = _checks.flag("uniform", uniform)
    leaves = _checks.batched_leaves(grads, "per_example_layer_norm_clip")
    leaves = _checks.stacking(stacked, grads, leaves)
    layers, inner = [], []  # per leaf: its stacked axes' shape, its inner axes
    for i, (path, x) in enumerate(zip(leaves.paths, leaves.arrays, strict=True)):
        k = leaves.stacked_axes(i)
        if k > x.ndim - 1:
            raise ValueError(
                f"`stacked` gives {k} stacked axes to the leaf at "
                f"{_checks.path_str(path)} with shape {tuple(x.shape)}, whose "
                f"first axis is the batch: at most {x.ndim - 1}."
            )
        layers.append(tuple(x.shape[1 : 1 + k]))
        inner.append(tuple(range(1 + k, x.ndim)))
    count = sum(math.prod(shape) for shape in layers)  # layers in all
    sizes = [
        math.prod(x.shape[a] for a in axes)
        for x, axes in zip(leaves.arrays, inner, strict=True)
    ]
    total_size = sum(n * s for n, s in zip(map(math.prod, layers), sizes, strict=True))
    norms = _engine.tensor_norms(leaves.arrays, inner)
    summed, counts = [], []
    for x, n, shape, size in zip(leaves.arrays, norms, layers, sizes, strict=True):
        share = 1.0 / count if uniform else (size / total_size if total_size else 0.0)
        n = n.reshape((x.shape[0], *shape))
        clip = jnp.asarray(global_l2_norm_clip, n.dtype) * share**0.5
        scales, num_clipped = _scales(n, clip)
        summed.append(_weighted_sum(scales, x))
        counts.append(num_clipped)
    return leaves.rebuild(summed), leaves.rebuild(counts)
