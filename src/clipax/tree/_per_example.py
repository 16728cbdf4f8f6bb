"""Per-example clipping for DP-SGD: clip each example's gradient, then sum."""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from clipax import _common, _engine

CLIP_ACCEPTED = (
    f"a scalar >= 0 ({_common.THRESHOLD_TYPES}); inf means no clipping, 0 "
    "zeroes every nonzero example"
)


def _check_clip(name: str, value: Any) -> None:
    _common.check_scalar(name, value, CLIP_ACCEPTED, low=0)


def _batched_leaves(grads: chex.ArrayTree, fn_name: str) -> list[Any]:
    """The leaves, checked to be float arrays sharing a leading batch axis."""
    flat = _common.check_norm_leaves(grads, fn_name)
    batch = None
    for path, leaf in flat:
        shape = tuple(leaf.shape)
        if batch is None and shape:
            batch = shape[0]
        if not shape or shape[0] != batch:
            raise ValueError(
                f"`{fn_name}` takes per-example gradients: every leaf must have "
                "the same batch size on axis 0"
                + (f" ({batch}, from the first leaf)" if batch is not None else "")
                + f"; the leaf at {_common.path_str(path)} has shape {shape}."
            )
    return [leaf for _, leaf in flat]


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
    weights = scales.reshape(scales.shape + (1,) * (x.ndim - 1))
    return jnp.sum(x * weights, axis=0).astype(x.dtype)


def _scales(norms: jax.Array, clip: ArrayLike) -> tuple[jax.Array, jax.Array]:
    scales = _common.clip_scale(norms, clip)
    # As optax counts them, but for a non-finite norm (its example is NaN).
    clipped = (norms > jnp.asarray(clip, norms.dtype)) & jnp.isfinite(norms)
    return scales, jnp.sum(clipped).astype(jnp.int32)


