"""Fewer, larger reductions: how clipax takes the norms of trees of many leaves.

XLA compiles one reduction kernel per leaf when each leaf's norm is taken on its
own, and on CPU its compile time grows faster than linearly in their number
(optax's `clip_by_global_norm` takes about 5 s to compile for 1000 leaves of
1000 floats). Small leaves are therefore reduced in buckets: leaves of one dtype
are flattened and concatenated into a few buffers of bounded size, and each
buffer is reduced once. The copy costs one read and one write of the small
leaves only; large leaves, where a kernel's fixed cost is negligible beside its
bytes, keep a reduction of their own and are never copied.

Bucketing never touches a leaf that may be sharded across devices: concatenating
sharded arrays would reshard them. A leaf is bucketed only when it is known to
live whole on each device (see `can_concatenate`); any other leaf keeps its own
reduction, which lowers to a local reduction plus a scalar all-reduce.

The numbers are those of the per-leaf path: every partial sum is accumulated in
float32 or wider from the leaves' own values, zero padding adds nothing to a sum
of |x|**p nor to a max of |x|, and the order of summation is the only
difference (within float32 rounding of the per-leaf path).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from clipax import _common

# Leaves of at most this many elements are bucketed; larger ones are reduced
# on their own. At 2**16 float32 elements (256 KiB) a kernel's fixed cost on CPU
# is already small beside its memory traffic (benchmarks/RESULTS.md).
SMALL_LEAF = 1 << 16
# The most elements one bucket holds (4 MiB of float32): bounds the temporary
# memory of the concatenation.
BUCKET_ELEMENTS = 1 << 20


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


def _bucket_plan(
    leaves: Sequence[Any],
) -> tuple[list[list[int]], list[int]]:
    """Splits leaf indices into buckets of small leaves and lone leaves.

    A bucket holds small leaves of one dtype, in tree order, with at most
    `BUCKET_ELEMENTS` elements in all. Zero-size leaves are in neither list:
    they add nothing to any norm.
    """
    open_buckets: dict[np.dtype, list[int]] = {}
    filled: dict[np.dtype, int] = {}
    buckets: list[list[int]] = []
    alone: list[int] = []
    for i, x in enumerate(leaves):
        size = int(np.prod(x.shape, dtype=np.int64))
        if size == 0:
            continue
        if size > SMALL_LEAF or not can_concatenate(x):
            alone.append(i)
            continue
        dtype = np.dtype(x.dtype)
        if dtype not in open_buckets or filled[dtype] + size > BUCKET_ELEMENTS:
            open_buckets[dtype] = []
            filled[dtype] = 0
            buckets.append(open_buckets[dtype])
        open_buckets[dtype].append(i)
        filled[dtype] += size
    return buckets, alone


def _concat(parts: Sequence[jax.Array]) -> jax.Array:
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def partial_sums(leaves: Sequence[Any], p: float, dtype: Any) -> jax.Array:
    """A vector whose sum (max for p = inf) is the tree's sum of |x|**p.

    Each entry is the sum of |x|**p (max |x| for p = inf) over one bucket of
    small leaves or one large leaf, accumulated as `_common.power_sum` does and
    cast to `dtype`. The vector has at least one entry (0 for no elements).
    """
    leaves = list(leaves)
    buckets, alone = _bucket_plan(leaves)
    parts = [_common.power_sum(jnp.asarray(leaves[i]), p) for i in alone]
    for bucket in buckets:
        flat = _concat([jnp.ravel(leaves[i]) for i in bucket])
        parts.append(_common.power_sum(flat, p))
    if not parts:
        return jnp.zeros((1,), dtype)
    return jnp.stack([part.astype(dtype) for part in parts])


def total(partials: jax.Array, p: float) -> jax.Array:
    """The sum of `partial_sums` (their max for p = inf)."""
    return jnp.max(partials) if p == math.inf else jnp.sum(partials)
