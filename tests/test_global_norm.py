"""`clipax.tree.global_norm`, `clipax.tree.clip_by_global_norm` and the
`clipax.clip_by_global_norm` transformation."""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipax
from tests import helpers

ORDS = [1, 1.5, 2, 3, math.inf]


def _tree(seed: int = 0, scale: float = 1.0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "dense": {
            "w": jnp.asarray(scale * rng.normal(size=(4, 3)), jnp.float32),
            "b": jnp.asarray(scale * rng.normal(size=(3,)), jnp.float32),
        },
        "frozen": None,
        "masked": optax.MaskedNode(),
        "scalar": jnp.asarray(scale * rng.normal(), jnp.float32),
        "list": [jnp.asarray(scale * rng.normal(size=(2, 2, 2)), jnp.float32)],
    }


# global_norm


@pytest.mark.parametrize("ord", ORDS)
def test_global_norm_matches_float64_reference(ord: float) -> None:
    tree = _tree()
    got = clipax.tree.global_norm(tree, ord=ord)
    assert got.dtype == jnp.float32 and got.shape == ()
    np.testing.assert_allclose(got, helpers.ref_global_norm(tree, ord), rtol=1e-6)


@pytest.mark.parametrize("ord", ORDS)
@pytest.mark.parametrize(
    "tree", [{}, [], None, {"a": None, "b": optax.MaskedNode()}, [jnp.zeros((0, 3))]]
)
def test_empty_trees_have_norm_zero(tree: object, ord: float) -> None:
    norm = clipax.tree.global_norm(tree, ord=ord)
    chex.assert_trees_all_equal(norm, jnp.zeros((), jnp.float32))
    clipped, norm2 = clipax.tree.clip_by_global_norm(tree, 1.0, ord=ord)
    chex.assert_trees_all_equal(norm2, jnp.zeros((), jnp.float32))
    assert jax.tree.structure(clipped) == jax.tree.structure(tree)
    chex.assert_trees_all_equal(clipped, tree)


def test_none_and_masked_leaves_add_nothing_and_stay_in_place() -> None:
    tree = _tree()
    dense_only = {k: v for k, v in tree.items() if k not in ("frozen", "masked")}
    chex.assert_trees_all_close(
        clipax.tree.global_norm(tree), clipax.tree.global_norm(dense_only)
    )
    clipped, _ = clipax.tree.clip_by_global_norm(tree, 0.5)
    assert clipped["frozen"] is None
    assert isinstance(clipped["masked"], optax.MaskedNode)


def test_complex_leaves_use_magnitude() -> None:
    x = jnp.array([3.0 + 4.0j, 0.0 + 0.0j], jnp.complex64)
    assert clipax.tree.global_norm({"z": x}) == 5.0
    assert clipax.tree.global_norm({"z": x}, ord=1) == 5.0
    assert clipax.tree.global_norm({"z": x}, ord=jnp.inf) == 5.0
    clipped, _ = clipax.tree.clip_by_global_norm({"z": x}, 1.0)
    assert clipped["z"].dtype == jnp.complex64
    chex.assert_trees_all_close(clipped["z"], x / 5.0, rtol=1e-6)


# Dtypes


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_low_precision_leaves_accumulate_in_float32(dtype: jnp.dtype) -> None:
    # 1000 values of 300: squares overflow float16 (max 65504) and the norm
    # (~9487) is above optax's ~256 limit for float16.
    x = jnp.full((1000,), 300.0, dtype)
    norm = clipax.tree.global_norm(x)
    assert norm.dtype == jnp.float32
    np.testing.assert_allclose(norm, helpers.ref_global_norm(x), rtol=1e-6)
    clipped, _ = clipax.tree.clip_by_global_norm({"x": x}, 1.0)
    assert clipped["x"].dtype == dtype
    chex.assert_tree_all_finite(clipped)
    np.testing.assert_allclose(
        np.asarray(clipped["x"], np.float32), 1 / math.sqrt(1000), rtol=1e-2
    )


def test_float64_leaves_accumulate_in_float64() -> None:
    with jax.enable_x64(True):
        x64 = jnp.array([1e-8, 1.0], jnp.float64)
        x32 = jnp.array([2.0], jnp.float32)
        norm = clipax.tree.global_norm({"a": x64})
        assert norm.dtype == jnp.float64
        np.testing.assert_allclose(norm, math.sqrt(1 + 1e-16), rtol=1e-15)
        mixed = clipax.tree.global_norm({"a": x64, "b": x32})
        assert mixed.dtype == jnp.float64
        clipped, _ = clipax.tree.clip_by_global_norm({"a": x64, "b": x32}, 1.0)
        assert clipped["a"].dtype == jnp.float64
        assert clipped["b"].dtype == jnp.float32


