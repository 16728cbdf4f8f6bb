"""Norms, accumulated in float32 or wider; the clip factor, and applying it.

Every norm clipax takes is read here. The global norm (`global_norm`) is exact
for every finite input: small leaves that are whole on their device are
concatenated per dtype into buckets, each bucket and each other leaf gives one
partial sum of |x|**p, and the partial sums are completed across devices and
added. When that plain sum is inf, or so small that squares may have
underflowed, one `lax.cond` sums again with every element scaled by one power
of two (`pow2_scale`); the common path pays one scalar test. Where a leaf may
be split in a way only XLA knows (several devices, automatic mesh axes), the
leaves are reduced one by one and both passes are the iterations of one
`lax.while_loop`. Orders above 2 take the largest |x| first and sum once,
scaled by it; the inf-norm is a maximum.

Per-tensor norms (`tensor_norms`) are the bare formula's: a float32 (float64)
sum of squares over the reduced axes, completed across devices, and its root.
A tensor whose squares overflow has an inf norm, and one below about 1e-19
(float32) may read smaller: a rescaled pass for them doubled the step's
compile time (benchmarks/RESULTS.md, "Tried and rejected").
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from clipax import _checks, _placement
from clipax._placement import MeshAxes, Placements

# Leaves of at most this many elements are bucketed, and a bucket holds at most
# BUCKET_ELEMENTS: see benchmarks/RESULTS.md, "What limits each case".
SMALL_LEAF = 1 << 12
BUCKET_ELEMENTS = 1 << 15


# Dtypes and powers.


def accum_dtype(dtype: Any) -> np.dtype:
    """Float32, or float64 for 64-bit leaves (with x64 on): never narrower."""
    real = np.dtype(jnp.finfo(dtype).dtype)
    wide = real.itemsize >= 8 and jax.config.read("jax_enable_x64")
    return np.dtype(np.float64) if wide else np.dtype(np.float32)


def tree_accum_dtype(leaves: Sequence[Any]) -> np.dtype:
    """The widest `accum_dtype` over `leaves` (float32 for none)."""
    wide = any(accum_dtype(leaf.dtype).itemsize >= 8 for leaf in leaves)
    return np.dtype(np.float64) if wide else np.dtype(np.float32)


def _hypot(re: jax.Array, im: jax.Array) -> jax.Array:
    """|re + i im| without overflow or underflow, with a finite gradient at 0."""
    big = jnp.maximum(jnp.abs(re), jnp.abs(im))
    small = jnp.minimum(jnp.abs(re), jnp.abs(im))
    zero = big == 0
    ratio = small / jnp.where(zero, jnp.ones_like(big), big)
    return jnp.where(zero, jnp.zeros_like(big), big * jnp.sqrt(1 + jnp.square(ratio)))


def powers(x: jax.Array, p: float) -> jax.Array:
    """|x|**p element by element (|x| for p = inf), in float32 or wider; a
    complex leaf counts its modulus, taken without overflow."""
    acc = accum_dtype(x.dtype)
    if jnp.iscomplexobj(x):
        re, im = x.real.astype(acc), x.imag.astype(acc)
        if p == 2:
            return jnp.square(re) + jnp.square(im)
        magnitude = _hypot(re, im)
    else:
        real = x.astype(acc)
        if p == 2:
            return jnp.square(real)
        magnitude = jnp.abs(real)
    return magnitude if p in (1.0, math.inf) else magnitude**p


def power_sum(x: jax.Array, p: float, axes: tuple[int, ...] | None = None) -> jax.Array:
    """Sum of |x|**p over `axes` (max |x| for p = inf), reduced dims kept
    unless `axes` is None (a scalar); 0 for no elements."""
    keep = axes is not None
    if p == math.inf:
        return jnp.max(powers(x, p), axis=axes, keepdims=keep, initial=0.0)
    return jnp.sum(powers(x, p), axis=axes, keepdims=keep)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def safe_root(total: jax.Array, p: float) -> jax.Array:
    """`total ** (1/p)`, whose derivative at 0 is 0, not inf; NaN and inf pass
    through, so a broken norm stays visible."""
    if p in (1.0, math.inf):
        return total
    return jnp.sqrt(total) if p == 2 else total ** (1.0 / p)


@safe_root.defjvp
def _safe_root_jvp(p: float, primals: tuple, tangents: tuple) -> tuple:
    (total,), (dtotal,) = primals, tangents
    root = safe_root(total, p)
    if p in (1.0, math.inf):
        return root, dtotal
    zero = total == 0
    base = jnp.where(zero, jnp.ones_like(total), total)
    slope = 0.5 / jnp.sqrt(base) if p == 2 else base ** (1.0 / p - 1.0) / p
    return root, jnp.where(zero, jnp.zeros_like(dtotal), slope * dtotal)


# The clip factor.


class Threshold(NamedTuple):
    """A threshold t as `clip_factor` reads it: max(t, 0) over max(t, tiny),
    t capped at the largest float (so inf clips nothing: max / max = 1)."""

    top: jax.Array
    floor: jax.Array


def threshold(max_norm: Any, dtype: Any) -> Threshold:
    info = np.finfo(dtype)
    t = jnp.minimum(jnp.asarray(max_norm).astype(dtype), info.max)
    return Threshold(jnp.maximum(t, 0), jnp.maximum(t, info.tiny))


@jax.custom_jvp
def _stable_quotient(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a / b`, differentiated as `(da - (a / b) db) / b`: plain division goes
    through `b**-2`, which overflows for |b| < 1e-19 in float32."""
    return a / b


