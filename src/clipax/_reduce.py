"""The norm engine: exact norms of pytrees, on one device or sharded.

The data's path: a global norm (`global_norm`) sums |x|**p over all leaves in
float32 (`_fused.partial_sums` reduces small leaves together), completes the
sum across devices, and tests it once: inf, or below `_trust_floor`, sends it
under `lax.cond` to a rescaled pass. Per-slice norms (`slice_norms`, for
`clip_by_norm`) take one float32 sum of squares per slice, the bare formula's,
and one scalar test over the whole tree decides under one `lax.cond` whether
the shifted sums that repair overflow and underflow are taken.

Two concerns meet here, each solved once:

- Placement. Inside `shard_map` or `pmap`, a leaf is a local block. `specs`
  (the `in_specs` given to `shard_map`) or `axis_name` say over which mesh axes
  each leaf is split; a leaf's partial sum is combined over exactly those axes
  (psum for p-norms, pmax for the inf-norm), so replicated leaves count once.
  Leaves that share an axis set share one collective.
- Range. Squares of float32 values above ~1.8e19 overflow, and below ~1e-19
  they underflow. The common path pays one scalar test; only inputs at those
  extremes (or all-zero slices, for per-slice norms) take the second pass.
  For the global norm it scales every element by the same power of two, 2**-e
  with 2**e near the largest |x|; for per-slice norms it sums the squares of
  x 2**-80 and x 2**80 and keeps the one in range. Both are exact.
"""

from __future__ import annotations

