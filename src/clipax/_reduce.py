"""The norm engine: exact norms of pytrees, on one device or sharded.

Two concerns meet here, each solved once:

- Placement. Inside `shard_map` or `pmap`, a leaf is a local block. `specs`
  (the `in_specs` given to `shard_map`) or `axis_name` say over which mesh axes
  each leaf is split; a leaf's partial sum is combined over exactly those axes
  (psum for p-norms, pmax for the inf-norm), so replicated leaves count once.
  Leaves that share an axis set share one collective.
- Range. Squares of float32 values above ~1.8e19 overflow, and below ~1e-19
  they underflow. For the global norm, the fast pass sums |x|**p in float32
  (float64 for float64 leaves); only when that sum came out inf, or too small
  to trust, does a second pass run (under `lax.cond`, so the common path pays
  one scalar test). It scales every element by the same power of two, 2**-e
  with 2**e near the largest |x|, which is exact, sums again and scales back.
  Per-slice norms (`clip_by_norm`) instead keep three sums of squares in their
  one pass, of x, x 2**-80 and x 2**80, and take the one in range: a branch
  over thousands of leaves compiled far slower.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from clipax import _common, _fused

MeshAxes = tuple[str, ...]
AxisName = str | Sequence[str] | None


# Placement.


def normalize_axis_name(axis_name: AxisName) -> MeshAxes:
    """`axis_name` as a tuple of mesh-axis names; () for None."""
    if axis_name is None:
        return ()
    names: tuple[Any, ...] = ()
    if isinstance(axis_name, str):
        names = (axis_name,)
    elif isinstance(axis_name, (tuple, list)):
        names = tuple(axis_name)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(
            "`axis_name` must be None, a mesh-axis name, or a sequence of names; "
            f"got {axis_name!r}."
        )
    return names


def _is_spec(node: Any) -> bool:
    return node is None or isinstance(node, PartitionSpec)


def _spec_entries(spec: PartitionSpec | None, path: Any, ndim: int) -> list[MeshAxes]:
    """The mesh axes that split each dimension of a leaf, from its spec."""
    entries: list[MeshAxes] = [()] * ndim
    if spec is None:
        return entries
    if len(spec) > ndim:
        raise ValueError(
            f"`specs` gives {spec} to the leaf at {_common.path_str(path)}, which "
            f"has rank {ndim}: a PartitionSpec may not be longer than the rank."
        )
    for dim, entry in enumerate(spec):
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            continue
        entries[dim] = (entry,) if isinstance(entry, str) else tuple(entry)
    return entries


def leaf_placements(
    flat: list[tuple[Any, Any]], specs: Any, axis_name: AxisName
) -> list[list[MeshAxes]]:
    """For each leaf, the mesh axes that split each of its dimensions.

    `specs` is a prefix of the tree: each PartitionSpec covers the leaves
    below it. `axis_name` splits every leaf (along an unknown dimension, which
    only a whole-leaf reduction can use; it is recorded on every dimension).
    """
    names = normalize_axis_name(axis_name)
    table: dict[tuple[str, ...], PartitionSpec | None] = {}
    if specs is not None:
        for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)[
            0
        ]:
            if not _is_spec(spec):
                raise TypeError(
                    "`specs` must be a tree of jax.sharding.PartitionSpec (a prefix "
                    f"of the updates); at {_common.path_str(path)} it holds "
                    f"{spec!r}."
                )
            table[tuple(map(str, path))] = spec
    placements = []
    for path, leaf in flat:
        spec = None
        if specs is not None:
            key = tuple(map(str, path))
            for end in range(len(key), -1, -1):
                if key[:end] in table:
                    spec = table[key[:end]]
                    break
            else:
                raise ValueError(
                    f"`specs` has no PartitionSpec for the leaf at "
                    f"{_common.path_str(path)} (shape {tuple(leaf.shape)}); it must "
                    "be a prefix of the updates tree, as `in_specs` of shard_map."
                )
        entries = _spec_entries(spec, path, leaf.ndim)
        if names:
            entries = [tuple(dict.fromkeys(e + names)) for e in entries]
            if leaf.ndim == 0:
                raise ValueError(
                    f"`axis_name` splits every leaf, but the leaf at "
                    f"{_common.path_str(path)} is a scalar; use `specs` to mark it "
                    "replicated."
                )
        placements.append(entries)
    return placements


def reduced_mesh_axes(entries: list[MeshAxes], axes: Sequence[int]) -> MeshAxes:
    """The mesh axes that split any of the reduced dimensions `axes`."""
    names: dict[str, None] = {}
    for dim in axes:
        names.update(dict.fromkeys(entries[dim]))
    return tuple(sorted(names))


def _collective(
    values: list[jax.Array],
    groups: list[MeshAxes],
    op: Callable[..., jax.Array],
    buckets: Sequence[Any] | None = None,
) -> list[jax.Array]:
    """`op` (psum or pmax) of each value over its group's mesh axes.

    Values of one bucket (by default, one group) travel together in one
    collective. A bucket must hold values that vary over the same mesh axes,
    or shard_map's replication checks would see them all as varying.
    """
    out = list(values)
    by_bucket: dict[Any, list[int]] = {}
    for i, group in enumerate(groups):
        if group:
            key = (group, buckets[i] if buckets is not None else group)
            by_bucket.setdefault(key, []).append(i)
    for (group, _), index in by_bucket.items():
        if len(index) == 1:
            out[index[0]] = op(values[index[0]], group)
            continue
        flat = jnp.concatenate([jnp.ravel(values[i]) for i in index])
        reduced = op(flat, group)
        offset = 0
        for i in index:
            size = values[i].size
            out[i] = reduced[offset : offset + size].reshape(values[i].shape)
            offset += size
    return out


def _pmax_everywhere(values: jax.Array, groups: list[MeshAxes]) -> jax.Array:
    """pmax over every mesh axis any leaf is split over, in one collective.

    Max is idempotent, so a value already equal across some of these axes is
    unchanged by them: one pmax serves leaves of every axis set.
    """
    names = tuple(sorted(set().union(*groups)))
    return jax.lax.pmax(values, names) if names else values


# Range.


def _upcast(x: jax.Array) -> jax.Array:
    acc = _common.accum_dtype(x.dtype)
    if jnp.iscomplexobj(x):
        return x.astype(jnp.result_type(acc, jnp.complex64))
    return x.astype(acc)


def _trust_floor(dtype: np.dtype) -> float:
    """Sums below this may have lost terms to underflow: rescale them."""
    return float(np.sqrt(np.finfo(dtype).tiny))


def _exponent_bound(dtype: np.dtype) -> int:
    return int(np.finfo(dtype).maxexp) - 3


def _power_of_two_scale(peak: jax.Array) -> jax.Array:
    """2**-e with 2**e near `peak`: multiplying by it is exact."""
    _, exponent = jnp.frexp(peak)
    bound = _exponent_bound(peak.dtype)
    exponent = jnp.clip(exponent, -bound, bound)
    return jax.lax.stop_gradient(jnp.ldexp(jnp.ones_like(peak), -exponent))


def _finish(total: jax.Array, peak: jax.Array, inverse: jax.Array, p: float) -> Any:
    """The norm from a rescaled sum, with the peak's own rules for 0, inf, NaN."""
    norm = _common.safe_root(total, p) / inverse
    norm = jnp.where(peak == 0, jnp.zeros_like(norm), norm)
    return jnp.where(jnp.isfinite(peak), norm, peak)


