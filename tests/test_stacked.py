"""`stacked=`: a stacked leaf gives what the unrolled model gives, layer by layer.

Every rule runs on a tree whose blocks are stacked (one leaf of shape
`(L, ...)` per parameter, as `nn.scan` makes them) and on the same values
unrolled into L separate leaves; outputs, states and logs must agree.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import clipax
from tests import helpers

L = 4
STACKED = {"blocks": 1, "embed": 0, "head": 0}
SHAPES = {
    "embed": (8, 4),
    "blocks": {"attn": {"kernel": (L, 4, 12), "bias": (L, 12)}, "mlp": (L, 4, 16)},
    "head": (4,),
}


def stacked_tree(seed: int, spike: tuple[int, float] | None = None) -> dict:
    """Random values in the stacked layout; `spike` multiplies one layer of
    the attention kernel."""
    rng = np.random.default_rng(seed)
    tree = jax.tree.map(
        lambda s: jnp.asarray(rng.normal(size=s).astype(np.float32)),
        SHAPES,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    if spike is not None:
        layer, factor = spike
        kernel = tree["blocks"]["attn"]["kernel"]
        tree["blocks"]["attn"]["kernel"] = kernel.at[layer].multiply(factor)
    return tree


def unrolled(tree: dict) -> dict:
    """The same values with each layer a subtree of its own."""
    blocks = tree["blocks"]
    return {
        **tree,
        "blocks": [jax.tree.map(lambda x, i=i: x[i], blocks) for i in range(L)],
    }


def restacked(tree: dict) -> dict:
    """`unrolled`'s inverse."""
    return {**tree, "blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *tree["blocks"])}


def assert_same_logs(stacked_state: Any, unrolled_state: Any) -> None:
    got, want = clipax.metrics(stacked_state), clipax.metrics(unrolled_state)
    assert list(got) == list(want)  # the same keys, in the same order
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-6, err_msg=key)


RULES: dict[str, Callable[..., optax.GradientTransformation]] = {
    "clip_by_norm": lambda **kw: clipax.clip_by_norm(1.5, **kw),
    "clip_by_norm axes=-1": lambda **kw: clipax.clip_by_norm(0.5, axes=-1, **kw),
    "clip_by_norm axes=0": lambda **kw: clipax.clip_by_norm(0.5, axes=0, **kw),
    "adaptive_grad_clip": lambda **kw: clipax.adaptive_grad_clip(0.05, **kw),
    "clip_by_block_rms": lambda **kw: clipax.clip_by_block_rms(0.3, **kw),
    "adagc": lambda **kw: clipax.adagc(warmup_steps=3, max_norm=5.0, **kw),
    "stable_spam": lambda **kw: clipax.stable_spam(
        optax.adam(1e-2), reset_every=4, **kw
    ),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_each_rule_equals_the_unrolled_model_step_by_step(rule: str) -> None:
    stacked_tx, unrolled_tx = RULES[rule](stacked=STACKED), RULES[rule]()
    params = stacked_tree(100)
    s_state = stacked_tx.init(params)
    u_state = unrolled_tx.init(unrolled(params))
    s_update, u_update = jax.jit(stacked_tx.update), jax.jit(unrolled_tx.update)
    for step in range(10):
        grads = stacked_tree(step, spike=(2, 30.0) if step == 7 else None)
        got, s_state = s_update(grads, s_state, params)
        want, u_state = u_update(unrolled(grads), u_state, unrolled(params))
        chex.assert_trees_all_close(got, restacked(want), rtol=2e-6, atol=1e-7)
        assert_same_logs(s_state, u_state)


def test_adagc_spike_in_one_layer_clips_that_layer_only() -> None:
    # After warm-up, a spike in layer 2 of one kernel is clipped to its own
    # EMA; every other layer, of that kernel too, passes as without the spike.
    tx = clipax.adagc(warmup_steps=3, max_norm=100.0, stacked=STACKED)
    update = jax.jit(tx.update)
    state = tx.init(stacked_tree(0))
    for step in range(7):
        _, state = update(stacked_tree(step), state)
    calm, calm_state = update(stacked_tree(7), state)
    spiked, spike_state = update(stacked_tree(7, spike=(2, 30.0)), state)
    kernel, calm_kernel = (
        spiked["blocks"]["attn"]["kernel"],
        calm["blocks"]["attn"]["kernel"],
    )
    for layer in (0, 1, 3):
        np.testing.assert_array_equal(kernel[layer], calm_kernel[layer])
    thresholds = spike_state.thresholds["blocks"]["attn"]["kernel"]
    np.testing.assert_allclose(np.linalg.norm(kernel[2]), thresholds[2], rtol=1e-5)
    assert np.linalg.norm(kernel[2]) < 0.1 * 30.0 * np.linalg.norm(calm_kernel[2])
    ema = spike_state.ema["blocks"]["attn"]["kernel"]
    np.testing.assert_array_equal(
        np.delete(ema, 2), np.delete(calm_state.ema["blocks"]["attn"]["kernel"], 2)
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"depth": 2},
        {"depth": 3},
        {"prefixes": ["blocks/1", "embed"]},
        {"ord": 1},
        {"depth": 2, "ord": math.inf},
        {"key_prefix": "grads"},
    ],
    ids=str,
)
def test_group_norms_equal_the_unrolled_model(kwargs: dict) -> None:
    grads = stacked_tree(3)
    got = jax.jit(lambda g: clipax.tree.group_norms(g, stacked=STACKED, **kwargs))(
        grads
    )
    want = clipax.tree.group_norms(unrolled(grads), **kwargs)
    assert list(got) == list(want)
    chex.assert_trees_all_close(got, want, rtol=2e-6)


