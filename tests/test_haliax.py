"""Levanter's trees: haliax `NamedArray` parameters and `hnn.Stacked` layers.

A per-tensor statistic of a `NamedArray` is a plain array (its axes would not
fit the statistic), so the state is well formed and `hax.shard` shards it; keys
follow the parameter's path; `stacked_prefix` reads the named layer axis; a
`Stacked` model trains as its unrolled twin (`BlockSeq`).
"""

from __future__ import annotations

from typing import Any

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipax

hax = pytest.importorskip("haliax")
hnn = pytest.importorskip("haliax.nn")

Layers = hax.Axis("layers", 3)
Embed = hax.Axis("embed", 4)
Mlp = hax.Axis("mlp", 6)
In = hax.Axis("in", 5)
Out = hax.Axis("out", 2)
Batch = hax.Axis("batch", 8)


class Block(eqx.Module):
    up: Any
    down: Any
    ln: Any

    @staticmethod
    def init(*, key: jax.Array) -> Block:
        k1, k2 = jax.random.split(key)
        return Block(
            hnn.Linear.init(Embed, Mlp, key=k1),
            hnn.Linear.init(Mlp, Embed, key=k2),
            hnn.LayerNorm.init(Embed),
        )

    def __call__(self, x: Any) -> Any:
        return x + self.down(hnn.gelu(self.up(self.ln(x))))


class Net(eqx.Module):
    embed: Any
    layers: Any
    head: Any

    def __call__(self, x: Any) -> Any:
        return self.head(self.layers.fold(self.embed(x)))


def stacked_net(seed: int = 0) -> Net:
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return Net(
        hnn.Linear.init(In, Embed, key=k1),
        hnn.Stacked.init(Layers, Block)(key=jax.random.split(k2, Layers.size)),
        hnn.Linear.init(Embed, Out, key=k3),
    )


def unrolled(net: Net) -> Net:
    blocks = hnn.BlockSeq(list(net.layers.unstacked()), Layers, False)
    return Net(net.embed, blocks, net.head)


def unrolled_key(key: str) -> str:
    """A key of the stacked model as its unrolled twin writes it."""
    parts = key.split("/")
    if "layers" in parts and parts[parts.index("layers") + 2] == "stacked":
        i = parts.index("layers")
        parts[i + 1 : i + 3] = ["blocks", parts[i + 1]]
    return "/".join(parts)


def grads_of(net: Net) -> Any:
    params = eqx.filter(net, eqx.is_array)
    x = hax.random.normal(jax.random.key(1), (Batch, In))
    return eqx.filter_grad(lambda p: hax.sum(p(x) ** 2).scalar())(params)


RULES = {
    "adagc": lambda s: clipax.adagc(warmup_steps=1, stacked=s),
    "clip_by_norm": lambda s: clipax.clip_by_norm(0.1, stacked=s),
    "stable_spam": lambda s: clipax.stable_spam(optax.sgd(0.1), stacked=s),
}


@pytest.mark.parametrize("stacked", [False, True], ids=["plain", "stacked"])
@pytest.mark.parametrize("rule", list(RULES))
def test_states_of_named_arrays_are_well_formed_and_shard(
    rule: str, stacked: bool
) -> None:
    params = eqx.filter(stacked_net(), eqx.is_array)
    prefix = clipax.stacked_prefix(params, axis_name="layers") if stacked else None
    tx = optax.chain(RULES[rule](prefix), optax.adam(1e-3))
    state = tx.init(params)
    _, state = jax.jit(tx.update)(grads_of(stacked_net()), state, params)
    for leaf in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, hax.NamedArray)):
        if isinstance(leaf, hax.NamedArray):  # adam's moments: the params' axes
            assert leaf.array.shape == tuple(leaf.shape.values())
    mesh = jax.make_mesh((2,), ("data",))
    sharded = hax.shard(state, {"embed": "data"}, mesh=mesh)
    chex.assert_trees_all_equal(sharded, state)
    logs = clipax.metrics(state)
    assert not [k for k in logs if "/0/" in k and "layers/" not in k]
    assert f"{rule}/embed/weight/" in next(k for k in logs if "embed/weight" in k)


def test_stacked_prefix_reads_named_axes() -> None:
    params = eqx.filter(stacked_net(), eqx.is_array)
    prefix = clipax.stacked_prefix(params, axis_name="layers")
    assert (prefix.embed, prefix.layers, prefix.head) == (0, 1, 0)
    norms = clipax.tree.clip_by_norm(params, 1.0, stacked=prefix)
    assert norms.layers.stacked.up.weight.axes == params.layers.stacked.up.weight.axes
    with pytest.raises(ValueError, match=r"'layer'.*\['embed', 'in', 'layers'"):
        clipax.stacked_prefix(params, axis_name="layer")


def test_two_stacked_modules_of_equal_depth_stay_two() -> None:
    net = stacked_net()
    two = {"encoder": net.layers, "decoder": stacked_net(1).layers}
    params = eqx.filter(two, eqx.is_array)
    prefix = clipax.stacked_prefix(params, axis_name="layers")
    assert prefix == {"encoder": 1, "decoder": 1}
    norms = clipax.tree.group_norms(params, depth=2, stacked=prefix)
    assert list(norms) == [
        f"{p}/{i}/norm" for p in ("decoder", "encoder") for i in range(3)
    ]


def test_a_stacked_model_trains_as_its_unrolled_twin() -> None:
    net = stacked_net()
    twin = unrolled(net)
    prefix = clipax.stacked_prefix(eqx.filter(net, eqx.is_array), axis_name="layers")
    x = hax.random.normal(jax.random.key(2), (Batch, In))

    def make(stacked: Any) -> optax.GradientTransformation:
        return optax.chain(
            clipax.adagc(warmup_steps=2, max_norm=1.0, stacked=stacked),
            clipax.clip_by_norm(0.5, stacked=stacked),
            optax.adamw(1e-2),
        )

    def trainer(model: Net, stacked: Any) -> tuple:
        tx = make(stacked)
        params, static = eqx.partition(model, eqx.is_array)

        @jax.jit
        def step(params: Any, state: Any, scale: jax.Array) -> tuple:
            def loss(p: Any) -> jax.Array:
                out = eqx.combine(p, static)(x * scale)
                return hax.mean(out**2).scalar()

            value, grads = jax.value_and_grad(loss)(params)
            updates, state = tx.update(grads, state, params)
            norms = clipax.tree.group_norms(grads, depth=3, stacked=stacked)
            logs = clipax.metrics(state) | norms
            return eqx.apply_updates(params, updates), state, value, logs

        return params, tx.init(params), step

    s_params, s_state, s_step = trainer(net, prefix)
    u_params, u_state, u_step = trainer(twin, None)
    for i in range(5):
        scale = jnp.asarray(20.0 if i == 3 else 1.0)  # a spike at step 3
        s_params, s_state, s_loss, s_logs = s_step(s_params, s_state, scale)
        u_params, u_state, u_loss, u_logs = u_step(u_params, u_state, scale)
        np.testing.assert_allclose(s_loss, u_loss, rtol=1e-5)
        assert sorted(map(unrolled_key, s_logs)) == sorted(u_logs)
        for key, value in s_logs.items():
            np.testing.assert_allclose(
                value, u_logs[unrolled_key(key)], rtol=2e-5, err_msg=key
            )
