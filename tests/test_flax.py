"""clipax in Flax training steps: linen TrainState and nnx.Optimizer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen, nnx
from flax.training import train_state

import clipax
from tests import helpers


def _batch() -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(0)
    x = jnp.asarray(100.0 * rng.normal(size=(16, 8)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 3, size=16))
    return x, y


def test_linen_train_state_step_logs_the_norm() -> None:
    model = linen.Dense(3)
    x, y = _batch()
    params = model.init(jax.random.key(0), x)
    tx = optax.chain(clipax.clip_by_global_norm(1.0), optax.sgd(0.1))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def loss_fn(p: dict) -> jax.Array:
        logits = state.apply_fn(p, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(s: train_state.TrainState) -> tuple:
        grads = jax.grad(loss_fn)(s.params)
        return s.apply_gradients(grads=grads), grads

    new_state, grads = step(state)
    norm = optax.tree.get(new_state.opt_state, "norm")
    np.testing.assert_allclose(norm, helpers.ref_global_norm(grads), rtol=1e-5)
    assert norm > 1.0  # inputs scaled by 100: this step was clipped
    moved = jax.tree.map(lambda a, b: a - b, state.params, new_state.params)
    np.testing.assert_allclose(clipax.tree.global_norm(moved), 0.1, rtol=1e-5)


def test_nnx_optimizer_step_logs_the_norm() -> None:
    x, y = _batch()
    model = nnx.Linear(8, 3, rngs=nnx.Rngs(0))
    tx = optax.chain(clipax.clip_by_global_norm(1.0), optax.sgd(0.1))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))

    @nnx.jit
    def step(model: nnx.Linear, optimizer: nnx.Optimizer) -> jax.Array:
        def loss_fn(m: nnx.Linear) -> jax.Array:
            return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

        grads = nnx.grad(loss_fn)(model)
        optimizer.update(model, grads)
        return clipax.tree.global_norm(grads)

    grad_norm = step(model, optimizer)
    # nnx wraps optimizer state arrays in variables; `[...]` reads the array.
    norm = optax.tree.get(optimizer.opt_state, "norm")[...]
    np.testing.assert_allclose(norm, grad_norm, rtol=1e-6)
    assert norm > 1.0
    after = nnx.state(model, nnx.Param)
    moved = jax.tree.map(lambda a, b: a - b, before, after)
    np.testing.assert_allclose(clipax.tree.global_norm(moved), 0.1, rtol=1e-5)
