"""The global adaptive rules (AutoClip, ZClip): a threshold learned from the norms.

A rule is a pure function of its state and this step's global norm,

    rule(state, norm) -> (threshold, state)

`state` is the rule's declared NamedTuple (`_states.declare`) with the fields
every such rule keeps: `count` (steps whose norm was finite), `norm` (the
last global norm) and `threshold`. The rule returns the state with its
statistics updated (`state._replace`); `global_rule` does the rest once: the
norm (with `specs` / `axis_name` for sharded leaves), `count`, `norm` and
`threshold`, the NaN rule (a NaN or inf norm keeps the statistics and the
threshold, its updates come out NaN, and the step is not counted), and the
clip, TensorFlow's `x * t / max(norm, t)`. ZClip's rolling window is
`_statistics`'.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from clipax import _checks, _engine, _leaves, _states, _statistics

EPS = 1e-6  # added to the standard deviation in ZClip's z-score, as its authors do
# ZClip's modes by clipax's names and by the authors' package's.
MODES = {
    "adaptive": "adaptive",
    "std": "std",
    "zscore": "adaptive",
    "percentile": "std",
}


def global_rule(
    fn_name: str,
    init: Callable[[np.dtype], Any],
    rule: Callable[[Any, jax.Array], tuple[jax.Array, Any]],
    *,
    p: float,
    specs: Any,
    axis_name: str | Sequence[str] | None,
) -> optax.GradientTransformation:
    """An Optax transformation that clips all leaves by their global p-norm to
    the threshold `rule` gives; `init(dtype)` is the state before any step."""
    checked = _leaves.reader(fn_name, specs=specs, axis_name=axis_name)

    def init_fn(params: optax.Params) -> Any:
        return init(_engine.tree_accum_dtype(_leaves.leaves(params, fn_name).arrays))

    def update_fn(
        updates: optax.Updates, state: Any, params: optax.Params | None = None
    ) -> tuple[optax.Updates, Any]:
        del params
        leaves = checked(updates)
        dtype = state.norm.dtype
        same_shapes(fn_name, state._asdict(), init(dtype)._asdict())
        norm = _engine.global_norm(leaves, p).astype(dtype)
        threshold, stepped = rule(state, norm)
        finite = jnp.isfinite(norm)
        stepped = stepped._replace(threshold=threshold.astype(dtype))
        new_state = jax.tree.map(
            lambda n, o: jnp.where(finite, n, o).astype(o.dtype), stepped, state
        )._replace(count=_engine.count_if(finite, state.count), norm=norm)
        factor = _engine.clip_factor(norm, threshold.astype(dtype))
        clipped = [_engine.scaled(x, factor) for x in leaves.arrays]
        return leaves.rebuild(clipped), new_state

    return optax.GradientTransformation(init_fn, update_fn)


# The arguments that set a rule's state shapes.
SHAPED_BY = {
    "autoclip": "`history`",
    "zclip": "`window` (or `warmup_steps`, without one)",
    "skip_spikes": "`window`",
}


def same_shapes(fn_name: str, state: dict[str, Any], fresh: dict[str, Any]) -> None:
    """A state's fields shaped as `fresh`'s, the state this configuration
    starts from.

    Raises:
      ValueError: naming the field, if a state built under another `window`
        or `history` is given.
    """
    for field, want in fresh.items():
        if np.shape(state[field]) != np.shape(want):
            raise ValueError(
                f"`{fn_name}` got a state whose `{field}` has shape "
                f"{np.shape(state[field])}, where its configuration needs "
                f"{np.shape(want)}: a state built under another "
                f"{SHAPED_BY[fn_name]}. `init` it again with this configuration."
            )


@_states.declare("autoclip", clip=("norm", "threshold"))
class AutoClipState(NamedTuple):
    """State of `autoclip`: the recent norms and what the last update saw."""

    buffer: jax.Array  # float32 [history] (float64 for float64 updates): the
    # last `history` finite pre-clip global norms, the i-th (0-based) in slot
    # `i % history`; unwritten slots are 0
    count: jax.Array  # type: ignore[assignment]  # int32 scalar: finite norms recorded (saturates)
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
      axis_name: the mesh axes every leaf is split over (docs/scaling-out.md).
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
    return global_rule("autoclip", init, rule, p=p, specs=specs, axis_name=axis_name)


@_states.declare("zclip", clip=("norm", "threshold"))
class ZClipState(NamedTuple):
    """State of `zclip`: the norm statistics and what the last update saw."""

    mean: jax.Array  # float32 scalar (float64 for float64 updates): EMA of norms
    variance: jax.Array  # float32 scalar: EMA of the squared deviation
    count: jax.Array  # type: ignore[assignment]  # int32 scalar: steps with a finite norm (saturates)
    norm: jax.Array  # float32 scalar: pre-clip global norm of the last update
    threshold: jax.Array  # float32 scalar: the last clip limit (inf in warmup)
    buffer: jax.Array  # float32 [warmup_steps] (EMA statistics): the warmup
    # norms, in order; or [window]: the last `window` norms, the i-th in slot
    # `i % window`


def zclip_rule(
    state: ZClipState,
    norm: jax.Array,
    *,
    alpha: ArrayLike,
    z_threshold: ArrayLike,
    mode: str,
    clip_option: str = "adaptive_scaling",
    clip_factor: ArrayLike = 1.0,
    skip_update_on_spike: bool = False,
    eps: ArrayLike = EPS,
    max_grad_norm: ArrayLike | None = None,
    warmup: int | None = None,
    raw: bool = False,
) -> tuple[jax.Array, ZClipState]:
    """ZClip's step (docs/semantics.md, "ZClip") for one global norm: EMA
    statistics started from the warmup's norms, or, with `warmup` given,
    those of a rolling window (`state.buffer`) from `warmup` norms on."""
    mean, variance, buffer = state.mean, state.variance, state.buffer
    dtype = mean.dtype
    zt = jnp.asarray(z_threshold, dtype)
    warming = state.count < (buffer.shape[0] if warmup is None else warmup)

    # The z-score test against the statistics so far, and the limit.
    std = jnp.sqrt(variance)
    z = (norm - mean) / (std + eps)
    over = ~warming & (z > zt)
    if mode == "std":
        limit = mean + zt * std
    elif clip_option == "mean":
        limit = mean
    else:
        limit = mean + jnp.square(zt) / jnp.where(over, z, 1) * std
        limit = limit * jnp.asarray(clip_factor, dtype)  # x * 1.0 is x, bit for bit
    seen = norm if raw else jnp.where(over, limit, norm)
    if warmup is not None:
        buffer = _statistics.pushed(buffer, state.count, seen, True)
        new_mean, new_var = _statistics.window_moments(buffer, state.count + 1, 0)
    else:  # the warmup records its norms; its last step starts the EMA
        a = jnp.asarray(alpha, dtype)
        slot = jnp.minimum(state.count, buffer.shape[0] - 1)
        buffer = jnp.where(warming, buffer.at[slot].set(norm), buffer)
        ends = warming & (state.count == buffer.shape[0] - 1)
        ema_mean = a * mean + (1 - a) * seen
        ema_var = a * variance + (1 - a) * jnp.square(seen - ema_mean)
        if skip_update_on_spike:  # a spike leaves the statistics as they were
            ema_mean = jnp.where(over, mean, ema_mean)
            ema_var = jnp.where(over, variance, ema_var)
        start = jnp.mean(buffer)
        new_mean = jnp.where(warming, jnp.where(ends, start, 0), ema_mean)
        start_var = jnp.mean(jnp.square(buffer - start))
        new_var = jnp.where(warming, jnp.where(ends, start_var, 0), ema_var)

    # Not clipped: the norm above which it would have been (never below the
    # norm itself, whatever the rounding of the z-score test).
    bound = jnp.maximum(mean + zt * (std + eps), norm)
    threshold = jnp.where(warming, jnp.inf, jnp.where(over, limit, bound))
    if max_grad_norm is not None:  # a ceiling on the limit, also in warmup
        threshold = jnp.minimum(threshold, jnp.asarray(max_grad_norm, dtype))
    return threshold, state._replace(mean=new_mean, variance=new_var, buffer=buffer)


def limit_options(mode: str, clip_option: str, clip_factor: Any) -> tuple[str, Any]:
    """ZClip's limit, checked: its mode by clipax's name, and `clip_factor`,
    each refused where it would mean nothing in the mode given.

    Raises:
      ValueError: naming the argument and the mode.
    """
    rule_mode = MODES[_checks.choice("mode", mode, tuple(MODES))]
    _checks.choice("clip_option", clip_option, ("adaptive_scaling", "mean"))
    if rule_mode == "std":
        _checks.unused(
            clip_option,
            "adaptive_scaling",
            '`clip_option` chooses the limit of mode "adaptive"; mode "std" clips '
            "to mean + z_threshold * std and takes only the default "
            'clip_option="adaptive_scaling"; got {value} with mode="std" (the '
            'zclip package ignores clip_option in its "percentile" mode: leave '
            "it out).",
        )
    clip_factor = _checks.positive("clip_factor", clip_factor)
    if rule_mode != "adaptive" or clip_option != "adaptive_scaling":
        _checks.unused(
            clip_factor,
            1.0,
            '`clip_factor` scales the limit of mode "adaptive" with '
            'clip_option="adaptive_scaling", and would change nothing here; got '
            f"clip_factor={{value}} with mode={mode!r} and "
            f"clip_option={clip_option!r}.",
        )
    return rule_mode, clip_factor


@_checks.peer_names({"z_thresh": "z_threshold"})
def zclip(
    *,
    alpha: ArrayLike = 0.97,
    z_threshold: ArrayLike = 2.5,
    warmup_steps: int = 25,
    mode: Literal["adaptive", "std", "zscore", "percentile"] = "adaptive",
    clip_option: Literal["adaptive_scaling", "mean"] = "adaptive_scaling",
    clip_factor: ArrayLike = 1.0,
    skip_update_on_spike: bool = False,
    eps: ArrayLike = EPS,
    max_grad_norm: ArrayLike | None = None,
    window: int | None = None,
    history: Literal["clipped", "raw"] = "clipped",
    axis_name: str | Sequence[str] | None = None,
    specs: Any = None,
) -> optax.GradientTransformation:
    """Clips global-norm spikes detected by their z-score against running stats.

    ZClip (Kumar et al. 2025): the first `warmup_steps` norms start an EMA
    mean and variance of the global norm (with `window`: those of the last
    `window` norms); after them, a norm whose z-score exceeds `z_threshold`
    is clipped by global norm, to `mean + z_threshold**2 / z * std` (mode
    `"adaptive"`), or `mean + z_threshold * std` (mode `"std"`). It takes
    the `zclip` package's call: docs/semantics.md ("ZClip") gives the rule,
    docs/porting.md the package's options and Levanter's update clipping.

    Args:
      alpha: the EMA factor of the mean and variance, in (0, 1).
      z_threshold: the z-score above which a norm is clipped, > 0.
      warmup_steps: how many first norms are only recorded, an int >= 1.
      window: None (EMA statistics), or the latest norms' count, an int >= 2.
      history: `"clipped"` (default) or `"raw"`: which norm they take.
      mode: `"adaptive"` (default; the package's `"zscore"`) or `"std"`.
      clip_option: the package's, in mode `"adaptive"`.
      clip_factor: the package's, in mode `"adaptive"`.
      skip_update_on_spike: whether a spike leaves the statistics as they were.
      eps: added to the standard deviation in the z-score, > 0.
      max_grad_norm: None (default), or a global norm no update exceeds.
      axis_name: the mesh axes every leaf is split over (docs/scaling-out.md).
      specs: inside `shard_map`, the `in_specs` of the updates.

    Returns:
      An `optax.GradientTransformation` whose state is a `ZClipState`.

    Raises:
      ValueError: if an argument is not accepted or means nothing in `mode`.
      TypeError: if `warmup_steps` is traced, `skip_update_on_spike` is not a
        bool, or a leaf is not a float array.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> tx = clipax.zclip(warmup_steps=2)
      >>> state = tx.init({"w": jnp.zeros(1)})
      >>> for g in [1.0, 3.0, 20.0]:  # warmup: mean 2, std 1; then a spike
      ...     updates, state = tx.update({"w": jnp.array([g])}, state)
      >>> updates["w"]  # z = 18, clipped to 2 + 2.5**2 / 18 * 1
      Array([2.347], dtype=float32)

    References:
      Kumar et al., `ZClip <https://arxiv.org/abs/2504.02507>`_, 2025.
    """
    alpha = _checks.unit("alpha", alpha)
    z_threshold = _checks.positive("z_threshold", z_threshold)
    warmup = _checks.integer("warmup_steps", warmup_steps)
    rule_mode, clip_factor = limit_options(mode, clip_option, clip_factor)
    skip = _checks.flag("skip_update_on_spike", skip_update_on_spike)
    size = None if window is None else _checks.integer("window", window, minimum=2)
    if size is not None and skip:
        raise ValueError(
            "`skip_update_on_spike` keeps a spike out of the EMA statistics; with "
            "`window` every norm enters the window (`history` says which)."
        )
    if max_grad_norm is not None:
        max_grad_norm = _checks.threshold("max_grad_norm", max_grad_norm)
    rule = functools.partial(
        zclip_rule,
        alpha=alpha,
        z_threshold=z_threshold,
        mode=rule_mode,
        clip_option=clip_option,
        clip_factor=clip_factor,
        skip_update_on_spike=skip,
        eps=_checks.positive("eps", eps),
        max_grad_norm=max_grad_norm,
        warmup=None if size is None else warmup,
        raw=_checks.choice("history", history, ("clipped", "raw")) == "raw",
    )

    def init(dtype: np.dtype) -> ZClipState:
        # Each its own array: a state may be donated.
        mean, variance, norm = (jnp.zeros((), dtype) for _ in range(3))
        buffer = jnp.zeros((warmup if size is None else size,), dtype)
        inf = jnp.full((), jnp.inf, dtype)
        count = jnp.zeros((), jnp.int32)
        return ZClipState(mean, variance, count, norm, inf, buffer)

    return global_rule("zclip", init, rule, p=2.0, specs=specs, axis_name=axis_name)
