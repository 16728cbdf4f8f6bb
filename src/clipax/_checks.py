"""Argument checks: what each public entry takes, checked once, one message per mistake.

A factory or function checks its arguments here and passes inward only
normalised values (a concrete threshold as a float, `ord` as a float, `axes`
as a tuple, a mesh-axis name as a tuple). The peers' names for arguments are
taken here too (`peer_names`). Leaves are checked where they are read, in
`_leaves`.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeGuard, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np

F = TypeVar("F", bound=Callable[..., Any])

THRESHOLD_TYPES = "a real number, a NumPy or JAX scalar, or a traced value"
POSITIVE = f"a positive scalar ({THRESHOLD_TYPES}); inf means no clipping"
ORD_ACCEPTED = "1, 2, inf, or a real number p >= 1"
STATIC_HINT = (
    "it must be known when the function is traced; under "
    "`optax.inject_hyperparams`, name it in `static_args`"
)
INT32_MAX = 2**31 - 1  # counts meet the states' int32 counters
NONFINITE_MODES = ("nan", "zero", "error")
NO_HOST = (
    "`nonfinite`='error' checks the norm on the host through "
    "`jax.debug.callback`, which needs a CPU backend, and JAX has none here "
    "(JAX_PLATFORMS={platforms!r}). Add cpu to the platforms (for example "
    "JAX_PLATFORMS=cuda,cpu), or use nonfinite='nan' or 'zero' with "
    "`optax.apply_if_finite` or the state's `nonfinite_count`."
)


def is_traced(value: Any) -> bool:
    """Whether `value` is an abstract value inside a JAX transformation."""
    return isinstance(value, jax.core.Tracer)


def is_data(value: Any) -> TypeGuard[jax.Array]:
    """Whether `value` is a JAX array, traced or not: data, which the rules
    take as it is (docs/semantics.md, "Thresholds"); a Python or NumPy value
    is configuration, checked where it is given."""
    return isinstance(value, jax.Array)


def is_int(value: Any) -> bool:
    """Whether `value` is a Python or NumPy int, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _real_dtype(dtype: Any) -> bool:
    return dtype != np.bool_ and (
        jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
    )