@_stable_quotient.defjvp
def _stable_quotient_jvp(primals: tuple, tangents: tuple) -> tuple:
    a, b = primals
    da, db = tangents
    out = a / b
    return out, (da - out * db) / b


def clip_factor(norm: jax.Array, max_norm: Any) -> jax.Array:
    """`max_norm / max(norm, max_norm)` in the norm's dtype (docs/semantics.md).

    Exactly 1 at or below the threshold (a zero norm never divides); NaN for
    a NaN norm or threshold, or an inf norm; 0 for a threshold <= 0. Four
    operations per norm (threshold terms are taken once, `threshold`): in
    per-tensor rules each operation is compiled once per leaf.
    """
    t = max_norm if isinstance(max_norm, Threshold) else threshold(max_norm, norm.dtype)
    return _stable_quotient(t.top + norm * 0, jnp.maximum(norm, t.floor))


def scaled(x: Any, factor: jax.Array) -> jax.Array:
    """`x * factor`, computed in the wider of the two dtypes, cast back to x's
    dtype as JAX holds it (a NumPy float64 leaf is float32 with x64 off)."""
    x = jnp.asarray(x)
    return (x * factor).astype(jax.dtypes.canonicalize_dtype(x.dtype))


def _scale_parts(x: jax.Array, factor: jax.Array) -> jax.Array:
    """`x * factor` for a real factor; a complex `x` has its parts scaled
    apart (a complex product makes the imaginary part of inf + 0j NaN)."""
    if jnp.iscomplexobj(x):
        return jax.lax.complex(x.real * factor, x.imag * factor)
    return x * factor


def count_if(flag: jax.Array, count: jax.Array) -> jax.Array:
    """`count` + 1 where `flag` (saturating at 2**31 - 1)."""
    return jnp.where(flag, optax.safe_int32_increment(count), count)


# Buckets and partial sums.


def _buckets(leaves: Sequence[Any]) -> tuple[list[list[int]], list[int]]:
    """Leaf indices in buckets (small whole leaves of one dtype, in tree order,
    at most `BUCKET_ELEMENTS` each) and the leaves reduced alone; zero-size
    leaves are in neither."""
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


def _separate_upcast(x: jax.Array, dtype: Any = None) -> jax.Array:
    """`x` behind an optimization barrier when it is upcast to `dtype` (its
    `accum_dtype` by default): XLA would otherwise share one float32 copy of
    a narrow leaf between the norm and the clip, and write it out whole
    (benchmarks/RESULTS.md, "Each clip alone")."""
    wide = accum_dtype(x.dtype) if dtype is None else np.dtype(dtype)
    if wide.itemsize > np.dtype(x.dtype).itemsize:
        return jax.lax.optimization_barrier(x)
    return x


def _unfolded(x: jax.Array, scale: Any) -> tuple[jax.Array, jax.Array]:
    """`(x, scale)` through one barrier, for a pass that multiplies `x` by
    `scale`: where XLA sees `x` as a constant it rewrote (x s)**2 as x**2 s**2,
    and s**2 overflows for the largest scales. It also keeps this pass's
    upcast of a narrow `x` apart (`_separate_upcast`)."""
    pair: tuple[jax.Array, jax.Array] = jax.lax.optimization_barrier(
        (x, jnp.asarray(scale))
    )
    return pair


