"""`clipax.tree.clip_by_value` and the `clip_by_value` / `clip` transformations."""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipax
from tests import helpers


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_asymmetric_bounds_keep_dtype(dtype: jnp.dtype) -> None:
    x = jnp.array([-3.0, -0.5, 0.5, 7.0], dtype)
    out = clipax.tree.clip_by_value({"x": x, "n": None}, -1.0, 2.0)
    assert out["x"].dtype == dtype and out["n"] is None
    chex.assert_trees_all_equal(out["x"], jnp.array([-1.0, -0.5, 0.5, 2.0], dtype))


def test_nan_is_kept_and_infinities_map_to_the_bounds() -> None:
    x = jnp.array([math.nan, math.inf, -math.inf, 1.5])
    out = clipax.tree.clip_by_value(x, -4.0, 4.0)
    np.testing.assert_array_equal(out, [math.nan, 4.0, -4.0, 1.5])


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int32, jnp.uint8])
def test_integer_leaves_keep_their_dtype(dtype: jnp.dtype) -> None:
    x = jnp.arange(10, dtype=dtype)
    out = clipax.tree.clip_by_value(x, 2, 8)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out, np.clip(np.arange(10), 2, 8))
    # Whole float bounds work; bounds past the dtype's range saturate (a
    # fractional bound is an error: tests/test_inputs.py).
    out = clipax.tree.clip_by_value(x, 2.0, 1e9)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out, np.clip(np.arange(10), 2, 9))


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
def test_float_bounds_at_the_edge_of_a_64_bit_leaf_s_range_saturate(dtype) -> None:
    # float(2**63 - 1) rounds up to 2.0**63, one past int64's largest value
    # (uint64's: 2.0**64); cast back, it would overflow.
    info = np.iinfo(dtype)
    edge = float(info.max)
    with jax.enable_x64(True):
        x = jnp.array([info.min, 7, info.max], dtype)
        out = clipax.tree.clip_by_value(x, float(info.min), edge)
        assert out.dtype == dtype
        np.testing.assert_array_equal(out, x)
        out = clipax.tree.clip_by_value(x, edge, edge)
        np.testing.assert_array_equal(out, np.full(3, info.max, dtype))
        out = clipax.tree.clip_by_value(x, float(info.min), float(info.min))
        np.testing.assert_array_equal(out, np.full(3, info.min, dtype))


@pytest.mark.parametrize("bound", [2**40, np.int64(2**40), np.uint64(2**40), 2**31])
def test_integer_bounds_past_int32_clamp_float_leaves(bound: object) -> None:
    # With x64 off, `jnp.asarray` wraps np.int64(2**40) to 0 and refuses 2**40.
    x = jnp.array([5e12, -5e12, 1.5, math.inf, math.nan], jnp.float32)
    b = float(bound)  # type: ignore[arg-type]
    want = np.array([b, -b, 1.5, b, math.nan], np.float32)
    np.testing.assert_array_equal(clipax.tree.clip_by_value(x, -b, bound), want)
    out, _ = jax.jit(clipax.clip(bound).update)({"w": x}, None)
    np.testing.assert_array_equal(out["w"], want)


FLOATS = [
    jnp.float16,
    jnp.bfloat16,
    jnp.float32,
    jnp.float8_e4m3fn,  # no inf: its bounds saturate to +-448
    jnp.float8_e5m2,
]


@pytest.mark.parametrize("dtype", FLOATS)
def test_bounds_past_a_float_dtype_s_range_change_no_value(dtype: jnp.dtype) -> None:
    big = float(jnp.finfo(dtype).max)
    x = jnp.array([-big, -1.0, 0.0, 1.5, big, math.nan], dtype)
    highs = [h for h in (500, 1e5, np.int64(2**40), 1e39, 2**70) if float(h) > big]
    assert highs
    for high in highs:
        for out in (
            clipax.tree.clip_by_value(x, -float(high), high),
            clipax.clip(high).update(x, None)[0],
        ):
            assert out.dtype == dtype
            np.testing.assert_array_equal(
                out.astype(jnp.float32), x.astype(jnp.float32), err_msg=str(high)
            )


@pytest.mark.parametrize("dtype", FLOATS)
def test_float8_and_narrow_leaves_are_clamped_in_their_dtype(dtype: jnp.dtype) -> None:
    x = jnp.array([-3.0, -0.5, 0.5, 7.0, math.nan], dtype)
    out = jax.jit(clipax.clip_by_value(-1.0, 2.0).update)(x, None)[0]
    assert out.dtype == dtype
    want = np.array([-1.0, -0.5, 0.5, 2.0, math.nan], np.float32)
    np.testing.assert_array_equal(out.astype(jnp.float32), want)
    if dtype != jnp.float8_e4m3fn:  # +-inf map to the bounds, or to +-inf past them
        inf = jnp.array([-math.inf, math.inf], dtype)
        np.testing.assert_array_equal(
            clipax.tree.clip_by_value(inf, -1.0, 2.0).astype(jnp.float32), [-1, 2]
        )
        out = clipax.tree.clip_by_value(inf, -1e39, 1e39).astype(jnp.float32)
        np.testing.assert_array_equal(out, [-math.inf, math.inf])


