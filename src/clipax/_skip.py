"""`skip_spikes`: drop a step whose gradient norm or loss spikes, on device."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from clipax import _adaptive, _common, _states
from clipax._placement import AxisName, normalize_axis_name
from clipax.tree import _global_norm


@_states.register("skip_spikes", inner="inner_state")
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
    axis_name: AxisName = None,
    specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Skips a step whose gradient norm (or loss) is non-finite or a spike.

    Wraps `inner` (any `optax.GradientTransformation`, e.g. the whole
    `optax.chain(clip, adamw)`). Each step takes the global L2 norm `g` of the
    incoming updates (clipax's exact engine; `specs` / `axis_name` inside
    `shard_map` or `pmap`) and skips the step when

    - `g` is NaN or inf (always), or the `loss=` passed to `update` is;
    - `g > max_norm`, when `max_norm` is given (axlearn's
      `skip_and_clip_by_global_norm` drop threshold);
    - `g - mean > z_threshold * std`, a z-score above `z_threshold` against
      the running statistics of the norms of accepted steps, once
      `warmup_steps` steps were accepted;
    - the same test on the loss, when `update(..., loss=...)` is given one
      (optax's extra-args protocol: `optax.chain` and `optax.MultiSteps`
      forward it), with its own statistics and warmup.

    A skipped step returns zero updates (so `optax.apply_updates` leaves the
    parameters where they are) and `inner`'s state bit for bit as it was:
    Adam's moments and step count do not move, a schedule does not advance.
    Skipped steps do not enter the statistics. After `max_consecutive_skips`
    skips in a row, the next outlier is let through and enters the statistics
    (the statistics may be stale after a real shift of the norm's level; the
    data is not broken) and the state's `forced` says so; non-finite steps and
    norms above `max_norm` are never let through. Every decision is taken on
    the device from values that are the same on every device (the global norm,
    the loss the caller averaged): no host round trip, no retrace, the same
    decision everywhere.

    Statistics: an exponential moving average with factor `alpha`, started as
    the exact mean and population variance of the first accepted values (the
    weight of a new value is `max(1 - alpha, 1 / n)` for the n-th), not a
    rolling window as in OLMo-core, Levanter and MaxText: the state stays a
    few scalars whatever the horizon, each step costs O(1) instead of a pass
    over the window, there is no cold-start bias, and old steps fade instead
    of dropping out all at once. The default `alpha=0.985` gives the EMA the
    centre of mass (about 65 steps back) of the peers' 128-step window.

    Defaults, from the peers: `z_threshold=6.0` is the `sigma_factor` of
    OLMo-core's `SkipStepOptimizer` and Levanter's `SkipStepConfig`, and
    MaxText's `skip_step_on_spikes` takes the same `mean + k * std` test;
    `warmup_steps=64` is when those start testing (half their 128-step
    `rolling_interval_length`). `max_consecutive_skips=10` has no peer
    default: they let skipped steps into their window, so a lasting shift
    ends the skipping by itself; here skipped steps stay out, and the limit
    plays that part (`optax.apply_if_finite`'s `max_consecutive_errors` is the
    same idea for NaNs).

    Args:
      inner: the transformation whose steps are skipped; extra arguments of
        `update` (`loss=` included) are forwarded to it.
      z_threshold: the z-score above which a norm (or loss) is a spike, > 0;
        `inf` turns the statistical tests off. May be traced.
      alpha: the EMA factor of the statistics, in (0, 1). May be traced.
      warmup_steps: how many accepted steps (with a loss, for the loss test)
        the statistics take before the z-tests start, an int in
        [1, 2**31 - 1] (the state's counters are int32).
      max_consecutive_skips: after this many skips in a row the next outlier
        is let through, an int in [1, 2**31 - 1].
      max_norm: None (default), or a norm above which a step is always
        skipped: a positive scalar, or traced.
      axis_name: inside `pmap` or `shard_map`, the mesh axes every update leaf
        is split over (see `clipax.tree.global_norm`).
      specs: inside `shard_map`, the `in_specs` of the updates, a prefix tree
        of PartitionSpecs (see `clipax.tree.global_norm`).

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a
      `SkipSpikesState`; its `update` takes an optional `loss=` (a scalar, the
      same on every device).

    Raises:
      TypeError: at construction, if `inner` is not a transformation, or if
        `z_threshold`, `alpha` or `max_norm` is not a real number (a string,
        a bool, None for the first two, an array of another dtype).
      ValueError: at construction, if another argument is not accepted: a
        number out of range or not a scalar; a count (`warmup_steps`,
        `max_consecutive_skips`) that is not an int in [1, 2**31 - 1],
        whatever its type; an `axis_name` that is not a name or names.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import clipax
      >>> tx = clipax.skip_spikes(optax.adam(0.1), warmup_steps=3)
      >>> params = {"w": jnp.zeros(2)}
      >>> state = tx.init(params)
      >>> for g in [1.0, 1.2, 0.9, 1.1, 50.0]:  # a spike at the last step
      ...     updates, state = tx.update({"w": jnp.array([g, 0.0])}, state)
      >>> updates["w"], state.skipped, state.skipped_count
      (Array([0., 0.], dtype=float32), Array(True, dtype=bool), Array(1, dtype=int32))
      >>> state.inner_state[0].count  # Adam's count: four steps, not five
      Array(4, dtype=int32)
    """
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(
            "`inner` must be an optax.GradientTransformation; got "
            f"{type(inner).__name__}."
        )
    _adaptive.check_positive("z_threshold", z_threshold, inf_ok=True)
    _adaptive.check_open_unit("alpha", alpha)
    _adaptive.check_count("warmup_steps", warmup_steps, traced_ok=True)
    _adaptive.check_count(
        "max_consecutive_skips", max_consecutive_skips, traced_ok=True
    )
    if max_norm is not None:
        _common.check_max_norm("max_norm", max_norm)
    normalize_axis_name(axis_name)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: optax.Params) -> SkipSpikesState:
        flat = _common.check_norm_leaves(params, "skip_spikes")
        dtype = _common.tree_accum_dtype([leaf for _, leaf in flat])
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
        norm = _global_norm.global_norm(
            updates, axis_name=axis_name, specs=specs
        ).astype(dtype)
        n = state.accepted_count
        broken = ~jnp.isfinite(norm)
        outlier = _outlier(
            norm, n, state.norm_mean, state.norm_variance, z_threshold, warmup_steps
        )
        if max_norm is not None:
            broken |= norm > jnp.asarray(max_norm).astype(dtype)
        if loss is not None:
            value = jnp.asarray(loss)
            if value.shape != ():
                raise ValueError(
                    f"`loss` must be a scalar; got an array of shape {value.shape}."
                )
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
        loss_fields = {
            "loss": state.loss,
            "loss_count": state.loss_count,
            "loss_mean": state.loss_mean,
            "loss_variance": state.loss_variance,
        }
        if loss is not None:
            loss_mean, loss_variance = _moments(
                value, state.loss_count, state.loss_mean, state.loss_variance, alpha
            )
            loss_fields = {
                "loss": value,
                "loss_count": jnp.where(
                    accept,
                    optax.safe_int32_increment(state.loss_count),
                    state.loss_count,
                ),
                "loss_mean": jnp.where(accept, loss_mean, state.loss_mean),
                "loss_variance": jnp.where(accept, loss_variance, state.loss_variance),
            }
        new_state = SkipSpikesState(
            inner_state=inner_state,
            skipped=skip,
            forced=forced,
            skipped_count=jnp.where(
                skip,
                optax.safe_int32_increment(state.skipped_count),
                state.skipped_count,
            ),
            consecutive_skips=jnp.where(
                skip, optax.safe_int32_increment(state.consecutive_skips), 0
            ),
            accepted_count=jnp.where(accept, optax.safe_int32_increment(n), n),
            norm=norm,
            norm_mean=jnp.where(accept, mean, state.norm_mean),
            norm_variance=jnp.where(accept, variance, state.norm_variance),
            **loss_fields,
        )
        return out, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
