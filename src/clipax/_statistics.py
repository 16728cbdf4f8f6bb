"""A value's running statistics and the spike test on them, for the rules that
watch a norm or a loss against its own history (`skip_spikes`,
`reset_on_spike`, ZClip's window).

The statistics are (count, mean, variance, window) of one value, or,
elementwise, of many (a layer's norms). A NaN or inf value is a spike and is
never recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from clipax import _engine


def pushed(buffer: jax.Array, count: jax.Array, x: jax.Array, take: Any) -> jax.Array:
    """`buffer` with `x` recorded (in slot `count % len(buffer)`) where `take`:
    a rolling window of the last `len(buffer)` of the `count` values so far."""
    return jnp.where(take, buffer.at[count % buffer.shape[0]].set(x), buffer)


def window_moments(
    buffer: jax.Array, count: jax.Array, ddof: int
) -> tuple[jax.Array, jax.Array]:
    """The mean and variance (divisor n - `ddof`) of the n = min(`count`,
    `len(buffer)`) values recorded; 0 for none."""
    valid = jnp.arange(buffer.shape[0]) < count
    n = jnp.sum(valid).astype(buffer.dtype)
    mean = jnp.sum(jnp.where(valid, buffer, 0)) / jnp.maximum(n, 1)
    squares = jnp.sum(jnp.where(valid, jnp.square(buffer - mean), 0))
    return mean, squares / jnp.maximum(n - ddof, 1)


def statistics(
    z_threshold: Any, alpha: Any, size: int | None, ddof: Any, warmup: Any
) -> tuple[Callable[..., jax.Array], Callable[..., tuple]]:
    """The spike test and the statistics' update, from the checked arguments
    of `skip_spikes` (`size`: its `window`, None for an EMA)."""

    def spike(x: jax.Array, stats: tuple) -> jax.Array:
        """NaN or inf, or `x - mean > z_threshold * std` once `warmup` values
        were recorded."""
        count, mean, variance, _ = stats
        zt = jnp.asarray(z_threshold, mean.dtype)
        outlier = (count >= warmup) & (x - mean > zt * jnp.sqrt(variance))
        return ~jnp.isfinite(x) | outlier

    def recorded(x: jax.Array, stats: tuple, take: jax.Array) -> tuple:
        """The statistics after `x`, where `take` and `x` is finite: the
        window's, or an EMA with weight `max(1 - alpha, 1 / (count + 1))`
        (West's incremental form: the exact mean and population variance
        while few values are in)."""
        count, mean, variance, buffer = stats
        take = take & jnp.isfinite(x)
        new_count = _engine.count_if(take, count)
        if size is not None:
            buffer = pushed(buffer, count, x, take)
            mean, variance = window_moments(buffer, new_count, ddof)
            return new_count, mean, variance, buffer
        w = jnp.maximum(1 - jnp.asarray(alpha, mean.dtype), 1 / (count + 1))
        delta = x - mean
        moved = (1 - w) * (variance + w * jnp.square(delta))
        variance = jnp.where(take, moved, variance)
        return new_count, jnp.where(take, mean + w * delta, mean), variance, buffer

    return spike, recorded
