"""The trainers' spike rules and Stable-SPAM, as their own code computes them.

`tests/data/trainers.json` holds what OLMo-core 3.0.0, Levanter 0.2.20 and
pytorch-optimizer 4.1.0 computed on fixed inputs (its `about` says how each
was called); each rule reproduces it step by step with the call the porting
guide gives.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import clipax
from tests import helpers

DATA = json.loads((Path(__file__).parent / "data" / "trainers.json").read_text())


def _tree(values: dict) -> dict:
    return {k: jnp.asarray(v, jnp.float32) for k, v in values.items()}


@pytest.mark.parametrize(
    "case", DATA["olmo_core_skip_step"], ids=lambda c: str(c["window"])
)
def test_olmo_core_skip_step(case: dict) -> None:
    # OLMo-core: every step's values enter a window of `window`, torch.std
    # (ddof 1); the test starts once window // 2 values, the current one
    # included, are held. MaxText's skip_step_on_spikes follows it.
    window = case["window"]
    tx = clipax.skip_spikes(
        optax.identity(),
        z_threshold=case["sigma"],
        window=window,
        ddof=1,
        warmup_steps=max(2, window // 2) - 1,
        history="all",
        max_consecutive_skips=None,
    )
    state = tx.init({"g": jnp.zeros(1)})
    step = jax.jit(tx.update)
    skipped = []
    for loss, norm in zip(case["loss"], case["grad_norm"], strict=True):
        grads = {"g": jnp.array([norm], jnp.float32)}
        _, state = step(grads, state, loss=jnp.float32(loss))
        skipped.append(bool(state.skipped))
    assert skipped == [factor == 0.0 for factor in case["step_factor"]]
    assert sum(skipped) >= 6  # the spikes were there to skip
    # One vector per statistic: the window of norms, the window of losses.
    assert state.norm_window.shape == state.loss_window.shape == (window,)


@pytest.mark.parametrize(
    "case", DATA["levanter_skip_step"], ids=lambda c: str(c["window"])
)
def test_levanter_skip_step(case: dict) -> None:
    window = case["window"]
    tx = clipax.skip_spikes(
        optax.sgd(1.0),
        z_threshold=case["sigma"],
        window=window,
        ddof=0,
        warmup_steps=max(2, window // 2),
        history="all",
        max_consecutive_skips=None,
    )
    params = {"a": jnp.zeros(4), "b": jnp.zeros((2, 3))}
    state = tx.init(params)
    step = jax.jit(lambda u, s, loss: tx.update(u, s, params, loss=loss))
    skipped = []
    for updates, loss in zip(case["updates"], case["loss"], strict=True):
        out, state = step(_tree(updates), state, jnp.float32(loss))
        skipped.append(bool(state.skipped))
        if skipped[-1]:
            assert not any(np.any(x) for x in jax.tree.leaves(out))
    assert skipped == case["skipped"] and sum(skipped) >= 5


@pytest.mark.parametrize(
    "case", DATA["levanter_clip_update_norm"], ids=lambda c: str(c["window"])
)
def test_levanter_update_clip(case: dict) -> None:
    window = case["window"]
    tx = clipax.zclip(
        mode="std",
        z_threshold=case["sigma"],
        window=window,
        warmup_steps=max(2, window // 2),
        history="raw",
    )
    state = tx.init({"a": jnp.zeros(4), "b": jnp.zeros((2, 3))})
    step = jax.jit(tx.update)
    clipped = 0
    for updates, want in zip(case["updates"], case["clipped"], strict=True):
        got, state = step(_tree(updates), state)
        chex.assert_trees_all_close(got, _tree(want), rtol=1e-6, atol=1e-7)
        clipped += bool(state.threshold < state.norm)
    assert clipped >= 4 and state.buffer.shape == (window,)


def _stable_spam_for(hyperparameters: dict) -> optax.GradientTransformation:
    """pytorch-optimizer's `StableSPAM(**hyperparameters)`, as the porting guide
    writes it."""
    kw = {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "gamma1": 0.7,
        "gamma2": 0.9,
        "theta": 0.999,
        "weight_decay": 0.0,
        "update_proj_gap": 1000,
        "eps": 1e-8,
        **hyperparameters,
    }
    b1, b2 = kw["betas"]
    adamw = optax.adamw(
        kw["lr"], b1, b2, eps=kw["eps"], weight_decay=kw["weight_decay"]
    )
    return clipax.stable_spam(
        adamw,
        theta=kw["theta"],
        gamma1=kw["gamma1"],
        gamma2=kw["gamma2"],
        eps=kw["eps"],
        reset_every=kw["update_proj_gap"],
    )


@pytest.mark.parametrize(
    "case", DATA["stable_spam"], ids=lambda c: str(c["hyperparameters"])
)
def test_stable_spam_equals_pytorch_optimizer(case: dict) -> None:
    tx = _stable_spam_for(case["hyperparameters"])
    params = _tree(case["init"])
    state = tx.init(params)
    step = jax.jit(tx.update)
    for grads, want in zip(case["grads"], case["params"], strict=True):
        updates, state = step(_tree(grads), state, params)
        params = optax.apply_updates(params, updates)
        # float32 rounding, accumulated over up to 250 steps of Adam
        chex.assert_trees_all_close(params, _tree(want), rtol=1e-5, atol=2e-5)
    assert int(state.count) == len(case["grads"])


def test_stable_spam_rules_per_tensor() -> None:
    tx = clipax.stable_spam(optax.sgd(1.0), reset_every=None)
    grads = {"a": jnp.array([1.0, -2.0]), "z": jnp.zeros(3), "n": None}
    state = tx.init(grads)
    assert state.m_max["n"] is None
    update = jax.jit(tx.update)
    for _ in range(3):
        out, state = update(grads, state)
    # A zero tensor keeps its norm statistics and passes as zeros (StableSPAM
    # skips Adam for it: the inner transformation here sees the zeros).
    assert float(state.m_norm["z"]) == 0.0 and not np.any(out["z"])
    _, zeroed = update({**grads, "a": jnp.zeros(2)}, state)  # m_max decays
    np.testing.assert_allclose(zeroed.m_max["a"], 0.999 * state.m_max["a"], rtol=1e-6)
    assert float(zeroed.m_norm["a"]) == float(state.m_norm["a"])
    # AdaGN: after steady steps the tensor's norm is m_hat / (sqrt(v_hat) + eps)
    # = 1; AdaClip: entries at most the bias-corrected EMA of the largest |g|.
    np.testing.assert_allclose(np.linalg.norm(out["a"]), 1.0, rtol=1e-5)
    spiked, after = update({**grads, "a": jnp.array([1.0, -200.0])}, state)
    assert float(after.m_max["a"]) > float(state.m_max["a"])
    assert np.linalg.norm(spiked["a"]) < 3.0
    # NaN or inf in a tensor: all of it comes out NaN, its statistics kept.
    for bad in (math.nan, math.inf):
        broken, _ = update({**grads, "a": jnp.array([bad, 0.001])}, state)
        assert np.isnan(broken["a"]).all()
    broken, kept = update({**grads, "a": jnp.array([math.nan, 1.0])}, state)
    chex.assert_trees_all_equal(kept.m_norm["a"], state.m_norm["a"])
    chex.assert_trees_all_equal(kept.m_max["a"], state.m_max["a"])


def test_stable_spam_clips_an_entry_to_its_threshold_below_one() -> None:
    """AdaClip scales the entries above the bias-corrected EMA of the largest
    |g| by threshold / peak, also where the peak is below 1: the spiked entry
    comes out at the threshold, the others as they are, before AdaGN rescales
    the whole tensor (which keeps their ratio)."""
    theta = 0.999
    tx = clipax.stable_spam(optax.sgd(1.0), theta=theta, reset_every=None)
    grads = {"a": jnp.array([0.1, -0.2])}
    state = tx.init(grads)
    update = jax.jit(tx.update)
    for _ in range(3):
        _, state = update(grads, state)
    spiked, after = update({"a": jnp.array([0.1, -0.9])}, state)  # peak 0.9
    top = float(after.m_max["a"]) / (1 - theta ** int(after.count))
    assert 0.2 < top < 0.9, "the spike must pass the threshold: nothing clipped"
    out = np.asarray(spiked["a"], np.float64)
    # float32's bias correction (1 - theta**4) against float64's: 2e-5 apart
    np.testing.assert_allclose(out[1] / out[0], -top / 0.1, rtol=1e-4)


def test_stable_spam_resets_the_inner_state() -> None:
    tx = clipax.stable_spam(optax.adam(1e-2), reset_every=3)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    counts = []
    for _ in range(7):
        _, state = tx.update({"w": jnp.array([0.5, -0.5])}, state, params)
        counts.append(int(state.inner_state[0].count))
    assert counts == [1, 2, 1, 2, 3, 1, 2]  # re-initialised before steps 3 and 6


@pytest.mark.parametrize(
    "make",
    [
        lambda: clipax.stable_spam(optax.adam(1e-3)),
        lambda: clipax.skip_spikes(optax.adam(1e-3), window=4, history="all"),
        lambda: clipax.zclip(window=4, warmup_steps=2, history="raw"),
    ],
    ids=["stable_spam", "skip_spikes window", "zclip window"],
)
def test_compiles_once_and_logs_its_statistics(make: Any) -> None:
    tx = make()
    state = helpers.state_after_compiled_steps(tx, {"a": jnp.ones(3), "b": jnp.ones(2)})
    logs = clipax.metrics(state)
    name = clipax._states.declared(state).name
    assert logs and all(key.startswith(name) or "/" in key for key in logs)
    if name == "stable_spam":
        assert {
            "stable_spam/a/m_max",
            "stable_spam/b/v_norm",
            "stable_spam/count",
        } <= set(logs)
    if name == "skip_spikes":
        assert {"skip_spikes/norm_mean", "skip_spikes/norm_count"} <= set(logs)


def test_nonfinite_values_never_enter_the_window() -> None:
    tx = clipax.skip_spikes(
        optax.sgd(1.0), window=4, warmup_steps=2, history="all", z_threshold=3.0
    )
    state = tx.init({"w": jnp.zeros(1)})
    for loss in (1.0, 1.1, math.nan, 0.9, 1.0):
        _, state = tx.update({"w": jnp.ones(1)}, state, loss=jnp.float32(loss))
    assert int(state.loss_count) == 4 and np.isfinite(state.loss_window).all()
    np.testing.assert_allclose(state.loss_mean, 1.0, rtol=1e-6)
    assert not state.skipped  # the NaN step was skipped, the later ones not


def test_migrating_between_the_new_rules_and_optax() -> None:
    params = {"w": jnp.ones(3)}
    adamw = optax.adamw(1e-3)
    plain = adamw.init(params)
    _, plain = adamw.update({"w": jnp.ones(3)}, plain, params)
    spam = clipax.stable_spam(optax.adamw(1e-3))
    state = clipax.migrate_state(plain, spam.init(params))
    chex.assert_trees_all_equal(state.inner_state, plain)  # the moments kept
    back = clipax.migrate_state(state, adamw.init(params))
    chex.assert_trees_all_equal(back, plain)
    windowed = clipax.skip_spikes(adamw, window=8)
    moved = clipax.migrate_state(plain, windowed.init(params))
    assert moved.norm_window.shape == (8,)
    chex.assert_trees_all_equal(moved.inner_state, plain)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: clipax.skip_spikes(optax.sgd(1.0), window=1),
            ValueError,
            r"`window` must be an int >= 2; got 1",
        ),
        (
            lambda: clipax.skip_spikes(optax.sgd(1.0), ddof=-1),
            ValueError,
            r"`ddof` must be an int >= 0",
        ),
        (
            lambda: clipax.skip_spikes(optax.sgd(1.0), history="kept"),
            ValueError,
            r'`history` must be "accepted" or "all"',
        ),
        (
            lambda: clipax.skip_spikes(optax.sgd(1.0), max_consecutive_skips=0),
            ValueError,
            r"`max_consecutive_skips` must be an int >= 1",
        ),
        (
            lambda: clipax.zclip(window="8"),
            ValueError,
            r"`window` must be an int >= 2; got '8'",
        ),
        (
            lambda: clipax.zclip(history="all"),
            ValueError,
            r'`history` must be "clipped" or "raw"',
        ),
        (
            lambda: clipax.zclip(window=8, skip_update_on_spike=True),
            ValueError,
            r"`skip_update_on_spike`.*`window`",
        ),
        (
            lambda: clipax.stable_spam(optax.sgd(1.0), theta=1.5),
            ValueError,
            r"`theta` must be a real number strictly between 0 and 1; got 1.5",
        ),
        (
            lambda: clipax.stable_spam(optax.sgd(1.0), reset_every=0),
            ValueError,
            r"`reset_every` must be an int >= 1; got 0",
        ),
        (
            lambda: clipax.stable_spam(optax.sgd(1.0), eps=-1.0),
            ValueError,
            r"`eps` must be a finite real number >= 0",
        ),
        (
            lambda: clipax.stable_spam("adam"),
            TypeError,
            r"`inner` must be an optax.GradientTransformation; got str",
        ),
        (
            lambda: clipax.stable_spam(optax.sgd(1.0), stacked=1, axis_name="d"),
            ValueError,
            r"`axis_name` cannot be combined with `stacked`",
        ),
    ],
)
def test_bad_arguments_are_refused_at_construction(
    call: Any, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        call()


@pytest.mark.devices(4)
def test_under_shard_map_with_specs_equal_one_device() -> None:
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    specs = {"w": P("d"), "b": P()}
    rng = np.random.default_rng(0)
    steps = [
        {
            "w": jnp.asarray(
                rng.normal(size=(8, 3)) * (30.0 if t == 6 else 1.0), jnp.float32
            ),
            "b": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
        }
        for t in range(8)
    ]
    place = lambda t, s: jax.tree.map(  # noqa: E731
        lambda x, p: jax.device_put(x, NamedSharding(mesh, p)), t, s
    )
    for make, state_specs in (
        (
            lambda **kw: clipax.stable_spam(optax.adam(1e-2), reset_every=3, **kw),
            lambda state: state._replace(
                inner_state=(
                    optax.ScaleByAdamState(P(), specs, specs),
                    optax.EmptyState(),
                ),
                count=P(),
                m_max={"w": P(), "b": P()},
                m_norm={"w": P(), "b": P()},
                v_norm={"w": P(), "b": P()},
            ),
        ),
        (
            lambda **kw: clipax.skip_spikes(
                optax.sgd(1.0), window=4, warmup_steps=3, history="all", **kw
            ),
            lambda state: jax.tree.map(lambda _: P(), state),
        ),
        (
            lambda **kw: clipax.zclip(window=4, warmup_steps=3, history="raw", **kw),
            lambda state: jax.tree.map(lambda _: P(), state),
        ),
    ):
        one, tx = make(), make(specs=specs)
        one_state = one.init(steps[0])
        state_spec = state_specs(one_state)
        state = place(tx.init(steps[0]), state_spec)
        update = jax.jit(
            jax.shard_map(
                lambda g, s, p, tx=tx: tx.update(g, s, p),
                mesh=mesh,
                in_specs=(specs, state_spec, specs),
                out_specs=(specs, state_spec),
            )
        )
        for grads in steps:
            want, one_state = one.update(grads, one_state, grads)
            got, state = update(place(grads, specs), state, place(grads, specs))
            chex.assert_trees_all_close(got, want, rtol=2e-6, atol=1e-7)
        chex.assert_trees_all_close(
            dict(clipax.metrics(state)), dict(clipax.metrics(one_state)), rtol=2e-6
        )


@pytest.mark.parametrize(
    "make",
    [
        lambda: clipax.stable_spam(optax.adamw(1e-3), reset_every=2),
        lambda: clipax.skip_spikes(optax.adam(1e-3), window=4, history="all"),
        lambda: optax.chain(
            optax.adam(1e-3), clipax.zclip(window=4, warmup_steps=2, history="raw")
        ),
    ],
    ids=["stable_spam", "skip_spikes window", "zclip window"],
)
def test_checkpoints_restore_through_migrate_state(make: Any, tmp_path: Path) -> None:
    import orbax.checkpoint as ocp

    tx = make()
    params = {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}
    state = tx.init(params)
    for scale in (1.0, 2.0, 0.5):
        grads = jax.tree.map(lambda x, s=scale: s * x, params)
        _, state = tx.update(grads, state, params)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "ckpt")  # plain dicts and lists
    chex.assert_trees_all_equal(clipax.migrate_state(restored, tx.init(params)), state)


FACTORIES = {
    "stable_spam": lambda: clipax.stable_spam(optax.adam(1e-3)),
    "skip_spikes": lambda: clipax.skip_spikes(optax.adam(1e-3), window=4),
    "zclip": lambda: clipax.zclip(window=4, warmup_steps=2),
    "zclip ema": lambda: clipax.zclip(),
    "autoclip": lambda: clipax.autoclip(),
    "adagc": lambda: clipax.adagc(),
    "clip_by_global_norm": lambda: clipax.clip_by_global_norm(1.0),
    "clip_by_norm": lambda: clipax.clip_by_norm(1.0),
}


@pytest.mark.parametrize("name", list(FACTORIES))
def test_a_fresh_state_can_be_donated(name: str) -> None:
    # Training loops donate the optimizer state: no two of its leaves may be
    # one buffer.
    tx = FACTORIES[name]()
    params = {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}
    update = jax.jit(lambda g, s: tx.update(g, s, params), donate_argnums=1)
    _, state = update(params, tx.init(params))
    _, state = update(params, state)
    buffers = [id(x) for x in jax.tree.leaves(tx.init(params))]
    assert len(set(buffers)) == len(buffers)


def test_stable_spam_keeps_its_dtypes_with_x64() -> None:
    with jax.enable_x64(True):
        tx = clipax.stable_spam(optax.sgd(1.0))
        grads = {"a": jnp.ones(3, jnp.float64), "b": jnp.ones(2, jnp.float32)}
        state = tx.init(grads)
        _, after = jax.jit(tx.update)(grads, state)
        assert jax.tree.map(lambda x: x.dtype, after) == jax.tree.map(
            lambda x: x.dtype, state
        )


def test_stable_spam_a_tiny_nonzero_gradient_keeps_its_sign() -> None:
    # A tensor whose norm is below `eps`: AdaGN's denominator sqrt(v_hat) + eps
    # stays positive (float64 NumPy of the rule's first step: no AdaClip,
    # m_hat = n, v_hat = n**2, so the update is g / (n + eps)).
    g = np.array([3e-11, -4e-11])
    tx = clipax.stable_spam(optax.identity(), eps=1e-8, reset_every=None)
    grads = {"w": jnp.asarray(g, jnp.float32)}
    updates, _ = jax.jit(tx.update)(grads, tx.init(grads))
    want = g / (np.linalg.norm(g) + 1e-8)
    np.testing.assert_allclose(updates["w"], want, rtol=1e-5)
    assert np.all(np.sign(updates["w"]) == np.sign(g))