def per_example_global_norm_clip(
    grads: chex.ArrayTree, l2_norm_clip: ArrayLike
) -> tuple[chex.ArrayTree, jax.Array]:
    """Clips each example's gradient to global norm `l2_norm_clip`, then sums.

    The clipping step of DP-SGD, equal to `optax.per_example_global_norm_clip`
    on the same inputs. Every leaf of `grads` holds per-example gradients on
    axis 0 (as `jax.vmap(jax.grad(loss), in_axes=(None, 0))` gives them).
    Example `i`, of global L2 norm `n_i` over all leaves, is weighted by
    `l2_norm_clip / max(n_i, l2_norm_clip)`, and the weighted examples are
    summed. Only the `[batch]` norms and one weighted sum over the batch per
    leaf are computed, each fused into one pass: no clipped copy of the
    per-example gradients is made on XLA's CPU backend (on GPU, XLA was seen
    to make one leaf-sized temporary: docs/semantics.md). Works with the batch
    axis sharded across devices (under jit with `NamedSharding`, explicit mesh
    axes included, where optax's `tensordot` asks for an output sharding).

    With clipax's rules: norms are accumulated in float32 (float64 for float64
    leaves), each summed leaf keeps its input dtype (optax returns float32 for
    bfloat16 input), an example of norm 0 counts as not clipped, and an example
    whose norm is NaN or inf makes every output NaN (optax lets it through
    unscaled, or zeroes its finite entries). A tree with no leaves gives itself
    and a count of 0.

    Args:
      grads: a pytree of float16, bfloat16, float32, float64 or complex arrays,
        each with the batch on axis 0; None and `optax.MaskedNode` leaves are
        empty.
      l2_norm_clip: the largest global norm of one example: a scalar >= 0,
        `inf`, or a traced value.

    Returns:
      `(summed, num_clipped)`: the sum over the batch of the clipped
      per-example gradients (the structure of `grads`, each leaf without its
      batch axis), and an int32 scalar, how many examples were scaled down.

    Raises:
      ValueError: if `l2_norm_clip` is not accepted, or a leaf has no axis 0 or
        a batch size that differs from the first leaf's.
      TypeError: if a leaf is not a float16, bfloat16, float32, float64 or complex
        array.

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
    _check_clip("l2_norm_clip", l2_norm_clip)
    leaves = _batched_leaves(grads, "per_example_global_norm_clip")
    if not leaves:
        return grads, jnp.zeros((), jnp.int32)
    dtype = _common.tree_accum_dtype(leaves)
    per_leaf = jnp.stack([n.astype(dtype) for n in _example_norms(leaves)])
    norms = _engine.norm_of_norms(per_leaf)
    scales, num_clipped = _scales(norms, l2_norm_clip)
    summed = jax.tree.map(lambda x: _weighted_sum(scales, x), grads)
    return summed, num_clipped


def per_example_layer_norm_clip(
    grads: chex.ArrayTree,
    global_l2_norm_clip: ArrayLike,
    uniform: bool = True,
) -> tuple[chex.ArrayTree, chex.ArrayTree]:
    """Clips each example's gradient leaf by leaf (layer by layer), then sums.

    Per-layer clipping for DP training (McMahan et al. 2017), equal to
    `optax.per_example_layer_norm_clip` on the same inputs. Each of the `K`
    leaves is clipped on its own, per example, as
    `clipax.tree.per_example_global_norm_clip` does, to its share of
    `C = global_l2_norm_clip`: `C / sqrt(K)` when `uniform`, else
    `C * sqrt(D_i / D)`, `D_i` being the leaf's size per example and `D` the
    total. Either way the clipped example's global norm is at most `C`. The
    rules of `per_example_global_norm_clip` hold for each leaf.

    Args:
      grads: a pytree of float16, bfloat16, float32, float64 or complex arrays,
        each with the batch on axis 0; None and `optax.MaskedNode` leaves are
        empty.
      global_l2_norm_clip: the bound `C` on the global norm of one clipped
        example: a scalar >= 0, `inf`, or a traced value.
      uniform: whether every leaf gets the same share of `C` (True, default) or
        a share by its size (False).

    Returns:
      `(summed, num_clipped)`: the sum over the batch of the clipped
      per-example gradients, and a tree of the same structure with, in place of
      each leaf, an int32 scalar: how many examples that leaf was scaled down
      for.

    Raises:
      ValueError: if `global_l2_norm_clip` is not accepted, or a leaf has no
        axis 0 or a batch size that differs from the first leaf's.
      TypeError: if a leaf is not a float16, bfloat16, float32, float64 or complex
        array.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> grads = {"a": jnp.array([[3.0, 4.0], [0.3, 0.4]]),
      ...          "b": jnp.array([[0.0], [2.0]])}
      >>> summed, num_clipped = clipax.tree.per_example_layer_norm_clip(
      ...     grads, 2**0.5)  # each leaf clipped to norm 1
      >>> # a: [3, 4] clipped to [0.6, 0.8], plus [0.3, 0.4]; b: [2] clipped to [1]
      >>> jnp.allclose(summed["a"], jnp.array([0.9, 1.2]))
      Array(True, dtype=bool)
      >>> jnp.allclose(summed["b"], jnp.array([1.0]))
      Array(True, dtype=bool)
      >>> num_clipped["a"], num_clipped["b"]
      (Array(1, dtype=int32), Array(1, dtype=int32))

    References:
      McMahan et al., `Learning Differentially Private Recurrent Language
      Models <https://arxiv.org/abs/1710.06963>`_, 2017.
    """
    _check_clip("global_l2_norm_clip", global_l2_norm_clip)
    leaves = _batched_leaves(grads, "per_example_layer_norm_clip")
    treedef = jax.tree.structure(grads)
    if uniform:
        shares = [1.0 / len(leaves)] * len(leaves) if leaves else []
    else:
        sizes = [int(np.prod(x.shape[1:])) for x in leaves]
        total_size = sum(sizes)
        shares = [size / total_size if total_size else 0.0 for size in sizes]
    summed, counts = [], []
    for x, share, norms in zip(leaves, shares, _example_norms(leaves), strict=True):
        clip = jnp.asarray(global_l2_norm_clip, norms.dtype) * share**0.5
        scales, num_clipped = _scales(norms, clip)
        summed.append(_weighted_sum(scales, x))
        counts.append(num_clipped)
    return jax.tree.unflatten(treedef, summed), jax.tree.unflatten(treedef, counts)
