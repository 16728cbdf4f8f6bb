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