def test_array_bounds_broadcast_but_never_grow_a_leaf() -> None:
    x = jnp.zeros((2, 3))
    out = clipax.tree.clip_by_value(x, jnp.array([[2.0], [1.0]]), 100.0)
    np.testing.assert_array_equal(out, [[2.0] * 3, [1.0] * 3])
    with pytest.raises(ValueError, match=r"broadcast to the leaf at \['b'\]"):
        clipax.tree.clip_by_value({"b": jnp.zeros(3)}, jnp.zeros((2, 3)), 1.0)


def test_traced_bounds() -> None:
    fn = jax.jit(clipax.tree.clip_by_value)
    out = fn(jnp.array([-5.0, 5.0]), jnp.float32(-1.0), jnp.float32(1.0))
    np.testing.assert_array_equal(out, [-1.0, 1.0])


@pytest.mark.parametrize(
    ("low", "high", "error", "match"),
    [
        (2.0, 1.0, ValueError, "`min_value` must be <= `max_value`"),
        (np.array([0.0, 3.0]), 2.0, ValueError, "`min_value` must be <= `max_value`"),
        (math.nan, 1.0, ValueError, "`min_value` must not be NaN"),
        (0.0, math.nan, ValueError, "`max_value` must not be NaN"),
        ("a", 1.0, TypeError, "`min_value` must be"),
        (0.0, 1j, TypeError, "`max_value` must be"),
        (np.zeros(2), np.ones(3), ValueError, "must broadcast together"),
    ],
)
def test_bad_bounds(low: object, high: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        clipax.clip_by_value(low, high)
    with pytest.raises(error, match=match):
        clipax.tree.clip_by_value(jnp.ones(2), low, high)


@pytest.mark.parametrize(
    ("leaf", "dtype"),
    [(jnp.ones(2, bool), "bool"), (jnp.ones(2, jnp.complex64), "complex64")],
)
def test_unordered_leaves_are_rejected_by_path(leaf: jax.Array, dtype: str) -> None:
    with pytest.raises(TypeError, match=rf"leaf at \['z'\] has dtype {dtype}"):
        clipax.tree.clip_by_value({"z": leaf}, -1.0, 1.0)


@pytest.mark.parametrize("max_delta", [-1.0, math.nan, np.array([1.0, -1.0])])
def test_bad_max_delta(max_delta: object) -> None:
    with pytest.raises(ValueError, match="`max_delta` must be >= 0"):
        clipax.clip(max_delta)


def test_clip_is_symmetric_clip_by_value_and_matches_optax() -> None:
    grads = {"w": jnp.linspace(-3, 3, 13), "b": None}
    tx = clipax.clip(1.25)
    ours, state = jax.jit(tx.update)(grads, tx.init(grads))
    assert isinstance(state, optax.EmptyState)
    theirs, _ = optax.clip(1.25).update(grads, optax.clip(1.25).init(grads))
    chex.assert_trees_all_equal(ours, theirs)
    by_value = clipax.clip_by_value(-1.25, 1.25)
    chex.assert_trees_all_equal(ours, by_value.update(grads, by_value.init(grads))[0])


@pytest.mark.parametrize(
    "max_delta", [np.uint8(3), jnp.uint32(3), np.array([3, 3], np.uint64)]
)
def test_unsigned_max_delta_is_negated_without_wrapping(max_delta: object) -> None:
    # -np.uint8(3) wraps to 253 in NumPy (and in JAX).
    tx = clipax.clip(max_delta)
    out, _ = tx.update({"w": jnp.array([-5.0, 5.0]), "i": jnp.array([-5, 5])}, None)
    np.testing.assert_array_equal(out["w"], [-3.0, 3.0])
    np.testing.assert_array_equal(out["i"], [-3, 3])


def test_zero_max_delta_zeroes_updates() -> None:
    tx = clipax.clip(0.0)
    out, _ = tx.update({"w": jnp.array([-1.0, 2.0])}, tx.init(None))
    np.testing.assert_array_equal(out["w"], [0.0, 0.0])


def test_transformations_compile_once() -> None:
    grads = {"w": jnp.linspace(-3, 3, 7), "i": jnp.arange(4)}
    for tx in (clipax.clip(1.0), clipax.clip_by_value(-1.0, 2.0)):
        helpers.assert_compiles_once(tx.update, grads, tx.init(grads))


def test_traced_bounds_past_float8_e4m3fn_s_range_saturate() -> None:
    x = jnp.array([-448.0, -1.0, 1.5, 448.0, math.nan], jnp.float8_e4m3fn)
    out = jax.jit(clipax.tree.clip_by_value)(x, jnp.float32(-1e3), jnp.float32(1e3))
    assert out.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(out.astype(jnp.float32), x.astype(jnp.float32))
