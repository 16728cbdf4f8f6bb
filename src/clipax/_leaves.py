"""The model of leaves: a tree's leaves as records, built once per call.

`leaves(tree, ...)` reads a tree, with its `stacked=` and `specs`/`axis_name`,
into one `Leaf` per array: its key path, the array, the positions of its layer
axes (the axes that index stacked layers) and, inside `shard_map`/`pmap`, the
mesh axes that split each of its dimensions. Every rule, tree function and
`metrics` works from these records; a layer's axes, a leaf's placement and the
unrolled model's keys (`flat_keys`) are computed here and nowhere else.
None and `optax.MaskedNode` are no leaves: `Leaves.rebuild` puts them back.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec
from numpy.lib.array_utils import normalize_axis_tuple

from clipax import _checks
from clipax._checks import short_repr

KeyPath = tuple[Any, ...]
MeshAxes = tuple[str, ...]

NORM_DTYPES = "float16, bfloat16, float32, float64 or complex"
ARRAY_LEAVES = (
    "clipax takes trees of arrays (jax.Array, numpy.ndarray, NumPy scalars or "
    "Python numbers); use None or optax.MaskedNode for empty leaves"
)
# What a layout argument other than `specs` and `stacked` describes, for messages.
DESCRIBES = {"logit_specs": "`max_logits`"}
STACKED_ACCEPTED = (
    "None, a pytree prefix of the updates holding per subtree an int k >= 0 "
    "(its leaves' k leading axes index stacked layers) or a `clipax.LayerAxes` "
    "(the positions of those axes), or a callable that returns one"
)


def path_str(path: KeyPath) -> str:
    """A key path as `jax.tree_util.keystr` writes it; `<root>` for ()."""
    return jax.tree_util.keystr(path) if path else "<root>"


def path_keys(path: KeyPath) -> list[str]:
    """A key path as strings: dict keys, attribute names, sequence indices."""
    return [
        str(next((getattr(k, a) for a in ("key", "name", "idx") if hasattr(k, a)), k))
        for k in path
    ]


def prefixes(path: Sequence[Any]) -> list[tuple[Any, ...]]:
    """The paths at and above `path`, nearest first (the root last): the one
    place a path is read as below another."""
    return [tuple(path[:end]) for end in range(len(path), -1, -1)]


def child_of(path: KeyPath, root: KeyPath) -> str | None:
    """The name of the child of `root` that `path` lies under, or None."""
    below = len(path) > len(root) and root in prefixes(path)
    return path_keys(path[len(root) : len(root) + 1])[0] if below else None


def rewrap(node: Any, value: Any) -> Any:
    """`value` in the wrapper `node` (`is_wrapper`) in place of its array."""
    return jax.tree.unflatten(jax.tree.structure(node), [value])


def is_empty(x: Any) -> bool:
    return x is None or isinstance(x, optax.MaskedNode)


def imported(module: str) -> Any:
    """The `module` where the program has imported it, else None. clipax
    depends on jax, optax and chex alone (DESIGN.md, "Dependencies"): a
    container of Flax, NNX or haliax exists only where its library was
    imported, so that is where clipax looks for one, never importing it."""
    return sys.modules.get(module)


def is_variable(node: Any) -> bool:
    """Whether `node` is a Flax NNX variable."""
    nnx = imported("flax.nnx")
    return nnx is not None and isinstance(node, nnx.Variable)


def is_named(node: Any) -> bool:
    """Whether `node` is a haliax `NamedArray`."""
    hax = imported("haliax")
    return hax is not None and isinstance(node, hax.NamedArray)


def is_box(node: Any) -> bool:
    """Whether `node` is a Flax linen box (`nn.Partitioned`,
    `nn.LogicallyPartitioned`): an array with names for its axes, which
    `stacked_prefix` reads; a pytree node elsewhere."""
    return hasattr(node, "unbox") and hasattr(node, "names")


def is_wrapper(node: Any) -> bool:
    """Whether `node` wraps one array with metadata about its axes (an NNX
    variable, a haliax `NamedArray`): clipax reads the array, and puts a
    statistic of it in the node's place as a plain array, since the metadata
    would not fit the statistic's shape. A wrapper of an empty leaf (an NNX
    variable holding the `MaskedNode` of `optax.partition`) is none: it
    flattens to nothing, as the empty leaf does."""
    return (is_variable(node) or is_named(node)) and not is_empty(unwrap(node))


def unwrap(node: Any) -> Any:
    """A wrapper's or a linen box's array (an NNX variable's value:
    `get_value` from Flax 0.12, `.value` before); any other node as it is."""
    if is_box(node):
        return node.unbox()
    if is_named(node):
        return node.array
    if not is_variable(node):
        return node
    return node.get_value() if hasattr(type(node), "get_value") else node.value


def accum_dtype(dtype: Any) -> np.dtype:
    """Float32, or float64 for 64-bit leaves (with x64 on): never narrower."""
    real = np.dtype(jnp.finfo(dtype).dtype)
    wide = real.itemsize >= 8 and jax.config.read("jax_enable_x64")
    return np.dtype(np.float64) if wide else np.dtype(np.float32)


def tree_accum_dtype(arrays: Sequence[Any]) -> np.dtype:
    """The widest `accum_dtype` over `arrays` (float32 for none)."""
    wide = any(accum_dtype(x.dtype).itemsize >= 8 for x in arrays)
    return np.dtype(np.float64) if wide else np.dtype(np.float32)


def _array(x: Any) -> Any:
    """A Python number as a 0-d JAX array (a leaf, as in optax); else `x`."""
    return jnp.asarray(x) if type(x) in (bool, int, float, complex) else x


@dataclasses.dataclass(frozen=True)
class LayerAxes:
    """The positions of a leaf's stacked (layer) axes, for `stacked=`.

    An int `k` in a `stacked=` prefix says that the `k` leading axes index
    layers; `LayerAxes(1)` says that axis 1 does (MaxText's default layout,
    `nn.scan(variable_axes={"params": 1})`), `LayerAxes(0, 2)` axes 0 and 2.
    A bare tuple cannot say it: in a prefix, a tuple is a tree node.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> kernel = jnp.ones((4, 3, 8))  # (embed, layers, mlp)
      >>> tx = clipax.clip_by_norm(1.0, stacked=clipax.LayerAxes(1))
      >>> tx.init(kernel).norms.shape  # one norm per layer
      (3,)
    """

    axes: tuple[int, ...]

    def __init__(self, *axes: int) -> None:
        if not axes or not all(map(_checks.is_int, axes)):
            raise TypeError(f"`LayerAxes` takes one or more ints; got {axes!r}.")
        object.__setattr__(self, "axes", tuple(int(a) for a in axes))

    def __repr__(self) -> str:
        return f"LayerAxes({', '.join(map(str, self.axes))})"


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Stacks:
    """Where each stacked leaf's stack starts, for the keys of `metrics`: per
    leaf of a per-tensor state, the depth of its `stacked=` entry's node (None
    where it is not stacked); () where none is. A pytree node without leaves:
    it holds no arrays, and maps, jits and checkpoints as nothing."""

    depths: tuple[int | None, ...] = ()


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One array of a tree: where it is, and how it is laid out."""

    path: KeyPath
    x: Any  # a JAX or NumPy array (a Python number as a 0-d JAX array)
    layer_axes: tuple[int, ...] = ()  # the axes indexing stacked layers, sorted
    dims: tuple[MeshAxes, ...] | None = None  # inside shard_map/pmap: per
    # dimension, the mesh axes that split it (from `specs`; () where JAX's
    # types prove the leaf whole); None outside, or where it is not known
    fsdp_axes: MeshAxes = ()  # from `axis_name`: axes that split some
    # dimension, unknown which (only a whole-leaf reduction can use them)
    unsaid_axes: MeshAxes = ()  # the manual mesh axes it may be split over,
    # where nobody said how
    argument: str = "specs"  # the argument that would say it
    node: Any = None  # the wrapper holding `x` (`is_wrapper`), or None
    root: KeyPath | None = None  # where its stack starts: its `stacked=` entry

    @property
    def layers(self) -> tuple[int, ...]:
        """The shape of its layer axes (() for a leaf not stacked)."""
        return tuple(self.x.shape[a] for a in self.layer_axes)

    @property
    def inner(self) -> tuple[int, ...]:
        """Its axes within one layer, in order."""
        return tuple(d for d in range(self.x.ndim) if d not in self.layer_axes)

    def within(self, axes: tuple[int, ...] | None, name: str = "axes") -> tuple:
        """`axes` counted within one layer's tensor (all of them for None), as
        axes of the leaf.

        Raises:
          ValueError: naming the leaf and one layer's shape, if an axis is
            out of range or two name the same axis.
        """
        inner = self.inner
        if axes is None:
            return inner
        shape = tuple(self.x.shape[d] for d in inner)
        where = f"for the leaf at {path_str(self.path)} with shape {shape}"
        try:
            resolved = normalize_axis_tuple(axes, len(inner))
        except np.exceptions.AxisError:
            raise ValueError(
                f"`{name}`={axes} is out of range {where} (rank {len(inner)})."
            ) from None
        except ValueError:
            raise ValueError(
                f"`{name}`={axes} names the same axis twice {where}."
            ) from None
        return tuple(inner[a] for a in resolved)

    def broadcast(self, values: Any, axes: Sequence[int] | None = None) -> Any:
        """`values`, whose dims are the leaf's `axes` in that order (its layer
        axes for None: per-layer values), shaped to broadcast against it."""
        axes = list(self.layer_axes if axes is None else axes)
        shape = [n if d in axes else 1 for d, n in enumerate(self.x.shape)]
        return jnp.transpose(values, np.argsort(axes).tolist()).reshape(shape)

    def own(self, whole: jax.Array, axes: Sequence[int]) -> jax.Array:
        """`whole`, whose dims are the whole tensor's `axes` of this leaf, cut
        to this device's block of them inside `shard_map` (where the spec
        splits them); as it is elsewhere."""
        for i, d in enumerate(axes):
            names, size = (self.dims[d] if self.dims else ()), self.x.shape[d]
            if whole.shape[i] != size:
                start = jax.lax.axis_index(names) * size
                whole = jax.lax.dynamic_slice_in_dim(whole, start, size, i)
        return whole

    def split(self, axes: Sequence[int] | None = None, fsdp: bool = True) -> MeshAxes:
        """The mesh axes that split any of `axes` (all of its axes for None).

        Raises:
          ValueError: naming the leaf, the mesh axes and the arguments to
            pass, inside `shard_map` where nobody said how it is split.
        """
        if self.unsaid_axes:
            raise ValueError(
                f"clipax cannot tell how the leaf at {path_str(self.path)} (its block "
                f"{tuple(self.x.shape)}) is split across the mesh axes "
                f"{self.unsaid_axes} of this shard_map (or pmap), and a reduction of "
                "a block is not the tensor's: "
                f"pass `{self.argument}=` (the `in_specs` you gave shard_map for this "
                "tree; `PartitionSpec()` for a leaf whole on every device, as after "
                "`lax.pmean`), or `axis_name=` where every leaf is split over one "
                "mesh axis. JAX's types prove a leaf whole only with `check_vma=True`."
            )
        chosen = range(self.x.ndim) if axes is None else axes
        dims = self.dims or ((),) * self.x.ndim
        named = {n for d in chosen for n in dims[d]}
        return tuple(sorted(named | set(self.fsdp_axes if fsdp else ())))

    def size(self, axes: Sequence[int]) -> int:
        """How many elements `axes` span in the whole tensor, not the block
        (`axis_name`'s axes count where `axes` are all of the leaf's)."""
        split = self.split(axes, fsdp=len(set(axes)) == self.x.ndim)
        mesh = jax.sharding.get_abstract_mesh()
        return math.prod(self.x.shape[d] for d in axes) * math.prod(
            mesh.shape[n] for n in split
        )


