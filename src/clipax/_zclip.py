"""ZClip: clip global-norm outliers by their z-score against EMA statistics."""

from __future__ import annotations

import functools
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from clipax import _adaptive, _common, _states
from clipax._placement import AxisName

EPS = 1e-6  # added to the standard deviation in the z-score, as the authors do
MODES = ("adaptive", "std")
CLIP_OPTIONS = ("adaptive_scaling", "mean")


@_states.register("zclip")
class ZClipState(NamedTuple):
    """State of `zclip`: the norm statistics and what the last update saw."""

    mean: jax.Array  # float32 scalar (float64 for float64 updates): EMA of norms
    variance: jax.Array  # float32 scalar: EMA of the squared deviation
    count: jax.Array  # type: ignore[assignment]  # int32 scalar: steps with a
    # finite norm so far (saturates at 2**31 - 1)
    norm: jax.Array  # float32 scalar: pre-clip global norm of the last update
    threshold: jax.Array  # float32 scalar: the last clip limit (inf in warmup)
    warmup_norms: jax.Array  # float32 [warmup_steps]: the warmup norms, in order


def zclip_rule(
    stats: _adaptive.Stats,
    norm: jax.Array,
    count: jax.Array,
    *,
    alpha: ArrayLike,
    z_threshold: ArrayLike,
    mode: str,
    clip_option: str = "adaptive_scaling",
    clip_factor: ArrayLike = 1.0,
    skip_update_on_spike: bool = False,
) -> tuple[jax.Array, _adaptive.Stats]:
    """ZClip's rule (steps 1 to 3 of `zclip`'s docstring), for one global norm."""
    mean, variance, warm = stats["mean"], stats["variance"], stats["warmup_norms"]
    dtype = mean.dtype
    a = jnp.asarray(alpha, dtype)
    zt = jnp.asarray(z_threshold, dtype)
    warmup = warm.shape[0]
    warming = count < warmup

    # Warmup: record the norm; the last warmup step starts the statistics.
    recorded = warm.at[jnp.minimum(count, warmup - 1)].set(norm)
    warm = jnp.where(warming, recorded, warm)
    start_mean = jnp.mean(warm)
    start_var = jnp.mean(jnp.square(warm - start_mean))
    ends_warmup = warming & (count == warmup - 1)

    # After warmup: z-score test, clip, EMA of the clipped norm.
    std = jnp.sqrt(variance)
    z = (norm - mean) / (std + EPS)
    over = ~warming & (z > zt)
    safe_z = jnp.where(over, z, 1)
    if mode == "std":
        limit = mean + zt * std
    elif clip_option == "mean":
        limit = mean
    else:
        limit = mean + jnp.square(zt) / safe_z * std
        if _common.is_traced(clip_factor) or clip_factor != 1:
            limit = limit * jnp.asarray(clip_factor, dtype)
    seen = jnp.where(over, limit, norm)
    ema_mean = a * mean + (1 - a) * seen
    ema_var = a * variance + (1 - a) * jnp.square(seen - ema_mean)
    if skip_update_on_spike:  # a spike leaves the statistics as they were
        ema_mean = jnp.where(over, mean, ema_mean)
        ema_var = jnp.where(over, variance, ema_var)

    new_stats = {
        "mean": jnp.where(warming, jnp.where(ends_warmup, start_mean, 0), ema_mean),
        "variance": jnp.where(warming, jnp.where(ends_warmup, start_var, 0), ema_var),
        "warmup_norms": warm,
    }
    # Not clipped: the norm above which it would have been (never below the
    # norm itself, whatever the rounding of the z-score test).
    bound = jnp.maximum(mean + zt * (std + EPS), norm)
    threshold = jnp.where(warming, jnp.inf, jnp.where(over, limit, bound))
    return threshold, new_stats


