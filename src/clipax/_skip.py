"""`skip_spikes`: drop a step whose gradient norm or loss spikes, on device."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from clipax import _adaptive, _checks, _engine, _leaves, _states, _statistics

STATS = ("count", "mean", "variance", "window")  # of the norms, and of the losses


@_states.declare("skip_spikes", inner="inner_state")
class SkipSpikesState(NamedTuple):
    """State of `skip_spikes`: the wrapped state and the spike statistics.

    `dtype` below is float32, or float64 when an update leaf is float64. The
    statistics (`norm_*`, `loss_*`) are those the next step is tested
    against; a window is `[window]` long, or `[1]` (unused) without one: a
    checkpointer refuses zero-size arrays.
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
    norm_count: jax.Array  # int32 scalar: norms recorded in the statistics
    norm_mean: jax.Array  # dtype scalar: their mean
    norm_variance: jax.Array  # dtype scalar: their variance
    norm_window: jax.Array  # dtype [window]: the last norms recorded, the
    # i-th in slot `i % window`
    loss: jax.Array  # dtype scalar: the last `loss=` passed (NaN before any)
    loss_count: jax.Array  # int32 scalar: losses recorded, likewise
    loss_mean: jax.Array  # dtype scalar
    loss_variance: jax.Array  # dtype scalar
    loss_window: jax.Array  # dtype [window]


class Config(NamedTuple):
    """`skip_spikes`' arguments, checked, and its inner transformation."""

    inner: optax.GradientTransformationExtraArgs
    checked: _leaves.Reader
    size: int | None  # `window`
    every: bool  # `history="all"`
    limit: Any  # `max_consecutive_skips`
    max_norm: Any
    spike: Callable[..., jax.Array]
    record: Callable[..., tuple]


def initial(config: Config, params: optax.Params) -> SkipSpikesState:
    """The state before any step: no statistics, no loss (NaN); each field
    its own array (a state may be donated)."""
    dtype = _engine.tree_accum_dtype(_leaves.leaves(params, "skip_spikes").arrays)
    i32 = jnp.int32

    def series(k: str, last: jax.Array) -> dict[str, jax.Array]:
        """A value's last one and its statistics, none recorded."""
        return {
            k: last,
            f"{k}_count": jnp.zeros((), i32),
            f"{k}_mean": jnp.zeros((), dtype),
            f"{k}_variance": jnp.zeros((), dtype),
            f"{k}_window": jnp.zeros((config.size or 1,), dtype),
        }

    return SkipSpikesState(
        config.inner.init(params),
        skipped=jnp.zeros((), bool),
        forced=jnp.zeros((), bool),
        skipped_count=jnp.zeros((), i32),
        consecutive_skips=jnp.zeros((), i32),
        accepted_count=jnp.zeros((), i32),
        **series("norm", jnp.zeros((), dtype)),
        **series("loss", jnp.full((), jnp.nan, dtype)),
    )


def step(
    config: Config,
    updates: optax.Updates,
    state: SkipSpikesState,
    params: optax.Params | None = None,
    *,
    loss: ArrayLike | None = None,
    **extra_args: Any,
) -> tuple[optax.Updates, SkipSpikesState]:
    """One step: `inner`'s, kept where neither the global norm nor the loss
    (where given) is NaN or inf, above `max_norm`, or a spike; else zero
    updates and `inner`'s state as it was."""
    dtype = state.norm.dtype
    window = jnp.zeros((config.size or 1,), dtype)
    fresh = {"norm_window": window, "loss_window": window}
    _adaptive.same_shapes("skip_spikes", state._asdict(), fresh)
    values = {"norm": _engine.global_norm(config.checked(updates), 2.0).astype(dtype)}
    if loss is not None:
        loss = jnp.asarray(loss)
        _checks.jax_number("loss", loss, "a scalar: the step's loss")
        # Inside shard_map, one decision on every device: the largest copy.
        values["loss"] = _engine.pmax_all(loss, [_leaves.manual_axes()]).astype(dtype)
        extra_args = {**extra_args, "loss": loss}
    stats = {k: tuple(getattr(state, f"{k}_{s}") for s in STATS) for k in values}
    broken = ~jnp.all(jnp.isfinite(jnp.stack(list(values.values()))))
    if config.max_norm is not None:  # a NaN `max_norm` skips every step
        broken |= ~(values["norm"] <= jnp.asarray(config.max_norm).astype(dtype))
    spiked = jnp.stack([config.spike(x, stats[k]) for k, x in values.items()])
    forced = jnp.any(spiked) & ~broken
    forced &= False if config.limit is None else state.consecutive_skips >= config.limit
    skip = broken | (jnp.any(spiked) & ~forced)
    new_updates, new_inner = config.inner.update(
        updates, state.inner_state, params, **extra_args
    )
    # Selects, not a lax.cond: XLA fuses each into the elementwise work that
    # made its new value (Adam's moments, apply_updates), so a taken step
    # costs what the inner step costs, and the step compiles the inner
    # transformation once (a cond's second branch would compile it again, to
    # give zeros of its output types, varying mesh axes included).
    # result_type, not `u.dtype`: a leaf may be a Python number (0-d).
    out = jax.tree.map(
        lambda u: jnp.where(skip, jnp.zeros((), jnp.result_type(u)), u), new_updates
    )
    fields: dict[str, Any] = {}
    for k, x in values.items():
        new = config.record(x, stats[k], True if config.every else ~skip)
        fields |= {k: x, **{f"{k}_{s}": v for s, v in zip(STATS, new, strict=True)}}
    return out, state._replace(
        inner_state=jax.tree.map(
            lambda old, new: jnp.where(skip, old, new), state.inner_state, new_inner
        ),
        skipped=skip,
        forced=forced,
        skipped_count=_engine.count_if(skip, state.skipped_count),
        consecutive_skips=jnp.where(
            skip, optax.safe_int32_increment(state.consecutive_skips), 0
        ),
        accepted_count=_engine.count_if(~skip, state.accepted_count),
        **fields,
    )