class Leaves(list[Leaf]):
    """A tree's leaves, in its flattening order, and the tree to rebuild."""

    def __init__(self, items: Sequence[Leaf], treedef: Any) -> None:
        super().__init__(items)
        self.treedef = treedef

    @property
    def arrays(self) -> list[Any]:
        return [leaf.x for leaf in self]

    @property
    def stacks(self) -> Stacks:
        depths = [len(leaf.root) if leaf.root is not None else None for leaf in self]
        return Stacks(tuple(depths) if any(d is not None for d in depths) else ())

    def rebuild(self, values: Sequence[Any], batched: bool = False) -> Any:
        """The tree with `values` (one per leaf, shaped as it, or `batched`: as
        it but for its first axis, summed away) for its arrays, each in its
        leaf's wrapper (a `NamedArray` without its first axis, where batched;
        no other wrapper then)."""

        def wrap(leaf: Leaf, v: Any) -> Any:
            if leaf.node is None or (batched and not is_named(leaf.node)):
                return v
            if batched:
                return type(leaf.node)(v, leaf.node.axes[1:])
            return rewrap(leaf.node, v)

        return jax.tree.unflatten(
            self.treedef, [wrap(leaf, v) for leaf, v in zip(self, values, strict=True)]
        )

    @property
    def records(self) -> Any:
        """These records in the tree's containers (a wrapper's place holding
        its leaf's): what `jax.tree.map` reads beside per-tensor statistics."""
        return jax.tree.unflatten(self.treedef, list(self))

    def stats(self, values: Iterable[Any]) -> Any:
        """A per-tensor statistic: the tree with `values` (one per leaf, shaped
        as its layers) for its leaves, a wrapper's place included, each whole
        on every device under `jax.jit` (as `init` made it)."""
        return jax.tree.unflatten(self.treedef, [replicated(v) for v in values])

    def full(self, value: float, dtype: Any = None) -> Any:
        """A per-tensor statistic holding `value` in `dtype` (each leaf's
        `accum_dtype` for None), each its own array: a state may be donated."""
        return self.stats(
            jnp.full(leaf.layers, value, dtype or accum_dtype(leaf.x.dtype))
            for leaf in self
        )


