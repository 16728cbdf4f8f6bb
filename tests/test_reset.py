"""`reset_on_spike`: the moments of the layer that spikes, and only its, reset.

Checked against float64 NumPy of Adam (b1 0.5, b2 0.95), per layer: the
spiking layer's moments restart at the step after its spike, as a fresh Adam
would (its bias correction counted from there), every other layer and the
step itself as plain Adam; a layer whose gradient is NaN or inf takes no step
and restarts, leaving nothing NaN in the state; the decays are given or read
from `inject_hyperparams`, never assumed; Muon's orthogonalised branch and a
parameter named `mu` are read right; stacked equals unrolled; a checkpoint
resumes bit for bit; an optimizer without moments shaped like the params is
refused.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipax
from tests.helpers import assert_compiles_once

LR, B1, B2, EPS = 0.1, 0.5, 0.95, 1e-8
ADAM = {"b1": B1, "b2": B2}  # the decays, given to optax and to the rule
STEPS, SPIKE_AT = 10, 6  # the spike comes at step 6 (1-based), in layer 1
PREFIX = {"blocks": 1, "head": 0}


def gradients(seed: int = 0, spike: float = 50.0) -> list[dict[str, np.ndarray]]:
    """Each step's gradients; layer 1 of the blocks times `spike` at SPIKE_AT."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(1, STEPS + 1):
        blocks = rng.normal(size=(3, 4, 2))
        if step == SPIKE_AT:
            blocks[1] *= spike
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
        with np.errstate(invalid="ignore"):  # inf / inf, for an inf gradient
            out.append(-LR * m_hat / (np.sqrt(v_hat) + EPS))
        if not np.all(np.isfinite(g)):  # a NaN or inf layer takes no step
            out[-1] = np.zeros_like(g)
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
    tx = clipax.reset_on_spike(
        optax.adam(LR, **ADAM), **ADAM, warmup_steps=4, stacked=PREFIX
    )
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
        optax.adam(LR, **ADAM),
        **ADAM,
        moments="first",
        factor=0.25,
        warmup_steps=4,
        stacked=PREFIX,
    )
    outs, _ = run(tx, grads)
    got = [np.asarray(o["blocks"][1]) for o in outs]
    want = adam([g["blocks"][1] for g in grads], shrink=(SPIKE_AT, 0.25))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)


def test_the_update_can_be_watched_and_lion_is_read() -> None:
    grads = gradients(2)
    inner = optax.lion(1e-3)
    tx = clipax.reset_on_spike(
        inner, watch="update", b1=None, b2=None, warmup_steps=4, stacked=PREFIX
    )
    _, states = run(tx, grads)
    norms = [np.asarray(s.norms["blocks"]) for s in states]
    ones = jax.tree.map(np.ones_like, grads[0])
    alone = inner.update(grads[0], inner.init(ones), ones)[0]
    np.testing.assert_allclose(
        norms[0], np.linalg.norm(np.asarray(alone["blocks"]), axis=(1, 2)), rtol=1e-5
    )
    assert states[-1].count == STEPS


def muon_gradients() -> list[dict[str, np.ndarray]]:
    """A matrix (Muon's orthogonalised branch) and a vector (its Adam branch);
    the matrix x100 at SPIKE_AT."""
    rng = np.random.default_rng(7)
    out = []
    for step in range(1, STEPS + 1):
        w = rng.normal(size=(4, 3)) * (100.0 if step == SPIKE_AT else 1.0)
        out.append({"w": w.astype(np.float32), "b": rng.normal(size=3).astype("f")})
    return out


def muon() -> Any:
    """Muon whose two branches share their decays (one `b1`, one `b2`)."""
    return optax.contrib.muon(LR, beta=B1, adam_b1=B1, adam_b2=B2)


def test_muons_orthogonalised_branch_is_reset_and_restarts() -> None:
    grads = muon_gradients()
    tx = clipax.reset_on_spike(muon(), **ADAM, warmup_steps=4)
    outs, states = run(tx, grads)
    plain, _ = run(muon(), grads)
    spiked = [bool(s.spiked["w"]) for s in states]
    assert spiked == [step == SPIKE_AT for step in range(1, STEPS + 1)]
    moments = [
        s.mu["w"]
        for s in jax.tree.leaves(
            states[SPIKE_AT - 1].inner_state,
            is_leaf=lambda x: isinstance(x, optax.contrib.MuonState),
        )
        if isinstance(s, optax.contrib.MuonState)
    ]
    assert moments and not np.any(np.asarray(moments[0]))  # the matrix's reset
    # The step after: a fresh Muon's first step on that gradient.
    ones = jax.tree.map(np.ones_like, grads[0])
    fresh = muon().update(grads[SPIKE_AT], muon().init(ones), ones)[0]
    np.testing.assert_allclose(outs[SPIKE_AT]["w"], fresh["w"], rtol=1e-5, atol=1e-7)
    assert not np.allclose(plain[SPIKE_AT]["w"], fresh["w"], rtol=1e-3)
    for got, want in zip(outs, plain, strict=True):  # its Adam branch untouched
        np.testing.assert_allclose(got["b"], want["b"], rtol=1e-6)


