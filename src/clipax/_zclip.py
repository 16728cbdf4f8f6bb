"""ZClip: clip global-norm outliers by their z-score against EMA statistics."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from clipax import _adaptive, _checks, _states

EPS = 1e-6  # added to the standard deviation in the z-score, as the authors do
# The modes by clipax's names and by the authors' package's.
MODES = {
    "adaptive": "adaptive",
    "std": "std",
    "zscore": "adaptive",
    "percentile": "std",
}


@_states.declare("zclip")
class ZClipState(NamedTuple):
    """State of `zclip`: the norm statistics and what the last update saw."""

    mean: jax.Array  # float32 scalar (float64 for float64 updates): EMA of norms
    variance: jax.Array  # float32 scalar: EMA of the squared deviation
    count: jax.Array  # int32 scalar: steps with a finite norm (saturates)
    norm: jax.Array  # float32 scalar: pre-clip global norm of the last update
    threshold: jax.Array  # float32 scalar: the last clip limit (inf in warmup)
    warmup_norms: jax.Array  # float32 [warmup_steps]: the warmup norms, in order


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
) -> tuple[jax.Array, ZClipState]:
    """ZClip's step (docs/semantics.md, "ZClip") for one global norm."""
    mean, variance, warm = state.mean, state.variance, state.warmup_norms
    dtype = mean.dtype
    a = jnp.asarray(alpha, dtype)
    zt = jnp.asarray(z_threshold, dtype)
    warmup = warm.shape[0]
    warming = state.count < warmup

    # Warmup: record the norm; the last warmup step starts the statistics.
    recorded = warm.at[jnp.minimum(state.count, warmup - 1)].set(norm)
    warm = jnp.where(warming, recorded, warm)
    start_mean = jnp.mean(warm)
    start_var = jnp.mean(jnp.square(warm - start_mean))
    ends_warmup = warming & (state.count == warmup - 1)

    # After warmup: z-score test, clip, EMA of the clipped norm.
    std = jnp.sqrt(variance)
    z = (norm - mean) / (std + eps)
    over = ~warming & (z > zt)
    safe_z = jnp.where(over, z, 1)
    if mode == "std":
        limit = mean + zt * std
    elif clip_option == "mean":
        limit = mean
    else:
        limit = mean + jnp.square(zt) / safe_z * std
        if _checks.is_data(clip_factor) or clip_factor != 1:
            limit = limit * jnp.asarray(clip_factor, dtype)
    seen = jnp.where(over, limit, norm)
    ema_mean = a * mean + (1 - a) * seen
    ema_var = a * variance + (1 - a) * jnp.square(seen - ema_mean)
    if skip_update_on_spike:  # a spike leaves the statistics as they were
        ema_mean = jnp.where(over, mean, ema_mean)
        ema_var = jnp.where(over, variance, ema_var)

    # Not clipped: the norm above which it would have been (never below the
    # norm itself, whatever the rounding of the z-score test).
    bound = jnp.maximum(mean + zt * (std + eps), norm)
    threshold = jnp.where(warming, jnp.inf, jnp.where(over, limit, bound))
    if max_grad_norm is not None:  # a ceiling on the limit, also in warmup
        threshold = jnp.minimum(threshold, jnp.asarray(max_grad_norm, dtype))
    return threshold, state._replace(
        mean=jnp.where(warming, jnp.where(ends_warmup, start_mean, 0), ema_mean),
        variance=jnp.where(warming, jnp.where(ends_warmup, start_var, 0), ema_var),
        warmup_norms=warm,
    )


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
    axis_name: str | Sequence[str] | None = None,
    specs: Any = None,
) -> optax.GradientTransformation:
    """Clips global-norm spikes detected by their z-score against running stats.

    ZClip (Kumar et al. 2025): the first `warmup_steps` norms pass and start
    an EMA mean and variance of the global norm; after them, a norm whose
    z-score exceeds `z_threshold` is clipped by global norm, to
    `mean + z_threshold**2 / z * std` (mode `"adaptive"`, times
    `clip_factor`), to the mean (`clip_option="mean"`), or to
    `mean + z_threshold * std` (mode `"std"`), and the statistics follow the
    clipped norm. It takes the call of the authors' `zclip` package's
    `ZClip(...)` as written and follows its code where the paper leaves room:
    docs/semantics.md ("ZClip") gives the rule and the differences,
    docs/porting.md maps the options.

    Args:
      alpha: the EMA factor of the mean and variance, in (0, 1).
      z_threshold: the z-score above which a norm is clipped, > 0 (the
        package's `z_thresh`).
      warmup_steps: how many first steps only record their norm, an int >= 1;
        it sets the state's shape.
      mode: `"adaptive"` (default; the package's `"zscore"`) or `"std"` (its
        `"percentile"`), the limit clipped to.
      clip_option: in mode `"adaptive"`: `"adaptive_scaling"` (default) or
        `"mean"`.
      clip_factor: a multiplier on the adaptive-scaling limit, > 0.
      skip_update_on_spike: whether a spike leaves the statistics as they
        were, rather than feeding them its limit.
      eps: added to the standard deviation in the z-score, > 0.
      max_grad_norm: None (default; the package's default is 1.0), or a
        global norm no update exceeds, in warmup too; the statistics follow
        the adaptive limit.
      axis_name: inside `pmap` or `shard_map`, the mesh axes every leaf is
        split over (docs/scaling-out.md).
      specs: inside `shard_map`, the `in_specs` of the updates.

    Returns:
      An `optax.GradientTransformation` whose state is a `ZClipState`.

    Raises:
      ValueError: at construction, if an argument is not accepted, or
        `clip_option` or `clip_factor` is given where it means nothing.
      TypeError: at construction, if `warmup_steps` is traced or
        `skip_update_on_spike` is not a bool; at `init` or `update`, if a leaf
        is not a float array.

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
      Kumar et al., `ZClip: Adaptive Spike Mitigation for LLM Pre-Training
      <https://arxiv.org/abs/2504.02507>`_, 2025.
    """
    alpha = _checks.unit("alpha", alpha)
    z_threshold = _checks.positive("z_threshold", z_threshold)
    warmup = _checks.integer("warmup_steps", warmup_steps)
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
    skip = _checks.flag("skip_update_on_spike", skip_update_on_spike)
    eps = _checks.positive("eps", eps)
    if max_grad_norm is not None:
        max_grad_norm = _checks.threshold("max_grad_norm", max_grad_norm)

    def init(dtype: np.dtype) -> ZClipState:
        zero = jnp.zeros((), dtype)
        return ZClipState(
            mean=zero,
            variance=zero,
            count=jnp.zeros((), jnp.int32),
            norm=zero,
            threshold=jnp.full((), jnp.inf, dtype),
            warmup_norms=jnp.zeros((warmup,), dtype),
        )

    rule = functools.partial(
        zclip_rule,
        alpha=alpha,
        z_threshold=z_threshold,
        mode=rule_mode,
        clip_option=clip_option,
        clip_factor=clip_factor,
        skip_update_on_spike=skip,
        eps=eps,
        max_grad_norm=max_grad_norm,
    )
    return _adaptive.global_rule(
        "zclip", init, rule, p=2.0, specs=specs, axis_name=_checks.axis_name(axis_name)
    )
