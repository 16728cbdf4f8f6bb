"""Norms, accumulated in float32 or wider; the clip factor, and applying it.

Every norm clipax takes is read here, from the leaves' records (`_leaves`):
a sum over a leaf is completed over exactly the mesh axes that split the
reduced dimensions (psum; pmax for a maximum), so that a replicated leaf
counts once; under `jax.jit` over sharded arrays XLA completes it itself.

`global_norm` is exact for every finite input: small leaves that are whole on
their device are concatenated per dtype into buckets, each bucket and each
other leaf gives one partial sum of |x|**p, and the partial sums are added.
When that plain sum is inf, or so small that terms may have underflowed, one
`lax.cond` sums again with every element scaled by one power of two; the common
path pays one scalar test. Where a leaf may be split in a way only XLA knows,
both passes are the iterations of one `lax.while_loop`. Orders above 2 take the
largest |x| first and sum once, scaled by it; the inf-norm is a maximum.

`norms` gives each leaf's norms over some of its axes: the bare formula (a
float32 sum of |x|**p and its root, as the per-tensor rules take it, whose
squares may overflow above about 1e19), or `exact`, each norm scaled by its
own peak where the plain sums need it (group norms).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from clipax._checks import is_traced
from clipax._leaves import Leaf, MeshAxes, accum_dtype, replicated, tree_accum_dtype

# Leaves of at most this many elements are bucketed, and a bucket holds at most
# BUCKET_ELEMENTS: see benchmarks/RESULTS.md, "What limits each case".
SMALL_LEAF = 1 << 12
BUCKET_ELEMENTS = 1 << 15


# Dtypes and powers.


def _hypot(re: jax.Array, im: jax.Array) -> jax.Array:
    """|re + i im| without overflow or underflow, with a finite gradient at 0."""
    big = jnp.maximum(jnp.abs(re), jnp.abs(im))
    small = jnp.minimum(jnp.abs(re), jnp.abs(im))
    zero = big == 0
    ratio = small / jnp.where(zero, jnp.ones_like(big), big)
    return jnp.where(zero, jnp.zeros_like(big), big * jnp.sqrt(1 + jnp.square(ratio)))


def upcast(x: jax.Array, like: Any = None) -> jax.Array:
    """`x` in the `accum_dtype` of `like` (of its own dtype by default), the
    one upcast before any accumulation: complex where `x` is."""
    acc = accum_dtype(x.dtype if like is None else like)
    if jnp.iscomplexobj(x):
        return x.astype(jnp.result_type(acc, jnp.complex64))
    return x.astype(acc)


def powers(x: jax.Array, p: float) -> jax.Array:
    """|x|**p element by element (|x| for p = inf), in float32 or wider; a
    complex leaf counts its modulus, taken without overflow."""
    x, is_complex = upcast(x), jnp.iscomplexobj(x)
    if p == 2:
        return jnp.square(x.real) + jnp.square(x.imag) if is_complex else jnp.square(x)
    magnitude = _hypot(x.real, x.imag) if is_complex else jnp.abs(x)
    return magnitude if p in (1.0, math.inf) else magnitude**p


def power_sum(
    x: jax.Array, p: float, axes: tuple[int, ...] | None = None, keep: bool = False
) -> jax.Array:
    """Sum of |x|**p over `axes` (max |x| for p = inf; all axes for None), the
    reduced dims kept where `keep`; 0 for no elements."""
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


class Limit(NamedTuple):
    """A threshold t as `clip_factor` reads it: max(t, 0) over max(t, tiny),
    t capped at the largest float (so inf clips nothing: max / max = 1)."""

    top: jax.Array
    floor: jax.Array


def limit(max_norm: Any, dtype: Any) -> Limit:
    """`max_norm` (a float, or an array of any real dtype) as a `Limit`."""
    info = np.finfo(dtype)
    t = jnp.minimum(jnp.asarray(max_norm).astype(dtype), info.max)
    return Limit(jnp.maximum(t, 0), jnp.maximum(t, info.tiny))


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
    operations per norm (a `Limit` is taken once, then shared): in per-tensor
    rules each operation is compiled once per leaf.
    """
    t = max_norm if isinstance(max_norm, Limit) else limit(max_norm, norm.dtype)
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


