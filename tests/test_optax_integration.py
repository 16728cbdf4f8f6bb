"""clipax inside Optax: chains, masking, multi_transform, inject_hyperparams."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipax
from tests import helpers


def _params() -> dict:
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
    }


def _grads(scale: float = 10.0) -> dict:
    rng = np.random.default_rng(1)
    return {
        "w": jnp.asarray(scale * rng.normal(size=(4, 3)), jnp.float32),
        "b": jnp.asarray(scale * rng.normal(size=(3,)), jnp.float32),
    }


@pytest.mark.parametrize("optimizer", [optax.sgd(0.1), optax.adam(1e-2)])
def test_chain_equals_optax_clip_then_optimizer(
    optimizer: optax.GradientTransformation,
) -> None:
    params, grads = _params(), _grads()
    ours = optax.chain(clipax.clip_by_global_norm(1.0), optimizer)
    theirs = optax.chain(optax.clip_by_global_norm(1.0), optimizer)
    s_ours, s_theirs = ours.init(params), theirs.init(params)
    for _ in range(3):
        u_ours, s_ours = jax.jit(ours.update)(grads, s_ours, params)
        u_theirs, s_theirs = theirs.update(grads, s_theirs, params)
        chex.assert_trees_all_close(u_ours, u_theirs, rtol=1e-5, atol=1e-7)
    norm = optax.tree.get(s_ours, "norm")
    np.testing.assert_allclose(norm, helpers.ref_global_norm(grads), rtol=1e-6)


def test_chain_with_every_clipax_transformation_compiles_once() -> None:
    params, grads = _params(), _grads()
    tx = optax.chain(
        clipax.clip(5.0),
        clipax.clip_by_value(-4.0, 6.0),
        clipax.clip_by_norm(3.0, axes=0),
        clipax.clip_by_global_norm(2.0),
        optax.adam(1e-3),
    )

    def step(p: dict, s: optax.OptState) -> tuple:
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    helpers.assert_compiles_once(step, params, tx.init(params))


def test_inside_masked_only_the_selected_leaves_are_clipped() -> None:
    params, grads = _params(), _grads()
    mask = {"w": True, "b": False}
    tx = optax.masked(clipax.clip_by_global_norm(1.0), mask)
    updates, state = jax.jit(tx.update)(grads, tx.init(params))
    chex.assert_trees_all_equal(updates["b"], grads["b"])
    np.testing.assert_allclose(clipax.tree.global_norm(updates["w"]), 1.0, rtol=1e-6)
    np.testing.assert_allclose(
        optax.tree.get(state, "norm"),
        helpers.ref_global_norm(grads["w"]),
        rtol=1e-6,
    )


def test_inside_multi_transform() -> None:
    params, grads = _params(), _grads()
    tx = optax.multi_transform(
        {"global": clipax.clip_by_global_norm(1.0), "leaf": clipax.clip_by_norm(2.0)},
        {"w": "global", "b": "leaf"},
    )
    updates, _ = jax.jit(tx.update)(grads, tx.init(params))
    np.testing.assert_allclose(clipax.tree.global_norm(updates["w"]), 1.0, rtol=1e-6)
    np.testing.assert_allclose(clipax.tree.global_norm(updates["b"]), 2.0, rtol=1e-6)


def test_inject_hyperparams_with_a_schedule_for_max_norm() -> None:
    params, grads = _params(), _grads()
    schedule = optax.linear_schedule(1.0, 4.0, transition_steps=3)
    tx = optax.inject_hyperparams(clipax.clip_by_global_norm)(max_norm=schedule)
    state = tx.init(params)

    def step(s: optax.OptState) -> tuple:
        updates, s = tx.update(grads, s)
        return (s, clipax.tree.global_norm(updates))

    jitted = jax.jit(step)
    for expected in (1.0, 2.0, 3.0, 4.0, 4.0):
        state, norm = jitted(state)
        np.testing.assert_allclose(norm, expected, rtol=1e-6)
        np.testing.assert_allclose(
            state.inner_state.norm, helpers.ref_global_norm(grads), rtol=1e-6
        )
    assert jitted._cache_size() == 1
    # Eagerly too, where the injected value is a concrete JAX scalar.
    updates, _ = tx.update(grads, tx.init(params))
    np.testing.assert_allclose(clipax.tree.global_norm(updates), 1.0, rtol=1e-6)


def test_inject_hyperparams_for_clip_and_clip_by_norm() -> None:
    grads = _grads()
    for factory, kwargs in (
        (clipax.clip, {"max_delta": 0.5}),
        (clipax.clip_by_norm, {"max_norm": 0.5}),
    ):
        tx = optax.inject_hyperparams(factory)(**kwargs)
        updates, _ = jax.jit(tx.update)(grads, tx.init(grads))
        direct = factory(**kwargs)
        chex.assert_trees_all_close(
            updates, direct.update(grads, direct.init(grads))[0]
        )


def test_apply_if_finite_skips_non_finite_steps() -> None:
    params = _params()
    tx = optax.apply_if_finite(
        optax.chain(clipax.clip_by_global_norm(1.0), optax.sgd(1.0)),
        max_consecutive_errors=5,
    )
    state = tx.init(params)
    bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), _grads())
    updates, state = jax.jit(tx.update)(bad, state, params)
    chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))
    assert int(state.notfinite_count) == 1
    updates, state = jax.jit(tx.update)(_grads(), state, params)
    assert int(state.notfinite_count) == 0
    np.testing.assert_allclose(clipax.tree.global_norm(updates), 1.0, rtol=1e-6)


def test_inject_hyperparams_with_a_static_ord() -> None:
    grads = _grads()
    tx = optax.inject_hyperparams(clipax.clip_by_global_norm, static_args="ord")(
        max_norm=1.0, ord=1
    )
    updates, state = jax.jit(tx.update)(grads, tx.init(grads))
    np.testing.assert_allclose(clipax.tree.global_norm(updates, ord=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(
        state.inner_state.norm, helpers.ref_global_norm(grads, 1), rtol=1e-6
    )


def test_traced_ord_or_axes_name_static_args() -> None:
    grads = _grads()
    for factory, kwargs in (
        (clipax.clip_by_global_norm, {"max_norm": 1.0, "ord": 1}),
        (clipax.clip_by_norm, {"max_norm": 1.0, "axes": 0}),
    ):
        tx = optax.inject_hyperparams(factory)(**kwargs)
        state = tx.init(grads)
        with pytest.raises(TypeError, match=r"traced value.*`static_args`"):
            jax.jit(tx.update)(grads, state)
