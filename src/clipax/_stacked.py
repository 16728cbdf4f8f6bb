"""`stacked_prefix`: the `stacked=` prefix of a model whose layers are stacked."""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np

from clipax import _checks
from clipax._leaves import LayerAxes, is_variable, path_keys, unwrap


def _names(node: Any) -> tuple[Any, ...] | None:
    """A leaf's logical axis names: a Flax linen box's (`nn.LogicallyPartitioned`,
    `nn.Partitioned`) or an NNX variable's (`out_sharding` metadata; `sharding`
    before Flax 0.12); None where it has none."""
    if hasattr(node, "names") and hasattr(node, "unbox"):
        return tuple(node.names)
    meta = node.get_metadata() if is_variable(node) else {}
    names = meta.get("out_sharding", meta.get("sharding"))
    return tuple(names) if isinstance(names, (tuple, list)) else None


def _entry(positions: list[int]) -> int | LayerAxes:
    """Leading axes as their count, others as `LayerAxes`."""
    return (
        len(positions)
        if positions == list(range(len(positions)))
        else LayerAxes(*positions)
    )


def _fold(node: Any, keys: list[Any], root: bool = True) -> Any:
    """`node`, a tree of leaf indices, with each leaf's entry (`keys[i][0]`)
    for its index, and each subtree below the root whose leaves share their
    entry and layers held once, by its root (`{"blocks": 1}`)."""
    if isinstance(node, int):
        return keys[node][0]
    indices = jax.tree.leaves(node)
    if not root and indices and len({keys[i] for i in indices}) == 1:
        return keys[indices[0]][0]
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        node, is_leaf=lambda x: x is not node
    )
    folded = [_fold(child, keys, root=False) for _, child in flat]
    return treedef.unflatten(folded)  # type: ignore[attr-defined]


def stacked_prefix(
    tree: Any,
    *,
    axis_name: str | None = None,
    path: str | None = None,
    axes: int | tuple[int, ...] = 1,
) -> Any:
    """The `stacked=` prefix for a model's parameters: which axes of each leaf
    index stacked layers.

    With `axis_name`, from the logical axis names of each leaf: a Flax linen
    box's (`nn.with_logical_partitioning`; `nn.scan(...,
    metadata_params={nn.PARTITION_NAME: axis_name})` inserts `axis_name` at
    the scanned axis, which MaxText puts at 1) or an NNX variable's
    (`sharding_names`); a leaf without names (a bias not annotated) takes
    those of the annotated leaves beside it, where they agree. With `path`,
    from a regular expression: a leaf whose `/`-joined key path matches it
    (`re.search`) gets `axes` (an int: that many leading axes; a tuple: those
    positions), others none. A subtree whose leaves share their layer axes
    and counts holds them once, at its root; the prefix fits the unboxed
    parameters and their updates (docs/stacked-layers.md).

    Args:
      tree: the parameters (boxed, for `axis_name`), or the updates.
      axis_name: the logical name of the stacked axis, e.g. `"layers"`.
      path: a regular expression on the leaves' key paths, e.g.
        `"^params/blocks/"`.
      axes: with `path`, an int >= 0 (the count of leading layer axes) or a
        tuple of ints (their positions).

    Returns:
      A pytree prefix of ints and `clipax.LayerAxes`, for `stacked=`.

    Raises:
      ValueError: if not exactly one of `axis_name` and `path` is given, no
        leaf has the axis name (naming those found) or matches the path
        (naming a few paths), `path` is not a regular expression, or `axes`
        is not accepted.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> params = {"embed": jnp.ones((8, 4)), "blocks": {"w": jnp.ones((3, 4, 4))}}
      >>> clipax.stacked_prefix(params, path="^blocks/")
      {'blocks': 1, 'embed': 0}
      >>> clipax.stacked_prefix(params, path="^blocks/", axes=(1,))
      {'blocks': LayerAxes(1), 'embed': 0}
    """
    if (axis_name is None) == (path is None):
        raise ValueError("Give `axis_name` or `path` to `stacked_prefix`, one of them.")
    if axis_name is not None:
        if not isinstance(axis_name, str) or not axis_name:
            raise ValueError(
                f"`axis_name` must be a logical axis name; got {axis_name!r}."
            )
        flat, treedef = jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=lambda x: hasattr(x, "unbox") or is_variable(x)
        )
        names = [_names(x) for _, x in flat]
        if not any(axis_name in n for n in names if n):
            found = sorted({str(a) for n in names if n for a in n})
            none = "none (the leaves carry no names: pass the boxed parameters, or "
            raise ValueError(
                f"No leaf of the tree has the logical axis name {axis_name!r}; the "
                f"names found are {found or none + 'give `path`)'}."
            )
        entries: list[Any] = [
            None
            if n is None
            else _entry([i for i, a in enumerate(n) if a == axis_name])
            for n in names
        ]
        beside: dict[tuple[str, ...], set[Any]] = {}
        for (key_path, _), named in zip(flat, entries, strict=True):
            if named is not None:
                beside.setdefault(tuple(path_keys(key_path)[:-1]), set()).add(named)
        for i, (key_path, _) in enumerate(flat):
            if entries[i] is None:
                found_here = beside.get(tuple(path_keys(key_path)[:-1]), set())
                entries[i] = found_here.pop() if len(found_here) == 1 else 0
        shapes = [
            np.shape(x.unbox() if hasattr(x, "unbox") else unwrap(x)) for _, x in flat
        ]
    else:
        if not isinstance(path, str):
            raise ValueError(f"`path` must be a regular expression; got {path!r}.")
        try:
            pattern = re.compile(path)
        except re.error as error:
            raise ValueError(
                f"`path` must be a regular expression; got {path!r}."
            ) from error
        if isinstance(axes, tuple):
            if not axes:
                raise ValueError("`axes` must be an int >= 0 or ints; got ().")
            entry: Any = LayerAxes(*_checks.axes(axes) or ())
        else:
            entry = _checks.integer("axes", axes, minimum=0)
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        joined = ["/".join(path_keys(p)) for p, _ in flat]
        entries = [entry if pattern.search(j) else 0 for j in joined]
        if entries and all(e == 0 for e in entries) and entry != 0:
            raise ValueError(
                f"`path`={path!r} matches no leaf of the tree; its paths include "
                f"{joined[:4]}."
            )
        shapes = [np.shape(x) for _, x in flat]
    keys = [
        (
            e,
            tuple(
                s[a]
                for a in (e.axes if isinstance(e, LayerAxes) else range(e))
                if -len(s) <= a < len(s)
            ),
        )
        for e, s in zip(entries, shapes, strict=True)
    ]
    indices = treedef.unflatten(range(len(flat)))  # type: ignore[attr-defined]
    return _fold(indices, keys)