def skip_spikes(
    inner: optax.GradientTransformation,
    *,
    z_threshold: ArrayLike = 6.0,
    alpha: ArrayLike = 0.985,
    window: int | None = None,
    ddof: int = 0,
    warmup_steps: int = 64,
    history: Literal["accepted", "all"] = "accepted",
    max_consecutive_skips: int | None = 10,
    max_norm: ArrayLike | None = None,
    axis_name: str | Sequence[str] | None = None,
    specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Skips a step whose gradient norm (or loss) is non-finite or a spike.

    A step is skipped when the global norm of the incoming updates, or the
    `loss=` passed to `update`, is NaN or inf, above `max_norm`, or more than
    `z_threshold` standard deviations above the mean of the values so far
    (an EMA, or the last `window` values), once `warmup_steps` were
    recorded. A skipped step returns zero updates and `inner`'s state bit for
    bit as it was (docs/skipping-and-logging.md; docs/porting.md gives
    OLMo-core's, Levanter's and MaxText's rules as calls).

    Args:
      inner: the transformation whose steps are skipped, e.g. the whole
        `optax.chain(clip, adamw)`; `update`'s extra arguments go to it.
      z_threshold: the z-score of a spike, > 0 (`inf`: no statistical test).
      alpha: the EMA factor of the statistics, in (0, 1) (without `window`).
      window: None (EMA statistics), or the latest values' count, an int >= 2.
      ddof: with `window`, the std's delta degrees of freedom, an int >= 0.
      warmup_steps: values recorded before the z-tests start, an int >= 1.
      history: whose values the statistics take: `"accepted"` or `"all"`.
      max_consecutive_skips: None (no limit), or an int >= 1: after that
        many skips in a row the next spike is let through (`forced`).
      max_norm: None, or a norm above which a step is always skipped.
      axis_name: the mesh axes every leaf is split over (docs/scaling-out.md).
      specs: inside `shard_map`, the `in_specs` of the updates.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a
      `SkipSpikesState`; its `update` takes an optional scalar `loss=`.

    Raises:
      TypeError: if `inner` is not a transformation, or `z_threshold`,
        `alpha` or `max_norm` is not a real number.
      ValueError: if an argument is not accepted.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import clipax
      >>> tx = clipax.skip_spikes(optax.adam(0.1), warmup_steps=3)
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> for g in [1.0, 1.2, 0.9, 1.1, 50.0]:  # a spike at the last step
      ...     updates, state = tx.update({"w": jnp.array([g, 0.0])}, state)
      >>> updates["w"], state.skipped, state.inner_state[0].count
      (Array([0., 0.], dtype=float32), Array(True, dtype=bool),
       Array(4, dtype=int32))
    """
    _checks.transformation("inner", inner)
    z_threshold = _checks.positive("z_threshold", z_threshold, inf_ok=True)
    alpha = _checks.unit("alpha", alpha)
    size = None if window is None else _checks.integer("window", window, minimum=2)
    ddof = _checks.integer("ddof", ddof, minimum=0, data_ok=True)
    warmup = _checks.integer("warmup_steps", warmup_steps, data_ok=True)
    every = _checks.choice("history", history, ("accepted", "all")) == "all"
    limit = max_consecutive_skips
    if limit is not None:
        limit = _checks.integer("max_consecutive_skips", limit, data_ok=True)
    if max_norm is not None:
        max_norm = _checks.threshold("max_norm", max_norm)
    config = Config(
        optax.with_extra_args_support(inner),
        _leaves.reader("skip_spikes", specs=specs, axis_name=axis_name),
        size,
        every,
        limit,
        max_norm,
        *_statistics.statistics(z_threshold, alpha, size, ddof, warmup),
    )

    return optax.GradientTransformationExtraArgs(
        functools.partial(initial, config), functools.partial(step, config)
    )