def _branch(
    untrusted: jax.Array, rescaled: Callable[[], Any], fast: Callable[[], Any]
) -> Any:
    """`lax.cond` when traced; eagerly, the branch is chosen on the host, since
    an eager `lax.cond` over closures would compile anew at every call."""
    if _common.is_traced(untrusted):
        return jax.lax.cond(untrusted, rescaled, fast)
    return rescaled() if bool(untrusted) else fast()


# Global norms.


def global_norm(
    leaves: list[jax.Array], p: float, placements: list[list[MeshAxes]] | None = None
) -> jax.Array:
    """The p-norm over all `leaves`, exact for every finite input.

    With `placements`, leaves are local blocks and the result is the norm of
    the whole sharded tree, the same on every device.
    """
    dtype = _common.tree_accum_dtype(leaves)
    if not leaves:
        return jnp.zeros((), dtype)
    if placements is None:
        groups: list[MeshAxes] = [()] * len(leaves)
    else:
        groups = [reduced_mesh_axes(e, range(len(e))) for e in placements]
    by_group: dict[MeshAxes, list[jax.Array]] = {}
    for leaf, group in zip(leaves, groups, strict=True):
        by_group.setdefault(group, []).append(leaf)
    keys = list(by_group)

    def summed(scale: jax.Array | None = None) -> jax.Array:
        """Sum of |x * scale|**p over all leaves: one psum per axis set.

        Within an axis set, small leaves are reduced together (`_fused`).
        """
        sums = [
            jnp.sum(_fused.partial_sums(by_group[k], p, dtype, scale)) for k in keys
        ]
        return jnp.sum(jnp.stack(_collective(sums, keys, jax.lax.psum)))

    def peak() -> jax.Array:
        """Largest |x| over all leaves: one pmax for every axis set."""
        local = jnp.max(_fused.partial_sums(leaves, math.inf, dtype))
        return _pmax_everywhere(local, keys)

    if p == math.inf:
        return peak()

    total = summed()

    def rescaled() -> jax.Array:
        top = peak()
        inverse = _power_of_two_scale(top)
        return _finish(summed(inverse), top, inverse, p)

    untrusted = jnp.isposinf(total) | (total < _trust_floor(dtype))
    return _branch(untrusted, rescaled, lambda: _common.safe_root(total, p))