# Across devices.


def complete(
    values: list[jax.Array],
    axes: list[MeshAxes],
    varies_over: Sequence[Hashable] | None = None,
    op: Any = jax.lax.psum,
) -> list[jax.Array]:
    """Each value reduced with `op` (psum, or pmax) over its mesh `axes`.

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
        reduced = op(jnp.concatenate([jnp.ravel(values[i]) for i in index]), names)
        sizes = np.cumsum([values[i].size for i in index])[:-1]
        for i, piece in zip(index, jnp.split(reduced, sizes), strict=True):
            out[i] = piece.reshape(values[i].shape).astype(values[i].dtype)
    return out


def pmax_all(value: jax.Array, axes: Sequence[MeshAxes]) -> jax.Array:
    """pmax over every mesh axis in `axes`, in one collective: max is
    idempotent, so a value already equal across some of them is unchanged."""
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
    if not is_traced(x):
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
            return jax.sharding.AxisType.Auto not in mesh.axis_types
    return jax.device_count() == 1


# Buckets and partial sums.


def _buckets(arrays: Sequence[Any]) -> tuple[list[list[int]], list[int]]:
    """Leaf indices in buckets (small whole leaves of one dtype, in tree order,
    at most `BUCKET_ELEMENTS` each) and the leaves reduced alone; zero-size
    leaves are in neither."""
    alone: list[int] = []
    open_buckets: dict[np.dtype, list[int]] = {}
    filled: dict[np.dtype, int] = {}
    buckets: list[list[int]] = []
    for i, x in enumerate(arrays):
        if not x.size:
            continue
        if x.size > SMALL_LEAF or not is_whole(x):
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


def _upcast_barrier(x: jax.Array, dtype: Any = None) -> jax.Array:
    """`x` behind an optimization barrier when it is upcast to `dtype` (its
    `accum_dtype` by default): XLA would otherwise share one float32 copy of
    a narrow leaf between the norm and the clip, and write it out whole
    (benchmarks/RESULTS.md, "Each clip alone")."""
    wide = accum_dtype(x.dtype) if dtype is None else np.dtype(dtype)
    if wide.itemsize > np.dtype(x.dtype).itemsize:
        return jax.lax.optimization_barrier(x)
    return x


def _scale_barrier(x: jax.Array, scale: Any) -> tuple[jax.Array, jax.Array]:
    """`(x, scale)` through one optimization barrier, for a pass that
    multiplies `x` by `scale`: where XLA sees `x` as a constant it rewrote
    (x s)**2 as x**2 s**2, and s**2 overflows for the largest scales. It also
    keeps this pass's upcast of a narrow `x` apart (`_upcast_barrier`)."""
    return jax.lax.optimization_barrier((x, jnp.asarray(scale)))


def partial_sums(
    arrays: Sequence[Any], p: float, dtype: Any, scale: Any = None
) -> jax.Array:
    """A vector whose sum (max for p = inf) is the sum of |x * scale|**p over
    `arrays` (|x|**p without `scale`): one entry per bucket and per leaf
    reduced alone, each in `dtype`; at least one entry (0 for no elements)."""
    arrays = [jnp.asarray(x) for x in arrays]
    buckets, alone = _buckets(arrays)

    def prepared(x: jax.Array) -> jax.Array:
        if scale is None:
            return upcast(_upcast_barrier(x, dtype), like=dtype)
        x, factor = _scale_barrier(x, scale)
        return _scale_parts(upcast(x, like=dtype), factor.astype(dtype))

    parts = [power_sum(prepared(arrays[i]), p) for i in alone]
    for bucket in buckets:
        whole = jnp.concatenate([jnp.ravel(arrays[i]) for i in bucket])
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
    top = int(np.finfo(bound.dtype).maxexp) - 3
    exponent = jnp.clip(headroom - exponent, -top, top)
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


def _from_peak(norm: jax.Array, peak: jax.Array) -> jax.Array:
    """`norm` with the peak's rules, the one place a NaN or inf entry
    overrides a norm taken scaled by its peak: 0 for a zero peak, the peak
    where it is inf or NaN."""
    norm = jnp.where(peak == 0, jnp.zeros_like(norm), norm)
    return jnp.where(jnp.isfinite(peak), norm, peak)


