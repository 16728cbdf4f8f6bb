"""clipax with an Equinox model whose layers are stacked the Equinox way.

The layers are built with `eqx.filter_vmap` (one stacked leaf per parameter)
and run with `jax.lax.scan`; the updates are filtered with `eqx.is_array`, so
non-array fields are None; the step is `eqx.filter_jit`-ed. The model must
train as its unrolled twin (a list of layers with the same values).
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import clipax

LAYERS = 4
WIDTH = 6


class Layer(eqx.Module):
    linear: eqx.nn.Linear
    scale: float  # a non-array field: None in the filtered updates

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.scale * jax.nn.tanh(self.linear(x))


def make_layer(key: jax.Array) -> Layer:
    return Layer(eqx.nn.Linear(WIDTH, WIDTH, key=key), 0.5)


class Stacked(eqx.Module):
    layers: Layer  # every array with a leading axis of LAYERS
    head: eqx.nn.Linear

    def __call__(self, x: jax.Array) -> jax.Array:
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def body(h: jax.Array, params: Any) -> tuple[jax.Array, None]:
            return eqx.combine(params, static)(h), None

        h, _ = jax.lax.scan(body, x, dynamic)
        return self.head(h)


class Unrolled(eqx.Module):
    layers: list[Layer]
    head: eqx.nn.Linear

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def models() -> tuple[Stacked, Unrolled]:
    key, head_key = jax.random.split(jax.random.key(0))
    layers = eqx.filter_vmap(make_layer)(jax.random.split(key, LAYERS))
    head = eqx.nn.Linear(WIDTH, 2, key=head_key)
    dynamic, static = eqx.partition(layers, eqx.is_array)
    unrolled = [
        eqx.combine(jax.tree.map(lambda a, i=i: a[i], dynamic), static)
        for i in range(LAYERS)
    ]
    return Stacked(layers, head), Unrolled(unrolled, head)


def test_stacked_equinox_model_trains_as_its_unrolled_twin() -> None:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(16, WIDTH)).astype(np.float32))
    y = jnp.asarray(rng.normal(size=(16, 2)).astype(np.float32))
    stacked, unrolled = models()

    def make(model: eqx.Module, stacked_layers: bool) -> Any:
        prefix = (
            (lambda u: clipax.stacked_prefix(u, path="^layers/"))
            if stacked_layers
            else None
        )
        tx = optax.chain(
            clipax.adagc(warmup_steps=2, max_norm=1.0, alpha=0.9, stacked=prefix),
            clipax.adaptive_grad_clip(0.05, stacked=prefix),
            optax.adam(1e-2),
        )

        @eqx.filter_jit
        def step(model: eqx.Module, state: Any, inputs: jax.Array) -> tuple:
            def loss_fn(m: eqx.Module) -> jax.Array:
                return jnp.mean((jax.vmap(m)(inputs) - y) ** 2)

            loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
            grads = eqx.filter(grads, eqx.is_array)  # non-arrays: None
            params = eqx.filter(model, eqx.is_array)
            updates, state = tx.update(grads, state, params)
            return eqx.apply_updates(model, updates), state, loss

        return step, tx.init(eqx.filter(model, eqx.is_array))

    s_step, s_state = make(stacked, True)
    u_step, u_state = make(unrolled, False)
    for step in range(8):
        inputs = x * (20.0 if step == 5 else 1.0)  # a spike at step 5
        stacked, s_state, s_loss = s_step(stacked, s_state, inputs)
        unrolled, u_state, u_loss = u_step(unrolled, u_state, inputs)
        np.testing.assert_allclose(s_loss, u_loss, rtol=1e-5)
    np.testing.assert_allclose(
        stacked.layers.linear.weight[2], unrolled.layers[2].linear.weight, rtol=1e-4
    )
    ema = s_state[0].ema.layers.linear.weight
    assert ema.shape == (LAYERS,)
    assert s_state[0].ema.layers.scale is None
    # The logs read as the unrolled model's: `0/adagc/layers/2/linear/weight/ema`.
    logs, unrolled_logs = clipax.metrics(s_state), clipax.metrics(u_state)
    assert list(logs) == list(unrolled_logs)
    for key, value in unrolled_logs.items():
        np.testing.assert_allclose(logs[key], value, rtol=1e-4, err_msg=key)
