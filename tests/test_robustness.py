"""Exact norms at the extremes of float range, the non-finite policy, donation."""

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

ORDS = [1, 1.5, 2, 3, math.inf]


def _extreme_trees() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "squares overflow float32": {"w": jnp.full((4, 3), 1e20, jnp.float32)},
        "overflow beside ones": [jnp.array([1e20, -3e19]), jnp.ones(5)],
        "near the largest float32": [jnp.array([3e37, -1e38], jnp.float32)],
        "squares underflow float32": {"w": jnp.full((4,), 1e-25, jnp.float32)},
        "underflow, mixed signs": [
            jnp.asarray(rng.normal(size=50) * 1e-22, jnp.float32)
        ],
        "float16 near 65504": {"h": jnp.full((1000,), 65000.0, jnp.float16)},
        "float16 tiny": {"h": jnp.full((7,), 1e-4, jnp.float16)},
        "bfloat16, two million elements": {
            "b": jnp.asarray(rng.uniform(0.5, 1.5, 2_000_000), jnp.bfloat16)
        },
        "bfloat16 at 1e30": {"b": jnp.full((9,), 1e30, jnp.bfloat16)},
        "mixed dtypes": {
            "h": jnp.full((100,), 60000.0, jnp.float16),
            "b": jnp.full((100,), 1e19, jnp.bfloat16),
            "f": jnp.full((3,), 1e-20, jnp.float32),
            "z": jnp.full((2,), 1e20 + 1e20j, jnp.complex64),
        },
        "1e-30 to 1e30 in one leaf": [
            jnp.asarray(np.logspace(-30, 30, 61), jnp.float32)
        ],
    }


TREES = _extreme_trees()


