"""`reset_on_spike`: the moments of the layer that spikes, and only its, reset.

Checked against float64 NumPy of Adam, per layer: the spiking layer's moments
restart at the step after its spike, as a fresh Adam would (its bias
correction counted from there), every other layer and the step itself as
plain Adam; stacked equals unrolled; a checkpoint resumes bit for bit; an
optimizer without moments shaped like the params is refused.
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipax
from tests.helpers import assert_compiles_once

LR, B1, B2, EPS = 0.1, 0.9, 0.999, 1e-8
STEPS, SPIKE_AT = 10, 6  # the spike comes at step 6 (1-based), in layer 1
PREFIX = {"blocks": 1, "head": 0}


def gradients(seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for step in range(1, STEPS + 1):
        blocks = rng.normal(size=(3, 4, 2))
        if step == SPIKE_AT:
            blocks[1] *= 50.0
        out.append({"blocks": blocks, "head": rng.normal(size=4)})
    return [jax.tree.map(lambda x: x.astype(np.float32), g) for g in out]


def adam(grads: list[np.ndarray], restart: int | None = None, shrink: Any = None):
    """Float64 Adam updates of one tensor over the steps; its moments restart
    (zero, the count from 1) after step `restart`, or (`shrink`: (step,
    factor)) its first moment is multiplied by factor after that step."""
    mu = nu = np.zeros_like(grads[0], np.float64)
    count, out = 0, []
    for step, g in enumerate(grads, start=1):
        g = g.astype(np.float64)
        count += 1
        mu, nu = B1 * mu + (1 - B1) * g, B2 * nu + (1 - B2) * g**2
        m_hat, v_hat = mu / (1 - B1**count), nu / (1 - B2**count)
        out.append(-LR * m_hat / (np.sqrt(v_hat) + EPS))
        if step == restart:
            mu, nu, count = np.zeros_like(mu), np.zeros_like(nu), 0
        if shrink is not None and step == shrink[0]:
            mu = mu * shrink[1]
    return out


def run(tx: Any, trees: list[Any]) -> tuple[list[Any], list[Any]]:
    """Each step's updates and state; the params are ones (for weight decay)."""
    update = jax.jit(tx.update)
    params = jax.tree.map(np.ones_like, trees[0])
    state, outs, states = tx.init(params), [], []
    for tree in trees:
        out, state = update(tree, state, params)
        outs.append(out)
        states.append(state)
    return outs, states


def test_resets_the_spiking_layer_only_and_restarts_its_bias_correction() -> None:
    grads = gradients()
    tx = clipax.reset_on_spike(optax.adam(LR), warmup_steps=4, stacked=PREFIX)
    outs, states = run(tx, grads)
    for step, state in enumerate(states, start=1):
        want = [step == SPIKE_AT and layer == 1 for layer in range(3)]
        np.testing.assert_array_equal(state.spiked["blocks"], want)
        assert not state.spiked["head"]
    for layer in range(3):
        want = adam(
            [g["blocks"][layer] for g in grads], SPIKE_AT if layer == 1 else None
        )
        got = [np.asarray(o["blocks"][layer]) for o in outs]
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(
        [np.asarray(o["head"]) for o in outs],
        adam([g["head"] for g in grads]),
        rtol=2e-5,
        atol=1e-7,
    )
    logs = clipax.metrics(states[-1])
    assert [logs[f"reset_on_spike/blocks/{i}/resets"] for i in range(3)] == [0, 1, 0]
    assert logs["reset_on_spike/head/resets"] == 0
    np.testing.assert_allclose(
        logs["reset_on_spike/blocks/1/norm"], np.linalg.norm(grads[-1]["blocks"][1])
    )


def test_a_factor_shrinks_the_first_moment_and_keeps_its_count() -> None:
    grads = gradients(1)
    tx = clipax.reset_on_spike(
        optax.adam(LR), moments="first", factor=0.25, warmup_steps=4, stacked=PREFIX
    )
    outs, _ = run(tx, grads)
    got = [np.asarray(o["blocks"][1]) for o in outs]
    want = adam([g["blocks"][1] for g in grads], shrink=(SPIKE_AT, 0.25))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)


def test_the_update_can_be_watched_and_lion_and_muon_are_read() -> None:
    grads = gradients(2)
    for inner, b1 in ((optax.lion(1e-3), None), (optax.contrib.muon(1e-3), None)):
        tx = clipax.reset_on_spike(
            inner, watch="update", b1=b1, b2=None, warmup_steps=4, stacked=PREFIX
        )
        _, states = run(tx, grads)
        norms = [np.asarray(s.norms["blocks"]) for s in states]
        ones = jax.tree.map(np.ones_like, grads[0])
        alone = inner.update(grads[0], inner.init(ones), ones)[0]
        np.testing.assert_allclose(
            norms[0],
            np.linalg.norm(np.asarray(alone["blocks"]), axis=(1, 2)),
            rtol=1e-5,
        )
        assert states[-1].count == STEPS


