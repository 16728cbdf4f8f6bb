"""Stable-SPAM: per-tensor AdaClip and AdaGN on the gradients, then `inner`."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from clipax import _checks, _engine, _leaves, _states


@_states.declare(
    "stable_spam",
    per_tensor={"m_max": "m_max", "m_norm": "m_norm", "v_norm": "v_norm"},
    inner="inner_state",
)
class StableSpamState(NamedTuple):
    """State of `stable_spam`: each tensor's statistics and the wrapped state."""

    inner_state: optax.OptState  # the wrapped transformation's state
    count: jax.Array  # type: ignore[assignment]  # int32 scalar: steps taken (the bias corrections' t)
    m_max: chex.ArrayTree  # the updates' tree, a float32 scalar per tensor
    # (a vector, one per layer, for a stacked leaf): EMA of its largest |g|
    m_norm: chex.ArrayTree  # likewise: EMA of its norm after AdaClip
    v_norm: chex.ArrayTree  # likewise: EMA of that norm squared
    stacks: _leaves.Stacks = _leaves.Stacks()  # static: where each stack starts


class Config(NamedTuple):
    """`stable_spam`'s arguments, checked, and its inner transformation."""

    inner: optax.GradientTransformationExtraArgs
    checked: _leaves.Reader
    theta: Any
    gamma1: Any
    gamma2: Any
    eps: Any
    reset_every: int | None


def lerp(old: jax.Array, new: jax.Array, gamma: Any, where: jax.Array) -> jax.Array:
    """`old` moved by 1 - `gamma` towards `new` (as torch's `lerp`) where
    `where`."""
    return jnp.where(where, old + (1 - gamma) * (new - old), old)


def ada_clip(leaf: _leaves.Leaf, peak: jax.Array, top: jax.Array, dtype: Any) -> Any:
    """AdaClip: the leaf's entries above `top` (per layer), its largest
    `peak` scaled down to it, the others as they are; upcast."""
    top = leaf.broadcast(top)
    scale = top / leaf.broadcast(jnp.where(peak > 0, peak, 1))
    g = _engine.upcast(jnp.asarray(leaf.x), like=dtype)
    return dataclasses.replace(leaf, x=jnp.where(jnp.abs(g) > top, g * scale, g))


def ada_gn(
    leaf: _leaves.Leaf, g: Any, n: jax.Array, m: jax.Array, v: jax.Array, at: Any
) -> jax.Array:
    """AdaGN: `g` (of norm `n`) rescaled to norm `m_hat / (sqrt(v_hat) + eps)`
    (`at`: `(gamma1, gamma2, t, eps)`, the bias corrections taken here, as
    each tensor's own operations); NaN where `n` is; in the leaf's dtype."""
    g1, g2, steps, eps = at
    usable = jnp.isfinite(n) & (n > 0)
    target = (m / (1 - g1**steps)) / (jnp.sqrt(v / (1 - g2**steps)) + eps)
    factor = jnp.where(usable, target / jnp.where(usable, n, 1), 1)
    factor = jnp.where(jnp.isfinite(n), factor, jnp.nan)  # all of it NaN
    return (g.x * leaf.broadcast(factor)).astype(leaf.x.dtype)


def step(
    config: Config, updates: Any, state: StableSpamState, params: Any, extra: dict
) -> tuple[Any, StableSpamState]:
    """AdaClip, then AdaGN, per tensor (per layer), then `inner`, whose state
    restarts before every `reset_every`-th step."""
    leaves = config.checked(updates)
    m_max, m_norm, v_norm = (
        leaves.stats(_leaves.check_state("stable_spam", leaves, tree, state.stacks))
        for tree in (state.m_max, state.m_norm, state.v_norm)
    )
    dtype = _engine.tree_accum_dtype(leaves.arrays)
    t = optax.safe_int32_increment(state.count)
    steps = t.astype(dtype)
    theta, g1, g2 = config.theta, config.gamma1, config.gamma2
    peaks = leaves.stats(_engine.layer_norms(leaves, math.inf))
    m_max = jax.tree.map(lambda m, p: lerp(m, p, theta, jnp.isfinite(p)), m_max, peaks)
    clipped = jax.tree.map(
        lambda leaf, p, m: ada_clip(leaf, p, m / (1 - theta**steps), dtype),
        leaves.records,
        peaks,
        m_max,
    )
    norms = leaves.stats(_engine.layer_norms(jax.tree.leaves(clipped)))
    usable = jax.tree.map(lambda n: jnp.isfinite(n) & (n > 0), norms)
    m_norm = jax.tree.map(lambda m, n, u: lerp(m, n, g1, u), m_norm, norms, usable)
    v_norm = jax.tree.map(lambda v, n, u: lerp(v, n**2, g2, u), v_norm, norms, usable)
    at = (g1, g2, steps, config.eps)
    out = jax.tree.map(
        functools.partial(ada_gn, at=at), leaves.records, clipped, norms, m_norm, v_norm
    )
    inner_state = state.inner_state
    if config.reset_every is not None:  # Stable-SPAM's momentum reset, only then
        inner_state = jax.lax.cond(
            t % config.reset_every == 0,
            lambda: config.inner.init(updates if params is None else params),
            lambda: inner_state,
        )
    new_updates, inner_state = config.inner.update(
        leaves.rebuild(jax.tree.leaves(out)), inner_state, params, **extra
    )
    return new_updates, StableSpamState(
        inner_state, t, m_max, m_norm, v_norm, state.stacks
    )


