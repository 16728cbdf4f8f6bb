"""clipax.tree.group_norms: per-layer / per-module norms as a flat dict."""

from __future__ import annotations

import math
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


def _tree() -> dict[str, Any]:
    rng = np.random.default_rng(0)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    return {
        "embed": {"table": normal(8, 4)},
        "layers": [
            {"w": normal(8, 4), "b": normal(4)},
            {"w": normal(8, 4), "b": normal(4), "skip": None},
        ],
        "head": normal(4),
    }


@pytest.mark.parametrize("ord", [2.0, 1.0, math.inf])
def test_depth_groups_match_float64_norms(ord: float) -> None:
    tree = _tree()
    got = jax.jit(lambda t: clipax.tree.group_norms(t, depth=2, ord=ord))(tree)
    expected = {
        "embed/table/norm": tree["embed"]["table"],
        "layers/0/norm": tree["layers"][0],
        "layers/1/norm": tree["layers"][1],
        "head/norm": tree["head"],
    }
    assert sorted(got) == sorted(expected)
    for key, sub in expected.items():
        np.testing.assert_allclose(
            got[key], helpers.ref_global_norm(sub, ord), rtol=1e-6, err_msg=key
        )
    # The groups combine to the global norm.
    if ord == 2.0:
        total = math.sqrt(sum(float(v) ** 2 for v in got.values()))
        np.testing.assert_allclose(total, helpers.ref_global_norm(tree), rtol=1e-6)


def test_default_is_depth_one_with_a_key_prefix() -> None:
    tree = _tree()
    got = clipax.tree.group_norms(tree, key_prefix="grads")
    assert list(got) == ["grads/embed/norm", "grads/head/norm", "grads/layers/norm"]
    np.testing.assert_allclose(
        got["grads/layers/norm"], helpers.ref_global_norm(tree["layers"]), rtol=1e-6
    )
    assert clipax.tree.group_norms(jnp.array([3.0, 4.0])) == {"root/norm": 5.0}


def test_prefixes_take_the_longest_match_and_whole_entries() -> None:
    tree = {f"layers_{i}": {"w": jnp.full((2,), float(i))} for i in (1, 10)}
    tree["layers"] = [{"w": jnp.ones(1)} for _ in range(11)]
    got = clipax.tree.group_norms(tree, prefixes=["layers", "layers/1", "layers_1"])
    np.testing.assert_allclose(got["layers_1/norm"], math.sqrt(2), rtol=1e-6)
    np.testing.assert_allclose(got["layers/1/norm"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(got["layers/norm"], math.sqrt(10), rtol=1e-6)
    assert len(got) == 3  # layers_10 is under no prefix: left out


def test_merges_with_metrics_and_compiles_once() -> None:
    tx = optax.chain(clipax.clip_by_global_norm(1.0), optax.sgd(0.1))
    tree = jax.tree.map(jnp.asarray, _tree())

    def step(grads: Any, state: Any) -> tuple:
        _, state = tx.update(grads, state)
        logs = {**clipax.metrics(state), **clipax.tree.group_norms(grads)}
        assert len(logs) == 5 + 3
        return grads, state

    helpers.assert_compiles_once(step, tree, tx.init(tree))


@pytest.mark.devices(8)
def test_shard_map_with_specs_equals_one_device() -> None:
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    tree = {
        "a": {"w": np.ones((4, 8), np.float32) * 2},
        "b": np.arange(8.0, dtype=np.float32),
    }
    specs = {"a": P("data", "model"), "b": P()}
    expected = clipax.tree.group_norms(tree)
    full_specs = {"a": {"w": specs["a"]}, "b": specs["b"]}  # specs is a prefix
    sharded = jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, full_specs
    )
    fn = jax.jit(
        jax.shard_map(
            lambda t: clipax.tree.group_norms(t, specs=specs),
            mesh=mesh,
            in_specs=(specs,),
            out_specs=P(),
        )
    )
    got = fn(sharded)
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-6)
    gspmd = jax.jit(clipax.tree.group_norms)(sharded)
    for key in expected:
        np.testing.assert_allclose(gspmd[key], expected[key], rtol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"depth": 0}, "depth"),
        ({"depth": 1.5}, "depth"),
        ({"depth": True}, "depth"),
        ({"prefixes": "layers"}, "prefixes"),
        ({"prefixes": ["", "a"]}, "prefixes"),
        ({"prefixes": [3]}, "prefixes"),
        ({"depth": 1, "prefixes": ["a"]}, "depth"),
        ({"ord": 0.5}, "ord"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=f"`{name}`"):
        clipax.tree.group_norms(_tree(), **kwargs)


def test_two_groups_with_one_key_raise_naming_both_leaves() -> None:
    # `a/b` (one entry) and `a`/`b` (two) both write as "a/b" at depth 2.
    tree = {"a/b": jnp.array([3.0]), "a": {"b": jnp.array([4.0])}}
    with pytest.raises(ValueError, match=r"\['a'\]\['b'\] and \['a/b'\]"):
        clipax.tree.group_norms(tree, depth=2)
    # At depth 1 the groups are "a" and "a/b": told apart.
    assert clipax.tree.group_norms(tree) == {"a/norm": 4.0, "a/b/norm": 3.0}


@pytest.mark.parametrize("prefix", ["a/b", "a"])
def test_a_key_holding_the_separator_is_not_silently_left_out(prefix: str) -> None:
    # The path of `a/b` reads as under "a/b" (and "a"), its entries are not.
    tree = {"a/b": jnp.array([3.0]), "c": jnp.array([4.0])}
    with pytest.raises(ValueError, match=r"\['a/b'\].*`prefixes`"):
        clipax.tree.group_norms(tree, prefixes=[prefix])
    assert clipax.tree.group_norms(tree, prefixes=["c"]) == {"c/norm": 4.0}


@pytest.mark.devices(4)
def test_in_shard_map_every_device_takes_the_same_pass() -> None:
    # A zero layer on one device only needs the exact pass there; its
    # collectives must still meet the other devices'.
    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    tree = {"a": jnp.stack([jnp.zeros(4), jnp.ones(4)]), "b": jnp.arange(8.0)}
    specs, stacked = {"a": P("x"), "b": P("x")}, {"a": 1, "b": 0}
    want = clipax.tree.group_norms(tree, depth=2, stacked=stacked)
    fn = jax.jit(
        jax.shard_map(
            lambda t: clipax.tree.group_norms(t, depth=2, stacked=stacked, specs=specs),
            mesh=mesh,
            in_specs=(specs,),
            out_specs=P(),
        )
    )
    placed = jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
    )
    got = fn(placed)
    assert list(got) == list(want)
    chex.assert_trees_all_close(dict(got), dict(want), rtol=1e-6)


@pytest.mark.devices(4)
def test_layers_split_over_two_mesh_axes_keep_their_order() -> None:
    mesh = jax.make_mesh(
        (2, 2), ("b", "a"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
    )
    tree = {"w": jnp.stack([jnp.full(3, i + 1.0) for i in range(4)])}
    specs = {"w": P(("b", "a"))}
    fn = jax.jit(
        jax.shard_map(
            lambda t: clipax.tree.group_norms(t, depth=2, stacked=1, specs=specs),
            mesh=mesh,
            in_specs=(specs,),
            out_specs=P(),
        )
    )
    got = fn({"w": jax.device_put(tree["w"], NamedSharding(mesh, specs["w"]))})
    np.testing.assert_allclose(
        [got[f"w/{i}/norm"] for i in range(4)],
        [np.sqrt(3) * (i + 1) for i in range(4)],
        rtol=1e-6,
    )
