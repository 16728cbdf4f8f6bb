"""`clip_by_block_rms`: each leaf clipped to a root-mean-square threshold."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from clipax import _common


def _clip_leaf(x: jax.Array, threshold: ArrayLike) -> jax.Array:
    if x.size == 0:
        return x
    rms = _common.safe_root(_common.power_sum(x, 2.0) / x.size, 2.0)
    return _common.apply_scale(x, _common.clip_scale(rms, threshold))


def clip_by_block_rms(threshold: ArrayLike) -> optax.GradientTransformation:
    """Scales each update leaf so that its root mean square is <= `threshold`.

    Equal to `optax.clip_by_block_rms` on the same inputs: a block is a leaf
    (a weight vector, matrix or kernel), its RMS is `sqrt(mean(|u|**2))`, and a
    leaf whose RMS exceeds `threshold` is multiplied by `threshold / rms`. With
    clipax's rules: the mean of squares is accumulated in float32 (float64 for
    float64 leaves) and each leaf keeps its dtype; a leaf whose RMS is NaN or
    inf comes back all NaN; a leaf of size 0, None and `optax.MaskedNode` come
    back as they are. It is the per-leaf rule of `clipax.clip_by_norm` with
    the threshold scaled by `sqrt(size)`, so large and small leaves are held to
    the same per-entry size.

    Args:
      threshold: the largest RMS allowed for each leaf: a positive scalar,
        `inf`, or a traced value (a traced value <= 0 maps nonzero leaves to
        zeros).

    Returns:
      An `optax.GradientTransformation` with state `optax.EmptyState`.

    Raises:
      ValueError: at construction, if `threshold` is not accepted.
      TypeError: at `init` or `update`, if a leaf is not a floating-point or
        complex array.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> tx = clipax.clip_by_block_rms(1.0)
      >>> grads = {"w": jnp.array([3.0, -3.0, 3.0, -3.0]), "b": jnp.array([0.5])}
      >>> updates, _ = tx.update(grads, tx.init(grads))
      >>> updates["w"], updates["b"]  # RMS 3 scaled to 1; RMS 0.5 kept
      (Array([ 1., -1.,  1., -1.], dtype=float32), Array([0.5], dtype=float32))
    """
    _common.check_max_norm("threshold", threshold)

    def init_fn(params: optax.Params) -> optax.EmptyState:
        _common.check_norm_leaves(params, "clip_by_block_rms")
        return optax.EmptyState()

    def update_fn(
        updates: optax.Updates,
        state: optax.EmptyState,
        params: optax.Params | None = None,
    ) -> tuple[optax.Updates, optax.EmptyState]:
        del params
        _common.check_norm_leaves(updates, "clip_by_block_rms")
        clipped = jax.tree.map(lambda x: _clip_leaf(jnp.asarray(x), threshold), updates)
        return clipped, state

    return optax.GradientTransformation(init_fn, update_fn)
