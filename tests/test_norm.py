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
from clipax import _common, _fused, _reduce
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


@pytest.mark.parametrize("value", [0.0, 1e-30, 1e30])
def test_scalar_leaves_under_jit_take_the_exact_branch_without_nan(
    value: float,
) -> None:
    # A 0-d leaf has no reduction: XLA once folded the 2**80 scale of the exact
    # branch into its square (0 * 2**160 = NaN) under jit.
    tree = {"s": jnp.float32(value), "z": jnp.zeros((2, 3))}
    out, norms = jax.jit(
        lambda t: clipax.tree._norm.clip_by_norm_with_norms(t, 2e30, None)
    )(tree)
    chex.assert_trees_all_equal(out, tree)
    np.testing.assert_array_equal(norms["s"], np.float32(value))
    np.testing.assert_array_equal(norms["z"], 0.0)


def test_non_finite_slice_becomes_nan_others_unchanged() -> None:
    x = jnp.array([[1.0, math.inf], [3.0, 4.0]])
    out = clipax.tree.clip_by_norm(x, 1.0, axes=1)
    assert bool(jnp.all(jnp.isnan(out[0])))
    chex.assert_trees_all_close(out[1], jnp.array([0.6, 0.8]))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.complex64])
def test_dtypes_are_kept_and_accumulated_wide(dtype: jnp.dtype) -> None:
    x = jnp.full((100, 10), 300.0, dtype)
    out = clipax.tree.clip_by_norm(x, 1.0, axes=1)
    assert out.dtype == dtype
    chex.assert_tree_all_finite(out)
    expected = 1 / math.sqrt(10)
    np.testing.assert_allclose(
        np.abs(np.asarray(out, np.complex64)), expected, rtol=1e-2
    )


@pytest.mark.parametrize(
    ("tree", "axes", "match"),
    [
        (
            {"w": jnp.ones((3, 2, 2)), "b": jnp.ones(3)},
            2,
            r"`axes`=\(2,\) is out of range for the leaf at \['b'\] with shape \(3,\)",
        ),
        (
            {"w": jnp.ones((3, 2)), "x": jnp.ones((3, 2, 2))},
            -3,
            r"out of range for the leaf at \['w'\] with shape \(3, 2\)",
        ),
        (
            {"w": jnp.ones((3, 2))},
            (0, -2),
            r"names the same axis twice for the leaf at \['w'\]",
        ),
    ],
)
def test_axes_out_of_range_name_the_leaf(tree: dict, axes: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        clipax.tree.clip_by_norm(tree, 1.0, axes=axes)
    with pytest.raises(ValueError, match=match):
        clipax.clip_by_norm(1.0, axes=axes).init(tree)


@pytest.mark.parametrize("axes", [(0, 0), 1.5, "rows", (True,), [0, None]])
def test_bad_axes_fail_at_construction(axes: object) -> None:
    with pytest.raises(ValueError, match="`axes` must be None, an int, or a sequence"):
        clipax.clip_by_norm(1.0, axes=axes)


@pytest.mark.parametrize("max_norm", [0.0, -2.0, math.nan, np.ones(2)])
def test_bad_max_norm(max_norm: object) -> None:
    with pytest.raises(ValueError, match="`max_norm`"):
        clipax.clip_by_norm(max_norm)
    with pytest.raises(ValueError, match="`max_norm`"):
        clipax.tree.clip_by_norm({"w": jnp.ones(2)}, max_norm)


def test_integer_leaf_is_rejected_by_path() -> None:
    with pytest.raises(TypeError, match=r"leaf at \['i'\] has dtype int32"):
        clipax.tree.clip_by_norm({"i": jnp.arange(3)}, 1.0)


@pytest.mark.parametrize("value", [1e200, 1e300, 1e-170, 1e-300])
def test_float64_norms_are_exact_at_float64_extremes(value: float) -> None:
    # The exact pass's power of two is sized to the dtype's range: float32's
    # 2**80 would neither keep 1e200**2 finite nor lift 1e-300**2 to normal.
    with jax.enable_x64(True):
        x = jnp.full((2, 4), value, jnp.float64)
        tx = clipax.clip_by_norm(1.0)
        out, state = tx.update({"w": x}, tx.init({"w": x}))
        np.testing.assert_allclose(state.norms["w"], math.sqrt(8) * value, rtol=1e-14)
        want = np.full((2, 4), 1 / math.sqrt(8)) if value > 1 else np.asarray(x)
        np.testing.assert_allclose(out["w"], want, rtol=1e-14)
        rows = clipax.tree.clip_by_norm(x, 1.0, axes=1)
        np.testing.assert_allclose(rows, np.full((2, 4), 0.5) if value > 1 else x)


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


# Small leaves of one shape are reduced as stacks (`_reduce._stacks`). The test
# session has 8 devices, so under jit a traced leaf is stacked only where
# `can_concatenate` is made to hold, as it does with one device.


@pytest.fixture
def stack_under_jit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_fused, "can_concatenate", lambda x: True)