def _dtype_error(fn_name: str, leaf: Leaf, kind: str) -> str | None:
    """Why `leaf` cannot be read by a rule of `kind`, or None."""
    x, where = leaf.x, f"the leaf at {path_str(leaf.path)}"
    if not (hasattr(x, "dtype") and hasattr(x, "shape")):
        return (
            f"The leaf at {path_str(leaf.path)} is a {type(x).__name__} "
            f"({short_repr(x)}); {ARRAY_LEAVES}."
        )
    dtype = np.dtype(x.dtype)
    real = jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
    if kind == "value" and not real:
        return (
            f"`{fn_name}` clamps real integer or floating-point leaves; {where} has "
            f"dtype {dtype}, which has no order to clamp in."
        )
    if kind == "logits" and not jnp.issubdtype(dtype, jnp.floating):
        return (
            f"`max_logits` holds the step's largest attention logits, floats; "
            f"{where} has dtype {dtype}. Cast it (`x.astype(jnp.float32)`)."
        )
    narrow = dtype.itemsize < 2 and jnp.issubdtype(dtype, jnp.floating)
    if kind == "norm" and (narrow or not jnp.issubdtype(dtype, jnp.inexact)):
        return (  # float8, float4: no implicit promotion in JAX
            f"`{fn_name}` takes norms of {NORM_DTYPES} leaves; {where} has dtype "
            + (
                f"{dtype}, which JAX does not promote to float32 in arithmetic. Cast "
                "it (`x.astype(jnp.bfloat16)`)"
                if narrow
                else f"{dtype}. Cast it to a float dtype"
            )
            + ", or leave it out of the clipped tree (None, optax.masked)."
        )
    return None


