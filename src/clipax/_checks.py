"""Arguments and leaves: every check a public entry makes, once, with its message.

A public function or factory checks what it is given with these functions and
passes inward only normalised values: an `ord` as a float, `axes` as a tuple,
a mesh-axis name as a tuple of names, a tree's leaves as `Leaves`. The peers'
argument names (`peer_names`) are taken here too.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeGuard, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any
KeyPath = tuple[Any, ...]
F = TypeVar("F", bound=Callable[..., Any])

THRESHOLD_TYPES = "a real number, a NumPy or JAX scalar, or a traced value"
NORM_DTYPES = "float16, bfloat16, float32, float64 or complex"
ORD_ACCEPTED = "1, 2, inf, or a real number p >= 1"
ORD_INF_NAMES = ("inf", "infinity")  # optax's and PyTorch's spellings
ARRAY_LEAVES = (
    "clipax takes trees of arrays (jax.Array, numpy.ndarray, NumPy scalars or "
    "Python numbers); use None or optax.MaskedNode for empty leaves"
)
STATIC_HINT = (
    "it must be known when the function is traced; under "
    "`optax.inject_hyperparams`, name it in `static_args`"
)
INT32_MAX = 2**31 - 1  # counts meet the states' int32 counters
PYTHON_NUMBERS = (bool, int, float, complex)


def is_traced(value: Any) -> bool:
    """Whether `value` is an abstract value inside a JAX transformation."""
    return isinstance(value, jax.core.Tracer)


def short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def path_str(path: KeyPath) -> str:
    """A key path as `jax.tree_util.keystr` writes it; `<root>` for ()."""
    return jax.tree_util.keystr(path) if path else "<root>"


def path_keys(path: KeyPath) -> list[str]:
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


# Leaves.


@dataclasses.dataclass(frozen=True)
class Leaves:
    """A tree's leaves with their key paths, Python numbers as 0-d arrays.

    None and `optax.MaskedNode` are no leaves: `rebuild` puts them back.
    `stacked` gives, per leaf, how many leading axes index stacked layers
    (`stacking`), and `depths` after how many of its path keys the layer
    index goes in a key; both empty when no `stacked` was given.
    """

    paths: list[KeyPath]
    arrays: list[Any]
    treedef: Any
    stacked: tuple[int, ...] = ()
    depths: tuple[int, ...] = ()

    def rebuild(self, arrays: Sequence[Any]) -> PyTree:
        return jax.tree.unflatten(self.treedef, arrays)

    def stacked_axes(self, i: int) -> int:
        """How many leading axes of leaf `i` index stacked layers."""
        return self.stacked[i] if self.stacked else 0

    def layers(self, i: int) -> tuple[int, ...]:
        """The shape of leaf `i`'s stacked axes (() for a leaf not stacked)."""
        return tuple(self.arrays[i].shape[: self.stacked_axes(i)])

    def inner(self, i: int) -> tuple[int, ...]:
        """Leaf `i`'s axes within one layer."""
        return tuple(range(self.stacked_axes(i), self.arrays[i].ndim))


def _array(x: Any) -> Any:
    """A Python number as a 0-d JAX array; anything else as it is."""
    return jnp.asarray(x) if type(x) in PYTHON_NUMBERS else x


def leaves(tree: PyTree) -> Leaves:
    """`tree`'s leaves, unchecked (Python numbers as 0-d JAX arrays)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    arrays = [_array(x) for _, x in flat]
    return Leaves([path for path, _ in flat], arrays, treedef)


def _dtype(path: KeyPath, leaf: Any) -> np.dtype:
    if not (hasattr(leaf, "dtype") and hasattr(leaf, "shape")):
        raise TypeError(
            f"The leaf at {path_str(path)} is a {type(leaf).__name__} "
            f"({short_repr(leaf)}); {ARRAY_LEAVES}."
        )
    return np.dtype(leaf.dtype)


def norm_leaf(path: KeyPath, leaf: Any, fn_name: str) -> None:
    """A leaf that has a norm: float16 or wider, or complex.

    Raises:
      TypeError: naming the leaf, if it is not an array, or its dtype is
        integer, bool, not numeric, or a float narrower than 16 bits.
    """
    dtype = _dtype(path, leaf)
    if not jnp.issubdtype(dtype, jnp.inexact):
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


def norm_leaves(tree: PyTree, fn_name: str, stacked: Any = None) -> Leaves:
    """`tree`'s leaves, each checked by `norm_leaf`, with their `stacking`."""
    out = leaves(tree)
    for path, leaf in zip(out.paths, out.arrays, strict=True):
        norm_leaf(path, leaf, fn_name)
    return stacking(stacked, tree, out)


