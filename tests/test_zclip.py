"""Tests for clipax.zclip (ZClip, Kumar et al. 2025)."""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipax
from tests.helpers import (
    assert_compiles_once,
    ref_global_norm,
    run_updates,
    sharded_and_pmap_runs,
    spike_norms,
    tree_with_norm,
)


def ref_zclip(
    norms: np.ndarray, alpha: float, z_threshold: float, warmup: int, mode: str
) -> dict[str, np.ndarray]:
    """ZClip in float64, step by step as the authors' `ZClip.step` does.

    Returns per step: the clipped norm, the mean and variance after the step.
    """
    warm: list[float] = []
    mean = var = math.nan
    out: dict[str, list[float]] = {"clipped": [], "mean": [], "variance": []}
    for g in norms:
        if len(warm) < warmup:
            warm.append(g)
            if len(warm) == warmup:
                mean = float(np.mean(warm))
                var = float(np.mean((np.array(warm) - mean) ** 2))
            clipped = g
        else:
            std = math.sqrt(var)
            z = (g - mean) / (std + 1e-6)
            clipped = g
            if z > z_threshold:
                factor = z_threshold**2 / z if mode == "adaptive" else z_threshold
                clipped = mean + factor * std
            mean = alpha * mean + (1 - alpha) * clipped
            var = alpha * var + (1 - alpha) * (clipped - mean) ** 2
        out["clipped"].append(clipped)
        out["mean"].append(mean)
        out["variance"].append(var)
    return {k: np.array(v) for k, v in out.items()}


@pytest.mark.parametrize("mode", ["adaptive", "std"])
@pytest.mark.parametrize("warmup_steps", [1, 5, 25])
@pytest.mark.parametrize(("alpha", "z_threshold"), [(0.97, 2.5), (0.9, 2.0)])
def test_matches_reference_over_a_spike(mode, warmup_steps, alpha, z_threshold):
    norms = spike_norms()
    trees = [tree_with_norm(n) for n in norms]
    tx = clipax.zclip(
        alpha=alpha, z_threshold=z_threshold, warmup_steps=warmup_steps, mode=mode
    )
    outputs, states = run_updates(tx, trees)
    ref = ref_zclip(norms, alpha, z_threshold, warmup_steps, mode)
    for t, (tree, out, state) in enumerate(zip(trees, outputs, states, strict=True)):
        np.testing.assert_allclose(ref_global_norm(out), ref["clipped"][t], rtol=2e-5)
        scale = ref["clipped"][t] / norms[t]
        want = jax.tree.map(lambda x, s=scale: np.asarray(x, np.float64) * s, tree)
        chex.assert_trees_all_close(out, want, rtol=2e-5, atol=1e-7)
        np.testing.assert_allclose(state.norm, norms[t], rtol=1e-5)
        assert int(state.count) == t + 1
        if t + 1 >= warmup_steps:
            np.testing.assert_allclose(state.mean, ref["mean"][t], rtol=2e-5)
            np.testing.assert_allclose(state.variance, ref["variance"][t], rtol=1e-4)
        assert out["none"] is None
    # The spike is clipped, and to below mean + z * std in adaptive mode.
    spike = int(np.argmax(norms))
    before = states[spike - 1]
    limit = float(before.mean + z_threshold * jnp.sqrt(before.variance))
    if mode == "adaptive":
        assert ref_global_norm(outputs[spike]) < limit
    else:
        np.testing.assert_allclose(ref_global_norm(outputs[spike]), limit, rtol=1e-5)
    np.testing.assert_allclose(
        states[spike].threshold, ref["clipped"][spike], rtol=2e-5
    )


def test_warmup_passes_updates_unchanged_and_starts_the_statistics():
    norms = [1.0, 3.0, 1.0, 3.0]
    trees = [tree_with_norm(n) for n in norms]
    outputs, states = run_updates(clipax.zclip(warmup_steps=4), trees)
    for tree, out, state in zip(trees, outputs, states, strict=True):
        chex.assert_trees_all_equal(out, tree)
        assert float(state.threshold) == math.inf
    np.testing.assert_allclose(states[-1].warmup_norms, norms, rtol=1e-6)
    np.testing.assert_allclose(states[-1].mean, 2.0, rtol=1e-6)
    np.testing.assert_allclose(states[-1].variance, 1.0, rtol=1e-6)  # population


def test_threshold_when_not_clipped_is_the_z_score_limit():
    norms = [1.0, 3.0, 2.5]
    _, states = run_updates(
        clipax.zclip(warmup_steps=2), [tree_with_norm(n) for n in norms]
    )
    np.testing.assert_allclose(states[-1].threshold, 2.0 + 2.5 * (1.0 + 1e-6))


def test_zero_variance_clips_to_the_mean_without_nan():
    norms = [2.0, 2.0, 2.0, 2.0, 7.0]
    outputs, states = run_updates(
        clipax.zclip(warmup_steps=3), [tree_with_norm(n) for n in norms]
    )
    np.testing.assert_allclose(ref_global_norm(outputs[3]), 2.0, rtol=1e-6)  # z = 0
    np.testing.assert_allclose(ref_global_norm(outputs[4]), 2.0, rtol=1e-6)
    for state in states:
        chex.assert_tree_all_finite((state.mean, state.variance))


def test_clipping_keeps_the_direction():
    norms = [1.0, 1.2, 0.9, 50.0]
    trees = [tree_with_norm(n) for n in norms]
    outputs, _ = run_updates(clipax.zclip(warmup_steps=3), trees)
    ratio = outputs[-1]["w"] / trees[-1]["w"]
    np.testing.assert_allclose(ratio, ratio[0, 0], rtol=1e-5)
    assert 0 < ratio[0, 0] < 0.1


