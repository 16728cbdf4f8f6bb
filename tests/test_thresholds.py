"""A threshold given as an array is data: one rule, the same eagerly and under jit.

A Python number given at construction is configuration and is checked there
(tests/test_bad_inputs.py). An array (a schedule's value, an
`optax.inject_hyperparams` entry, traced or not) is data: a norm threshold
<= 0 zeroes the update, NaN makes it NaN, inf turns clipping off, and no
value raises, eagerly or under `jax.jit` (docs/semantics.md, "Thresholds").
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import clipax

GRADS = {"w": jnp.array([[3.0, -4.0], [1.0, 2.0]]), "b": jnp.array([0.5, -0.5])}
PARAMS = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
VALUES = [0.0, -1.0, math.nan, math.inf]


def _update_both_ways(tx: optax.GradientTransformation) -> tuple[Any, Any]:
    """The first update, eagerly and under `jax.jit` (each from a fresh init)."""
    eager, _ = tx.update(GRADS, tx.init(PARAMS), PARAMS)
    jitted, _ = jax.jit(tx.update)(GRADS, tx.init(PARAMS), PARAMS)
    return eager, jitted


def _assert_same(eager: Any, jitted: Any) -> None:
    jax.tree.map(np.testing.assert_array_equal, eager, jitted)  # NaN == NaN


# Each norm threshold: (factory, its argument).
NORM_THRESHOLDS: dict[str, tuple[Callable[..., Any], str]] = {
    "clip_by_global_norm": (clipax.clip_by_global_norm, "max_norm"),
    "clip_by_norm": (clipax.clip_by_norm, "max_norm"),
    "clip_by_block_rms": (clipax.clip_by_block_rms, "threshold"),
    "adaptive_grad_clip": (clipax.adaptive_grad_clip, "clipping"),
    "adagc max_norm": (clipax.adagc, "max_norm"),
}


@pytest.mark.parametrize("value", VALUES, ids=str)
@pytest.mark.parametrize("rule", list(NORM_THRESHOLDS))
def test_a_norm_threshold_array_follows_one_rule(rule: str, value: float) -> None:
    factory, name = NORM_THRESHOLDS[rule]
    static = ("warmup_steps",) if factory is clipax.adagc else ()
    tx = optax.inject_hyperparams(factory, static_args=static)(**{name: value})
    eager, jitted = _update_both_ways(tx)
    _assert_same(eager, jitted)
    for leaf, grad in zip(jax.tree.leaves(eager), jax.tree.leaves(GRADS), strict=True):
        if math.isnan(value):
            assert np.isnan(leaf).all()
        elif math.isinf(value):
            np.testing.assert_allclose(leaf, grad, rtol=1e-6)
        else:  # <= 0: every update zero
            np.testing.assert_array_equal(leaf, np.zeros_like(grad))


@pytest.mark.parametrize("value", VALUES, ids=str)
def test_clip_max_delta_array(value: float) -> None:
    tx = optax.inject_hyperparams(clipax.clip)(max_delta=value)
    eager, jitted = _update_both_ways(tx)
    _assert_same(eager, jitted)
    want = (
        jax.tree.map(lambda g: np.clip(g, -value, value), GRADS)
        if value > 0
        else jax.tree.map(
            lambda g: np.full_like(g, math.nan if math.isnan(value) else 0.0), GRADS
        )
    )
    jax.tree.map(np.testing.assert_array_equal, eager, want)


@pytest.mark.parametrize(
    ("low", "high"), [(math.nan, 1.0), (2.0, 1.0), (-math.inf, math.inf)]
)
def test_clip_by_value_bound_arrays(low: float, high: float) -> None:
    tx = optax.inject_hyperparams(clipax.clip_by_value)(min_value=low, max_value=high)
    eager, jitted = _update_both_ways(tx)
    _assert_same(eager, jitted)
    # jnp.clip's rule: a NaN bound gives NaN, min > max gives max.
    jax.tree.map(
        lambda got, g: np.testing.assert_array_equal(
            got, np.minimum(np.maximum(g, low), high)
        ),
        eager,
        GRADS,
    )


# The adaptive rules' other hyperparameters enter their formula as they are:
# no value raises, and eager and jitted steps agree.
HYPERPARAMETERS: list[tuple[Callable[..., Any], dict[str, Any]]] = (
    [(clipax.adagc, {"clip_ratio": value}) for value in VALUES]
    + [(clipax.adagc, {"alpha": value, "warmup_steps": 0}) for value in VALUES]
    + [(clipax.zclip, {"z_threshold": value, "warmup_steps": 1}) for value in VALUES]
    + [(clipax.zclip, {"alpha": value, "warmup_steps": 1}) for value in VALUES]
    + [(clipax.zclip, {"clip_factor": value, "warmup_steps": 1}) for value in VALUES]
    + [(clipax.autoclip, {"percentile": value}) for value in [*VALUES, 150.0]]
)


@pytest.mark.parametrize(
    ("factory", "hyperparams"),
    HYPERPARAMETERS,
    ids=[f"{f.__name__}-{h}" for f, h in HYPERPARAMETERS],
)
def test_adaptive_hyperparameter_arrays_are_data(
    factory: Callable[..., Any], hyperparams: dict[str, Any]
) -> None:
    names = inspect.signature(factory).parameters
    static = tuple(a for a in ("warmup_steps", "history") if a in names)
    tx = optax.inject_hyperparams(factory, static_args=static)(**hyperparams)

    def run(update: Any) -> Any:
        state = tx.init(PARAMS)
        outs = []
        for scale in (1.0, 1.0, 8.0):  # the last step spikes
            grads = jax.tree.map(lambda g, s=scale: s * g, GRADS)
            out, state = update(grads, state)
            outs.append(out)
        return outs

    _assert_same(run(tx.update), run(jax.jit(tx.update)))


def test_autoclip_percentile_array_is_clamped_and_nan_gives_nan() -> None:
    def first(percentile: float) -> Any:
        tx = optax.inject_hyperparams(clipax.autoclip)(percentile=percentile)
        state = tx.init(PARAMS)
        _, state = tx.update(GRADS, state)
        out, _ = tx.update(jax.tree.map(lambda g: 3 * g, GRADS), state)
        return out

    jax.tree.map(np.testing.assert_array_equal, first(150.0), first(100.0))
    jax.tree.map(np.testing.assert_array_equal, first(-5.0), first(0.0))
    assert all(np.isnan(x).all() for x in jax.tree.leaves(first(math.nan)))


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan])
def test_skip_spikes_max_norm_array_skips_every_nonzero_step(value: float) -> None:
    tx = optax.inject_hyperparams(
        lambda max_norm: clipax.skip_spikes(optax.sgd(1.0), max_norm=max_norm)
    )(max_norm=value)
    for update in (tx.update, jax.jit(tx.update)):
        out, state = update(GRADS, tx.init(PARAMS))
        assert bool(state.inner_state.skipped)
        jax.tree.map(lambda x: np.testing.assert_array_equal(x, 0.0), out)


def _warmup() -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=1.0, warmup_steps=4, decay_steps=20
    )


def test_a_warmup_schedule_from_zero_works_eagerly_and_under_jit() -> None:
    tx = optax.chain(
        optax.inject_hyperparams(clipax.clip_by_global_norm)(max_norm=_warmup()),
        optax.sgd(1.0),
    )
    runs = []
    for update in (tx.update, jax.jit(tx.update)):
        state, outs = tx.init(PARAMS), []
        for _ in range(4):
            out, state = update(GRADS, state)
            outs.append(out)
        runs.append(outs)
    _assert_same(*runs)
    norms = [float(optax.tree.norm(out)) for out in runs[0]]
    assert norms[0] == 0.0  # threshold 0 at the first step: a zero update
    np.testing.assert_allclose(norms[1:], [0.25, 0.5, 0.75], rtol=1e-6)


def test_a_warmup_schedule_from_zero_in_an_nnx_optimizer() -> None:
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    tx = optax.chain(
        optax.inject_hyperparams(clipax.clip_by_global_norm)(max_norm=_warmup()),
        optax.sgd(0.1),
    )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)  # eager init: no error
    before = jax.tree.map(np.array, nnx.state(model, nnx.Param))
    grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
    optimizer.update(model, grads)  # eager step at threshold 0
    jax.tree.map(np.testing.assert_array_equal, nnx.state(model, nnx.Param), before)
    optimizer.update(model, grads)
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(
            jax.tree.leaves(nnx.state(model, nnx.Param)),
            jax.tree.leaves(before),
            strict=True,
        )
    )
