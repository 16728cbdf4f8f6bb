"""Norms of a pytree's groups of leaves (layers, modules), as a flat dict."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp

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
    stacked: Any = None,
    axis_name: _placement.AxisName = None,
    specs: Any = None,
) -> dict[str, jax.Array]:
    """The norm of each group of leaves of `tree`, e.g. per layer or module.

    A leaf's path is its key path joined with `/` (`dense/kernel`; sequence
    entries give their index). Leaves are grouped by the first `depth` entries of
    their path (1 when neither is given), or under the longest of `prefixes` that
    starts their path (whole entries: `layers/1` holds `layers/1/w`, not
    `layers/10/w`; leaves under none are left out). Each group's norm is taken by
    clipax's exact engine, so the groups' norms combine to the global norm. With
    `stacked`, each layer of a stacked leaf is a leaf of its own, its index a
    path entry where the stacked subtree starts (`layers/0/attn/kernel`), and
    its norm a per-tensor norm (docs/stacked-layers.md). The result is a flat
    dict from `"<group>/norm"` to a scalar, jittable, ready to merge with
    `clipax.metrics` (docs/skipping-and-logging.md).

    Args:
      tree: a pytree of float16, bfloat16, float32, float64 or complex arrays.
      depth: group by the first `depth` path entries, an int >= 1.
      prefixes: group under these `/`-separated paths.
      key_prefix: put before every key, e.g. `"grads"`.
      ord: the norm's order: 2 (default), 1, `inf`, or a real p >= 1.
      stacked: None, or a prefix of `tree` holding, per subtree, how many
        leading axes index stacked layers, or a callable that returns one.
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
    _, names = _checks.axes_and_axis_name(None, axis_name, stacked)
    leaves = _checks.norm_leaves(tree, "group_norms", stacked)
    placements = _placement.leaf_placements(leaves, specs, names)
    wanted = None
    if prefixes is not None:
        wanted = sorted(
            (tuple(q.strip(SEPARATOR).split(SEPARATOR)) for q in prefixes),
            key=len,
            reverse=True,
        )
    # Members: (leaf, layer) pairs, the layer None for a leaf not stacked.
    count = len(leaves.arrays)
    layer_shapes = [leaves.layers(i) for i in range(count)]
    if placements is not None:  # local blocks: count every device's layers
        layer_shapes = [
            tuple(
                n * int(jax.lax.psum(1, placements[i][d])) if placements[i][d] else n
                for d, n in enumerate(shape)
            )
            for i, shape in enumerate(layer_shapes)
        ]
    members = _checks.unrolled(
        leaves.paths, layer_shapes, leaves.depths or (0,) * count
    )
    groups: dict[str, list[int]] = {}
    entries: dict[str, tuple[str, ...]] = {}  # each group's name -> its entries
    for m, (i, _, segments) in enumerate(members):
        path = leaves.paths[i]
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
            first = leaves.paths[members[groups[name][0]][0]]
            raise ValueError(
                f"`group_norms` got the leaves at {_checks.path_str(first)} and "
                f"{_checks.path_str(path)}, whose groups at `depth`={depth or 1} both "
                f"write as {name!r}: a dict key holding {SEPARATOR!r} reads as two "
                f"path entries, and one norm would hide the other. Rename the key "
                f"so that it holds no {SEPARATOR!r}."
            )
        groups.setdefault(name, []).append(m)
    for q in wanted or []:
        if not any(tuple(segments[: len(q)]) == q for _, _, segments in members):
            tops = sorted({segments[0] for _, _, segments in members if segments})
            raise ValueError(
                f"`prefixes` entry {SEPARATOR.join(q)!r} matches no leaf of the "
                f"tree, whose paths start with {tops}: a logger would never see "
                "its norm."
            )
    layer_norms = _stacked_layer_norms(leaves, p, placements)
    out = {}
    head = f"{key_prefix}{SEPARATOR}" if key_prefix else ""
    for name, group_members in groups.items():
        whole = [members[m][0] for m in group_members if members[m][1] is None]
        where = None if placements is None else [placements[i] for i in whole]
        norm = _engine.global_norm([leaves.arrays[i] for i in whole], p, where)
        layers = [
            _engine.entry(layer_norms[leaf], index)
            for leaf, index, _ in (members[m] for m in group_members)
            if index is not None
        ]
        if layers:
            norm = _engine.norm_of_norms(
                jnp.stack([norm.astype(layers[0].dtype), *layers]), p
            )
        out[f"{head}{name}{SEPARATOR}norm"] = norm
    return out


def _gathered(values: jax.Array, dim: int, names: tuple[str, ...]) -> jax.Array:
    """`values`, split along `dim` over the mesh axes `names`, whole on every
    device: each device's block put in its place in zeros, then summed."""
    local = values.shape[dim]
    count = int(jax.lax.psum(1, names))  # the number of blocks, known when traced
    whole = jnp.zeros((*values.shape[:dim], local * count, *values.shape[dim + 1 :]))
    start = jax.lax.axis_index(names) * local
    placed = jax.lax.dynamic_update_slice_in_dim(
        whole.astype(values.dtype), values, start, dim
    )
    return jax.lax.psum(placed, names)


def _stacked_layer_norms(
    leaves: _checks.Leaves, p: float, placements: _placement.Placements | None
) -> dict[int, jax.Array]:
    """Each stacked leaf's per-layer p-norms, one reduction over its inner
    axes, completed over the mesh axes that split them; where its layers are
    split across devices, gathered, so that every device has every layer's."""
    out = {}
    for i, x in enumerate(leaves.arrays):
        k = leaves.stacked_axes(i)
        if not k:
            continue
        x = jnp.asarray(x)
        sums = _engine.power_sum(x, p, leaves.inner(i)).reshape(x.shape[:k])
        if placements is not None:
            inner = _placement.split_axes(placements[i], leaves.inner(i))
            if inner:
                reduce = jax.lax.pmax if p == math.inf else jax.lax.psum
                sums = reduce(sums, inner)
            for dim in range(k):
                if placements[i][dim]:
                    sums = _gathered(sums, dim, placements[i][dim])
        out[i] = _engine.safe_root(sums, p)
    return out
