"""Element-wise value clipping of a pytree."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from clipax import _checks

INTEGER_BOUND = (
    "an integer leaf is clamped in its own dtype, so its bounds must be whole "
    "numbers (values past the dtype's range and +-inf saturate)"
)


def _check_integer_bound(
    name: str, bound: ArrayLike, path: str, dtype: np.dtype
) -> None:
    """A bound for an integer leaf: whole numbers (or +-inf), never rounded.

    Raises:
      ValueError: for a Python or NumPy bound with a fractional part.
      TypeError: for a JAX array bound of a floating dtype (data, traced or
        not, whose values are not read).
    """
    if _checks.is_data(bound):
        if not jnp.issubdtype(bound.dtype, jnp.integer):
            kind = "traced " if _checks.is_traced(bound) else ""
            raise TypeError(
                f"`{name}` is a {kind}{bound.dtype} array and the leaf at {path} "
                f"has dtype {dtype}: {INTEGER_BOUND}, which a float array is not "
                "checked to be. Pass an integer-dtype bound, or cast the leaf "
                "to a float dtype."
            )
        return
    if isinstance(bound, int):  # whole, of any size (10**400 is no float64)
        return
    values = np.asarray(bound, dtype=np.float64)
    finite = values[np.isfinite(values)]
    if np.any(finite != np.round(finite)):
        raise ValueError(
            f"`{name}`={_checks.short_repr(bound)} cannot bound the leaf at {path} "
            f"(dtype {dtype}) exactly: {INTEGER_BOUND}. Round the bound yourself "
            "(`math.floor`/`math.ceil`), or cast the leaf to a float dtype."
        )


def _has_inf(dtype: np.dtype) -> bool:
    """Whether the float `dtype` holds inf (`float8_e4m3fn` does not)."""
    return bool(np.isinf(np.asarray(np.inf).astype(dtype)))


def _traced_bound(bound: jax.Array, dtype: np.dtype) -> jax.Array:
    """A traced `bound` in a leaf's dtype, on the device; for integer leaves,
    and float dtypes with no inf, saturated to its range (an integer leaf's
    traced bound is an integer)."""
    bound = jnp.asarray(bound)
    if not jnp.issubdtype(dtype, jnp.integer):
        if not _has_inf(dtype):  # the cast would give NaN past the range
            big = float(jnp.finfo(dtype).max)
            bound = jnp.clip(bound, -big, big)
        return bound.astype(dtype)
    info = jnp.iinfo(dtype)
    if jnp.issubdtype(bound.dtype, jnp.integer):
        own = jnp.iinfo(bound.dtype)
        low, high = max(info.min, own.min), min(info.max, own.max)
        return jnp.clip(bound, low, high).astype(dtype)
    return jnp.clip(bound, float(info.min), float(info.max)).astype(dtype)


def _integer_bound(bound: ArrayLike, dtype: np.dtype, lower: bool) -> np.ndarray:
    """A concrete bound for an integer leaf, in its dtype, in exact integer
    arithmetic: past the dtype's range (or +-inf) it saturates, which clamps
    exactly as the bound would; a float bound is rounded inwards (ceil for
    `min_value`, floor for `max_value`; `_check_integer_bound` has made sure
    that it is whole, so this only turns it into an integer)."""
    info = np.iinfo(dtype)
    if isinstance(bound, int):  # a Python int of any size
        return np.asarray(min(max(bound, int(info.min)), int(info.max)), dtype)
    array = np.asarray(bound)
    if array.dtype.kind in "iu":  # NumPy compares these with Python ints exactly
        whole, above, below = array, array > info.max, array < info.min
    else:
        values = array.astype(np.float64)
        whole = np.ceil(values) if lower else np.floor(values)
        # float(info.max) is info.max + 1 for 64-bit dtypes: >= saturates it.
        above, below = whole >= float(info.max), whole <= float(info.min)
    out = np.where(above | below, 0, whole).astype(dtype)
    np.putmask(out, above, info.max)
    np.putmask(out, below, info.min)
    return out


def _float_bound(bound: ArrayLike, dtype: np.dtype) -> np.ndarray:
    """A concrete bound for a floating leaf, rounded to its dtype as a cast
    rounds (to nearest): past the largest finite value it is +-inf, or that
    largest value in a dtype with no inf (`float8_e4m3fn`), where the cast
    would give NaN. Finite leaf values never change."""
    if isinstance(bound, int):  # a Python int of any size
        bound = _checks.int_as_float(bound)
    array = np.asarray(bound)
    if not _has_inf(dtype):
        big = float(jnp.finfo(dtype).max)
        array = np.clip(array.astype(np.float64), -big, big)
    with np.errstate(over="ignore"):  # overflowing to +-inf is the rule here
        return array.astype(dtype)


def _bound_for(bound: ArrayLike, dtype: np.dtype, lower: bool) -> ArrayLike:
    """`bound` in a leaf's dtype. A concrete bound is converted on the host,
    so no value passes through JAX's default dtypes (with x64 off,
    `jnp.asarray(np.int64(2**40))` wraps to 0, 2**31 overflows int32 and
    16777217.0 rounds to float32's 16777216)."""
    if _checks.is_data(bound):
        return _traced_bound(bound, dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return _integer_bound(bound, dtype, lower)
    return _float_bound(bound, dtype)


@_checks.peer_names(
    "clipax.tree.clip_by_value",
    {"t": "tree", "clip_value_min": "min_value", "clip_value_max": "max_value"},
    ["name"],
)
def clip_by_value(
    tree: chex.ArrayTree,
    min_value: ArrayLike,
    max_value: ArrayLike,
    name: str | None = None,
) -> chex.ArrayTree:
    """Clamps every element of every leaf to `[min_value, max_value]`.

    Like `tf.clip_by_value`, and taking its call: bounds may be scalars or arrays
    that broadcast to each leaf, NaN stays NaN, +inf and -inf map to the bounds,
    and each leaf keeps its dtype and shape. Integer leaves are clamped in their
    own dtype: a bound is never rounded (a fractional bound is an error naming
    the leaf), and bounds past the dtype's range saturate. Concrete bounds are
    converted to each leaf's dtype on the host, never through JAX's default
    dtypes (docs/semantics.md, "Dtypes").

    Args:
      tree: a pytree of real integer or floating-point arrays.
      min_value: the lower bound, any real dtype (TensorFlow's
        `clip_value_min`).
      max_value: the upper bound; where both are concrete, `min_value <=
        max_value` (TensorFlow's `clip_value_max`).
      name: TensorFlow's name for the operation: ignored.

    Returns:
      The clipped tree, with the structure, shapes and dtypes of `tree`.

    Raises:
      ValueError: if a bound is NaN, `min_value > max_value`, a bound does not
        broadcast to a leaf's shape, or a concrete bound of an integer leaf is
        not a whole number (naming the leaf).
      TypeError: if a bound is not real, a traced bound of an integer leaf has
        a float dtype, a leaf is bool, complex or not an array, or a peer's
        argument is given wrongly.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> clipax.tree.clip_by_value({"w": jnp.array([-3.0, 0.5, 7.0])}, -1.0, 2.0)
      {'w': Array([-1. ,  0.5,  2. ], dtype=float32)}
    """
    del name  # means nothing in JAX
    _checks.bounds(min_value, max_value)
    return clip_leaves(
        _checks.value_leaves(tree, "clip_by_value"), min_value, max_value
    )


def clip_leaves(
    leaves: _checks.Leaves, min_value: ArrayLike, max_value: ArrayLike
) -> chex.ArrayTree:
    """`clip_by_value` of checked `leaves`, with checked bounds."""
    shapes = (np.shape(min_value), np.shape(max_value))
    out = []
    for path, x in zip(leaves.paths, leaves.arrays, strict=True):
        try:
            shape = np.broadcast_shapes(x.shape, *shapes)
        except ValueError:
            shape = None
        if shape != tuple(x.shape):
            raise ValueError(
                f"`min_value` (shape {shapes[0]}) and `max_value` (shape "
                f"{shapes[1]}) must broadcast to the leaf at {_checks.path_str(path)}"
                f" with shape {tuple(x.shape)} without changing its shape."
            )
        dtype = jax.dtypes.canonicalize_dtype(x.dtype)  # as JAX holds the leaf
        if jnp.issubdtype(dtype, jnp.integer):
            for arg, bound in (("min_value", min_value), ("max_value", max_value)):
                _check_integer_bound(arg, bound, _checks.path_str(path), dtype)
        low = _bound_for(min_value, dtype, lower=True)
        high = _bound_for(max_value, dtype, lower=False)
        out.append(jnp.clip(jnp.asarray(x), low, high).astype(dtype))
    return leaves.rebuild(out)