@pytest.mark.parametrize("axes", [None, -1])
def test_tree_clip_by_norm_equals_the_unrolled_model(axes: Any) -> None:
    grads = stacked_tree(4)
    got = clipax.tree.clip_by_norm(grads, 0.7, axes=axes, stacked=STACKED)
    want = clipax.tree.clip_by_norm(unrolled(grads), 0.7, axes=axes)
    chex.assert_trees_all_close(got, restacked(want), rtol=2e-6)


@pytest.mark.parametrize("uniform", [True, False])
def test_per_example_layer_clip_equals_the_unrolled_model(uniform: bool) -> None:
    rng = np.random.default_rng(5)
    batch = {  # the stacked axes follow the batch axis
        "blocks": jnp.asarray(rng.normal(size=(6, L, 3, 2)).astype(np.float32)),
        "head": jnp.asarray(rng.normal(size=(6, 5)).astype(np.float32)),
    }
    per_layer = {
        "blocks": [batch["blocks"][:, i] for i in range(L)],
        "head": batch["head"],
    }
    summed, clipped = clipax.tree.per_example_layer_norm_clip(
        batch, 1.0, uniform, stacked={"blocks": 1, "head": 0}
    )
    want, want_clipped = clipax.tree.per_example_layer_norm_clip(
        per_layer, 1.0, uniform
    )
    np.testing.assert_allclose(summed["blocks"], np.stack(want["blocks"]), rtol=2e-6)
    np.testing.assert_allclose(summed["head"], want["head"], rtol=2e-6)
    np.testing.assert_array_equal(clipped["blocks"], np.stack(want_clipped["blocks"]))
    assert clipped["blocks"].shape == (L,)


def test_nested_scans_two_stacked_axes() -> None:
    rng = np.random.default_rng(6)
    grads = {"w": jnp.asarray(rng.normal(size=(2, 3, 4, 5)).astype(np.float32))}
    nested = {"w": [[grads["w"][i, j] for j in range(3)] for i in range(2)]}
    tx = clipax.adagc(warmup_steps=1, stacked={"w": 2})
    state = tx.init(grads)
    u_tx = clipax.adagc(warmup_steps=1)
    u_state = u_tx.init(nested)
    for scale in (1.0, 2.0, 40.0):
        got, state = tx.update(jax.tree.map(lambda x, s=scale: s * x, grads), state)
        want, u_state = u_tx.update(
            jax.tree.map(lambda x, s=scale: s * x, nested), u_state
        )
        np.testing.assert_allclose(got["w"], np.asarray(want["w"]), rtol=2e-6)
    assert state.ema["w"].shape == (2, 3)
    assert_same_logs(state, u_state)
    assert "adagc/w/1/2/ema" in clipax.metrics(state)
    got = clipax.tree.group_norms(grads, depth=3, stacked={"w": 2})
    assert list(got) == list(clipax.tree.group_norms(nested, depth=3))