def batched_leaves(tree: PyTree, fn_name: str) -> Leaves:
    """`norm_leaves`, each with the batch on axis 0, of one size."""
    out = norm_leaves(tree, fn_name)
    batch = None
    for path, leaf in zip(out.paths, out.arrays, strict=True):
        shape = tuple(leaf.shape)
        if batch is None and shape:
            batch = shape[0]
        if not shape or shape[0] != batch:
            raise ValueError(
                f"`{fn_name}` takes per-example gradients: every leaf must have "
                "the same batch size on axis 0"
                + (f" ({batch}, from the first leaf)" if batch is not None else "")
                + f"; the leaf at {path_str(path)} has shape {shape}."
            )
    return out


def value_leaves(tree: PyTree, fn_name: str) -> Leaves:
    """`tree`'s leaves, each a real integer or floating array."""
    out = leaves(tree)
    for path, leaf in zip(out.paths, out.arrays, strict=True):
        dtype = _dtype(path, leaf)
        if not (
            jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
        ):
            raise TypeError(
                f"`{fn_name}` clamps real integer or floating-point leaves; the "
                f"leaf at {path_str(path)} has dtype {dtype}, which has no order "
                "to clamp in."
            )
    return out


def state_entries(
    fn_name: str, leaves: Leaves, state_tree: PyTree, shapes: Sequence[Any]
) -> list[Any]:
    """The entries of a per-tensor state tree, one per leaf of the updates,
    checked to be those of the tree `init` was given: the same leaves (by
    path) with entries of the `shapes` expected for them.

    Raises:
      ValueError: naming the first path that differs and what the state
        expected there.
    """
    flat = jax.tree_util.tree_flatten_with_path(state_tree)[0]
    want = [path_str(path) for path, _ in flat]
    got = [path_str(path) for path in leaves.paths]
    if want != got:
        i = next(
            (i for i, (w, g) in enumerate(zip(want, got, strict=False)) if w != g),
            min(len(want), len(got)),
        )
        w = want[i] if i < len(want) else None
        g = got[i] if i < len(got) else None
        if g is not None and g not in want and (w is None or w in got):
            detail = f"the updates have a leaf at {g} that the state holds no entry for"
        elif w is not None and w not in got and (g is None or g in want):
            detail = f"the updates have no leaf at {w}, which the state holds"
        else:
            detail = (
                f"the updates have a leaf at {g} where the state expected the "
                f"leaf at {w}"
            )
        raise ValueError(
            f"`{fn_name}` was initialised for another tree: {detail}. Its state "
            "holds statistics for each leaf `init` was given; update it with "
            "that tree, or `init` it again."
        )
    for (path, entry), x, shape in zip(flat, leaves.arrays, shapes, strict=True):
        if np.shape(entry) != tuple(shape):
            raise ValueError(
                f"`{fn_name}` was initialised for another tree: the leaf at "
                f"{path_str(path)} has shape {tuple(x.shape)}, and the state "
                f"holds statistics of shape {np.shape(entry)} for it, where this "
                f"shape needs {tuple(shape)}. Update it with the tree `init` "
                "was given, or `init` it again."
            )
    return [entry for _, entry in flat]