@pytest.mark.parametrize("ord", ORDS)
@pytest.mark.parametrize("name", list(TREES))
def test_norm_is_exact_for_every_finite_input(name: str, ord: float) -> None:
    tree = TREES[name]
    expected = helpers.ref_global_norm(tree, ord)
    for fn in (
        clipax.tree.global_norm,
        jax.jit(clipax.tree.global_norm, static_argnames="ord"),
    ):
        norm = fn(tree, ord=ord)
        assert norm.dtype == jnp.float32
        np.testing.assert_allclose(norm, expected, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("ord", ORDS)
@pytest.mark.parametrize("name", list(TREES))
def test_norm_is_exact_for_every_finite_input_with_leaves_known_whole(
    monkeypatch: pytest.MonkeyPatch, name: str, ord: float
) -> None:
    # The suite's 8 devices leave a traced leaf's placement unknown (both
    # passes in one loop); on one device, or with known placements, small
    # leaves are bucketed and the second pass is a `lax.cond` branch.
    monkeypatch.setattr(_engine, "is_whole", lambda x: True)
    tree = TREES[name]
    expected = helpers.ref_global_norm(tree, ord)
    norm = jax.jit(clipax.tree.global_norm, static_argnames="ord")(tree, ord=ord)
    np.testing.assert_allclose(norm, expected, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("ord", ORDS)
@pytest.mark.parametrize("name", list(TREES))
def test_clipping_extremes_gives_finite_trees_at_max_norm(
    name: str, ord: float
) -> None:
    tree = TREES[name]
    norm = helpers.ref_global_norm(tree, ord)
    max_norm = norm / 8  # always clipped
    clipped, got = jax.jit(
        lambda t: clipax.tree.clip_by_global_norm(t, max_norm, ord=ord)
    )(tree)
    chex.assert_tree_all_finite(clipped)
    np.testing.assert_allclose(got, norm, rtol=1e-5)
    after = helpers.ref_global_norm(clipped, ord)
    dtypes = {str(x.dtype) for x in jax.tree.leaves(tree)}
    tol = 1e-2 if dtypes & {"float16", "bfloat16"} else 1e-5
    np.testing.assert_allclose(after, max_norm, rtol=tol)


@pytest.mark.parametrize("name", list(TREES))
def test_per_leaf_norms_follow_the_per_tensor_rule_at_the_extremes(name: str) -> None:
    # Exact where a leaf's sum of squares is a normal float32; an overflowing
    # leaf is inf and all NaN, alone; an underflowing one reads smaller and is
    # clipped by what it read (docs/semantics.md).
    tree = TREES[name]
    max_norm = helpers.ref_global_norm(tree) / 4  # clips the largest leaves
    tx = clipax.clip_by_norm(max_norm)
    updates, state = jax.jit(tx.update)(tree, tx.init(tree))
    leaves = zip(
        jax.tree.leaves(tree),
        jax.tree.leaves(state.norms),
        jax.tree.leaves(updates),
        strict=True,
    )
    for leaf, norm, out in leaves:
        leaf_norm = helpers.ref_global_norm(leaf)
        where = helpers.per_tensor_range(leaf)
        if where == "overflow":
            assert np.isinf(norm) and np.isnan(np.asarray(out)).all(), name
            continue
        chex.assert_tree_all_finite(out)
        if where == "underflow":
            assert 0 <= float(norm) <= leaf_norm * (1 + 1e-5), name
            expected = leaf_norm * min(1.0, max_norm / max(float(norm), 1e-300))
        else:
            np.testing.assert_allclose(norm, leaf_norm, rtol=1e-5)
            expected = min(leaf_norm, max_norm)
        np.testing.assert_allclose(helpers.ref_global_norm(out), expected, rtol=1e-2)


def test_per_slice_norms_follow_the_per_tensor_rule_when_slices_span_the_range() -> (
    None
):
    x = jnp.array([[1e20, 1e20], [3.0, 4.0], [1e-25, 1e-25], [0.0, 0.0]], jnp.float32)
    out = clipax.tree.clip_by_norm(x, 2.0, axes=1)
    assert np.isnan(np.asarray(out[0])).all()  # squares overflow: this row alone
    expected = np.array([[1.2, 1.6], [1e-25, 1e-25], [0, 0]])
    np.testing.assert_allclose(out[1:], expected, rtol=1e-6)


def test_a_norm_beyond_float32_is_inf_and_follows_the_nan_rule() -> None:
    tree = [jnp.array([3e38, 3e38], jnp.float32)]  # true norm 4.2e38 > 3.4e38
    clipped, norm = clipax.tree.clip_by_global_norm(tree, 1.0)
    assert norm == np.inf
    assert bool(jnp.all(jnp.isnan(clipped[0])))


@pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="XLA's CPU backend flushes float32 subnormals; GPUs keep them "
    "(measured on an H100: docs/semantics.md)",
)
def test_subnormal_inputs_read_as_zero_on_cpu() -> None:
    # XLA's CPU backend flushes float32 subnormals (< 1.18e-38) to zero; the
    # documented consequence: a tree of subnormals has norm 0 and comes back as
    # zeros, like any arithmetic on it in XLA's CPU backend.
    x = jnp.full((3,), 1e-40, jnp.float32)
    clipped, norm = clipax.tree.clip_by_global_norm(x, 1e-45)
    assert norm == 0.0
    chex.assert_trees_all_equal(clipped, x * 1.0)
    # A clip factor below the smallest normal float32 is flushed to 0 too.
    clipped, norm = clipax.tree.clip_by_global_norm(jnp.array([1e9]), 1e-30)
    assert norm == 1e9 and float(clipped[0]) == 0.0


@pytest.mark.parametrize("ord", [1, 2, math.inf])
def test_rescaled_pass_has_finite_gradients(ord: float) -> None:
    def loss(t: jax.Array) -> jax.Array:
        clipped, norm = clipax.tree.clip_by_global_norm(t, 1e-30, ord=ord)
        return jnp.sum(clipped) + norm

    for x in (jnp.full((3,), 1e-25), jnp.zeros(3), jnp.array([3.0, 4.0, 0.0])):
        chex.assert_tree_all_finite(jax.grad(loss)(x))
        chex.assert_tree_all_finite(jax.jit(jax.grad(loss))(x))


@pytest.mark.parametrize("ord", [1, 1.5, 2, 3])
@pytest.mark.parametrize("scale", [1e-30, 1.0, 1e25])
def test_gradient_of_the_norm_is_exact_at_the_extremes(
    scale: float, ord: float
) -> None:
    # d||x||_p / dx = sign(x) |x|**(p-1) / ||x||**(p-1), in float64: the
    # derivative of the second (rescaled) pass is that of its own formula.
    # At x = 0 the 1-norm takes JAX's subgradient of |x|, 1, as before.
    x64 = np.array([3.0, -4.0, 0.5, 0.0]) * scale
    x = jnp.asarray(x64, jnp.float32)
    norm = np.sum(np.abs(x64) ** ord) ** (1 / ord)
    expected = np.sign(x64) * (np.abs(x64) / norm) ** (ord - 1)
    if ord == 1:
        expected[3] = 1.0
    for grad in (
        jax.grad(clipax.tree.global_norm),
        jax.jit(jax.grad(clipax.tree.global_norm, argnums=0), static_argnames="ord"),
    ):
        got = grad(x, ord=ord)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-30)
    tangent = jnp.asarray([1.0, 2.0, 0.0, 5.0], jnp.float32)
    _, slope = jax.jvp(lambda t: clipax.tree.global_norm(t, ord=ord), (x,), (tangent,))
    np.testing.assert_allclose(slope, np.dot(expected, [1.0, 2.0, 0.0, 5.0]), rtol=1e-5)


