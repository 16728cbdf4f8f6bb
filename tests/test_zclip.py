"""Tests for clipax.zclip (ZClip, Kumar et al. 2025)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipax
from tests.helpers import (
    assert_compiles_once,
    ref_global_norm,
    run_updates,
    sharded_and_pmap_runs,
    spike_norms,
    tree_with_norm,
)

PACKAGE_MODES = {"adaptive": "zscore", "std": "percentile"}  # clipax: package


def ref_zclip_package(
    norms: Sequence[float],
    *,
    alpha: float = 0.97,
    z_thresh: float = 2.5,
    warmup_steps: int = 25,
    mode: str = "zscore",
    clip_option: str = "adaptive_scaling",
    clip_factor: float = 1.0,
    skip_update_on_spike: bool = False,
    max_grad_norm: float | None = None,
    eps: float = 1e-6,
) -> dict[str, np.ndarray]:
    """The `zclip` package's `ZClip.step` (version 1.0.0), in float64, on a
    sequence of global norms, with its options and their defaults.

    Two departures, clipax's documented differences: the updates are scaled by
    `limit / g`, not `limit / (g + 1e-6)`, so a clipped step's norm is the
    limit itself; and a NaN or inf norm gives NaN updates and leaves the
    statistics as they were (the package would record it and break them).

    Returns per step: `clipped`, the norm of the updates after clipping (and
    after `max_grad_norm`); `limit`, the adaptive limit of a spike, else NaN;
    `mean` and `variance` after the step (NaN until the warmup ends); and
    `margin`, how far the norm was from the spike test's boundary, relative to
    the norm (inf when there was no test), so that a test can see that
    float32 rounding cannot flip a decision.
    """
    buffer: list[float] = []
    initialized = False
    mean = var = math.nan
    out: dict[str, list[float]] = {
        k: [] for k in ("clipped", "limit", "mean", "variance", "margin")
    }

    def record(clipped: float, limit: float, margin: float) -> None:
        for key, value in zip(out, (clipped, limit, mean, var, margin), strict=True):
            out[key].append(value)

    for g in map(float, norms):
        if not math.isfinite(g):  # clipax's rule for a broken step
            record(math.nan, math.nan, math.inf)
            continue
        if not initialized:  # warmup: record the norm, clip only to the ceiling
            buffer.append(g)
            if len(buffer) >= warmup_steps:
                mean = sum(buffer) / len(buffer)
                var = sum((x - mean) ** 2 for x in buffer) / len(buffer)
                initialized = True
            # The package clips to max_grad_norm with torch's clip_grad_norm_.
            ceiling = math.inf if max_grad_norm is None else max_grad_norm
            record(min(g, ceiling), math.nan, math.inf)
            continue
        std = var**0.5
        limit = None
        if mode == "percentile":
            boundary = mean + z_thresh * std
            if g > boundary:
                limit = boundary
        else:
            z = (g - mean) / (std + eps)
            boundary = mean + z_thresh * (std + eps)  # z > z_thresh above it
            if z > z_thresh:
                if clip_option == "adaptive_scaling":
                    eta = z / z_thresh
                    limit = (mean + (z_thresh * std) / eta) * clip_factor
                else:
                    limit = mean
        adaptive = limit if limit is not None else g
        effective = adaptive if max_grad_norm is None else min(adaptive, max_grad_norm)
        clipped = min(g, effective)
        if not (limit is not None and skip_update_on_spike):
            seen = limit if limit is not None else g
            mean = alpha * mean + (1 - alpha) * seen
            var = alpha * var + (1 - alpha) * (seen - mean) ** 2
        record(
            clipped,
            math.nan if limit is None else limit,
            abs(g - boundary) / g,
        )
    return {k: np.array(v) for k, v in out.items()}


def ref_zclip(
    norms: np.ndarray, alpha: float, z_threshold: float, warmup: int, mode: str
) -> dict[str, np.ndarray]:
    """`ref_zclip_package` with clipax's defaults, by clipax's names."""
    return ref_zclip_package(
        norms,
        alpha=alpha,
        z_thresh=z_threshold,
        warmup_steps=warmup,
        mode=PACKAGE_MODES[mode],
    )


def test_the_transcription_gives_the_packages_own_figures():
    # The package's tests: mean 1, variance 0.25, z_thresh 2, a norm of 3
    # (z = 4): adaptive scaling clips to 1 + (2 * 0.5) / (4 / 2) = 1.5, "mean"
    # to 1, "percentile" to 1 + 2 * 0.5 = 2. Two warmup norms give that start.
    for options, want in [
        ({}, 1.5),
        ({"clip_option": "mean"}, 1.0),
        ({"mode": "percentile"}, 2.0),
        ({"clip_factor": 0.5}, 0.75),
    ]:
        ref = ref_zclip_package(
            [0.5, 1.5, 3.0], z_thresh=2.0, warmup_steps=2, **options
        )
        np.testing.assert_allclose(ref["clipped"][2], want, rtol=1e-5)
        np.testing.assert_allclose(ref["limit"][2], want, rtol=1e-5)
        assert ref["mean"][1] == 1.0 and ref["variance"][1] == 0.25
    skipped = ref_zclip_package(
        [0.5, 1.5, 3.0], z_thresh=2.0, warmup_steps=2, skip_update_on_spike=True
    )
    assert skipped["mean"][2] == 1.0 and skipped["variance"][2] == 0.25


def long_run_norms(steps: int = 400, seed: int = 3) -> np.ndarray:
    """A few hundred global norms of a training run: a falling trend with 20%
    log-normal noise, single spikes of 4 to 300 times the trend, a decaying
    burst, a lasting rise (steps 150 to 159), and a NaN (in warmup) and an inf
    (after it)."""
    rng = np.random.default_rng(seed)
    t = np.arange(steps)
    norms = (0.8 + 3.0 * np.exp(-t / 60.0)) * np.exp(0.2 * rng.standard_normal(steps))
    factors = {12: 6.0, 60: 30.0, 61: 8.0, 62: 2.5, 250: 300.0, 251: 20.0, 330: 4.0}
    for step, factor in factors.items():
        norms[step] *= factor
    norms[150:160] *= 3.0
    norms[7] = math.nan
    norms[200] = math.inf
    return norms


# The package's options (its names and values), a case per combination that
# matters: each clip option of its "zscore" mode, its "percentile" mode, with
# and without skipping spikes in the statistics, a clip_factor below and above
# 1, and max_grad_norm.
PACKAGE_OPTIONS = [
    {},
    {"skip_update_on_spike": True},
    {"clip_factor": 0.7},
    {"clip_factor": 0.7, "skip_update_on_spike": True, "alpha": 0.9, "z_thresh": 2.0},
    {"clip_factor": 1.5},
    {"clip_option": "mean"},
    {"clip_option": "mean", "skip_update_on_spike": True},
    {"mode": "percentile"},
    {"mode": "percentile", "skip_update_on_spike": True, "warmup_steps": 5},
    {"clip_factor": 0.7, "max_grad_norm": 2.5},
    {"mode": "percentile", "max_grad_norm": 2.5, "skip_update_on_spike": True},
    {"clip_option": "mean", "max_grad_norm": 2.5, "warmup_steps": 10},
]


def clipax_for(options: dict[str, Any]) -> optax.GradientTransformation:
    """The package's `ZClip(**options)` as clipax writes it (docs/porting.md):
    `z_thresh` is `z_threshold`, modes "zscore" and "percentile" are "adaptive"
    and "std", and `max_grad_norm` is `clip_by_global_norm` chained after."""
    options = dict(options)
    max_grad_norm = options.pop("max_grad_norm", None)
    modes = {package: ours for ours, package in PACKAGE_MODES.items()}
    tx = clipax.zclip(
        alpha=options.pop("alpha", 0.97),
        z_threshold=options.pop("z_thresh", 2.5),
        warmup_steps=options.pop("warmup_steps", 25),
        mode=modes[options.pop("mode", "zscore")],
        **options,
    )
    if max_grad_norm is None:
        return tx
    return optax.chain(tx, clipax.clip_by_global_norm(max_grad_norm))


def run_scanned(
    tx: optax.GradientTransformation, norms: np.ndarray, dtype: Any
) -> tuple[Any, Any, Any]:
    """Feeds updates of the given norms (one direction) through `tx.update`,
    all steps in one jitted `lax.scan`; returns the direction, the outputs
    and the states, stacked along a first axis of steps."""
    direction = tree_with_norm(1.0, dtype)

    def step(state: Any, norm: jax.Array) -> tuple[Any, Any]:
        out, state = tx.update(jax.tree.map(lambda d: d * norm, direction), state)
        return state, (out, state)

    scan = jax.jit(lambda state, ns: jax.lax.scan(step, state, ns)[1])
    outputs, states = scan(tx.init(direction), jnp.asarray(norms, dtype))
    return direction, outputs, states


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(
    "options", PACKAGE_OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items())
)
def test_options_match_the_packages_step(options, dtype):
    norms = long_run_norms()
    ref = ref_zclip_package(norms, **options)
    # No norm lies near the spike test's boundary, where float32 could decide
    # otherwise (or the two tests of "percentile" differ, see `zclip`).
    assert ref["margin"].min() > 1e-4
    assert np.isfinite(ref["limit"]).sum() >= 5  # spikes were clipped
    rtol = 2e-5 if dtype == "float32" else 1e-10
    with jax.enable_x64(dtype == "float64"):
        direction, outputs, states = run_scanned(clipax_for(options), norms, dtype)
    zstate = states if isinstance(states, clipax.ZClipState) else states[0]
    squares = [
        np.sum(np.square(np.asarray(x, np.float64)), axis=tuple(range(1, x.ndim)))
        for x in jax.tree.leaves(outputs)
    ]
    out_norms = np.sqrt(sum(squares))
    np.testing.assert_allclose(out_norms, ref["clipped"], rtol=rtol)
    want = jax.tree.map(
        lambda d: np.asarray(d, np.float64) * ref["clipped"].reshape(-1, *[1] * d.ndim),
        direction,
    )
    chex.assert_trees_all_close(
        outputs, want, rtol=rtol, atol=1e-7 if dtype == "float32" else 1e-15
    )
    started = ~np.isnan(ref["mean"])
    np.testing.assert_allclose(zstate.mean[started], ref["mean"][started], rtol=rtol)
    np.testing.assert_allclose(
        zstate.variance[started], ref["variance"][started], rtol=5 * rtol
    )
    spikes = np.isfinite(ref["limit"])
    np.testing.assert_allclose(
        zstate.threshold[spikes], ref["limit"][spikes], rtol=rtol
    )
    np.testing.assert_array_equal(zstate.count, np.cumsum(np.isfinite(norms)))


@pytest.mark.parametrize(
    "options",
    [
        {"mode": "zscore", "z_thresh": 2.0, "max_grad_norm": 2.5, "eps": 1e-6},
        {"mode": "percentile", "z_thresh": 2.5, "max_grad_norm": 2.5},
        {"mode": "zscore", "clip_option": "mean", "eps": 1e-3},
    ],
    ids=["zscore", "percentile", "mean-eps"],
)
def test_the_packages_call_as_written_matches_its_step(options):
    # `ZClip(mode="zscore", z_thresh=..., max_grad_norm=..., eps=...)` as the
    # package is called, by its names; one transformation, max_grad_norm in it.
    norms = long_run_norms()
    ref = ref_zclip_package(norms, **options)
    assert ref["margin"].min() > 1e-4
    _, outputs, states = run_scanned(clipax.zclip(**options), norms, "float32")
    squares = [
        np.sum(np.square(np.asarray(x, np.float64)), axis=tuple(range(1, x.ndim)))
        for x in jax.tree.leaves(outputs)
    ]
    np.testing.assert_allclose(np.sqrt(sum(squares)), ref["clipped"], rtol=2e-5)
    started = ~np.isnan(ref["mean"])
    np.testing.assert_allclose(states.mean[started], ref["mean"][started], rtol=2e-5)
    spikes = np.isfinite(ref["limit"])
    ceiling = options.get("max_grad_norm", math.inf)
    np.testing.assert_allclose(
        states.threshold[spikes], np.minimum(ref["limit"][spikes], ceiling), rtol=2e-5
    )


@pytest.mark.parametrize("mode", ["adaptive", "std"])
@pytest.mark.parametrize("warmup_steps", [1, 5, 25])
@pytest.mark.parametrize(("alpha", "z_threshold"), [(0.97, 2.5), (0.9, 2.0)])
def test_matches_reference_over_a_spike(mode, warmup_steps, alpha, z_threshold):
    norms = spike_norms()
    trees = [tree_with_norm(n) for n in norms]
    tx = clipax.zclip(
        alpha=alpha, z_threshold=z_threshold, warmup_steps=warmup_steps, mode=mode
    )
    outputs, states = run_updates(tx, trees)
    ref = ref_zclip(norms, alpha, z_threshold, warmup_steps, mode)
    for t, (tree, out, state) in enumerate(zip(trees, outputs, states, strict=True)):
        np.testing.assert_allclose(ref_global_norm(out), ref["clipped"][t], rtol=2e-5)
        scale = ref["clipped"][t] / norms[t]
        want = jax.tree.map(lambda x, s=scale: np.asarray(x, np.float64) * s, tree)
        chex.assert_trees_all_close(out, want, rtol=2e-5, atol=1e-7)
        np.testing.assert_allclose(state.norm, norms[t], rtol=1e-5)
        assert int(state.count) == t + 1
        if t + 1 >= warmup_steps:
            np.testing.assert_allclose(state.mean, ref["mean"][t], rtol=2e-5)
            np.testing.assert_allclose(state.variance, ref["variance"][t], rtol=1e-4)
        assert out["none"] is None
    # The spike is clipped, and to below mean + z * std in adaptive mode.
    spike = int(np.argmax(norms))
    before = states[spike - 1]
    limit = float(before.mean + z_threshold * jnp.sqrt(before.variance))
    if mode == "adaptive":
        assert ref_global_norm(outputs[spike]) < limit
    else:
        np.testing.assert_allclose(ref_global_norm(outputs[spike]), limit, rtol=1e-5)
    np.testing.assert_allclose(
        states[spike].threshold, ref["clipped"][spike], rtol=2e-5
    )


def test_warmup_passes_updates_unchanged_and_starts_the_statistics():
    norms = [1.0, 3.0, 1.0, 3.0]
    trees = [tree_with_norm(n) for n in norms]
    outputs, states = run_updates(clipax.zclip(warmup_steps=4), trees)
    for tree, out, state in zip(trees, outputs, states, strict=True):
        chex.assert_trees_all_equal(out, tree)
        assert float(state.threshold) == math.inf
    np.testing.assert_allclose(states[-1].buffer, norms, rtol=1e-6)
    np.testing.assert_allclose(states[-1].mean, 2.0, rtol=1e-6)
    np.testing.assert_allclose(states[-1].variance, 1.0, rtol=1e-6)  # population


def test_threshold_when_not_clipped_is_the_z_score_limit():
    norms = [1.0, 3.0, 2.5]
    _, states = run_updates(
        clipax.zclip(warmup_steps=2), [tree_with_norm(n) for n in norms]
    )
    np.testing.assert_allclose(states[-1].threshold, 2.0 + 2.5 * (1.0 + 1e-6))


def test_zero_variance_clips_to_the_mean_without_nan():
    norms = [2.0, 2.0, 2.0, 2.0, 7.0]
    outputs, states = run_updates(
        clipax.zclip(warmup_steps=3), [tree_with_norm(n) for n in norms]
    )
    np.testing.assert_allclose(ref_global_norm(outputs[3]), 2.0, rtol=1e-6)  # z = 0
    np.testing.assert_allclose(ref_global_norm(outputs[4]), 2.0, rtol=1e-6)
    for state in states:
        chex.assert_tree_all_finite((state.mean, state.variance))


def test_clipping_keeps_the_direction():
    norms = [1.0, 1.2, 0.9, 50.0]
    trees = [tree_with_norm(n) for n in norms]
    outputs, _ = run_updates(clipax.zclip(warmup_steps=3), trees)
    ratio = outputs[-1]["w"] / trees[-1]["w"]
    np.testing.assert_allclose(ratio, ratio[0, 0], rtol=1e-5)
    assert 0 < ratio[0, 0] < 0.1


def test_non_finite_norm_skips_the_statistics_and_gives_nan():
    tx = clipax.zclip(warmup_steps=2)
    update = jax.jit(tx.update)
    for steps_before in (1, 3):  # inside and after warmup
        state = tx.init(tree_with_norm(1.0))
        for n in [1.0, 2.0, 1.5][:steps_before]:
            _, state = update(tree_with_norm(n), state)
        for bad in (math.nan, math.inf):
            tree = tree_with_norm(1.0)
            tree["w"][1, 1] = bad
            out, after = update(tree, state)
            assert all(np.isnan(leaf).all() for leaf in jax.tree.leaves(out))
            for name in ("mean", "variance", "count", "threshold", "buffer"):
                chex.assert_trees_all_equal(getattr(after, name), getattr(state, name))


def test_apply_if_finite_skips_a_broken_step():
    tx = optax.apply_if_finite(clipax.zclip(warmup_steps=1), max_consecutive_errors=3)
    state = tx.init(tree_with_norm(1.0))
    _, state = tx.update(tree_with_norm(1.0), state)
    tree = tree_with_norm(1.0)
    tree["b"][0] = math.inf
    updates, state = tx.update(tree, state)
    assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
    assert int(state.inner_state.count) == 1


@pytest.mark.parametrize(
    "options",
    [
        {"mode": "adaptive"},
        {"mode": "std"},
        {"mode": "std", "skip_update_on_spike": True},
        {"clip_option": "mean", "skip_update_on_spike": True},
        {"clip_factor": 0.7, "skip_update_on_spike": True},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_compiles_once_across_warmup(options):
    tx = clipax.zclip(warmup_steps=3, **options)
    tree = jax.tree.map(jnp.asarray, tree_with_norm(2.0))

    def step(grads, state):
        updates, state = tx.update(grads, state)
        return jax.tree.map(lambda u: 1.5 * u, updates), state

    _, state = assert_compiles_once(step, tree, tx.init(tree), calls=8)
    assert int(state.count) == 8
    assert np.isfinite(state.threshold)  # past warmup, spikes clipped on device


def test_clip_factor_may_be_traced_under_inject_hyperparams():
    factory = optax.inject_hyperparams(
        clipax.zclip, static_args=("warmup_steps", "mode", "clip_option")
    )
    tx = factory(clip_factor=0.7, warmup_steps=5, skip_update_on_spike=True)
    norms = long_run_norms()[:120]
    outputs, states = run_updates(tx, [tree_with_norm(n) for n in norms])
    ref = ref_zclip_package(
        norms, clip_factor=0.7, warmup_steps=5, skip_update_on_spike=True
    )
    np.testing.assert_allclose(
        [ref_global_norm(o) for o in outputs], ref["clipped"], rtol=2e-5
    )
    assert states[-1].hyperparams["clip_factor"].dtype == jnp.float32


def test_traced_hyperparameters_under_inject_hyperparams():
    factory = optax.inject_hyperparams(
        clipax.zclip, static_args=("warmup_steps", "mode")
    )
    tx = factory(alpha=0.9, z_threshold=2.0, warmup_steps=3)
    norms = spike_norms()[:60]
    outputs, _ = run_updates(tx, [tree_with_norm(n) for n in norms])
    ref = ref_zclip(norms, 0.9, 2.0, 3, "adaptive")
    np.testing.assert_allclose(
        [ref_global_norm(o) for o in outputs], ref["clipped"], rtol=2e-5
    )


def test_dtypes_are_kept_and_statistics_are_float32():
    tree = {"h": jnp.full((4,), 300.0, jnp.bfloat16), "m": optax.MaskedNode()}
    tx = clipax.zclip(warmup_steps=1)
    state = tx.init(tree)
    assert state.mean.dtype == jnp.float32 and state.buffer.shape == (1,)
    _, state = tx.update(tree, state)
    np.testing.assert_allclose(state.mean, 600.0, rtol=1e-6)  # no bf16 overflow
    out, state = tx.update(jax.tree.map(lambda x: 2 * x, tree), state)
    chex.assert_trees_all_equal_shapes_and_dtypes(out, tree)
    assert isinstance(out["m"], optax.MaskedNode)
    np.testing.assert_allclose(out["h"].astype(np.float32), 300.0, rtol=1e-2)


def test_init_rejects_integer_leaves():
    with pytest.raises(TypeError, match=r"\['i'\].*int32"):
        clipax.zclip().init({"i": jnp.zeros(2, jnp.int32)})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"alpha": 0.0}, r"`alpha` must be a real number strictly between 0 and 1"),
        ({"alpha": 1.0}, r"`alpha`.*got 1.0"),
        ({"alpha": math.nan}, r"`alpha`.*got nan"),
        ({"z_threshold": 0.0}, r"`z_threshold` must be a finite real number > 0"),
        ({"z_threshold": -2.5}, r"`z_threshold`.*got -2.5"),
        ({"z_threshold": math.inf}, r"`z_threshold`.*got inf"),
        ({"warmup_steps": 0}, r"`warmup_steps` must be an int >= 1; got 0"),
        ({"warmup_steps": 2.5}, r"`warmup_steps`.*got 2.5"),
        ({"warmup_steps": 2**31}, r"`warmup_steps` must be an int <= 2147483647"),
        (
            {"mode": "median"},
            r'`mode` must be "adaptive", "std", "zscore" or "percentile"; got '
            r"'median'",
        ),
        (
            {"clip_option": "median"},
            r'`clip_option` must be "adaptive_scaling" or "mean"; got \'median\'',
        ),
        (
            {"clip_option": "mean", "mode": "std"},
            r'mode "std" .* takes only the default clip_option="adaptive_scaling"; '
            r"got 'mean'",
        ),
        ({"clip_factor": 0.0}, r"`clip_factor` must be a finite real number > 0"),
        ({"clip_factor": -0.5}, r"`clip_factor`.*got -0.5"),
        ({"clip_factor": math.nan}, r"`clip_factor`.*got nan"),
        ({"clip_factor": math.inf}, r"`clip_factor`.*got inf"),
        (
            {"clip_factor": 0.8, "mode": "std"},
            r"`clip_factor` scales the limit .* would change nothing here; got "
            r"clip_factor=0.8 with mode='std'",
        ),
        (
            {"clip_factor": 0.8, "clip_option": "mean"},
            r"`clip_factor`.*clip_option='mean'",
        ),
    ],
)
def test_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        clipax.zclip(**kwargs)


@pytest.mark.parametrize("value", [1, "yes", None, np.array([True])])
def test_skip_update_on_spike_must_be_a_bool(value):
    with pytest.raises(TypeError, match=r"`skip_update_on_spike` must be True or"):
        clipax.zclip(skip_update_on_spike=value)


def test_the_defaults_of_the_new_options_are_todays_rule():
    norms = long_run_norms()
    trees = [tree_with_norm(n) for n in norms[:80]]
    default, _ = run_updates(clipax.zclip(warmup_steps=5), trees)
    explicit, _ = run_updates(
        clipax.zclip(
            warmup_steps=5,
            clip_option="adaptive_scaling",
            clip_factor=1.0,
            skip_update_on_spike=False,
        ),
        trees,
    )
    chex.assert_trees_all_equal(explicit, default)
    # mode "std" accepts the defaults too, and a clip_factor of exactly 1.
    clipax.zclip(mode="std", clip_option="adaptive_scaling", clip_factor=1)


def test_arguments_are_keyword_only():
    with pytest.raises(TypeError):
        clipax.zclip(0.97)  # type: ignore[misc]


@pytest.mark.parametrize("mode", ["adaptive", "std"])
def test_same_numbers_sharded_and_under_pmap(mode):
    single, sharded, pmapped = sharded_and_pmap_runs(
        lambda **kw: clipax.zclip(warmup_steps=5, mode=mode, **kw)
    )
    chex.assert_trees_all_close(sharded, single, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(pmapped, single, rtol=1e-4, atol=1e-5)


def test_float64_updates_keep_float64_statistics():
    with jax.enable_x64(True):
        tree = {"a": jnp.array([1.0, 1e-4], jnp.float64)}
        tx = clipax.zclip(warmup_steps=1)
        _, state = jax.jit(tx.update)(tree, tx.init(tree))
        assert state.mean.dtype == jnp.float64
        assert float(state.mean) == math.sqrt(1.0 + 1e-8)


def test_traced_warmup_steps_asks_for_static_args():
    tx = optax.inject_hyperparams(clipax.zclip)(warmup_steps=3)
    with pytest.raises(TypeError, match=r"`warmup_steps` got a traced value"):
        jax.jit(tx.init)(tree_with_norm(1.0))
