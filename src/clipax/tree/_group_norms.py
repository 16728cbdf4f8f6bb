"""Norms of a pytree's groups of leaves (layers, modules), as a flat mapping."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from clipax import _checks, _engine, _leaves
from clipax._metrics import SEPARATOR, Metrics


def whole_layer_norms(leaves: _leaves.Leaves, p: float) -> list[jax.Array]:
    """Each leaf's exact norms per layer, the layers on other devices
    gathered (in the spec's order of mesh axes)."""
    out = []
    for leaf, n in zip(leaves, _engine.layer_norms(leaves, p, exact=True), strict=True):
        for dim, axis in enumerate(leaf.layer_axes):
            if leaf.dims and leaf.dims[axis]:
                n = _engine.gathered(n, dim, leaf.dims[axis])
        out.append(n)
    return out


def grouped(
    members: list, leaves: _leaves.Leaves, depth: int | None, wanted: list | None
) -> dict[str, list[int]]:
    """Each group's name and its members' places (`flat_keys`): by the first
    `depth` keys, or under the longest of the `wanted` prefixes (a member
    under none in no group).

    Raises:
      ValueError: naming the leaves, if a key holding `/` makes a prefix
        ambiguous or two groups one name.
    """
    columns: dict[str, list[int]] = {}
    entries: dict[str, tuple[tuple[str, ...], int]] = {}  # key entries, first leaf
    for i, keys, place in members:
        if wanted is None:
            group = tuple(keys[: depth or 1])
        else:
            joined = SEPARATOR.join(keys)
            by_text = [
                q for q in wanted if f"{joined}/".startswith(SEPARATOR.join(q) + "/")
            ]
            match = [q for q in wanted if tuple(keys[: len(q)]) == q]
            if by_text[:1] != match[:1]:
                said = SEPARATOR.join((by_text or match)[0])
                raise ValueError(
                    f"The leaf at {_leaves.path_str(leaves[i].path)} has a key holding "
                    f"{SEPARATOR!r}, so whether it is under the `prefixes` entry "
                    f"{said!r} is ambiguous: its path {joined!r} reads one way, its "
                    f"key entries {keys} another. Rename the key so that it holds no "
                    f"{SEPARATOR!r}."
                )
            if not match:
                continue
            group = match[0]
        name = SEPARATOR.join(group) or "root"
        seen, first = entries.setdefault(name, (group, i))
        if seen != group:
            raise ValueError(
                f"`group_norms` got the leaves at "
                f"{_leaves.path_str(leaves[first].path)} and "
                f"{_leaves.path_str(leaves[i].path)}, whose groups at "
                f"`depth`={depth or 1} both write as {name!r}: a dict key holding "
                f"{SEPARATOR!r} reads as two path entries, and one norm would hide the "
                f"other. Rename the key so that it holds no {SEPARATOR!r}."
            )
        columns.setdefault(name, []).append(place)
    return columns


def group_norms(
    tree: chex.ArrayTree,
    *,
    depth: int | None = None,
    prefixes: Sequence[str] | None = None,
    key_prefix: str = "",
    ord: float = 2,
    stacked: Any = None,
    axis_name: str | Sequence[str] | None = None,
    specs: Any = None,
) -> Metrics:
    """The norm of each group of leaves of `tree`, e.g. per layer or module.

    A leaf's path is its key path joined with `/` (`dense/kernel`; sequence
    entries give their index). Leaves are grouped by the first `depth` entries
    of their path (1 when neither is given), or under the longest of
    `prefixes` that starts their path (whole entries: `layers/1` holds
    `layers/1/w`, not `layers/10/w`; leaves under none are left out). Each
    group's norm is exact, so the groups' norms combine to the global norm.
    With `stacked`, each layer of a stacked leaf is a tensor, its index a
    path entry right after the node of its `stacked=` entry
    (docs/stacked-layers.md). Jittable, ready to merge with `clipax.metrics`
    (docs/skipping-and-logging.md).

    Args:
      tree: a pytree of float16, bfloat16, float32, float64 or complex arrays.
      depth: group by the first `depth` path entries, an int >= 1.
      prefixes: group under these `/`-separated paths.
      key_prefix: put before every key, e.g. `"grads"`.
      ord: the norm's order: 2 (default), 1, `inf`, or a real p >= 1.
      stacked: None, or a prefix of `tree` (docs/stacked-layers.md).
      axis_name: as for `clipax.tree.global_norm`.
      specs: as for `clipax.tree.global_norm`.

    Returns:
      A `clipax.Metrics` from key to a float32 scalar (float64 for float64
      leaves), in the order of the leaves.

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
      >>> float(norms["grads/layers/1/norm"])
      2.0
    """
    if depth is not None and prefixes is not None:
        raise ValueError("Give `depth` or `prefixes`, not both.")
    if depth is not None:
        depth = _checks.integer("depth", depth)
    wanted = None
    if prefixes is not None:
        wanted = sorted(
            _checks.key_paths("prefixes", prefixes, SEPARATOR), key=len, reverse=True
        )
    p = _checks.order(ord)
    leaves = _leaves.reader(
        "group_norms", stacked=stacked, specs=specs, axis_name=axis_name
    )(tree)
    norms = whole_layer_norms(leaves, p)
    vectors = [n.reshape(-1) for n in norms]
    members = _leaves.flat_keys(
        [leaf.path for leaf in leaves], [n.shape for n in norms], leaves.stacks.depths
    )
    columns = grouped(members, leaves, depth, wanted)
    for q in wanted or ():
        if not any(tuple(keys[: len(q)]) == q for _, keys, _ in members):
            tops = sorted({keys[0] for _, keys, _ in members if keys})
            raise ValueError(
                f"`prefixes` entry {SEPARATOR.join(q)!r} matches no leaf of the tree, "
                f"whose paths start with {tops}: a logger would never see its norm."
            )
    # The groups as columns, zeros below (they change no p-norm), then one
    # exact norm of every column.
    table = np.full(
        (max(map(len, columns.values()), default=0), len(columns)),
        sum(v.size for v in vectors),
    )
    for g, column in enumerate(columns.values()):
        table[: len(column), g] = column
    dtype = _engine.tree_accum_dtype(leaves.arrays)
    values = jnp.concatenate([*(v.astype(dtype) for v in vectors), jnp.zeros(1, dtype)])
    totals = _engine.norm_of_norms(values[table], p)
    head = f"{key_prefix}{SEPARATOR}" if key_prefix else ""
    return Metrics(
        [totals],
        {f"{head}{name}{SEPARATOR}norm": (0, g) for g, name in enumerate(columns)},
    )