def test_float64_trees_with_narrow_leaves_are_exact_at_the_extremes() -> None:
    # With x64, a tree holding a float64 leaf is summed in float64: a
    # bfloat16 leaf whose float32 squares overflow is summed in float64 too,
    # and the second pass's scale, chosen for float64's range, cannot flush
    # it to zero.
    with jax.enable_x64(True):
        cases = [
            [jnp.asarray(2.7e19, jnp.bfloat16), jnp.asarray(0.25, jnp.float64)],
            [jnp.array([1e200, 1.0]), jnp.full((3,), 1e30, jnp.bfloat16)],
            [jnp.full((3,), 1e-30, jnp.float32), jnp.full((2,), 1e-200)],
        ]
        for tree in cases:
            expected = helpers.ref_global_norm(tree)
            for fn in (clipax.tree.global_norm, jax.jit(clipax.tree.global_norm)):
                norm = fn(tree)
                assert norm.dtype == jnp.float64
                np.testing.assert_allclose(norm, expected, rtol=1e-6)


@pytest.mark.parametrize("scale", [1e-30, 1.0, 1e30])
def test_norm_under_vmap_and_second_derivatives(scale: float) -> None:
    # The loop's custom_jvp composes: a batch mixing in-range and extreme rows,
    # and the Hessian (I - u u^T) / n of the 2-norm, u = x / n, forward over
    # reverse and reverse over reverse.
    rows = jnp.array([[3.0, 4.0], [3.0 * scale, 4.0 * scale], [0.0, 0.0]])
    np.testing.assert_allclose(
        jax.vmap(clipax.tree.global_norm)(rows), [5.0, 5.0 * scale, 0.0], rtol=1e-6
    )
    x = jnp.array([3.0, 4.0]) * scale
    u = np.array([0.6, 0.8])
    expected = (np.eye(2) - np.outer(u, u)) / (5.0 * scale)
    np.testing.assert_allclose(
        jax.hessian(clipax.tree.global_norm)(x), expected, rtol=1e-5
    )
    row = jax.grad(lambda t: jax.grad(clipax.tree.global_norm)(t)[0])(x)
    np.testing.assert_allclose(row, expected[0], rtol=1e-5)