def _cond(
    pred: jax.Array, if_true: Callable[[], Any], if_false: Callable[[], Any]
) -> Any:
    """`lax.cond` when traced; eagerly the host chooses, since an eager
    `lax.cond` over closures compiles anew at every call."""
    if is_traced(pred):
        return jax.lax.cond(pred, if_true, if_false)
    return if_true() if bool(pred) else if_false()


# The global norm.


def global_norm(items: Sequence[Leaf], p: float) -> jax.Array:
    """The p-norm over all leaves, exact for every finite input; where the
    leaves are placed (`specs`, `axis_name`), the whole sharded tree's norm,
    the same on every device."""
    arrays = [leaf.x for leaf in items]
    dtype = tree_accum_dtype(arrays)
    if not arrays:
        return jnp.zeros((), dtype)
    members: dict[MeshAxes, list[int]] = {}
    for i, leaf in enumerate(items):
        members.setdefault(leaf.split(), []).append(i)
    sets = list(members)

    def summed(arrays: list[jax.Array], scale: jax.Array | None) -> jax.Array:
        """Sum of |x * scale|**p over all leaves, one psum per mesh-axis set."""
        sums = [
            jnp.sum(partial_sums([arrays[i] for i in members[k]], p, dtype, scale))
            for k in sets
        ]
        return jnp.sum(jnp.stack(complete(sums, sets)))

    def peak() -> jax.Array:
        """The largest |x| over all leaves, in one pmax."""
        return pmax_all(jnp.max(partial_sums(arrays, math.inf, dtype)), sets)

    if p == math.inf:
        return peak()
    if p > 2:  # rare orders: the peak, then one sum scaled by it
        top = peak()
        scale = pow2_scale(top)
        return _from_peak(safe_root(summed(arrays, scale), p) / scale, top)
    return _two_pass_norm(summed, arrays, p)