@pytest.mark.parametrize(
    "max_norm",
    [
        2.0,
        2,
        np.float16(2.0),
        np.float64(2.0),
        jnp.asarray(2.0, jnp.bfloat16),
        jnp.asarray(2.0, jnp.float32),
        np.array(2.0),
    ],
)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_thresholds_of_any_dtype(max_norm: object, dtype: jnp.dtype) -> None:
    x = {"w": jnp.array([3.0, 4.0], dtype)}
    clipped, norm = clipax.tree.clip_by_global_norm(x, max_norm)
    assert clipped["w"].dtype == dtype
    assert norm.dtype == jnp.float32
    chex.assert_trees_all_close(
        clipped["w"].astype(jnp.float32), jnp.array([1.2, 1.6]), rtol=1e-2
    )


# The formula and its edge cases


def test_at_threshold_the_tree_is_unchanged_bit_for_bit() -> None:
    x = {"w": jnp.array([3.0, 4.0])}
    clipped, norm = clipax.tree.clip_by_global_norm(x, 5.0)
    assert norm == 5.0
    chex.assert_trees_all_equal(clipped, x)


@pytest.mark.parametrize("ord", ORDS)
@pytest.mark.parametrize("max_norm", [1e-30, 1.0, math.inf])
def test_zero_tree_is_unchanged(max_norm: float, ord: float) -> None:
    x = {"a": jnp.zeros((3, 2)), "b": jnp.zeros(4, jnp.bfloat16)}
    clipped, norm = clipax.tree.clip_by_global_norm(x, max_norm, ord=ord)
    assert norm == 0
    chex.assert_trees_all_equal(clipped, x)


def test_inf_max_norm_never_clips() -> None:
    x = _tree(scale=1e15)
    clipped, _ = clipax.tree.clip_by_global_norm(x, math.inf)
    chex.assert_trees_all_equal(clipped, x)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("ord", ORDS)
def test_non_finite_norm_makes_every_output_nan(bad: float, ord: float) -> None:
    tree = _tree()
    tree["dense"]["b"] = tree["dense"]["b"].at[1].set(bad)
    clipped, norm = clipax.tree.clip_by_global_norm(tree, 1.0, ord=ord)
    assert not jnp.isfinite(norm)
    for leaf in jax.tree.leaves(clipped):
        assert bool(jnp.all(jnp.isnan(leaf))), leaf
    assert clipped["frozen"] is None


@pytest.mark.parametrize("max_norm", [0.0, -1.0, -math.inf])
def test_traced_non_positive_threshold_gives_zeros_never_nan(max_norm: float) -> None:
    fn = jax.jit(lambda t, m: clipax.tree.clip_by_global_norm(t, m)[0])
    tree = _tree()
    chex.assert_trees_all_equal(fn(tree, max_norm), jax.tree.map(jnp.zeros_like, tree))
    zeros = jax.tree.map(jnp.zeros_like, tree)
    chex.assert_trees_all_equal(fn(zeros, max_norm), zeros)


@pytest.mark.parametrize("ord", ORDS)
@pytest.mark.parametrize("max_norm", [0.1, 1.0, 3.0, 100.0])
def test_clip_matches_tf_formula_in_float64(ord: float, max_norm: float) -> None:
    tree = _tree(seed=3)
    clipped, norm = clipax.tree.clip_by_global_norm(tree, max_norm, ord=ord)
    expected, ref_norm = helpers.ref_clip_by_global_norm(tree, max_norm, ord)
    np.testing.assert_allclose(norm, ref_norm, rtol=1e-6)
    chex.assert_trees_all_close(
        jax.tree.map(lambda x: np.asarray(x, np.float64), clipped),
        expected,
        rtol=2e-6,
        atol=1e-7,
    )
    assert clipax.tree.global_norm(clipped, ord=ord) <= max_norm * (1 + 1e-6)


# use_norm


def test_use_norm_replaces_the_computed_norm() -> None:
    x = {"w": jnp.array([3.0, 4.0])}
    clipped, norm = clipax.tree.clip_by_global_norm(x, 1.0, use_norm=10.0)
    assert norm == 10.0
    chex.assert_trees_all_close(clipped["w"], jnp.array([0.3, 0.4]))
    clipped, norm = jax.jit(
        lambda t, n: clipax.tree.clip_by_global_norm(t, 1.0, use_norm=n)
    )(x, 2.0)
    assert norm == 2.0
    chex.assert_trees_all_close(clipped["w"], jnp.array([1.5, 2.0]))