def leaves(
    tree: Any,
    fn_name: str,
    *,
    kind: str = "norm",
    stacked: Any = None,
    specs: Any = None,
    axis_name: MeshAxes = (),
    batched: bool = False,
    argument: str = "specs",
) -> Leaves:
    """`tree`'s leaves as records, each checked to be readable.

    Args:
      tree: the updates (or parameters).
      fn_name: the public name, for messages.
      kind: `"norm"` (float16 or wider, or complex), `"value"` (real
        integer or floating), `"logits"` (floating) or `"array"` (any array;
        the rule checks the leaves it reads): the leaves a rule reads.
      stacked: the `stacked=` prefix (or a function giving it), whose entries
        give the layer axes.
      specs, axis_name: inside `shard_map`/`pmap`, how the leaves are split.
      batched: the leaves hold per-example values on axis 0, of one size;
        `stacked` then describes the axes after it.
      argument: the argument that gives `specs`, for messages.

    Raises:
      TypeError: naming the leaf, if it is not an array of `kind`.
      ValueError: naming the leaf or path, if `stacked` or `specs` does not
        fit the tree, or the batch sizes differ.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_wrapper)
    items = [
        Leaf(path, _array(unwrap(x)), node=x if is_wrapper(x) else None)
        for path, x in flat
    ]
    for leaf in items:
        if error := _dtype_error(fn_name, leaf, kind):
            raise TypeError(error)
    batch = next((leaf.x.shape[0] for leaf in items if leaf.x.ndim), None)
    for leaf in items if batched else ():
        if not leaf.x.ndim or leaf.x.shape[0] != batch:
            raise ValueError(
                f"`{fn_name}` takes per-example gradients: every leaf must have the "
                f"same batch size on axis 0 ({batch}, from the first leaf); the leaf "
                f"at {path_str(leaf.path)} has shape {tuple(leaf.x.shape)}."
            )
    if stacked is not None:
        entry_types = (numbers.Integral, LayerAxes)
        if callable(stacked) and not all(  # a model of ints is a prefix
            isinstance(e, entry_types) for e in jax.tree.leaves(stacked)
        ):
            stacked = stacked(tree)
        items = _stack(stacked, tree, items, int(batched))
    if specs is not None or axis_name:
        items = _place(specs, axis_name, tree, items, argument)
        split = {leaf.dims[0] for leaf in items if batched and leaf.dims}
        if len(split) > 1:  # each device must hold the same examples of each
            raise ValueError(
                f"`{fn_name}` pairs the examples of every leaf: `specs` must split "
                f"their batch axes alike; it splits them over {sorted(split)}."
            )
    elif manual := manual_axes():  # JAX's types may prove a leaf whole, no more
        known = types_checked(manual)
        items = [
            dataclasses.replace(leaf, dims=((),) * leaf.x.ndim)
            if known and not varying(leaf.x)
            else dataclasses.replace(leaf, unsaid_axes=manual, argument=argument)
            for leaf in items
        ]
    return Leaves(items, treedef)


def manual_axes() -> MeshAxes:
    """The mesh axes of the `shard_map` (or `pmap`) whose body this is traced
    in, from the abstract mesh (also with `check_vma=False`); () outside."""
    return tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))


def varying(x: Any) -> MeshAxes:
    """The manual mesh axes `x` varies over inside `shard_map` (`vma`; JAX
    0.10 calls it `mat.varying`); none outside, or with `check_vma=False`."""
    aval = jax.typeof(x)
    axes = getattr(getattr(aval, "mat", None), "varying", getattr(aval, "vma", ()))
    return tuple(sorted(axes or ()))


def types_checked(manual: MeshAxes) -> bool:
    """Whether JAX tracks which values vary over the `manual` axes (shard_map's
    `check_vma=True`): then a value that varies over none is whole."""
    return bool(varying(jax.lax.axis_index(manual)))


def replicated(x: jax.Array) -> jax.Array:
    """`x` (a few statistics) whole on every device where it is split over
    explicit mesh axes under `jax.jit`; as it is elsewhere."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    if sharding is None or all(e is None for e in sharding.spec):
        return x
    return jax.sharding.reshard(x, sharding.update(spec=PartitionSpec()))