def _stackable_tree(extreme: bool, dtype: Any = jnp.float32) -> dict[str, Any]:
    """40 leaves of (3, 4) (two stacks), 3 of (5,), one of (2,) and one past
    `SMALL_LEAF`; with `extreme`, magnitudes from 1e-30 to 1e30 (squares that
    overflow and underflow float32) and an all-zero leaf inside a stack."""
    rng = np.random.default_rng(3)
    tree: dict[str, Any] = {}
    for i in range(40):
        exponent = int(rng.integers(-30, 31)) if extreme else int(rng.integers(-1, 2))
        tree[f"w{i:02d}"] = rng.normal(size=(3, 4)) * 10.0**exponent
    if extreme:
        tree["w05"] = np.zeros((3, 4))
    for i in range(3):
        tree[f"b{i}"] = rng.normal(size=5) * (1e25 if extreme and i == 1 else 1.0)
    tree["lone"] = rng.normal(size=2)
    tree["big"] = rng.normal(size=_fused.SMALL_LEAF + 1)
    return {k: jnp.asarray(v, dtype) for k, v in tree.items()}


def _flat_axes(tree: Any, axes: Any) -> tuple[list[jax.Array], list[tuple[int, ...]]]:
    leaves = jax.tree.leaves(tree)
    normalized = _common.normalize_axes(axes)
    return leaves, [_common.leaf_axes(normalized, (), x.shape) for x in leaves]