def test_parameters_named_mu_and_nu_are_parameters() -> None:
    rng = np.random.default_rng(3)
    grads = []
    for step in range(1, STEPS + 1):
        g = {k: {"w": rng.normal(size=4)} for k in ("mu", "nu")}
        g["w"] = rng.normal(size=4)
        if step == SPIKE_AT:
            g["mu"]["w"] = g["mu"]["w"] * 50.0
        grads.append(jax.tree.map(lambda x: x.astype(np.float32), g))
    tx = clipax.reset_on_spike(optax.adam(LR, **ADAM), **ADAM, warmup_steps=4)
    outs, states = run(tx, grads)
    for path in (("mu", "w"), ("nu", "w"), ("w",)):

        def pick(tree: Any, path: tuple = path) -> Any:
            return functools.reduce(operator.getitem, path, tree)

        restart = SPIKE_AT if path == ("mu", "w") else None
        want = adam([pick(g) for g in grads], restart)
        got = [np.asarray(pick(o)) for o in outs]
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7, err_msg=path)
    assert int(clipax.metrics(states[-1])["reset_on_spike/mu/w/resets"]) == 1


def test_decays_are_read_from_inject_hyperparams() -> None:
    grads = gradients()
    inner = optax.inject_hyperparams(optax.adam)(learning_rate=LR, **ADAM)
    outs, _ = run(clipax.reset_on_spike(inner, warmup_steps=4, stacked=PREFIX), grads)
    want = adam([g["blocks"][1] for g in grads], SPIKE_AT)
    got = [np.asarray(o["blocks"][1]) for o in outs]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("watch", ["gradient", "update"])
@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("broken", [np.nan, np.inf])
def test_a_nonfinite_layer_takes_no_step_and_restarts(
    watch: str, stacked: bool, broken: float
) -> None:
    grads = gradients(6)
    grads[SPIKE_AT - 1]["blocks"][1] = broken
    # Clipped by global norm inside: the NaN of one layer must not reach it.
    inner = optax.chain(clipax.clip_by_global_norm(1e6), optax.adamw(LR, **ADAM))
    tx = clipax.reset_on_spike(
        inner, **ADAM, watch=watch, warmup_steps=4, stacked=PREFIX if stacked else None
    )
    trees = grads
    if not stacked:
        trees = [{**g, "blocks": list(g["blocks"])} for g in grads]
    outs, states = run(tx, trees)

    def decayed(u: np.ndarray) -> np.ndarray:  # adamw's weight decay, params 1
        return u - LR * 1e-4

    for layer in range(3):
        want = adam(
            [g["blocks"][layer] for g in grads], SPIKE_AT if layer == 1 else None
        )
        got = [np.asarray(o["blocks"][layer]) for o in outs]
        for step, (w, g) in enumerate(zip(want, got, strict=True), start=1):
            lost = step == SPIKE_AT and layer == 1
            np.testing.assert_allclose(
                g,
                w if lost else decayed(w),
                rtol=2e-5,
                atol=1e-7,
                err_msg=f"layer {layer}, step {step}",
            )
    lost_state = states[SPIKE_AT - 1]
    chex.assert_tree_all_finite(lost_state.inner_state)
    spiked = [
        np.asarray(s.spiked["blocks"]).tolist()
        if stacked
        else [bool(x) for x in s.spiked["blocks"]]
        for s in states
    ]
    assert spiked == [
        [step == SPIKE_AT and i == 1 for i in range(3)] for step in range(1, STEPS + 1)
    ]
    chex.assert_tree_all_finite(states[SPIKE_AT])  # its norm logged, then gone


