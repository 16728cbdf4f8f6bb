"""Where each leaf lives: mesh axes, collectives, and leaves whole on a device.

Inside `shard_map` or `pmap` a leaf is a local block. `specs` (the `in_specs`
given to `shard_map`) or `axis_name` say over which mesh axes each of its
dimensions is split; a sum over a leaf is completed over exactly the axes that
split the reduced dimensions (psum; pmax for a maximum), so that a replicated
leaf counts once. Under `jax.jit` over sharded arrays (GSPMD) neither is given:
XLA completes the sums itself, and `is_whole` tells which leaves may be
concatenated without resharding.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from clipax import _checks

MeshAxes = tuple[str, ...]
AxisName = str | Sequence[str] | None  # as the public functions take it
# For each leaf, the mesh axes that split each of its dimensions.
Placements = list[list[MeshAxes]]


def _is_spec(node: Any) -> bool:
    return node is None or isinstance(node, PartitionSpec)


def _spec_entries(spec: PartitionSpec | None, path: Any, ndim: int) -> list[MeshAxes]:
    """The mesh axes that split each dimension of a leaf, from its spec."""
    entries: list[MeshAxes] = [()] * ndim
    if spec is None:
        return entries
    if len(spec) > ndim:
        raise ValueError(
            f"`specs` gives {spec} to the leaf at {_checks.path_str(path)}, which "
            f"has rank {ndim}: a PartitionSpec may not be longer than the rank."
        )
    for dim, entry in enumerate(spec):
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            continue
        entries[dim] = (entry,) if isinstance(entry, str) else tuple(entry)
    return entries


def leaf_placements(
    leaves: _checks.Leaves, specs: Any, axis_name: MeshAxes
) -> Placements | None:
    """For each of `leaves`, the mesh axes that split each of its dimensions;
    None when neither `specs` nor `axis_name` (normalised by
    `_checks.axis_name`) is given.

    `specs` is a prefix of the tree: each PartitionSpec covers the leaves
    below it. `axis_name` splits every leaf (along an unknown dimension, which
    only a whole-leaf reduction can use; it is recorded on every dimension).
    """
    if specs is None and not axis_name:
        return None
    specs_of: list[Any] = [None] * len(leaves.arrays)
    if specs is not None:
        flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)[0]
        for path, spec in flat:
            if not _is_spec(spec):
                raise TypeError(
                    "`specs` must be a tree of jax.sharding.PartitionSpec (a prefix "
                    f"of the updates); at {_checks.path_str(path)} it holds "
                    f"{spec!r}."
                )
        entries = _checks.prefix_entries(
            "specs", specs, leaves, _is_spec, "PartitionSpec"
        )
        specs_of = [spec for spec, _ in entries]
    placements = []
    for path, leaf, spec in zip(leaves.paths, leaves.arrays, specs_of, strict=True):
        dims = _spec_entries(spec, path, leaf.ndim)
        if axis_name:
            dims = [tuple(dict.fromkeys(e + axis_name)) for e in dims]
            if leaf.ndim == 0:
                raise ValueError(
                    f"`axis_name` splits every leaf, but the leaf at "
                    f"{_checks.path_str(path)} is a scalar; use `specs` to mark it "
                    "replicated."
                )
        placements.append(dims)
    return placements


def split_axes(entries: list[MeshAxes], dims: Sequence[int] | None = None) -> MeshAxes:
    """The mesh axes that split any of the dimensions `dims` (all by default)."""
    names: dict[str, None] = {}
    for dim in range(len(entries)) if dims is None else dims:
        names.update(dict.fromkeys(entries[dim]))
    return tuple(sorted(names))


def layer_axes(leaves: _checks.Leaves, placements: Placements) -> list[MeshAxes]:
    """Per leaf, the mesh axes that split its stacked (layer) axes."""
    return [
        split_axes(dims, range(leaves.stacked_axes(i)))
        for i, dims in enumerate(placements)
    ]


def psum_each(
    values: list[jax.Array],
    axes: list[MeshAxes],
    varies_over: Sequence[Hashable] | None = None,
    op: Any = jax.lax.psum,
) -> list[jax.Array]:
    """`op` (psum, or pmax) of each value over its mesh `axes`.

    Values with the same axes travel in one collective, unless they vary over
    different mesh axes (`varies_over`, each value's): `shard_map`'s
    replication checks would then see them all as varying.
    """
    out = list(values)
    sets: dict[Any, list[int]] = {}
    for i, names in enumerate(axes):
        if names:
            key = (names, varies_over[i] if varies_over is not None else None)
            sets.setdefault(key, []).append(i)
    for (names, _), index in sets.items():
        if len(index) == 1:
            out[index[0]] = op(values[index[0]], names)
            continue
        flat = jnp.concatenate([jnp.ravel(values[i]) for i in index])
        reduced = op(flat, names)
        offset = 0
        for i in index:
            size = values[i].size
            out[i] = reduced[offset : offset + size].reshape(values[i].shape)
            offset += size
    return out


def pmax_everywhere(value: jax.Array, axes: Sequence[MeshAxes]) -> jax.Array:
    """pmax over every mesh axis in `axes`, in one collective.

    Max is idempotent, so a value already equal across some of these axes is
    unchanged by them: one pmax serves leaves of every axis set.
    """
    names = tuple(sorted(set().union(*axes)))
    return jax.lax.pmax(value, names) if names else value


def is_whole(x: Any) -> bool:
    """Whether `x` is known to be whole on every device that holds it, so that
    concatenating it with other such leaves moves no data between devices.

    True for a concrete array on one device or replicated; for a traced value
    whose abstract sharding names no mesh axis, when it is local to a
    `shard_map` or `pmap` body (every mesh axis manual) or replicated over an
    explicit mesh; and for any traced value when the process has a single
    device. False otherwise: under `jax.jit` with several devices and
    automatic mesh axes, a traced value's sharding is decided by XLA after
    tracing, so clipax cannot know it.
    """
    if not _checks.is_traced(x):
        sharding = getattr(x, "sharding", None)
        if sharding is None:  # a NumPy array: it is copied to one device anyway
            return True
        return len(sharding.device_set) == 1 or bool(sharding.is_fully_replicated)
    aval_sharding = getattr(jax.typeof(x), "sharding", None)
    if aval_sharding is not None:
        if any(entry is not None for entry in aval_sharding.spec):
            return False  # some dimension is split over a mesh axis
        mesh = aval_sharding.mesh
        if not mesh.empty:
            auto = jax.sharding.AxisType.Auto
            return all(kind != auto for kind in mesh.axis_types)
    return jax.device_count() == 1
