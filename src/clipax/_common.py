"""Checks and numerics shared by every clipping rule.

Each rule of the semantics page (docs/semantics.md) lives here once: how
arguments are validated, which dtype norms accumulate in, how a norm is taken,
and how a clip factor is formed and applied. The public functions in
`clipax.tree` and the transformations compose these pieces.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
KeyPath = tuple[Any, ...]

ORD_ACCEPTED = "1, 2, inf, or a real number p >= 1"
ORD_INF_NAMES = ("inf", "infinity")  # optax's and PyTorch's spellings
THRESHOLD_TYPES = "a real number, a NumPy or JAX scalar, or a traced value"
ARRAY_LEAVES = (
    "clipax takes trees of arrays (jax.Array, numpy.ndarray, NumPy scalars or "
    "Python numbers); use None or optax.MaskedNode for empty leaves"
)
PYTHON_NUMBERS = (bool, int, float, complex)
NORM_DTYPES = "float16, bfloat16, float32, float64 or complex"


def is_traced(value: Any) -> bool:
    """Whether `value` is an abstract value inside a JAX transformation."""
    return isinstance(value, jax.core.Tracer)


def path_str(path: KeyPath) -> str:
    """The leaf's path as `jax.tree_util.keystr` writes it; `<root>` for ()."""
    return jax.tree_util.keystr(path) if path else "<root>"


def as_array(leaf: Any) -> Any:
    """A Python number as a 0-d JAX array (as `jnp.asarray` makes it: float32
    for a float, int32 for an int, with x64 off); any other leaf as it is."""
    return jnp.asarray(leaf) if type(leaf) in PYTHON_NUMBERS else leaf


def as_arrays(tree: PyTree) -> PyTree:
    """`tree` with its Python-number leaves as 0-d JAX arrays (`as_array`)."""
    return jax.tree.map(as_array, tree)


def path_segments(path: KeyPath) -> list[str]:
    """A key path as strings: dict keys, attribute names, sequence indices."""
    out = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                out.append(str(getattr(key, attr)))
                break
        else:
            out.append(str(key))
    return out