def zclip(
    *,
    alpha: ArrayLike = 0.97,
    z_threshold: ArrayLike = 2.5,
    warmup_steps: int = 25,
    mode: Literal["adaptive", "std"] = "adaptive",
    clip_option: Literal["adaptive_scaling", "mean"] = "adaptive_scaling",
    clip_factor: ArrayLike = 1.0,
    skip_update_on_spike: bool = False,
    axis_name: AxisName = None,
    specs: Any = None,
) -> optax.GradientTransformation:
    """Clips global-norm spikes detected by their z-score against running stats.

    ZClip (Kumar et al. 2025). With `g` the pre-clip global L2 norm of the
    updates:

    1. Warmup: the first `warmup_steps` norms are recorded and the updates
       pass unchanged. After the last of them, the mean and the (population)
       variance of the recorded norms start the statistics.
    2. After warmup, each step computes `z = (g - mean) / (sqrt(variance) +
       1e-6)`. If `z > z_threshold` (a spike), the updates are clipped by
       global norm (TensorFlow's formula, as `clipax.clip_by_global_norm`) to
       a limit; otherwise they pass unchanged. In mode `"adaptive"` the limit
       is `clip_factor * (mean + z_threshold**2 / z * std)` (the larger the
       spike, the harder the clip), or with `clip_option="mean"` the mean
       itself; in mode `"std"` it is `mean + z_threshold * std`.
    3. The statistics follow the clipped norm `c` (the limit when the step was
       a spike, `g` otherwise): `mean <- alpha * mean + (1 - alpha) * c`,
       then `variance <- alpha * variance + (1 - alpha) * (c - mean)**2` with
       the mean just updated. With `skip_update_on_spike`, a spike leaves
       them as they were.

    Where the paper leaves room, this follows the authors' reference code
    (github.com/bluorion-com/ZClip, `zclip/zclip.py`, published as the `zclip`
    package): the warmup variance is the population variance (divided by
    `warmup_steps`); the variance EMA uses the new mean; the EMA is fed the
    clipped norm; the step that completes the warmup is itself not clipped;
    and `1e-6` is added to the standard deviation in the z-score. The options
    `clip_option`, `clip_factor` and `skip_update_on_spike` are that package's,
    with its meaning; its `"zscore"` mode is mode `"adaptive"` here, its
    `"percentile"` mode `"std"`. Differences from that code: its warmup list
    is a fixed-size array in the state here; it scales by `limit / (g + 1e-6)`
    where this uses `limit / g` (clipax's formula); its `"percentile"` mode
    compares `g` with `mean + z_threshold * std` directly, where this uses the
    z-score test of both modes (they differ only for norms within
    `z_threshold * 1e-6` of the limit); its `eps` (the `1e-6`) is fixed here;
    and its `max_grad_norm`, a fixed ceiling on the limit that also clips
    during warmup, is `clipax.clip_by_global_norm(max_grad_norm)` chained after
    this transformation (second example), which gives the same updates and
    leaves the statistics to the adaptive limit, as the package does.

    A NaN or inf norm leaves the statistics and count as they were, and makes
    every output NaN, as `clipax.clip_by_global_norm` does; wrap the chain in
    `optax.apply_if_finite` to skip such steps. Statistics are kept in float32
    (float64 for float64 updates), on the device: the step compiles once and
    never syncs with the host.

    The state's `threshold` is the limit of the last step when it was a spike,
    else the norm above which it would have been one,
    `mean + z_threshold * (std + 1e-6)`; inf during warmup.

    Args:
      alpha: the EMA factor for the mean and variance, in (0, 1); 0.97 by
        default. May be traced (not checked then).
      z_threshold: the z-score above which a norm is clipped, > 0; 2.5 by
        default (the package's `z_thresh`). May be traced (not checked then).
      warmup_steps: how many first steps only record their norm, an int >= 1.
        It sets the state's shape: under `optax.inject_hyperparams`, name it
        in `static_args`.
      mode: `"adaptive"` (default) or `"std"`, the limit clipped to (above).
      clip_option: in mode `"adaptive"`, what a spike is clipped to:
        `"adaptive_scaling"` (default), the adaptive limit above, or `"mean"`,
        the mean. Mode `"std"` takes only the default (the package ignores
        `clip_option` in its `"percentile"` mode).
      clip_factor: a multiplier on the adaptive-scaling limit, a finite real
        > 0; 1.0 by default, below 1 clips harder. It scales the whole limit
        `mean + z_threshold**2 / z * std`, as the package's code does (its
        docstring says it scales only the `z_threshold * std` term). Only for
        mode `"adaptive"` with `clip_option="adaptive_scaling"`: elsewhere it
        would change nothing, and a value other than 1 is an error. May be
        traced (not checked then).
      skip_update_on_spike: whether a spike leaves the mean and variance as
        they were (True), rather than feeding them its limit (False, the
        default). With True, a lasting rise of the norm is clipped for as long
        as it lasts, since the statistics never follow it.
      axis_name: inside `pmap` or `shard_map`, the mesh axes every update leaf
        is split over (see `clipax.tree.global_norm`).
      specs: inside `shard_map`, the `in_specs` of the updates, a prefix tree of
        PartitionSpecs (see `clipax.tree.global_norm`).

    Returns:
      An `optax.GradientTransformation` whose state is a `ZClipState`.

    Raises:
      ValueError: at construction, if an argument is not accepted, or
        `clip_option` or `clip_factor` is given where it means nothing.
      TypeError: at construction, if `warmup_steps` is traced or
        `skip_update_on_spike` is not a bool.
      TypeError: at `init` or `update`, if a leaf is not a floating-point or
        complex array.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import clipax
      >>> tx = clipax.zclip(warmup_steps=2)
      >>> state = tx.init({"w": jnp.zeros(1)})
      >>> for g in [1.0, 3.0, 20.0]:  # warmup: mean 2, std 1; then a spike
      ...     updates, state = tx.update({"w": jnp.array([g])}, state)
      >>> updates["w"]  # z = 18, clipped to 2 + 2.5**2 / 18 * 1
      Array([2.347], dtype=float32)
      >>> state.threshold
      Array(2.347, dtype=float32)

      The package's `ZClip(warmup_steps=2, clip_factor=0.5, max_grad_norm=1.5)`:

      >>> tx = optax.chain(
      ...     clipax.zclip(warmup_steps=2, clip_factor=0.5),
      ...     clipax.clip_by_global_norm(1.5),  # max_grad_norm
      ... )
      >>> state = tx.init({"w": jnp.zeros(1)})
      >>> for g in [1.0, 3.0, 20.0]:  # the second warmup step is clipped to 1.5
      ...     updates, state = tx.update({"w": jnp.array([g])}, state)
      ...     print(updates["w"])
      [1.]
      [1.5]
      [1.1736112]

    References:
      Kumar et al., `ZClip: Adaptive Spike Mitigation for LLM Pre-Training
      <https://arxiv.org/abs/2504.02507>`_, 2025.
    """
    _adaptive.check_open_unit("alpha", alpha)
    _adaptive.check_positive("z_threshold", z_threshold)
    warmup = _adaptive.check_count("warmup_steps", warmup_steps)
    if mode not in MODES:
        raise ValueError(f'`mode` must be "adaptive" or "std"; got {mode!r}.')
    _check_options(mode, clip_option, clip_factor, skip_update_on_spike)

    def init_stats(dtype: Any) -> _adaptive.Stats:
        zero = jnp.zeros((), dtype)
        return {
            "mean": zero,
            "variance": zero,
            "warmup_norms": jnp.zeros((warmup,), dtype),
        }

    rule = functools.partial(
        zclip_rule,
        alpha=alpha,
        z_threshold=z_threshold,
        mode=mode,
        clip_option=clip_option,
        clip_factor=clip_factor,
        skip_update_on_spike=bool(skip_update_on_spike),
    )
    return _adaptive.transformation(
        "zclip", ZClipState, init_stats, rule, axis_name=axis_name, specs=specs
    )


