"""Value clipping as Optax transformations: `clip_by_value` and `clip`."""

from __future__ import annotations

import optax
from jax.typing import ArrayLike

from clipax import _common
from clipax.tree import _value


def clip_by_value(
    min_value: ArrayLike, max_value: ArrayLike
) -> optax.GradientTransformation:
    """Clamps every update element to `[min_value, max_value]`.

    The transformation form of `clipax.tree.clip_by_value` (`tf.clip_by_value`):
    asymmetric bounds, scalars or arrays that broadcast to the leaves; NaN stays
    NaN and +-inf map to the bounds. Stateless.

    Args:
      min_value: the lower bound, concrete or traced.
      max_value: the upper bound; where both are concrete, `min_value <=
        max_value`.

    Returns:
      An `optax.GradientTransformation` with `optax.EmptyState`.

    Raises:
      ValueError: at construction, if a bound is NaN or `min_value > max_value`.
      TypeError: at construction, if a bound is not a real number or array.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> tx = clipax.clip_by_value(-1.0, 2.0)
      >>> updates, _ = tx.update({"w": jnp.array([-3.0, 0.5, 7.0])}, tx.init(None))
      >>> updates["w"]
      Array([-1. ,  0.5,  2. ], dtype=float32)
    """
    _common.check_bounds(min_value, max_value)
    return optax.stateless(
        lambda updates, params: _value.clip_by_value(updates, min_value, max_value)
    )


def clip(max_delta: ArrayLike) -> optax.GradientTransformation:
    """Clamps every update element to `[-max_delta, max_delta]`.

    The symmetric shorthand for `clip_by_value(-max_delta, max_delta)`, the
    drop-in for `optax.clip`, `torch.nn.utils.clip_grad_value_` and Keras
    `clipvalue`.

    Args:
      max_delta: the largest absolute value allowed: >= 0 (0 zeroes every
        update), a scalar or an array that broadcasts to the leaves, concrete or
        traced.

    Returns:
      An `optax.GradientTransformation` with `optax.EmptyState`.

    Raises:
      ValueError: at construction, if `max_delta` is negative or NaN.
      TypeError: at construction, if `max_delta` is not a real number or array.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> tx = clipax.clip(1.0)
      >>> updates, _ = tx.update({"w": jnp.array([-3.0, 0.5, 7.0])}, tx.init(None))
      >>> updates["w"]
      Array([-1. ,  0.5,  1. ], dtype=float32)
    """
    if not _common.is_traced(max_delta):
        delta = _common.concrete_real(
            "max_delta", max_delta, "a real number >= 0 or an array of them"
        )
        if not (delta >= 0).all():  # also catches NaN
            raise ValueError(
                f"`max_delta` must be >= 0 and not NaN; got {max_delta!r}."
            )
    return clip_by_value(-max_delta, max_delta)  # type: ignore[operator]
