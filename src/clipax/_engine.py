"""The norm engine: every norm clipax takes, accumulated in float32 or wider.

The global norm (`global_norm`: `clip_by_global_norm`, AutoClip, ZClip,
`skip_spikes`, `group_norms`) is exact for every finite input. Small leaves
(at most `SMALL_LEAF` elements, whole on their device: `_placement.is_whole`)
are concatenated per dtype, in tree order, into buckets of at most
`BUCKET_ELEMENTS` elements; each bucket and each other leaf gives one partial
sum of |x|**p, in float32 (float64 in a tree with float64 leaves), completed
across devices and added up. That plain sum is tested once: when it is inf, or
below `_trust_floor` (squares may have underflowed), the branch of one
`lax.cond` sums |x s|**p again, every element scaled by one power of two
(`pow2_scale`), so the common path pays one scalar test. Where some leaf may
be split across devices in a way only XLA knows (several devices, automatic
mesh axes), leaves are reduced one by one, and both passes are the iterations
of one `lax.while_loop`, compiled once. The inf-norm is a
maximum and needs no rescaling; orders above 2 take the largest |x| first and
sum once, scaled by it.

Per-tensor norms (`tensor_norms`: `clip_by_norm`, AGC, AdaGC, block RMS and
per-example clipping) are the bare formula's: each leaf's float32 (float64)
sum of squares over its axes, completed across devices, and its square root,
one leaf at a time. They are exact where the sum of squares is a normal
float: a tensor whose squares overflow has an inf norm and follows the NaN
rule, and a norm below about 1e-19 in float32 (1e-154 in float64) may come
out smaller, down to 0, as its squares underflow. There is no rescaled pass:
its range test joins every leaf before any is scaled, and its second set of
kernels doubled the step's compile time (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from clipax import _common, _placement
from clipax._placement import MeshAxes, Placements

# Leaves of at most this many elements are bucketed; above 16 KiB of float32 a
# reduction's fixed cost is small beside its bytes (benchmarks/RESULTS.md).
SMALL_LEAF = 1 << 12
# The most elements one bucket holds (128 KiB of float32): smaller buckets
# compiled slower, larger ones ran slower (benchmarks/RESULTS.md).
BUCKET_ELEMENTS = 1 << 15


# Buckets.


def _buckets(leaves: Sequence[Any]) -> tuple[list[list[int]], list[int]]:
    """Leaf indices in buckets (small leaves of one dtype, in tree order, at
    most `BUCKET_ELEMENTS` elements each) and the leaves reduced alone.

    Zero-size leaves are in neither: they add nothing to any norm.
    """
    alone: list[int] = []
    open_buckets: dict[np.dtype, list[int]] = {}
    filled: dict[np.dtype, int] = {}
    buckets: list[list[int]] = []
    for i, x in enumerate(leaves):
        if not x.size:
            continue
        if x.size > SMALL_LEAF or not _placement.is_whole(x):
            alone.append(i)
            continue
        dtype = np.dtype(x.dtype)
        if dtype not in open_buckets or filled[dtype] + x.size > BUCKET_ELEMENTS:
            open_buckets[dtype] = []
            filled[dtype] = 0
            buckets.append(open_buckets[dtype])
        open_buckets[dtype].append(i)
        filled[dtype] += x.size
    return buckets, alone


def opaque_if_narrow(x: jax.Array, dtype: Any = None) -> jax.Array:
    """`x`, behind an optimization barrier when it is upcast to `dtype` (by
    default its accumulation dtype: float16 and bfloat16 leaves).

    XLA would merge the upcast taken for the norm with the one where the clip
    factor is applied, and write the whole tree out in float32: a barrier,
    which copies nothing, keeps each upcast fused into its own consumer
    (GPT-2 in bfloat16: 435 MiB less than optax; benchmarks/RESULTS.md).
    """
    wide = _common.accum_dtype(x.dtype) if dtype is None else np.dtype(dtype)
    if wide.itemsize > np.dtype(x.dtype).itemsize:
        return jax.lax.optimization_barrier(x)
    return x


def scaled_pair(x: jax.Array, scale: Any) -> tuple[jax.Array, jax.Array]:
    """`(x, scale)` through one barrier, for a pass that multiplies `x` by
    the `scale` returned here.

    Where XLA sees `x` as a constant (zeros from `optax.set_to_zero`, a
    closed-over array) it rewrote (x s)**2 as x**2 s**2, and s**2 overflows
    for the largest scales: 0 * inf = NaN. The barrier also keeps this
    pass's upcast of a narrow `x` apart from any other (`opaque_if_narrow`).
    """
    pair: tuple[jax.Array, jax.Array] = jax.lax.optimization_barrier(
        (x, jnp.asarray(scale))
    )
    return pair


def partial_sums(
    leaves: Sequence[Any], p: float, dtype: Any, scale: Any = None
) -> jax.Array:
    """A vector whose sum (max for p = inf) is the sum of |x * scale|**p over
    `leaves` (|x|**p without `scale`; max |x| for p = inf).

    One entry per bucket and per leaf reduced alone (`_buckets`), each
    accumulated in `dtype` (the tree's accumulation dtype; a complex leaf in
    its complex counterpart's real part); at least one entry (0 for no
    elements).
    """
    leaves = [jnp.asarray(x) for x in leaves]
    buckets, alone = _buckets(leaves)

    def prepared(x: jax.Array) -> jax.Array:
        wide = jnp.result_type(x.dtype, dtype)
        if scale is None:
            return opaque_if_narrow(x, wide).astype(wide)
        x, factor = scaled_pair(x, scale)
        return _common.scale_by(x.astype(wide), factor.astype(dtype))

    parts = [_common.power_sum(prepared(leaves[i]), p) for i in alone]
    for bucket in buckets:  # one upcast (and one barrier) per bucket
        pieces = [jnp.ravel(leaves[i]) for i in bucket]
        whole = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)
        parts.append(_common.power_sum(prepared(whole), p))
    if not parts:
        return jnp.zeros((1,), dtype)
    stacked = jnp.stack([part.astype(dtype) for part in parts])
    # Seen through, XLA rewrites the sum of these scalars as one fused chain of
    # adds, slow to compile: 8 % of the step's compile on 48 layers.
    return jax.lax.optimization_barrier(stacked) if len(parts) > 1 else stacked


# Range.


def _upcast(x: jax.Array) -> jax.Array:
    acc = _common.accum_dtype(x.dtype)
    if jnp.iscomplexobj(x):
        return x.astype(jnp.result_type(acc, jnp.complex64))
    return x.astype(acc)


def _trust_floor(dtype: np.dtype) -> float:
    """Sums of powers below this may have lost terms to underflow."""
    return float(np.sqrt(np.finfo(dtype).tiny))


def _untrusted(total: jax.Array) -> jax.Array:
    """Where a sum of powers is inf, or below `_trust_floor` (0 included)."""
    return (total == np.inf) | (total < _trust_floor(total.dtype))


def pow2_scale(bound: jax.Array, headroom: int = 0) -> jax.Array:
    """The power of two 2**(headroom - e), with `bound` = m 2**e, 1/2 <= m < 1.

    Multiplying by it is exact and brings `bound` into [2**(headroom - 1),
    2**headroom). The one rescaling rule of clipax: every rescaled sum takes
    its scale from a bound on the values it sums.
    """
    _, exponent = jnp.frexp(bound)
    limit = int(np.finfo(bound.dtype).maxexp) - 3
    exponent = jnp.clip(headroom - exponent, -limit, limit)
    return jax.lax.stop_gradient(jnp.ldexp(jnp.ones_like(bound), exponent))


def _second_scale(total: jax.Array, p: float) -> jax.Array:
    """The scale of the second pass, for 1 <= p <= 2, from the first pass's
    `total` (inf, or below `_trust_floor`): `pow2_scale` of a bound on every
    |x|, with headroom for 2**40 terms.

    With E = log2 of the dtype's largest float (128 in float32), every scaled
    |x s| is below 2**h, h = floor((E - 40) / p) - 1, so the new sum is in
    range; an overflowed sum bounds |x| by the largest float, and a sum below
    the floor by max(total**(1/p), tiny**(1/p)), which also lifts every
    nonzero |x|, subnormals included, to where its power is a normal float.
    What drops below the smallest normal float is negligible beside the sum.
    """
    info = np.finfo(total.dtype)
    headroom = math.floor((int(info.maxexp) - 40) / p) - 1
    smallest = jnp.asarray(float(info.tiny) ** (1 / p), total.dtype)
    low = jnp.maximum(_common.safe_root(total, p), smallest)
    bound = jnp.where(total == np.inf, jnp.asarray(info.max, total.dtype), low)
    return pow2_scale(bound, headroom)


def _finish(total: jax.Array, peak: jax.Array, scale: jax.Array, p: float) -> Any:
    """The norm from a rescaled sum, with the peak's own rules for 0, inf, NaN."""
    norm = _common.safe_root(total, p) / scale
    norm = jnp.where(peak == 0, jnp.zeros_like(norm), norm)
    return jnp.where(jnp.isfinite(peak), norm, peak)