def test_a_callable_prefix_and_stacked_prefix_by_path() -> None:
    grads = stacked_tree(7)
    prefix = clipax.stacked_prefix(grads, path="^blocks/")
    assert prefix == STACKED  # one count for the whole stacked subtree
    tx = clipax.clip_by_norm(
        1.0, stacked=lambda u: clipax.stacked_prefix(u, path="^blocks/")
    )
    got, state = jax.jit(tx.update)(grads, tx.init(grads))
    want = clipax.tree.clip_by_norm(grads, 1.0, stacked=STACKED)
    chex.assert_trees_all_close(got, want)
    assert state.norms["blocks"]["mlp"].shape == (L,)


def test_compiles_once_and_the_state_keeps_its_layers() -> None:
    tx = optax.chain(clipax.adagc(warmup_steps=2, stacked=STACKED), optax.adam(1e-3))

    def step(grads: Any, state: Any) -> tuple:
        _, state = tx.update(grads, state, grads)
        return grads, state

    _, state = helpers.assert_compiles_once(
        step, stacked_tree(0), tx.init(stacked_tree(0))
    )
    # Per-layer statistics are plain arrays in the updates' own tree: the state
    # maps against the updates, and against its twin.
    grads = stacked_tree(0)
    assert jax.tree.structure(state[0].ema) == jax.tree.structure(grads)
    shapes = jax.tree.map(lambda e: e.shape, state[0].ema)
    assert shapes == {
        "blocks": {"attn": {"bias": (L,), "kernel": (L,)}, "mlp": (L,)},
        "embed": (),
        "head": (),
    }
    jax.tree.map(jnp.add, state, tx.init(grads))
    assert optax.tree.get(state, "ema")["blocks"]["mlp"].shape == (L,)


def test_migrate_state_keeps_stacked_statistics_through_orbax(tmp_path: Any) -> None:
    import orbax.checkpoint as ocp

    tx = optax.chain(clipax.adagc(warmup_steps=1, stacked=STACKED), optax.adam(1e-3))
    params = stacked_tree(0)
    state = tx.init(params)
    for step in range(3):
        _, state = tx.update(stacked_tree(step), state, params)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "ckpt")
    migrated = clipax.migrate_state(restored, tx.init(params))
    chex.assert_trees_all_equal(migrated, state)
    # Going back to optax's global clip drops the per-layer statistics.
    plain = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    back = clipax.migrate_state(restored, plain.init(params))
    chex.assert_trees_all_equal(back[1], state[1])


# Sharding: the same numbers as on one device.


def _place(tree: Any, mesh: jax.sharding.Mesh, spec_of: Callable[[Any], P]) -> Any:
    return jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, spec_of(x))), tree
    )


def _layer_split(x: jax.Array) -> P:
    return P("d") if x.ndim == 3 or (x.shape[0] == L and x.ndim == 2) else P()


def _inner_split(x: jax.Array) -> P:
    return P(None, "d") if x.ndim == 3 else P()


SHARD_RULES = ["clip_by_norm", "clip_by_norm axes=-1", "adagc", "clip_by_block_rms"]