def leaves_with_paths(tree: PyTree) -> list[tuple[KeyPath, Any]]:
    """The (path, leaf) pairs of `tree`, Python numbers as 0-d arrays; None and
    MaskedNode contribute none."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(path, as_array(leaf)) for path, leaf in flat]


def _array_dtype(path: KeyPath, leaf: Any) -> np.dtype:
    if not (hasattr(leaf, "dtype") and hasattr(leaf, "shape")):
        raise TypeError(
            f"The leaf at {path_str(path)} is a {type(leaf).__name__} "
            f"({short_repr(leaf)}); {ARRAY_LEAVES}."
        )
    return np.dtype(leaf.dtype)


def short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_inexact(dtype: np.dtype) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def check_norm_leaves(tree: PyTree, fn_name: str) -> list[tuple[KeyPath, Any]]:
    """Checks that every leaf is a float16, bfloat16, float32, float64 or
    complex array; returns the leaves.

    Raises:
      TypeError: naming the first leaf that is not an array, or whose dtype is
        integer, bool, not numeric, or a float narrower than 16 bits (float8).
    """
    flat = leaves_with_paths(tree)
    for path, leaf in flat:
        check_norm_leaf(path, leaf, fn_name)
    return flat


def check_norm_leaf(path: KeyPath, leaf: Any, fn_name: str) -> None:
    """`check_norm_leaves` for one leaf, at `path` in its tree."""
    dtype = _array_dtype(path, leaf)
    if not is_inexact(dtype):
        raise TypeError(
            f"`{fn_name}` takes norms of {NORM_DTYPES} leaves; the leaf at "
            f"{path_str(path)} has dtype {dtype}. Cast it to a float dtype, or "
            "leave it out of the clipped tree (None, optax.masked)."
        )
    if dtype.itemsize < 2 and not jnp.issubdtype(dtype, jnp.complexfloating):
        raise TypeError(  # float8, float4: no implicit promotion in JAX
            f"`{fn_name}` takes norms of {NORM_DTYPES} leaves; the leaf at "
            f"{path_str(path)} has dtype {dtype}, which JAX does not promote to "
            "float32 in arithmetic. Cast it (`x.astype(jnp.bfloat16)`), or "
            "leave it out of the clipped tree (None, optax.masked)."
        )


def check_value_leaves(tree: PyTree, fn_name: str) -> list[tuple[KeyPath, Any]]:
    """Checks that every leaf is a real integer or floating array."""
    flat = leaves_with_paths(tree)
    for path, leaf in flat:
        dtype = _array_dtype(path, leaf)
        real = jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
        if not real:
            raise TypeError(
                f"`{fn_name}` clamps real integer or floating-point leaves; the "
                f"leaf at {path_str(path)} has dtype {dtype}, which has no order "
                "to clamp in."
            )
    return flat


def accum_dtype(dtype: Any) -> np.dtype:
    """Float32, or float64 for 64-bit leaves: never float16 or bfloat16."""
    real = np.dtype(jnp.finfo(dtype).dtype)
    wide = real.itemsize >= 8 and jax.config.read("jax_enable_x64")
    return np.dtype(np.float64) if wide else np.dtype(np.float32)


def tree_accum_dtype(leaves: Sequence[Any]) -> np.dtype:
    """The widest accumulation dtype over `leaves` (float32 for no leaves)."""
    wide = any(accum_dtype(leaf.dtype).itemsize >= 8 for leaf in leaves)
    return np.dtype(jnp.float64) if wide else np.dtype(jnp.float32)


# Arguments.


STATIC_HINT = (
    "it must be known when the function is traced; under "
    "`optax.inject_hyperparams`, name it in `static_args`"
)


def check_ord(ord: Any) -> float:
    """Returns `ord` as a float p >= 1 (inf allowed; None means 2).

    The strings `"inf"` and `"infinity"` (any case) mean inf, as in
    `optax.tree.norm` and PyTorch's `norm_type`.

    Raises:
      TypeError: if `ord` is a traced value.
      ValueError: if `ord` is not accepted.
    """
    if ord is None:
        return 2.0
    if isinstance(ord, str) and ord.lower() in ORD_INF_NAMES:
        return math.inf
    if is_traced(ord):
        raise TypeError(f"`ord` got a traced value; {STATIC_HINT}.")
    real_array = (
        isinstance(ord, (jax.Array, np.ndarray))
        and ord.ndim == 0
        and (
            jnp.issubdtype(ord.dtype, jnp.floating)
            or jnp.issubdtype(ord.dtype, jnp.integer)
        )
    )
    real_number = isinstance(ord, numbers.Real) and not isinstance(ord, bool)
    p = float(ord) if real_number or real_array else math.nan
    if math.isnan(p) or p < 1:
        raise ValueError(f"`ord` must be {ORD_ACCEPTED}; got {short_repr(ord)}.")
    return p


def concrete_real(name: str, value: Any, accepted: str) -> np.ndarray:
    """`value` as a float64 NumPy array, or TypeError when it is not real."""
    if value is None or isinstance(value, (str, bytes, bool)):
        raise TypeError(f"`{name}` must be {accepted}; got {value!r}.")
    if isinstance(value, int):  # any size: 2**70 is an object array to NumPy
        return np.asarray(int_as_float(value))
    try:
        array = np.asarray(value)
    except Exception as error:  # anything NumPy cannot read as an array
        raise TypeError(
            f"`{name}` must be {accepted}; got {short_repr(value)} of type "
            f"{type(value).__name__}."
        ) from error
    numeric = jnp.issubdtype(array.dtype, jnp.floating) or jnp.issubdtype(
        array.dtype, jnp.integer
    )
    if not numeric or array.dtype == np.bool_:
        raise TypeError(
            f"`{name}` must be {accepted}; got {short_repr(value)} with dtype "
            f"{array.dtype}."
        )
    return array.astype(np.float64)


def int_as_float(value: int) -> float:
    """A Python int as the nearest float64; +-inf past float64's range."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def check_scalar(
    name: str,
    value: Any,
    accepted: str,
    *,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """A real scalar argument within [low, high] (either end open), unless
    traced (a traced value is not checked).

    Raises:
      TypeError: if `value` is not a real number or array (`concrete_real`).
      ValueError: naming `name`, saying it must be `accepted`, and showing
        the value (or the shape of an array), if it is not a scalar, is NaN,
        or lies outside the bounds.
    """
    if is_traced(value):
        return
    array = concrete_real(name, value, accepted)
    if array.ndim != 0:
        raise ValueError(
            f"`{name}` must be {accepted}; got an array of shape {array.shape}."
        )
    above = array > low if low_open else array >= low
    below = array < high if high_open else array <= high
    if not (above and below):  # NaN is neither
        raise ValueError(f"`{name}` must be {accepted}; got {short_repr(value)}.")


def check_max_norm(name: str, value: Any) -> None:
    """A norm threshold: a positive scalar (inf allowed), unless traced."""
    accepted = f"a positive scalar ({THRESHOLD_TYPES}); inf means no clipping"
    check_scalar(name, value, accepted, low=0, low_open=True)


def check_use_norm(value: Any) -> None:
    """A norm given in place of the computed one: a scalar >= 0, unless traced."""
    if value is not None:
        accepted = f"None or a scalar norm >= 0 ({THRESHOLD_TYPES})"
        check_scalar("use_norm", value, accepted, low=0)