@pytest.mark.usefixtures("stack_under_jit")
@pytest.mark.parametrize("axes", [None, 0, -1])
@pytest.mark.parametrize("extreme", [False, True], ids=["plain", "exact-branch"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_stacked_leaves_match_float64_reference(
    axes: Any, extreme: bool, jit: bool
) -> None:
    tree = _stackable_tree(extreme)
    leaves, leaf_axes = _flat_axes(tree, axes)
    stacks = _reduce._stacks(leaves, leaf_axes, [()] * 45, [()] * 45)
    assert sorted(map(len, stacks)) == [3, 8, 32]  # (5,), then (3, 4) twice
    fn = lambda t: clipax.tree._norm.clip_by_norm_with_norms(t, 2.0, axes)  # noqa: E731
    out, norms = (jax.jit(fn) if jit else fn)(tree)
    np_axes = None if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    for key, x in tree.items():
        x64 = np.asarray(x, np.float64)
        slice_norms = np.sqrt(np.sum(x64**2, axis=np_axes))
        np.testing.assert_allclose(
            out[key], _ref_clip_by_norm(x64, 2.0, np_axes), rtol=2e-6, atol=1e-37
        )
        np.testing.assert_allclose(norms[key], np.max(slice_norms), rtol=2e-6)


@pytest.mark.usefixtures("stack_under_jit")
def test_stacked_leaves_equal_unstacked_with_gradients_and_vmap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tree = _stackable_tree(extreme=True)

    def loss(t: Any) -> jax.Array:
        out = clipax.tree.clip_by_norm(t, 2.0, axes=-1)
        return sum(jnp.sum(jnp.sin(x)) for x in jax.tree.leaves(out))

    def per_example(t: Any) -> Any:  # a batch of two trees, the cond under vmap
        return jax.vmap(lambda u: clipax.tree.clip_by_norm(u, 2.0))(t)

    batch = jax.tree.map(lambda x: jnp.stack([x, x * 1e-3]), tree)
    stacked = (jax.jit(jax.grad(loss))(tree), jax.jit(per_example)(batch))
    leaves, leaf_axes = _flat_axes(tree, -1)
    assert _reduce._stacks(leaves, leaf_axes, [()] * 45, [()] * 45)
    monkeypatch.setattr(_fused, "GROUP_LEAVES", 1)  # no stacks
    assert not _reduce._stacks(leaves, leaf_axes, [()] * 45, [()] * 45)
    alone = (jax.jit(jax.grad(loss))(tree), jax.jit(per_example)(batch))
    chex.assert_tree_all_finite(stacked[0])
    chex.assert_trees_all_close(stacked, alone, rtol=1e-6, atol=1e-37)


def test_stack_plan_keeps_to_its_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_fused, "SMALL_LEAF", 10)
    monkeypatch.setattr(_fused, "GROUP_LEAVES", 3)
    monkeypatch.setattr(_fused, "MAX_BUCKETED", 40)
    leaves = [
        jnp.ones(4),  # 0-3, 5: one stack of 3, then one of 2 (with 5)
        jnp.ones(4),
        jnp.ones(4),
        jnp.ones(4),
        jnp.ones(4, jnp.bfloat16),  # 4: its dtype alone: not stacked
        jnp.ones(4),
        jnp.ones(11),  # 6, 7: past SMALL_LEAF
        jnp.ones(11),
        jnp.ones((0, 3)),  # 8, 9: empty
        jnp.ones((0, 3)),
        jnp.ones((2, 5)),  # 10-12: stack of 3, 30 elements: past MAX_BUCKETED
        jnp.ones((2, 5)),
        jnp.ones((2, 5)),
        jnp.ones((2, 2)),  # 13, 14: one axes each: apart
        jnp.ones((2, 2)),
    ]
    axes = [tuple(range(x.ndim)) for x in leaves]
    axes[14] = (1,)
    groups: list[tuple[str, ...]] = [()] * len(leaves)
    stacks = _reduce._stacks(leaves, axes, groups, groups)
    assert stacks == [[0, 1, 2], [3, 5]]
    monkeypatch.setattr(_fused, "MAX_BUCKETED", 60)
    assert _reduce._stacks(leaves, axes, groups, groups)[2] == [10, 11, 12]
    placed = list(groups)
    placed[1] = ("data",)  # another placement: apart
    assert _reduce._stacks(leaves, axes, placed, groups)[0] == [0, 2, 3]
    monkeypatch.setattr(_fused, "can_concatenate", lambda x: x.dtype != jnp.float32)
    assert _reduce._stacks(leaves, axes, groups, groups) == []


@pytest.mark.usefixtures("stack_under_jit")
def test_stacked_norms_are_read_at_run_time_positions() -> None:
    # Each leaf's norm is read out of its stack's at a position that XLA sees
    # as a run-time value (it comes out of the range test's cond): constant
    # positions would be folded into static slices, a distinct kernel per leaf
    # that XLA's CPU backend compiles on its own (benchmarks/RESULTS.md).
    tree = [jnp.full(6, float(i)) for i in range(1, 9)]
    tx = clipax.clip_by_norm(1.0)
    hlo = jax.jit(tx.update).lower(tree, tx.init(tree)).compile().as_text()
    assert "dynamic-slice" in hlo
    assert not re.search(r"= f32\[\S*\] slice\(", hlo)


@pytest.mark.usefixtures("stack_under_jit")
@pytest.mark.parametrize(
    ("dtype", "rtol"),
    [(jnp.bfloat16, 1e-2), (jnp.float16, 2e-3), (jnp.complex64, 2e-6)],
)
def test_stacked_narrow_and_complex_leaves_in_the_exact_branch(
    dtype: Any, rtol: float
) -> None:
    # An all-zero leaf sends the whole tree through the exact branch, where a
    # narrow stack goes through a barrier with its (broadcast) scale.
    tree = _stackable_tree(extreme=False, dtype=dtype)
    tree["w07"] = jnp.zeros((3, 4), dtype)
    if dtype == jnp.complex64:
        tree = {k: v * (1 - 2j) for k, v in tree.items()}
    out, norms = jax.jit(
        lambda t: clipax.tree._norm.clip_by_norm_with_norms(t, 2.0, -1)
    )(tree)
    for key, x in tree.items():
        want, slice_norms = _ref_clip_with_norms(x, 2.0, -1)
        assert out[key].dtype == dtype
        np.testing.assert_allclose(
            np.asarray(out[key], np.complex128), want, rtol=rtol, atol=1e-6
        )
        np.testing.assert_allclose(norms[key], np.max(slice_norms), rtol=rtol)


_PACKED_RTOL = {"float32": 2e-6, "float64": 1e-12, "bfloat16": 1e-2, "complex64": 2e-6}


@pytest.mark.usefixtures("stack_under_jit")
@pytest.mark.parametrize("axes", [None, -1])
@pytest.mark.parametrize("extreme", [False, True], ids=["plain", "exact-branch"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_whole_leaf_norms_packed_across_shapes_and_dtypes(
    axes: Any, extreme: bool, jit: bool
) -> None:
    # Whole-leaf norms of every rank, lone or stacked, take their roots and
    # clip factors as one vector per accumulation dtype (float32 for
    # bfloat16 and complex64 leaves, float64 apart), each leaf's read back at
    # its own position; with axes=-1 the matrices' row norms stay per leaf.
    # The three (7,) leaves of each dtype form a stack (under jit too: see
    # `stack_under_jit`).
    rng = np.random.default_rng(5)
    scalar = () if axes is None else (1,)  # axes=-1 needs a dimension
    shapes = [scalar, (7,), (3, 5), (2, 3, 4), (_fused.SMALL_LEAF + 3,), (7,), (7,)]
    dtypes = ["float32", "float64", "bfloat16", "complex64"]
    with jax.enable_x64(True):
        tree: dict[str, Any] = {}
        for i, shape in enumerate(shapes):
            for dtype in dtypes:
                exponent = int(rng.integers(-30, 31)) if extreme else 0
                x = rng.normal(size=shape) * 10.0**exponent
                if dtype == "complex64":
                    x = x * (0.6 - 0.8j)
                tree[f"{dtype}_{i}"] = jnp.asarray(x, dtype)
        leaves, leaf_axes = _flat_axes(tree, axes)
        placed: list[tuple[str, ...]] = [()] * len(leaves)
        stacks = _reduce._stacks(leaves, leaf_axes, placed, placed)
        assert sorted(map(len, stacks)) == [3, 3, 3, 3]
        fn = lambda t: clipax.tree._norm.clip_by_norm_with_norms(t, 2.0, axes)  # noqa: E731
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
                rtol=_PACKED_RTOL[dtype],
                atol=1e-300,
                err_msg=key,
            )
            np.testing.assert_allclose(
                norms[key], np.max(slice_norms), rtol=_PACKED_RTOL[dtype], err_msg=key
            )


def test_whole_leaf_roots_and_clip_factors_are_one_kernel_per_pack() -> None:
    # Eight large leaves of different shapes, under jit over 8 devices (their
    # sums are scalars, whole everywhere): the roots, after the range test,
    # and the clip factors are vector operations on one pack, and each leaf's
    # are read out at a run-time position; a root or a clip factor per leaf
    # would be scalar kernels, one per leaf.
    tree = [jnp.ones(_fused.SMALL_LEAF + k) for k in range(8)]
    tx = clipax.clip_by_norm(1.0)
    hlo = jax.jit(tx.update).lower(tree, tx.init(tree)).compile().as_text()
    assert len(re.findall(r"= f32\[8\]\S* sqrt\(", hlo)) == 1
    assert not re.search(r"= f32\[\] (?:sqrt|divide)\(", hlo)
    assert "dynamic-slice" in hlo


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
    tree = [jnp.ones(_fused.SMALL_LEAF + k) for k in range(3)]
    hlo = jax.jit(transform.update).lower(tree, transform.init(tree)).compile()
    for k in range(3):
        shape = f"f32[{_fused.SMALL_LEAF + k}]"
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
def test_leaves_xla_sees_as_constants_take_the_exact_pass_without_nan(
    value: float, clip: Any
) -> None:
    # Zeros from `optax.set_to_zero` (a frozen layer) or an array closed over
    # by the jitted function are constants to XLA: it rewrote the exact pass's
    # (x scale)**2 as x**2 scale**2, and 0 * 2**160 = NaN.
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


@pytest.mark.parametrize(
    ("floor", "exact"), [(0.0, True), (6.5e-10, True), (6.6e-10, False), (1e-3, False)]
)
def test_a_floor_spares_zero_slices_the_exact_pass(
    monkeypatch: pytest.MonkeyPatch, floor: float, exact: bool
) -> None:
    # Norms below `floor` need not be exact: from 2 sqrt(_trust_floor) (6.58e-10
    # in float32) up, sums that underflowed are below it whatever was lost, and
    # an all-zero slice no longer sends the tree through the exact pass.
    calls = helpers.count_exact_passes(monkeypatch)
    # A norm below the floor may come out as anything below it; the plain
    # sum of 1e-15 is exact, and so must its norm be.
    leaves = [jnp.zeros(3), jnp.array([3.0, 4.0]), jnp.full((2, 2), 1e-30)]
    leaves.append(jnp.full(3, 1e-15))
    axes = [(0,), (0,), (1,), (0,)]
    norms = _reduce.slice_norms(leaves, axes, floor=floor)
    assert bool(calls) == exact
    traced = jax.jit(lambda f: _reduce.slice_norms(leaves, axes, floor=f))(floor)
    want = [0.0, 5.0, np.full((2, 1), np.sqrt(2) * 1e-30)]
    flagged = jax.jit(_reduce._untrusted)(jnp.float32(0), jnp.float32(floor))
    assert bool(flagged) == exact
    for got in (norms, traced):
        np.testing.assert_allclose(got[0], want[0])
        np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
        np.testing.assert_allclose(got[3], np.sqrt(3) * 1e-15, rtol=1e-6)
        if exact:
            np.testing.assert_allclose(got[2], want[2], rtol=1e-6)
        else:  # the plain sums (here 0) are kept: below the floor either way
            assert np.all(np.asarray(got[2]) < floor)
