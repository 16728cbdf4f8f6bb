"""`clip_by_spectral_norm`: SPECTRA's soft clip of each update matrix's
singular values, sigma / sqrt(1 + sigma**2 / c**2), by Newton-Schulz or SVD."""

from __future__ import annotations

import functools
import json
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers as Dims

import clipax
from tests.helpers import DATA, assert_compiles_once, collectives

METHODS = ["newton_schulz", "svd"]


def exact(x, c):
    """The soft clip of each matrix x[..., :, :] by float64 NumPy SVD."""
    u, s, vt = np.linalg.svd(np.asarray(x, np.float64), full_matrices=False)
    return (u * (s / np.sqrt(1 + (s / c) ** 2))[..., None, :]) @ vt


def matrix(shape, sigma_max, seed=0, kind="gauss"):
    """A random float64 matrix with largest singular value `sigma_max`: a
    Gaussian one, one whose spectrum falls over four decades ("decades"), or
    a Gaussian bulk below 1 plus one large rank-one spike ("spike")."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    if kind == "decades":
        u, _ = np.linalg.qr(rng.standard_normal((shape[0], min(shape))))
        v, _ = np.linalg.qr(rng.standard_normal((shape[1], min(shape))))
        x = (u * np.logspace(0, -4, min(shape))) @ v.T
    if kind == "spike":
        a, b = (rng.standard_normal(n) for n in shape)
        x = x / np.linalg.norm(x, 2) + sigma_max * np.outer(a, b) / np.linalg.norm(
            np.outer(a, b), 2
        )
    return x * sigma_max / np.linalg.norm(x, 2)


def relative_error(y, want):
    want = np.asarray(want, np.float64)
    return np.linalg.norm(np.asarray(y, np.float64) - want) / np.linalg.norm(want)


def clipped(tx, updates):
    return jax.jit(tx.update)(updates, tx.init(updates))


# Values.


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(8, 8), (12, 5), (5, 12)], ids=str)
def test_values_match_the_float64_svd_of_the_formula(method, shape) -> None:
    c = 0.5
    ratios = {"above": 50.0, "near": 1.2, "below": 0.3}
    tree = {k: matrix(shape, r * c, seed=i) for i, (k, r) in enumerate(ratios.items())}
    y, state = clipped(clipax.clip_by_spectral_norm(c, method=method), tree)
    chex.assert_trees_all_close(y, {k: exact(x, c) for k, x in tree.items()}, atol=5e-6)
    assert state.clipped == {k: r > 1 for k, r in ratios.items()}
    sigma = {k: np.linalg.norm(x, 2) for k, x in tree.items()}
    rtol = 1e-5 if method == "svd" else 2e-2  # power steps: from below, close
    chex.assert_trees_all_close(state.sigma_max, sigma, rtol=rtol)


@pytest.mark.parametrize("method", METHODS)
def test_each_matrix_of_a_batch_is_clipped_alone(method) -> None:
    # Axis 0 of a conv-like (batch, in, out) leaf is a batch of matrices; an
    # attention kernel (embed, heads, head_dim) is one (embed, heads*head_dim).
    x = np.stack([matrix((6, 4), r, seed=i) for i, r in enumerate((0.2, 3.0, 40.0))])
    kernel = matrix((6, 12), 20.0, seed=4).reshape(6, 3, 4)
    dims = {"conv": Dims(1, 2), "attn": Dims(reduction_axis=0, output_axis=(1, 2))}
    tx = clipax.clip_by_spectral_norm(1.0, method=method, weight_dimension_numbers=dims)
    y, state = clipped(tx, {"conv": x, "attn": kernel})
    chex.assert_trees_all_close(y["conv"], exact(x, 1.0), atol=3e-6)
    want = exact(kernel.reshape(6, 12), 1.0).reshape(6, 3, 4)
    chex.assert_trees_all_close(y["attn"], want, atol=3e-6)
    rtol = 1e-5 if method == "svd" else 2e-2  # power steps: from below, close
    chex.assert_trees_all_close(
        state.sigma_max, {"conv": 40.0, "attn": 20.0}, rtol=rtol
    )
    # The same matrix with its sides swapped in the leaf: the same clip.
    swapped = Dims(reduction_axis=(2, 1), output_axis=0)
    tx = clipax.clip_by_spectral_norm(
        1.0, method=method, weight_dimension_numbers=swapped
    )
    y, _ = clipped(tx, kernel.transpose(0, 2, 1))
    chex.assert_trees_all_close(y, want.transpose(0, 2, 1), atol=3e-6)


@pytest.mark.parametrize("method", METHODS)
def test_a_stacked_leaf_equals_the_unrolled_model_layer_by_layer(method) -> None:
    layers = np.stack(
        [matrix((5, 7), r, seed=i) for i, r in enumerate((0.5, 2.0, 30.0))]
    )
    stack = {"blocks": {"w": layers, "b": np.ones((3, 7))}, "head": matrix((7, 2), 4.0)}
    unrolled = {
        "blocks": [{"w": w, "b": np.ones(7)} for w in layers],
        "head": stack["head"],
    }
    tx = clipax.clip_by_spectral_norm(
        1.0, method=method, stacked={"blocks": 1, "head": 0}
    )
    y, state = clipped(tx, stack)
    twin = clipax.clip_by_spectral_norm(1.0, method=method)
    y_unrolled, state_unrolled = clipped(twin, unrolled)
    for i in range(3):
        chex.assert_trees_all_close(
            y["blocks"]["w"][i], y_unrolled["blocks"][i]["w"], atol=1e-6
        )
    chex.assert_trees_all_equal(y["blocks"]["b"], stack["blocks"]["b"])
    assert (
        dict(clipax.metrics(state)).keys()
        == dict(clipax.metrics(state_unrolled)).keys()
    )
    chex.assert_trees_all_close(
        dict(clipax.metrics(state)), dict(clipax.metrics(state_unrolled))
    )
    assert state.sigma_max["blocks"]["w"].shape == (3,)


def test_the_step_is_jitted_once() -> None:
    tx = clipax.clip_by_spectral_norm(1.0, weight_dimension_numbers=Dims(1, 2))
    x = jnp.asarray(np.stack([matrix((4, 6), 5.0, seed=i) for i in range(2)]))

    def step(x, state):
        y, state = tx.update(x, state)
        return 2 * y, state

    assert_compiles_once(step, x, tx.init(x))


def test_dtypes_kept_and_computed_in_float32() -> None:
    x = jnp.asarray(matrix((6, 4), 9.0), jnp.bfloat16)
    tx = clipax.clip_by_spectral_norm(1.0)
    y, state = clipped(tx, {"w": x, "step": jnp.arange(3)})  # int leaves pass
    assert y["w"].dtype == jnp.bfloat16 and state.sigma_max["w"].dtype == jnp.float32
    want = exact(np.asarray(x, np.float64), 1.0)
    chex.assert_trees_all_close(
        np.asarray(y["w"], np.float64), want, rtol=1e-2, atol=1e-2
    )
    chex.assert_trees_all_equal(y["step"], jnp.arange(3))
    with jax.enable_x64(True):
        y, state = clipped(tx, jnp.asarray(matrix((6, 4), 9.0), jnp.float64))
        assert y.dtype == state.sigma_max.dtype == jnp.float64
        chex.assert_trees_all_close(y, exact(matrix((6, 4), 9.0), 1.0), atol=1e-12)


# The authors' outputs (tests/data/spectra.json: clip_sigvals run with torch).


SPECTRA = json.loads((DATA / "spectra.json").read_text())["cases"]


@pytest.mark.parametrize("case", SPECTRA, ids=lambda case: case["name"])
def test_the_authors_outputs(case) -> None:
    x = jnp.asarray(case["x"], jnp.float32)
    dims = Dims(1, 2) if x.ndim == 3 else None  # their batch: axis 0

    def txs():
        for method, steps in (
            ("spectra", 5),
            ("spectra", 10),
            ("svd", None),
            ("newton_schulz", None),
        ):
            yield clipax.clip_by_spectral_norm(
                case["c"], method=method, ns_steps=steps, weight_dimension_numbers=dims
            )

    @jax.jit
    def run(x):  # one compilation for the four
        return [tx.update(x, tx.init(x))[0] for tx in txs()]

    want = {
        key: np.asarray(case[key])
        for key in ("exact_float64", "float32_ns5", "float32_ns10")
    }
    peak = np.abs(want["exact_float64"]).max()
    ns5, ns10, svd, ours = (np.asarray(y, np.float64) for y in run(x))
    # Their scaling and their steps: their float32 outputs, to rounding.
    chex.assert_trees_all_close(ns5, want["float32_ns5"], atol=5e-6 * peak)
    chex.assert_trees_all_close(ns10, want["float32_ns10"], atol=5e-6 * peak)
    chex.assert_trees_all_close(svd, want["exact_float64"], atol=2e-6 * peak)
    chex.assert_trees_all_close(ours, want["exact_float64"], atol=1e-5 * peak)


def test_the_default_is_within_one_percent_up_to_ratio_100() -> None:
    worst = {}
    txs = [
        clipax.clip_by_spectral_norm(1.0, method=m)
        for m in ("newton_schulz", "spectra")
    ]
    runs = [(jax.jit(tx.update), tx.init(jnp.zeros((48, 32)))) for tx in txs]
    for kind in ("gauss", "decades", "spike"):
        for ratio in (1.0, 10.0, 50.0, 100.0):
            x = matrix((48, 32), ratio, seed=7, kind=kind)
            outs = [update(x, state)[0] for update, state in runs]
            errors = [relative_error(out, exact(x, 1.0)) for out in outs]
            worst[kind, ratio] = errors
    assert max(ours for ours, _ in worst.values()) < 1e-2, worst
    # SPECTRA's iteration at its own 10 steps: off by far more than 1 %.
    assert max(theirs for _, theirs in worst.values()) > 5e-2, worst


def test_the_error_table_script() -> None:
    rows = _spectral_table()
    assert rows[("newton_schulz", 10)][100.0] < 1e-2
    assert rows[("spectra", 10)][100.0] > 1e-2


def _spectral_table():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench_spectral.py"
    spec = importlib.util.spec_from_file_location("bench_spectral", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.error_table(ratios=(1.0, 100.0), steps=(10,), shape=(24, 16))


# SPECTRA with AdamW as an optax chain (docs/porting.md, "From SPECTRA").


def _spectra_chain(lr, clip_c, base_lr, warmup_steps, weight_decay, method):
    def threshold(step):  # c * lr constant in the warm-up, then clip_c
        warm = clip_c * base_lr / jnp.maximum(lr(step), 1e-10)
        return jnp.where(step < warmup_steps, warm, clip_c)

    def rectangular(updates, params=None):  # sqrt(max(1, out / in)), (in, out)
        return jax.tree.map(
            lambda u: u * max(1, u.shape[1] / u.shape[0]) ** 0.5 if u.ndim == 2 else u,
            updates,
        )

    return optax.chain(
        optax.scale_by_adam(0.9, 0.95, 1e-8),
        clipax.clip_by_spectral_norm(threshold, method=method),
        optax.stateless(rectangular),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(lr),
    )


def spectra_adamw_steps(params, grads, lrs, clip_c, base_lr, warmup_steps, wd):
    """Each step's update of SPECTRA over torch's AdamW (b1 0.9, b2 0.95, eps
    1e-8) in float64, from src/optim/spectra.py: U, AdamW's direction; for a
    2-D parameter (a kernel (in, out), the torch weight transposed) U soft-
    clipped by SVD at c (c * lr = clip_c * base_lr in the warm-up, then
    clip_c) and scaled by sqrt(max(1, out / in)); X (1 - lr wd) - lr U."""
    b1, b2, eps = 0.9, 0.95, 1e-8
    x = {k: np.asarray(p, np.float64) for k, p in params.items()}
    m = {k: np.zeros_like(p) for k, p in x.items()}
    v = {k: np.zeros_like(p) for k, p in x.items()}
    steps = []
    for t, (g, lr) in enumerate(zip(grads, lrs, strict=True)):
        c = clip_c * base_lr / max(lr, 1e-10) if t < warmup_steps else clip_c
        new = {}
        for k in x:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            u = m[k] / (1 - b1 ** (t + 1)) / (np.sqrt(v[k] / (1 - b2 ** (t + 1))) + eps)
            if u.ndim == 2:
                weight = u.T  # torch's (out, in)
                alpha = max(1, weight.shape[-2] / weight.shape[-1]) ** 0.5
                u = (alpha * exact(weight, c)).T
            new[k] = (1 - lr * wd) * x[k] - lr * u
        steps.append({k: new[k] - x[k] for k in x})
        x = new
    return steps


@pytest.mark.parametrize(
    "method, rtol, atol", [("svd", 1e-5, 1e-8), ("newton_schulz", 1e-5, 2e-8)]
)
def test_spectra_with_adamw_as_an_optax_chain_matches_float64_numpy(
    method, rtol, atol
) -> None:
    rng = np.random.default_rng(0)
    shapes = {"w": (6, 4), "v": (4, 6), "b": (4,)}
    params = {k: rng.standard_normal(shape) for k, shape in shapes.items()}
    grads = [{k: rng.standard_normal(s) for k, s in shapes.items()} for _ in range(5)]
    lr = optax.linear_schedule(5e-3, 1e-2, transition_steps=3)  # warm-up: 3 steps
    lrs, clip_c = [float(lr(t)) for t in range(5)], 0.35  # c: 0.7 down to 0.35
    wants = spectra_adamw_steps(params, grads, lrs, clip_c, 1e-2, 3, wd=0.1)
    tx = _spectra_chain(lr, clip_c, 1e-2, 3, weight_decay=0.1, method=method)
    x = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
    state, step = tx.init(x), jax.jit(tx.update)
    for t, (g, want) in enumerate(zip(grads, wants, strict=True)):
        updates, state = step(jax.tree.map(jnp.float32, g), state, x)
        chex.assert_trees_all_close(updates, want, rtol=rtol, atol=atol)
        c = clip_c * 1e-2 / lrs[t] if t < 3 else clip_c
        for k in ("w", "v"):  # where the clip acts: sigma_max / c from 3 to 10
            assert 3 < state[1].sigma_max[k] / c < 10, (t, k, state[1].sigma_max)
        x = optax.apply_updates(x, updates)


# State, metrics, thresholds.


def test_state_and_metrics() -> None:
    w = matrix((4, 3), 6.0)
    tx = clipax.clip_by_spectral_norm(2.0, method="svd")
    tree = {"w": w, "b": np.ones(3), "small": matrix((3, 3), 1.0)}
    state = tx.init(tree)
    assert state.sigma_max == {"w": 0.0, "b": None, "small": 0.0}
    _, state = tx.update(tree, state)
    logs = clipax.metrics(state)
    assert list(logs) == [
        "clip_by_spectral_norm/count",
        "clip_by_spectral_norm/small/sigma_max",
        "clip_by_spectral_norm/w/sigma_max",
        "clip_by_spectral_norm/small/clipped",
        "clip_by_spectral_norm/w/clipped",
    ]
    np.testing.assert_allclose(
        logs["clip_by_spectral_norm/w/sigma_max"], 6.0, rtol=1e-6
    )
    assert logs["clip_by_spectral_norm/w/clipped"]
    assert not logs["clip_by_spectral_norm/small/clipped"]
    assert logs["clip_by_spectral_norm/count"] == 1


def test_sigma_max_by_power_steps_is_close_from_below() -> None:
    # A Gaussian matrix's top singular values crowd together: the hardest case.
    x = matrix((96, 64), 3.0, seed=3)
    _, state = clipped(clipax.clip_by_spectral_norm(1.0), x)
    assert 0.97 * 3.0 < state.sigma_max <= 3.0 * (1 + 1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_infinite_zero_and_nan_thresholds(method) -> None:
    x = jnp.asarray(matrix((5, 4), 7.0), jnp.float32)

    @jax.jit
    def run(c):  # an array threshold is data: one compilation for all
        tx = clipax.clip_by_spectral_norm(c, method=method)
        return tx.update(x, tx.init(x))

    same, state = run(jnp.inf)
    chex.assert_trees_all_equal(same, x)  # bit for bit
    assert not state.clipped
    for c, want in ((0.0, 0.0), (-1.0, 0.0), (np.nan, np.nan)):  # <= 0: zeros
        chex.assert_trees_all_equal(run(c)[0], jnp.full_like(x, want))
    assert clipax.clip_by_spectral_norm(np.inf) is not None  # a number: allowed


def test_a_schedule_and_inject_hyperparams() -> None:
    x = jnp.asarray(matrix((5, 4), 7.0), jnp.float32)
    schedule = optax.linear_schedule(0.0, 2.0, transition_steps=2)
    tx = clipax.clip_by_spectral_norm(schedule)
    injected = optax.inject_hyperparams(clipax.clip_by_spectral_norm)(
        max_singular_value=schedule
    )
    state, inner = tx.init(x), injected.init(x)
    step, step_injected = jax.jit(tx.update), jax.jit(injected.update)

    @jax.jit
    def fixed(c):  # the threshold as data
        tx = clipax.clip_by_spectral_norm(c)
        return tx.update(x, tx.init(x))[0]

    for count, c in enumerate([0.0, 1.0, 2.0, 2.0]):
        y, state = step(x, state)
        y_injected, inner = step_injected(x, inner)
        chex.assert_trees_all_close(y, fixed(c), y_injected, atol=1e-6)
        assert state.count == count + 1


@pytest.mark.parametrize("method", METHODS)
def test_a_nan_matrix_gives_nan_and_nothing_else_changes(method) -> None:
    x = matrix((4, 4), 5.0)
    tx = clipax.clip_by_spectral_norm(1.0, method=method)
    update, state = jax.jit(tx.update), tx.init({"bad": x, "good": x})
    for bad in (np.nan, np.inf):
        broken = x.copy()
        broken[1, 2] = bad
        y, new = update({"bad": broken, "good": x}, state)
        assert np.isnan(y["bad"]).all() and np.isnan(new.sigma_max["bad"])
        chex.assert_trees_all_close(y["good"], exact(x, 1.0), atol=2e-6)


@pytest.mark.parametrize("method", METHODS)
def test_gradients_match_float64_autodiff_of_the_formula(method) -> None:
    x = matrix((6, 4), 5.0, seed=1)
    weights = np.random.default_rng(2).standard_normal((6, 4)).astype(np.float32)

    def reference(x, c):  # x (I + x^T x / c^2)^(-1/2), by eigh
        eigenvalues, v = jnp.linalg.eigh(jnp.eye(4) + x.T @ x / c**2)
        return jnp.sum(weights * (x @ (v * eigenvalues**-0.5) @ v.T))

    def loss(x, c):  # the threshold traced too: data
        tx = clipax.clip_by_spectral_norm(c, method=method)
        return jnp.sum(weights * tx.update(x, tx.init(x))[0])

    with jax.enable_x64(True):
        wants = jax.grad(reference, (0, 1))(jnp.asarray(x), jnp.asarray(1.5))
        wants = [np.asarray(want) for want in wants]
    gots = jax.jit(jax.grad(loss, (0, 1)))(
        jnp.asarray(x, jnp.float32), jnp.float32(1.5)
    )
    for got, want in zip(gots, wants, strict=True):
        chex.assert_trees_all_close(got, want, atol=2e-5 * np.abs(want).max())


def test_svd_gradients_where_singular_values_repeat() -> None:
    tx = clipax.clip_by_spectral_norm(1.0, method="svd")
    state = tx.init(jnp.zeros((3, 3)))
    grad = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(tx.update(x, state)[0]))))
    for a in (0.0, 2.0):
        # At X = a I: Y = a h I, h = (1 + a^2)^(-1/2), and a loss of Y with
        # gradient C (symmetric) has gradient (h - a^2 h^3) C in X.
        h = 1 / math.sqrt(1 + a**2)
        want = (h - a**2 * h**3) * np.cos(a * h * np.eye(3))
        chex.assert_trees_all_close(grad(a * jnp.eye(3)), want, atol=1e-6)


# Bad input.


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"max_singular_value": 0.0},
            "`max_singular_value` must be a positive scalar (a real number, a NumPy "
            "or JAX scalar, or a traced value); inf means no clipping; got 0.0.",
        ),
        (
            {"max_singular_value": -2},
            "`max_singular_value` must be a positive scalar (a real number, a NumPy "
            "or JAX scalar, or a traced value); inf means no clipping; got -2.",
        ),
        (
            {"max_singular_value": float("nan")},
            "`max_singular_value` must be a positive scalar (a real number, a NumPy "
            "or JAX scalar, or a traced value); inf means no clipping; got nan.",
        ),
        (
            {"max_singular_value": [1.0, 2.0]},
            "`max_singular_value` must be a positive scalar (a real number, a NumPy "
            "or JAX scalar, or a traced value); inf means no clipping; got an array "
            "of shape (2,).",
        ),
        (
            {"max_singular_value": 1.0, "method": "qr"},
            '`method` must be "newton_schulz", "spectra" or "svd"; got \'qr\'.',
        ),
        (
            {"max_singular_value": 1.0, "ns_steps": 0},
            "`ns_steps` must be an int >= 1; got 0.",
        ),
        (
            {"max_singular_value": 1.0, "method": "svd", "ns_steps": 5},
            "`ns_steps` means nothing with method='svd'; got 5.",
        ),
    ],
)
def test_bad_arguments_at_construction(kwargs, message) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        clipax.clip_by_spectral_norm(**kwargs)


W = {"w": jnp.ones((4, 3))}
WI = {"w": jnp.ones((4, 3)), "i": jnp.ones((2, 2), jnp.int32)}


@pytest.mark.parametrize(
    "tree, dims, error, message",
    [
        (
            W,
            Dims(0, 2),
            ValueError,
            "`output_axis`=2 is out of range for the leaf at ['w'] with shape "
            "(4, 3) (rank 2).",
        ),
        (
            W,
            Dims(0, (1, 0)),
            ValueError,
            "`weight_dimension_numbers` gives the leaf at ['w'] with shape (4, 3) "
            "the reduction axes (0,) and the output axes (1, 0): they must not "
            "overlap.",
        ),
        (
            WI,
            {"w": Dims(), "i": Dims()},
            TypeError,
            "`clip_by_spectral_norm` clips float matrices; the leaf at ['i'] with "
            "shape (2, 2) has dtype int32. Cast it, or give it None in "
            "`weight_dimension_numbers`.",
        ),
        (
            WI,
            {"w": "2d", "i": None},
            TypeError,
            "`weight_dimension_numbers` must be None, a MuonDimensionNumbers, a "
            "prefix of the updates holding them or None; at ['w'] it holds '2d'.",
        ),
    ],
)
def test_bad_leaves_name_their_path(tree, dims, error, message) -> None:
    tx = clipax.clip_by_spectral_norm(1.0, weight_dimension_numbers=dims)
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        tx.init(tree)


def test_a_function_of_the_params_gives_the_dimension_numbers() -> None:
    def dims(params):  # Muon's spelling: 3-D kernels batched on axis 0
        return jax.tree.map(lambda x: Dims(1, 2) if x.ndim == 3 else None, params)

    tree = {"k": np.stack([matrix((3, 3), 1.0), matrix((3, 3), 2.0, seed=1)])}
    tree["w"] = matrix((3, 3), 9.0)
    y, state = clipped(
        clipax.clip_by_spectral_norm(0.5, weight_dimension_numbers=dims), tree
    )
    chex.assert_trees_all_close(y["k"], exact(tree["k"], 0.5), atol=2e-6)
    chex.assert_trees_all_equal(y["w"], jnp.asarray(tree["w"], jnp.float32))
    assert state.sigma_max["w"] is None


def test_another_tree_is_refused() -> None:
    tx = clipax.clip_by_spectral_norm(1.0)
    state = tx.init({"w": jnp.ones((3, 2))})
    with pytest.raises(ValueError, match=r"the updates have a leaf at \['v'\]"):
        tx.update({"v": jnp.ones((3, 2))}, state)


# Devices.


@functools.cache
def _sharding_case():
    """A tree, a clip, and the clip on one device (shared by the layouts)."""
    tree = {
        "w": matrix((16, 8), 5.0),  # rows split
        "cols": matrix((16, 8), 6.0, seed=5),  # the smaller side split
        "s": np.stack([matrix((8, 12), r, seed=i) for i, r in enumerate((1, 3, 5, 7))]),
        "attn": matrix((8, 16), 9.0).reshape(8, 4, 4),  # heads split
    }
    dims = {"w": Dims(), "cols": Dims(), "s": Dims(), "attn": Dims(0, (1, 2))}
    tx = clipax.clip_by_spectral_norm(
        1.0,
        stacked={"w": 0, "cols": 0, "s": 1, "attn": 0},
        weight_dimension_numbers=dims,
    )
    return tree, tx, clipped(tx, tree)


@pytest.mark.devices(4)
@pytest.mark.parametrize("kind", ["Auto", "Explicit"])
def test_sharded_leaves_under_jit_give_one_devices_numbers(kind) -> None:
    mesh = jax.make_mesh((4,), ("d",), axis_types=(getattr(AxisType, kind),))
    tree, tx, (want, want_state) = _sharding_case()
    layouts = {"w": P("d"), "cols": P(None, "d"), "s": P("d"), "attn": P(None, "d")}
    with jax.set_mesh(mesh):  # s: its layers split
        placed = {
            k: jax.device_put(x, NamedSharding(mesh, layouts[k]))
            for k, x in tree.items()
        }
        got, state = clipped(tx, placed)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(state.sigma_max, want_state.sigma_max, rtol=1e-5)
    for k in layouts:  # placed as given
        assert got[k].sharding.is_equivalent_to(placed[k].sharding, got[k].ndim), k


@pytest.mark.devices(4)
def test_on_an_explicit_mesh_the_gram_matrix_is_summed_not_the_matrix_gathered():
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Explicit,))
    x = matrix((16, 8), 5.0)
    tx = clipax.clip_by_spectral_norm(1.0)
    with jax.set_mesh(mesh):
        placed = jax.device_put(x, P("d"))
        hlo = jax.jit(tx.update).lower(placed, tx.init(placed)).compile().as_text()
    # One all-reduce of the 8 x 8 Gram matrix (older JAX keeps its unit layer
    # and batch axes); nothing of the 16 x 8 matrix.
    [(shape, op)] = collectives(hlo)
    dims = [int(d) for d in re.findall(r"\d+", shape.split("{")[0][4:])]
    unit_free = [d for d in dims if d != 1]
    assert (shape[:4], op, unit_free) == ("f32[", "all-reduce", [8, 8]), shape


def _in_shard_map(tx, tree, specs, state_specs, check_vma=True):
    """`tx`'s first update of `tree`, placed as `specs` on a mesh of 4."""
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        placed = jax.tree.map(lambda x, s: jax.device_put(x, s), tree, specs)
        step = jax.shard_map(
            lambda t: tx.update(t, tx.init(t)),
            mesh=mesh,
            in_specs=(specs,),
            out_specs=(specs, state_specs),
            check_vma=check_vma,
        )
        return jax.jit(step)(placed)


