"""Tests for clipax.adagc (AdaGC, Wang et al. 2025)."""

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
    run_updates,
    sharded_and_pmap_runs,
    state_after_compiled_steps,
)

SHAPES = {"w": (8, 3), "b": (3,), "s": ()}


def ref_adagc(
    trees: list[dict[str, np.ndarray]],
    clip_ratio: float,
    alpha: float,
    warmup: int,
    max_norm: float,
) -> list[dict[str, dict[str, float | np.ndarray]]]:
    """AdaGC in float64, step by step as the paper's equations and the authors'
    `AdaGC.clip_by_norm` (without its 1e-6) give it, with clipax's rule that a
    zero norm does not seed a leaf's EMA.

    Returns per step and leaf: the clipped leaf, its EMA and its threshold.
    """
    ema: dict[str, float] = {}
    steps = []
    for t, tree in enumerate(trees):
        norms = {
            k: float(np.linalg.norm(np.asarray(v, np.float64))) for k, v in tree.items()
        }
        out: dict[str, dict[str, float | np.ndarray]] = {}
        if t < warmup:  # GlobalGC, and the minimum of the clipped norms
            total = math.sqrt(sum(n**2 for n in norms.values()))
            h = min(1.0, max_norm / total) if total > 0 else 1.0
            for k, n in norms.items():
                if n * h > 0:
                    ema[k] = min(ema.get(k, math.inf), n * h)
                out[k] = {"x": np.asarray(tree[k], np.float64) * h, "threshold": n * h}
        else:  # h = min(1, lambda_rel * gamma / |g|); gamma = EMA of |h g|
            for k, n in norms.items():
                previous = ema.get(k, n)
                limit = clip_ratio * previous
                h = min(1.0, limit / n) if n > 0 else 1.0
                if k in ema or n > 0:
                    ema[k] = alpha * previous + (1 - alpha) * n * h
                out[k] = {"x": np.asarray(tree[k], np.float64) * h, "threshold": limit}
        for k in out:
            out[k]["ema"] = ema.get(k, math.inf)
        steps.append(out)
    return steps


