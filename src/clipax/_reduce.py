"""The norm engine: exact norms of pytrees, on one device or sharded.

The data's path: a global norm (`global_norm`, 1 <= p <= 2) sums |x|**p
over all leaves in float32 (`_fused.partial_sums` reduces small leaves
together; for p = 2 a large leaf's sum is optax's sum of squares), completes
the sum across devices, and tests it once: inf, or below `_trust_floor`, takes
a `lax.cond` branch that sums |x s|**p again with s a power of two chosen from
that sum (`_next_scale`). Per-slice norms
(`slice_norms`, for `clip_by_norm`) take one float32 sum of squares per slice,
the bare formula's, and one scalar test over the whole tree decides under one
`lax.cond` whether a second pass, each slice scaled by a power of two chosen
from its own sum, repairs overflow and underflow (a loop with per-leaf
carries compiled slower there); small leaves of one shape take all of this as
one stacked array (`_stacks`), and whole-leaf sums are gathered into one
vector per dtype (a pack), whose roots and clip factors are one kernel after
the test; each leaf's norms are read back out of its stack's or pack's.

Two concerns meet here, each solved once:

- Placement. Inside `shard_map` or `pmap`, a leaf is a local block. `specs`
  (the `in_specs` given to `shard_map`) or `axis_name` say over which mesh axes
  each leaf is split; a leaf's partial sum is combined over exactly those axes
  (psum for p-norms, pmax for the inf-norm), so replicated leaves count once.
  Leaves that share an axis set share one collective.
- Range. Squares of float32 values above ~1.8e19 overflow, and below ~1e-19
  they underflow. The common path pays one scalar test; only inputs at those
  extremes (or all-zero slices, for per-slice norms) take the second pass.
  For the global norm it scales every element by the same power of two (for
  orders above 2, whose powers span more than float32's range, one taken
  from the largest |x|, in a pass of its own); for per-slice norms, each
  slice by 2**-80 or 2**80 as its plain sum overflowed or underflowed. All
  are exact.
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


def _untrusted(total: jax.Array, floor: Any = 0.0) -> jax.Array:
    """Where a sum of powers is inf or below `_trust_floor` (0 included).

    `floor` (a norm, maybe traced) says that norms below it need not be exact.
    Where it is at least 2 sqrt(`_trust_floor`) (6.6e-10 in float32), sums
    below `_trust_floor` pass: their norms are below `floor` whether exact or
    not (each term lost to underflow is below the smallest normal float, so
    fewer than 2**60 of them add less than `_trust_floor` / 4).
    """
    limit = _trust_floor(total.dtype)
    honoured = 2 * math.sqrt(limit)
    low = total < limit
    if _common.is_traced(floor):
        low = low & ~(jnp.asarray(floor, total.dtype) >= honoured)
    elif floor >= honoured:
        low = jnp.zeros_like(low)
    return (total == np.inf) | low


def _exponent_bound(dtype: np.dtype) -> int:
    return int(np.finfo(dtype).maxexp) - 3


def power_of_two_scale(peak: jax.Array) -> jax.Array:
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
    members: dict[MeshAxes, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    keys = list(members)

    def summed(leaves: list[jax.Array], scale: jax.Array | None) -> jax.Array:
        """Sum of |x * scale|**p (|x|**p for `scale=None`) over all leaves: one
        psum per axis set.

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
        inverse = power_of_two_scale(top)
        return _finish(summed(leaves, inverse), top, inverse, p)
    return _norm_in_two_passes(summed, leaves, p)


def _varying(x: jax.Array) -> frozenset[str]:
    """The manual mesh axes over which `x` varies inside `shard_map`.

    JAX 0.10 and later name them `jax.typeof(x).manual_axis_type.varying`,
    earlier releases `jax.typeof(x).vma`. With neither, values that vary over
    different axes would be packed together and all typed as varying over
    every one of them, so this fails instead of guessing.
    """
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    vma = getattr(aval, "vma", None)
    if vma is not None:
        return frozenset(vma)
    raise NotImplementedError(
        f"clipax cannot tell over which mesh axes a value varies with JAX "
        f"{jax.__version__}: its abstract values have neither "
        "`manual_axis_type` nor `vma`. Install a JAX that clipax supports "
        "(see its pyproject.toml)."
    )


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
    # A normal float's exponent field, and 2**e built from it, read and
    # written with bit operations: `jnp.frexp` and `jnp.ldexp` handle zeros,
    # subnormals, inf and NaN in some 50 scalar operations, which this pass
    # never needs (`bound` is normal or inf, an inf `total` takes `down`, and
    # a NaN `total` never takes the second pass);
    # with them, `clip_by_global_norm` on one or two large leaves compiled
    # 6-14 % slower (benchmarks/RESULTS.md).
    bits = jnp.dtype(f"int{info.bits}")
    bias = big - 1
    field = jax.lax.bitcast_convert_type(bound, bits) >> info.nmant
    limit = _exponent_bound(total.dtype)
    exponent = jnp.clip(headroom - 1 - (field - bias + 1), -limit, limit)
    up = jax.lax.bitcast_convert_type((exponent + bias) << info.nmant, total.dtype)
    return jax.lax.select(total == np.inf, jnp.broadcast_to(down, up.shape), up)


