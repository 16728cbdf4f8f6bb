"""`clipax.tree.clip_by_norm` and the `clipax.clip_by_norm` transformation."""

from __future__ import annotations

import math
import re
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipax
from clipax import _engine
from tests import helpers


def _ref_clip_with_norms(
    x: Any, max_norm: float, axes: object
) -> tuple[np.ndarray, np.ndarray]:
    """The clipped array (complex128) and its slice norms, in float64."""
    x128 = np.asarray(x, np.complex128)
    norm = np.sqrt(np.sum(np.abs(x128) ** 2, axis=axes, keepdims=True))
    scale = np.where(norm > max_norm, max_norm / np.where(norm > 0, norm, 1), 1.0)
    return x128 * scale, norm


def _ref_clip_by_norm(x: np.ndarray, max_norm: float, axes: object) -> np.ndarray:
    return _ref_clip_with_norms(np.asarray(x, np.float64), max_norm, axes)[0].real


@pytest.mark.parametrize(
    "axes", [None, 0, 1, 2, -1, (0, 1), (1, 2), (0, 2), (-1, 0), (0, 1, 2)]
)
@pytest.mark.parametrize("max_norm", [0.5, 2.0, 50.0])
def test_matches_float64_reference(axes: object, max_norm: float) -> None:
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 4, 5)), jnp.float32)
    got = clipax.tree.clip_by_norm({"x": x}, max_norm, axes=axes)["x"]
    np_axes = tuple(axes) if isinstance(axes, tuple) else axes
    np.testing.assert_allclose(
        got, _ref_clip_by_norm(x, max_norm, np_axes), rtol=2e-6, atol=1e-7
    )


def test_each_leaf_is_clipped_on_its_own() -> None:
    tree = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.3, 0.4]), "c": None}
    out = clipax.tree.clip_by_norm(tree, 1.0)
    chex.assert_trees_all_close(out["a"], jnp.array([0.6, 0.8]))
    chex.assert_trees_all_equal(out["b"], tree["b"])
    assert out["c"] is None


def test_zero_slices_and_thresholds() -> None:
    x = jnp.array([[0.0, 0.0], [3.0, 4.0]])
    out = clipax.tree.clip_by_norm(x, 5.0, axes=1)
    chex.assert_trees_all_equal(out, x)  # at the threshold: unchanged
    out = clipax.tree.clip_by_norm(x, math.inf, axes=1)
    chex.assert_trees_all_equal(out, x)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_per_tensor_norms_are_exact_wherever_the_squares_are_normal(
    jit: bool, dtype: Any
) -> None:
    # From 2e-19 to 1.8e19 in float32 (where every square is a normal float)
    # a per-tensor norm is the float64 one, to float32 rounding; scalars too.
    values = [3e-19, 1e-10, 1.0, 1e10, 4e18]
    tree = {f"v{i}": jnp.full((3, 4), v, dtype) for i, v in enumerate(values)}
    tree["s"] = jnp.asarray(5e18, dtype)
    fn = lambda t: helpers.clip_with_norms(t, 1e-5, None)  # noqa: E731
    out, norms = (jax.jit(fn) if jit else fn)(tree)
    for key, x in tree.items():
        x64 = np.asarray(x, np.float64)
        want = np.sqrt(np.sum(x64**2))
        np.testing.assert_allclose(norms[key], want, rtol=2e-6, err_msg=key)
        scale = min(1.0, 1e-5 / want)
        rtol = 1e-2 if dtype == jnp.bfloat16 else 2e-6
        np.testing.assert_allclose(
            np.asarray(out[key], np.float64), x64 * scale, rtol=rtol, err_msg=key
        )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("axes", [None, -1])
def test_a_tensor_whose_squares_overflow_follows_the_nan_rule_alone(
    jit: bool, axes: Any
) -> None:
    # 1e20**2 overflows float32: that leaf's (or row's) norm is inf and it
    # comes out NaN, as a NaN or inf entry would; the other leaves and rows
    # are clipped as usual.
    tree = {
        "big": jnp.array([[1e20, 1.0], [3.0, 4.0]], jnp.float32),
        "ok": jnp.array([3.0, 4.0], jnp.float32),
    }
    fn = lambda t: helpers.clip_with_norms(t, 1.0, axes)  # noqa: E731
    out, norms = (jax.jit(fn) if jit else fn)(tree)
    if axes is None:
        assert np.isnan(np.asarray(out["big"])).all()
    else:
        assert np.isnan(np.asarray(out["big"][0])).all()
        np.testing.assert_allclose(out["big"][1], [0.6, 0.8], rtol=1e-6)
    assert np.isinf(norms["big"])
    np.testing.assert_allclose(out["ok"], [0.6, 0.8], rtol=1e-6)
    np.testing.assert_allclose(norms["ok"], 5.0)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("value", [1e-25, 1e-30])
