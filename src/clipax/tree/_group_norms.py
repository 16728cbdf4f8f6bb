"""Norms of a pytree's groups of leaves (layers, modules), as a flat dict."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import chex
import jax

from clipax import _checks, _engine, _placement

SEPARATOR = "/"


def _check_prefix_match(
    path: _checks.KeyPath,
    segments: list[str],
    wanted: list[tuple[str, ...]],
    match: list[tuple[str, ...]],
) -> None:
    """ValueError where the leaf's entries and its `/`-joined path disagree on
    the prefix it is under: a key holding `/`, which no grouping reads right."""
    joined = SEPARATOR.join(segments)
    by_text = [
        q
        for q in wanted
        if joined == SEPARATOR.join(q) or joined.startswith(SEPARATOR.join(q) + "/")
    ]
    if by_text[:1] != match[:1]:
        said = SEPARATOR.join(by_text[0]) if by_text else SEPARATOR.join(match[0])
        raise ValueError(
            f"The leaf at {_checks.path_str(path)} has a key holding {SEPARATOR!r}, "
            f"so whether it is under the `prefixes` entry {said!r} is ambiguous: "
            f"its path {joined!r} reads one way, its key entries {segments} "
            f"another. Rename the key so that it holds no {SEPARATOR!r}."
        )


def group_norms(
    tree: chex.ArrayTree,
    *,
    depth: int | None = None,
    prefixes: Sequence[str] | None = None,
    key_prefix: str = "",
    ord: float = 2,
    axis_name: _placement.AxisName = None,
    specs: Any = None,
) -> dict[str, jax.Array]:
    """The norm of each group of leaves of `tree`, e.g. per layer or module.

    A leaf's path is its key path joined with `/` (`dense/kernel`; sequence
    entries give their index). Leaves are grouped by the first `depth` entries of
    their path (1 when neither is given), or under the longest of `prefixes` that
    starts their path (whole entries: `layers/1` holds `layers/1/w`, not
    `layers/10/w`; leaves under none are left out). Each group's norm is taken by
    clipax's exact engine, so the groups' norms combine to the global norm. The
    result is a flat dict from `"<group>/norm"` to a scalar, jittable, ready to
    merge with `clipax.metrics` (docs/skipping-and-logging.md).

    Args:
      tree: a pytree of float16, bfloat16, float32, float64 or complex arrays.
      depth: group by the first `depth` path entries, an int >= 1.
      prefixes: group under these `/`-separated paths.
      key_prefix: put before every key, e.g. `"grads"`.
      ord: the norm's order: 2 (default), 1, `inf`, or a real p >= 1.
      axis_name: as for `clipax.tree.global_norm`.
      specs: as for `clipax.tree.global_norm`.

    Returns:
      A dict from key to a float32 scalar (float64 for float64 leaves), in the
      order of the leaves.

    Raises:
      ValueError: if an argument is not accepted, both `depth` and `prefixes`
        are given, or a dict key holding `/` makes two groups one key or a
        prefix ambiguous (naming the leaves).
      TypeError: if a leaf is not a float array.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> grads = {
      ...     "embed": {"table": jnp.array([3.0, 4.0])},
      ...     "layers": [{"w": jnp.array([1.0])}, {"w": jnp.array([0.0, 2.0])}],
      ... }
      >>> norms = clipax.tree.group_norms(grads, depth=2, key_prefix="grads")
      >>> list(norms)
      ['grads/embed/table/norm', 'grads/layers/0/norm', 'grads/layers/1/norm']
      >>> norms["grads/layers/1/norm"]
      Array(2., dtype=float32)
    """
    if depth is not None and prefixes is not None:
        raise ValueError("Give `depth` or `prefixes`, not both.")
    if depth is not None:
        depth = _checks.count("depth", depth)
    if prefixes is not None:
        prefixes = _checks.key_paths("prefixes", prefixes, SEPARATOR)
    p = _checks.order(ord)
    names = _checks.axis_name(axis_name)
    leaves = _checks.norm_leaves(tree, "group_norms")
    flat = list(zip(leaves.paths, leaves.arrays, strict=True))
    placements = _placement.leaf_placements(leaves, specs, names)
    wanted = None
    if prefixes is not None:
        wanted = sorted(
            (tuple(q.strip(SEPARATOR).split(SEPARATOR)) for q in prefixes),
            key=len,
            reverse=True,
        )
    groups: dict[str, list[int]] = {}
    entries: dict[str, tuple[str, ...]] = {}  # each group's name -> its entries
    for i, (path, _) in enumerate(flat):
        segments = _checks.path_keys(path)
        if wanted is None:
            group = tuple(segments[: depth or 1])
        else:
            match = [q for q in wanted if tuple(segments[: len(q)]) == q]
            _check_prefix_match(path, segments, wanted, match)
            if not match:
                continue
            group = match[0]
        name = SEPARATOR.join(group) or "root"
        if entries.setdefault(name, group) != group:
            first = flat[groups[name][0]][0]
            raise ValueError(
                f"`group_norms` got the leaves at {_checks.path_str(first)} and "
                f"{_checks.path_str(path)}, whose groups at `depth`={depth or 1} both "
                f"write as {name!r}: a dict key holding {SEPARATOR!r} reads as two "
                f"path entries, and one norm would hide the other. Rename the key "
                f"so that it holds no {SEPARATOR!r}."
            )
        groups.setdefault(name, []).append(i)
    for q in wanted or []:
        if not any(tuple(_checks.path_keys(path)[: len(q)]) == q for path, _ in flat):
            tops = sorted(
                {SEPARATOR.join(_checks.path_keys(path)[:1]) for path, _ in flat}
            )
            raise ValueError(
                f"`prefixes` entry {SEPARATOR.join(q)!r} matches no leaf of the "
                f"tree, whose paths start with {tops}: a logger would never see "
                "its norm."
            )
    out = {}
    head = f"{key_prefix}{SEPARATOR}" if key_prefix else ""
    for name, members in groups.items():
        where = None if placements is None else [placements[i] for i in members]
        arrays = [flat[i][1] for i in members]
        out[f"{head}{name}{SEPARATOR}norm"] = _engine.global_norm(arrays, p, where)
    return out