def test_where_it_sits_says_what_it_sees() -> None:
    """Around a clip it watches the raw gradient and resets a x100 spike in a
    Muon layer; after one it sees the clipped gradient, and does not; behind a
    skip, the skipped spike never reaches it."""
    grads = muon_gradients()
    clip = clipax.clip_by_global_norm(1.0)
    around = clipax.reset_on_spike(optax.chain(clip, muon()), **ADAM, warmup_steps=4)
    after = optax.chain(clip, clipax.reset_on_spike(muon(), **ADAM, warmup_steps=4))
    behind = clipax.skip_spikes(around, warmup_steps=4)
    _, around_states = run(around, grads)
    _, after_states = run(after, grads)
    _, behind_states = run(behind, grads)
    assert [bool(s.spiked["w"]) for s in around_states].count(True) == 1
    assert not any(bool(s[1].spiked["w"]) for s in after_states)
    assert int(clipax.metrics(behind_states[-1])["skip_spikes/skipped_count"]) == 1
    assert not any(bool(s.inner_state.spiked["w"]) for s in behind_states)


def test_stacked_equals_unrolled() -> None:
    grads = gradients(3)
    unrolled = [
        {"blocks": [g["blocks"][i] for i in range(3)], "head": g["head"]} for g in grads
    ]
    s_outs, s_states = run(
        clipax.reset_on_spike(
            optax.adamw(LR, **ADAM), **ADAM, warmup_steps=4, stacked=PREFIX
        ),
        grads,
    )
    u_outs, u_states = run(
        clipax.reset_on_spike(optax.adamw(LR, **ADAM), **ADAM, warmup_steps=4),
        unrolled,
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
    tx = clipax.reset_on_spike(
        optax.adam(LR, **ADAM), **ADAM, warmup_steps=4, stacked=PREFIX
    )
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
    tx = clipax.reset_on_spike(optax.adam(LR, **ADAM), **ADAM, stacked=PREFIX)

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
            lambda: clipax.reset_on_spike(
                optax.adam(1.0), **ADAM, stacked={"w": 1}
            ).update(
                {"w": jnp.ones((2, 3))},
                clipax.reset_on_spike(optax.adam(1.0), **ADAM).init(
                    {"w": jnp.ones((2, 3))}
                ),
            ),
            ValueError,
            r"initialised with another `stacked=`: its state says where each stack "
            r"starts \(Stacks\(depths=\(\)\)\), and this one says "
            r"Stacks\(depths=\(1,\)\)",
        ),
        (
            lambda: clipax.reset_on_spike(optax.adam(1.0)).init({"w": jnp.ones(2)}),
            ValueError,
            r"^`reset_on_spike` restarts the bias correction of `inner`'s `mu` with "
            r"its decay: pass `b1=` \(the optimizer's\), `b1=None` where it has none",
        ),
        (
            lambda: clipax.reset_on_spike(optax.adam(1.0), b1=0.9).init(
                {"w": jnp.ones(2)}
            ),
            ValueError,
            r"^`reset_on_spike` restarts the bias correction of `inner`'s `nu` with "
            r"its decay: pass `b2=`",
        ),
        (
            lambda: clipax.reset_on_spike(
                optax.inject_hyperparams(optax.adam)(learning_rate=1.0), b2=0.95
            ).init({"w": jnp.ones(2)}),
            ValueError,
            r"`nu` with the `b2` its `optax.inject_hyperparams` state holds; "
            r"`b2`=0.95 would be a second one: leave it out\.$",
        ),
        (
            lambda: clipax.reset_on_spike(optax.rmsprop(1.0), b2=0.9).init(
                {"w": jnp.ones(2)}
            ),
            ValueError,
            r"`nu` by `b2`=0.9, but the state holding it keeps no `count`: it has "
            r"none\. Pass `b2=None`\.$",
        ),
    ],
)
def test_bad_input_is_refused(make: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        make()


def test_haliax_moments_are_reset_and_stay_named_arrays() -> None:
    hax = pytest.importorskip("haliax")
    named = lambda g: {"w": hax.NamedArray(jnp.full((2, 3), g), ("a", "b"))}  # noqa: E731
    tx = clipax.reset_on_spike(optax.adam(LR, **ADAM), **ADAM, warmup_steps=2)
    state = tx.init(named(0.0))
    for g in [1.0, 1.1, 60.0]:
        _, state = jax.jit(tx.update)(named(g), state)
    mu = state.inner_state[0].mu["w"]
    assert isinstance(mu, hax.NamedArray) and mu.axis_names == ("a", "b")
    assert bool(state.spiked["w"]) and not np.any(np.asarray(mu.array))
