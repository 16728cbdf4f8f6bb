"""Fewer, larger reductions: how clipax takes the norm of a tree of many leaves.

When each leaf's norm is taken on its own, XLA compiles a few kernels per leaf,
and on CPU its compile time grows faster than linearly in their number (optax's
`clip_by_global_norm` takes about 5 s to compile for 1000 leaves of 1000
floats, 23 s for 2000). clipax reduces small leaves together instead:

- small leaves of one dtype are flattened and concatenated, in tree order,
  into buckets of bounded size, each reduced once: a copy of those leaves,
  made one bucket at a time;
- large leaves, where a kernel's fixed cost is negligible beside its bytes,
  keep a reduction of their own.

Nothing here touches a leaf that may be sharded across devices: concatenating
sharded arrays would reshard them. A leaf joins a bucket only when it is known
to live whole on each device that holds it (see `can_concatenate`); any other
leaf keeps its own reduction, which lowers to a local reduction plus a scalar
all-reduce.

The numbers are those of the per-leaf path: every partial sum is accumulated in
float32 or wider from the leaves' own values; only the order of summation
differs (within float32 rounding).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from clipax import _common

# Leaves of at most this many elements are bucketed; larger ones are reduced
# on their own. Above 2**12 float32 elements (16 KiB) a kernel's fixed cost on
# CPU is small beside its memory traffic, while the copy into a bucket is not
# (benchmarks/RESULTS.md).
SMALL_LEAF = 1 << 12
# `_reduce.slice_norms` stacks at most this many small leaves of one shape.
# Larger stacks compile superlinearly slower (benchmarks/RESULTS.md).
GROUP_LEAVES = 32
# The most elements one bucket holds (128 KiB of float32). Buckets are copied
# one at a time (`partial_sums`), so this bounds the copies' memory. Smaller
# buckets compiled slower (2**14: 9-33 % on GPT-2 and 500 leaves of 1k
# floats), larger ones ran slower (2**16: 7-23 % on 500 x 1k;
# benchmarks/RESULTS.md).
BUCKET_ELEMENTS = 1 << 15
# The most elements `_reduce.slice_norms` stacks in one tree (32 MiB of
# float32): bounds the temporary memory of its stacks, which are copies held
# together; further small leaves take their own reductions.
MAX_BUCKETED = 1 << 23


def can_concatenate(x: Any) -> bool:
    """Whether `x` is known to be whole on every device that holds it.

    True for a concrete array on one device or replicated; for a traced value
    whose abstract sharding names no mesh axis, when it is local to a
    `shard_map` or `pmap` body (every mesh axis manual) or replicated over an
    explicit mesh; and for any traced value when the process has a single
    device. False otherwise, in particular under `jax.jit` with several devices
    and an automatic (unknown) sharding.
    """
    if not _common.is_traced(x):
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


def _is_small(x: Any) -> bool:
    """Nonempty, at most `SMALL_LEAF` elements, and whole on every device."""
    return 0 < x.size <= SMALL_LEAF and can_concatenate(x)


def small_chunks(leaves: Sequence[Any], key: Callable[[int], Any]) -> list[list[int]]:
    """Small leaves that share `key(i)`, in chunks of 2 to `GROUP_LEAVES`: the
    stacks of `_reduce.slice_norms`.

    Small: nonempty, at most `SMALL_LEAF` elements, and whole on every device
    that holds it (`can_concatenate`). A small leaf left alone in a chunk of
    one is in no chunk.
    """
    same: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        if _is_small(x):
            same.setdefault(key(i), []).append(i)
    chunks: list[list[int]] = []
    for members in same.values():
        for start in range(0, len(members), GROUP_LEAVES):
            chunk = members[start : start + GROUP_LEAVES]
            if len(chunk) > 1:
                chunks.append(chunk)
    return chunks


def _plan(leaves: Sequence[Any]) -> tuple[list[list[int]], list[int]]:
    """Splits leaf indices into buckets and lone leaves.

    - A bucket holds small leaves of one dtype, in tree order, with at most
      `BUCKET_ELEMENTS` elements in all.
    - Every other leaf is reduced alone.
    Zero-size leaves are in neither list: they add nothing to any norm.

    Small leaves of one size were once also combined element by element in
    groups (one kernel reading up to 32 leaves, nothing copied). With two
    passes, each group's kernel compiled twice, 30-60 ms each on this CPU,
    where a bucket's concatenation and reduction take a few ms:
    `clip_by_global_norm` compiles 15-40 % faster on model-shaped trees
    without groups (ResNet-50, GPT-2, Llama, 48 layers), and as fast or
    faster elsewhere, with the same run time. Groups copied nothing; buckets
    are copied one at a time (`partial_sums`).
    """
    alone: list[int] = []
    open_buckets: dict[np.dtype, list[int]] = {}
    filled: dict[np.dtype, int] = {}
    buckets: list[list[int]] = []
    for i, x in enumerate(leaves):
        if not x.size:
            continue
        if not _is_small(x):
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


def concat(parts: Sequence[jax.Array]) -> jax.Array:
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def opaque_if_narrow(x: jax.Array, dtype: Any = None) -> jax.Array:
    """`x`, hidden from common-subexpression elimination when it is upcast to
    `dtype` (by default its accumulation dtype: float16 and bfloat16 leaves).

    A float16 or bfloat16 leaf is converted to float32 both here (for its
    norm) and where the scale is applied (a float32 leaf of a float64 tree
    likewise to float64). Left alone, XLA merges the two
    conversions and writes the whole tree out in float32, one more write and
    read of twice the gradients' bytes (and as much temporary memory). An
    optimization barrier, which copies nothing, keeps the conversions apart,
    so each is fused into its own consumer. A second pass over the same leaf
    takes it through a barrier of its own (`scaled_pair`).
    """
    wide = _common.accum_dtype(x.dtype) if dtype is None else np.dtype(dtype)
    if wide.itemsize > np.dtype(x.dtype).itemsize:
        return jax.lax.optimization_barrier(x)
    return x


def scaled_pair(x: jax.Array, scale: Any) -> tuple[jax.Array, jax.Array]:
    """`(x, scale)` through one barrier, for a pass that rescales `x`.

    The pass must multiply by the `scale` returned here. That ties its upcast
    of `x` to this barrier, so that XLA neither merges it with another pass's
    upcast of the same leaf nor hoists it, either of which writes the leaf out
    in float32. And for every dtype: where XLA sees `x` as a constant (zeros
    from `optax.set_to_zero`, a closed-over array), it rewrites (x scale)**2
    as x**2 scale**2, and a scale of 2**80 squares to inf: 0 * inf = NaN.
    """
    pair: tuple[jax.Array, jax.Array] = jax.lax.optimization_barrier(
        (x, jnp.asarray(scale))
    )
    return pair


def partial_sums(
    leaves: Sequence[Any], p: float, dtype: Any, scale: Any = None
) -> jax.Array:
    """A vector whose sum (max for p = inf) is the tree's sum of |x|**p.

    Each entry is the sum of |x|**p (max |x| for p = inf) over one bucket of
    small leaves, or over one large leaf, accumulated in `dtype`
    (the tree's accumulation dtype, float32 or wider; complex leaves in its
    complex type). The vector has at least one entry (0 when there are no
    elements). Every leaf is summed in `dtype`: in a float64 tree, a float32
    leaf's squares neither overflow nor underflow where float64's do not, so
    that a second pass can choose its scale from the first's sum.

    With `scale` (a scalar), every element is also multiplied by it: the sums
    of |x * scale|**p, as a pass that rescales against overflow or underflow
    needs.
    """
    leaves = [jnp.asarray(x) for x in leaves]
    buckets, alone = _plan(leaves)

    def prepared(x: jax.Array) -> jax.Array:
        wide = jnp.result_type(x.dtype, dtype)
        if scale is None:
            return opaque_if_narrow(x, wide).astype(wide)
        # A barrier of its own, so that XLA does not merge this pass's upcast
        # with another pass's over the same leaf (see opaque_if_narrow), nor
        # fold a constant leaf's square with the scale's (see scaled_pair).
        x, factor = scaled_pair(x, scale)
        return _common.scale_by(x.astype(wide), factor.astype(dtype))

    parts = [_common.power_sum(prepared(leaves[i]), p) for i in alone]
    # A bucket is concatenated in its leaves' own dtype and then prepared as
    # one array: one upcast (and one barrier) per bucket, not per leaf; the
    # concatenation is a copy of those small leaves anyway.
    #
    # Each bucket after the first takes one element more: the previous
    # bucket's sum clamped to at most 0, which is 0 for every sum but NaN (a
    # NaN sum makes the total NaN anyway) and adds nothing to |x|**p or to
    # the max. Its copy then waits for the previous bucket's reduction, so
    # that one bucket's copy is held at a time. Left unordered, XLA's CPU
    # scheduler made every bucket's copy before reducing any: a copy of all
    # the small leaves at once (2000 leaves of 1k floats: 7.6 MiB of
    # temporaries, 1.5 x optax's peak; in this order 0.14 MiB;
    # benchmarks/RESULTS.md). An optimization barrier does not order them:
    # XLA removes it before scheduling.
    previous = None
    for bucket in buckets:
        pieces = [jnp.ravel(leaves[i]) for i in bucket]
        if previous is not None:
            after = jax.lax.stop_gradient(jnp.minimum(previous, 0))
            pieces.append(after.astype(pieces[0].dtype).reshape(1))
        previous = _common.power_sum(prepared(concat(pieces)), p)
        parts.append(previous)
    if not parts:
        return jnp.zeros((1,), dtype)
    # Behind a barrier, the vector is summed by one small reduction. Seen
    # through, XLA rewrites the sum of a stack of scalars as a chain of
    # scalar adds fused into one kernel, whose compile time grows with its
    # length (about 0.2 ms an add: 160 ms at 400 leaves, twice, once per
    # pass); with the barrier `clip_by_global_norm` compiles 7-17 % faster
    # on 100 and 400 leaves of 40k floats, 5-10 % on a Llama-shaped tree
    # (benchmarks/RESULTS.md).
    stacked = jnp.stack([part.astype(dtype) for part in parts])
    return jax.lax.optimization_barrier(stacked) if len(parts) > 1 else stacked


def total(partials: jax.Array, p: float) -> jax.Array:
    """The sum of `partial_sums` (their max for p = inf)."""
    return jnp.max(partials) if p == math.inf else jnp.sum(partials)
