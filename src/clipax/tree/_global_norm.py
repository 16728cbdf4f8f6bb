"""The global norm of a pytree, and clipping a pytree by it."""

from __future__ import annotations

import math
from typing import Any

import chex
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from clipax import _common, _fused


def _global_norm_of(leaves: list[Any], p: float) -> jax.Array:
    """The p-norm over all of `leaves`, accumulated in float32 or wider."""
    dtype = _common.tree_accum_dtype(leaves)
    if not leaves:
        return jnp.zeros((), dtype)
    partials = _fused.partial_sums(leaves, p, dtype)
    if p == math.inf:
        return jnp.max(partials)
    return _common.safe_root(jnp.sum(partials), p)


def global_norm(tree: chex.ArrayTree, *, ord: float = 2) -> jax.Array:  # noqa: A002
    """Returns the norm of all leaves of `tree` taken together.

    The leaves are treated as one long vector. Squares (or |x|**p) are summed in
    float32, or float64 when a leaf is float64, so float16 and bfloat16 trees do
    not overflow where their own dtype would. None and `optax.MaskedNode` leaves
    are empty; a tree with no leaves has norm 0 for every `ord`. Complex leaves
    contribute |x|.

    Args:
      tree: a pytree of floating-point or complex arrays.
      ord: 2 (default), 1, `inf` (the largest absolute value), or any real p >= 1.

    Returns:
      A float32 scalar, or float64 when a leaf is float64.

    Raises:
      ValueError: if `ord` is not accepted.
      TypeError: if a leaf is not a floating-point or complex array; the
        message names its path.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> grads = {"w": jnp.array([3.0, 0.0]), "b": jnp.array([4.0]), "x": None}
      >>> clipax.tree.global_norm(grads)
      Array(5., dtype=float32)
      >>> clipax.tree.global_norm(grads, ord=jnp.inf)
      Array(4., dtype=float32)
    """
    p = _common.check_ord(ord)
    flat = _common.check_norm_leaves(tree, "global_norm")
    return _global_norm_of([leaf for _, leaf in flat], p)


def clip_by_global_norm(
    tree: chex.ArrayTree,
    max_norm: ArrayLike,
    *,
    use_norm: ArrayLike | None = None,
    ord: float = 2,  # noqa: A002
) -> tuple[chex.ArrayTree, jax.Array]:
    """Scales all leaves by one factor so that their global norm is <= `max_norm`.

    Every leaf is multiplied by `max_norm / max(norm, max_norm)`, TensorFlow's
    formula with no epsilon: a tree whose norm is at most `max_norm` comes back
    unchanged, a zero tree too. When the norm is NaN or inf, every output leaf
    is NaN, as in TensorFlow: a broken step is never turned silently into a small
    or partial update. The factor is applied in float32 (float64 for float64
    leaves) and each leaf is cast back to its dtype. The gradient of any loss of
    the result is finite everywhere, also at a zero tree.

    Args:
      tree: a pytree of floating-point or complex arrays; None and
        `optax.MaskedNode` leaves are empty and come back in place.
      max_norm: the largest global norm allowed: a positive scalar of any dtype,
        `inf` for no clipping, or a traced value (not checked; a traced value <= 0
        maps every nonzero tree to zeros).
      use_norm: a norm to use instead of computing one, as in
        `tf.clip_by_global_norm`; it is also the norm returned.
      ord: the norm's order: 2 (default), 1, `inf`, or any real p >= 1.

    Returns:
      `(clipped_tree, norm)`, `norm` being the pre-clip global norm (float32, or
      float64 when a leaf is float64).

    Raises:
      ValueError: if `max_norm`, `use_norm` or `ord` is not accepted.
      TypeError: if a leaf is not a floating-point or complex array.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> grads = {"w": jnp.array([3.0, 0.0]), "b": jnp.array([4.0])}
      >>> clipped, norm = clipax.tree.clip_by_global_norm(grads, 1.0)
      >>> norm
      Array(5., dtype=float32)
      >>> clipped["w"], clipped["b"]
      (Array([0.6, 0. ], dtype=float32), Array([0.8], dtype=float32))

    References:
      Pascanu et al., `On the difficulty of training recurrent neural networks
      <https://arxiv.org/abs/1211.5063>`_, 2012.
    """
    _common.check_max_norm("max_norm", max_norm)
    _common.check_use_norm(use_norm)
    p = _common.check_ord(ord)
    leaves = [leaf for _, leaf in _common.check_norm_leaves(tree, "clip_by_global_norm")]
    if use_norm is None:
        norm = _global_norm_of(leaves, p)
    else:
        norm = jnp.asarray(use_norm).astype(_common.tree_accum_dtype(leaves))
    scale = _common.clip_scale(norm, max_norm)
    clipped = jax.tree.map(lambda x: _common.apply_scale(x, scale), tree)
    return clipped, norm
