"""Inputs the peers take: Python numbers as leaves, and integer leaves under
value clipping whose bounds never change a value silently."""

from __future__ import annotations

import math
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipax

SCALARS = (1.0, {"k": 2.0, "none": None})
ARRAYS = (jnp.asarray(1.0), {"k": jnp.asarray(2.0), "none": None})


def test_global_norm_of_python_numbers() -> None:
    norm = clipax.tree.global_norm(SCALARS)
    np.testing.assert_allclose(norm, math.sqrt(5.0), rtol=1e-7)
    np.testing.assert_allclose(norm, optax.tree.norm(SCALARS), rtol=1e-7)
    assert clipax.tree.global_norm(3.0) == 3.0


@pytest.mark.parametrize(
    "fn",
    [
        lambda t: clipax.tree.clip_by_global_norm(t, 1.0),
        lambda t: clipax.tree.clip_by_global_norm(t, 1.0, nonfinite="zero"),
        lambda t: clipax.tree.clip_by_norm(t, 1.5),
        lambda t: clipax.tree.clip_by_value(t, -0.5, 1.5),
    ],
    ids=["global_norm", "global_norm_zero", "norm", "value"],
)
@pytest.mark.parametrize("jit", [False, True])
def test_tree_functions_take_numbers_as_0d_arrays(fn: Any, jit: bool) -> None:
    run = jax.jit(fn) if jit else fn
    got, want = run(SCALARS), fn(ARRAYS)
    chex.assert_trees_all_close(got, want)
    for leaf in jax.tree.leaves(got):
        assert (
            isinstance(leaf, jax.Array)
            and leaf.shape == ()
            and leaf.dtype == jnp.float32
        )


TRANSFORMATIONS = {
    "clip_by_global_norm": lambda: clipax.clip_by_global_norm(1.0),
    "clip_by_norm": lambda: clipax.clip_by_norm(1.5),
    "clip_by_value": lambda: clipax.clip_by_value(-0.5, 1.5),
    "clip": lambda: clipax.clip(1.5),
    "autoclip": lambda: clipax.autoclip(),
    "zclip": lambda: clipax.zclip(),
    "adaptive_grad_clip": lambda: clipax.adaptive_grad_clip(0.1),
    "clip_by_block_rms": lambda: clipax.clip_by_block_rms(0.5),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
@pytest.mark.parametrize("jit", [False, True])
def test_transformations_take_numbers_as_0d_arrays(name: str, jit: bool) -> None:
    tx = TRANSFORMATIONS[name]()
    update = jax.jit(tx.update) if jit else tx.update
    got, got_state = update(SCALARS, tx.init(SCALARS), SCALARS)
    want, want_state = tx.update(ARRAYS, tx.init(ARRAYS), ARRAYS)
    chex.assert_trees_all_close(got, want)
    chex.assert_trees_all_close(got_state, want_state)
    for leaf in jax.tree.leaves(got):
        assert isinstance(leaf, jax.Array) and leaf.shape == ()


def test_integer_python_numbers_are_integer_leaves() -> None:
    with pytest.raises(TypeError, match=r"leaf at \[0\] has dtype int32"):
        clipax.tree.global_norm((1, 2.0))
    out = clipax.tree.clip_by_value((5, 2.0), 0, 3)
    assert out[0].dtype == jnp.int32 and int(out[0]) == 3


# Integer leaves under value clipping: no bound is rounded.


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int32, jnp.uint8])
@pytest.mark.parametrize(
    ("low", "high", "bad"),
    [(-3.1, 3.1, "min_value"), (-3.0, 3.5, "max_value"), (0.5, 2, "min_value")],
)
def test_a_fractional_bound_for_an_integer_leaf_is_an_error(
    dtype: Any, low: float, high: float, bad: str
) -> None:
    tree = {"f": jnp.ones(2), "n": {"i": jnp.arange(3, dtype=dtype)}}
    match = rf"`{bad}`=.* leaf at \['n'\]\['i'\] \(dtype {np.dtype(dtype)}\) exactly"
    with pytest.raises(ValueError, match=match):
        clipax.tree.clip_by_value(tree, low, high)
    tx = clipax.clip_by_value(low, high)
    with pytest.raises(ValueError, match=match):
        jax.jit(tx.update)(tree, tx.init(tree))
    # The float leaf alone takes the same bounds.
    clipax.tree.clip_by_value(tree["f"], low, high)