@functools.cache
def _specs_case():
    """Each layout `specs` takes, one leaf each, and the clip on one device."""
    tree = {
        "rows": matrix((16, 8), 5.0),  # the larger side split
        "cols": matrix((16, 8), 6.0, seed=1),  # the smaller: its Gram is 16 x 16
        "wide": matrix((8, 16), 4.0, seed=2),  # the output axis split
        "layers": np.stack(
            [matrix((8, 12), r, seed=i) for i, r in enumerate((2, 4, 6, 8))]
        ),
        "batch": np.stack(
            [matrix((8, 12), r, seed=i) for i, r in enumerate((9, 3, 5, 7))]
        ),
        "whole": matrix((6, 4), 7.0, seed=3),
        "bias": np.ones(8),
    }
    specs = {
        "rows": P("d"),
        "cols": P(None, "d"),
        "wide": P(None, "d"),
        "layers": P("d"),
        "batch": P("d"),
        "whole": P(),
        "bias": P("d"),
    }
    kw = {
        "stacked": {k: 1 if k == "layers" else 0 for k in tree},
        "weight_dimension_numbers": {
            k: Dims(1, 2) if k == "batch" else Dims() for k in tree
        }
        | {"bias": None},
    }
    want = clipped(clipax.clip_by_spectral_norm(1.0, **kw), tree)
    return tree, specs, kw, want


