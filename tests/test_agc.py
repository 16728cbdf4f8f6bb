"""Tests for clipax.adaptive_grad_clip (AGC, Brock et al. 2021)."""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipax
from tests.helpers import assert_compiles_once, shard_rows

SHAPES = [(), (5,), (1, 5), (5, 1), (3, 4), (1, 1, 6), (2, 3, 4), (3, 3, 2, 4)]
SHAPES += [(2, 2, 2, 3, 4), (0, 3)]


def make(shapes, seed=0, grad_scale=1.0):
    """Params (one leaf all zeros, as a bias) and grads of mixed sizes, so that
    some units are clipped and some are not."""
    rng = np.random.default_rng(seed)
    params, grads = {}, {}
    for i, shape in enumerate(shapes):
        params[f"p{i}"] = np.array(rng.standard_normal(shape), np.float32)
        unit_scale = rng.choice([0.001, 0.05, 3.0], size=shape[-1:] or None)
        g = rng.standard_normal(shape) * unit_scale * grad_scale
        grads[f"p{i}"] = np.array(g, np.float32)
    params["p0"] = np.zeros_like(params["p0"])
    return params, grads


@pytest.mark.parametrize("clipping", [0.01, 0.1, 1.0])
@pytest.mark.parametrize("eps", [1e-3, 0.5])
@pytest.mark.parametrize("seed", [0, 1])
def test_equals_optax_with_default_axes(clipping, eps, seed):
    params, grads = make(SHAPES, seed)
    # optax's default unit axes by rank; for rank 5 (DHWIO), which optax
    # before 0.2.7 has no default for, the axes that later releases default
    # to, (0, 1, 2, 3).
    rank5 = {k for k, g in grads.items() if g.ndim == 5}
    want, _ = optax.adaptive_grad_clip(clipping, eps).update(
        {k: g for k, g in grads.items() if k not in rank5},
        None,
        {k: w for k, w in params.items() if k not in rank5},
    )
    for k in rank5:
        conv3d = optax.adaptive_grad_clip(clipping, eps, axis=(0, 1, 2, 3))
        want[k] = conv3d.update(grads[k], None, params[k])[0]
    assert rank5 and len(want) == len(grads)
    tx = clipax.adaptive_grad_clip(clipping, eps=eps)
    got, state = jax.jit(tx.update)(grads, tx.init(params), params)
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, grads)
    assert state == optax.EmptyState()


@pytest.mark.parametrize(
    ("shape", "axis"),
    [((3, 4), 1), ((3, 4), -1), ((2, 3, 4), (0, 2)), ((2, 2, 2, 2, 2, 3), (0, 1, 2))],
)
def test_equals_optax_with_axis(shape, axis):
    params, grads = make([shape, shape], seed=3)
    want, _ = optax.adaptive_grad_clip(0.05, axis=axis).update(grads, None, params)
    tx = clipax.adaptive_grad_clip(0.05, axis=axis)
    got, _ = tx.update(grads, tx.init(params), params)
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)


def test_each_unit_ends_at_most_at_its_limit_and_keeps_its_direction():
    _, grads = make([(6, 5)], seed=4, grad_scale=10.0)
    w, g = np.random.default_rng(5).standard_normal((6, 5)), grads["p0"]
    params = {"p0": w.astype(np.float32)}
    clipping, eps = 0.02, 1e-3
    tx = clipax.adaptive_grad_clip(clipping, eps=eps)
    out, _ = tx.update(grads, tx.init(params), params)
    o = np.asarray(out["p0"])
    limits = clipping * np.maximum(np.linalg.norm(w, axis=0), eps)
    g_norms, o_norms = np.linalg.norm(g, axis=0), np.linalg.norm(o, axis=0)
    assert np.all(o_norms <= limits * (1 + 1e-6))
    clipped = g_norms >= limits
    assert clipped.any() and (~clipped).any()
    np.testing.assert_allclose(o_norms[clipped], limits[clipped], rtol=1e-5)
    np.testing.assert_array_equal(o[:, ~clipped], g[:, ~clipped])
    # Each unit (column) is scaled by one factor.
    ratios = o / g
    np.testing.assert_allclose(ratios, np.broadcast_to(ratios[:1], g.shape), rtol=1e-5)


def test_zero_params_are_measured_against_eps():
    params = {"b": jnp.zeros(3)}
    grads = {"b": jnp.array([3.0, 0.0, 4.0])}
    tx = clipax.adaptive_grad_clip(0.5, eps=0.1)
    out, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(out["b"], [0.03, 0.0, 0.04], rtol=1e-6)