def drifting_trees(steps: int = 300, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Leaves whose norms drift on their own scales, with spikes in single
    leaves at known steps and a leaf ("b") that is zero for the first steps."""
    rng = np.random.default_rng(seed)
    spikes = {("w", 40): 30.0, ("b", 90): 8.0, ("s", 150): 50.0, ("w", 151): 5.0}
    trees = []
    for t in range(steps):
        tree = {}
        for k, shape in SHAPES.items():
            scale = {"w": 2.0, "b": 0.3, "s": 0.05}[k] * (1 + 2 * math.exp(-t / 60))
            x = (
                scale
                * rng.standard_normal(shape)
                * math.exp(0.2 * rng.standard_normal())
            )
            x = x * spikes.get((k, t), 1.0)
            if k == "b" and t < 5:
                x = 0 * x
            tree[k] = np.asarray(x, np.float32)
        trees.append(tree)
    return trees


@pytest.mark.parametrize(
    ("clip_ratio", "alpha", "warmup", "max_norm"),
    [
        (1.04, 0.99, 100, 1.0),
        (1.05, 0.98, 20, 5.0),
        (1.5, 0.9, 0, 1.0),
        (2.0, 0.5, 3, math.inf),
    ],
)
def test_matches_float64_reference_over_300_steps(clip_ratio, alpha, warmup, max_norm):
    trees = drifting_trees()
    tx = clipax.adagc(
        clip_ratio=clip_ratio, alpha=alpha, warmup_steps=warmup, max_norm=max_norm
    )
    outputs, states = run_updates(tx, trees)
    ref = ref_adagc(trees, clip_ratio, alpha, warmup, max_norm)
    clipped_after_warmup = 0
    for t, (tree, out, state) in enumerate(zip(trees, outputs, states, strict=True)):
        for k in SHAPES:
            want = ref[t][k]
            np.testing.assert_allclose(out[k], want["x"], rtol=2e-5, atol=1e-7)
            np.testing.assert_allclose(state.ema[k], want["ema"], rtol=2e-5)
            np.testing.assert_allclose(
                state.thresholds[k], want["threshold"], rtol=2e-5
            )
            norm = np.linalg.norm(np.asarray(tree[k], np.float64))
            np.testing.assert_allclose(state.norms[k], norm, rtol=1e-5)
            if t >= warmup and norm > want["threshold"]:
                clipped_after_warmup += 1
        total = math.sqrt(
            sum(np.sum(np.asarray(x, np.float64) ** 2) for x in tree.values())
        )
        np.testing.assert_allclose(state.norm, total, rtol=1e-5)
        assert int(state.count) == t + 1
    assert clipped_after_warmup >= 4  # the injected spikes, at least, were clipped


def test_a_spike_in_one_leaf_changes_no_other_leaf():
    trees = drifting_trees(120, seed=3)
    spiked = [dict(tree) for tree in trees]
    spiked[60]["w"] = spiked[60]["w"] * 1000.0
    spiked[61]["w"] = np.full_like(spiked[61]["w"], np.nan)
    tx = clipax.adagc(warmup_steps=10, max_norm=100.0)
    calm, calm_states = run_updates(tx, trees)
    hit, hit_states = run_updates(tx, spiked)
    for t in range(len(trees)):
        for k in ("b", "s"):  # bit for bit: every other leaf, every step
            np.testing.assert_array_equal(hit[t][k], calm[t][k])
            np.testing.assert_array_equal(hit_states[t].ema[k], calm_states[t].ema[k])
    # The spiked leaf was clipped to its own threshold, the NaN one kept its EMA.
    np.testing.assert_allclose(
        np.linalg.norm(hit[60]["w"]), hit_states[59].ema["w"] * 1.04, rtol=1e-5
    )
    assert np.isnan(hit[61]["w"]).all()
    assert hit_states[61].ema["w"] == hit_states[60].ema["w"]
    assert int(hit_states[61].count) == int(hit_states[60].count)  # not counted


def test_nan_during_warmup_makes_every_leaf_nan_and_keeps_the_state():
    tx = clipax.adagc(warmup_steps=5)
    trees = drifting_trees(3)
    _, states = run_updates(tx, trees[:2])
    broken = dict(trees[2])
    broken["s"] = np.array(np.inf, np.float32)
    out, after = jax.jit(tx.update)(broken, states[-1])
    assert all(np.isnan(leaf).all() for leaf in jax.tree.leaves(out))
    chex.assert_trees_all_equal(after.ema, states[-1].ema)
    assert int(after.count) == 2


def test_apply_if_finite_skips_a_broken_step():
    tx = optax.apply_if_finite(clipax.adagc(warmup_steps=1), max_consecutive_errors=3)
    trees = drifting_trees(3)
    state = tx.init(trees[0])
    _, state = tx.update(trees[0], state)
    broken = dict(trees[1])
    broken["b"] = np.full(3, np.nan, np.float32)
    updates, state = tx.update(broken, state)
    assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
    assert int(state.inner_state.count) == 1


def test_a_zero_leaf_does_not_freeze_its_ema():
    tx = clipax.adagc(warmup_steps=2, clip_ratio=1.1)
    zero, one = {"a": np.zeros(2, np.float32)}, {"a": np.ones(2, np.float32)}
    outputs, states = run_updates(tx, [zero, zero, zero, one, one])
    assert math.isinf(float(states[2].ema["a"]))  # unseen while its norms are 0
    np.testing.assert_allclose(outputs[3]["a"], 1.0)  # its first norm seeds it
    np.testing.assert_allclose(states[4].ema["a"], math.sqrt(2), rtol=1e-6)


def test_compiles_once_across_warmup():
    tree = jax.tree.map(jnp.asarray, drifting_trees(1)[0])
    state = state_after_compiled_steps(clipax.adagc(warmup_steps=3), tree, calls=8)
    assert int(state.count) == 8


def test_traced_hyperparameters_under_inject_hyperparams():
    factory = optax.inject_hyperparams(clipax.adagc, static_args=("warmup_steps",))
    tx = factory(clip_ratio=1.05, alpha=0.98, max_norm=5.0, warmup_steps=20)
    trees = drifting_trees(80)
    outputs, _ = run_updates(tx, trees)
    ref = ref_adagc(trees, 1.05, 0.98, 20, 5.0)
    for out, want in zip(outputs, ref, strict=True):
        for k in SHAPES:
            np.testing.assert_allclose(out[k], want[k]["x"], rtol=2e-5, atol=1e-7)


def test_none_and_masked_leaves_stay_empty():
    tree = {"a": jnp.ones(3), "n": None, "m": optax.MaskedNode()}
    tx = clipax.adagc(warmup_steps=1)
    state = tx.init(tree)
    assert state.ema["n"] is None and isinstance(state.ema["m"], optax.MaskedNode)
    out, state = jax.jit(tx.update)(tree, state)
    assert out["n"] is None and isinstance(out["m"], optax.MaskedNode)
    assert state.thresholds["n"] is None
    np.testing.assert_allclose(state.ema["a"], 1.0, rtol=1e-6)  # clipped to max_norm


def test_all_none_tree():
    tx = clipax.adagc()
    out, state = tx.update({"n": None}, tx.init({"n": None}))
    assert out == {"n": None} and float(state.norm) == 0.0


def test_dtypes_are_kept_and_statistics_are_float32():
    tree = {"h": jnp.full((4,), 300.0, jnp.bfloat16), "f": jnp.ones(2, jnp.float16)}
    tx = clipax.adagc(warmup_steps=1, max_norm=math.inf)
    state = tx.init(tree)
    assert state.ema["h"].dtype == jnp.float32
    _, state = tx.update(tree, state)
    np.testing.assert_allclose(state.ema["h"], 600.0, rtol=1e-6)  # no bf16 overflow
    out, state = tx.update(jax.tree.map(lambda x: 3 * x, tree), state)
    chex.assert_trees_all_equal_shapes_and_dtypes(out, tree)
    np.testing.assert_allclose(out["h"].astype(np.float32), 312.0, rtol=1e-2)


def test_float64_updates_keep_float64_statistics():
    with jax.enable_x64(True):
        tree = {"a": jnp.array([1.0, 1e-4], jnp.float64)}
        tx = clipax.adagc(warmup_steps=1, max_norm=math.inf)
        _, state = jax.jit(tx.update)(tree, tx.init(tree))
        assert state.ema["a"].dtype == jnp.float64
        assert float(state.ema["a"]) == math.sqrt(1.0 + 1e-8)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"clip_ratio": 0.0}, r"`clip_ratio` must be a finite real number > 0"),
        ({"clip_ratio": math.inf}, r"`clip_ratio`.*got inf"),
        ({"alpha": 1.0}, r"`alpha` must be a real number strictly between 0 and 1"),
        ({"alpha": math.nan}, r"`alpha`.*got nan"),
        ({"warmup_steps": -1}, r"`warmup_steps` must be an int >= 0; got -1"),
        ({"warmup_steps": 2.5}, r"`warmup_steps`.*got 2.5"),
        ({"warmup_steps": 2**31}, r"`warmup_steps` must be an int <= 2147483647"),
        ({"max_norm": 0.0}, r"`max_norm` must be a positive scalar"),
        ({"axis_name": 3}, r"`axis_name` must be None"),
    ],
)
def test_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        clipax.adagc(**kwargs)


def test_arguments_are_keyword_only():
    with pytest.raises(TypeError):
        clipax.adagc(1.04)  # type: ignore[misc]


def test_init_rejects_integer_leaves():
    with pytest.raises(TypeError, match=r"`adagc`.*\['i'\].*int32"):
        clipax.adagc().init({"i": jnp.zeros(2, jnp.int32)})


def test_same_numbers_sharded_and_under_pmap():
    single, sharded, pmapped = sharded_and_pmap_runs(
        lambda **kw: clipax.adagc(warmup_steps=5, max_norm=10.0, **kw)
    )
    chex.assert_trees_all_close(sharded, single, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(pmapped, single, rtol=1e-4, atol=1e-5)


def test_traced_warmup_steps_asks_for_static_args():
    tx = optax.inject_hyperparams(clipax.adagc)(warmup_steps=3)
    with pytest.raises(TypeError, match=r"`warmup_steps` got a traced value"):
        jax.jit(tx.init)({"a": jnp.ones(2)})


def test_metrics_report_every_leaf_statistic():
    tx = optax.chain(clipax.adagc(warmup_steps=1, max_norm=math.inf), optax.sgd(0.1))
    tree = {"a": np.ones(4, np.float32), "b": np.full(2, 9.0, np.float32), "n": None}
    _, states = run_updates(tx, [tree, tree, jax.tree.map(lambda x: 3 * x, tree)])
    logged = jax.jit(clipax.metrics)(states[-1])
    inner = states[-1][0]
    for leaf in ("a", "b"):
        for stat, tree_of in (("ema", inner.ema), ("norm", inner.norms)):
            np.testing.assert_allclose(logged[f"adagc/{leaf}/{stat}"], tree_of[leaf])
        np.testing.assert_allclose(
            logged[f"adagc/{leaf}/threshold"], inner.thresholds[leaf]
        )
        assert float(logged[f"adagc/{leaf}/clipped"]) == 1.0  # 3x: clipped
    assert not any("/n/" in key for key in logged)  # None leaves stay empty
    np.testing.assert_allclose(logged["adagc/norm"], inner.norm)
    assert int(logged["adagc/count"]) == 3