@pytest.mark.devices(4)
@pytest.mark.parametrize("check_vma", [True, False])
def test_inside_shard_map_with_specs_gives_one_devices_numbers(check_vma) -> None:
    tree, specs, kw, (want, want_state) = _specs_case()
    tx = clipax.clip_by_spectral_norm(1.0, specs=specs, **kw)
    per_layer = {k: P("d") if k == "layers" else P() for k in tree} | {"bias": None}
    state_specs = clipax.ClipBySpectralNormState(
        P(), per_layer, per_layer, want_state.stacks
    )
    got, state = _in_shard_map(tx, tree, specs, state_specs, check_vma)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(state.sigma_max, want_state.sigma_max, rtol=1e-5)
    assert all(np.all(c) for c in jax.tree.leaves(state.clipped))  # well above c


BOTH_SIDES = (
    "`clip_by_spectral_norm` takes a matrix split along one side at most inside "
    "shard_map (its Gram matrix then sums over that side: one psum): `specs` gives "
    f"{P('x', 'y')} to the leaf at ['w'] (its block (8, 2)), which splits "
    "its reduction axes (0,) over ('x',) and its output axes (1,) over ('y',). "
    "Gather one side first, or clip under jax.jit."
)
SVD_SPLIT = (
    "`method='svd'` needs each matrix whole on its device inside shard_map: `specs` "
    f"gives {P('x', None)} to the leaf at ['w'] (its block (8, 8)), which "
    "splits its reduction axes (0,) over ('x',). Split only its batch and layer "
    "axes, or use method='newton_schulz' (one psum of a Gram matrix), or jax.jit."
)
SPECTRA_SPLIT = (
    "`method='spectra'` sums each matrix's Gram matrix over its larger side, as "
    "SPECTRA does (its steps depend on the side): `specs` gives "
    f"{P(None, 'y')} to the leaf at ['w'] (its block (16, 2)), which splits its "
    "output axes (1,) over ('y',), the smaller side. Split the larger one, or use "
    "method='newton_schulz' (either side), or jax.jit."
)
NO_SPECS = (
    "`clip_by_spectral_norm` cannot tell how the leaf at ['w'] (its block (8, 8)) "
    "is split across the mesh axes ('x', 'y') of this shard_map: pass `specs=`, "
    "the `in_specs` you gave shard_map for the updates (`PartitionSpec()` for a "
    "leaf whole on every device). JAX's types prove a leaf whole only with "
    "`check_vma=True`."
)