def test_infinite_clipping_keeps_units_of_zero_parameters():
    # The limit inf * max(0, eps=0) is inf * 0 = NaN unless inf is taken as
    # "no limit": every unit must pass unchanged.
    params = {"b": jnp.zeros(3), "w": jnp.ones((2, 2))}
    grads = {"b": jnp.array([3.0, 0.0, 4.0]), "w": jnp.full((2, 2), 1e15)}
    tx = clipax.adaptive_grad_clip(math.inf, eps=0.0)
    out, _ = tx.update(grads, tx.init(params), params)
    chex.assert_trees_all_equal(out, grads)
    traced = jax.jit(
        lambda g, c: clipax.adaptive_grad_clip(c, eps=0.0).update(
            g, optax.EmptyState(), params
        )[0]
    )(grads, jnp.float32(math.inf))
    chex.assert_trees_all_equal(traced, grads)


def test_float16_norms_do_not_overflow():
    # Squares of 300 overflow float16 (max 65504): optax zeroes these updates.
    params = {"h": jnp.full((4,), 1000.0, jnp.float16)}
    grads = {"h": jnp.full((4,), 300.0, jnp.float16)}
    tx = clipax.adaptive_grad_clip(1.0)
    out, _ = tx.update(grads, tx.init(params), params)
    chex.assert_trees_all_equal(out, grads)
    tx = clipax.adaptive_grad_clip(0.15)
    out, _ = tx.update(grads, tx.init(params), params)
    assert out["h"].dtype == jnp.float16
    np.testing.assert_allclose(out["h"].astype(np.float32), 150.0, rtol=1e-3)


def test_non_finite_unit_is_nan_and_other_units_are_kept():
    params = {"w": jnp.ones((2, 3))}
    grads = {"w": jnp.array([[math.inf, 0.01, 0.01], [1.0, 0.02, math.nan]])}
    tx = clipax.adaptive_grad_clip(0.1)
    out, _ = tx.update(grads, tx.init(params), params)
    assert np.isnan(out["w"][:, 0]).all() and np.isnan(out["w"][:, 2]).all()
    np.testing.assert_array_equal(out["w"][:, 1], grads["w"][:, 1])


def test_none_and_masked_leaves_stay_empty():
    params = {"a": jnp.ones(2), "b": jnp.ones(2), "c": jnp.ones((2, 2))}
    grads = {"a": None, "b": jnp.array([5.0, 0.0]), "c": jnp.ones((2, 2))}
    tx = clipax.adaptive_grad_clip(1.0)
    out, _ = tx.update(grads, tx.init(params), params)
    assert out["a"] is None
    np.testing.assert_allclose(out["b"], [math.sqrt(2), 0.0], rtol=1e-6)

    masked = optax.masked(
        clipax.adaptive_grad_clip(0.1), {"a": False, "b": True, "c": False}
    )
    full = {"a": jnp.ones(2), "b": jnp.array([5.0, 0.0]), "c": jnp.ones((2, 2))}
    out, _ = masked.update(full, masked.init(params), params)
    np.testing.assert_allclose(out["b"], [0.1 * math.sqrt(2), 0.0], rtol=1e-6)
    chex.assert_trees_all_equal(out["a"], full["a"])


def test_params_under_empty_updates_are_not_checked():
    # An integer step counter among the params, with no update there.
    params = {"w": jnp.array([3.0, 4.0]), "step": jnp.array(7, jnp.int32)}
    tx = clipax.adaptive_grad_clip(0.1)
    for empty in (None, optax.MaskedNode()):
        grads = {"w": jnp.array([6.0, 8.0]), "step": empty}
        out, _ = tx.update(grads, optax.EmptyState(), params)
        assert out["step"] is None if empty is None else out["step"] == empty
        np.testing.assert_allclose(out["w"], [0.3, 0.4], rtol=1e-6)
    with pytest.raises(TypeError, match=r"\['step'\] has dtype int32"):
        grads = {"w": jnp.ones(2), "step": jnp.ones((), jnp.float32)}
        tx.update(grads, optax.EmptyState(), params)


def test_update_without_params_raises():
    tx = clipax.adaptive_grad_clip(0.1)
    grads = {"w": jnp.ones(3)}
    with pytest.raises(ValueError, match=r"needs `params`; got params=None"):
        tx.update(grads, tx.init(grads))


def test_params_of_another_shape_raise():
    tx = clipax.adaptive_grad_clip(0.1)
    with pytest.raises(ValueError, match=r"shape \(3,\) at \['w'\]; got \(4,\)"):
        tx.update({"w": jnp.ones(3)}, optax.EmptyState(), {"w": jnp.ones(4)})


def test_rank_6_needs_axis():
    params = {"k": jnp.ones((1, 2, 2, 2, 2, 3))}
    with pytest.raises(
        ValueError, match=r"\['k'\] with shape \(1, 2, 2, 2, 2, 3\).*`axis`"
    ):
        clipax.adaptive_grad_clip(0.1).init(params)
    tx = clipax.adaptive_grad_clip(0.1, axis=(0, 1, 2, 3, 4))
    out, _ = tx.update(params, tx.init(params), params)
    chex.assert_shape(out["k"], (1, 2, 2, 2, 2, 3))


