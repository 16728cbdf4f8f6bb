"""The adaptive rules: each rule's step on its own against its paper's
formula, and the parts the rules share."""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import clipax
from clipax import _checks, _engine
from clipax._adagc import adagc_step
from clipax._adaptive import EPS, autoclip_rule, zclip_rule
from tests.helpers import spike_norms, state_after_compiled_steps

f32 = np.float32


# Each rule, a pure function, against its formula.


@pytest.mark.parametrize(("history", "q"), [(1, 10.0), (4, 50.0), (16, 90.0)])
def test_autoclip_rule_is_the_percentile_of_the_recent_norms(history, q):
    """Seetharaman et al., Algorithm 1: eta_c = percentile(G_h, p)."""
    rule = jax.jit(functools.partial(autoclip_rule, percentile=q))
    state = clipax.autoclip(q, history=history).init(jnp.zeros(1))
    norms = spike_norms(40)
    for t, norm in enumerate(norms):
        state = state._replace(count=jnp.int32(t))
        threshold, state = rule(state, jnp.float32(norm))
        recent = norms[max(0, t + 1 - history) : t + 1].astype(f32)
        np.testing.assert_allclose(threshold, np.percentile(recent, q), rtol=1e-6)


@pytest.mark.parametrize("mode", ["adaptive", "std"])
def test_zclip_rule_after_warmup_is_the_papers_formula(mode):
    """Kumar et al., eqs. 5-8: z = (g - mu) / sigma; clipped to mu + z_t**2 / z
    * sigma (adaptive) or mu + z_t * sigma; EMA of the clipped norm."""
    alpha, zt, mean, var = 0.97, 2.5, 2.0, 0.25
    state = (
        clipax.zclip(warmup_steps=3)
        .init(jnp.zeros(1))
        ._replace(
            mean=jnp.float32(mean), variance=jnp.float32(var), count=jnp.int32(10)
        )
    )
    rule = functools.partial(zclip_rule, alpha=alpha, z_threshold=zt, mode=mode)
    for g in (1.0, 2.5, 9.0):
        threshold, new = rule(state, jnp.float32(g))
        std = math.sqrt(var)
        z = (g - mean) / (std + EPS)
        limit = mean + (zt**2 / z if mode == "adaptive" else zt) * std
        clipped = limit if z > zt else g
        want = limit if z > zt else mean + zt * (std + EPS)
        np.testing.assert_allclose(threshold, want, rtol=1e-6)
        new_mean = alpha * mean + (1 - alpha) * clipped
        np.testing.assert_allclose(new.mean, new_mean, rtol=1e-6)
        new_var = alpha * var + (1 - alpha) * (clipped - new_mean) ** 2
        np.testing.assert_allclose(new.variance, new_var, rtol=1e-5)


def test_zclip_rule_warmup_records_then_starts_the_statistics():
    rule = functools.partial(zclip_rule, alpha=0.9, z_threshold=2.0, mode="std")
    state = clipax.zclip(warmup_steps=2).init(jnp.zeros(1))
    threshold, state = rule(state, jnp.float32(1.0))
    assert math.isinf(threshold) and float(state.mean) == 0.0
    threshold, state = rule(state._replace(count=jnp.int32(1)), jnp.float32(3.0))
    assert math.isinf(threshold)
    assert float(state.mean) == 2.0 and float(state.variance) == 1.0


def test_adagc_rule_is_the_papers_formula():
    """Wang et al., eqs. 6-7: h_i = min(1, lambda_rel gamma_i / |g_i|),
    gamma_i <- beta gamma_i + (1 - beta) |h_i g_i|; warm-up: GlobalGC at
    lambda_abs, gamma_i = min of the clipped norms."""
    inf = math.inf

    def step(ema, norms, count):
        # The step on a vector of norms: each entry is one tensor's step.
        total = _engine.norm_of_norms(norms)
        factor = _engine.clip_factor(total, 2.0)
        alpha = jnp.float32(0.9)
        return adagc_step(
            ema, norms, count < 2, factor, jnp.float32(1.04), alpha, 1 - alpha
        )

    state = jnp.full(3, inf)
    norms = jnp.array([3.0, 4.0, 0.0], jnp.float32)  # global 5, clipped to 2
    threshold, state = step(state, norms, 0)
    np.testing.assert_allclose(threshold, [1.2, 1.6, 0.0], rtol=1e-6)
    np.testing.assert_allclose(state, [1.2, 1.6, inf], rtol=1e-6)
    norms = jnp.array([1.0, 0.1, 0.0], jnp.float32)  # not clipped: minimum
    threshold, state = step(state, norms, 1)
    np.testing.assert_allclose(state, [1.0, 0.1, inf], rtol=1e-6)
    norms = jnp.array([5.0, 0.1, 2.0], jnp.float32)  # after warm-up
    threshold, state = step(state, norms, 2)
    np.testing.assert_allclose(threshold, [1.04, 0.104, 2.08], rtol=1e-6)
    clipped = np.array([1.04, 0.1, 2.0])
    gamma = np.array([1.0, 0.1, 2.0])  # the unseen third leaf starts from its norm
    np.testing.assert_allclose(state, 0.9 * gamma + 0.1 * clipped, rtol=1e-6)