@pytest.mark.parametrize(
    ("use_norm", "error", "match"),
    [
        (jnp.ones(2), ValueError, "`use_norm`.*shape \\(2,\\)"),
        (-1.0, ValueError, "`use_norm`.*-1.0"),
        ("big", TypeError, "`use_norm`.*'big'"),
    ],
)
def test_bad_use_norm(use_norm: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        clipax.tree.clip_by_global_norm({"w": jnp.ones(2)}, 1.0, use_norm=use_norm)


# Gradients through clipping


@pytest.mark.parametrize("ord", ORDS)
@pytest.mark.parametrize("scale", [0.0, 1e-3, 1.0, 100.0])
def test_gradient_through_clipping_is_finite(ord: float, scale: float) -> None:
    tree = _tree(seed=1, scale=scale)

    def loss(t: dict, max_norm: jax.Array) -> jax.Array:
        clipped, norm = clipax.tree.clip_by_global_norm(t, max_norm, ord=ord)
        return optax.tree.norm(clipped, squared=True) + norm

    grads = jax.grad(loss, argnums=(0, 1))(tree, jnp.float32(1.0))
    chex.assert_tree_all_finite(grads)
    if scale == 0.0:  # optax gives NaN here; a zero tree is a fixed point
        assert float(grads[1]) == 0.0


@pytest.mark.parametrize("clip", ["global", "per_leaf"])
@pytest.mark.parametrize(("max_norm", "scale"), [(math.inf, 1.0), (1e30, 1e-10)])
def test_gradient_is_finite_when_nothing_is_clipped(
    clip: str, max_norm: float, scale: float
) -> None:
    # max_norm / norm is inf here, in the branch the clip does not take.
    tree = {"w": jnp.array([3.0, 4.0]) * scale, "b": jnp.array([1.0]) * scale}

    def loss(t: dict) -> jax.Array:
        if clip == "global":
            clipped = clipax.tree.clip_by_global_norm(t, max_norm)[0]
        else:
            clipped = clipax.tree.clip_by_norm(t, max_norm)
        return optax.tree.norm(clipped, squared=True)

    grads = jax.grad(loss)(tree)
    chex.assert_trees_all_close(grads, jax.tree.map(lambda x: 2 * x, tree))


@pytest.mark.parametrize("ord", [2.0, 1.5, 1.0, math.inf])
def test_jitted_norm_can_be_differentiated(ord: float) -> None:
    # The norm's custom derivative once closed over a tracer of the jit's
    # trace, which escaped when the jitted function was differentiated.
    x = {"w": jnp.array([3.0, 4.0]), "b": jnp.array([-1.0])}
    norm = functools.partial(clipax.tree.global_norm, ord=ord)
    want = jax.grad(norm)(x)
    chex.assert_trees_all_close(jax.grad(jax.jit(norm))(x), want)
    chex.assert_trees_all_close(jax.grad(jax.checkpoint(norm))(x), want)
    chex.assert_trees_all_close(jax.jacfwd(jax.jit(norm))(x), want)

    def loss(t: dict) -> jax.Array:
        clipped, _ = clipax.tree.clip_by_global_norm(t, 1.0, ord=ord)
        return jnp.sum(clipped["w"] * jnp.array([1.0, 2.0])) + 3 * clipped["b"][0]

    chex.assert_trees_all_close(jax.grad(jax.jit(loss))(x), jax.grad(loss)(x))


def test_gradient_through_global_norm_at_zero_is_zero() -> None:
    grads = jax.grad(clipax.tree.global_norm)({"w": jnp.zeros(3)})
    chex.assert_trees_all_equal(grads, {"w": jnp.zeros(3)})


# Bad arguments


@pytest.mark.parametrize(
    ("max_norm", "error", "match"),
    [
        (-1.0, ValueError, "`max_norm` must be a positive scalar.*-1.0"),
        (0.0, ValueError, "`max_norm` must be a positive scalar.*0.0"),
        (math.nan, ValueError, "`max_norm`.*nan"),
        (np.ones(3), ValueError, "`max_norm`.*shape \\(3,\\)"),
        ("1.0", TypeError, "`max_norm`.*'1.0'"),
        (None, TypeError, "`max_norm`.*None"),
        (True, TypeError, "`max_norm`.*True"),
        (1j, TypeError, "`max_norm`.*complex"),
    ],
)
def test_bad_max_norm(max_norm: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        clipax.clip_by_global_norm(max_norm)
    with pytest.raises(error, match=match):
        clipax.tree.clip_by_global_norm({"w": jnp.ones(2)}, max_norm)


@pytest.mark.parametrize("ord", [0, -1, 0.5, "fro", math.nan, True, np.ones(2)])
def test_bad_ord(ord: object) -> None:
    match = "`ord` must be 1, 2, inf, or a real number p >= 1; got"
    with pytest.raises(ValueError, match=match):
        clipax.clip_by_global_norm(1.0, ord=ord)
    with pytest.raises(ValueError, match=match):
        clipax.tree.global_norm({"w": jnp.ones(2)}, ord=ord)


@pytest.mark.parametrize(
    ("leaf", "dtype"),
    [(np.arange(3), "int64"), (jnp.arange(3), "int32"), (np.ones(2, bool), "bool")],
)
def test_integer_and_bool_leaves_are_rejected_by_path(leaf: object, dtype: str) -> None:
    tree = {"layer": [jnp.ones(2), leaf]}
    match = rf"leaf at \['layer'\]\[1\] has dtype {dtype}"
    with pytest.raises(TypeError, match=match):
        clipax.tree.global_norm(tree)
    with pytest.raises(TypeError, match=match):
        clipax.tree.clip_by_global_norm(tree, 1.0)
    with pytest.raises(TypeError, match=match):
        clipax.clip_by_global_norm(1.0).init(tree)


@pytest.mark.parametrize(
    ("leaf", "kind"), [("abc", "str"), (b"ab", "bytes"), (object(), "object")]
)
def test_non_array_leaves_are_rejected_by_path(leaf: object, kind: str) -> None:
    with pytest.raises(TypeError, match=rf"leaf at \['x'\] is a {kind}"):
        clipax.tree.global_norm({"x": leaf})


def test_inputs_are_never_modified() -> None:
    tree = {"w": np.array([3.0, 4.0], np.float32)}
    before = tree["w"].copy()
    clipax.tree.clip_by_global_norm(tree, 1.0)
    with pytest.raises(ValueError):
        clipax.tree.clip_by_global_norm(tree, -1.0)
    np.testing.assert_array_equal(tree["w"], before)


# The transformation


def test_transformation_keeps_the_pre_clip_norm_in_state() -> None:
    params = {"w": jnp.zeros(2), "frozen": None}
    tx = clipax.clip_by_global_norm(1.0)
    state = tx.init(params)
    assert isinstance(state, clipax.ClipByGlobalNormState)
    chex.assert_trees_all_equal(state.norm, jnp.zeros((), jnp.float32))
    updates, state = tx.update({"w": jnp.array([6.0, 8.0]), "frozen": None}, state)
    assert state.norm == 10.0
    assert optax.tree.get(state, "norm") == 10.0
    chex.assert_trees_all_close(updates["w"], jnp.array([0.6, 0.8]))
    assert updates["frozen"] is None


@pytest.mark.parametrize("ord", ORDS)
def test_transformation_equals_tree_function_under_jit(ord: float) -> None:
    tree = _tree(seed=4, scale=3.0)
    tx = clipax.clip_by_global_norm(2.0, ord=ord)
    updates, state = jax.jit(tx.update)(tree, tx.init(tree))
    expected, norm = clipax.tree.clip_by_global_norm(tree, 2.0, ord=ord)
    chex.assert_trees_all_close(updates, expected)
    chex.assert_trees_all_close(state.norm, norm)


def test_transformation_compiles_once() -> None:
    tx = clipax.clip_by_global_norm(1.0)
    tree = _tree()

    def step(updates: dict, state: clipax.ClipByGlobalNormState) -> tuple:
        return tx.update(updates, state)

    _, state = helpers.assert_compiles_once(step, tree, tx.init(tree))
    assert state.norm.dtype == jnp.float32


def test_transformation_state_dtype_is_stable_in_float64() -> None:
    with jax.enable_x64(True):
        params = {"w": jnp.ones(3, jnp.float64)}
        tx = clipax.clip_by_global_norm(1.0)
        state = tx.init(params)
        _, new_state = tx.update(params, state)
        chex.assert_trees_all_equal_shapes_and_dtypes(state, new_state)
        assert new_state.norm.dtype == jnp.float64
