"""What the kept norm means inside optax's wrappers (MultiSteps,
inject_hyperparams, masked, partition, apply_if_finite), and that
`optax.tree.get` / `get_all_with_path` find it there."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipax
from tests.helpers import ref_global_norm

PARAMS = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}


def grads_at(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {
        "w": (2.0 * rng.standard_normal((3, 2))).astype(np.float32),
        "b": (2.0 * rng.standard_normal(2)).astype(np.float32),
    }


def run(tx: Any, steps: int, grads: Any = grads_at) -> list[Any]:
    update = jax.jit(tx.update)
    state, states = tx.init(PARAMS), []
    for step in range(steps):
        _, state = update(grads(step), state, PARAMS)
        states.append(state)
    return states


def test_multi_steps_keeps_the_norm_of_the_accumulated_mean() -> None:
    k = 3
    tx = optax.MultiSteps(
        optax.chain(clipax.clip_by_global_norm(1.0), optax.sgd(0.1)), every_k_schedule=k
    )
    states = run(tx, 2 * k + 1)
    norms = [float(optax.tree.get(s, "norm")) for s in states]
    mean_1 = jax.tree.map(lambda *g: np.mean(g, axis=0), *map(grads_at, range(k)))
    mean_2 = jax.tree.map(
        lambda *g: np.mean(g, axis=0), *map(grads_at, range(k, 2 * k))
    )
    # Before the first k-th step, the initial 0; at each k-th step the norm of the
    # mean of the k gradients; between them, the last value.
    assert norms[: k - 1] == [0.0] * (k - 1)
    np.testing.assert_allclose(norms[k - 1], ref_global_norm(mean_1), rtol=1e-5)
    assert norms[k : 2 * k - 1] == [norms[k - 1]] * (k - 1)
    np.testing.assert_allclose(norms[2 * k - 1], ref_global_norm(mean_2), rtol=1e-5)
    assert norms[2 * k] == norms[2 * k - 1]
    assert norms[k - 1] != norms[2 * k - 1]


def test_inject_hyperparams_keeps_the_norm_in_its_inner_state() -> None:
    schedule = optax.linear_schedule(2.0, 0.5, 4)
    tx = optax.inject_hyperparams(clipax.clip_by_global_norm)(max_norm=schedule)
    states = run(tx, 4)
    for step, state in enumerate(states):
        assert isinstance(state.inner_state, clipax.ClipByGlobalNormState)
        norm = optax.tree.get(state, "norm")
        np.testing.assert_allclose(norm, ref_global_norm(grads_at(step)), rtol=1e-6)
        np.testing.assert_allclose(state.hyperparams["max_norm"], schedule(step))


def test_masked_keeps_the_norm_of_the_masked_in_leaves() -> None:
    tx = optax.masked(clipax.clip_by_global_norm(1.0), {"w": True, "b": False})
    (state,) = run(tx, 1)
    norm = optax.tree.get(state, "norm")
    np.testing.assert_allclose(norm, ref_global_norm(grads_at(0)["w"]), rtol=1e-6)


def test_partition_keeps_one_norm_per_group() -> None:
    tx = optax.partition(
        {"a": clipax.clip_by_global_norm(1.0), "b": clipax.clip_by_global_norm(2.0)},
        {"w": "a", "b": "b"},
    )
    (state,) = run(tx, 1)
    with pytest.raises(KeyError):  # two norms: `get` wants one
        optax.tree.get(state, "norm")
    found = {
        jax.tree_util.keystr(path): value
        for path, value in optax.tree.get_all_with_path(state, "norm")
    }
    assert len(found) == 2, found
    by_group = {("'a'" in path and "a") or "b": value for path, value in found.items()}
    np.testing.assert_allclose(
        by_group["a"], ref_global_norm(grads_at(0)["w"]), rtol=1e-6
    )
    np.testing.assert_allclose(
        by_group["b"], ref_global_norm(grads_at(0)["b"]), rtol=1e-6
    )


def test_apply_if_finite_keeps_the_last_finite_norm() -> None:
    tx = optax.apply_if_finite(
        optax.chain(clipax.clip_by_global_norm(1.0), optax.sgd(0.1)),
        max_consecutive_errors=5,
    )

    def grads(step: int) -> dict[str, np.ndarray]:
        g = grads_at(step)
        if step == 1:
            g["b"][0] = np.nan
        return g

    states = run(tx, 3, grads)
    norms = [float(optax.tree.get(s, "norm")) for s in states]
    np.testing.assert_allclose(norms[0], ref_global_norm(grads_at(0)), rtol=1e-6)
    # The broken step leaves the inner state as it was: the norm of step 0 and
    # no count of the non-finite update.
    assert norms[1] == norms[0]
    assert int(optax.tree.get(states[1], "nonfinite_count")) == 0
    assert int(states[1].notfinite_count) == 1
    np.testing.assert_allclose(norms[2], ref_global_norm(grads_at(2)), rtol=1e-6)