# Per-leaf (per-slice) norms.


# Per-slice norms are taken in one pass with three accumulators: the squares of
# x, of x * 2**-SHIFT (for sums that overflow) and of x * 2**SHIFT (for sums that
# underflow); XLA fuses the three sibling reductions into one read of x. Many
# small leaves then compile without the branch a second pass would need.
SHIFT = 80


def _three_sums(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """Sums of |x|**2, |x 2**-SHIFT|**2 and |x 2**SHIFT|**2 over `axes`, stacked.

    The result has a new leading axis of 3 and keeps `axes` as size-1 dims.
    """
    acc = _common.accum_dtype(x.dtype)
    sums = [_common.power_sum(_fused.opaque_if_narrow(x), 2.0, axes)]
    for shift in (-SHIFT, SHIFT):
        # Each scaled sum takes the leaf through a barrier of its own with its
        # scale (see `_fused.scaled_pair`): a narrow leaf's float32 upcast is
        # then fused into each reduction, never written out.
        leaf, scale = _fused.scaled_pair(x, jnp.asarray(2.0**shift, acc))
        sums.append(_common.power_sum(_upcast(leaf) * scale, 2.0, axes))
    return jnp.stack(sums)


def _norm_in_range(sums: jax.Array) -> jax.Array:
    """The L2 norm from the three sums: the one that neither overflowed nor
    underflowed, scaled back (exact: the scales are powers of two)."""
    plain, down, up = sums[0], sums[1], sums[2]
    floor = _trust_floor(plain.dtype)
    norm = _common.safe_root(plain, 2.0)
    norm = jnp.where(
        jnp.isposinf(plain), _common.safe_root(down, 2.0) * 2.0**SHIFT, norm
    )
    return jnp.where(plain < floor, _common.safe_root(up, 2.0) * 2.0**-SHIFT, norm)


def slice_norms(
    leaves: list[jax.Array],
    leaf_axes: list[tuple[int, ...]],
    placements: list[list[MeshAxes]] | None = None,
) -> list[jax.Array]:
    """Each leaf's L2 norm over its `leaf_axes` (kept as size-1 dims).

    Exact for every finite input, in one pass over each leaf and with no
    branch. With `placements`, the sums over sharded dimensions are completed
    across devices (one psum per axis set).
    """
    if not leaves:
        return []
    groups: list[MeshAxes] = [()] * len(leaves)
    buckets: list[MeshAxes] = groups
    if placements is not None:
        pairs = zip(placements, leaf_axes, strict=True)
        groups = [reduced_mesh_axes(e, a) for e, a in pairs]
        buckets = [reduced_mesh_axes(e, range(len(e))) for e in placements]
    sums = [_three_sums(x, a) for x, a in zip(leaves, leaf_axes, strict=True)]
    sums = _collective(sums, groups, jax.lax.psum, buckets)
    return [_norm_in_range(s) for s in sums]


def leaf_peak_norms(
    norms: list[jax.Array], placements: list[list[MeshAxes]] | None
) -> list[jax.Array]:
    """The largest slice norm of each leaf, the same on every device."""
    peaks = [jnp.max(n, initial=0.0) for n in norms]
    if placements is None or not peaks:
        return peaks
    groups = [reduced_mesh_axes(e, range(len(e))) for e in placements]
    dtype = jnp.result_type(*peaks)
    everywhere = _pmax_everywhere(jnp.stack(peaks).astype(dtype), groups)
    return [everywhere[i].astype(n.dtype) for i, n in enumerate(peaks)]
