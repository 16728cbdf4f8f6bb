"""AutoClip: clip to a percentile of the recent global norms, kept in opt_state."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from clipax import _adaptive, _common, _states
from clipax._placement import AxisName


@_states.register("autoclip")
class AutoClipState(NamedTuple):
    """State of `autoclip`: the recent norms and what the last update saw."""

    buffer: jax.Array  # float32 [history] (float64 for float64 updates): ring
    # buffer of the last `history` finite pre-clip global norms; slot
    # `i % history` holds the i-th one (0-based); unwritten slots are 0
    count: jax.Array  # type: ignore[assignment]  # int32 scalar: finite norms
    # recorded so far (saturates at 2**31 - 1)
    norm: jax.Array  # float32 scalar: pre-clip global norm of the last update
    threshold: jax.Array  # float32 scalar: the last threshold (inf before any)


def masked_percentile(values: jax.Array, n: jax.Array, q: ArrayLike) -> jax.Array:
    """`numpy.percentile(values[:n], q)` (linear method) for a traced `n`.

    `values` has a fixed length L and `n` is an int in [1, L], so the number
    of entries taken is dynamic under jit while every shape stays static: the
    entries from `n` on are set to +inf, the whole array is sorted, and the
    value at NumPy's fractional rank `(n - 1) * q / 100` is interpolated as
    NumPy's `_lerp` does (from the upper neighbour when the fraction is >= 0.5).
    """
    length = values.shape[0]
    dtype = values.dtype
    valid = jnp.arange(length) < n
    ordered = jnp.sort(jnp.where(valid, values, jnp.inf))
    rank = (n - 1).astype(dtype) * (jnp.asarray(q, dtype) / 100)
    below = jnp.clip(jnp.floor(rank).astype(jnp.int32), 0, n - 1)
    above = jnp.minimum(below + 1, n - 1)
    t = rank - below.astype(dtype)
    low, high = ordered[below], ordered[above]
    diff = high - low
    return jnp.where(t >= 0.5, high - diff * (1 - t), low + diff * t)


def _check_percentile(percentile: Any) -> None:
    accepted = "a real number in [0, 100]"
    _common.check_scalar("percentile", percentile, accepted, low=0, high=100)


def autoclip_rule(
    stats: _adaptive.Stats, norm: jax.Array, count: jax.Array, *, percentile: ArrayLike
) -> tuple[jax.Array, _adaptive.Stats]:
    """AutoClip's rule: the norm joins the ring buffer (slot `count % history`);
    the threshold is the percentile of the norms recorded so far, this one
    included."""
    buffer = stats["buffer"]
    size = buffer.shape[0]
    buffer = buffer.at[count % size].set(norm)
    taken = jnp.clip(optax.safe_int32_increment(count), 1, size)
    return masked_percentile(buffer, taken, percentile), {"buffer": buffer}


def autoclip(
    percentile: ArrayLike = 10.0,
    *,
    history: int = 1000,
    ord: float | None = None,
    axis_name: AxisName = None,
    specs: Any = None,
) -> optax.GradientTransformation:
    """Clips the updates to a percentile of their own recent global norms.

    AutoClip (Seetharaman et al. 2020): each step, the pre-clip global norm of
    the updates joins a ring buffer of the last `history` norms in the
    optimizer state; the threshold is `numpy.percentile` (linear interpolation)
    of the norms in the buffer, the current one included; and the updates are
    clipped by global norm to that threshold with TensorFlow's formula, as in
    `clipax.clip_by_global_norm`. The first step is never clipped (its norm is
    its own percentile). The paper keeps every norm since the start; `history`
    bounds the memory to O(history) and lets the threshold follow the run.

    Everything stays on the device: the percentile is taken by sorting the
    fixed-size buffer, with its unused slots set to +inf, and interpolating at
    a rank computed from the traced count, so the step compiles once and never
    syncs with the host.

    A NaN or inf norm leaves the buffer, count and threshold as they were (one
    broken step does not poison the next `history` thresholds), and makes
    every output NaN, as `clipax.clip_by_global_norm` does; wrap the chain in
    `optax.apply_if_finite` to skip such steps. Norms are accumulated in
    float32 (float64 for float64 updates).

    Args:
      percentile: the percentile of the recent norms to clip to, in [0, 100];
        10 (the paper's choice) by default. May be traced (as under
        `optax.inject_hyperparams`); then it is not checked.
      history: how many of the latest norms the percentile is taken over, an
        int >= 1. It sets the state's shape: under `optax.inject_hyperparams`,
        name it in `static_args`.
      ord: the order of the global norm: None (default) or 2 for L2, 1, `inf`,
        or any real p >= 1 (None, as in `clipax.clip_by_global_norm`, so that
        `optax.inject_hyperparams` leaves it static).
      axis_name: inside `pmap` or `shard_map`, the mesh axes every update leaf
        is split over (see `clipax.tree.global_norm`).
      specs: inside `shard_map`, the `in_specs` of the updates, a prefix tree of
        PartitionSpecs (see `clipax.tree.global_norm`).

    Returns:
      An `optax.GradientTransformation` whose state is an `AutoClipState`.

    Raises:
      ValueError: at construction, if `percentile`, `history` or `ord` is not
        accepted.
      TypeError: at construction, if `history` or `ord` is traced.
      TypeError: at `init` or `update`, if a leaf is not a floating-point or
        complex array.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import clipax
      >>> tx = clipax.autoclip(50.0, history=3)
      >>> state = tx.init({"w": jnp.zeros(1)})
      >>> for g in [1.0, 3.0, 2.0, 10.0]:
      ...     updates, state = tx.update({"w": jnp.array([g])}, state)
      >>> updates["w"]  # the median of the last three norms, 3, 2 and 10
      Array([3.], dtype=float32)
      >>> state.norm, state.threshold, state.count
      (Array(10., dtype=float32), Array(3., dtype=float32), Array(4, dtype=int32))

    References:
      Seetharaman et al., `AutoClip: Adaptive Gradient Clipping for Source
      Separation Networks <https://arxiv.org/abs/2007.14469>`_, 2020.
    """
    _check_percentile(percentile)
    size = _adaptive.check_count("history", history)
    p = _common.check_ord(ord)
    return _adaptive.transformation(
        "autoclip",
        AutoClipState,
        lambda dtype: {"buffer": jnp.zeros((size,), dtype)},
        functools.partial(autoclip_rule, percentile=percentile),
        ord=p,
        axis_name=axis_name,
        specs=specs,
    )