def int_as_float(value: int) -> float:
    """A Python int as the nearest float64; +-inf past float64's range."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def real_array(name: str, value: Any, accepted: str) -> np.ndarray:
    """A concrete real `value` as a float64 NumPy array (a Python int of any
    size as the nearest float, +-inf past float64's range).

    Raises:
      TypeError: naming `name`, if `value` is not a real number or array.
    """
    if value is None or isinstance(value, (str, bytes, bool)):
        raise TypeError(f"`{name}` must be {accepted}; got {value!r}.")
    if isinstance(value, int):  # 2**70 is an object array to NumPy
        return np.asarray(int_as_float(value))
    try:
        array = np.asarray(value)
    except Exception as error:  # anything NumPy cannot read as an array
        raise TypeError(
            f"`{name}` must be {accepted}; got {short_repr(value)} of type "
            f"{type(value).__name__}."
        ) from error
    if not _real_dtype(array.dtype):
        raise TypeError(
            f"`{name}` must be {accepted}; got {short_repr(value)} with dtype "
            f"{array.dtype}."
        )
    return array.astype(np.float64)


def jax_number(
    name: str, value: jax.Array, accepted: str, *, scalar: bool = True
) -> None:
    """A JAX array where a number belongs: a real dtype and, for a scalar, no
    dimensions (both known when traced); its values are not read."""
    if not _real_dtype(value.dtype):
        raise TypeError(
            f"`{name}` must be {accepted}; got an array of dtype {value.dtype}."
        )
    if scalar and value.ndim != 0:
        raise ValueError(
            f"`{name}` must be {accepted}; got an array of shape {value.shape}."
        )


def number(
    name: str,
    value: Any,
    accepted: str,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
) -> Any:
    """A real scalar in [low, high] (either end open), returned as a float; a
    JAX array (data) is checked for its dtype and shape only, and returned.

    Raises:
      TypeError: if `value` is not real.
      ValueError: naming `name` and showing the value (or an array's shape),
        if it is not a scalar, is NaN, or lies outside the bounds.
    """
    if is_data(value):
        jax_number(name, value, accepted)
        return value
    array = real_array(name, value, accepted)
    if array.ndim != 0:
        raise ValueError(
            f"`{name}` must be {accepted}; got an array of shape {array.shape}."
        )
    above = array > low if low_open else array >= low
    below = array < high if high_open else array <= high
    if not (above and below):  # NaN is neither
        raise ValueError(f"`{name}` must be {accepted}; got {short_repr(value)}.")
    return float(array)


def threshold(name: str, value: Any) -> Any:
    """A norm threshold: a positive scalar, inf allowed."""
    return number(name, value, POSITIVE, low=0, low_open=True)


def nonnegative(name: str, value: Any, accepted: str) -> Any:
    """A scalar >= 0, inf allowed."""
    return number(name, value, f"{accepted} ({THRESHOLD_TYPES})", low=0)


def unit(name: str, value: Any) -> Any:
    """A real number strictly between 0 and 1."""
    accepted = "a real number strictly between 0 and 1"
    return number(name, value, accepted, low=0, high=1, low_open=True, high_open=True)


def positive(name: str, value: Any, *, inf_ok: bool = False) -> Any:
    """A real number > 0, finite unless `inf_ok`."""
    accepted = "a real number > 0 or inf" if inf_ok else "a finite real number > 0"
    return number(name, value, accepted, low=0, low_open=True, high_open=not inf_ok)


def integer(name: str, value: Any, minimum: int = 1, *, data_ok: bool = False) -> Any:
    """An int in [`minimum`, 2**31 - 1] (a Python or NumPy int, or a concrete
    0-d integer array), returned as an int; with `data_ok` (a count that is
    only compared with), a JAX integer scalar is data, returned as it is.

    Raises:
      TypeError: if `value` is traced and not `data_ok` (it sets a shape).
      ValueError: if `value` is not such an int.
    """
    accepted = f"an int >= {minimum}"
    if data_ok and is_data(value):
        jax_number(name, value, accepted)
        if not jnp.issubdtype(value.dtype, jnp.integer):
            raise TypeError(
                f"`{name}` must be {accepted}; got an array of dtype {value.dtype}."
            )
        return value
    if is_traced(value):
        raise TypeError(f"`{name}` got a traced value; {STATIC_HINT}.")
    if isinstance(value, (jax.Array, np.ndarray)) and value.ndim == 0:
        value = value.item() if jnp.issubdtype(value.dtype, jnp.integer) else value
    if not is_int(value) or value < minimum:
        raise ValueError(f"`{name}` must be {accepted}; got {short_repr(value)}.")
    if value > INT32_MAX:
        raise ValueError(
            f"`{name}` must be an int <= {INT32_MAX} (2**31 - 1, the limit of the "
            f"int32 step counters); got {value!r}."
        )
    return int(value)


def flag(name: str, value: Any) -> bool:
    """True or False (a Python or NumPy bool)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be True or False; got {short_repr(value)}.")
    return bool(value)


def order(value: Any) -> float:
    """A norm's order as a float p >= 1 (inf allowed; None means 2). The
    strings `"inf"` and `"infinity"` (any case) mean inf, as in
    `optax.tree.norm` and PyTorch's `norm_type`.

    Raises:
      TypeError: if `value` is traced.
      ValueError: if `value` is not accepted.
    """
    if value is None:
        return 2.0
    if isinstance(value, str) and value.lower() in ("inf", "infinity"):
        return math.inf
    if is_traced(value):
        raise TypeError(f"`ord` got a traced value; {STATIC_HINT}.")
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if isinstance(value, (jax.Array, np.ndarray)):
        real = value.ndim == 0 and _real_dtype(value.dtype)
    p = float(value) if real else math.nan
    if math.isnan(p) or p < 1:
        raise ValueError(f"`ord` must be {ORD_ACCEPTED}; got {short_repr(value)}.")
    return p


def axes(value: Any, name: str = "axes") -> tuple[int, ...] | None:
    """`value` as a tuple of distinct ints, or None (all axes); each leaf
    resolves them against its shape (`_leaves.Leaf.within`).

    Raises:
      TypeError: if `value` is traced.
      ValueError: if it is not None, an int or a sequence of distinct ints.
    """
    if value is None:
        return None
    if is_traced(value):
        raise TypeError(f"`{name}` got a traced value; {STATIC_HINT}.")
    accepted = "None, an int, or a sequence of distinct ints"
    items = value
    if isinstance(value, (jax.Array, np.ndarray)):  # from inject_hyperparams
        if value.ndim > 1 or not jnp.issubdtype(value.dtype, jnp.integer):
            raise ValueError(f"`{name}` must be {accepted}; got {short_repr(value)}.")
        items = np.asarray(value).reshape(-1).tolist()
    elif isinstance(value, numbers.Integral):
        items = (value,)
    if not (
        isinstance(items, Sequence)
        and not isinstance(items, str)
        and all(map(is_int, items))
    ):
        raise ValueError(f"`{name}` must be {accepted}; got {value!r}.")
    if len(set(items)) != len(items):
        raise ValueError(
            f"`{name}` must be {accepted}; got repeated axes in {value!r}."
        )
    return tuple(int(a) for a in items)


def axis_name(value: Any) -> tuple[str, ...]:
    """A mesh-axis name, or a sequence of them, as a tuple; () for None."""
    if value is None:
        return ()
    names = (value,) if isinstance(value, str) else value
    if not (
        isinstance(names, (tuple, list))
        and names
        and all(isinstance(n, str) and n for n in names)
    ):
        raise ValueError(
            "`axis_name` must be None, a mesh-axis name, or a sequence of names; "
            f"got {value!r}."
        )
    return tuple(names)


def axes_and_axis_name(
    axes_value: Any, axis_name_value: Any, stacked: Any = None
) -> tuple[tuple[int, ...] | None, tuple[str, ...]]:
    """`axes` and `axis_name`, which cannot be given together, nor
    `axis_name` with `stacked`: a norm over some of a leaf's dimensions
    must know which are split."""
    resolved, names = axes(axes_value), axis_name(axis_name_value)
    if names and (resolved is not None or stacked is not None):
        given = f"`axes`={resolved}" if resolved is not None else "`stacked`"
        raise ValueError(
            f"`axis_name` cannot be combined with {given}: it says that every "
            "leaf is split, but not along which dimension; give `specs` instead."
        )
    return resolved, names


def key_paths(name: str, value: Any, separator: str) -> list[tuple[str, ...]]:
    """A sequence of non-empty `separator`-joined key paths, as their keys."""
    if (
        isinstance(value, str)
        or not isinstance(value, Sequence)
        or not all(isinstance(p, str) and p.strip(separator) for p in value)
    ):
        raise ValueError(
            f"`{name}` must be a sequence of non-empty {separator!r}-separated key "
            f"paths; got {value!r}."
        )
    return [tuple(p.strip(separator).split(separator)) for p in value]


def choice(name: str, value: Any, options: Sequence[Any]) -> Any:
    """One of `options` (strings or ints), of its type."""
    if not any(type(value) is type(o) and value == o for o in options):
        names = [f'"{o}"' if isinstance(o, str) else str(o) for o in options]
        spelled = ", ".join(names[:-1]) + f" or {names[-1]}"
        raise ValueError(f"`{name}` must be {spelled}; got {value!r}.")
    return value


def unused(value: Any, default: Any, message: str) -> None:
    """An argument that means nothing with the others given keeps its default
    (data is not read); `message` has a `{value}` field."""
    if not is_data(value) and np.any(np.asarray(value) != default):
        raise ValueError(message.format(value=short_repr(value)))


def nonfinite(value: Any, modes: tuple[Any, ...] = NONFINITE_MODES) -> Any:
    """The mode `value` names, one of `modes`; True and False (PyTorch's
    `error_if_nonfinite`) are `"error"` and `modes[0]`. `"error"` checks the
    norm on the host, which needs JAX's CPU backend."""
    if value is True or value is False:
        value = "error" if value else modes[0]
    if not (value is None or isinstance(value, str)) or value not in modes:
        raise ValueError(
            f"`nonfinite` must be one of {modes}, or a bool as PyTorch's "
            f"`error_if_nonfinite` (True is 'error', False {modes[0]!r}); got "
            f"{short_repr(value)}."
        )
    if value == "error":  # refused where it is asked for, not at the first step
        try:
            jax.local_devices(backend="cpu")
        except RuntimeError as error:
            platforms = getattr(jax.config, "jax_platforms", None)
            raise ValueError(NO_HOST.format(platforms=platforms)) from error
    return value


def bounds(min_value: Any, max_value: Any) -> None:
    """Value-clipping bounds: real scalars or arrays, min <= max where concrete."""
    accepted = f"{THRESHOLD_TYPES}, or an array that broadcasts to the leaves"
    arrays = {}
    for name, value in (("min_value", min_value), ("max_value", max_value)):
        if is_data(value):
            jax_number(name, value, accepted, scalar=False)
            continue
        arrays[name] = real_array(name, value, accepted)
        if np.isnan(arrays[name]).any():
            raise ValueError(f"`{name}` must not be NaN; got {short_repr(value)}.")
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


def is_transformation(value: Any) -> bool:
    """Whether `value` has an `init` and an `update` to call, as a transformation."""
    return all(callable(getattr(value, f, None)) for f in ("init", "update"))


def transformation(name: str, value: Any) -> None:
    """An `optax.GradientTransformation` (anything with `init` and `update`)."""
    if not is_transformation(value):
        raise TypeError(
            f"`{name}` must be an optax.GradientTransformation; got "
            f"{type(value).__name__}."
        )


def not_a_tree(fn_name: str, name: str, value: Any, tree_call: str) -> None:
    """A factory's number given a tree of arrays, as the function of the same
    name in `clipax.tree` takes first: a `TypeError` that says so."""
    if isinstance(value, Mapping) or (
        not jax.tree_util.treedef_is_leaf(jax.tree.structure(value))
        and any(isinstance(x, (jax.Array, np.ndarray)) for x in jax.tree.leaves(value))
    ):
        raise TypeError(
            f"`{fn_name}` makes an Optax transformation, and its `{name}` "
            f"is a number; got a tree ({short_repr(value)}). To clip a tree of "
            f"gradients directly, call `{tree_call}`."
        )


def peer_names(
    aliases: Mapping[str, str] | None = None, tree_call: str | None = None
) -> Callable[[F], F]:
    """Makes a public function take its peers' argument names: `aliases` maps
    each peer's name for a parameter to the parameter (both given: a
    `TypeError`), and TensorFlow's `name` and PyTorch's `foreach`, which mean
    nothing in JAX, are accepted and dropped. For a transformation named as a
    function of `clipax.tree`, `tree_call` says how to call that function,
    which a tree given as the first argument is pointed to (`not_a_tree`).
    The function keeps its signature (`optax.inject_hyperparams` reads it).
    """
    aliases = dict(aliases or {})

    def decorate(fn: F) -> F:
        names = list(inspect.signature(fn).parameters)
        fn_name = f"clipax.{'tree.' if '.tree.' in fn.__module__ else ''}{fn.__name__}"

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if tree_call is not None and args:
                not_a_tree(fn_name, names[0], args[0], tree_call)
            for alias in [a for a in aliases if a in kwargs]:
                own = aliases[alias]
                given = [n for n, o in aliases.items() if o == own and n in kwargs]
                if own in kwargs or names.index(own) < len(args):
                    given.insert(0, own)
                if len(given) > 1:
                    spelled = " and ".join(f"`{n}`" for n in given)
                    raise TypeError(
                        f"`{fn_name}` got {spelled}, which name the same argument "
                        f"(`{own}`); pass one of them."
                    )
                kwargs[own] = kwargs.pop(alias)
            for ignored in {"name", "foreach"}.difference(names):
                kwargs.pop(ignored, None)
            return fn(*args, **kwargs)

        return cast(F, wrapper)

    return decorate
