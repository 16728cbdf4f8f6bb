"""`clip_by_block_rms`: each leaf clipped to a root-mean-square threshold."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from clipax import _adaptive, _common, _engine


@jax.jit
def _rms_factor(norm: jax.Array, root_size: float, threshold: Any) -> jax.Array:
    """The clip factor of a leaf's RMS, `norm / root_size`; jitted, so that
    every leaf shares one trace."""
    return _common.clip_scale(norm / root_size, threshold)


def _clip_tree(updates: optax.Updates, threshold: ArrayLike) -> optax.Updates:
    flat = _common.check_norm_leaves(updates, "clip_by_block_rms")
    leaves = [jnp.asarray(x) for _, x in flat]
    norms = _engine.tensor_norms(leaves, [tuple(range(x.ndim)) for x in leaves])
    clipped = [
        _common.apply_scale(x, _rms_factor(n, math.sqrt(max(x.size, 1)), threshold))
        for x, n in zip(leaves, norms, strict=True)
    ]
    return jax.tree.unflatten(jax.tree.structure(updates), clipped)


def clip_by_block_rms(threshold: ArrayLike) -> optax.GradientTransformation:
    """Scales each update leaf so that its root mean square is <= `threshold`.

    Equal to `optax.clip_by_block_rms` on the same inputs: a block is a leaf
    (a weight vector, matrix or kernel), its RMS is `sqrt(mean(|u|**2))`, and a
    leaf whose RMS exceeds `threshold` is multiplied by `threshold / rms`. With
    clipax's rules: the RMS is the leaf's per-tensor norm (clipax's engine,
    float32, float64 for float64 leaves) over `sqrt(size)`, and each leaf keeps its
    dtype; a leaf whose RMS is NaN or inf comes back all NaN; a leaf of size 0,
    None and `optax.MaskedNode` come back as they are. It is the per-leaf rule
    of `clipax.clip_by_norm` with the threshold scaled by `sqrt(size)`, so large
    and small leaves are held to the same per-entry size.

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
    return _adaptive.stateless(
        "clip_by_block_rms", lambda updates, _: _clip_tree(updates, threshold)
    )
