"""`stacked_prefix`: the `stacked=` prefix of a model whose layers are stacked."""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import numpy as np

from clipax import _checks, _leaves, _states

Entry = Any  # an int (leading layer axes) or a LayerAxes


def _names(node: Any) -> tuple[Any, ...] | None:
    """A leaf's logical axis names: a Flax linen box's (`nn.LogicallyPartitioned`,
    `nn.Partitioned`), an NNX variable's (`out_sharding` metadata;
    `sharding_names` in Flax 0.12.0, `sharding` before) or a haliax
    `NamedArray`'s; None where it has none."""
    if _leaves.is_box(node):
        return tuple(node.names)
    if _leaves.is_named(node):
        return tuple(node.axis_names)
    meta = node.get_metadata() if _leaves.is_variable(node) else {}
    key = next((k for k in ("out_sharding", "sharding_names") if k in meta), "sharding")
    names = meta.get(key)
    return tuple(names) if isinstance(names, (tuple, list)) else None


def _entry(positions: tuple[int, ...]) -> Entry:
    """Leading axes as their count, others as `LayerAxes`."""
    if positions == tuple(range(len(positions))):
        return len(positions)
    return _leaves.LayerAxes(*positions)


def _fold(node: Any, leaves: list[tuple[Entry, int | None]], depth: int = 0) -> Any:
    """`node`, a tree of leaf indices, with each leaf's entry for its index,
    and a subtree held once, by its root, where that root is where its
    leaves' stack starts (`leaves[i]`: the entry, and its node's depth; None
    for a leaf not stacked, whose entry 0 any subtree below the top holds)."""
    if isinstance(node, int):
        return leaves[node][0]
    found = {leaves[i] for i in jax.tree.leaves(node)}
    if len(found) == 1:
        ((entry, root),) = found
        if root == depth or (root is None and depth):
            return entry
    children, treedef = _states.children(node)
    return treedef.unflatten([_fold(c, leaves, depth + 1) for _, c in children])


def _stack_roots(
    keys: list[tuple[str, ...]], sigs: list, shapes: list, scans: list
) -> tuple[list[tuple[Entry, int | None]], dict[tuple[str, ...], Any]]:
    """Each named leaf's entry and its stack's root: the highest subtree below
    the top whose leaves all hold its layers at its axes (those without names:
    where their shape fits), never above a haliax `Stacked`; and each root's
    (axes, layers)."""
    members: dict[tuple[str, ...], list[int]] = {}
    for i, k in enumerate(keys):
        for node in _leaves.prefixes(k):
            members.setdefault(node, []).append(i)

    @functools.cache
    def holds(node: tuple[str, ...], sig: tuple[tuple[int, ...], tuple]) -> bool:
        if any(len(b) > len(node) and b[: len(node)] == node for b in scans):
            return False
        at, layers = sig
        return all(
            sigs[j] == sig
            if sigs[j]
            else all(a < len(shapes[j]) for a in at)
            and tuple(shapes[j][a] for a in at) == layers
            for j in members[node]
        )

    out: list[tuple[Entry, int | None]] = [(0, None)] * len(keys)
    roots: dict[tuple[str, ...], Any] = {}
    for i, (k, sig) in enumerate(zip(keys, sigs, strict=True)):
        if sig is not None and sig[0]:
            nodes = _leaves.prefixes(k)[::-1][min(1, len(k)) :]  # below the top first
            root = next(node for node in nodes if holds(node, sig))
            roots[root], out[i] = sig, (_entry(sig[0]), len(root))
    return out, roots