@pytest.mark.devices(8)
@pytest.mark.parametrize(
    "spec, method, given, message",
    [
        (P("x", "y"), "newton_schulz", True, BOTH_SIDES),
        (P("x"), "svd", True, SVD_SPLIT),
        (P(None, "y"), "spectra", True, SPECTRA_SPLIT),
        (P("x"), "newton_schulz", False, NO_SPECS),
    ],
    ids=["both sides", "svd", "spectra smaller side", "no specs"],
)
def test_inside_shard_map_a_layout_it_cannot_read_is_refused(
    spec, method, given, message
) -> None:
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    specs = {"w": spec, "b": P()}
    tx = clipax.clip_by_spectral_norm(
        1.0, method=method, specs=specs if given else None
    )
    tree = {"w": jnp.ones((16, 8)), "b": jnp.ones(8)}
    with jax.set_mesh(mesh):
        placed = jax.tree.map(lambda x, s: jax.device_put(x, s), tree, specs)
        step = jax.shard_map(
            lambda t: tx.update(t, tx.init(t))[0],
            mesh=mesh,
            in_specs=(specs,),
            out_specs=specs,
        )
        # Raised while jit traces: JAX adds a note about its frames below.
        with pytest.raises(ValueError, match=f"^{re.escape(message)}($|\n)"):
            step(placed)