def _norm_in_two_passes(
    summed: Callable[[list[jax.Array], jax.Array | None], jax.Array],
    leaves: list[jax.Array],
    p: float,
) -> jax.Array:
    """The p-norm (1 <= p <= 2) from `summed(leaves, scale)`, the sum of
    |x scale|**p (|x|**p for `scale=None`): one plain pass, and a second at
    `_next_scale` only when the first sum is inf or below `_trust_floor`.

    Under a trace the second pass is the branch of one `lax.cond`. The plain
    pass is then the bare sum of squares, which XLA's CPU backend runs about
    twice as fast as a sum of scaled squares on leaves in cache: where both
    passes were the iterations of one `lax.while_loop` (one compiled body,
    multiplying by the scale), `clip_by_global_norm` alone ran 1.05-1.37 x
    optax's time on float32 trees, and compiled 15-40 % faster on trees of
    many leaves; in the whole training step the compile times are alike and
    the cond runs 3-10 % faster (benchmarks/RESULTS.md). Eagerly, the host
    decides whether to take the second pass.

    The derivative is, through `jax.custom_jvp`, that of the last pass's
    formula at its (constant) scale, taken on the scaled leaves.

    The constants are made inside the functions that use them: a tracer
    closed over by `jax.custom_jvp` escapes when the jitted caller is itself
    differentiated (`jax.grad(jax.jit(...))`).
    """

    def passes(leaves: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
        """(total, scale) of the last pass."""
        total = summed(leaves, None)
        one = jnp.ones_like(total)  # typed as `total` is inside shard_map

        def rescaled() -> tuple[jax.Array, jax.Array]:
            scale = _next_scale(total, p)
            return summed(leaves, scale), scale

        def plain() -> tuple[jax.Array, jax.Array]:
            return total, one

        pair: tuple[jax.Array, jax.Array] = _branch(_untrusted(total), rescaled, plain)
        return pair

    @jax.custom_jvp
    def norm(leaves: list[jax.Array]) -> jax.Array:
        total, scale = passes(leaves)
        return _common.safe_root(total, p) / scale

    @norm.defjvp
    def norm_jvp(primals: tuple, tangents: tuple) -> tuple[jax.Array, jax.Array]:
        # With y = x s (s the last pass's scale, a constant), the norm is
        # R(y) / s and its tangent R'(y) s dx / s = R'(y) dx: taken on the
        # scaled leaves, whose derivatives are of moderate size, the tangent
        # (and its transpose, in reverse mode) neither overflows nor
        # underflows where x is extreme.
        scale = jax.lax.stop_gradient(passes(primals[0])[1])
        one = jnp.ones_like(scale)
        scaled = [_common.scale_by(_upcast(x), scale) for x in primals[0]]
        dots = [t.astype(y.dtype) for t, y in zip(tangents[0], scaled, strict=True)]
        unit, slope = jax.jvp(
            lambda ys: _common.safe_root(summed(ys, one), p), (scaled,), (dots,)
        )
        return unit / scale, slope

    return norm(list(leaves))


# The exact pass of per-slice norms scales each slice by a power of two chosen
# from its plain sum (`_range_scale`), 2**-k where the sum overflowed and 2**k
# where it fell below `_trust_floor`, with k = maxexp / 2 + 16 (`_shift`: 80
# for float32, 528 for float64). In float32: an overflowed sum has |x| <
# 2**128, and every square of x 2**-80 is below 2**96; a sum below the floor
# has |x| < 2**-31.5, and x 2**80 lifts the square of every |x| >= 2**-143,
# all normal and most subnormal floats, to a normal float below 2**97 (in
# float64 the same with 2**1024, 2**-255.5, 2**-1039 and 2**545).
# Scaling by powers of two loses nothing.


def _shift(dtype: np.dtype) -> int:
    return int(np.finfo(dtype).maxexp) // 2 + 16


# Each leaf's steps below are jitted functions, called (not inlined) from the
# caller's trace: leaves of one shape and dtype share one trace and one
# lowering, and XLA inlines the calls, so the kernels are the same. Traced
# anew for every leaf, their few dozen `jnp` operations cost about 3 ms a leaf
# (500 x 1k: trace and lowering 3.2 s, with these 0.6 s; benchmarks/RESULTS.md).


@functools.partial(jax.jit, static_argnums=(1, 2))
def _plain_sum(x: jax.Array, axes: tuple[int, ...], keep: bool) -> jax.Array:
    """The float32 (or wider) sum of squares of `x` over `axes`, with the
    reduced dims kept where `keep`.

    A norm over a whole leaf is a scalar (or, for a stack, a vector), not an
    array of size-1 dims: the per-leaf scalar kernels that follow (the exact
    pass's range scale, the reads out of a pack) are then one kernel for
    leaves of every rank, which XLA's CPU backend compiles once (10-20 % less
    compile on model-shaped trees, measured before packs took the roots and
    clip factors; benchmarks/RESULTS.md).
    """
    squares = _common.powers(_fused.opaque_if_narrow(x), 2.0)
    return jnp.sum(squares, axis=axes, keepdims=keep)


def _range_scale(total: jax.Array) -> jax.Array:
    """The power of two by which the exact pass scales the slices of `total`:
    2**-k where it is inf, 2**k where it is below `_trust_floor`, 1 elsewhere
    (those slices' sums come out as in the plain pass); k = `_shift`.

    Written with `lax.select`: `jnp.where` is a jitted function of its own,
    one more call per leaf for XLA to flatten and inline."""
    one = jnp.ones_like(total)
    k = _shift(total.dtype)
    up = jax.lax.select(total < _trust_floor(total.dtype), one * 2.0**k, one)
    down = jax.lax.select(total == np.inf, one * 2.0**-k, up)
    return jax.lax.stop_gradient(down)


@functools.partial(jax.jit, static_argnums=(1, 3))
def _rescaled_sum(
    x: jax.Array, axes: tuple[int, ...], total: jax.Array, keep: bool
) -> jax.Array:
    """The sum of |x scale|**2 over `axes`, `scale` from `x`'s plain sums
    `total` (`_range_scale`); reduced dims kept where `keep` (`_plain_sum`).

    Every leaf goes through a barrier with its scale (`_fused.scaled_pair`).
    Where XLA sees the leaf as a constant (zeros from `optax.set_to_zero`, an
    array closed over by the jitted function), it rewrote (x scale)**2 as
    x**2 scale**2, and scale**2 = 2**160 is inf in float32: 0 * inf = NaN for
    every zero or tiny leaf, also when scale itself is a run-time value. The
    barrier costs no measurable compile time (benchmarks/RESULTS.md). For a
    narrow leaf it also keeps the float32 upcast fused into this reduction,
    never written out.
    """
    scale = _range_scale(total)
    factor = scale if keep else jnp.expand_dims(scale, axes)
    x, factor = _fused.scaled_pair(x, factor)
    squares = _common.powers(_common.scale_by(_upcast(x), factor), 2.0)
    return jnp.sum(squares, axis=axes, keepdims=keep)


@jax.jit
def _root(total: jax.Array, sums: jax.Array, rescaled: Any) -> jax.Array:
    """The norm from the sum of |x scale|**2 that the range test chose, either
    pass's, so both passes share one root after the test: `scale` is
    `_range_scale` of the plain `sums`, which is 1 wherever the plain pass is
    taken. With a `floor`, a plain sum below it may be one that the exact pass
    would scale: then `rescaled` says which pass was taken (None without)."""
    scale = _range_scale(sums)
    if rescaled is not None:
        scale = jax.lax.select(rescaled, scale, jnp.ones_like(sums))
    return _common.safe_root(total, 2.0) / scale


def _stacks(
    leaves: list[jax.Array],
    leaf_axes: list[tuple[int, ...]],
    groups: list[MeshAxes],
    buckets: list[MeshAxes],
) -> list[list[int]]:
    """Indices of small leaves whose slice norms are taken as one stack.

    A stack holds 2 to `_fused.GROUP_LEAVES` nonempty leaves of at most
    `_fused.SMALL_LEAF` elements with one shape, dtype, `axes` and placement,
    each whole on every device that holds it (`_fused.can_concatenate`); at
    most `_fused.MAX_BUCKETED` elements are stacked in all (the stacks are
    copies).
    """

    def key(i: int) -> Any:
        x = leaves[i]
        placed = (groups[i], buckets[i], _varying(x))
        return x.shape, x.dtype, leaf_axes[i], placed

    stacks: list[list[int]] = []
    stacked = 0
    for chunk in _fused.small_chunks(leaves, key):
        size = len(chunk) * leaves[chunk[0]].size
        if stacked + size <= _fused.MAX_BUCKETED:
            stacks.append(chunk)
            stacked += size
    return stacks


@jax.jit
def _take(norms: jax.Array, position: jax.Array) -> jax.Array:
    """The norms of one leaf, at `position` along its stack or pack.

    `position` is in range, so JAX's wrap of negative indices (a compare, an
    add and a select per read) is left out, which cut `clip_by_norm`'s compile
    by 10-28 % on trees of 100 to 580 leaves (benchmarks/RESULTS.md)."""
    return jax.lax.dynamic_index_in_dim(
        norms, position, keepdims=False, allow_negative_indices=False
    )


def slice_norms(
    leaves: list[jax.Array],
    leaf_axes: list[tuple[int, ...]],
    placements: list[list[MeshAxes]] | None = None,
    then: Callable[[jax.Array], Any] | None = None,
    floor: Any = 0.0,
) -> list[Any]:
    """Each leaf's L2 norm over its `leaf_axes` (kept as size-1 dims; a scalar
    where `leaf_axes` are all of the leaf's dims); with
    `then`, `then(norms)` for each leaf (a pytree of arrays; `then` works
    element by element). With `floor`, the caller needs no exact norm below it
    (see `_untrusted`): an all-zero slice then takes the plain pass, and a
    norm below `floor` may come out as any value from 0 to `floor`.

    Exact for every finite input. The fast pass is the bare formula's one
    float32 sum of squares per slice. One scalar test over the whole tree,
    "some sum is inf or below `_trust_floor`" (0 included: a slice whose
    squares all underflowed sums to 0 too), decides under one `lax.cond`
    whether the rescaled sums (`_range_scale`, `_rescaled_sum`) are taken:
    one reduction per leaf, where a sum of x 2**-80 and one of x 2**80 for
    every leaf compiled 1.1-1.5 x slower (benchmarks/RESULTS.md). With
    `placements`, sums over sharded dimensions are completed across devices
    (one psum per axis set) and the test is the same on every device.

    Small leaves of one shape (`_stacks`) go through all of this as one
    stacked array, so that their sums and rescaled sums are one kernel per
    stack, not per leaf. Sums over whole leaves (scalars, or a stack's vector)
    are then gathered into one vector per dtype, a pack: the range test, the
    root (one, after the test, for either pass: the passes differ only in
    their sums) and `then` are one kernel per pack (a root and a clip factor
    per leaf compiled 1.1-1.2 x slower on GPT-2 and ResNet-50 shaped trees;
    benchmarks/RESULTS.md). Each leaf's norms are read out of its stack's or
    pack's at a position that comes out of the `lax.cond`. To XLA that
    position is a run-time value, so the kernels that read it are the same
    for every leaf of one shape, and XLA's CPU backend compiles them once
    (about 8 ms each); a constant position made one kernel per leaf
    (benchmarks/RESULTS.md). `then` is applied to a pack's (or a stack's)
    norms once, and its results are read out per leaf.
    """
    if not leaves:
        return []
    groups: list[MeshAxes] = [()] * len(leaves)
    buckets: list[MeshAxes] = groups
    if placements is not None:
        pairs = zip(placements, leaf_axes, strict=True)
        groups = [reduced_mesh_axes(e, a) for e, a in pairs]
        buckets = [reduced_mesh_axes(e, range(len(e))) for e in placements]
    stacks = _stacks(leaves, leaf_axes, groups, buckets)
    stacked = {i for members in stacks for i in members}
    # A unit is a stack of small leaves or one leaf, reduced over `axes`.
    members = stacks + [[i] for i in range(len(leaves)) if i not in stacked]
    firsts = [unit[0] for unit in members]
    units = [jnp.stack([leaves[i] for i in unit]) for unit in stacks]
    units += [leaves[unit[0]] for unit in members[len(stacks) :]]
    axes = [tuple(a + 1 for a in leaf_axes[i]) for i in firsts[: len(stacks)]]
    axes += [leaf_axes[unit[0]] for unit in members[len(stacks) :]]
    groups = [groups[i] for i in firsts]
    buckets = [buckets[i] for i in firsts]
    keeps = [len(leaf_axes[i]) < leaves[i].ndim for i in firsts]
    sums = [_plain_sum(*unit) for unit in zip(units, axes, keeps, strict=True)]
    sums = _collective(sums, groups, jax.lax.psum, buckets)
    # Whole-leaf norms are scalars (a vector for a stack): those of one dtype,
    # varying over the same mesh axes, are gathered into one vector (a pack),
    # so that the roots and `then` are one kernel per pack, not per leaf. A
    # scalar is whole on every device; a stack's vector is (its leaves are).
    # Norms over `axes` stay per unit.
    by_key: dict[Any, list[int]] = {}
    sliced = []
    for u, s in enumerate(sums):
        if not keeps[u]:
            by_key.setdefault((s.dtype, _varying(s)), []).append(u)
        else:
            sliced.append(u)
    packs = list(by_key.values())

    def gathered(values: Sequence[jax.Array]) -> list[jax.Array]:
        """Per-unit values as the packs' vectors, then the sliced units'."""
        vectors = [
            _fused.concat([values[u].reshape(-1) for u in pack]) for pack in packs
        ]
        return vectors + [values[u] for u in sliced]

    # The passes differ only in their sums; the roots (and `then`) follow the
    # test, one kernel per pack or unit for either pass.
    plain_sums = gathered(sums)
    # The range test reads every sum, concatenated per dtype, with one
    # reduction: a chain of one test per leaf compiled twice as slowly at 500
    # leaves. Sums that may be split over devices (an explicit sharding) are
    # tested alone: concatenating them would reshard them.
    by_dtype: dict[Any, list[jax.Array]] = {}
    lone = []
    for v in plain_sums:
        if _fused.can_concatenate(v):
            by_dtype.setdefault(v.dtype, []).append(jnp.ravel(v))
        else:
            lone.append(v)
    tested = [_fused.concat(parts) for parts in by_dtype.values()] + lone
    flags = [jnp.any(_untrusted(v, floor)) for v in tested]
    untrusted = functools.reduce(jnp.logical_or, flags)
    if placements is not None:
        untrusted = _pmax_everywhere(untrusted.astype(jnp.int32), buckets) > 0
    widths = [len(v) for v in plain_sums[: len(packs)]]
    width = max(widths + [len(members[u]) for u in sliced], default=0)

    def positions() -> tuple[Any, ...]:
        # NumPy scalars, which the branch returns as constants: a `jnp.int32`
        # is an operation to trace, 10-18 % of the trace time on 100 to 580
        # leaves, for the same program (benchmarks/RESULTS.md).
        return tuple(np.int32(j) for j in range(width))

    def exact() -> tuple[list[jax.Array], tuple[jax.Array, ...]]:
        pairs = zip(units, axes, sums, keeps, strict=True)
        out = [_rescaled_sum(x, a, s, k) for x, a, s, k in pairs]
        totals = _collective(out, groups, jax.lax.psum, buckets)
        return gathered(totals), positions()

    def plain() -> tuple[list[jax.Array], tuple[jax.Array, ...]]:
        return plain_sums, positions()

    totals, position = _branch(untrusted, exact, plain)
    rescaled = untrusted if _common.is_traced(floor) or floor != 0 else None
    norms = [_root(t, s, rescaled) for t, s in zip(totals, plain_sums, strict=True)]
    results = [n if then is None else then(n) for n in norms]

    def read(result: Any, j: int) -> Any:
        return jax.tree.map(lambda v: _take(v, position[j]), result)

    by_leaf: dict[int, Any] = {}
    for result, pack in zip(results[: len(packs)], packs, strict=True):
        row = [i for u in pack for i in members[u]]
        by_leaf.update((i, read(result, j)) for j, i in enumerate(row))
    for result, u in zip(results[len(packs) :], sliced, strict=True):
        if u < len(stacks):
            by_leaf.update((i, read(result, j)) for j, i in enumerate(members[u]))
        else:
            by_leaf[members[u][0]] = result
    return [by_leaf[i] for i in range(len(leaves))]


def leaf_peak_norms(
    norms: list[jax.Array], placements: list[list[MeshAxes]] | None
) -> list[jax.Array]:
    """The largest slice norm of each leaf, the same on every device."""
    # A whole-leaf norm is its own peak: a reshape, not one more kernel per leaf.
    peaks = [
        jnp.reshape(n, ()) if n.size == 1 else jnp.max(n, initial=0.0) for n in norms
    ]
    if placements is None or not peaks:
        return peaks
    groups = [reduced_mesh_axes(e, range(len(e))) for e in placements]
    dtype = jnp.result_type(*peaks)
    everywhere = _pmax_everywhere(jnp.stack(peaks).astype(dtype), groups)
    return [everywhere[i].astype(n.dtype) for i, n in enumerate(peaks)]