Reader = Callable[..., Leaves]  # `leaves` with one rule's layout arguments


def reader(
    fn_name: str, *, stacked: Any = None, specs: Any = None, axis_name: Any = None
) -> Reader:
    """`leaves` with one rule's layout arguments, checked once where the rule
    is made: the one way a rule reads a tree (`axis_name` normalised, and
    checked against `stacked`, here)."""
    _, names = _checks.axes_and_axis_name(None, axis_name, stacked)
    return functools.partial(
        leaves, fn_name=fn_name, stacked=stacked, specs=specs, axis_name=names
    )


def entries(
    name: str,
    prefix: Any,
    tree: Any,
    items: Sequence[Leaf],
    is_entry: Any,
    what: str,
    accepted: str,
) -> list[tuple[Any, KeyPath]]:
    """For each leaf, the entry of `prefix` (a pytree prefix of `tree`) above
    it, and the entry's path.

    Raises:
      TypeError: naming the path, if an entry is not `is_entry`'s.
      ValueError: naming the path, if `prefix` has no entry above a leaf, or
        holds one where `tree` has no node (below an empty node, an entry
        describes nothing, as under `optax.masked`).
    """
    flat = jax.tree_util.tree_flatten_with_path(prefix, is_leaf=is_entry)[0]
    for path, entry in flat:
        if not is_entry(entry):
            raise TypeError(
                f"`{name}` must be {accepted}; at {path_str(path)} it holds "
                f"{short_repr(entry)}."
            )
    table = {tuple(path): (entry, tuple(path)) for path, entry in flat}
    of = DESCRIBES.get(name, "the updates")
    out = []
    for leaf in items:
        found = next((table[p] for p in prefixes(leaf.path) if p in table), None)
        if found is None:
            raise ValueError(
                f"`{name}` has no {what} for the leaf at {path_str(leaf.path)} (shape "
                f"{tuple(leaf.x.shape)}); it must be a prefix of {of}."
            )
        out.append(found)
    nodes: set[KeyPath] = set()
    empty: set[KeyPath] = set()
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_empty)[0]:
        nodes.update(prefixes(path))
        if is_empty(x):
            empty.add(path)
    for path in table:  # in the prefix's order, so one error names one entry
        if path not in nodes and not any(
            above in empty for above in prefixes(path)[1:]
        ):
            raise ValueError(
                f"`{name}` holds an entry at {path_str(path)}, where {of} have "
                f"no node: it must be a prefix of {of}."
            )
    return out