def check_bounds(min_value: Any, max_value: Any) -> None:
    """Value-clipping bounds: real scalars or arrays, min <= max where concrete."""
    accepted = f"{THRESHOLD_TYPES}, or an array that broadcasts to the leaves"
    arrays = {}
    for name, value in (("min_value", min_value), ("max_value", max_value)):
        if is_traced(value):
            continue
        array = concrete_real(name, value, accepted)
        if np.isnan(array).any():
            raise ValueError(f"`{name}` must not be NaN; got {short_repr(value)}.")
        arrays[name] = array
    if len(arrays) == 2:
        low, high = arrays["min_value"], arrays["max_value"]
        try:
            crossed = bool(np.any(low > high))
        except ValueError as error:  # shapes that do not broadcast together
            raise ValueError(
                f"`min_value` (shape {low.shape}) and `max_value` (shape "
                f"{high.shape}) must broadcast together."
            ) from error
        if crossed:
            raise ValueError(
                "`min_value` must be <= `max_value`; got min_value="
                f"{short_repr(min_value)} and max_value={short_repr(max_value)}."
            )


def normalize_axes(axes: Any) -> tuple[int, ...] | None:
    """`axes` as a tuple of ints (None for all axes); checks type and repeats."""
    if axes is None:
        return None
    if is_traced(axes):
        raise TypeError(f"`axes` got a traced value; {STATIC_HINT}.")
    accepted = "None, an int, or a sequence of distinct ints"
    if isinstance(axes, (jax.Array, np.ndarray)):  # e.g. from inject_hyperparams
        if axes.ndim > 1 or not jnp.issubdtype(axes.dtype, jnp.integer):
            raise ValueError(f"`axes` must be {accepted}; got {short_repr(axes)}.")
        axes = tuple(int(a) for a in np.asarray(axes).reshape(-1))
    items = (axes,) if isinstance(axes, numbers.Integral) else axes
    try:
        items = tuple(items)
    except TypeError as error:
        raise ValueError(f"`axes` must be {accepted}; got {axes!r}.") from error
    if not all(
        isinstance(a, numbers.Integral) and not isinstance(a, bool) for a in items
    ):
        raise ValueError(f"`axes` must be {accepted}; got {axes!r}.")
    items = tuple(int(a) for a in items)
    if len(set(items)) != len(items):
        raise ValueError(f"`axes` must be {accepted}; got repeated axes in {axes!r}.")
    return items


def leaf_axes(
    axes: tuple[int, ...] | None, path: KeyPath, shape: tuple[int, ...]
) -> tuple[int, ...]:
    """`axes` resolved for one leaf of `shape`; ValueError naming the leaf."""
    ndim = len(shape)
    if axes is None:
        return tuple(range(ndim))
    if any(not -ndim <= a < ndim for a in axes):
        raise ValueError(
            f"`axes`={axes} is out of range for the leaf at {path_str(path)} with "
            f"shape {shape} (rank {ndim})."
        )
    resolved = tuple(a % ndim for a in axes)
    if len(set(resolved)) != len(resolved):
        raise ValueError(
            f"`axes`={axes} names the same axis twice for the leaf at "
            f"{path_str(path)} with shape {shape}."
        )
    return resolved


# Numerics.


def powers(x: jax.Array, p: float) -> jax.Array:
    """|x|**p element by element (|x| for p = inf), in float32 or wider.

    Complex leaves count |x|, taken without overflow.
    """
    acc = accum_dtype(x.dtype)
    if jnp.iscomplexobj(x):
        re, im = x.real.astype(acc), x.imag.astype(acc)
        if p == 2:
            return jnp.square(re) + jnp.square(im)
        magnitude = _hypot(re, im)
    else:
        real = x.astype(acc)
        if p == 2:
            return jnp.square(real)
        magnitude = jnp.abs(real)
    if p in (1.0, math.inf):
        return magnitude
    return magnitude**p


def scale_by(x: jax.Array, factor: jax.Array) -> jax.Array:
    """`x * factor` for a real `factor`; a complex `x` has its real and
    imaginary parts scaled apart (a complex product makes the imaginary part
    of `inf + 0j` inf * 0 = NaN)."""
    if jnp.iscomplexobj(x):
        return jax.lax.complex(x.real * factor, x.imag * factor)
    return x * factor


def power_sum(x: jax.Array, p: float, axes: tuple[int, ...] | None = None) -> jax.Array:
    """Sum of |x|**p over `axes` (max |x| for p = inf), kept dims, float32+.

    With `axes=None` the result is a scalar. Zero-size inputs give 0.
    """
    keep = axes is not None
    if p == math.inf:
        return jnp.max(powers(x, p), axis=axes, keepdims=keep, initial=0.0)
    return jnp.sum(powers(x, p), axis=axes, keepdims=keep)


