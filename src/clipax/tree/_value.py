"""Element-wise value clipping of a pytree."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from clipax import _checks, _leaves

INTEGER_BOUND = (
    "an integer leaf is clamped in its own dtype, so its bounds must be whole "
    "numbers (values past the dtype's range and +-inf saturate)"
)


def _bound(name: str, bound: ArrayLike, path: str, dtype: np.dtype) -> ArrayLike:
    """`bound` in a leaf's dtype, never rounded: for an integer leaf it must
    be whole, and saturates past the dtype's range; for a float leaf it is
    rounded as a cast rounds, and saturates to the largest finite value in a
    dtype with no inf (`float8_e4m3fn`, where the cast would give NaN). A
    concrete bound is converted on the host, so no value passes through JAX's
    default dtypes (with x64 off, `jnp.asarray(np.int64(2**40))` wraps to 0).

    Raises:
      ValueError: for a concrete bound of an integer leaf with a fraction.
      TypeError: for a JAX array bound of a floating dtype and an integer
        leaf (data, whose values are not read).
    """
    integer = jnp.issubdtype(dtype, jnp.integer)
    info = np.iinfo(dtype) if integer else jnp.finfo(dtype)
    saturate = integer or not np.isinf(np.asarray(np.inf).astype(dtype))
    if _checks.is_data(bound):
        if integer and not jnp.issubdtype(bound.dtype, jnp.integer):
            kind = "traced " if _checks.is_traced(bound) else ""
            raise TypeError(
                f"`{name}` is a {kind}{bound.dtype} array and the leaf at {path} has "
                f"dtype {dtype}: {INTEGER_BOUND}, which a float array is not checked "
                "to be. Pass an integer-dtype bound, or cast the leaf to a float dtype."
            )
        if integer:  # within both dtypes' ranges, so the clip is exact
            own = np.iinfo(bound.dtype)
            bound = jnp.clip(bound, max(info.min, own.min), min(info.max, own.max))
        elif saturate:
            bound = jnp.clip(bound, -float(info.max), float(info.max))
        return jnp.asarray(bound).astype(dtype)
    if isinstance(bound, int):  # any size: 10**400 is no float64
        if integer:
            return np.asarray(min(max(bound, int(info.min)), int(info.max)), dtype)
        bound = _checks.int_as_float(bound)
    array = np.asarray(bound)
    if integer and array.dtype.kind not in "iu":
        values = array.astype(np.float64)
        finite = values[np.isfinite(values)]
        if np.any(finite != np.round(finite)):
            raise ValueError(
                f"`{name}`={_checks.short_repr(bound)} cannot bound the leaf at "
                f"{path} (dtype {dtype}) exactly: {INTEGER_BOUND}. Round the bound "
                "yourself (`math.floor`/`math.ceil`), or cast the leaf to a float "
                "dtype."
            )
    if integer:  # NumPy compares with Python ints exactly; float(max) rounds up
        top = info.max if array.dtype.kind in "iu" else float(info.max)
        above, below = array >= top, array <= info.min
        out = np.where(above | below, 0, array).astype(dtype)
        np.putmask(out, above, info.max)
        np.putmask(out, below, info.min)
        return out
    if saturate:
        array = np.clip(array.astype(np.float64), -float(info.max), float(info.max))
    with np.errstate(over="ignore"):  # overflowing to +-inf is the rule here
        return array.astype(dtype)


@_checks.peer_names(
    {"t": "tree", "clip_value_min": "min_value", "clip_value_max": "max_value"}
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
    return clip_leaves(tree, min_value, max_value)


def clip_leaves(
    tree: chex.ArrayTree, min_value: ArrayLike | None, max_value: ArrayLike
) -> chex.ArrayTree:
    """`clip_by_value` of `tree`, with checked bounds; a None `min_value` is
    `-max_value` (>= 0), negated in each leaf's dtype, where it is exact."""
    leaves = _leaves.leaves(tree, "clip_by_value", kind="value")
    low_shape = () if min_value is None else np.shape(min_value)
    shapes = (low_shape, np.shape(max_value))
    out = []
    for path, x in ((leaf.path, leaf.x) for leaf in leaves):
        try:
            shape = np.broadcast_shapes(x.shape, *shapes)
        except ValueError:
            shape = None
        if shape != tuple(x.shape):
            raise ValueError(
                f"`min_value` (shape {shapes[0]}) and `max_value` (shape "
                f"{shapes[1]}) must broadcast to the leaf at {_leaves.path_str(path)}"
                f" with shape {tuple(x.shape)} without changing its shape."
            )
        dtype = jax.dtypes.canonicalize_dtype(x.dtype)  # as JAX holds the leaf
        where = _leaves.path_str(path)
        low = (
            None if min_value is None else _bound("min_value", min_value, where, dtype)
        )
        high = _bound("max_value", max_value, where, dtype)
        if min_value is None and not jnp.issubdtype(dtype, jnp.unsignedinteger):
            low = jnp.negative(high)  # exact: |min| >= max in a signed dtype
        out.append(jnp.clip(jnp.asarray(x), low, high).astype(dtype))
    return leaves.rebuild(out)
