"""`stacked_prefix`: the `stacked=` prefix of a model whose layers are stacked."""

from __future__ import annotations

import re
from typing import Any

import jax

from clipax import _checks

PyTree = Any


def _is_box(node: Any) -> bool:
    """A Flax metadata box (`nn.LogicallyPartitioned`, `nn.Partitioned`)."""
    return hasattr(node, "names") and hasattr(node, "unbox")


def _gathered(node: PyTree, root: bool = True) -> PyTree:
    """`node`, a tree of ints, with each subtree below the root whose leaves
    all hold one int replaced by it: the int then sits where the stacked
    module starts, and a layer index goes there (`blocks/0/...`)."""
    if isinstance(node, int) or node is None:
        return node
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        node, is_leaf=lambda x: x is not node
    )
    children = [_gathered(child, root=False) for _, child in flat]
    counts = [c for c in children if c is not None]
    uniform = all(isinstance(c, int) for c in counts) and len(set(counts)) == 1
    if not root and uniform:
        return counts[0]
    return jax.tree.unflatten(treedef, children)


def stacked_prefix(
    tree: PyTree,
    *,
    axis_name: str | None = None,
    path: str | None = None,
    axes: int = 1,
) -> PyTree:
    """The `stacked=` prefix for a model's parameters: how many leading axes of
    each leaf index stacked layers.

    With `axis_name`, from Flax's logical axis names: `tree` is what a linen
    model's `init` returns with `nn.with_logical_partitioning` boxes, and
    `nn.scan(..., metadata_params={nn.PARTITION_NAME: axis_name})` puts
    `axis_name` first among a scanned parameter's names; a leaf gets the
    number of leading names equal to `axis_name` (2 for nested scans), and a
    leaf without names (a bias not annotated) that of the annotated leaves
    beside it, where they agree. With `path`, from a regular expression: a
    leaf whose `/`-joined key path matches it (`re.search`) gets `axes`,
    others 0. A subtree whose leaves share a count holds it once, at the root
    of the stacked module, where `metrics` and `group_norms` put the layer
    index (`blocks/0/...`); the prefix fits the unboxed parameters and their
    updates (docs/stacked-layers.md).

    Args:
      tree: the parameters (boxed, for `axis_name`), or the updates.
      axis_name: the logical name of the stacked axis, e.g. `"layers"`.
      path: a regular expression on the leaves' key paths, e.g.
        `"^params/blocks/"`.
      axes: with `path`, how many leading axes a matching leaf stacks, >= 0.

    Returns:
      A pytree of ints, one per leaf, for `stacked=`.

    Raises:
      ValueError: if not exactly one of `axis_name` and `path` is given, or
        `path` is not a regular expression, or `axes` is not an int >= 0.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> params = {"embed": jnp.ones((8, 4)), "blocks": {"w": jnp.ones((3, 4, 4))}}
      >>> clipax.stacked_prefix(params, path="^blocks/")
      {'blocks': 1, 'embed': 0}
    """
    if (axis_name is None) == (path is None):
        raise ValueError("Give `axis_name` or `path` to `stacked_prefix`, one of them.")
    if axis_name is not None:
        if not isinstance(axis_name, str) or not axis_name:
            raise ValueError(
                f"`axis_name` must be a logical axis name; got {axis_name!r}."
            )
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_box)
        counts: list[int | None] = []
        for _, leaf in flat:
            if not _is_box(leaf):
                counts.append(None)
                continue
            names = tuple(leaf.names)
            counts.append(
                next((i for i, n in enumerate(names) if n != axis_name), len(names))
            )
        beside: dict[tuple[str, ...], set[int]] = {}
        for (key_path, _), count in zip(flat, counts, strict=True):
            if count is not None:
                beside.setdefault(tuple(_checks.path_keys(key_path)[:-1]), set()).add(
                    count
                )
        out = []
        for (key_path, _), count in zip(flat, counts, strict=True):
            if count is None:
                found = beside.get(tuple(_checks.path_keys(key_path)[:-1]), set())
                count = found.pop() if len(found) == 1 else 0
            out.append(count)
        return _gathered(jax.tree.unflatten(treedef, out))
    if not isinstance(path, str):
        raise ValueError(f"`path` must be a regular expression; got {path!r}.")
    try:
        pattern = re.compile(path)
    except re.error as error:
        raise ValueError(
            f"`path` must be a regular expression; got {path!r}."
        ) from error
    axes = _checks.count("axes", axes, minimum=0)
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    counts = [
        axes if pattern.search("/".join(_checks.path_keys(p))) else 0 for p, _ in flat
    ]
    return _gathered(jax.tree.unflatten(treedef, counts))