def _hypot(re: jax.Array, im: jax.Array) -> jax.Array:
    """|re + i im| without overflow or underflow, with a finite gradient at 0."""
    big = jnp.maximum(jnp.abs(re), jnp.abs(im))
    small = jnp.minimum(jnp.abs(re), jnp.abs(im))
    zero = big == 0
    ratio = small / jnp.where(zero, jnp.ones_like(big), big)
    return jnp.where(zero, jnp.zeros_like(big), big * jnp.sqrt(1 + jnp.square(ratio)))


@jax.custom_jvp
def divide(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a / b` whose derivative is `(da - (a / b) db) / b`.

    Plain division differentiates through `b**-2`, which overflows for
    |b| < 1e-19 in float32 although the derivative itself is representable.
    """
    return a / b


@divide.defjvp
def _divide_jvp(primals: tuple, tangents: tuple) -> tuple[jax.Array, jax.Array]:
    a, b = primals
    da, db = tangents
    out = a / b
    return out, (da - out * db) / b


def safe_root(total: jax.Array, p: float) -> jax.Array:
    """`total ** (1/p)` whose gradient at 0 is 0, not inf or NaN.

    NaN and inf pass through unchanged, so a broken norm stays visible.
    """
    if p in (1.0, math.inf):
        return total
    zero = total == 0
    base = jnp.where(zero, jnp.ones_like(total), total)
    root = jnp.sqrt(base) if p == 2 else base ** (1.0 / p)
    return jnp.where(zero, jnp.zeros_like(total), root)


@jax.custom_jvp
def sqrt(total: jax.Array) -> jax.Array:
    """`jnp.sqrt` whose derivative at 0 is 0, not inf (the derivative of a
    norm at a zero tensor, where `safe_root`'s selects would cost a kernel)."""
    return jnp.sqrt(total)


@sqrt.defjvp
def _sqrt_jvp(primals: tuple, tangents: tuple) -> tuple[jax.Array, jax.Array]:
    (total,), (dtotal,) = primals, tangents
    root = jnp.sqrt(total)
    positive = total > 0
    slope = 0.5 / jnp.where(positive, root, jnp.ones_like(root))
    return root, jnp.where(positive, slope * dtotal, jnp.zeros_like(dtotal))


def clip_scale(norm: jax.Array, max_norm: Any) -> jax.Array:
    """The factor `max_norm / max(norm, max_norm)`, in the norm's dtype.

    The rules: exactly 1 when `norm <= max_norm` (a zero norm never divides);
    NaN when the norm or `max_norm` is NaN, or the norm inf; 0 when a traced
    `max_norm` is <= 0 (every tree then comes out as zeros). Differentiable,
    with finite gradients wherever the norm is finite (at an infinite norm,
    whose factor is NaN, so is its derivative). A factor below the smallest
    normal float (1.2e-38 in float32: `max_norm` under 1e-38 times the norm)
    is flushed to 0 by XLA's CPU backend; XLA's GPU backend keeps such
    subnormal factors.
    """
    return scale_from_terms(norm, threshold_terms(max_norm, norm.dtype))


def threshold_terms(max_norm: Any, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """The numerator and the denominator's floor of `clip_scale`, taken once
    per threshold t: max(t, 0) and max(t, tiny), t capped at the largest
    float (an inf threshold clips nothing: largest / largest = 1)."""
    info = np.finfo(dtype)
    threshold = jnp.minimum(jnp.asarray(max_norm).astype(dtype), info.max)
    return jnp.maximum(threshold, 0), jnp.maximum(threshold, info.tiny)


def scale_from_terms(norm: jax.Array, terms: tuple[jax.Array, jax.Array]) -> jax.Array:
    """`clip_scale` of `norm`, given `threshold_terms` of its threshold.

    Four operations per norm, for XLA's compile time grows with each of them
    times every leaf in per-tensor rules (benchmarks/RESULTS.md): `norm * 0`
    is 0, or NaN for an inf or NaN norm; at or below the threshold the
    quotient is t / t = 1 exactly; the floor keeps it from being 0 / 0 for a
    threshold <= 0.
    """
    numerator, floor = terms
    return divide(numerator + norm * 0, jnp.maximum(norm, floor))


def apply_scale(x: jax.Array, scale: jax.Array) -> jax.Array:
    """`x * scale`, computed in the wider of the two dtypes, cast back to x's."""
    # The leaf's dtype as JAX holds it: NumPy float64 leaves are float32 when
    # x64 is off, and asking for float64 would only warn.
    x = as_array(x)
    return (x * scale).astype(jax.dtypes.canonicalize_dtype(x.dtype))