def _two_pass_norm(
    summed: Callable[[list[jax.Array], jax.Array | None], jax.Array],
    arrays: list[jax.Array],
    p: float,
) -> jax.Array:
    """The p-norm (1 <= p <= 2) from `summed(arrays, scale)`: the plain sum,
    then a second at `_second_scale` where the first `_needs_rescale`.

    The plain pass is optax's bare sum: a sum of scaled powers runs about
    twice as long on leaves in cache. The derivative (`jax.custom_jvp`) is the
    last pass's formula at its constant scale, taken on the scaled leaves, so
    it neither overflows nor underflows. Constants are made inside the
    functions that use them: a tracer closed over by `jax.custom_jvp` escapes
    when the jitted caller is itself differentiated.
    """

    def passes(arrays: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
        """(total, scale) of the last pass."""
        if any(is_traced(x) and not is_whole(x) for x in arrays):
            return _looped_passes(summed, arrays, p)
        total = summed(arrays, None)
        one = jnp.ones_like(total)  # typed as `total` is inside shard_map

        def rescaled() -> tuple[jax.Array, jax.Array]:
            scale = _second_scale(total, p)
            return summed(arrays, scale), scale

        return _cond(_needs_rescale(total), rescaled, lambda: (total, one))

    @jax.custom_jvp
    def norm(arrays: list[jax.Array]) -> jax.Array:
        total, scale = passes(arrays)
        return safe_root(total, p) / scale

    @norm.defjvp
    def norm_jvp(primals: tuple, tangents: tuple) -> tuple[jax.Array, jax.Array]:
        # With y = x s (s constant) the norm is R(y) / s and its tangent R'(y) dx.
        scale = jax.lax.stop_gradient(passes(primals[0])[1])
        one = jnp.ones_like(scale)
        ys = [_scale_parts(upcast(x), scale) for x in primals[0]]
        dots = [t.astype(y.dtype) for t, y in zip(tangents[0], ys, strict=True)]
        value, slope = jax.jvp(lambda ys: safe_root(summed(ys, one), p), (ys,), (dots,))
        return value / scale, slope

    return norm(list(arrays))


def _looped_passes(
    summed: Callable[[list[jax.Array], jax.Array | None], jax.Array],
    arrays: list[jax.Array],
    p: float,
) -> tuple[jax.Array, jax.Array]:
    """`_two_pass_norm`'s (total, scale) as the iterations of one
    `lax.while_loop`, so that each leaf's reduction is compiled once, not once
    per pass (benchmarks/RESULTS.md, "On 8 devices"): the first at scale 1,
    the second only where the first `_needs_rescale`."""
    dtype = tree_accum_dtype(arrays)
    one = jnp.ones((), dtype)

    def again(carry: tuple) -> jax.Array:
        total, _, _, count = carry
        return (count == 0) | ((count == 1) & _needs_rescale(total))

    def one_pass(carry: tuple) -> tuple:
        _, _, scale, count = carry
        total = summed(arrays, scale)
        return total, scale, _second_scale(total, p), count + 1

    start = (jnp.zeros((), dtype), one, one, jnp.zeros((), jnp.int32))
    total, scale, _, _ = jax.lax.while_loop(again, one_pass, start)
    return total, scale


# Norms over some axes of each leaf. The per-tensor helpers here and in the
# rules (`_adagc._tensor_step`, `_agc._clip_units`, `_block_rms._rms_factor`,
# `tree._norm._clip_factor`) are jitted at module level: inside a traced step
# a jitted call of a shape seen before reuses its trace, so the step's trace
# and compile time grow with the distinct shapes, not the tensors (compile
# time counts as run time does; benchmarks/RESULTS.md, "What limits each case").


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _power_sum(x: jax.Array, p: float, axes: tuple[int, ...], keep: bool) -> jax.Array:
    """`power_sum`, jitted so that leaves of one shape and dtype share one
    trace (benchmarks/RESULTS.md, "What limits each case")."""
    return power_sum(_upcast_barrier(x), p, axes, keep)


_root = jax.jit(safe_root, static_argnums=1)


def norms(
    items: Sequence[Leaf],
    reduced: Sequence[tuple[int, ...]],
    p: float = 2.0,
    *,
    exact: bool = False,
) -> list[jax.Array]:
    """Each leaf's p-norms over its `reduced` axes, in float32 (float64 for
    float64 leaves): a scalar where all of a leaf's axes are reduced, else
    the reduced dims kept (size 1). Each sum is completed over the mesh axes
    that split the reduced dimensions, so every norm is the whole tensor's.

    The plain norm is the bare formula. An `exact` one is right for every
    finite input: where any plain sum is inf or may have underflowed, every
    sum is taken again with each slice scaled by `_second_scale` of its own
    total (orders above 2: by its peak, always).
    """
    arrays = [jnp.asarray(leaf.x) for leaf in items]
    keep = [len(axes) < x.ndim for x, axes in zip(arrays, reduced, strict=True)]

    def sums(q: float, scales: list[Any] | None = None) -> list[jax.Array]:
        out = []
        for i, (x, axes) in enumerate(zip(arrays, reduced, strict=True)):
            if scales is None:
                out.append(_power_sum(x, q, axes, keep[i]))
                continue
            x, scale = _scale_barrier(x, scales[i])
            out.append(power_sum(_scale_parts(upcast(x), scale), q, axes, keep[i]))
        split = [leaf.split(axes) for leaf, axes in zip(items, reduced, strict=True)]
        op = jax.lax.pmax if q == math.inf else jax.lax.psum
        return complete(out, split, [leaf.split() for leaf in items], op)

    if p == math.inf:
        return sums(p)
    if not exact:
        return [_root(t, p) for t in sums(p)]
    if p > 2:  # rare orders: each slice's peak, then one sum scaled by it
        peaks = sums(math.inf)
        scales = [peak_scale(m) for m in peaks]
        totals = sums(p, scales)
        return [
            _from_peak(safe_root(t, p) / s, m)
            for t, s, m in zip(totals, scales, peaks, strict=True)
        ]
    # The plain sums, then (one cond) all of them again where one needs it:
    # the plain pass is the per-tensor rules' own, which XLA then shares.
    plain = sums(p)
    ones = [jnp.ones_like(t) for t in plain]

    def rescaled() -> tuple[list[jax.Array], list[jax.Array]]:
        second = [_second_scale(t, p) for t in plain]
        return sums(p, second), second

    needs = jnp.any(jnp.stack([jnp.any(_needs_rescale(t)) for t in plain]))
    # Every device takes the same branch: its collectives must all meet.
    needs = pmax_all(needs.astype(jnp.int32), [leaf.split() for leaf in items]) > 0
    totals, scales = _cond(needs, rescaled, lambda: (plain, ones))
    return [safe_root(t, p) / s for t, s in zip(totals, scales, strict=True)]


def layer_norms(
    items: Sequence[Leaf], p: float = 2.0, *, exact: bool = False
) -> list[jax.Array]:
    """Each leaf's p-norm per layer (of its inner axes), shaped as its layers,
    whole on every device under `jax.jit` (a state's statistics are)."""
    reduced = norms(items, [leaf.inner for leaf in items], p, exact=exact)
    return [
        replicated(n.reshape(leaf.layers))
        for leaf, n in zip(items, reduced, strict=True)
    ]


def peak_scale(peak: jax.Array) -> jax.Array:
    """`pow2_scale` of `peak` where it is finite and positive, else 1."""
    usable = jnp.isfinite(peak) & (peak > 0)
    return pow2_scale(jnp.where(usable, peak, jnp.ones_like(peak)))


def norm_of_norms(values: jax.Array, p: float = 2.0) -> jax.Array:
    """The p-norm of `values` (>= 0) along axis 0, scaled by `pow2_scale` of
    the largest entry so that it neither overflows nor underflows where the
    entries do not; NaN if an entry is NaN, else inf if one is inf."""
    peak = jnp.max(values, axis=0, initial=0.0)  # 0 for no entries
    if p == math.inf:
        return peak
    scale = peak_scale(peak)
    values, factor = _scale_barrier(values, scale)
    total = safe_root(jnp.sum(powers(values * factor, p), axis=0), p) / scale
    return _from_peak(total, peak)


def total_norm(
    norms: list[jax.Array], layer_axes: list[MeshAxes]
) -> tuple[jax.Array, jax.Array]:
    """The L2 norm of all tensors' norms (their global norm), and whether all
    of those are finite, from each leaf's norms (one per layer of a stacked
    leaf); NaN if a norm is NaN, else inf if one is inf. Where a leaf's layers
    are split across devices (`layer_axes`, per leaf), both are completed
    across them, so that every device has the same."""
    if not norms:
        return jnp.zeros((), np.float32), jnp.asarray(True)
    # The scalars as one vector (a few operations whatever their number); a
    # stacked leaf's norms kept apart (they may be split over mesh axes).
    scalars = [n for n in norms if n.ndim == 0]
    parts = [n for n in norms if n.ndim] + ([jnp.stack(scalars)] if scalars else [])
    axes = [a for n, a in zip(norms, layer_axes, strict=True) if n.ndim]
    axes += [()] if scalars else []
    peak = pmax_all(jnp.max(jnp.stack([jnp.max(v, initial=0.0) for v in parts])), axes)
    broken = jnp.sum(jnp.stack([jnp.sum(~jnp.isfinite(v)) for v in parts]))
    broken = pmax_all(broken, axes)
    scale = peak_scale(peak)
    sums = complete([jnp.sum(jnp.square(v * scale)) for v in parts], axes)
    total = jnp.sqrt(jnp.sum(jnp.stack(sums))) / scale
    return _from_peak(total, peak), broken == 0


def gathered(values: jax.Array, dim: int, names: MeshAxes) -> jax.Array:
    """`values`, split along `dim` over the mesh axes `names` (inside
    `shard_map`), whole on every device (`Leaf.own`'s inverse), typed as the
    same on each, as a state's `out_specs` need it: JAX 0.10 spells that
    `all_gather(..., to="invarying")`, older ones `all_gather_invariant`."""
    if hasattr(jax.lax, "all_gather_invariant"):
        return jax.lax.all_gather_invariant(values, names, axis=dim, tiled=True)
    return jax.lax.all_gather(values, names, axis=dim, tiled=True, to="invarying")