import functools
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
    members: dict[MeshAxes, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    keys = list(members)

    def summed(leaves: list[jax.Array], scale: jax.Array) -> jax.Array:
        """Sum of |x * scale|**p over all leaves: one psum per axis set.

        Within an axis set, small leaves are reduced together (`_fused`).
        """
        sums = [
            jnp.sum(
                _fused.partial_sums([leaves[i] for i in members[k]], p, dtype, scale)
            )
            for k in keys
        ]
        return jnp.sum(jnp.stack(_collective(sums, keys, jax.lax.psum)))

    def peak() -> jax.Array:
        """Largest |x| over all leaves: one pmax for every axis set."""
        local = jnp.max(_fused.partial_sums(leaves, math.inf, dtype))
        return _pmax_everywhere(local, keys)

    if p == math.inf:
        return peak()
    if p > 2:
        # Rare orders: a peak pass, then one sum rescaled by it (two passes).
        top = peak()
        inverse = _power_of_two_scale(top)
        return _finish(summed(leaves, inverse), top, inverse, p)
    # Inside shard_map, the sum varies over the mesh axes its leaves vary
    # over, less those it is psummed over; the loop's carry must say so.
    varying = frozenset().union(
        *(_varying(leaves[i]) - set(k) for k in keys for i in members[k])
    )
    zeros = _vary(jnp.zeros((), dtype), varying)
    floor = _trust_floor(dtype)
    return _two_passes(
        summed,
        leaves,
        zeros,
        lambda total: _next_scale(total, p),
        lambda total: jnp.isposinf(total) | (total < floor),
        p,
        lambda scale: [scale] * len(leaves),
    )


def _varying(x: jax.Array) -> frozenset[str]:
    """The manual mesh axes over which `x` varies inside `shard_map`."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(manual.varying) if manual is not None else frozenset()


def _vary(x: jax.Array, names: frozenset[str]) -> jax.Array:
    """`x` typed as varying over `names` (shard_map's replication check)."""
    missing = tuple(sorted(names - _varying(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _vary_like(x: jax.Array, like: Any) -> jax.Array:
    """`x` typed as varying over the mesh axes `like` (an abstract value) does."""
    manual = getattr(like, "manual_axis_type", None)
    return _vary(x, frozenset(manual.varying) if manual is not None else frozenset())


def _next_scale(total: jax.Array, p: float) -> jax.Array:
    """The power of two by which a second pass scales every element, from the
    first pass's `total` (inf, or below `_trust_floor`), for 1 <= p <= 2.

    With E = log2 of the dtype's overflow threshold (128 for float32) and up
    to 2**40 elements: an overflowed sum has |x| < 2**E, so scaling by
    2**-(E - (E-40)//p) keeps every |x s|**p below 2**(E-40) and the new sum in
    range, and what drops below the smallest normal is negligible beside it.
    A sum below the floor bounds the peak: |x| <= m = max(total**(1/p),
    tiny**(1/p)) (a larger term would have been kept); scaling by 2**(c - e),
    2**e > m, puts the peak below 2**c = 2**((E-40)//p - 1) and lifts every
    nonzero |x| (subnormals included) to where its power is a normal float.
    """
    info = np.finfo(total.dtype)
    big, tiny = int(info.maxexp), -int(np.log2(info.tiny))
    headroom = math.floor((big - 40) / p)
    down = jnp.asarray(2.0 ** -(big - headroom), total.dtype)
    bound = jnp.maximum(_common.safe_root(total, p), 2.0 ** (-tiny / p))
    _, exponent = jnp.frexp(bound)
    limit = _exponent_bound(total.dtype)
    up = jnp.ldexp(
        jnp.ones_like(total), jnp.clip(headroom - 1 - exponent, -limit, limit)
    )
    return jnp.where(jnp.isposinf(total), down, up)


def _two_passes(
    summed: Callable[[list[jax.Array], Any], Any],
    leaves: list[jax.Array],
    zeros: Any,
    rescale: Callable[[Any], Any],
    untrusted: Callable[[Any], jax.Array],
    p: float,
    spread: Callable[[Any], list[jax.Array]],
) -> Any:
    """Norms from `summed(leaves, scales)`, the sums of |x scale|**p (a pytree
    like `zeros`, typed as the sums are): one pass at scale 1, and a second at
    `rescale(sums)` only when `untrusted(sums)` (a scalar, the same on every
    device) says that some sum is inf or below `_trust_floor`;
    `spread(scales)` gives each leaf's scale (broadcastable to it).

    Under a trace the passes are the iterations (two at most) of one
    `lax.while_loop`: the tree's reductions are compiled once, where a
    `lax.cond` would compile them twice (benchmarks/RESULTS.md). A while loop
    cannot be differentiated in reverse mode, so the norms' derivative is,
    through `jax.custom_jvp`, that of the last pass's formula at its scales
    (constants). Eagerly, the host decides whether to take the second pass.
    """
    ones = jax.tree.map(lambda z: z + 1, zeros)

    def passes(leaves: list[jax.Array]) -> tuple[Any, Any]:
        """(sums, scales) of the last pass."""
        if not any(_common.is_traced(x) for x in leaves):
            sums = summed(leaves, ones)
            if not bool(untrusted(sums)):
                return sums, ones
            scales = rescale(sums)
            return summed(leaves, scales), scales

        def again(carry: tuple) -> jax.Array:
            count, _, _, flag = carry
            return (count == 0) | ((count == 1) & flag)

        def one_pass(carry: tuple) -> tuple:
            count, _, sums, _ = carry
            first = count == 0
            scales = jax.tree.map(
                lambda one, new: jnp.where(first, one, new), ones, rescale(sums)
            )
            sums = summed(leaves, scales)
            return count + 1, scales, sums, untrusted(sums)

        flag = jax.eval_shape(untrusted, zeros)  # its type in shard_map
        start = (jnp.int32(0), ones, zeros, _vary_like(jnp.bool_(True), flag))
        _, scales, sums, _ = jax.lax.while_loop(again, one_pass, start)
        return sums, scales

    def roots(sums: Any, scales: Any) -> Any:
        return jax.tree.map(lambda s, c: _common.safe_root(s, p) / c, sums, scales)

    @jax.custom_jvp
    def norms(leaves: list[jax.Array]) -> Any:
        return roots(*passes(leaves))

    @norms.defjvp
    def norms_jvp(primals: tuple, tangents: tuple) -> tuple[Any, Any]:
        # With y = x s (s the last pass's scale, a constant), a norm is
        # R(y) / s and its tangent R'(y) s dx / s = R'(y) dx: taken on the
        # scaled leaves, whose derivatives are of moderate size, the tangent
        # (and its transpose, in reverse mode) neither overflows nor
        # underflows where x is extreme.
        scales = jax.lax.stop_gradient(passes(primals[0])[1])
        scaled = [
            _upcast(x) * c for x, c in zip(primals[0], spread(scales), strict=True)
        ]
        dots = [t.astype(y.dtype) for t, y in zip(tangents[0], scaled, strict=True)]
        unit, slope = jax.jvp(
            lambda ys: roots(summed(ys, ones), ones), (scaled,), (dots,)
        )
        return jax.tree.map(jnp.divide, unit, scales), slope

    return norms(list(leaves))


# Per-leaf (per-slice) norms.


def slice_norms(
    leaves: list[jax.Array],
    leaf_axes: list[tuple[int, ...]],
    placements: list[list[MeshAxes]] | None = None,
) -> list[jax.Array]:
    """Each leaf's L2 norm over its `leaf_axes` (kept as size-1 dims).

    Exact for every finite input. The first pass is the bare formula's one
    float32 sum of squares per slice. One scalar test over the whole tree,
    "some sum is inf or below `_trust_floor`" (0 included: a slice whose
    squares all underflowed sums to 0 too), decides whether a second pass
    rescales each such slice by its own power of two (`_next_scale`);
    `_two_passes` runs both. With `placements`, sums over sharded dimensions
    are completed across devices (one psum per axis set) and the test is the
    same on every device.
    """
    if not leaves:
        return []
    groups: list[MeshAxes] = [()] * len(leaves)
    buckets: list[MeshAxes] = groups
    if placements is not None:
        pairs = zip(placements, leaf_axes, strict=True)
        groups = [reduced_mesh_axes(e, a) for e, a in pairs]
        buckets = [reduced_mesh_axes(e, range(len(e))) for e in placements]

    def summed(leaves: list[jax.Array], scales: list[jax.Array]) -> list[jax.Array]:
        sums = []
        for x, a, scale in zip(leaves, leaf_axes, scales, strict=True):
            # A barrier that ties the leaf to its pass's scale: XLA neither
            # hoists a narrow leaf's float32 upcast out of the loop nor folds
            # a constant scale into the square (see `_fused.scaled_pair`).
            x, scale = _fused.scaled_pair(x, scale)
            sums.append(
                jnp.sum(_common.powers(_upcast(x) * scale, 2.0), a, keepdims=True)
            )
        return _collective(sums, groups, jax.lax.psum, buckets)

    def untrusted(sums: list[jax.Array]) -> jax.Array:
        flags = [jnp.any(jnp.isposinf(s) | (s < _trust_floor(s.dtype))) for s in sums]
        flag = functools.reduce(jnp.logical_or, flags)
        if placements is None:
            return flag
        return _pmax_everywhere(flag.astype(jnp.int32), buckets) > 0

    def rescale(sums: list[jax.Array]) -> list[jax.Array]:
        out = []
        for s in sums:
            bad = jnp.isposinf(s) | (s < _trust_floor(s.dtype))
            out.append(jnp.where(bad, _next_scale(s, 2.0), jnp.ones_like(s)))
        return out

    zeros = []
    for x, a, group in zip(leaves, leaf_axes, groups, strict=True):
        shape = tuple(1 if d in a else n for d, n in enumerate(x.shape))
        dtype = jnp.real(jnp.zeros((), _upcast(x).dtype)).dtype
        zeros.append(_vary(jnp.zeros(shape, dtype), _varying(x) - set(group)))
    out: list[jax.Array] = _two_passes(
        summed, leaves, zeros, rescale, untrusted, 2.0, lambda scales: scales
    )
    return out


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