def test_an_array_bound_with_one_fractional_element_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"`max_value`=.*leaf at <root>"):
        clipax.tree.clip_by_value(jnp.arange(3), -1, np.array([1.0, 2.5, 3.0]))


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.int32])
@pytest.mark.parametrize(
    ("low", "high"),
    [(-1000, 1000), (-math.inf, math.inf), (2.0, 1e9), (np.int64(-5), np.int64(300))],
)
def test_whole_and_out_of_range_bounds_clamp_exactly(
    dtype: Any, low: Any, high: Any
) -> None:
    info = np.iinfo(dtype)
    values = np.array([info.min, info.min + 1, 0, 2, 5, info.max], dtype=dtype)
    out = clipax.tree.clip_by_value(jnp.asarray(values), low, high)
    assert out.dtype == dtype
    want = np.clip(values.astype(np.float64), float(low), float(high)).astype(dtype)
    np.testing.assert_array_equal(out, want)


def test_traced_bounds_for_integer_leaves() -> None:
    x = jnp.arange(-5, 6, dtype=jnp.int8)
    fn = jax.jit(clipax.tree.clip_by_value)
    out = fn(x, jnp.int32(-300), jnp.int32(3))
    assert out.dtype == jnp.int8
    np.testing.assert_array_equal(out, np.clip(np.arange(-5, 6), -300, 3))
    with pytest.raises(TypeError, match=r"`min_value` is a traced float32 .* int8"):
        fn(x, jnp.float32(-3.0), jnp.int32(3))
    # Float leaves take traced float bounds as before.
    np.testing.assert_array_equal(
        fn(jnp.array([-5.0, 5.0]), jnp.float32(-1.5), jnp.float32(1.5)), [-1.5, 1.5]
    )


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.int32, jnp.uint32])
@pytest.mark.parametrize(
    ("low", "high"),
    [
        (-3, 2**31),
        (-3, np.int64(2**40)),
        (-(2**40), 2**40),
        (np.int64(-(2**40)), np.uint64(2**63)),
        (-1e30, np.float64(2**31)),
    ],
)
def test_bounds_past_int32_saturate_with_x64_off(
    dtype: Any, low: Any, high: Any
) -> None:
    # With x64 off, `jnp.asarray` wraps np.int64(2**40) to 0 and refuses 2**31.
    info = np.iinfo(dtype)
    values = np.array([info.min, info.min + 1, 0, 2, 5, info.max], dtype=dtype)
    want = np.clip(values.astype(np.float64), float(low), float(high)).astype(dtype)
    out = clipax.tree.clip_by_value(jnp.asarray(values), low, high)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out, want)
    tx = clipax.clip_by_value(low, high)
    np.testing.assert_array_equal(jax.jit(tx.update)(values, tx.init(values))[0], want)


@pytest.mark.parametrize("bound", [2**31, np.int64(2**40), np.uint64(2**40)])
def test_clip_past_int32_keeps_integer_leaves(bound: Any) -> None:
    x = jnp.array([-5, 0, 5, np.iinfo(np.int32).max], jnp.int32)
    out, _ = clipax.clip(bound).update({"i": x}, None)
    np.testing.assert_array_equal(out["i"], x)


def test_whole_float_bounds_are_not_rounded_through_float32() -> None:
    # float32 holds neither 16777217 nor 2**31 - 1: the bound must stay exact.
    x = jnp.array([16777216, 16777217, 16777218, 2**31 - 1], jnp.int32)
    out = clipax.tree.clip_by_value(x, 16777217.0, 16777217.0)
    np.testing.assert_array_equal(out, [16777217] * 4)
    out = clipax.tree.clip_by_value(x, np.float64(16777217), np.float64(2**31 - 2))
    np.testing.assert_array_equal(out, [16777217, 16777217, 16777218, 2**31 - 2])
    tx = clipax.clip_by_value(-1.0, float(2**31 - 1))
    np.testing.assert_array_equal(jax.jit(tx.update)(x, tx.init(x))[0], x)


def test_int64_leaves_with_x64_saturate_exactly() -> None:
    with jax.enable_x64(True):
        info = np.iinfo(np.int64)
        x = jnp.array([info.min, 2**62 + 1, info.max], jnp.int64)
        for low, high in [(-1e19, 1e19), (-(2**63), np.uint64(2**64 - 1))]:
            np.testing.assert_array_equal(clipax.tree.clip_by_value(x, low, high), x)
        out = clipax.tree.clip_by_value(x, -math.inf, 2.0**62)
        np.testing.assert_array_equal(out, [info.min, 2**62, 2**62])