def test_non_finite_norm_skips_the_statistics_and_gives_nan():
    tx = clipax.zclip(warmup_steps=2)
    update = jax.jit(tx.update)
    for steps_before in (1, 3):  # inside and after warmup
        state = tx.init(tree_with_norm(1.0))
        for n in [1.0, 2.0, 1.5][:steps_before]:
            _, state = update(tree_with_norm(n), state)
        for bad in (math.nan, math.inf):
            tree = tree_with_norm(1.0)
            tree["w"][1, 1] = bad
            out, after = update(tree, state)
            assert all(np.isnan(leaf).all() for leaf in jax.tree.leaves(out))
            for name in ("mean", "variance", "count", "threshold", "warmup_norms"):
                chex.assert_trees_all_equal(getattr(after, name), getattr(state, name))


def test_apply_if_finite_skips_a_broken_step():
    tx = optax.apply_if_finite(clipax.zclip(warmup_steps=1), max_consecutive_errors=3)
    state = tx.init(tree_with_norm(1.0))
    _, state = tx.update(tree_with_norm(1.0), state)
    tree = tree_with_norm(1.0)
    tree["b"][0] = math.inf
    updates, state = tx.update(tree, state)
    assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
    assert int(state.inner_state.count) == 1


@pytest.mark.parametrize("mode", ["adaptive", "std"])
def test_compiles_once_across_warmup(mode):
    tx = clipax.zclip(warmup_steps=3, mode=mode)
    tree = jax.tree.map(jnp.asarray, tree_with_norm(2.0))

    def step(grads, state):
        updates, state = tx.update(grads, state)
        return jax.tree.map(lambda u: 1.5 * u, updates), state

    _, state = assert_compiles_once(step, tree, tx.init(tree), calls=8)
    assert int(state.count) == 8


def test_traced_hyperparameters_under_inject_hyperparams():
    factory = optax.inject_hyperparams(
        clipax.zclip, static_args=("warmup_steps", "mode")
    )
    tx = factory(alpha=0.9, z_threshold=2.0, warmup_steps=3)
    norms = spike_norms()[:60]
    outputs, _ = run_updates(tx, [tree_with_norm(n) for n in norms])
    ref = ref_zclip(norms, 0.9, 2.0, 3, "adaptive")
    np.testing.assert_allclose(
        [ref_global_norm(o) for o in outputs], ref["clipped"], rtol=2e-5
    )


def test_dtypes_are_kept_and_statistics_are_float32():
    tree = {"h": jnp.full((4,), 300.0, jnp.bfloat16), "m": optax.MaskedNode()}
    tx = clipax.zclip(warmup_steps=1)
    state = tx.init(tree)
    assert state.mean.dtype == jnp.float32 and state.warmup_norms.shape == (1,)
    _, state = tx.update(tree, state)
    np.testing.assert_allclose(state.mean, 600.0, rtol=1e-6)  # no bf16 overflow
    out, state = tx.update(jax.tree.map(lambda x: 2 * x, tree), state)
    chex.assert_trees_all_equal_shapes_and_dtypes(out, tree)
    assert isinstance(out["m"], optax.MaskedNode)
    np.testing.assert_allclose(out["h"].astype(np.float32), 300.0, rtol=1e-2)


def test_init_rejects_integer_leaves():
    with pytest.raises(TypeError, match=r"\['i'\].*int32"):
        clipax.zclip().init({"i": jnp.zeros(2, jnp.int32)})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"alpha": 0.0}, r"`alpha` must be a real number strictly between 0 and 1"),
        ({"alpha": 1.0}, r"`alpha`.*got 1.0"),
        ({"alpha": math.nan}, r"`alpha`.*got nan"),
        ({"z_threshold": 0.0}, r"`z_threshold` must be a finite real number > 0"),
        ({"z_threshold": -2.5}, r"`z_threshold`.*got -2.5"),
        ({"z_threshold": math.inf}, r"`z_threshold`.*got inf"),
        ({"warmup_steps": 0}, r"`warmup_steps` must be an int >= 1; got 0"),
        ({"warmup_steps": 2.5}, r"`warmup_steps`.*got 2.5"),
        ({"warmup_steps": 2**31}, r"`warmup_steps` must be an int <= 2147483647"),
        ({"mode": "zscore"}, r'`mode` must be "adaptive" or "std"; got \'zscore\''),
    ],
)
def test_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        clipax.zclip(**kwargs)


def test_arguments_are_keyword_only():
    with pytest.raises(TypeError):
        clipax.zclip(0.97)  # type: ignore[misc]


@pytest.mark.parametrize("mode", ["adaptive", "std"])
def test_same_numbers_sharded_and_under_pmap(mode):
    single, sharded, pmapped = sharded_and_pmap_runs(
        lambda: clipax.zclip(warmup_steps=5, mode=mode)
    )
    chex.assert_trees_all_close(sharded, single, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(pmapped, single, rtol=1e-4, atol=1e-5)


def test_float64_updates_keep_float64_statistics():
    with jax.enable_x64(True):
        tree = {"a": jnp.array([1.0, 1e-4], jnp.float64)}
        tx = clipax.zclip(warmup_steps=1)
        _, state = jax.jit(tx.update)(tree, tx.init(tree))
        assert state.mean.dtype == jnp.float64
        assert float(state.mean) == math.sqrt(1.0 + 1e-8)


def test_traced_warmup_steps_asks_for_static_args():
    tx = optax.inject_hyperparams(clipax.zclip)(warmup_steps=3)
    with pytest.raises(TypeError, match=r"`warmup_steps` got a traced value"):
        jax.jit(tx.init)(tree_with_norm(1.0))