def _stack(prefix: Any, tree: Any, items: list[Leaf], skip: int) -> list[Leaf]:
    """`items` with their layer axes from the `stacked` prefix (after the
    first `skip` axes); the leaves under one entry must have the same layers."""
    out: list[Leaf] = []
    first: dict[Any, Leaf] = {}  # per stack, its first leaf
    try:
        found = entries(
            "stacked", prefix, tree, items, _is_layer_entry, "entry", STACKED_ACCEPTED
        )
    except ValueError as error:
        nodes = jax.tree.leaves(prefix, is_leaf=lambda x: isinstance(x, tuple))
        if not any(isinstance(node, tuple) for node in nodes):
            raise
        raise ValueError(
            f"{error} A tuple in `stacked` is a node of the prefix, not the "
            "positions of layer axes: give those as `clipax.LayerAxes(1)`."
        ) from None
    for leaf, (entry, root) in zip(items, found, strict=True):
        rank = leaf.x.ndim - skip
        where = f"to the leaf at {path_str(leaf.path)} with shape {leaf.x.shape}"
        if isinstance(entry, LayerAxes):
            try:
                axes = normalize_axis_tuple(entry.axes, rank)
            except ValueError:  # numpy's AxisError is one
                raise ValueError(
                    f"`stacked` gives {entry} {where}: distinct axes within its rank, "
                    f"{rank}" + (" after the batch axis." if skip else ".")
                ) from None
        else:
            if not 0 <= int(entry) <= rank:
                raise ValueError(
                    f"`stacked` gives {entry} stacked axes {where}"
                    + (
                        f", whose first axis is the batch: at most {rank}."
                        if skip
                        else f": an int from 0 to its rank, {rank} (the count of "
                        "leading layer axes; `clipax.LayerAxes(i)` for axis i)."
                    )
                )
            axes = tuple(range(int(entry)))
        leaf = dataclasses.replace(
            leaf,
            layer_axes=tuple(sorted(a + skip for a in axes)),
            # A whole tree's entry (`stacked=1`) is one per top-level child.
            root=(root or leaf.path[:1]) if axes else None,
        )
        other = first.setdefault(leaf.root, leaf)
        if leaf.layers != other.layers:
            raise ValueError(
                f"`stacked` makes the leaves at {path_str(other.path)} and "
                f"{path_str(leaf.path)} one stack, but they hold {other.layers} and "
                f"{leaf.layers} layers: give each stack an entry of its own."
            )
        out.append(leaf)
    return out