@pytest.mark.devices(4)
@pytest.mark.parametrize("split", [_layer_split, _inner_split], ids=["layers", "inner"])
@pytest.mark.parametrize("rule", SHARD_RULES)
def test_sharded_under_jit_equals_one_device(rule: str, split: Any) -> None:
    mesh = jax.make_mesh((4,), ("d",))
    tx = RULES[rule](stacked=STACKED)
    update = jax.jit(tx.update)
    state = tx.init(stacked_tree(0))
    sharded_state = tx.init(_place(stacked_tree(0), mesh, split))
    for step in range(5):
        grads = stacked_tree(step, spike=(1, 20.0) if step == 4 else None)
        want, state = update(grads, state)
        got, sharded_state = update(_place(grads, mesh, split), sharded_state)
        chex.assert_trees_all_close(got, want, rtol=2e-6, atol=1e-7)
    assert_same_logs(sharded_state, state)


def _specs(split: Any) -> Any:
    return jax.tree.map(
        lambda s: split(jnp.zeros(s)), SHAPES, is_leaf=lambda x: isinstance(x, tuple)
    )


@pytest.mark.devices(4)
@pytest.mark.parametrize("split", [_layer_split, _inner_split], ids=["layers", "inner"])
@pytest.mark.parametrize("rule", ["clip_by_norm", "clip_by_norm axes=-1", "adagc"])
def test_shard_map_with_specs_equals_one_device(rule: str, split: Any) -> None:
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    specs = _specs(split)
    tx = RULES[rule](stacked=STACKED, specs=specs)
    one = RULES[rule](stacked=STACKED)
    state, one_state = tx.init(stacked_tree(0)), one.init(stacked_tree(0))
    # The state's per-layer entries are split as their layers are.
    layer_specs = jax.tree.map(
        lambda s: P("d") if s == P("d") else P(),
        specs,
        is_leaf=lambda x: isinstance(x, P),
    )

    def state_spec(s: Any) -> Any:
        # Per-layer statistics are trees like the updates, one entry per layer.
        like_updates = jax.tree.structure(stacked_tree(0))
        fields = {}
        for name in s._fields:
            value = getattr(s, name)
            if jax.tree.structure(value) == like_updates:
                fields[name] = layer_specs
            else:
                fields[name] = jax.tree.map(lambda _: P(), value)
        return type(s)(**fields)

    state_specs = state_spec(state)
    state = jax.tree.map(
        lambda s, x: jax.device_put(x, NamedSharding(mesh, s)),
        state_specs,
        state,
        is_leaf=lambda x: isinstance(x, P),
    )
    update = jax.jit(
        jax.shard_map(
            tx.update,
            mesh=mesh,
            in_specs=(specs, state_specs),
            out_specs=(specs, state_specs),
        )
    )
    for step in range(5):
        grads = stacked_tree(step, spike=(1, 20.0) if step == 4 else None)
        want, one_state = one.update(grads, one_state)
        got, state = update(_place(grads, mesh, split), state)
        chex.assert_trees_all_close(got, want, rtol=2e-6, atol=1e-7)
    assert_same_logs(state, one_state)


@pytest.mark.devices(4)
@pytest.mark.parametrize("split", [_layer_split, _inner_split], ids=["layers", "inner"])
def test_group_norms_in_shard_map_equal_one_device(split: Any) -> None:
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    specs = _specs(split)
    grads = stacked_tree(9)
    want = clipax.tree.group_norms(grads, depth=3, stacked=STACKED)
    fn = jax.jit(
        jax.shard_map(
            lambda g: clipax.tree.group_norms(g, depth=3, stacked=STACKED, specs=specs),
            mesh=mesh,
            in_specs=(specs,),
            out_specs=P(),
        )
    )
    got = fn(_place(grads, mesh, split))
    assert list(got) == list(want)
    chex.assert_trees_all_close(got, want, rtol=2e-6)


@pytest.mark.devices(4)
@pytest.mark.parametrize("split", [_layer_split, _inner_split], ids=["layers", "inner"])
def test_group_norms_sharded_under_jit_equal_one_device(split: Any) -> None:
    mesh = jax.make_mesh((4,), ("d",))
    grads = stacked_tree(10)
    fn = jax.jit(lambda g: clipax.tree.group_norms(g, depth=3, stacked=STACKED))
    want = fn(grads)
    got = fn(_place(grads, mesh, split))
    assert list(got) == list(want)
    chex.assert_trees_all_close(got, want, rtol=2e-6)