def _check_options(
    mode: str, clip_option: Any, clip_factor: Any, skip_update_on_spike: Any
) -> None:
    """The checks of the package's three options (see `zclip`)."""
    if not isinstance(clip_option, str) or clip_option not in CLIP_OPTIONS:
        raise ValueError(
            f'`clip_option` must be "adaptive_scaling" or "mean"; got {clip_option!r}.'
        )
    if mode == "std" and clip_option != "adaptive_scaling":
        raise ValueError(
            '`clip_option` chooses the limit of mode "adaptive"; mode "std" clips '
            "to mean + z_threshold * std and takes only the default "
            f'clip_option="adaptive_scaling"; got {clip_option!r} with mode="std" '
            '(the zclip package ignores clip_option in its "percentile" mode: '
            "leave it out)."
        )
    _adaptive.check_positive("clip_factor", clip_factor)
    adaptive_scaling = mode == "adaptive" and clip_option == "adaptive_scaling"
    concrete = not _common.is_traced(clip_factor)
    if not adaptive_scaling and concrete and float(clip_factor) != 1:
        raise ValueError(
            '`clip_factor` scales the limit of mode "adaptive" with '
            'clip_option="adaptive_scaling", and would change nothing here; '
            f"got clip_factor={clip_factor!r} with mode={mode!r} and "
            f"clip_option={clip_option!r}."
        )
    if not isinstance(skip_update_on_spike, (bool, np.bool_)):
        raise TypeError(
            "`skip_update_on_spike` must be True or False; got "
            f"{_common.short_repr(skip_update_on_spike)}."
        )