def partial_sums(
    leaves: Sequence[Any], p: float, dtype: Any, scale: Any = None
) -> jax.Array:
    """A vector whose sum (max for p = inf) is the sum of |x * scale|**p over
    `leaves` (|x|**p without `scale`): one entry per bucket and per leaf
    reduced alone, each in `dtype`; at least one entry (0 for no elements)."""
    leaves = [jnp.asarray(x) for x in leaves]
    buckets, alone = _buckets(leaves)

    def prepared(x: jax.Array) -> jax.Array:
        wide = jnp.result_type(x.dtype, dtype)
        if scale is None:
            return _separate_upcast(x, wide).astype(wide)
        x, factor = _unfolded(x, scale)
        return _scale_parts(x.astype(wide), factor.astype(dtype))

    parts = [power_sum(prepared(leaves[i]), p) for i in alone]
    for bucket in buckets:
        pieces = [jnp.ravel(leaves[i]) for i in bucket]
        whole = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)
        parts.append(power_sum(prepared(whole), p))
    if not parts:
        return jnp.zeros((1,), dtype)
    stacked = jnp.stack([part.astype(dtype) for part in parts])
    # Seen through, the sum of these scalars becomes one fused chain of adds,
    # slow to compile (benchmarks/RESULTS.md, "What limits each case").
    return jax.lax.optimization_barrier(stacked) if len(parts) > 1 else stacked


# Range.


def _needs_rescale(total: jax.Array) -> jax.Array:
    """Whether a sum of powers is inf, or below sqrt(tiny) (0 included), where
    terms may have underflowed."""
    floor = float(np.sqrt(np.finfo(total.dtype).tiny))
    return (total == np.inf) | (total < floor)


def pow2_scale(bound: jax.Array, headroom: int = 0) -> jax.Array:
    """2**(headroom - e) for `bound` = m 2**e (1/2 <= m < 1): multiplying by
    it is exact and brings `bound` into [2**(headroom - 1), 2**headroom)."""
    _, exponent = jnp.frexp(bound)
    limit = int(np.finfo(bound.dtype).maxexp) - 3
    exponent = jnp.clip(headroom - exponent, -limit, limit)
    return jax.lax.stop_gradient(jnp.ldexp(jnp.ones_like(bound), exponent))


def _second_scale(total: jax.Array, p: float) -> jax.Array:
    """The second pass's scale, for 1 <= p <= 2, from the first pass's total:
    `pow2_scale` of a bound on every |x|, with headroom for 2**40 terms.

    An overflowed sum bounds |x| by the largest float; a sum below the floor
    by max(total**(1/p), tiny**(1/p)), which also lifts subnormal entries to
    where their powers are normal floats.
    """
    info = np.finfo(total.dtype)
    headroom = math.floor((int(info.maxexp) - 40) / p) - 1
    smallest = jnp.asarray(float(info.tiny) ** (1 / p), total.dtype)
    low = jnp.maximum(safe_root(total, p), smallest)
    bound = jnp.where(total == np.inf, jnp.asarray(info.max, total.dtype), low)
    return pow2_scale(bound, headroom)


def _norm_of_scaled(
    total: jax.Array, peak: jax.Array, scale: jax.Array, p: float
) -> jax.Array:
    """The norm from a sum scaled by `scale`, with the peak's rules for 0, inf
    and NaN."""
    norm = safe_root(total, p) / scale
    norm = jnp.where(peak == 0, jnp.zeros_like(norm), norm)
    return jnp.where(jnp.isfinite(peak), norm, peak)


def _cond(
    pred: jax.Array, if_true: Callable[[], Any], if_false: Callable[[], Any]
) -> Any:
    """`lax.cond` when traced; eagerly the host chooses, since an eager
    `lax.cond` over closures compiles anew at every call."""
    if _checks.is_traced(pred):
        return jax.lax.cond(pred, if_true, if_false)
    return if_true() if bool(pred) else if_false()


# The global norm.


def global_norm(
    leaves: list[Any], p: float, placements: Placements | None = None
) -> jax.Array:
    """The p-norm over all `leaves`, exact for every finite input.

    With `placements` (`_placement.leaf_placements`), leaves are local blocks
    and the result is the whole sharded tree's norm, the same on every device.
    """
    dtype = tree_accum_dtype(leaves)
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
        """Sum of |x * scale|**p over all leaves, one psum per mesh-axis set."""
        sums = [
            jnp.sum(partial_sums([leaves[i] for i in members[k]], p, dtype, scale))
            for k in sets
        ]
        return jnp.sum(jnp.stack(_placement.psum_each(sums, sets)))

    def peak() -> jax.Array:
        """The largest |x| over all leaves, in one pmax."""
        local = jnp.max(partial_sums(leaves, math.inf, dtype))
        return _placement.pmax_everywhere(local, sets)

    if p == math.inf:
        return peak()
    if p > 2:  # rare orders: the peak, then one sum scaled by it
        top = peak()
        scale = pow2_scale(top)
        return _norm_of_scaled(summed(leaves, scale), top, scale, p)
    return _two_pass_norm(summed, leaves, p)


