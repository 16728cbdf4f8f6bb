"""Tests for clipax.autoclip (AutoClip, Seetharaman et al. 2020)."""

from __future__ import annotations

import math

import chex
import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipax
from clipax._adaptive import masked_percentile
from tests.helpers import (
    assert_compiles_once,
    ref_global_norm,
    run_updates,
    sharded_and_pmap_runs,
    spike_norms,
    tree_with_norm,
)


def ref_autoclip(norms: np.ndarray, percentile: float, history: int) -> np.ndarray:
    """The threshold of each step: numpy.percentile of the last `history` norms."""
    return np.array(
        [
            np.percentile(norms[max(0, t + 1 - history) : t + 1], percentile)
            for t in range(len(norms))
        ]
    )


@pytest.mark.parametrize("length", [1, 2, 5, 16])
@pytest.mark.parametrize("q", [0.0, 10.0, 25.0, 33.3, 50.0, 87.5, 99.9, 100.0])
def test_masked_percentile_equals_numpy_for_every_count(length, q):
    rng = np.random.default_rng(length)
    values = rng.exponential(size=length).astype(np.float32)
    values[-1] = values[0]  # a tie
    percentile = jax.jit(masked_percentile)
    for n in range(1, length + 1):
        got = percentile(jnp.asarray(values), jnp.int32(n), q)
        want = np.percentile(values[:n].astype(np.float64), q)
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"n={n}")


@hypothesis.given(
    values=hnp.arrays(
        np.float32,
        st.integers(1, 40),
        elements=st.floats(0, 1e6, width=32, allow_subnormal=False),  # XLA: FTZ
    ),
    data=st.data(),
    q=st.floats(0, 100),
)
def test_masked_percentile_property(values, data, q):
    n = data.draw(st.integers(1, len(values)))
    got = _jit_percentile(jnp.asarray(values), jnp.int32(n), jnp.float32(q))
    want = np.percentile(values[:n].astype(np.float64), q)
    # float32 rank: an error of ~1e-7 of a gap between neighbours.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(values.max()))


_jit_percentile = jax.jit(masked_percentile)


@pytest.mark.parametrize("history", [1, 7, 30, 1000])
@pytest.mark.parametrize("percentile", [0.0, 10.0, 50.0, 90.0, 100.0])
def test_matches_numpy_reference_over_a_spike(history, percentile):
    norms = spike_norms()  # 90 steps: counts below and above `history`
    trees = [tree_with_norm(n) for n in norms]
    outputs, states = run_updates(clipax.autoclip(percentile, history=history), trees)
    thresholds = ref_autoclip(norms, percentile, history)
    for t, (tree, out, state) in enumerate(zip(trees, outputs, states, strict=True)):
        np.testing.assert_allclose(state.threshold, thresholds[t], rtol=1e-5)
        np.testing.assert_allclose(state.norm, norms[t], rtol=1e-5)
        assert int(state.count) == t + 1
        scale = thresholds[t] / max(norms[t], thresholds[t])
        want = jax.tree.map(lambda x, s=scale: np.asarray(x, np.float64) * s, tree)
        chex.assert_trees_all_close(out, want, rtol=1e-5, atol=1e-7)
        assert out["none"] is None
    # The spike is cut to the percentile of its window, not passed through.
    spike = int(np.argmax(norms))
    if history >= 7 and percentile <= 50:
        assert float(states[spike].threshold) < norms[spike] / 2


def test_ring_buffer_keeps_only_the_last_history_norms():
    norms = [1.0, 2.0, 3.0, 4.0, 5.0]
    _, states = run_updates(
        clipax.autoclip(0.0, history=3), [tree_with_norm(n) for n in norms]
    )
    np.testing.assert_allclose(states[-1].buffer, [4.0, 5.0, 3.0], rtol=1e-6)
    np.testing.assert_allclose(states[-1].threshold, 3.0, rtol=1e-6)
    assert states[-1].buffer.shape == (3,)


def test_first_step_is_not_clipped():
    tree = tree_with_norm(123.0)
    out, state = clipax.autoclip().update(tree, clipax.autoclip().init(tree))
    chex.assert_trees_all_close(out, tree, rtol=1e-6)
    np.testing.assert_allclose(state.threshold, 123.0, rtol=1e-6)


@pytest.mark.parametrize("ord", [1, 3.5, math.inf])
def test_ord_sets_the_norm_used(ord):
    rng = np.random.default_rng(3)
    trees = [{"a": rng.standard_normal((4,)).astype(np.float32) * s} for s in (1, 5, 2)]
    norms = np.array([ref_global_norm(t, ord) for t in trees])
    _, states = run_updates(clipax.autoclip(50.0, history=10, ord=ord), trees)
    np.testing.assert_allclose([s.norm for s in states], norms, rtol=1e-5)
    np.testing.assert_allclose(
        states[-1].threshold, np.percentile(norms, 50.0), rtol=1e-5
    )


def test_clipped_norm_is_at_most_the_threshold():
    norms = spike_norms(seed=1)
    outputs, states = run_updates(
        clipax.autoclip(10.0, history=20), [tree_with_norm(n) for n in norms]
    )
    for out, state in zip(outputs, states, strict=True):
        assert ref_global_norm(out) <= float(state.threshold) * (1 + 1e-5)