def params_of(updates: PyTree, params: PyTree, fn_name: str) -> list[Any]:
    """The parameter beside each update leaf, checked by `norm_leaf`; where an
    update leaf is None or `optax.MaskedNode`, the parameter is not read.

    Raises:
      ValueError: if `params` is None, or a parameter's shape is not its
        update's.
      TypeError: if a parameter is not a float array.
    """
    if params is None:
        raise ValueError(
            f"`{fn_name}` clips each update against the norm of its parameter, "
            "so `update` needs `params`; got params=None. Call "
            "`tx.update(updates, state, params)`."
        )

    flat, treedef = jax.tree_util.tree_flatten_with_path(updates, is_leaf=_empty)
    out = []
    weights = treedef.flatten_up_to(params)  # type: ignore[attr-defined]
    for (path, g), w in zip(flat, weights, strict=True):
        if _empty(g):
            continue
        w = _array(w)
        if np.shape(w) != np.shape(g) or not hasattr(w, "dtype"):
            raise ValueError(
                f"`{fn_name}` needs a parameter of the update's shape "
                f"{np.shape(g)} at {path_str(path)}; got "
                f"{getattr(w, 'shape', w)!r}."
            )
        norm_leaf(path, w, fn_name)
        out.append(w)
    return out


# Prefixes of a tree: `specs`, `stacked`.


def _empty(x: Any) -> bool:
    return x is None or isinstance(x, optax.MaskedNode)


def prefix_entries(
    name: str, prefix: PyTree, leaves: Leaves, is_entry: Any, what: str = "entry"
) -> list[tuple[Any, int]]:
    """For each of `leaves`, the entry of `prefix` (a pytree prefix of their
    tree) that covers it, and the number of path keys above that entry.

    Raises:
      ValueError: naming the path, if `prefix` holds an entry where `tree`
        has no node, or has no entry above a leaf.
    """
    table: dict[tuple[str, ...], tuple[Any, int]] = {}
    flat = jax.tree_util.tree_flatten_with_path(prefix, is_leaf=is_entry)[0]
    for path, entry in flat:
        table[tuple(map(str, path))] = (entry, len(path))
    skeleton = leaves.rebuild(range(len(leaves.arrays)))  # empty leaves kept
    nodes = {
        tuple(map(str, path))[:end]
        for path, _ in jax.tree_util.tree_flatten_with_path(skeleton, is_leaf=_empty)[0]
        for end in range(len(path) + 1)
    }
    out = []
    for path, x in zip(leaves.paths, leaves.arrays, strict=True):
        key = tuple(map(str, path))
        found = next(
            (key[:end] for end in range(len(key), -1, -1) if key[:end] in table), None
        )
        if found is None:
            raise ValueError(
                f"`{name}` has no {what} for the leaf at {path_str(path)} (shape "
                f"{tuple(x.shape)}); it must be a prefix of the updates' tree."
            )
        out.append(table[found])
    for (key, _), (path, _) in zip(table.items(), flat, strict=True):
        if key not in nodes:
            raise ValueError(
                f"`{name}` holds an entry at {path_str(path)}, where the updates "
                "have no node: it must be a prefix of the updates' tree."
            )
    return out


STACKED_ACCEPTED = (
    "None, a pytree prefix of the updates holding an int k >= 0 per subtree "
    "(its leaves' leading k axes index stacked layers), or a callable that "
    "takes the updates and returns one"
)


def stacking(stacked: Any, tree: PyTree, leaves: Leaves) -> Leaves:
    """`leaves` with, per leaf, how many leading axes index stacked layers,
    from `stacked` (a prefix of `tree` of ints, or a callable giving one).

    Raises:
      TypeError: if `stacked` holds something other than an int.
      ValueError: naming the leaf or path, if `stacked` is not a prefix of
        `tree`, or gives a leaf a negative number of axes or more than it has.
    """
    if stacked is None:
        return leaves
    prefix = stacked(tree) if callable(stacked) else stacked
    entries = prefix_entries("stacked", prefix, leaves, None)
    for (k, _), path, x in zip(entries, leaves.paths, leaves.arrays, strict=True):
        if not isinstance(k, numbers.Integral) or isinstance(k, bool):
            raise TypeError(
                f"`stacked` must be {STACKED_ACCEPTED}; for the leaf at "
                f"{path_str(path)} it holds {short_repr(k)}."
            )
        if not 0 <= int(k) <= x.ndim:
            raise ValueError(
                f"`stacked` gives {k} stacked axes to the leaf at {path_str(path)} "
                f"with shape {tuple(x.shape)}: an int from 0 to its rank, "
                f"{x.ndim}."
            )
    return dataclasses.replace(
        leaves,
        stacked=tuple(int(k) for k, _ in entries),
        depths=tuple(depth for _, depth in entries),
    )