def _two_pass_norm(
    summed: Callable[[list[jax.Array], jax.Array | None], jax.Array],
    leaves: list[jax.Array],
    p: float,
) -> jax.Array:
    """The p-norm (1 <= p <= 2) from `summed(leaves, scale)`: the plain sum,
    then a second at `_second_scale` where the first `_needs_rescale`.

    The plain pass is optax's bare sum: a sum of scaled powers runs about
    twice as long on leaves in cache. The derivative (`jax.custom_jvp`) is the
    last pass's formula at its constant scale, taken on the scaled leaves, so
    it neither overflows nor underflows. Constants are made inside the
    functions that use them: a tracer closed over by `jax.custom_jvp` escapes
    when the jitted caller is itself differentiated.
    """

    def passes(leaves: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
        """(total, scale) of the last pass."""
        if any(_checks.is_traced(x) and not _placement.is_whole(x) for x in leaves):
            return _looped_passes(summed, leaves, p)
        total = summed(leaves, None)
        one = jnp.ones_like(total)  # typed as `total` is inside shard_map

        def rescaled() -> tuple[jax.Array, jax.Array]:
            scale = _second_scale(total, p)
            return summed(leaves, scale), scale

        pair: tuple[jax.Array, jax.Array] = _cond(
            _needs_rescale(total), rescaled, lambda: (total, one)
        )
        return pair

    @jax.custom_jvp
    def norm(leaves: list[jax.Array]) -> jax.Array:
        total, scale = passes(leaves)
        return safe_root(total, p) / scale

    @norm.defjvp
    def norm_jvp(primals: tuple, tangents: tuple) -> tuple[jax.Array, jax.Array]:
        # With y = x s (s constant) the norm is R(y) / s and its tangent R'(y) dx.
        scale = jax.lax.stop_gradient(passes(primals[0])[1])
        one = jnp.ones_like(scale)
        ys = [_scale_parts(_upcast(x), scale) for x in primals[0]]
        dots = [t.astype(y.dtype) for t, y in zip(tangents[0], ys, strict=True)]
        value, slope = jax.jvp(lambda ys: safe_root(summed(ys, one), p), (ys,), (dots,))
        return value / scale, slope

    return norm(list(leaves))


def _upcast(x: jax.Array) -> jax.Array:
    acc = accum_dtype(x.dtype)
    if jnp.iscomplexobj(x):
        return x.astype(jnp.result_type(acc, jnp.complex64))
    return x.astype(acc)


def _looped_passes(
    summed: Callable[[list[jax.Array], jax.Array | None], jax.Array],
    leaves: list[jax.Array],
    p: float,
) -> tuple[jax.Array, jax.Array]:
    """`_two_pass_norm`'s (total, scale) as the iterations of one
    `lax.while_loop`, so that each leaf's reduction is compiled once, not once
    per pass (benchmarks/RESULTS.md, "On 8 devices"): the first at scale 1,
    the second only where the first `_needs_rescale`."""
    dtype = tree_accum_dtype(leaves)
    one = jnp.ones((), dtype)

    def again(carry: tuple) -> jax.Array:
        total, _, _, count = carry
        return (count == 0) | ((count == 1) & _needs_rescale(total))

    def one_pass(carry: tuple) -> tuple:
        _, _, scale, count = carry
        total = summed(leaves, scale)
        return total, scale, _second_scale(total, p), count + 1

    start = (jnp.zeros((), dtype), one, one, jnp.zeros((), jnp.int32))
    total, scale, _, _ = jax.lax.while_loop(again, one_pass, start)
    return total, scale


def norm_of_norms(norms: jax.Array, p: float = 2.0) -> jax.Array:
    """The p-norm of `norms` (>= 0) along axis 0, scaled by `pow2_scale` of
    the largest entry so that it neither overflows nor underflows where the
    entries do not; NaN if an entry is NaN, else inf if one is inf."""
    if norms.shape[0] == 0:
        return jnp.zeros(norms.shape[1:], norms.dtype)
    peak = jnp.max(norms, axis=0)
    if p == math.inf:
        return peak
    usable = jnp.isfinite(peak) & (peak > 0)
    scale = pow2_scale(jnp.where(usable, peak, jnp.ones_like(peak)))
    norms, factor = _unfolded(norms, scale)
    total = safe_root(jnp.sum(powers(norms * factor, p), axis=0), p) / scale
    return jnp.where(jnp.isfinite(peak), total, jnp.sum(norms, axis=0))


def norm_of_layer_norms(
    norms: list[jax.Array], layer_axes: list[MeshAxes] | None = None
) -> tuple[jax.Array, jax.Array]:
    """The L2 norm of all tensors' norms (their global norm), and whether all
    of those are finite, from each tensor's norms (one per layer of a stacked
    tensor), scaled by `pow2_scale` of the largest; NaN if a norm is NaN, else
    inf if one is inf. Where a tensor's layers are split across devices
    (`layer_axes`: per tensor, the mesh axes that split its stacked axes),
    both are completed across them, so that every device has the same."""
    if not norms:
        return jnp.zeros((), np.float32), jnp.asarray(True)
    layer_axes = list(layer_axes or [()] * len(norms))
    # One vector of the scalars (a few operations whatever their number); a
    # stacked tensor's norms kept apart (they may be split over mesh axes).
    scalars = [n for n in norms if n.ndim == 0]
    parts = [n for n in norms if n.ndim] + ([jnp.stack(scalars)] if scalars else [])
    axes = [a for n, a in zip(norms, layer_axes, strict=True) if n.ndim]
    axes += [()] if scalars else []
    sets = [names for names in dict.fromkeys(axes) if names]
    peak = jnp.max(jnp.stack([jnp.max(part, initial=0.0) for part in parts]))
    broken = jnp.sum(jnp.stack([jnp.sum(~jnp.isfinite(part)) for part in parts]))
    if sets:
        peak = _placement.pmax_everywhere(peak, sets)
        broken = _placement.pmax_everywhere(broken, sets)
    scale = pow2_scale(jnp.where(jnp.isfinite(peak) & (peak > 0), peak, 1.0))
    sums = [jnp.sum(jnp.square(part * scale)) for part in parts]
    if sets:
        sums = _placement.psum_each(sums, axes)
    total = jnp.sqrt(jnp.sum(jnp.stack(sums))) / scale
    return jnp.where(jnp.isfinite(peak), total, peak), broken == 0


def entry(array: jax.Array, index: tuple[int, ...]) -> jax.Array:
    """`array[index]`; where the array is split over explicit mesh axes, as a
    masked sum, which needs no resharding (indexing would)."""
    sharding = getattr(jax.typeof(array), "sharding", None)
    if sharding is None or all(entry is None for entry in sharding.spec):
        return array[index]
    hit = jnp.ones(array.shape, bool)
    for dim, i in enumerate(index):
        hit &= jax.lax.broadcasted_iota(jnp.int32, array.shape, dim) == i
    return jnp.sum(jnp.where(hit, array, jnp.zeros_like(array)))


def layer_norms(
    leaves: _checks.Leaves, placements: Placements | None = None
) -> list[jax.Array]:
    """Each tensor's L2 norm, shaped as its stacked axes (a scalar for a leaf
    not stacked): one reduction over each leaf's inner axes."""
    inner = [leaves.inner(i) for i in range(len(leaves.arrays))]
    norms = tensor_norms(leaves.arrays, inner, placements)
    return [n.reshape(leaves.layers(i)) for i, n in enumerate(norms)]


# Per-tensor norms.


@functools.partial(jax.jit, static_argnums=(1, 2))
def _sum_of_squares(x: jax.Array, axes: tuple[int, ...], keep: bool) -> jax.Array:
    """The float32 (or wider) sum of squares of `x` over `axes`. Jitted, as
    `_root` is, so that leaves of one shape and dtype share one trace
    (benchmarks/RESULTS.md, "What limits each case")."""
    return jnp.sum(powers(_separate_upcast(x), 2.0), axis=axes, keepdims=keep)


_root = jax.jit(safe_root, static_argnums=1)


def tensor_norms(
    leaves: Sequence[Any],
    reduced: Sequence[tuple[int, ...]],
    placements: Placements | None = None,
) -> list[jax.Array]:
    """Each leaf's L2 norms over its `reduced` axes, in float32 (float64 for
    float64 leaves): a scalar where all of a leaf's axes are reduced, else the
    reduced dims kept (size 1).

    With `placements`, each sum is completed over the mesh axes that split
    its reduced dimensions, so every norm is the whole tensor's (or slice's).
    """
    arrays = [jnp.asarray(x) for x in leaves]
    sums = [
        _sum_of_squares(x, axes, len(axes) < x.ndim)
        for x, axes in zip(arrays, reduced, strict=True)
    ]
    if placements is not None:
        split = zip(placements, reduced, strict=True)
        axes = [_placement.split_axes(e, a) for e, a in split]
        varying = [_placement.split_axes(e) for e in placements]
        sums = _placement.psum_each(sums, axes, varies_over=varying)
    return [_root(total, 2.0) for total in sums]