def stable_spam(
    inner: optax.GradientTransformation,
    *,
    theta: ArrayLike = 0.999,
    gamma1: ArrayLike = 0.7,
    gamma2: ArrayLike = 0.9,
    eps: ArrayLike = 1e-8,
    reset_every: int | None = 1000,
    stacked: Any = None,
    axis_name: str | Sequence[str] | None = None,
    specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Stable-SPAM's gradient handling per tensor, then `inner`.

    Stable-SPAM (Huang et al. 2025) for each tensor: AdaClip scales the
    entries above a bias-corrected EMA (`theta`) of the tensor's largest |g|
    down to it; AdaGN rescales the tensor to norm `m / (sqrt(v) + eps)`, the
    bias-corrected EMAs of its norm and squared norm. `inner` takes the
    result; its whole state is re-initialised before every `reset_every`-th
    step. A tensor holding NaN or inf comes out all NaN; with `stacked`, each
    layer is a tensor (docs/stacked-layers.md). docs/porting.md maps
    pytorch-optimizer's `StableSPAM`, zero gradients and schedules.

    Args:
      inner: the optimizer the gradients go to, e.g. `optax.adamw(1e-3)`;
        extra arguments of `update` are forwarded to it.
      theta: the EMA factor of each tensor's largest |g|, in (0, 1).
      gamma1: the EMA factor of each tensor's norm, in (0, 1).
      gamma2: the EMA factor of its squared norm, in (0, 1).
      eps: added to the root of the squared norm's EMA, >= 0.
      reset_every: None (never), or every how many steps `inner`'s state is
        re-initialised, an int >= 1.
      stacked: None, or a prefix of the updates (docs/stacked-layers.md).
      axis_name: the mesh axes every leaf is split over (docs/scaling-out.md).
      specs: inside `shard_map`, the `in_specs` of the updates.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a
      `StableSpamState`.

    Raises:
      ValueError: if an argument is not accepted.
      TypeError: if `inner` is not a transformation, or a leaf not a float.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import clipax
      >>> tx = clipax.stable_spam(optax.sgd(1.0), reset_every=None)
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> for g in [1.0, 1.0, 50.0]:  # a spike at the third step
      ...     updates, state = tx.update({"w": jnp.array([g, -g])}, state)
      >>> updates["w"]  # norm 70.7 clipped, then rescaled by AdaGN to 0.80
      Array([-0.566,  0.566], dtype=float32)

    References:
      Huang et al., `Stable-SPAM <https://arxiv.org/abs/2502.17055>`_, 2025.
    """
    _checks.transformation("inner", inner)
    theta, gamma1, gamma2 = (
        _checks.unit(n, v)
        for n, v in (("theta", theta), ("gamma1", gamma1), ("gamma2", gamma2))
    )
    eps = _checks.number("eps", eps, "a finite real number >= 0", low=0, high_open=True)
    if reset_every is not None:
        reset_every = _checks.integer("reset_every", reset_every)
    config = Config(
        optax.with_extra_args_support(inner),
        _leaves.reader(
            "stable_spam", stacked=stacked, specs=specs, axis_name=axis_name
        ),
        theta,
        gamma1,
        gamma2,
        eps,
        reset_every,
    )

    def init_fn(params: optax.Params) -> StableSpamState:
        leaves = config.checked(params)
        dtype = _engine.tree_accum_dtype(leaves.arrays)
        m_max, m_norm, v_norm = (leaves.full(0, dtype) for _ in range(3))
        count = jnp.zeros((), jnp.int32)
        return StableSpamState(
            config.inner.init(params), count, m_max, m_norm, v_norm, leaves.stacks
        )

    def update_fn(
        updates: optax.Updates,
        state: StableSpamState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, StableSpamState]:
        return step(config, updates, state, params, extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
