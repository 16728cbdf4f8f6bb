"""ZClip: clip global-norm outliers by their z-score against EMA statistics."""

from __future__ import annotations

import functools
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from clipax import _adaptive, _states
from clipax._reduce import AxisName

EPS = 1e-6  # added to the standard deviation in the z-score, as the authors do
MODES = ("adaptive", "std")


@_states.register("zclip")
class ZClipState(NamedTuple):
    """State of `zclip`: the norm statistics and what the last update saw."""

    mean: jax.Array  # float32 scalar (float64 for float64 updates): EMA of norms
    variance: jax.Array  # float32 scalar: EMA of the squared deviation
    count: jax.Array  # type: ignore[assignment]  # int32 scalar: finite norms
    # recorded so far (saturates at 2**31 - 1)
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
    if mode == "adaptive":
        limit = mean + jnp.square(zt) / safe_z * std
    else:
        limit = mean + zt * std
    seen = jnp.where(over, limit, norm)
    ema_mean = a * mean + (1 - a) * seen
    ema_var = a * variance + (1 - a) * jnp.square(seen - ema_mean)

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
       1e-6)`. If `z > z_threshold`, the updates are clipped by global norm
       (TensorFlow's formula, as `clipax.clip_by_global_norm`) to
       `mean + z_threshold**2 / z * std` in mode `"adaptive"` (the larger the
       spike, the harder the clip) or to `mean + z_threshold * std` in mode
       `"std"`; otherwise they pass unchanged.
    3. The statistics follow the clipped norm `c` (the clip limit when the
       step was clipped, `g` otherwise): `mean <- alpha * mean + (1 - alpha) * c`,
       then `variance <- alpha * variance + (1 - alpha) * (c - mean)**2` with
       the mean just updated.

    Where the paper leaves room, this follows the authors' reference code
    (github.com/bluorion-com/ZClip, `zclip/zclip.py`): the warmup variance is
    the population variance (divided by `warmup_steps`); the variance EMA uses
    the new mean; the EMA is fed the clipped norm; the step that completes the
    warmup is itself not clipped; and `1e-6` is added to the standard deviation
    in the z-score. Differences from that code: its warmup list is a
    fixed-size array in the state here; it scales by `limit / (g + 1e-6)` where
    this uses `limit / g` (clipax's formula); its `"percentile"` mode (here
    `"std"`) compares `g` with `mean + z_threshold * std` directly, where this
    uses the z-score test of both modes (they differ only for norms within
    `z_threshold * 1e-6` of the limit); and it has no equivalent of its
    optional fixed `max_grad_norm` (chain `clipax.clip_by_global_norm` for that).

    A NaN or inf norm leaves the statistics and count as they were, and makes
    every output NaN, as `clipax.clip_by_global_norm` does; wrap the chain in
    `optax.apply_if_finite` to skip such steps. Statistics are kept in float32
    (float64 for float64 updates), on the device: the step compiles once and
    never syncs with the host.

    The state's `threshold` is the limit the norm was clipped to when the step
    was clipped, else the norm above which it would have been,
    `mean + z_threshold * (std + 1e-6)`; inf during warmup.

    Args:
      alpha: the EMA factor for the mean and variance, in (0, 1); 0.97 by
        default. May be traced (not checked then).
      z_threshold: the z-score above which a norm is clipped, > 0; 2.5 by
        default. May be traced (not checked then).
      warmup_steps: how many first steps only record their norm, an int >= 1.
        It sets the state's shape: under `optax.inject_hyperparams`, name it
        in `static_args`.
      mode: `"adaptive"` (default) or `"std"`, the limit clipped to (above).
      axis_name: inside `pmap` or `shard_map`, the mesh axes every update leaf
        is split over (see `clipax.tree.global_norm`).
      specs: inside `shard_map`, the `in_specs` of the updates, a prefix tree of
        PartitionSpecs (see `clipax.tree.global_norm`).

    Returns:
      An `optax.GradientTransformation` whose state is a `ZClipState`.

    Raises:
      ValueError: at construction, if an argument is not accepted.
      TypeError: at construction, if `warmup_steps` is traced.
      TypeError: at `init` or `update`, if a leaf is not a floating-point or
        complex array.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> tx = clipax.zclip(warmup_steps=2)
      >>> state = tx.init({"w": jnp.zeros(1)})
      >>> for g in [1.0, 3.0, 20.0]:  # warmup: mean 2, std 1; then a spike
      ...     updates, state = tx.update({"w": jnp.array([g])}, state)
      >>> updates["w"]  # z = 18, clipped to 2 + 2.5**2 / 18 * 1
      Array([2.347], dtype=float32)
      >>> state.threshold
      Array(2.347, dtype=float32)

    References:
      Kumar et al., `ZClip: Adaptive Spike Mitigation for LLM Pre-Training
      <https://arxiv.org/abs/2504.02507>`_, 2025.
    """
    _adaptive.check_open_unit("alpha", alpha)
    _adaptive.check_positive("z_threshold", z_threshold)
    warmup = _adaptive.check_count("warmup_steps", warmup_steps)
    if mode not in MODES:
        raise ValueError(f'`mode` must be "adaptive" or "std"; got {mode!r}.')

    def init_stats(dtype: Any) -> _adaptive.Stats:
        zero = jnp.zeros((), dtype)
        return {
            "mean": zero,
            "variance": zero,
            "warmup_norms": jnp.zeros((warmup,), dtype),
        }

    rule = functools.partial(
        zclip_rule, alpha=alpha, z_threshold=z_threshold, mode=mode
    )
    return _adaptive.transformation(
        "zclip", ZClipState, init_stats, rule, axis_name=axis_name, specs=specs
    )
