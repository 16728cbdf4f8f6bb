"""Element-wise value clipping of a pytree."""

from __future__ import annotations

from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from clipax import _common


def _bound_for(
    bound: ArrayLike, dtype: np.dtype, round_fn: Callable[[jax.Array], jax.Array]
) -> jax.Array:
    """`bound` in a leaf's dtype; for integer leaves rounded inwards, saturated."""
    bound = jnp.asarray(bound)
    if not jnp.issubdtype(dtype, jnp.integer):
        return bound.astype(dtype)
    if jnp.issubdtype(bound.dtype, jnp.integer):
        return bound.astype(dtype)
    info = jnp.iinfo(dtype)
    rounded = round_fn(bound)
    return jnp.clip(rounded, float(info.min), float(info.max)).astype(dtype)


def clip_by_value(
    tree: chex.ArrayTree,
    min_value: ArrayLike,
    max_value: ArrayLike,
) -> chex.ArrayTree:
    """Clamps every element of every leaf to `[min_value, max_value]`.

    Like `tf.clip_by_value`: bounds may be scalars or arrays that broadcast to
    each leaf, NaN stays NaN, +inf and -inf map to the bounds. Each leaf keeps its
    dtype and shape. Integer leaves are clamped in their own dtype, float bounds
    rounded inwards (`ceil` for the lower, `floor` for the upper bound).

    Args:
      tree: a pytree of real integer or floating-point arrays; None and
        `optax.MaskedNode` leaves are empty and come back in place.
      min_value: the lower bound, any real dtype, concrete or traced.
      max_value: the upper bound; where both are concrete, `min_value <=
        max_value` everywhere.

    Returns:
      The clipped tree, with the structure, shapes and dtypes of `tree`.

    Raises:
      ValueError: if a bound is NaN, `min_value > max_value`, or a bound does
        not broadcast to a leaf's shape (the message names the leaf).
      TypeError: if a bound is not real, or a leaf is bool, complex or not an
        array.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> clipax.tree.clip_by_value({"w": jnp.array([-3.0, 0.5, 7.0])}, -1.0, 2.0)
      {'w': Array([-1. ,  0.5,  2. ], dtype=float32)}
    """
    _common.check_bounds(min_value, max_value)
    flat = _common.check_value_leaves(tree, "clip_by_value")
    shapes = (np.shape(min_value), np.shape(max_value))
    for path, x in flat:
        try:
            shape = np.broadcast_shapes(x.shape, *shapes)
        except ValueError:
            shape = None
        if shape != tuple(x.shape):
            raise ValueError(
                f"`min_value` (shape {shapes[0]}) and `max_value` (shape "
                f"{shapes[1]}) must broadcast to the leaf at {_common.path_str(path)}"
                f" with shape {tuple(x.shape)} without changing its shape."
            )

    def clamp(x: jax.Array) -> jax.Array:
        dtype = jax.dtypes.canonicalize_dtype(x.dtype)  # as JAX holds the leaf
        low = _bound_for(min_value, dtype, jnp.ceil)
        high = _bound_for(max_value, dtype, jnp.floor)
        return jnp.clip(x, low, high).astype(dtype)

    return jax.tree.map(clamp, tree)