def _from_names(
    tree: Any, flat: list, keys: list[tuple[str, ...]], axis_name: str
) -> list[tuple[Entry, int | None]]:
    """Each leaf's entry and the depth of its stack's root, read from the
    positions of `axis_name` among its names (docs/stacked-layers.md).

    A stack is a highest subtree below the top whose leaves all hold the
    same layers at the same axes (those without names: where their shape
    fits), never above a haliax `Stacked`. A leaf without names in a stack
    needs a leaf beside it, in its module, whose names prove its layer axes.

    Raises:
      ValueError: if no leaf has the name (naming those found), or naming the
        leaves without names in a stack that no leaf proves.
    """
    names = [_names(x) for _, x in flat]
    if not any(axis_name in n for n in names if n):
        found = sorted({str(a) for n in names if n for a in n})
        none = "none (the leaves carry no names: pass the boxed parameters, or "
        raise ValueError(
            f"No leaf of the tree has the logical axis name {axis_name!r}; the "
            f"names found are {found or none + 'give `path`)'}."
        )
    shapes = [np.shape(_leaves.unwrap(x)) for _, x in flat]
    # Per leaf with names, the positions of its layer axes and the layers there.
    sigs: list[tuple[tuple[int, ...], tuple[int, ...]] | None] = []
    for n, s in zip(names, shapes, strict=True):
        at = tuple(i for i, a in enumerate(n or ()) if a == axis_name)
        sigs.append(None if n is None else (at, tuple(s[a] for a in at)))
    hnn = _leaves.imported("haliax.nn")
    scan = lambda x: hnn is not None and isinstance(x, hnn.Stacked)  # noqa: E731
    flat_scans = jax.tree_util.tree_flatten_with_path(tree, is_leaf=scan)[0]
    scans = [tuple(_leaves.path_keys(p)) for p, x in flat_scans if scan(x)]
    out, roots = _stack_roots(keys, sigs, shapes, scans)
    unproven = []
    for i, k in enumerate(keys):
        root = next((r for r in roots if k[: len(r)] == r), ())
        if sigs[i] is None and root in roots:
            module = [
                sigs[j] for j, kj in enumerate(keys) if kj[: len(k) - 1] == k[:-1]
            ]
            if roots[root] in module:
                out[i] = (_entry(roots[root][0]), len(root))
            else:
                unproven.append("/".join(k))
    if unproven:
        where = "/".join(next(r for r in roots if unproven[0].startswith("/".join(r))))
        raise ValueError(
            f"`stacked_prefix` found the layers of {axis_name!r} stacked under "
            f"{where or '<root>'!r}, but the leaves at {', '.join(unproven[:4])}"
            + (f" (and {len(unproven) - 4} more)" if len(unproven) > 4 else "")
            + " carry no logical axis names, and no leaf beside them proves their "
            "layer axes: read as one tensor, each would be normed across all layers. "
            "Annotate them (`nn.with_logical_partitioning` on their initializers, "
            "e.g. a LayerNorm's `scale_init`), or give `path=` to say which leaves "
            "are stacked."
        )
    return out


def _from_path(
    keys: list[tuple[str, ...]], path: Any, axes: Any
) -> list[tuple[Entry, int | None]]:
    """Each leaf's entry and the depth of its stack's root: `axes` for the
    leaves whose `/`-joined path `path` matches, the root the key where the
    match ends.

    Raises:
      ValueError: if `path` or `axes` is not accepted, or `path` matches no
        leaf (naming a few paths).
    """
    try:
        pattern = re.compile(path)
    except (re.error, TypeError) as error:
        raise ValueError(
            f"`path` must be a regular expression; got {path!r}."
        ) from error
    if isinstance(axes, tuple) and axes:
        entry: Entry = _leaves.LayerAxes(*(_checks.axes(axes) or ()))
    else:  # () too: an int is what it takes
        entry = _checks.integer("axes", axes, minimum=0)
    out: list[tuple[Entry, int | None]] = [(0, None)] * len(keys)
    for i, k in enumerate(keys):
        match = pattern.search("/".join(k))
        if match is not None and entry != 0:
            starts = np.cumsum([0, *(len(key) + 1 for key in k)])[:-1]
            out[i] = (entry, int(np.sum(starts < match.end())))
    if keys and all(root is None for _, root in out) and entry != 0:
        joined = ["/".join(k) for k in keys]
        raise ValueError(
            f"`path`={path!r} matches no leaf of the tree; its paths include "
            f"{joined[:4]}."
        )
    return out


def stacked_prefix(
    tree: Any,
    *,
    axis_name: str | None = None,
    path: str | None = None,
    axes: int | tuple[int, ...] = 1,
) -> Any:
    """The `stacked=` prefix for a model's parameters: which axes of each leaf
    index stacked layers, with each stack's entry where the stack starts.

    With `axis_name`, from the logical axis names of each leaf: a Flax linen
    box's (`nn.with_logical_partitioning`; `nn.scan(...,
    metadata_params={nn.PARTITION_NAME: axis_name})` inserts `axis_name` at
    the scanned axis, which MaxText puts at 1), an NNX variable's
    (`out_sharding` metadata) or a haliax `NamedArray`'s. A stack is a highest
    subtree whose leaves all hold the same layers at the same axes, never
    above a haliax `Stacked`; a leaf without names in it (a bias not
    annotated) takes the axes its module's annotated leaves prove, and is an
    error where none does. With `path`, from a regular expression: a leaf
    whose `/`-joined key path matches it (`re.search`) gets `axes` (an int:
    that many leading axes; a tuple: those positions), others none, and its
    stack starts at the key where the match ends. The prefix fits the
    unboxed parameters and their updates (docs/stacked-layers.md).

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
        (naming a few paths), a leaf without names sits in a stack unproven
        (naming it and the fixes), `path` is not a regular expression, or
        `axes` is not accepted.

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
    named = lambda x: _leaves.is_box(x) or _leaves.is_wrapper(x)  # noqa: E731
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=named)
    keys = [tuple(_leaves.path_keys(p)) for p, _ in flat]
    if path is not None:
        leaves = _from_path(keys, path, axes)
    elif isinstance(axis_name, str) and axis_name:
        leaves = _from_names(tree, flat, keys, axis_name)
    else:
        raise ValueError(f"`axis_name` must be a logical axis name; got {axis_name!r}.")
    indices = treedef.unflatten(range(len(flat)))  # type: ignore[attr-defined]
    return _fold(indices, leaves)
