"""clipax.skip_spikes: skipped steps leave everything as it was, on device."""

from __future__ import annotations

import math
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import clipax
from tests import helpers

PARAMS = {"w": jnp.ones((3, 2)), "b": jnp.ones(2), "none": None}


def _reference(
    norms: list[float],
    losses: list[float] | None,
    *,
    z: float,
    alpha: float,
    warmup: int,
    max_consecutive: int,
    max_norm: float | None = None,
) -> list[dict[str, Any]]:
    """The update rule of skip_spikes, transcribed in float64 NumPy."""
    n = lc = consecutive = 0
    mean = var = lmean = lvar = 0.0
    out = []

    def moments(x: float, count: int, m: float, v: float) -> tuple[float, float]:
        w = max(1 - alpha, 1 / (count + 1))
        d = x - m
        return m + w * d, (1 - w) * (v + w * d * d)

    for i, g in enumerate(norms):
        loss = None if losses is None else losses[i]
        broken = not math.isfinite(g) or (max_norm is not None and g > max_norm)
        outlier = n >= warmup and g - mean > z * math.sqrt(var)
        if loss is not None:
            broken |= not math.isfinite(loss)
            outlier |= lc >= warmup and loss - lmean > z * math.sqrt(lvar)
        forced = outlier and not broken and consecutive >= max_consecutive
        skip = broken or (outlier and not forced)
        if not skip:
            mean, var = moments(g, n, mean, var)
            n += 1
            if loss is not None:
                lmean, lvar = moments(loss, lc, lmean, lvar)
                lc += 1
        consecutive = consecutive + 1 if skip else 0
        out.append(
            {
                "skipped": skip,
                "forced": forced,
                "accepted_count": n,
                "consecutive_skips": consecutive,
                "norm_mean": mean,
                "norm_variance": var,
                "loss_mean": lmean,
                "loss_variance": lvar,
                "loss_count": lc,
            }
        )
    return out


def _norm_sequence() -> list[float]:
    """Spikes (step 50 on), a NaN at 30, and a lasting 10x shift from 75."""
    norms = [float(g) for g in helpers.spike_norms(90, spike_at=50)]
    norms[30] = math.nan
    return [g * 10 if i >= 75 else g for i, g in enumerate(norms)]


@pytest.mark.parametrize("with_loss", [False, True])
def test_statistics_and_decisions_match_a_float64_transcription(
    with_loss: bool,
) -> None:
    norms = _norm_sequence()
    rng = np.random.default_rng(3)
    losses = [2.0 + 0.05 * float(x) for x in rng.standard_normal(len(norms))]
    losses[20] = 9.0  # a loss spike with a normal norm
    kwargs = {"z": 3.0, "alpha": 0.9, "warmup": 8, "max_consecutive": 4}
    tx = clipax.skip_spikes(
        optax.sgd(1.0),
        z_threshold=3.0,
        alpha=0.9,
        warmup_steps=8,
        max_consecutive_skips=4,
    )
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    expected = _reference(norms, losses if with_loss else None, **kwargs)
    for i, (g, want) in enumerate(zip(norms, expected, strict=True)):
        grads = helpers.tree_with_norm(g)
        extra = {"loss": jnp.float32(losses[i])} if with_loss else {}
        updates, state = update(grads, state, None, **extra)
        assert bool(state.skipped) == want["skipped"], i
        assert bool(state.forced) == want["forced"], i
        for key in ("accepted_count", "consecutive_skips", "loss_count"):
            assert int(getattr(state, key)) == want[key], (i, key)
        for key in ("norm_mean", "norm_variance", "loss_mean", "loss_variance"):
            np.testing.assert_allclose(
                getattr(state, key), want[key], rtol=2e-5, atol=1e-6, err_msg=key
            )
        if want["skipped"]:
            chex.assert_trees_all_equal(updates, jax.tree.map(np.zeros_like, grads))
    decisions = [w["skipped"] for w in expected]
    assert decisions[30] and decisions[50]  # the NaN and the spike
    assert any(w["forced"] for w in expected)  # the lasting shift let through
    assert int(state.skipped_count) == sum(decisions)
    if with_loss:
        assert decisions[20]
        assert float(state.loss) == pytest.approx(losses[-1])