def _is_layer_entry(node: Any) -> bool:
    return isinstance(node, LayerAxes) or _checks.is_int(node)


def _is_spec(node: Any) -> bool:
    return node is None or isinstance(node, PartitionSpec)


def _place(
    specs: Any, axis_name: MeshAxes, tree: Any, items: list[Leaf], argument: str
) -> list[Leaf]:
    """`items` with the mesh axes that split each dimension, from `specs` (a
    prefix of PartitionSpecs; the argument `argument`), and `axis_name`'s, which
    split some dimension (only a whole-leaf reduction can use them)."""
    found: list[tuple[Any, KeyPath]] = [(None, ())] * len(items)
    if specs is not None:
        accepted = "a tree of jax.sharding.PartitionSpec (a prefix of the tree)"
        found = entries(
            argument, specs, tree, items, _is_spec, "PartitionSpec", accepted
        )
    typed = bool(manual := manual_axes()) and types_checked(manual)
    out = []
    for leaf, (spec, _) in zip(items, found, strict=True):
        spec, where = tuple(spec or ()), path_str(leaf.path)
        shown = f"P({', '.join(map(repr, spec))})"  # as every JAX version prints it
        if len(spec) > leaf.x.ndim:
            raise ValueError(
                f"`{argument}` gives {shown} to the leaf at {where}, "
                f"which has rank {leaf.x.ndim}: a PartitionSpec may not be longer "
                "than the rank."
            )
        if axis_name and not leaf.x.ndim:
            raise ValueError(
                f"`axis_name` splits every leaf, but the leaf at {where} is a scalar; "
                "use `specs` to mark it replicated."
            )
        dims = tuple(
            ((e,) if isinstance(e, str) else tuple(e or ()))
            if e is not PartitionSpec.UNCONSTRAINED
            else ()
            for e in spec + (None,) * (leaf.x.ndim - len(spec))
        )
        unsaid = set(varying(leaf.x) if typed else ()) - {*axis_name, *sum(dims, ())}
        if unsaid:
            raise ValueError(
                f"`{argument}` gives {shown} to the leaf at {where}, "
                "which JAX's types show varying over the mesh axes "
                f"{sorted(unsaid)} of this shard_map: split there, or different on "
                "each device, where "
                f"`{argument}` says it is the same. Pass the `in_specs` you gave "
                "shard_map for it, or make it whole first (`lax.pmean`)."
            )
        out.append(dataclasses.replace(leaf, dims=dims, fsdp_axes=axis_name))
    return out


def check_state(
    fn_name: str, items: Leaves, state_tree: Any, stacks: Stacks | None = None
) -> list[Any]:
    """The entries of a per-tensor state field (one array per leaf, shaped as
    its layers), checked to be those of the tree `init` was given, and, with
    `stacks`, of its stacking.

    Raises:
      ValueError: naming the first path that differs and what the state
        expected there.
    """
    flat = jax.tree_util.tree_flatten_with_path(state_tree, is_leaf=is_wrapper)[0]
    want = [path_str(path) for path, _ in flat]
    got = [path_str(leaf.path) for leaf in items]
    again = "update it with the tree `init` was given, or `init` it again"
    if want != got:
        pairs = zip([*want, None], [*got, None], strict=False)
        w, g = next((w, g) for w, g in pairs if w != g)
        if g is not None and g not in want and (w is None or w in got):
            detail = f"the updates have a leaf at {g} that the state holds no entry for"
        elif w is not None and w not in got and (g is None or g in want):
            detail = f"the updates have no leaf at {w}, which the state holds"
        else:
            detail = f"the updates have a leaf at {g} where the state expected "
            detail += f"the leaf at {w}"
        raise ValueError(
            f"`{fn_name}` was initialised for another tree: {detail}. Its state holds "
            f"statistics for each leaf `init` was given: {again}."
        )
    if stacks is not None and stacks != items.stacks:
        raise ValueError(
            f"`{fn_name}` was initialised with another `stacked=`: its state says "
            f"where each stack starts ({stacks}), and this one says {items.stacks}: "
            f"{again}."
        )
    for (path, entry), leaf in zip(flat, items, strict=True):
        if np.shape(unwrap(entry)) != leaf.layers:
            raise ValueError(
                f"`{fn_name}` was initialised for another tree: the leaf at "
                f"{path_str(path)} has shape {tuple(leaf.x.shape)}, and the state "
                f"holds statistics of shape {np.shape(unwrap(entry))} for it, where "
                f"this shape needs {leaf.layers}: {again}."
            )
    return [unwrap(entry) for _, entry in flat]