def test_stacked_equals_unrolled() -> None:
    grads = gradients(3)
    unrolled = [
        {"blocks": [g["blocks"][i] for i in range(3)], "head": g["head"]} for g in grads
    ]
    s_outs, s_states = run(
        clipax.reset_on_spike(optax.adamw(LR), warmup_steps=4, stacked=PREFIX), grads
    )
    u_outs, u_states = run(
        clipax.reset_on_spike(optax.adamw(LR), warmup_steps=4), unrolled
    )
    for s, u in zip(s_outs, u_outs, strict=True):
        for i in range(3):
            np.testing.assert_allclose(s["blocks"][i], u["blocks"][i], rtol=1e-6)
    s_logs, u_logs = clipax.metrics(s_states[-1]), clipax.metrics(u_states[-1])
    assert list(s_logs) == list(u_logs)
    for key in s_logs:
        np.testing.assert_allclose(s_logs[key], u_logs[key], rtol=1e-6, err_msg=key)


def test_a_checkpoint_resumes_bit_for_bit(tmp_path: Any) -> None:
    import orbax.checkpoint as ocp

    grads = gradients(4)
    tx = clipax.reset_on_spike(optax.adam(LR), warmup_steps=4, stacked=PREFIX)
    update = jax.jit(tx.update)
    state = tx.init(grads[0])
    for g in grads[:SPIKE_AT]:
        _, state = update(g, state)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    resumed = checkpointer.restore(tmp_path / "ckpt", abstract)
    for g in grads[SPIKE_AT:]:
        out, state = update(g, state)
        again, resumed = update(g, resumed)
        chex.assert_trees_all_equal(again, out)
    chex.assert_trees_all_equal(resumed, state)


def test_compiles_once() -> None:
    grads = jax.tree.map(jnp.asarray, gradients(5)[0])
    tx = clipax.reset_on_spike(optax.adam(LR), stacked=PREFIX)

    def step(g: Any, state: Any) -> tuple:
        return g, tx.update(g, state)[1]

    assert_compiles_once(step, grads, tx.init(grads))


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: clipax.reset_on_spike(None), TypeError, "`inner` must be"),
        (
            lambda: clipax.reset_on_spike(optax.adam(1.0), watch="loss"),
            ValueError,
            r"`watch` must be \"gradient\" or \"update\"; got 'loss'",
        ),
        (
            lambda: clipax.reset_on_spike(optax.adam(1.0), moments="second"),
            ValueError,
            r"`moments` must be \"both\" or \"first\"",
        ),
        (
            lambda: clipax.reset_on_spike(optax.adam(1.0), factor=1.0),
            ValueError,
            r"`factor` must be a real number in \[0, 1\); got 1.0",
        ),
        (
            lambda: clipax.reset_on_spike(optax.adam(1.0), b1=1.5),
            ValueError,
            r"`b1` must be a real number strictly between 0 and 1; got 1.5",
        ),
        (
            lambda: clipax.reset_on_spike(optax.adam(1.0), warmup_steps=0),
            ValueError,
            r"`warmup_steps` must be an int >= 1; got 0",
        ),
        (
            lambda: clipax.reset_on_spike(optax.sgd(1.0)).init({"w": jnp.ones(2)}),
            ValueError,
            r"moments \['mu', 'nu'\].*holds none",
        ),
        (
            lambda: clipax.reset_on_spike(optax.adam(1.0), stacked={"w": 1}).update(
                {"w": jnp.ones((2, 3))},
                clipax.reset_on_spike(optax.adam(1.0)).init({"w": jnp.ones((2, 3))}),
            ),
            ValueError,
            r"initialised with another `stacked=`|initialised for another tree",
        ),
    ],
)
def test_bad_input_is_refused(make: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        make()


def test_haliax_moments_are_reset_and_stay_named_arrays() -> None:
    hax = pytest.importorskip("haliax")
    named = lambda g: {"w": hax.NamedArray(jnp.full((2, 3), g), ("a", "b"))}  # noqa: E731
    tx = clipax.reset_on_spike(optax.adam(LR), warmup_steps=2)
    state = tx.init(named(0.0))
    for g in [1.0, 1.1, 60.0]:
        _, state = jax.jit(tx.update)(named(g), state)
    mu = state.inner_state[0].mu["w"]
    assert isinstance(mu, hax.NamedArray) and mu.axis_names == ("a", "b")
    assert bool(state.spiked["w"]) and not np.any(np.asarray(mu.array))