def _branch(
    untrusted: jax.Array, rescaled: Callable[[], Any], plain: Callable[[], Any]
) -> Any:
    """`lax.cond` when traced; eagerly the host chooses, since an eager
    `lax.cond` over closures would compile anew at every call."""
    if _common.is_traced(untrusted):
        return jax.lax.cond(untrusted, rescaled, plain)
    return rescaled() if bool(untrusted) else plain()


# The global norm.


def global_norm(
    leaves: list[jax.Array], p: float, placements: Placements | None = None
) -> jax.Array:
    """The p-norm over all `leaves`, exact for every finite input.

    With `placements` (`_placement.leaf_placements`), leaves are local blocks
    and the result is the norm of the whole sharded tree, the same on every
    device.
    """
    dtype = _common.tree_accum_dtype(leaves)
    if not leaves:
        return jnp.zeros((), dtype)
    if placements is None:
        axes: list[MeshAxes] = [()] * len(leaves)
    else:
        axes = [_placement.split_axes(e) for e in placements]
    members: dict[MeshAxes, list[int]] = {}
    for i, names in enumerate(axes):
        members.setdefault(names, []).append(i)
    sets = list(members)

    def summed(leaves: list[jax.Array], scale: jax.Array | None) -> jax.Array:
        """Sum of |x * scale|**p (|x|**p for `scale=None`) over all leaves,
        with one psum per mesh-axis set."""
        sums = [
            jnp.sum(partial_sums([leaves[i] for i in members[k]], p, dtype, scale))
            for k in sets
        ]
        return jnp.sum(jnp.stack(_placement.psum_each(sums, sets)))

    def peak() -> jax.Array:
        """Largest |x| over all leaves: one pmax for every axis set."""
        local = jnp.max(partial_sums(leaves, math.inf, dtype))
        return _placement.pmax_everywhere(local, sets)

    if p == math.inf:
        return peak()
    if p > 2:  # rare orders: the peak, then one sum scaled by it
        top = peak()
        scale = pow2_scale(top)
        return _finish(summed(leaves, scale), top, scale, p)
    return _norm_in_two_passes(summed, leaves, p)