@pytest.mark.parametrize(
    "inner", [optax.identity, lambda: optax.sgd(1.0)], ids=["identity", "sgd"]
)
@pytest.mark.parametrize("jit", [False, True])
def test_python_numbers_are_0d_leaves(inner: Any, jit: bool) -> None:
    # DESIGN.md: Python numbers are leaves too; `inner` may give them back.
    tx = clipax.skip_spikes(inner(), max_norm=10.0)
    update = jax.jit(tx.update) if jit else tx.update
    numbers = {"w": 1.0, "b": jnp.ones(2)}
    arrays = {"w": jnp.asarray(1.0), "b": jnp.ones(2)}
    got, state = update(numbers, tx.init(numbers))
    want, want_state = tx.update(arrays, tx.init(arrays))
    chex.assert_trees_all_close((got, state), (want, want_state))
    assert isinstance(got["w"], jax.Array)
    chex.assert_shape(got["w"], ())
    assert got["w"].dtype == jnp.float32
    got, state = update({"w": 100.0, "b": jnp.ones(2)}, state)  # above max_norm
    assert state.skipped
    chex.assert_trees_all_equal(got, {"w": np.float32(0.0), "b": np.zeros(2)})


def test_adamw_moments_and_count_untouched_bit_for_bit_under_one_trace() -> None:
    tx = clipax.skip_spikes(
        optax.chain(clipax.clip_by_global_norm(1.0), optax.adamw(0.1)),
        warmup_steps=3,
    )

    def step(params: Any, state: Any, g: jax.Array) -> tuple:
        grads = jax.tree.map(lambda p: g * jnp.ones_like(p), params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, g

    jitted = jax.jit(step)
    params, state = PARAMS, tx.init(PARAMS)
    for g in [1.0, 1.1, 0.9, 1.05]:
        params, state, _ = jitted(params, state, jnp.float32(g))
    before_params, before_inner = params, state.inner_state
    params, state, _ = jitted(params, state, jnp.float32(300.0))  # a spike
    assert state.skipped and state.skipped_count == 1
    chex.assert_trees_all_equal(params, before_params)
    chex.assert_trees_all_equal(state.inner_state, before_inner)
    assert int(state.inner_state[1][0].count) == 4
    params, state, _ = jitted(params, state, jnp.float32(jnp.nan))
    chex.assert_trees_all_equal(params, before_params)
    chex.assert_trees_all_equal(state.inner_state, before_inner)
    assert state.consecutive_skips == 2
    params, state, _ = jitted(params, state, jnp.float32(1.0))
    assert not state.skipped and int(state.inner_state[1][0].count) == 5
    assert jitted._cache_size() == 1
    helpers.assert_compiles_once(step, params, state, jnp.float32(1.0))


def test_max_norm_always_drops() -> None:
    tx = clipax.skip_spikes(optax.sgd(1.0), max_norm=10.0, max_consecutive_skips=1)
    _, states = helpers.run_updates(
        tx, [helpers.tree_with_norm(g) for g in [5.0, 11.0, 12.0, 9.0]]
    )
    assert [bool(s.skipped) for s in states] == [False, True, True, False]
    assert not any(bool(s.forced) for s in states)


def test_loss_is_forwarded_through_chain_and_to_inner() -> None:
    seen = []

    def init(params: Any) -> optax.EmptyState:
        return optax.EmptyState()

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple:
        seen.append(sorted(extra))
        return updates, state

    probe = optax.GradientTransformationExtraArgs(init, update)
    tx = optax.chain(clipax.skip_spikes(probe, warmup_steps=2))
    state = tx.init(PARAMS)
    for loss in [1.0, 1.1, 1.0, 50.0]:
        _, state = tx.update(helpers.tree_with_norm(1.0), state, loss=loss, other=1)
    assert state[0].skipped and state[0].loss == 50.0
    assert seen[-1] == ["loss", "other"]
    with pytest.raises(ValueError, match="`loss` must be a scalar"):
        tx.update(helpers.tree_with_norm(1.0), state, loss=jnp.ones(2))


def test_inside_multi_steps() -> None:
    inner = clipax.skip_spikes(optax.adam(0.1), warmup_steps=2)
    tx = optax.MultiSteps(inner, every_k_schedule=2)
    grads = [helpers.tree_with_norm(g) for g in [1.0, 1.0, 1.2, 1.2, 0.9, 0.9]]
    grads += [helpers.tree_with_norm(g) for g in [500.0, 500.0, 1.0, 1.0]]
    outputs, states = helpers.run_updates(tx, grads)
    skip_states = [s.inner_opt_state for s in states]
    assert [int(s.accepted_count) for s in skip_states[1::2]] == [1, 2, 3, 3, 4]
    assert bool(skip_states[7].skipped)
    chex.assert_trees_all_equal(skip_states[7].inner_state, skip_states[5].inner_state)
    chex.assert_trees_all_equal(outputs[7], jax.tree.map(np.zeros_like, grads[7]))


def test_around_and_inside_inject_hyperparams() -> None:
    inner = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    tx = clipax.skip_spikes(inner, warmup_steps=2)
    _, states = helpers.run_updates(
        tx, [helpers.tree_with_norm(g) for g in [1.0, 1.1, 1e4]]
    )
    assert states[2].skipped and int(states[2].inner_state.count) == 2
    chex.assert_trees_all_equal(states[2].inner_state, states[1].inner_state)

    injected = optax.inject_hyperparams(clipax.skip_spikes, static_args=("inner",))(
        inner=optax.sgd(1.0), z_threshold=3.0, warmup_steps=2
    )
    _, states = helpers.run_updates(
        injected, [helpers.tree_with_norm(g) for g in [1.0, 1.1, 50.0]]
    )
    assert states[2].inner_state.skipped
    assert float(states[2].hyperparams["z_threshold"]) == 3.0


def test_nnx_optimizer() -> None:
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    tx = clipax.skip_spikes(optax.adam(0.1), warmup_steps=2)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model: nnx.Linear, optimizer: nnx.Optimizer, scale: jax.Array) -> Any:
        grads = nnx.grad(lambda m: scale * jnp.sum(m(jnp.ones((1, 2)))))(model)
        optimizer.update(model, grads, loss=scale)
        return clipax.metrics(optimizer)

    for scale in [1.0, 1.1, 0.9]:
        logs = step(model, optimizer, jnp.float32(scale))
    before = jax.tree.map(np.asarray, nnx.state(model))
    logs = step(model, optimizer, jnp.float32(1e5))
    assert logs["skip_spikes/skipped"] and logs["skip_spikes/skipped_count"] == 1
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, nnx.state(model)), before)
    assert int(optimizer.opt_state.inner_state[0].count[...]) == 3


