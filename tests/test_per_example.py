"""Tests for clipax.tree.per_example_global_norm_clip and _layer_norm_clip."""

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
    UNFUSED_REDUCTIONS,
    assert_compiles_once,
    shard_rows,
    xla_output_since,
)

BATCH = 6


def per_example_tree(seed: int, batch: int = BATCH) -> dict[str, np.ndarray]:
    """Per-example gradients with examples of very different norms, one zero."""
    rng = np.random.default_rng(seed)
    scales = rng.choice([0.01, 0.3, 1.0, 20.0], size=batch)
    scales[0] = 0.0
    tree = {}
    for name, shape in (("b", ()), ("w", (3,)), ("k", (2, 4))):
        x = rng.standard_normal((batch, *shape)) * scales.reshape(
            (-1,) + (1,) * len(shape)
        )
        tree[name] = np.array(x, np.float32)
    return tree


def ref_clip_sum(tree, clips):
    """float64 loop over examples: clip each (per leaf group), then sum.

    `clips` maps a tuple of leaf names, clipped together, to their bound.
    """
    out = {name: np.zeros(x.shape[1:]) for name, x in tree.items()}
    counts = dict.fromkeys(clips, 0)
    for i in range(next(iter(tree.values())).shape[0]):
        for names, clip in clips.items():
            norm = math.sqrt(sum(np.sum(np.float64(tree[n][i]) ** 2) for n in names))
            scale = clip / norm if norm > clip else 1.0
            counts[names] += scale < 1
            for n in names:
                out[n] += np.float64(tree[n][i]) * scale
    return out, counts


@pytest.mark.parametrize("clip", [0.0, 0.5, 2.0, math.inf])
@pytest.mark.parametrize("seed", range(3))
def test_global_equals_optax_and_numpy(clip, seed):
    grads = per_example_tree(seed)
    want, want_n = optax.per_example_global_norm_clip(grads, clip)
    got, got_n = jax.jit(clipax.tree.per_example_global_norm_clip)(grads, clip)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    assert int(got_n) == int(want_n) and got_n.dtype == jnp.int32
    ref, counts = ref_clip_sum(grads, {("b", "w", "k"): clip})
    chex.assert_trees_all_close(got, ref, rtol=1e-5, atol=1e-6)
    assert int(got_n) == counts["b", "w", "k"]


@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("clip", [0.0, 0.7, 3.0, math.inf])
@pytest.mark.parametrize("seed", range(3))
def test_layer_equals_optax_and_numpy(uniform, clip, seed):
    grads = per_example_tree(seed)
    want, want_n = optax.per_example_layer_norm_clip(grads, clip, uniform)
    got, got_n = clipax.tree.per_example_layer_norm_clip(grads, clip, uniform)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_equal(got_n, want_n)
    sizes = {"b": 1, "w": 3, "k": 8}
    shares = {n: (1 / 3 if uniform else sizes[n] / 12) for n in sizes}
    ref, counts = ref_clip_sum(
        grads, {(n,): clip * math.sqrt(shares[n]) for n in sizes}
    )
    chex.assert_trees_all_close(got, ref, rtol=1e-5, atol=1e-6)
    assert {n: int(c) for n, c in got_n.items()} == {n: counts[(n,)] for n in sizes}


def test_vmap_computed_gradients_of_a_model():
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.standard_normal((5, 3)), jnp.float32),
        "b": jnp.zeros(3),
    }
    x = jnp.asarray(rng.standard_normal((16, 5)) * rng.choice([0.1, 10.0], (16, 1)))
    y = jnp.asarray(rng.integers(0, 3, 16))

    def loss(p, xi, yi):
        logits = xi @ p["w"] + p["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, yi)

    grads = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(params, x, y)
    got, n = jax.jit(clipax.tree.per_example_global_norm_clip)(grads, 1.0)
    ref, counts = ref_clip_sum(
        {k: np.asarray(v) for k, v in grads.items()}, {("w", "b"): 1.0}
    )
    chex.assert_trees_all_close(got, ref, rtol=1e-5, atol=1e-6)
    assert int(n) == counts["w", "b"] > 0


@pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="measured on XLA's CPU backend only: on an H100, XLA's GPU compiler "
    "made 1,050,624 temporary bytes here (one float32 copy of the [256, 1024] "
    "leaf); see docs/semantics.md, Per-example clipping: memory",
)
@xla_output_since("0.10.2", UNFUSED_REDUCTIONS)
def test_no_copy_of_the_per_example_gradients_is_made():
    grads = {"a": jnp.ones((256, 1024)), "b": jnp.ones((256, 32, 16))}
    size = sum(x.nbytes for x in grads.values())
    for fn in (
        lambda g: clipax.tree.per_example_global_norm_clip(g, 1.0),
        lambda g: clipax.tree.per_example_layer_norm_clip(g, 1.0),
    ):
        memory = jax.jit(fn).lower(grads).compile().memory_analysis()
        assert memory.temp_size_in_bytes < size / 16