def test_axis_out_of_range_is_reported_at_init():
    with pytest.raises(
        ValueError, match=r"`axis`=\(1,\) is out of range for the leaf at \['v'\]"
    ):
        clipax.adaptive_grad_clip(0.1, axis=1).init({"v": jnp.ones(3)})


def test_compiles_once():
    params, grads = make([(3, 4), (4,)])
    params = jax.tree.map(jnp.asarray, params)
    tx = clipax.adaptive_grad_clip(0.01)

    def step(grads, state, params):
        updates, state = tx.update(grads, state, params)
        return jax.tree.map(lambda u: 3 * u, updates), state, params

    assert_compiles_once(
        step, jax.tree.map(jnp.asarray, grads), tx.init(params), params
    )


@pytest.mark.parametrize("clipping", [0.0, -0.5])
def test_traced_non_positive_clipping_gives_zeros(clipping):
    params = {"w": jnp.ones((2, 2))}
    grads = {"w": jnp.array([[1.0, -2.0], [0.0, 3.0]])}

    @jax.jit
    def apply(c):
        return clipax.adaptive_grad_clip(c).update(grads, optax.EmptyState(), params)[0]

    out = apply(jnp.float32(clipping))
    chex.assert_trees_all_equal(out, {"w": jnp.zeros((2, 2))})


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((0.0,), {}, ValueError, r"`clipping` must be a positive scalar"),
        ((-1.0,), {}, ValueError, r"`clipping`.*got -1.0"),
        ((math.nan,), {}, ValueError, r"`clipping`.*got nan"),
        (
            (0.1,),
            {"eps": -1e-3},
            ValueError,
            r"`eps` must be a finite real number >= 0",
        ),
        ((0.1,), {"eps": math.inf}, ValueError, r"`eps`.*got inf"),
        ((0.1,), {"axis": "0"}, ValueError, r"`axis` must be None, an int"),
        ((0.1,), {"axis": (0, 0)}, ValueError, r"`axis`.*repeated"),
        (("x",), {}, TypeError, r"`clipping`"),
    ],
)
def test_rejects_bad_arguments(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        clipax.adaptive_grad_clip(*args, **kwargs)


def test_traced_axis_is_named_axis():
    tx = optax.inject_hyperparams(clipax.adaptive_grad_clip)(clipping=0.1, axis=0)
    params = {"w": jnp.ones((3, 2))}
    state = tx.init(params)
    with pytest.raises(TypeError, match=r"`axis` got a traced value"):
        jax.jit(tx.update)(params, state, params)


def test_init_rejects_integer_params():
    with pytest.raises(TypeError, match=r"\['i'\].*int32"):
        clipax.adaptive_grad_clip(0.1).init({"i": jnp.zeros(2, jnp.int32)})


def test_sharded_arrays_give_the_same_numbers_without_resharding():
    params, grads = make([(8, 4), (16, 2, 3), (5,)], seed=6)
    tx = clipax.adaptive_grad_clip(0.05)
    update = jax.jit(tx.update)
    want = jax.block_until_ready(update(grads, tx.init(params), params)[0])
    sharded_grads, sharded_params = shard_rows(grads), shard_rows(params)
    got = jax.block_until_ready(
        update(sharded_grads, tx.init(params), sharded_params)[0]
    )
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)
    for name in got:
        assert got[name].sharding.is_equivalent_to(
            sharded_grads[name].sharding, got[name].ndim
        )


@pytest.mark.parametrize(
    ("clipping", "eps"), [(0.01, 1e-3), (2.0, 1e-3), (0.01, 0.0), (1e-12, 1e-3)]
)
def test_zero_parameters_and_underflowing_updates_match_optax_in_float64(clipping, eps):
    # A zero parameter (a bias) counts as eps; an update whose squares
    # underflow float32 reads a norm below its limit and passes, as its true
    # norm does in float64.
    params, grads = make([(3,), (4, 5), (2, 3, 4)])
    grads["p0"] = np.full(3, 1e-25, np.float32)  # squares underflow
    tx = clipax.adaptive_grad_clip(clipping, eps=eps)
    out, _ = tx.update(grads, tx.init(params), params)
    want, _ = optax.adaptive_grad_clip(clipping, eps=eps).update(
        jax.tree.map(lambda x: np.asarray(x, np.float64), grads),
        optax.EmptyState(),
        jax.tree.map(lambda x: np.asarray(x, np.float64), params),
    )
    traced = jax.jit(
        lambda g, c, e: clipax.adaptive_grad_clip(c, eps=e).update(
            g, optax.EmptyState(), params
        )[0]
    )(grads, jnp.float32(clipping), jnp.float32(eps))
    for key in grads:
        np.testing.assert_allclose(out[key], want[key], rtol=2e-6, err_msg=key)
        np.testing.assert_allclose(traced[key], want[key], rtol=2e-6, err_msg=key)