def test_non_finite_norm_skips_the_statistics_and_gives_nan():
    tx = clipax.autoclip(50.0, history=4)
    update = jax.jit(tx.update)
    state = tx.init(tree_with_norm(1.0))
    for n in (1.0, 2.0):
        _, state = update(tree_with_norm(n), state)
    for bad in (math.nan, math.inf):
        tree = tree_with_norm(1.0)
        tree["w"][0, 0] = bad
        out, after = update(tree, state)
        assert all(np.isnan(leaf).all() for leaf in jax.tree.leaves(out))
        chex.assert_trees_all_equal(after.buffer, state.buffer)
        chex.assert_trees_all_equal(after.count, state.count)
        chex.assert_trees_all_equal(after.threshold, state.threshold)
        assert not np.isfinite(after.norm)
    # The next finite step sees the norms as if the broken one never happened.
    _, after = update(tree_with_norm(6.0), state)
    np.testing.assert_allclose(after.threshold, 2.0, rtol=1e-6)


def test_apply_if_finite_skips_a_broken_step():
    tx = optax.apply_if_finite(clipax.autoclip(), max_consecutive_errors=3)
    state = tx.init(tree_with_norm(1.0))
    _, state = tx.update(tree_with_norm(1.0), state)
    tree = tree_with_norm(1.0)
    tree["b"][0] = math.nan
    updates, state = tx.update(tree, state)
    assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
    assert int(state.inner_state.count) == 1


def test_compiles_once():
    tx = clipax.autoclip(history=5)
    tree = jax.tree.map(jnp.asarray, tree_with_norm(2.0))

    def step(grads, state):
        updates, state = tx.update(grads, state)
        return jax.tree.map(lambda u: 2 * u, updates), state

    assert_compiles_once(step, tree, tx.init(tree), calls=8)


def test_traced_percentile_under_inject_hyperparams():
    tx = optax.inject_hyperparams(clipax.autoclip, static_args=("history",))(
        percentile=50.0, history=4
    )
    norms = [3.0, 1.0, 2.0, 8.0]
    outputs, states = run_updates(tx, [tree_with_norm(n) for n in norms])
    np.testing.assert_allclose(ref_global_norm(outputs[-1]), 2.5, rtol=1e-5)
    np.testing.assert_allclose(optax.tree.get(states[-1], "threshold"), 2.5, rtol=1e-5)


def test_dtypes_are_kept_and_statistics_are_float32():
    tree = {"h": jnp.full((3,), 100.0, jnp.bfloat16), "m": optax.MaskedNode()}
    tx = clipax.autoclip(0.0)
    state = tx.init(tree)
    assert state.buffer.dtype == jnp.float32
    _, state = tx.update(tree, state)
    out, state = tx.update(jax.tree.map(lambda x: 4 * x, tree), state)
    chex.assert_trees_all_equal_shapes_and_dtypes(out, tree)
    assert isinstance(out["m"], optax.MaskedNode)
    np.testing.assert_allclose(state.norm, 400 * math.sqrt(3), rtol=1e-3)
    np.testing.assert_allclose(out["h"].astype(np.float32), 100.0, rtol=1e-2)


def test_all_none_tree():
    tree = {"a": None}
    tx = clipax.autoclip()
    out, state = tx.update(tree, tx.init(tree))
    assert out == tree
    assert float(state.norm) == 0.0 and float(state.threshold) == 0.0


def test_init_rejects_integer_leaves():
    with pytest.raises(TypeError, match=r"\['i'\].*int32"):
        clipax.autoclip().init({"i": jnp.zeros(2, jnp.int32)})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"percentile": -1.0},
            r"`percentile` must be a real number in \[0, 100\]; got -1",
        ),
        ({"percentile": 100.5}, r"`percentile`.*got 100.5"),
        ({"percentile": math.nan}, r"`percentile`.*got nan"),
        ({"percentile": np.ones(2)}, r"`percentile`"),
        ({"history": 0}, r"`history` must be an int >= 1; got 0"),
        ({"history": 2.0}, r"`history` must be an int >= 1; got 2.0"),
        ({"history": np.float32(2)}, r"`history` must be an int >= 1"),
        ({"history": np.zeros((), np.int32)}, r"`history` must be an int >= 1; got 0"),
        ({"history": True}, r"`history`.*got True"),
        ({"history": 2**31}, r"`history` must be an int <= 2147483647"),
        ({"ord": 0.5}, r"`ord` must be .*; got 0.5"),
    ],
)
def test_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        clipax.autoclip(**kwargs)


def test_rejects_non_numeric_percentile():
    with pytest.raises(TypeError, match="`percentile`"):
        clipax.autoclip("10")


def test_same_numbers_sharded_and_under_pmap():
    single, sharded, pmapped = sharded_and_pmap_runs(
        lambda **kw: clipax.autoclip(10.0, history=16, **kw)
    )
    chex.assert_trees_all_close(sharded, single, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(pmapped, single, rtol=1e-4, atol=1e-5)


def test_float64_updates_keep_float64_statistics():
    with jax.enable_x64(True):
        tree = {"a": jnp.array([1.0, 1e-4], jnp.float64)}
        tx = clipax.autoclip()
        state = tx.init(tree)
        _, state = jax.jit(tx.update)(tree, state)
        assert state.buffer.dtype == jnp.float64
        assert float(state.norm) == math.sqrt(1.0 + 1e-8)


def test_traced_history_asks_for_static_args():
    tx = optax.inject_hyperparams(clipax.autoclip)(percentile=50.0, history=4)
    state = tx.init(tree_with_norm(1.0))  # eager: history is a concrete array
    with pytest.raises(TypeError, match=r"`history` got a traced value.*static_args"):
        jax.jit(tx.update)(tree_with_norm(1.0), state)