def _norm_in_two_passes(
    summed: Callable[[list[jax.Array], jax.Array | None], jax.Array],
    leaves: list[jax.Array],
    p: float,
) -> jax.Array:
    """The p-norm (1 <= p <= 2) from `summed(leaves, scale)`, the sum of
    |x scale|**p (|x|**p for `scale=None`): the plain sum, and under a
    `lax.cond` (eagerly, on the host's decision) a second at `_second_scale`
    when the first is inf or below `_trust_floor`; where some leaf cannot be
    bucketed (`_looped_passes`), both passes are the iterations of one loop.

    The plain pass is the bare sum, optax's: a sum of scaled powers runs about
    twice as long on leaves in cache (benchmarks/RESULTS.md). The derivative,
    through `jax.custom_jvp`, is the last pass's formula at its (constant)
    scale, taken on the scaled leaves. Constants are made inside the
    functions that use them: a tracer closed over by `jax.custom_jvp` escapes
    when the jitted caller is itself differentiated.
    """

    def passes(leaves: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
        """(total, scale) of the last pass."""
        if any(_common.is_traced(x) and not _placement.is_whole(x) for x in leaves):
            return _looped_passes(summed, leaves, p)
        total = summed(leaves, None)
        one = jnp.ones_like(total)  # typed as `total` is inside shard_map

        def rescaled() -> tuple[jax.Array, jax.Array]:
            scale = _second_scale(total, p)
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
        # scaled leaves, whose derivatives are of moderate size, it neither
        # overflows nor underflows where x is extreme.
        scale = jax.lax.stop_gradient(passes(primals[0])[1])
        one = jnp.ones_like(scale)
        scaled = [_common.scale_by(_upcast(x), scale) for x in primals[0]]
        dots = [t.astype(y.dtype) for t, y in zip(tangents[0], scaled, strict=True)]
        value, slope = jax.jvp(
            lambda ys: _common.safe_root(summed(ys, one), p), (scaled,), (dots,)
        )
        return value / scale, slope

    return norm(list(leaves))


def _looped_passes(
    summed: Callable[[list[jax.Array], jax.Array | None], jax.Array],
    leaves: list[jax.Array],
    p: float,
) -> tuple[jax.Array, jax.Array]:
    """`_norm_in_two_passes`'s (total, scale) as the iterations of one
    `lax.while_loop`, for leaves that cannot be bucketed: each leaf's reduction
    is then compiled once, not once per pass (several devices, automatic mesh
    axes: the step compiles 5-20 % faster; benchmarks/RESULTS.md).

    The first iteration sums at scale 1, the second (only when the first sum
    is inf or below `_trust_floor`) at `_second_scale`.
    """
    dtype = _common.tree_accum_dtype(leaves)
    one = jnp.ones((), dtype)

    def again(carry: tuple) -> jax.Array:
        total, _, _, count = carry
        return (count == 0) | ((count == 1) & _untrusted(total))

    def one_pass(carry: tuple) -> tuple:
        _, _, scale, count = carry
        total = summed(leaves, scale)
        return total, scale, _second_scale(total, p), count + 1

    start = (jnp.zeros((), dtype), one, one, jnp.zeros((), jnp.int32))
    total, scale, _, _ = jax.lax.while_loop(again, one_pass, start)
    return total, scale


def norm_of_norms(norms: jax.Array) -> jax.Array:
    """The L2 norm of `norms` along axis 0 (the global norm of their leaves).

    Scaled by `pow2_scale` of the largest entry, so it neither overflows nor
    underflows where the entries do not; NaN if an entry is NaN, else inf if
    one is inf.
    """
    if norms.shape[0] == 0:
        return jnp.zeros(norms.shape[1:], norms.dtype)
    peak = jnp.max(norms, axis=0)
    usable = jnp.isfinite(peak) & (peak > 0)
    scale = pow2_scale(jnp.where(usable, peak, jnp.ones_like(peak)))
    scaled, factor = scaled_pair(norms, scale)
    total = jnp.sqrt(jnp.sum(jnp.square(scaled * factor), axis=0)) / scale
    return jnp.where(jnp.isfinite(peak), total, jnp.sum(norms, axis=0))


# Per-tensor norms.


@functools.partial(jax.jit, static_argnums=(1, 2))
def _sum_of_squares(x: jax.Array, axes: tuple[int, ...], keep: bool) -> jax.Array:
    """The float32 (or wider) sum of squares of `x` over `axes`, the reduced
    dims kept where `keep`.

    Jitted, as is `_root`: leaves of one shape and dtype share one trace, where
    tracing each leaf anew cost a millisecond a leaf (benchmarks/RESULTS.md).
    """
    return jnp.sum(_common.powers(opaque_if_narrow(x), 2.0), axis=axes, keepdims=keep)


_root = jax.jit(_common.sqrt)


def tensor_norms(
    leaves: list[jax.Array],
    leaf_axes: list[tuple[int, ...]],
    placements: Placements | None = None,
) -> list[jax.Array]:
    """Each leaf's L2 norms over its `leaf_axes`, in float32 (float64 for
    float64 leaves): a scalar where `leaf_axes` are all of the leaf's dims,
    else an array with the reduced dims kept (size 1).

    With `placements`, each sum is completed over the mesh axes that split its
    reduced dimensions, so every norm is the whole tensor's (or slice's).
    """
    keeps = [len(a) < x.ndim for x, a in zip(leaves, leaf_axes, strict=True)]
    pairs = zip(leaves, leaf_axes, keeps, strict=True)
    sums = [_sum_of_squares(x, axes, keep) for x, axes, keep in pairs]
    if placements is not None:
        split = zip(placements, leaf_axes, strict=True)
        axes = [_placement.split_axes(e, a) for e, a in split]
        whole = [_placement.split_axes(e) for e in placements]
        sums = _placement.psum_each(sums, axes, together=whole)
    return [_root(total) for total in sums]