def params_of(items: Leaves, updates: Any, params: Any, fn_name: str) -> list[Any]:
    """The parameter beside each update leaf, checked as a norm leaf.

    Raises:
      ValueError: if `params` is None, or a parameter's shape is not its
        update's.
      TypeError: if a parameter is not a float array.
    """
    if params is None:
        raise ValueError(
            f"`{fn_name}` reads the parameter beside each update, so `update` "
            "needs `params`; got params=None. Call "
            "`tx.update(updates, state, params)`."
        )
    treedef = jax.tree.structure(updates, is_leaf=is_empty)
    beside = treedef.flatten_up_to(params)  # type: ignore[attr-defined]
    kept = [
        _array(w)
        for g, w in zip(jax.tree.leaves(updates, is_leaf=is_empty), beside, strict=True)
        if not is_empty(g)
    ]
    for leaf, w in zip(items, kept, strict=True):
        if np.shape(w) != np.shape(leaf.x) or not hasattr(w, "dtype"):
            raise ValueError(
                f"`{fn_name}` needs a parameter of the update's shape "
                f"{np.shape(leaf.x)} at {path_str(leaf.path)}; got "
                f"{getattr(w, 'shape', w)!r}."
            )
        if error := _dtype_error(fn_name, Leaf(leaf.path, w), "norm"):
            raise TypeError(error)
    return kept


def flat_keys(
    paths: Sequence[KeyPath],
    layers: Sequence[tuple[int, ...]],
    depths: Sequence[int | None] = (),
    heads: int = 0,
) -> list[tuple[int, list[str], int]]:
    """The tensors of a tree as the unrolled model has them, in its order
    (layer by layer through each stack): for each, its leaf, its key path, and
    its place in the leaves' values (shaped as their layers) raveled and
    concatenated. A layer index goes right after the node of the leaf's
    `stacked=` entry (`depths`: that node's depth, per leaf; after the leaf's
    own keys without one): the keys depend on that entry alone, never on the
    other leaves, nor on two stacks having equal layer counts. The last
    `heads` axes of `layers` (attention heads) are keyed after the leaf's own.
    """
    keys = [path_keys(path) for path in paths]
    depths = depths or [None] * len(keys)
    depth = [len(k) if d is None else d for d, k in zip(depths, keys, strict=True)]
    offsets = np.cumsum([0, *(math.prod(shape) for shape in layers)])
    out: list[tuple[int, list[str], int]] = []
    i = 0
    while i < len(paths):
        d, root, j = depth[i], keys[i][: depth[i]], i + 1
        while (
            len(layers[i]) > heads
            and j < len(paths)
            and depth[j] == d
            and keys[j][:d] == root
        ):
            j += 1  # the leaves of one stack
        for index in np.ndindex(*layers[i][: len(layers[i]) - heads]):
            for m in range(i, j):
                for head in np.ndindex(*layers[m][len(layers[m]) - heads :]):
                    at = offsets[m] + np.ravel_multi_index(index + head, layers[m])
                    labels = [*map(str, index), *keys[m][d:], *map(str, head)]
                    out.append((m, [*root, *labels], int(at)))
        i = j
    return out