def unrolled(
    paths: Sequence[KeyPath],
    layers: Sequence[tuple[int, ...]],
    depths: Sequence[int],
) -> list[tuple[int, tuple[int, ...] | None, list[str]]]:
    """The tensors of stacked leaves as the unrolled model has them: for each,
    its leaf, its layer index (None for a leaf not stacked) and its key path
    with the index where the stacked subtree starts, in the unrolled model's
    order (layer by layer through each stacked subtree)."""
    keys = [path_keys(path) for path in paths]
    out: list[tuple[int, tuple[int, ...] | None, list[str]]] = []
    i = 0
    while i < len(paths):
        if not layers[i]:
            out.append((i, None, keys[i]))
            i += 1
            continue
        d, root = depths[i], keys[i][: depths[i]]
        j = i
        while j < len(paths) and layers[j] == layers[i] and keys[j][:d] == root:
            j += 1
        for index in np.ndindex(*layers[i]):
            for m in range(i, j):
                unrolled_keys = [*keys[m][:d], *map(str, index), *keys[m][d:]]
                out.append((m, index, unrolled_keys))
        i = j
    return out


def each_inner_axes(
    axes: tuple[int, ...] | None, leaves: Leaves, name: str = "axes"
) -> list[tuple[int, ...]]:
    """`axes` resolved within one layer of each leaf: counted in its axes
    after the stacked ones (all of those for None)."""
    out = []
    for i, (path, x) in enumerate(zip(leaves.paths, leaves.arrays, strict=True)):
        k = leaves.stacked_axes(i)
        inner = leaf_axes(axes, path, tuple(x.shape[k:]), name)
        out.append(tuple(k + a for a in inner))
    return out


# Numbers.