def test_clipped_examples_have_norm_at_most_the_bound():
    grads = per_example_tree(5)
    for i in range(BATCH):  # a batch of one clips that example alone
        one = {k: v[i : i + 1] for k, v in grads.items()}
        summed, _ = clipax.tree.per_example_global_norm_clip(one, 0.5)
        norm = math.sqrt(sum(float(jnp.sum(x**2)) for x in jax.tree.leaves(summed)))
        assert norm <= 0.5 * (1 + 1e-6)
        summed, _ = clipax.tree.per_example_layer_norm_clip(one, 0.5)
        norm = math.sqrt(sum(float(jnp.sum(x**2)) for x in jax.tree.leaves(summed)))
        assert norm <= 0.5 * (1 + 1e-6)


def test_non_finite_example_makes_every_output_nan():
    grads = per_example_tree(1)
    grads["w"][2, 1] = math.nan
    summed, _ = clipax.tree.per_example_global_norm_clip(grads, 1.0)
    assert all(np.isnan(x).all() for x in jax.tree.leaves(summed))
    summed, _ = clipax.tree.per_example_layer_norm_clip(grads, 1.0)
    assert np.isnan(summed["w"]).all()
    assert np.isfinite(summed["k"]).all()  # per layer: only the broken layer


def test_dtypes_none_and_masked_leaves():
    grads = {
        "h": jnp.full((4, 3), 100.0, jnp.bfloat16),
        "n": None,
        "m": optax.MaskedNode(),
    }
    summed, n = clipax.tree.per_example_global_norm_clip(grads, 1.0)
    assert summed["h"].dtype == jnp.bfloat16 and summed["h"].shape == (3,)
    assert summed["n"] is None and isinstance(summed["m"], optax.MaskedNode)
    np.testing.assert_allclose(
        summed["h"].astype(np.float32), 4 / math.sqrt(3), rtol=1e-2
    )
    assert int(n) == 4
    summed, counts = clipax.tree.per_example_layer_norm_clip(grads, 1.0)
    assert summed["n"] is None and counts["n"] is None
    assert int(counts["h"]) == 4


def test_empty_tree():
    summed, n = clipax.tree.per_example_global_norm_clip({"a": None}, 1.0)
    assert summed == {"a": None} and int(n) == 0
    summed, counts = clipax.tree.per_example_layer_norm_clip({}, 1.0)
    assert summed == {} and counts == {}


def test_compiles_once():
    grads = jax.tree.map(jnp.asarray, per_example_tree(2))
    total = jax.tree.map(lambda x: jnp.zeros(x.shape[1:]), grads)

    def step(grads, total):
        summed, _ = clipax.tree.per_example_global_norm_clip(grads, 1.0)
        layer, _ = clipax.tree.per_example_layer_norm_clip(grads, 1.0)
        return grads, jax.tree.map(lambda t, s, y: t + s + y, total, summed, layer)

    assert_compiles_once(step, grads, total)


@pytest.mark.parametrize(
    "fn",
    [clipax.tree.per_example_global_norm_clip, clipax.tree.per_example_layer_norm_clip],
)
def test_leaves_need_one_batch_axis(fn):
    with pytest.raises(
        ValueError, match=r"batch size on axis 0 \(4, .*\['w'\] has shape \(3, 2\)"
    ):
        fn({"b": jnp.ones((4, 2)), "w": jnp.ones((3, 2))}, 1.0)
    with pytest.raises(ValueError, match=r"the leaf at \['s'\] has shape \(\)"):
        fn({"s": jnp.ones(())}, 1.0)
    with pytest.raises(TypeError, match=r"\['i'\].*int32"):
        fn({"i": jnp.ones((4, 2), jnp.int32)}, 1.0)


@pytest.mark.parametrize("clip", [-1.0, math.nan, np.ones(2)])
def test_rejects_bad_clip(clip):
    grads = per_example_tree(0)
    with pytest.raises(ValueError, match=r"`l2_norm_clip` must be a scalar >= 0"):
        clipax.tree.per_example_global_norm_clip(grads, clip)
    with pytest.raises(
        ValueError, match=r"`global_l2_norm_clip` must be a scalar >= 0"
    ):
        clipax.tree.per_example_layer_norm_clip(grads, clip)


@pytest.mark.devices(8)
def test_batch_sharded_across_devices_gives_the_same_numbers():
    grads = per_example_tree(4, batch=16)
    sharded = shard_rows(grads)
    assert len(sharded["k"].sharding.device_set) == jax.device_count() > 1
    for fn in (
        clipax.tree.per_example_global_norm_clip,
        clipax.tree.per_example_layer_norm_clip,
    ):
        want = jax.block_until_ready(jax.jit(fn)(grads, 0.8))
        got = jax.block_until_ready(jax.jit(fn)(sharded, 0.8))
        chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)