# The shared parts.


@pytest.mark.parametrize("scale", [1.0, 1e30, 1e-30])
def test_norm_of_norms_is_exact_without_overflow(scale):
    rng = np.random.default_rng(0)
    norms = np.abs(rng.standard_normal((5, 3))) * scale
    want = np.sqrt(np.sum(norms.astype(np.float64) ** 2, axis=0))
    got = _engine.norm_of_norms(jnp.asarray(norms, jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert float(_engine.norm_of_norms(jnp.zeros((0,), jnp.float32))) == 0.0


@pytest.mark.parametrize("jit", [False, True])
def test_norm_of_norms_near_the_largest_float(jit):
    # 1 / 3e38 is subnormal in float32: a division by the largest entry, which
    # XLA turns into a multiplication by its reciprocal, flushed it to 0.
    f = jax.jit(_engine.norm_of_norms) if jit else _engine.norm_of_norms
    norms = np.array([[3e38, 2e38], [1.0, 2e38]])
    want = np.sqrt(np.sum(norms**2, axis=0))  # float64; the second is 2.8e38
    got = f(jnp.asarray(norms, jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    small = np.array([2e-38, 1.5e-38, 0.0])  # near the smallest normal float
    got = f(jnp.asarray(small, jnp.float32))
    np.testing.assert_allclose(got, np.sqrt(np.sum(small**2)), rtol=1e-6)


@pytest.mark.parametrize("scale", [1e-30, 1e30])
def test_norm_of_norms_of_norms_xla_sees_as_constants(scale):
    # Closed over by the jitted function, the norms are constants to XLA,
    # which rewrote (n s)**2 as n**2 s**2: s = 2**100 squares to inf, and
    # 1e-60, flushed to 0, times inf is NaN.
    norms = np.array([[1.0, 2.0], [2.0, 2.0]]) * scale
    got = jax.jit(lambda: _engine.norm_of_norms(jnp.asarray(norms, jnp.float32)))()
    want = np.sqrt(np.sum(norms.astype(np.float64) ** 2, axis=0))
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_norm_of_norms_of_nan_and_inf():
    f = _engine.norm_of_norms
    assert math.isnan(f(jnp.array([1.0, math.nan, math.inf])))
    assert math.isinf(f(jnp.array([1.0, math.inf])))
    assert float(f(jnp.zeros(3))) == 0.0


def test_clip_factor_rules():
    norm = jnp.array([2.0, 2.0, 2.0, math.nan, 0.0])
    threshold = jnp.array([1.0, math.inf, math.nan, 1.0, 0.0])
    # A threshold <= 0 gives the factor 0 (zeros for every tree, the zero
    # tree included); a NaN threshold (an adaptive rule's) makes it NaN.
    np.testing.assert_array_equal(
        _engine.clip_factor(norm, threshold), [0.5, 1.0, math.nan, math.nan, 0.0]
    )


def test_adagc_keeps_empty_leaves_and_a_broken_tensor_s_statistics():
    tx = clipax.adagc(warmup_steps=1, max_norm=100.0, alpha=0.5)
    tree = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([1.0]), "n": None}
    state = tx.init(tree)
    assert state.norms["n"] is None and math.isinf(state.thresholds["a"])
    update = jax.jit(tx.update)
    out, state = update(tree, state)  # the warm-up step passes
    chex.assert_trees_all_equal(out, tree)
    out, state = update(jax.tree.map(lambda x: 2 * x, tree), state)
    np.testing.assert_allclose(out["a"], [3.12, 4.16], rtol=1e-6)  # 10 -> 1.04 * 5
    np.testing.assert_allclose(state.norm, math.hypot(10.0, 2.0), rtol=1e-6)
    assert int(state.count) == 2
    # The NaN rule: the broken tensor keeps its statistics and comes out NaN,
    # the others go on, and the step is not counted.
    broken = {"a": jnp.array([math.nan, 0.0]), "b": jnp.array([8.0]), "n": None}
    out, after = update(broken, state)
    assert np.isnan(out["a"]).all()
    np.testing.assert_allclose(out["b"], [1.04 * float(state.ema["b"])], rtol=1e-6)
    assert float(after.ema["a"]) == float(state.ema["a"])
    assert float(after.ema["b"]) != float(state.ema["b"])
    assert int(after.count) == 2
    assert float(after.thresholds["a"]) == float(state.thresholds["a"])


def test_adagc_compiles_once():
    state = state_after_compiled_steps(clipax.adagc(), {"a": jnp.ones(3)}, calls=4)
    assert int(state.count) == 4


@pytest.mark.parametrize(
    ("check", "value", "match"),
    [
        (_checks.unit, 1.5, r"`x` must be a real number strictly"),
        (_checks.positive, -1.0, r"`x` must be a finite real number > 0"),
        (_checks.integer, 0, r"`x` must be an int >= 1; got 0"),
    ],
)
def test_shared_argument_checks(check, value, match):
    with pytest.raises(ValueError, match=match):
        check("x", value)
    assert _checks.integer("x", np.int64(3), minimum=0) == 3