def test_a_tensor_whose_squares_underflow_reads_smaller_and_passes(
    jit: bool, value: float
) -> None:
    # (1e-25)**2 underflows float32: the norm may read as less than its true
    # value (here 0; XLA may also fold a scalar's sqrt(x**2) into |x|), never
    # more, and the leaf is clipped by the norm it read: kept as it is where
    # that is at most the threshold, even if the true norm is above it.
    tree = {"tiny": jnp.full(4, value, jnp.float32), "s": jnp.float32(value)}
    fn = lambda t: helpers.clip_with_norms(t, 1e-35, None)  # noqa: E731
    out, norms = (jax.jit(fn) if jit else fn)(tree)
    for key, x in tree.items():
        true = float(np.sqrt(np.sum(np.asarray(x, np.float64) ** 2)))
        read = float(norms[key])
        assert 0 <= read <= true * (1 + 1e-6), key
        scale = 1.0 if read <= 1e-35 else 1e-35 / read
        np.testing.assert_allclose(out[key], np.asarray(x, np.float64) * scale)
    assert float(norms["tiny"]) < 2 * value  # four squares below the smallest


@pytest.mark.parametrize(
    ("value", "rule"),
    [(1e100, "exact"), (1e-100, "exact"), (1e200, "nan"), (1e-170, "smaller")],
)
def test_float64_leaves_take_float64_sums(value: float, rule: str) -> None:
    # Sums of float64 squares: exact from about 1e-154 to 1e154 (far beyond
    # float32's range), inf (the NaN rule) above, smaller below.
    with jax.enable_x64(True):
        x = jnp.full((2, 4), value, jnp.float64)
        tx = clipax.clip_by_norm(1.0)
        out, state = tx.update({"w": x}, tx.init({"w": x}))
        norm = float(state.norms["w"])
        if rule == "exact":
            np.testing.assert_allclose(norm, math.sqrt(8) * value, rtol=1e-14)
            want = np.full((2, 4), 1 / math.sqrt(8)) if value > 1 else np.asarray(x)
            np.testing.assert_allclose(out["w"], want, rtol=1e-14)
            rows = clipax.tree.clip_by_norm(x, 1.0, axes=1)
            np.testing.assert_allclose(rows, np.full((2, 4), 0.5) if value > 1 else x)
        elif rule == "nan":
            assert math.isinf(norm) and np.isnan(np.asarray(out["w"])).all()
        else:
            assert norm < math.sqrt(8) * value
            np.testing.assert_array_equal(out["w"], x)


def test_gradient_is_finite_at_zero() -> None:
    def loss(x: jax.Array) -> jax.Array:
        return jnp.sum(clipax.tree.clip_by_norm(x, 1.0, axes=1) ** 2)

    for x in (jnp.zeros((2, 3)), jnp.array([[0.0, 0.0, 0.0], [3.0, 4.0, 0.0]])):
        chex.assert_tree_all_finite(jax.grad(loss)(x))


def test_transformation_keeps_per_leaf_norms() -> None:
    params = {"a": jnp.zeros((2, 2)), "b": jnp.zeros(1), "none": None}
    tx = clipax.clip_by_norm(1.0, axes=-1)
    state = tx.init(params)
    assert isinstance(state, clipax.ClipByNormState)
    assert state.norms["none"] is None
    grads = {
        "a": jnp.array([[3.0, 4.0], [0.0, 0.5]]),
        "b": jnp.array([2.0]),
        "none": None,
    }
    updates, state = jax.jit(tx.update)(grads, state)
    chex.assert_trees_all_close(updates["a"], jnp.array([[0.6, 0.8], [0.0, 0.5]]))
    chex.assert_trees_all_close(updates["b"], jnp.array([1.0]))
    # The largest pre-clip norm of each leaf's slices, a scalar per leaf.
    chex.assert_trees_all_close(
        state.norms, {"a": jnp.array(5.0), "b": jnp.array(2.0), "none": None}
    )
    assert optax.tree.get(state, "norms")["a"] == 5.0


def test_transformation_compiles_once() -> None:
    params = {"a": jnp.ones((4, 3)), "b": jnp.ones(3)}
    tx = clipax.clip_by_norm(0.5, axes=0)
    state = tx.init(params)
    _, state2 = helpers.assert_compiles_once(tx.update, params, state)
    chex.assert_trees_all_equal_shapes_and_dtypes(state, state2)