@pytest.mark.parametrize("whole", [True, False], ids=["bucketable", "unknown"])
@pytest.mark.parametrize("ord", [1, 1.5, 2])
def test_the_common_path_is_one_plain_pass(
    monkeypatch: pytest.MonkeyPatch, ord: float, whole: bool
) -> None:
    # Under jit, with leaves known to be whole on their device, the first pass
    # is each large leaf's bare reduction, with no scale multiplied in (XLA's
    # CPU backend runs a bare sum of squares about twice as fast as a sum of
    # scaled squares); the pass that repairs overflow and underflow is in the
    # branch of one `lax.cond`. Where their placement is unknown (several
    # devices, automatic mesh axes), both passes are one loop body, in which
    # each leaf is reduced once.
    monkeypatch.setattr(_engine, "is_whole", lambda x: whole)
    tree = [jnp.ones((100, 100)), jnp.ones((64, 80)), jnp.ones((5000,))]
    jaxpr = jax.make_jaxpr(lambda t: clipax.tree.global_norm(t, ord=ord))(tree)
    reductions: dict[str, int] = {}
    multiplies = 0
    for eqn, inside in helpers.equations(jaxpr.jaxpr):
        large = bool(eqn.invars) and getattr(eqn.invars[0].aval, "size", 0) >= 4000
        if large and eqn.primitive.name == "reduce_sum":
            reductions[inside] = reductions.get(inside, 0) + 1
        multiplies += large and eqn.primitive.name == "mul" and not inside
    if whole:
        assert reductions == {"": len(tree), "cond": len(tree)}, reductions
    else:
        assert reductions == {"while": len(tree)}, reductions
    assert multiplies == 0
    for scale in (1e-30, 1.0, 1e30):
        scaled = [x * scale for x in tree]
        got = jax.jit(lambda t: clipax.tree.global_norm(t, ord=ord))(scaled)
        expected = helpers.ref_global_norm(
            [np.asarray(x, np.float64) * scale for x in tree], ord
        )
        np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_partial_sums_are_summed_by_a_reduction_not_an_add_chain() -> None:
    # XLA rewrites the sum of a stack of per-leaf scalars as one fused chain of
    # adds, whose compile time grows with the number of leaves; the stack goes
    # through a barrier, so that each pass sums it with one small reduction.
    tree = [jnp.ones((5000,)) for _ in range(40)]
    tx = clipax.clip_by_global_norm(1.0)
    compiled = jax.jit(tx.update).lower(tree, tx.init(tree)).compile()
    computations = re.split(r"\n(?=%|ENTRY)", compiled.as_text())
    assert max(c.count(" add(") for c in computations) < 8
    _, state = compiled(tree, tx.init(tree))
    np.testing.assert_allclose(state.norm, np.sqrt(40 * 5000), rtol=1e-6)


# The non-finite policy.

BAD = {"a": jnp.array([1.0, math.nan]), "b": [jnp.ones(2), jnp.array([math.inf])]}
GOOD = {"a": jnp.array([3.0, 0.0]), "b": [jnp.zeros(2), jnp.array([4.0])]}


def test_nonfinite_nan_is_the_default() -> None:
    clipped, _ = clipax.tree.clip_by_global_norm(BAD, 1.0)
    assert all(bool(jnp.all(jnp.isnan(x))) for x in jax.tree.leaves(clipped))


@pytest.mark.parametrize("jit", [False, True])
def test_nonfinite_zero_skips_the_step_and_counts_it(jit: bool) -> None:
    tx = clipax.clip_by_global_norm(1.0, nonfinite="zero")
    update = jax.jit(tx.update) if jit else tx.update
    state = tx.init(BAD)
    assert state.nonfinite_count == 0
    updates, state = update(BAD, state)
    chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, BAD))
    assert state.nonfinite_count == 1 and jnp.isnan(state.norm)
    updates, state = update(GOOD, state)
    chex.assert_trees_all_close(updates["a"], jnp.array([0.6, 0.0]))
    assert state.nonfinite_count == 1 and state.norm == 5.0
    _, state = update(BAD, state)
    assert state.nonfinite_count == 2


def test_nonfinite_count_in_nan_mode() -> None:
    tx = clipax.clip_by_global_norm(1.0)
    _, state = tx.update(BAD, tx.init(BAD))
    assert state.nonfinite_count == 1


@pytest.mark.parametrize("jit", [False, True])
def test_nonfinite_error_names_the_first_bad_leaf(jit: bool) -> None:
    def fn(t: Any) -> Any:
        return clipax.tree.clip_by_global_norm(t, 1.0, nonfinite="error")

    call = jax.jit(fn) if jit else fn
    # Eagerly the callback's own error; under jit, JAX's wrapping of it.
    error = jax.errors.JaxRuntimeError if jit else FloatingPointError
    with pytest.raises(error, match=r"the leaf at \['a'\] holds NaN or inf") as info:
        jax.block_until_ready(call(BAD))
    assert "nonfinite='error'" in str(info.value)
    only_b = {"a": jnp.ones(2), "b": BAD["b"]}
    with pytest.raises(error, match=r"the leaf at \['b'\]\[1\] holds NaN or inf"):
        jax.block_until_ready(call(only_b))
    clipped, norm = call(GOOD)  # finite trees pass through untouched by the check
    assert norm == 5.0
    chex.assert_trees_all_close(clipped["b"][1], jnp.array([0.8]))