def int_as_float(value: int) -> float:
    """A Python int as the nearest float64; +-inf past float64's range."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def real_array(name: str, value: Any, accepted: str) -> np.ndarray:
    """A concrete real `value` as a float64 NumPy array.

    Raises:
      TypeError: naming `name`, if `value` is not a real number or array.
    """
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


def is_data(value: Any) -> TypeGuard[jax.Array]:
    """Whether `value` is a JAX array, traced or not: data, which the rules
    take as it is (docs/semantics.md, "Thresholds"); a Python or NumPy value
    is configuration, checked where it is given."""
    return isinstance(value, jax.Array)


def data(name: str, value: jax.Array, accepted: str, scalar: bool) -> None:
    """A JAX array where a number belongs: a real dtype and, for a scalar, no
    dimensions (both known when traced); its values are not read."""
    if jnp.issubdtype(value.dtype, jnp.bool_) or not (
        jnp.issubdtype(value.dtype, jnp.floating)
        or jnp.issubdtype(value.dtype, jnp.integer)
    ):
        raise TypeError(
            f"`{name}` must be {accepted}; got an array of dtype {value.dtype}."
        )
    if scalar and value.ndim != 0:
        raise ValueError(
            f"`{name}` must be {accepted}; got an array of shape {value.shape}."
        )


def scalar(
    name: str,
    value: Any,
    accepted: str,
    *,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """A real scalar in [low, high] (either end open); a JAX array (data) is
    checked for its dtype and shape only.

    Raises:
      TypeError: if `value` is not real (`real_array`).
      ValueError: naming `name` and showing the value (or an array's shape),
        if it is not a scalar, is NaN, or lies outside the bounds.
    """
    if is_data(value):
        data(name, value, accepted, scalar=True)
        return
    array = real_array(name, value, accepted)
    if array.ndim != 0:
        raise ValueError(
            f"`{name}` must be {accepted}; got an array of shape {array.shape}."
        )
    above = array > low if low_open else array >= low
    below = array < high if high_open else array <= high
    if not (above and below):  # NaN is neither
        raise ValueError(f"`{name}` must be {accepted}; got {short_repr(value)}.")


def scalar_array(name: str, value: Any) -> jax.Array:
    """A 0-d array (of data: its value is not checked)."""
    array = jnp.asarray(value)
    if array.shape != ():
        raise ValueError(
            f"`{name}` must be a scalar; got an array of shape {array.shape}."
        )
    return array


def threshold(name: str, value: Any) -> None:
    """A norm threshold: a positive scalar, inf allowed."""
    accepted = f"a positive scalar ({THRESHOLD_TYPES}); inf means no clipping"
    scalar(name, value, accepted, low=0, low_open=True)


def nonnegative(name: str, value: Any, accepted: str) -> None:
    """A scalar >= 0, inf allowed."""
    scalar(name, value, f"{accepted} ({THRESHOLD_TYPES})", low=0)


def open_unit(name: str, value: Any) -> None:
    """A real number strictly between 0 and 1."""
    accepted = "a real number strictly between 0 and 1"
    scalar(name, value, accepted, low=0, high=1, low_open=True, high_open=True)


def positive(name: str, value: Any, *, inf_ok: bool = False) -> None:
    """A real number > 0, finite unless `inf_ok`."""
    accepted = "a real number > 0 or inf" if inf_ok else "a finite real number > 0"
    scalar(name, value, accepted, low=0, low_open=True, high_open=not inf_ok)


def count(name: str, value: Any, minimum: int = 1, *, traced_ok: bool = False) -> Any:
    """An int in [`minimum`, 2**31 - 1] (a Python or NumPy int, or a concrete
    0-d integer array), returned as an int; with `traced_ok` (a count that is
    only compared with), a JAX array is data, returned as it is.

    Raises:
      TypeError: if `value` is traced and not `traced_ok` (it sets a shape).
      ValueError: if `value` is not such an int.
    """
    if traced_ok and is_data(value):
        data(name, value, f"an int >= {minimum}", scalar=True)
        return value
    if is_traced(value):
        raise TypeError(f"`{name}` got a traced value; {STATIC_HINT}.")
    if (
        isinstance(value, (jax.Array, np.ndarray))
        and value.ndim == 0
        and jnp.issubdtype(value.dtype, jnp.integer)
    ):
        value = int(value)
    valid = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not valid or value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}; got {value!r}.")
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
    """A norm's order as a float p >= 1 (inf allowed; None means 2).

    The strings `"inf"` and `"infinity"` (any case) mean inf, as in
    `optax.tree.norm` and PyTorch's `norm_type`.

    Raises:
      TypeError: if `value` is traced.
      ValueError: if `value` is not accepted.
    """
    if value is None:
        return 2.0
    if isinstance(value, str) and value.lower() in ORD_INF_NAMES:
        return math.inf
    if is_traced(value):
        raise TypeError(f"`ord` got a traced value; {STATIC_HINT}.")
    real_array_value = (
        isinstance(value, (jax.Array, np.ndarray))
        and value.ndim == 0
        and (
            jnp.issubdtype(value.dtype, jnp.floating)
            or jnp.issubdtype(value.dtype, jnp.integer)
        )
    )
    real_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    p = float(value) if real_number or real_array_value else math.nan
    if math.isnan(p) or p < 1:
        raise ValueError(f"`ord` must be {ORD_ACCEPTED}; got {short_repr(value)}.")
    return p


def axes(value: Any, name: str = "axes") -> tuple[int, ...] | None:
    """`value` as a tuple of distinct ints, or None (all axes).

    Raises:
      TypeError: if `value` is traced.
      ValueError: if it is not None, an int or a sequence of distinct ints.
    """
    if value is None:
        return None
    if is_traced(value):
        raise TypeError(f"`{name}` got a traced value; {STATIC_HINT}.")
    accepted = "None, an int, or a sequence of distinct ints"
    if isinstance(value, (jax.Array, np.ndarray)):  # from inject_hyperparams
        if value.ndim > 1 or not jnp.issubdtype(value.dtype, jnp.integer):
            raise ValueError(f"`{name}` must be {accepted}; got {short_repr(value)}.")
        value = tuple(int(a) for a in np.asarray(value).reshape(-1))
    items = (value,) if isinstance(value, numbers.Integral) else value
    try:
        items = tuple(items)
    except TypeError as error:
        raise ValueError(f"`{name}` must be {accepted}; got {value!r}.") from error
    if not all(
        isinstance(a, numbers.Integral) and not isinstance(a, bool) for a in items
    ):
        raise ValueError(f"`{name}` must be {accepted}; got {value!r}.")
    items = tuple(int(a) for a in items)
    if len(set(items)) != len(items):
        raise ValueError(
            f"`{name}` must be {accepted}; got repeated axes in {value!r}."
        )
    return items


def leaf_axes(
    axes: tuple[int, ...] | None,
    path: KeyPath,
    shape: tuple[int, ...],
    name: str = "axes",
) -> tuple[int, ...]:
    """`axes` resolved for one leaf of `shape` (all its axes for None).

    Raises:
      ValueError: naming the leaf and its shape, if an axis is out of range or
        two name the same axis.
    """
    ndim = len(shape)
    if axes is None:
        return tuple(range(ndim))
    if any(not -ndim <= a < ndim for a in axes):
        raise ValueError(
            f"`{name}`={axes} is out of range for the leaf at {path_str(path)} "
            f"with shape {shape} (rank {ndim})."
        )
    resolved = tuple(a % ndim for a in axes)
    if len(set(resolved)) != len(resolved):
        raise ValueError(
            f"`{name}`={axes} names the same axis twice for the leaf at "
            f"{path_str(path)} with shape {shape}."
        )
    return resolved


def axis_name(value: Any) -> tuple[str, ...]:
    """A mesh-axis name, or a sequence of them, as a tuple; () for None."""
    if value is None:
        return ()
    names: tuple[Any, ...] = ()
    if isinstance(value, str):
        names = (value,)
    elif isinstance(value, (tuple, list)):
        names = tuple(value)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(
            "`axis_name` must be None, a mesh-axis name, or a sequence of names; "
            f"got {value!r}."
        )
    return names


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


def key_paths(name: str, value: Any, separator: str) -> list[str]:
    """A sequence of non-empty `separator`-joined key paths."""
    accepted = f"a sequence of non-empty {separator!r}-separated key paths"
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError(f"`{name}` must be {accepted}; got {value!r}.")
    if not all(isinstance(p, str) and p.strip(separator) for p in value):
        raise ValueError(f"`{name}` must be {accepted}; got {value!r}.")
    return list(value)


def choice(name: str, value: Any, options: Sequence[str]) -> str:
    """One of the strings `options`."""
    if not isinstance(value, str) or value not in options:
        names = [f'"{o}"' for o in options]
        spelled = ", ".join(names[:-1]) + f" or {names[-1]}"
        raise ValueError(f"`{name}` must be {spelled}; got {value!r}.")
    return value


def unused(value: Any, default: Any, message: str) -> None:
    """An argument that means nothing with the others given keeps its default
    (data is not read); `message` has a `{value}` field."""
    if not is_data(value) and np.any(np.asarray(value) != default):
        raise ValueError(message.format(value=short_repr(value)))


def nonfinite(value: Any, modes: tuple[Any, ...]) -> Any:
    """The mode `value` names, one of `modes`; True and False (PyTorch's
    `error_if_nonfinite`) are `"error"` and `modes[0]`."""
    if value is True or value is False:
        value = "error" if value else modes[0]
    if not (value is None or isinstance(value, str)) or value not in modes:
        raise ValueError(
            f"`nonfinite` must be one of {modes}, or a bool as PyTorch's "
            f"`error_if_nonfinite` (True is 'error', False {modes[0]!r}); got "
            f"{short_repr(value)}."
        )
    return value


def bounds(min_value: Any, max_value: Any) -> None:
    """Value-clipping bounds: real scalars or arrays, min <= max where concrete."""
    accepted = f"{THRESHOLD_TYPES}, or an array that broadcasts to the leaves"
    arrays = {}
    for name, value in (("min_value", min_value), ("max_value", max_value)):
        if is_data(value):
            data(name, value, accepted, scalar=False)
            continue
        array = real_array(name, value, accepted)
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


def transformation(name: str, value: Any) -> None:
    """An `optax.GradientTransformation` (anything with `init` and `update`)."""
    if not (
        callable(getattr(value, "init", None))
        and callable(getattr(value, "update", None))
    ):
        raise TypeError(
            f"`{name}` must be an optax.GradientTransformation; got "
            f"{type(value).__name__}."
        )


# Peers' names.

# What each ignored argument is, for the message of a wrong value.
IGNORED = {
    "name": "TensorFlow's name for the operation",
    "foreach": "PyTorch's choice of kernels",
}


def ignored(fn_name: str, name: str, value: Any) -> None:
    """An argument clipax ignores must still be what a peer takes there:
    TensorFlow's `name` (a string) or PyTorch's `foreach` (a bool); one
    peer's position may be another's, so either kind is accepted."""
    if value is None or isinstance(value, (bool, str)):
        return
    raise TypeError(
        f"`{fn_name}` ignores `{name}` ({IGNORED[name]}, which means nothing in "
        f"JAX) but takes only None, a bool or a string there; got "
        f"{short_repr(value)} of type {type(value).__name__}."
    )


def peer_names(
    fn_name: str,
    aliases: Mapping[str, str] | None = None,
    ignored_names: Sequence[str] = (),
    tree_call: str | None = None,
) -> Callable[[F], F]:
    """Makes the public function `fn_name` take its peers' argument names.

    Args:
      fn_name: the public name, for messages (`"clipax.tree.clip_by_norm"`).
      aliases: each peer's name for a parameter, mapped to the parameter's
        name. By keyword, an alias is passed on as the parameter; given with
        the parameter (or another alias of it), it is a `TypeError`.
      ignored_names: the peers' arguments the function ignores (keys of
        `IGNORED`): a parameter of the function stays one, which the function
        ignores; the others are accepted by keyword and dropped. Either way
        the value is checked (`ignored`).
      tree_call: for a transformation named as a function of `clipax.tree`,
        how to call that function: a tree given as the first argument is
        then a `TypeError` that shows it (`not_a_tree`).

    Returns:
      A decorator; the function keeps its signature (`inspect.signature`, and
      so `optax.inject_hyperparams`, sees it).
    """
    aliases = dict(aliases or {})

    def decorate(fn: F) -> F:
        parameters = inspect.signature(fn).parameters
        positions = {
            name: index
            for index, (name, p) in enumerate(parameters.items())
            if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        }
        in_signature = [(n, positions[n]) for n in ignored_names if n in positions]
        dropped = [n for n in ignored_names if n not in parameters]

        first = next(iter(parameters))

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if tree_call is not None and args:
                not_a_tree(fn_name, first, args[0], tree_call)
            for alias in [a for a in aliases if a in kwargs]:
                own = aliases[alias]
                given = [n for n, o in aliases.items() if o == own and n in kwargs]
                if own in kwargs or positions.get(own, len(args)) < len(args):
                    given.insert(0, own)
                if len(given) > 1:
                    names = " and ".join(f"`{n}`" for n in given)
                    raise TypeError(
                        f"`{fn_name}` got {names}, which name the same argument "
                        f"(`{own}`); pass one of them."
                    )
                kwargs[own] = kwargs.pop(alias)
            for name in dropped:
                if name in kwargs:
                    ignored(fn_name, name, kwargs.pop(name))
            for name, index in in_signature:
                ignored(
                    fn_name,
                    name,
                    args[index] if index < len(args) else kwargs.get(name),
                )
            return fn(*args, **kwargs)

        return cast(F, wrapper)

    return decorate