def _decisions(states: list) -> list[bool]:
    return [bool(s.skipped) for s in states]


@pytest.mark.devices(8)
def test_gspmd_and_pmap_decide_as_one_device() -> None:
    def make(**kw: Any) -> optax.GradientTransformation:
        return clipax.skip_spikes(optax.sgd(1.0), z_threshold=3.0, warmup_steps=5, **kw)

    single, sharded, pmapped = helpers.sharded_and_pmap_runs(make, spike_at=25)
    zero = [not any(np.any(np.asarray(x)) for x in jax.tree.leaves(o)) for o in single]
    assert any(zero) and not all(zero)
    for runs in (sharded, pmapped):
        got = [not any(np.any(np.asarray(x)) for x in jax.tree.leaves(o)) for o in runs]
        assert got == zero
        chex.assert_trees_all_close(runs, single, rtol=1e-5, atol=1e-6)


@pytest.mark.devices(8)
def test_shard_map_with_specs_decides_on_the_global_norm() -> None:
    mesh = jax.make_mesh((8,), ("d",))
    specs = {"w": P("d"), "b": P()}
    rng = np.random.default_rng(1)
    direction = {"w": rng.standard_normal((8, 3)), "b": rng.standard_normal(3)}
    norms = [1.0, 1.2, 0.9, 1.1, 40.0, 1.0]
    trees = [
        jax.tree.map(lambda d, n=n: np.asarray(d * n, np.float32), direction)
        for n in norms
    ]
    tx = clipax.skip_spikes(optax.sgd(1.0), warmup_steps=3, specs=specs)
    plain = clipax.skip_spikes(optax.sgd(1.0), warmup_steps=3)
    _, expected = helpers.run_updates(plain, trees)
    state_specs = jax.tree.map(lambda _: P(), plain.init(trees[0]))
    step = jax.jit(
        jax.shard_map(
            lambda t, s: tx.update(t, s),
            mesh=mesh,
            in_specs=(specs, state_specs),
            out_specs=(specs, state_specs),
        )
    )
    replicated = jax.sharding.NamedSharding(mesh, P())
    state = jax.device_put(tx.init(trees[0]), replicated)
    got = []
    for tree in trees:
        _, state = jax.block_until_ready(step(helpers.shard_rows(tree), state))
        got.append(state)
    assert _decisions(got) == _decisions(expected) == [False] * 4 + [True, False]
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a.norm, b.norm, rtol=1e-6)
        np.testing.assert_allclose(a.norm_mean, b.norm_mean, rtol=1e-6)


