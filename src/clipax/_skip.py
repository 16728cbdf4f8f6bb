"""`skip_spikes`: drop a step whose gradient norm or loss spikes, on device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from clipax import _checks, _engine, _leaves, _states


@_states.declare("skip_spikes", inner="inner_state")
class SkipSpikesState(NamedTuple):
    """State of `skip_spikes`: the wrapped state and the spike statistics.

    The statistics are those of accepted steps only. `dtype` below is float32,
    or float64 when an update leaf is float64.
    """

    inner_state: optax.OptState  # the wrapped transformation's state, as it was
    # after the last accepted step (bit for bit unchanged by a skipped one)
    skipped: jax.Array  # bool scalar: the last step was skipped
    forced: jax.Array  # bool scalar: the last step was an outlier, let through
    # because `max_consecutive_skips` steps in a row had been skipped
    skipped_count: jax.Array  # int32 scalar: steps skipped in all (saturates)
    consecutive_skips: jax.Array  # int32 scalar: skipped steps in a row up to
    # the last one (0 after an accepted step)
    accepted_count: jax.Array  # int32 scalar: accepted steps (saturates)
    norm: jax.Array  # dtype scalar: the last step's global norm, pre-inner
    norm_mean: jax.Array  # dtype scalar: running mean of accepted norms
    norm_variance: jax.Array  # dtype scalar: running variance of accepted norms
    loss: jax.Array  # dtype scalar: the last `loss=` passed (NaN before any)
    loss_count: jax.Array  # int32 scalar: accepted steps that passed a loss
    loss_mean: jax.Array  # dtype scalar: running mean of accepted losses
    loss_variance: jax.Array  # dtype scalar: running variance of accepted losses


def _moments(
    x: jax.Array, count: jax.Array, mean: jax.Array, variance: jax.Array, alpha: Any
) -> tuple[jax.Array, jax.Array]:
    """Mean and variance after one more value `x`, with weight
    `w = max(1 - alpha, 1 / (count + 1))`: the exact mean and population
    variance of the values so far while `count + 1 < 1 / (1 - alpha)`, an EMA
    with factor `alpha` from then on (West's incremental form)."""
    dtype = mean.dtype
    w = jnp.maximum(1 - jnp.asarray(alpha, dtype), 1 / (count.astype(dtype) + 1))
    delta = x - mean
    return mean + w * delta, (1 - w) * (variance + w * jnp.square(delta))


def _outlier(
    x: jax.Array,
    count: jax.Array,
    mean: jax.Array,
    variance: jax.Array,
    z_threshold: Any,
    warmup: Any,
) -> jax.Array:
    """`x - mean > z_threshold * std` once `warmup` values were accepted."""
    zt = jnp.asarray(z_threshold, mean.dtype)
    return (count >= warmup) & (x - mean > zt * jnp.sqrt(variance))


def skip_spikes(
    inner: optax.GradientTransformation,
    *,
    z_threshold: ArrayLike = 6.0,
    alpha: ArrayLike = 0.985,
    warmup_steps: int = 64,
    max_consecutive_skips: int = 10,
    max_norm: ArrayLike | None = None,
    axis_name: str | Sequence[str] | None = None,
    specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Skips a step whose gradient norm (or loss) is non-finite or a spike.

    Wraps `inner` (any transformation, e.g. the whole `optax.chain(clip,
    adamw)`). A step is skipped when the global norm of the incoming updates,
    or the `loss=` passed to `update`, is NaN or inf, when the norm is above
    `max_norm`, or when either is a spike: more than `z_threshold` standard
    deviations above the running mean of accepted steps, once `warmup_steps`
    were accepted. A skipped step returns zero updates and `inner`'s state
    bit for bit as it was; after `max_consecutive_skips` skips in a row the
    next spike is let through (`forced`). Every decision is a select on the
    device, the same on every device (docs/skipping-and-logging.md).

    Args:
      inner: the transformation whose steps are skipped; extra arguments of
        `update` (`loss=` included) are forwarded to it.
      z_threshold: the z-score above which a norm (or loss) is a spike, > 0;
        `inf` turns the statistical tests off.
      alpha: the EMA factor of the statistics, in (0, 1).
      warmup_steps: accepted steps before the z-tests start, an int >= 1.
      max_consecutive_skips: after this many skips in a row the next spike
        is let through, an int >= 1.
      max_norm: None (default), or a norm above which a step is always
        skipped: a positive scalar or an array.
      axis_name: inside `pmap` or `shard_map`, the mesh axes every leaf is
        split over (docs/scaling-out.md).
      specs: inside `shard_map`, the `in_specs` of the updates.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a
      `SkipSpikesState`; its `update` takes an optional scalar `loss=`.

    Raises:
      TypeError: at construction, if `inner` is not a transformation, or
        `z_threshold`, `alpha` or `max_norm` is not a real number.
      ValueError: at construction, if an argument is not accepted.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import clipax
      >>> tx = clipax.skip_spikes(optax.adam(0.1), warmup_steps=3)
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> for g in [1.0, 1.2, 0.9, 1.1, 50.0]:  # a spike at the last step
      ...     updates, state = tx.update({"w": jnp.array([g, 0.0])}, state)
      >>> updates["w"], state.skipped, state.inner_state[0].count
      (Array([0., 0.], dtype=float32), Array(True, dtype=bool), Array(4, dtype=int32))
    """
    _checks.transformation("inner", inner)
    z_threshold = _checks.positive("z_threshold", z_threshold, inf_ok=True)
    alpha = _checks.unit("alpha", alpha)
    warmup_steps = _checks.integer("warmup_steps", warmup_steps, data_ok=True)
    max_consecutive_skips = _checks.integer(
        "max_consecutive_skips", max_consecutive_skips, data_ok=True
    )
    if max_norm is not None:
        max_norm = _checks.threshold("max_norm", max_norm)
    names = _checks.axis_name(axis_name)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: optax.Params) -> SkipSpikesState:
        dtype = _engine.tree_accum_dtype(_leaves.leaves(params, "skip_spikes").arrays)
        zero, count = jnp.zeros((), dtype), jnp.zeros((), jnp.int32)
        return SkipSpikesState(
            inner_state=inner.init(params),
            skipped=jnp.zeros((), bool),
            forced=jnp.zeros((), bool),
            skipped_count=count,
            consecutive_skips=count,
            accepted_count=count,
            norm=zero,
            norm_mean=zero,
            norm_variance=zero,
            loss=jnp.full((), jnp.nan, dtype),
            loss_count=count,
            loss_mean=zero,
            loss_variance=zero,
        )

    def update_fn(
        updates: optax.Updates,
        state: SkipSpikesState,
        params: optax.Params | None = None,
        *,
        loss: ArrayLike | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, SkipSpikesState]:
        dtype = state.norm.dtype
        leaves = _leaves.leaves(updates, "skip_spikes", specs=specs, axis_name=names)
        norm = _engine.global_norm(leaves, 2.0).astype(dtype)
        n = state.accepted_count
        broken = ~jnp.isfinite(norm)
        outlier = _outlier(
            norm, n, state.norm_mean, state.norm_variance, z_threshold, warmup_steps
        )
        if max_norm is not None:  # a NaN `max_norm` skips every step
            broken |= ~(norm <= jnp.asarray(max_norm).astype(dtype))
        if loss is not None:
            value = jnp.asarray(loss)
            _checks.data("loss", value, "a scalar: the step's loss")
            value = value.astype(dtype)
            broken |= ~jnp.isfinite(value)
            outlier |= _outlier(
                value,
                state.loss_count,
                state.loss_mean,
                state.loss_variance,
                z_threshold,
                warmup_steps,
            )
        forced = outlier & ~broken & (state.consecutive_skips >= max_consecutive_skips)
        skip = broken | (outlier & ~forced)
        accept = ~skip

        inner_extra = extra_args if loss is None else {**extra_args, "loss": loss}

        new_updates, new_inner = inner.update(
            updates, state.inner_state, params, **inner_extra
        )
        # Selects, not a lax.cond: XLA fuses each into the elementwise work
        # that made its new value (Adam's moments, apply_updates), so a taken
        # step costs what the inner step costs, and the step compiles the inner
        # transformation once (a cond's second branch would compile it again,
        # to give zeros of its output types, varying mesh axes included).
        # result_type, not `u.dtype`: a leaf may be a Python number (0-d).
        out = jax.tree.map(
            lambda u: jnp.where(skip, jnp.zeros((), jnp.result_type(u)), u),
            new_updates,
        )
        inner_state = jax.tree.map(
            lambda old, new: jnp.where(skip, old, new), state.inner_state, new_inner
        )

        mean, variance = _moments(norm, n, state.norm_mean, state.norm_variance, alpha)
        new_state = state._replace(
            inner_state=inner_state,
            skipped=skip,
            forced=forced,
            skipped_count=_engine.count_if(skip, state.skipped_count),
            consecutive_skips=jnp.where(
                skip, optax.safe_int32_increment(state.consecutive_skips), 0
            ),
            accepted_count=_engine.count_if(accept, n),
            norm=norm,
            norm_mean=jnp.where(accept, mean, state.norm_mean),
            norm_variance=jnp.where(accept, variance, state.norm_variance),
        )
        if loss is not None:
            count = state.loss_count
            mean, variance = _moments(
                value, count, state.loss_mean, state.loss_variance, alpha
            )
            new_state = new_state._replace(
                loss=value,
                loss_count=_engine.count_if(accept, count),
                loss_mean=jnp.where(accept, mean, state.loss_mean),
                loss_variance=jnp.where(accept, variance, state.loss_variance),
            )
        return out, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
