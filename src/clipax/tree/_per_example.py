"""Per-example clipping for DP-SGD: clip each example's gradient, then sum."""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from clipax import _checks, _engine, _leaves

CLIP_ACCEPTED = "a scalar >= 0; inf means no clipping, 0 zeroes every nonzero example"


def _weighted_sum(
    scales: jax.Array, x: jax.Array, layer_axes: tuple[int, ...] = ()
) -> jax.Array:
    """`sum_i scales[i] * x[i]`, in float32 or wider, cast back to x's dtype;
    `scales` is [batch] or, for a stacked leaf, [batch, layers...].

    Written as a product reduced over the batch axis, which XLA fuses into one
    pass over `x` (no scaled copy is made), and which, unlike a `tensordot`,
    also works when the batch axis is sharded with explicit mesh axes.
    """
    shape = [n if d == 0 or d in layer_axes else 1 for d, n in enumerate(x.shape)]
    return jnp.sum(x * scales.reshape(shape), axis=0).astype(x.dtype)


def _scales(norms: jax.Array, clip: ArrayLike) -> tuple[jax.Array, jax.Array]:
    """Each example's clip factor, and how many examples were scaled down (per
    layer, for the norms of a stacked leaf: [batch, layers...])."""
    scales = _engine.clip_factor(norms, clip)
    # As optax counts them, but for a non-finite norm (its example is NaN).
    clipped = (norms > jnp.asarray(clip, norms.dtype)) & jnp.isfinite(norms)
    return scales, jnp.sum(clipped, axis=0).astype(jnp.int32)


def per_example_global_norm_clip(
    grads: chex.ArrayTree, l2_norm_clip: ArrayLike, *, specs: Any = None
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
      specs: inside `shard_map`, the `in_specs` of `grads`, the batch
        included: the sums are completed over the mesh axes splitting it.

    Returns:
      `(summed, num_clipped)`: the sum over the batch of the clipped
      per-example gradients, and an int32 scalar, how many examples were
      scaled down.

    Raises:
      ValueError: if `l2_norm_clip` is not accepted, a leaf has no axis 0 or
        another batch size than the first leaf's, or inside `shard_map` the
        layout is not given.
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
    l2_norm_clip = _checks.nonnegative("l2_norm_clip", l2_norm_clip, CLIP_ACCEPTED)
    leaves = _leaves.leaves(
        grads, "per_example_global_norm_clip", batched=True, specs=specs
    )
    if not leaves:
        return grads, jnp.zeros((), jnp.int32)
    dtype = _engine.tree_accum_dtype(leaves.arrays)
    per_leaf = _engine.norms(leaves, [tuple(range(1, leaf.x.ndim)) for leaf in leaves])
    norms = _engine.norm_of_norms(
        jnp.stack([n.reshape(-1).astype(dtype) for n in per_leaf])
    )
    scales, num_clipped = _scales(norms, l2_norm_clip)
    summed = [_weighted_sum(scales, jnp.asarray(x)) for x in leaves.arrays]
    # Each device summed its examples: the sums completed over the batch's axes.
    batch = [leaf.split([0]) for leaf in leaves]
    summed = _engine.complete(summed, batch)
    (num_clipped,) = _engine.complete([num_clipped], batch[:1])
    return leaves.rebuild(summed, batched=True), num_clipped


def per_example_layer_norm_clip(
    grads: chex.ArrayTree,
    global_l2_norm_clip: ArrayLike,
    uniform: bool = True,
    *,
    stacked: Any = None,
    specs: Any = None,
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
      specs: as for `per_example_global_norm_clip`.

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
    clip = _checks.nonnegative(
        "global_l2_norm_clip", global_l2_norm_clip, CLIP_ACCEPTED
    )
    uniform = _checks.flag("uniform", uniform)
    leaves = _leaves.leaves(
        grads, "per_example_layer_norm_clip", stacked=stacked, batched=True, specs=specs
    )
    inner = [leaf.inner[1:] for leaf in leaves]  # not the batch axis
    layers = [leaf.size(leaf.layer_axes) for leaf in leaves]  # the whole stacks'
    count = sum(layers)
    sizes = [leaf.size(axes) for leaf, axes in zip(leaves, inner, strict=True)]
    total_size = sum(n * size for n, size in zip(layers, sizes, strict=True))
    summed, counts = [], []
    for leaf, n, size in zip(leaves, _engine.norms(leaves, inner), sizes, strict=True):
        share = 1.0 / count if uniform else (size / total_size if total_size else 0.0)
        n = n.reshape((leaf.x.shape[0], *leaf.layers))
        scales, num_clipped = _scales(n, jnp.asarray(clip, n.dtype) * share**0.5)
        summed.append(_weighted_sum(scales, jnp.asarray(leaf.x), leaf.layer_axes))
        counts.append(num_clipped)
    batch = [leaf.split([0]) for leaf in leaves]
    summed, counts = _engine.complete(summed, batch), _engine.complete(counts, batch)
    return leaves.rebuild(summed, batched=True), leaves.stats(counts)