def test_nonfinite_error_in_the_transformation_under_jit() -> None:
    tx = clipax.clip_by_global_norm(1.0, nonfinite="error")
    with pytest.raises(
        jax.errors.JaxRuntimeError, match=r"the leaf at \['b'\]\[1\] holds NaN or inf"
    ):
        jax.block_until_ready(
            jax.jit(tx.update)({"a": jnp.ones(2), "b": BAD["b"]}, tx.init(BAD))
        )


@pytest.mark.parametrize("nonfinite", ["skip", None, "NaN"])
def test_bad_nonfinite(nonfinite: Any) -> None:
    match = (
        r"`nonfinite` must be one of \('nan', 'zero', 'error'\), or a bool as "
        r"PyTorch's `error_if_nonfinite` \(True is 'error', False 'nan'\)"
    )
    with pytest.raises(ValueError, match=match):
        clipax.clip_by_global_norm(1.0, nonfinite=nonfinite)
    with pytest.raises(ValueError, match=match):
        clipax.tree.clip_by_global_norm(GOOD, 1.0, nonfinite=nonfinite)


def test_apply_if_finite_skips_the_step_that_clipax_marks_nan() -> None:
    params = {"w": jnp.ones(2)}
    tx = optax.apply_if_finite(
        optax.chain(clipax.clip_by_global_norm(1.0), optax.adam(0.1)),
        max_consecutive_errors=3,
    )
    state = tx.init(params)
    step = jax.jit(tx.update)
    updates, state = step({"w": jnp.array([math.inf, 1.0])}, state, params)
    chex.assert_trees_all_equal(updates, {"w": jnp.zeros(2)})
    assert state.notfinite_count == 1 and state.total_notfinite == 1
    # The inner state did not see the broken step: its logged norm is still 0.
    assert optax.tree.get(state.inner_state, "norm") == 0.0
    updates, state = step({"w": jnp.array([3.0, 4.0])}, state, params)
    assert optax.tree.get(state.inner_state, "norm") == 5.0
    chex.assert_tree_all_finite(updates)


# Donation.


@pytest.mark.parametrize(
    "clip",
    [
        clipax.clip_by_global_norm(1.0),
        clipax.clip_by_global_norm(1.0, nonfinite="zero"),
        clipax.clip_by_norm(0.5, axes=0),
        clipax.clip(0.1),
    ],
    ids=["global", "global-zero", "per-leaf", "value"],
)
def test_donated_training_step(clip: optax.GradientTransformation) -> None:
    tx = optax.chain(clip, optax.adam(1e-2))
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), "b": jnp.zeros(3)}
    x = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)

    def step(p: Any, s: Any, grads_scale: jax.Array) -> Any:
        grads = jax.grad(lambda q: jnp.sum((x @ q["w"] + q["b"]) ** 2))(p)
        grads = jax.tree.map(lambda g: g * grads_scale, grads)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    plain = jax.jit(step)
    donated = jax.jit(step, donate_argnums=(0, 1))
    p1, s1 = params, tx.init(params)
    p2, s2 = jax.tree.map(jnp.copy, params), tx.init(params)
    for scale in (1.0, 10.0, 0.1):
        p1, s1 = plain(p1, s1, scale)
        p2, s2 = donated(p2, s2, scale)  # the old p2, s2 are consumed
    chex.assert_trees_all_close(p1, p2)
    chex.assert_trees_all_close(s1, s2)


@pytest.mark.parametrize("ord", [1.0, 1.5, 2.0, math.inf])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_complex_infinite_element_gives_an_infinite_norm(ord: float, jit: bool) -> None:
    # The rescaled pass scales the real and imaginary parts apart: a complex
    # product would make the imaginary part of inf + 0j inf * 0 = NaN, and the
    # norm NaN instead of inf.
    tree = {
        "c": jnp.array([math.inf + 0j, 1 + 1j], jnp.complex64),
        "r": jnp.ones(3),
    }
    global_norm = lambda t: clipax.tree.global_norm(t, ord=ord)  # noqa: E731
    with_norms = lambda t: helpers.clip_with_norms(t, 1.0, None)  # noqa: E731
    if jit:
        global_norm, with_norms = jax.jit(global_norm), jax.jit(with_norms)
    assert float(global_norm(tree)) == math.inf
    clipped, norms = with_norms(tree)
    assert float(norms["c"]) == math.inf
    np.testing.assert_allclose(norms["r"], math.sqrt(3), rtol=1e-6)
    assert bool(jnp.all(jnp.isnan(clipped["c"])))  # the NaN rule, as before