def test_metrics_keys_through_skip_spikes() -> None:
    tx = clipax.skip_spikes(
        optax.chain(clipax.clip_by_global_norm(1.0), optax.adam(0.1))
    )
    _, state = tx.update(helpers.tree_with_norm(3.0), tx.init(PARAMS))
    logs = clipax.metrics(state)
    assert logs["skip_spikes/skipped"].dtype == jnp.bool_
    np.testing.assert_allclose(logs["skip_spikes/norm"], 3.0, rtol=1e-6)
    np.testing.assert_allclose(logs["clip_by_global_norm/norm"], 3.0, rtol=1e-6)
    assert "clip_by_global_norm/clip_factor" in logs


def test_adding_skipping_midway_keeps_the_optimizer(tmp_path: Any) -> None:
    plain = optax.chain(clipax.clip_by_global_norm(1.0), optax.adamw(0.1))
    state = plain.init(PARAMS)
    params = PARAMS
    for g in [1.0, 2.0, 3.0]:
        updates, state = plain.update(helpers.tree_with_norm(g), state, params)
        params = optax.apply_updates(params, updates)
    skip_tx = clipax.skip_spikes(plain, warmup_steps=2)
    migrated = clipax.migrate_state(state, skip_tx.init(params))
    assert isinstance(migrated, clipax.SkipSpikesState)
    chex.assert_trees_all_equal(migrated.inner_state, state)
    assert int(migrated.accepted_count) == 0 and not migrated.skipped
    _, migrated = skip_tx.update(helpers.tree_with_norm(1.0), migrated, params)
    assert int(migrated.inner_state[1][0].count) == 4


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"z_threshold": 0.0}, "z_threshold"),
        ({"z_threshold": -1.0}, "z_threshold"),
        ({"z_threshold": math.nan}, "z_threshold"),
        ({"alpha": 1.0}, "alpha"),
        ({"alpha": 0.0}, "alpha"),
        ({"warmup_steps": 0}, "warmup_steps"),
        ({"warmup_steps": 2.5}, "warmup_steps"),
        ({"max_consecutive_skips": 0}, "max_consecutive_skips"),
        ({"max_consecutive_skips": True}, "max_consecutive_skips"),
        ({"warmup_steps": 2**31}, "warmup_steps"),
        ({"max_consecutive_skips": 2**31}, "max_consecutive_skips"),
        ({"max_norm": -1.0}, "max_norm"),
        ({"axis_name": 3}, "axis_name"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=f"`{name}`"):
        clipax.skip_spikes(optax.sgd(1.0), **kwargs)


@pytest.mark.parametrize("name", ["warmup_steps", "max_consecutive_skips"])
def test_counts_are_bounded_by_the_int32_counters(name: str) -> None:
    # The state counts in int32: a larger count is refused here, not by an
    # OverflowError at the first update.
    with pytest.raises(
        ValueError, match=rf"`{name}` must be an int <= 2147483647 .*; got 2147483648"
    ):
        clipax.skip_spikes(optax.sgd(1.0), **{name: 2**31})
    tx = clipax.skip_spikes(optax.sgd(1.0), **{name: 2**31 - 1})
    _, state = jax.jit(tx.update)(helpers.tree_with_norm(1.0), tx.init(PARAMS))
    assert int(state.accepted_count) == 1


@pytest.mark.parametrize("name", ["z_threshold", "alpha", "max_norm"])
@pytest.mark.parametrize("value", ["1.0", True])
def test_non_numbers_are_type_errors_as_documented(name: str, value: Any) -> None:
    with pytest.raises(TypeError, match=rf"`{name}` must be .*; got {value!r}"):
        clipax.skip_spikes(optax.sgd(1.0), **{name: value})
    doc = clipax.skip_spikes.__doc__ or ""
    raises = doc.split("Raises:")[1].split("Example:")[0]
    type_error = raises.split("TypeError:")[1].split("ValueError:")[0]
    assert f"`{name}`" in type_error


def test_inner_must_be_a_transformation() -> None:
    with pytest.raises(TypeError, match="`inner`"):
        clipax.skip_spikes(optax.sgd)  # type: ignore[arg-type]
