"""pmap and GSPMD (jit over NamedSharding arrays) on 8 CPU devices."""

from __future__ import annotations

import functools
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


def _grads(n_devices: int = 8) -> dict:
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.normal(size=(n_devices, 8, 4)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(n_devices, 4)), jnp.float32),
        "none": None,
    }


@pytest.fixture(scope="module")
def mesh() -> jax.sharding.Mesh:
    assert jax.device_count() == 8, "tests/conftest.py forces 8 CPU devices"
    return jax.make_mesh((2, 4), ("data", "model"))


@pytest.mark.devices(8)
def test_pmap_after_pmean_equals_one_device() -> None:
    per_device = _grads()
    one = clipax.clip_by_global_norm(0.5)
    mean = jax.tree.map(lambda g: g.mean(axis=0), per_device)
    expected, expected_state = one.update(mean, one.init(mean))

    def step(tx: Any, g: dict) -> tuple:
        g = jax.lax.pmean(g, "batch")
        return tx.update(g, tx.init(g))

    # pmap's body has no varying-axes types: a mean is not told from a shard.
    with pytest.raises(ValueError, match=r"the leaf at \['b'\].*\('batch',\)"):
        jax.pmap(functools.partial(step, one), axis_name="batch")(per_device)
    tx = clipax.clip_by_global_norm(0.5, specs=P())  # every leaf whole
    updates, state = jax.pmap(functools.partial(step, tx), axis_name="batch")(
        per_device
    )
    for i in range(8):
        chex.assert_trees_all_close(
            jax.tree.map(lambda u, i=i: u[i], updates), expected, rtol=1e-6
        )
        np.testing.assert_allclose(state.norm[i], expected_state.norm, rtol=1e-6)


SPECS = {
    "w": P("data", "model"),
    "b": P("model"),
    "r": P(),
    "v": P(None, ("data", "model")),
}


def _sharded_tree(mesh: jax.sharding.Mesh) -> tuple[dict, dict]:
    rng = np.random.default_rng(1)
    host = {
        "w": rng.normal(size=(8, 16)).astype(np.float32),
        "b": rng.normal(size=(16,)).astype(np.float32),
        "r": rng.normal(size=(3, 5)).astype(np.float32),
        "v": rng.normal(size=(2, 24)).astype(np.float32),
    }
    sharded = {
        k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in host.items()
    }
    return host, sharded


@pytest.mark.parametrize(
    "make",
    [
        lambda: clipax.clip_by_global_norm(1.0),
        lambda: clipax.clip_by_global_norm(1.0, ord=1),
        lambda: clipax.clip_by_global_norm(1.0, ord=jnp.inf),
        lambda: clipax.clip_by_norm(1.0, axes=-1),
        lambda: clipax.clip(0.5),
    ],
)
@pytest.mark.devices(8)
def test_gspmd_equals_one_device_and_keeps_shardings(
    mesh: jax.sharding.Mesh, make: object
) -> None:
    tx = make()  # type: ignore[operator]
    host, sharded = _sharded_tree(mesh)
    expected, expected_state = tx.update(host, tx.init(host))
    updates, state = jax.jit(tx.update)(sharded, tx.init(sharded))
    chex.assert_trees_all_close(updates, expected, rtol=1e-6)
    chex.assert_trees_all_close(state, expected_state, rtol=1e-6)
    for key, leaf in updates.items():
        assert leaf.sharding.is_equivalent_to(sharded[key].sharding, leaf.ndim), key


@pytest.mark.devices(8)
def test_gspmd_global_norm_gathers_nothing(mesh: jax.sharding.Mesh) -> None:
    _, sharded = _sharded_tree(mesh)
    tx = clipax.clip_by_global_norm(1.0)
    hlo = jax.jit(tx.update).lower(sharded, tx.init(sharded)).compile().as_text()
    assert "all-gather" not in hlo
    assert "all-to-all" not in hlo
    assert "collective-permute" not in hlo


@pytest.mark.devices(8)
def test_optax_chain_under_gspmd(mesh: jax.sharding.Mesh) -> None:
    host, sharded = _sharded_tree(mesh)
    tx = optax.chain(clipax.clip_by_global_norm(1.0), optax.adam(1e-3))
    expected, _ = tx.update(host, tx.init(host), host)
    updates, _ = jax.jit(tx.update)(sharded, tx.init(sharded), sharded)
    chex.assert_trees_all_close(updates, expected, rtol=1e-5, atol=1e-8)
