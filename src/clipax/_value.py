"""Value clipping as Optax transformations: `clip_by_value` and `clip`."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from clipax import _checks
from clipax.tree import _value as tree_value

MAX_DELTA_ACCEPTED = (
    "a real number >= 0, a NumPy or JAX scalar or array of them, or a traced value"
)


@_checks.peer_names(
    {"clip_value_min": "min_value", "clip_value_max": "max_value"},
    "clipax.tree.clip_by_value(tree, min_value, max_value)",
)
def clip_by_value(
    min_value: ArrayLike, max_value: ArrayLike, name: str | None = None
) -> optax.GradientTransformation:
    """Clamps every update element to `[min_value, max_value]`.

    The transformation form of `clipax.tree.clip_by_value` (`tf.clip_by_value`):
    asymmetric bounds, scalars or arrays that broadcast to the leaves; NaN stays
    NaN and +-inf map to the bounds. Stateless. It takes the arguments of
    `tf.clip_by_value` after the tensor, under their TensorFlow names too.

    Args:
      min_value: the lower bound, concrete or traced (TensorFlow's
        `clip_value_min`).
      max_value: the upper bound; where both are concrete, `min_value <=
        max_value` (TensorFlow's `clip_value_max`).
      name: TensorFlow's name for the operation: accepted and ignored.

    Returns:
      An `optax.GradientTransformation` with `optax.EmptyState`.

    Raises:
      ValueError: at construction, if a bound is NaN or `min_value > max_value`.
      TypeError: at construction, if a bound is not a real number or array, or
        an argument is given under two of its names (clipax's and a peer's).

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> tx = clipax.clip_by_value(-1.0, 2.0)
      >>> updates, _ = tx.update({"w": jnp.array([-3.0, 0.5, 7.0])}, tx.init(None))
      >>> updates["w"]
      Array([-1. ,  0.5,  2. ], dtype=float32)
    """
    del name  # means nothing in JAX
    _checks.bounds(min_value, max_value)

    def clip(updates: optax.Updates, params: optax.Params | None) -> optax.Updates:
        del params
        return tree_value.clip_leaves(updates, min_value, max_value)

    return optax.stateless(clip)


@_checks.peer_names(
    {"clip_value": "max_delta"},
    "clipax.tree.clip_by_value(tree, -max_delta, max_delta)",
)
def clip(
    max_delta: ArrayLike, foreach: bool | None = None
) -> optax.GradientTransformation:
    """Clamps every update element to `[-max_delta, max_delta]`.

    The symmetric shorthand for `clip_by_value(-max_delta, max_delta)`, the
    drop-in for `optax.clip`, `torch.nn.utils.clip_grad_value_` and Keras
    `clipvalue`. It takes the call of `optax.clip`, and the arguments of
    `clip_grad_value_` after the parameters, under their PyTorch names too.

    Args:
      max_delta: the largest absolute value allowed: >= 0 (0 zeroes every
        update), a scalar or an array that broadcasts to the leaves, concrete or
        traced (PyTorch's `clip_value`).
      foreach: PyTorch's choice of kernels: accepted and ignored (XLA fuses
        the work under `jax.jit`).

    Returns:
      An `optax.GradientTransformation` with `optax.EmptyState`.

    Raises:
      ValueError: at construction, if `max_delta` is negative or NaN.
      TypeError: at construction, if `max_delta` is not a real number, a NumPy
        or JAX scalar or array, or a traced value (a list, say); or if an
        argument is given under two of its names (clipax's and a peer's).

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> tx = clipax.clip(1.0)
      >>> updates, _ = tx.update({"w": jnp.array([-3.0, 0.5, 7.0])}, tx.init(None))
      >>> updates["w"]
      Array([-1. ,  0.5,  1. ], dtype=float32)
    """
    del foreach  # means nothing in JAX
    if _checks.is_data(max_delta):  # <= 0 zeroes every update; NaN gives NaN
        _checks.jax_number("max_delta", max_delta, MAX_DELTA_ACCEPTED, scalar=False)
        max_delta = jnp.maximum(max_delta, 0)
    else:
        arrays = (np.ndarray, np.generic, jax.Array)
        if max_delta is not None and not isinstance(max_delta, (numbers.Real, *arrays)):
            raise TypeError(  # a list, say
                f"`max_delta` must be {MAX_DELTA_ACCEPTED}; got "
                f"{_checks.short_repr(max_delta)} of type {type(max_delta).__name__}."
            )
        delta = _checks.real_array("max_delta", max_delta, MAX_DELTA_ACCEPTED)
        if not (delta >= 0).all():  # also catches NaN
            raise ValueError(
                f"`max_delta` must be >= 0 and not NaN; got {max_delta!r}."
            )

    def clip(updates: optax.Updates, params: optax.Params | None) -> optax.Updates:
        del params
        # The lower bound is -max_delta in each leaf's dtype: a bound's own
        # dtype may not hold it (an unsigned or a uint32 with x64 off).
        return tree_value.clip_leaves(updates, None, max_delta)

    return optax.stateless(clip)
