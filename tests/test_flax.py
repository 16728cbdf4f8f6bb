"""clipax in Flax training steps: linen TrainState and nnx.Optimizer."""

from __future__ import annotations

from typing import Any

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


# Layers stacked by `nn.scan` against the same model unrolled.

LAYERS = 3


class _Block(linen.Module):
    """A residual MLP block; the kernels carry logical axis names, the
    biases none (`stacked_prefix` gives them their kernels' count)."""

    @linen.compact
    def __call__(self, x: jax.Array, _: None = None) -> tuple[jax.Array, None]:
        dense = lambda n, names: linen.Dense(  # noqa: E731
            n,
            kernel_init=linen.with_logical_partitioning(
                linen.initializers.lecun_normal(), names
            ),
        )
        h = linen.gelu(dense(16, ("embed", "mlp"))(x))
        return x + dense(8, ("mlp", "embed"))(h), None


class _Scanned(linen.Module):
    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = linen.Dense(8, name="embed")(x)
        blocks = linen.scan(
            _Block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=LAYERS,
            metadata_params={linen.PARTITION_NAME: "layers"},
        )
        x, _ = blocks(name="blocks")(x, None)
        return linen.Dense(3, name="head")(x)


class _Unrolled(linen.Module):
    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = linen.Dense(8, name="embed")(x)
        for i in range(LAYERS):
            x, _ = _Block(name=f"block_{i}")(x)
        return linen.Dense(3, name="head")(x)


def _unrolled_params(scanned: dict) -> dict:
    params = dict(scanned["params"])
    blocks = params.pop("blocks")
    for i in range(LAYERS):
        params[f"block_{i}"] = jax.tree.map(lambda a, i=i: a[i], blocks)
    return {"params": params}


def test_stacked_prefix_from_logical_axis_names() -> None:
    x, _ = _batch()
    boxed = _Scanned().init(jax.random.key(0), x)
    prefix = clipax.stacked_prefix(boxed, axis_name="layers")
    # The count goes where the scanned module starts: `params/blocks`.
    assert prefix == {"params": {"blocks": 1, "embed": 0, "head": 0}}
    path_prefix = clipax.stacked_prefix(linen.unbox(boxed), path="^params/blocks/")
    assert path_prefix == prefix


def test_nn_scan_model_trains_as_its_unrolled_twin() -> None:
    x, y = _batch()
    x = x / 100.0
    boxed = _Scanned().init(jax.random.key(0), x)
    prefix = clipax.stacked_prefix(boxed, axis_name="layers")
    scanned_params = linen.unbox(boxed)
    unrolled_params = _unrolled_params(scanned_params)

    def make(stacked: Any) -> optax.GradientTransformation:
        return optax.chain(
            clipax.adagc(warmup_steps=2, max_norm=0.5, alpha=0.9, stacked=stacked),
            clipax.clip_by_norm(0.3, stacked=stacked),
            optax.adamw(1e-2),
        )

    def trainer(model: linen.Module, tx: optax.GradientTransformation) -> Any:
        def loss_fn(params: Any, inputs: jax.Array) -> jax.Array:
            logits = model.apply(params, inputs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        @jax.jit
        def step(params: Any, state: Any, inputs: jax.Array) -> tuple:
            loss, grads = jax.value_and_grad(loss_fn)(params, inputs)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss

        return step

    s_tx, u_tx = make(prefix), make(None)
    s_step, u_step = trainer(_Scanned(), s_tx), trainer(_Unrolled(), u_tx)
    s_params, s_state = scanned_params, s_tx.init(scanned_params)
    u_params, u_state = unrolled_params, u_tx.init(unrolled_params)
    for step in range(8):
        inputs = x * (25.0 if step == 5 else 1.0)  # a spike at step 5
        s_params, s_state, s_loss = s_step(s_params, s_state, inputs)
        u_params, u_state, u_loss = u_step(u_params, u_state, inputs)
        np.testing.assert_allclose(s_loss, u_loss, rtol=1e-5)
    np.testing.assert_allclose(
        s_params["params"]["blocks"]["Dense_0"]["kernel"][1],
        u_params["params"]["block_1"]["Dense_0"]["kernel"],
        rtol=1e-4,
        atol=1e-6,
    )
    logs = clipax.metrics(s_state)
    assert "adagc/params/blocks/2/Dense_1/kernel/ema" in logs
    assert "clip_by_norm/params/blocks/0/Dense_0/bias/norm" in logs
