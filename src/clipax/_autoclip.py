"""AutoClip: clip to a percentile of the recent global norms, kept in opt_state."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from clipax import _adaptive, _checks, _states


@_states.declare("autoclip")
class AutoClipState(NamedTuple):
    """State of `autoclip`: the recent norms and what the last update saw."""

    buffer: jax.Array  # float32 [history] (float64 for float64 updates): the
    # last `history` finite pre-clip global norms, the i-th (0-based) in slot
    # `i % history`; unwritten slots are 0
    count: jax.Array  # int32 scalar: finite norms recorded (saturates)
    norm: jax.Array  # float32 scalar: pre-clip global norm of the last update
    threshold: jax.Array  # float32 scalar: the last threshold (inf before any)


def masked_percentile(values: jax.Array, n: jax.Array, q: ArrayLike) -> jax.Array:
    """`numpy.percentile(values[:n], q)` (linear method) for a traced `n` in
    [1, len(values)]: the entries from `n` on are set to +inf, the array is
    sorted, and the value at NumPy's rank `(n - 1) * q / 100` is interpolated
    as NumPy's `_lerp` does (from the upper neighbour at a fraction >= 0.5).
    `q` is clamped to [0, 100]; a NaN `q` gives NaN."""
    dtype = values.dtype
    q = jnp.clip(jnp.asarray(q, dtype), 0, 100)  # data: clamped, NaN stays
    valid = jnp.arange(values.shape[0]) < n
    ordered = jnp.sort(jnp.where(valid, values, jnp.inf))
    rank = (n - 1).astype(dtype) * (q / 100)
    below = jnp.clip(jnp.floor(rank).astype(jnp.int32), 0, n - 1)
    above = jnp.minimum(below + 1, n - 1)
    t = rank - below.astype(dtype)
    low, high = ordered[below], ordered[above]
    diff = high - low
    value = jnp.where(t >= 0.5, high - diff * (1 - t), low + diff * t)
    return jnp.where(jnp.isnan(q), jnp.nan, value)


def autoclip_rule(
    state: AutoClipState, norm: jax.Array, *, percentile: ArrayLike
) -> tuple[jax.Array, AutoClipState]:
    """The norm joins the ring buffer; the threshold is the percentile of the
    norms recorded so far, this one included."""
    size = state.buffer.shape[0]
    buffer = state.buffer.at[state.count % size].set(norm)
    taken = jnp.clip(optax.safe_int32_increment(state.count), 1, size)
    threshold = masked_percentile(buffer, taken, percentile)
    return threshold, state._replace(buffer=buffer)


def autoclip(
    percentile: ArrayLike = 10.0,
    *,
    history: int = 1000,
    ord: float | None = None,
    axis_name: str | Sequence[str] | None = None,
    specs: Any = None,
) -> optax.GradientTransformation:
    """Clips the updates to a percentile of their own recent global norms.

    AutoClip (Seetharaman et al. 2020): each step the pre-clip global norm
    joins a ring buffer of the last `history` norms in the state, and the
    updates are clipped by global norm to the `percentile`-th percentile of
    the buffer (NumPy's linear interpolation, the current norm included). The
    first step is never clipped. All of it stays on the device: the step
    compiles once. A NaN or inf norm changes no statistic and makes every
    output NaN (docs/semantics.md, "The adaptive rules").

    Args:
      percentile: the percentile to clip to, in [0, 100]; 10 (the paper's) by
        default. May be an array (docs/semantics.md, "Thresholds").
      history: how many of the latest norms the percentile is taken over, an
        int >= 1; it sets the state's shape (static under
        `optax.inject_hyperparams`).
      ord: the global norm's order: None (default) or 2, 1, `inf`, or a real
        p >= 1.
      axis_name: inside `pmap` or `shard_map`, the mesh axes every leaf is
        split over (docs/scaling-out.md).
      specs: inside `shard_map`, the `in_specs` of the updates.

    Returns:
      An `optax.GradientTransformation` whose state is an `AutoClipState`.

    Raises:
      ValueError: at construction, if an argument is not accepted.
      TypeError: at construction, if `history` or `ord` is traced; at `init`
        or `update`, if a leaf is not a float array.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> tx = clipax.autoclip(50.0, history=3)
      >>> state = tx.init({"w": jnp.zeros(1)})
      >>> for g in [1.0, 3.0, 2.0, 10.0]:
      ...     updates, state = tx.update({"w": jnp.array([g])}, state)
      >>> updates["w"]  # the median of the last three norms, 3, 2 and 10
      Array([3.], dtype=float32)

    References:
      Seetharaman et al., `AutoClip: Adaptive Gradient Clipping for Source
      Separation Networks <https://arxiv.org/abs/2007.14469>`_, 2020.
    """
    percentile = _checks.number(
        "percentile", percentile, "a real number in [0, 100]", low=0, high=100
    )
    size = _checks.integer("history", history)
    p = _checks.order(ord)

    def init(dtype: np.dtype) -> AutoClipState:
        return AutoClipState(
            buffer=jnp.zeros((size,), dtype),
            count=jnp.zeros((), jnp.int32),
            norm=jnp.zeros((), dtype),
            threshold=jnp.full((), jnp.inf, dtype),
        )

    rule = functools.partial(autoclip_rule, percentile=percentile)
    return _adaptive.global_rule(
        "autoclip", init, rule, p=p, specs=specs, axis_name=_checks.axis_name(axis_name)
    )