def _small_leaves_tree(dtype: Any = jnp.float32) -> dict[str, Any]:
    """40 leaves of (3, 4), 3 of (5,), one of (2,) and one past `SMALL_LEAF`,
    an all-zero leaf among them."""
    rng = np.random.default_rng(3)
    tree: dict[str, Any] = {}
    for i in range(40):
        tree[f"w{i:02d}"] = rng.normal(size=(3, 4)) * 10.0 ** int(rng.integers(-1, 2))
    tree["w05"] = np.zeros((3, 4))
    for i in range(3):
        tree[f"b{i}"] = rng.normal(size=5)
    tree["lone"] = rng.normal(size=2)
    tree["big"] = rng.normal(size=_engine.SMALL_LEAF + 1)
    return {k: jnp.asarray(v, dtype) for k, v in tree.items()}


@pytest.mark.parametrize("axes", [None, 0, -1])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_many_small_leaves_match_float64_reference(axes: Any, jit: bool) -> None:
    tree = _small_leaves_tree()
    fn = lambda t: helpers.clip_with_norms(t, 2.0, axes)  # noqa: E731
    out, norms = (jax.jit(fn) if jit else fn)(tree)
    np_axes = None if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    for key, x in tree.items():
        x64 = np.asarray(x, np.float64)
        slice_norms = np.sqrt(np.sum(x64**2, axis=np_axes))
        np.testing.assert_allclose(
            out[key], _ref_clip_by_norm(x64, 2.0, np_axes), rtol=2e-6, atol=1e-37
        )
        np.testing.assert_allclose(norms[key], np.max(slice_norms), rtol=2e-6)


def test_gradients_are_finite_and_vmap_clips_each_example() -> None:
    tree = _small_leaves_tree()

    def loss(t: Any) -> jax.Array:
        out = clipax.tree.clip_by_norm(t, 2.0, axes=-1)
        return sum(jnp.sum(jnp.sin(x)) for x in jax.tree.leaves(out))

    chex.assert_tree_all_finite(jax.jit(jax.grad(loss))(tree))
    batch = jax.tree.map(lambda x: jnp.stack([x, x * 1e-3]), tree)
    mapped = jax.jit(jax.vmap(lambda u: clipax.tree.clip_by_norm(u, 2.0)))(batch)
    for i in range(2):
        one = clipax.tree.clip_by_norm(jax.tree.map(lambda x, i=i: x[i], batch), 2.0)
        chex.assert_trees_all_close(
            jax.tree.map(lambda x, i=i: x[i], mapped), one, rtol=1e-6, atol=1e-37
        )


@pytest.mark.parametrize(
    ("dtype", "rtol"),
    [(jnp.bfloat16, 1e-2), (jnp.float16, 2e-3), (jnp.complex64, 2e-6)],
)
def test_narrow_and_complex_leaves_match_the_reference(dtype: Any, rtol: float) -> None:
    tree = _small_leaves_tree(dtype=dtype)
    if dtype == jnp.complex64:
        tree = {k: v * (1 - 2j) for k, v in tree.items()}
    out, norms = jax.jit(lambda t: helpers.clip_with_norms(t, 2.0, -1))(tree)
    for key, x in tree.items():
        want, slice_norms = _ref_clip_with_norms(x, 2.0, -1)
        assert out[key].dtype == dtype
        np.testing.assert_allclose(
            np.asarray(out[key], np.complex128), want, rtol=rtol, atol=1e-6
        )
        np.testing.assert_allclose(norms[key], np.max(slice_norms), rtol=rtol)


_RTOL = {"float32": 2e-6, "float64": 1e-12, "bfloat16": 1e-2, "complex64": 2e-6}


@pytest.mark.parametrize("axes", [None, -1])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_norms_of_every_rank_and_dtype(axes: Any, jit: bool) -> None:
    rng = np.random.default_rng(5)
    scalar = () if axes is None else (1,)  # axes=-1 needs a dimension
    shapes = [scalar, (7,), (3, 5), (2, 3, 4), (_engine.SMALL_LEAF + 3,), (7,), (7,)]
    dtypes = ["float32", "float64", "bfloat16", "complex64"]
    with jax.enable_x64(True):
        tree: dict[str, Any] = {}
        for i, shape in enumerate(shapes):
            for dtype in dtypes:
                x = rng.normal(size=shape)
                if dtype == "complex64":
                    x = x * (0.6 - 0.8j)
                tree[f"{dtype}_{i}"] = jnp.asarray(x, dtype)
        fn = lambda t: helpers.clip_with_norms(t, 2.0, axes)  # noqa: E731
        out, norms = (jax.jit(fn) if jit else fn)(tree)
        for key, x in tree.items():
            dtype = key.split("_")[0]
            want, slice_norms = _ref_clip_with_norms(
                x, 2.0, None if axes is None else -1
            )
            assert out[key].dtype == x.dtype, key
            np.testing.assert_allclose(
                np.asarray(out[key], np.complex128),
                want,
                rtol=_RTOL[dtype],
                atol=1e-300,
                err_msg=key,
            )
            np.testing.assert_allclose(
                norms[key], np.max(slice_norms), rtol=_RTOL[dtype], err_msg=key
            )


def _leaf_writing_kernels(hlo: str, shape: str) -> list[str]:
    """The bodies of the fused computations whose result has `shape`."""
    head = r"\n(%\S+ \([^\n]*\) -> " + re.escape(shape) + r" \{.*?\n\})"
    return re.findall(head, hlo, re.S)


@pytest.mark.parametrize(
    "transform",
    [
        # Before, the exact pass's kernel that scales and squares each leaf
        # (with its range test) is one of the leaf-sized kernels seen here.
        pytest.param(
            clipax.clip_by_norm(1.0),
            marks=helpers.xla_output_since("0.10.2", helpers.UNFUSED_REDUCTIONS),
            id="clip_by_norm",
        ),
        pytest.param(clipax.clip_by_global_norm(1.0), id="clip_by_global_norm"),
    ],
)
def test_each_leaf_is_scaled_by_a_finished_clip_factor(
    transform: optax.GradientTransformation,
) -> None:
    # The clip factor's rules (over the threshold, NaN for a non-finite norm)
    # are settled in the kernel that divides; each leaf's scaling kernel only
    # reads its factor and multiplies. Selects after the divide would be fused
    # into every leaf's kernel and redone there (benchmarks/RESULTS.md).
    tree = [jnp.ones(_engine.SMALL_LEAF + k) for k in range(3)]
    hlo = jax.jit(transform.update).lower(tree, transform.init(tree)).compile()
    for k in range(3):
        shape = f"f32[{_engine.SMALL_LEAF + k}]"
        bodies = _leaf_writing_kernels(hlo.as_text(), shape)
        assert bodies, shape
        for body in bodies:
            assert " multiply(" in body
            assert not re.search(r" (?:select|compare|is-finite)\(", body), body


@pytest.mark.parametrize("value", [0.0, 1e-25])
@pytest.mark.parametrize(
    "clip",
    [
        lambda t: clipax.tree.clip_by_norm(t, 1.0),
        lambda t: clipax.tree.clip_by_norm(t, 1.0, axes=-1),
        lambda t: clipax.clip_by_block_rms(1.0).update(t, optax.EmptyState())[0],
    ],
    ids=["clip_by_norm", "axes=-1", "block_rms"],
)
def test_leaves_xla_sees_as_constants_stay_as_they_are(value: float, clip: Any) -> None:
    # Zeros from `optax.set_to_zero` (a frozen layer) or an array closed over
    # by the jitted function are constants to XLA, which folds their norms:
    # zero and underflowing leaves come back unchanged, never NaN.
    grads = {"a": jnp.ones(3), "b": jnp.ones((2, 2))}
    made = jax.jit(lambda g: clip(jax.tree.map(lambda x: jnp.full_like(x, value), g)))
    closed = jax.jit(lambda: clip({"c": jnp.full((2, 3), value, jnp.float32)}))
    for out in (made(grads), closed()):
        for leaf in jax.tree.leaves(out):
            np.testing.assert_array_equal(leaf, np.full(leaf.shape, value, np.float32))


def test_a_frozen_leaf_before_clip_by_norm_stays_zero_under_jit() -> None:
    grads = {"train": jnp.ones(3), "frozen": jnp.ones((2, 2))}
    labels = {"train": "t", "frozen": "f"}
    tx = optax.chain(
        optax.multi_transform(
            {"t": optax.identity(), "f": optax.set_to_zero()}, labels
        ),
        clipax.clip_by_norm(1.0),
    )
    out, state = jax.jit(tx.update)(grads, tx.init(grads))
    np.testing.assert_array_equal(out["frozen"], np.zeros((2, 2)))
    np.testing.assert_allclose(out["train"], np.full(3, 3**-0.5), rtol=1e-6)
    assert float(optax.tree.get(state, "norms")["frozen"]) == 0.0


@pytest.mark.parametrize("stacked", [None, {"blocks": 1, "b": 0}])
def test_the_state_before_any_step_logs_zero_norms(stacked: Any) -> None:
    # No step has been taken: every leaf's (every layer's) logged norm is 0.
    params = {"blocks": jnp.ones((3, 2, 4)), "b": jnp.ones(5)}
    state = clipax.clip_by_norm(1.0, stacked=stacked).init(params)
    norms = jax.tree.leaves(state.norms)
    assert [n.shape for n in norms] == [(), (3,) if stacked else ()]
    for n in norms:
        np.testing.assert_array_equal(n, 0.0)
    assert all(v == 0.0 for v in clipax.metrics(state).values())
    _, state = clipax.clip_by_norm(1.0, stacked=stacked).update(params, state)
    assert all(float(n.max()) > 1.0 for n in jax.tree.leaves(state.norms))
