"""`clipax.migrate_state`: switching a running job between optax and clipax."""

from __future__ import annotations

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import clipax

PARAMS = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}


def grads_at(step: int) -> dict[str, jax.Array]:
    rng = np.random.default_rng(step)
    scale = 3.0 if step % 2 else 0.2  # clipped and unclipped steps
    return {
        "w": jnp.asarray(scale * rng.standard_normal((4, 3)), jnp.float32),
        "b": jnp.asarray(scale * rng.standard_normal(3), jnp.float32),
    }


def train(tx: Any, state: Any, params: Any, steps: range) -> tuple[Any, Any]:
    update = jax.jit(tx.update)
    for step in steps:
        updates, state = update(grads_at(step), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def save_and_restore(tmp_path: Any, state: Any, name: str = "ckpt") -> Any:
    """Writes `state` with orbax and reads it back without a target."""
    checkpointer = ocp.StandardCheckpointer()
    path = tmp_path / name
    checkpointer.save(path, state)
    checkpointer.wait_until_finished()
    return checkpointer.restore(path)


def adamw() -> optax.GradientTransformation:
    return optax.adamw(1e-2, weight_decay=1e-2)


# Pairs (optax transformation, its clipax replacement).
PAIRS = {
    "clip_by_global_norm": (
        optax.clip_by_global_norm(1.0),
        clipax.clip_by_global_norm(1.0),
    ),
    "clip": (optax.clip(0.5), clipax.clip(0.5)),
    "clip_by_block_rms": (optax.clip_by_block_rms(0.5), clipax.clip_by_block_rms(0.5)),
    "adaptive_grad_clip": (
        optax.adaptive_grad_clip(0.1),
        clipax.adaptive_grad_clip(0.1),
    ),
}


@pytest.mark.parametrize("restore", [False, True], ids=["objects", "orbax"])
@pytest.mark.parametrize("name", sorted(PAIRS))
@pytest.mark.parametrize("direction", ["optax_to_clipax", "clipax_to_optax"])
def test_switch_keeps_the_optimizer_and_training_continues(
    tmp_path: Any, name: str, direction: str, restore: bool
) -> None:
    optax_clip, clipax_clip = PAIRS[name]
    old_clip, new_clip = (
        (optax_clip, clipax_clip)
        if direction == "optax_to_clipax"
        else (clipax_clip, optax_clip)
    )
    old_tx = optax.chain(old_clip, adamw())
    new_tx = optax.chain(new_clip, adamw())
    params, old_state = train(old_tx, old_tx.init(PARAMS), PARAMS, range(5))
    saved = save_and_restore(tmp_path, old_state) if restore else old_state

    state = clipax.migrate_state(saved, new_tx.init(params))

    chex.assert_trees_all_equal_structs(state, new_tx.init(params))
    chex.assert_trees_all_equal(state[1], old_state[1])  # moments, count: exact
    if direction == "optax_to_clipax" and name == "clip_by_global_norm":
        chex.assert_trees_all_equal(state[0], new_tx.init(params)[0])  # fresh
    # Training goes on as if the old chain had run on: the clipping rules
    # agree to float32 rounding.
    got, _ = train(new_tx, state, params, range(5, 10))
    want, _ = train(old_tx, old_state, params, range(5, 10))
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_kept_norm_after_the_switch_is_the_new_steps(tmp_path: Any) -> None:
    old_tx = optax.chain(optax.clip_by_global_norm(1.0), adamw())
    new_tx = optax.chain(clipax.clip_by_global_norm(1.0), adamw())
    params, old_state = train(old_tx, old_tx.init(PARAMS), PARAMS, range(3))
    state = clipax.migrate_state(
        save_and_restore(tmp_path, old_state), new_tx.init(params)
    )
    _, state = train(new_tx, state, params, range(3, 4))
    want = np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(grads_at(3))))
    np.testing.assert_allclose(optax.tree.get(state, "norm"), want, rtol=1e-6)
    assert int(state[1][0].count) == 4


@pytest.mark.parametrize("direction", ["optax_to_clipax", "clipax_to_optax"])
def test_inside_multi_steps_and_inject_hyperparams(
    tmp_path: Any, direction: str
) -> None:
    schedule = optax.linear_schedule(1e-2, 1e-3, 20)

    def make(clip: optax.GradientTransformation) -> optax.MultiSteps:
        inner = optax.chain(
            clip, optax.inject_hyperparams(optax.adamw)(learning_rate=schedule)
        )
        return optax.MultiSteps(inner, every_k_schedule=3)

    optax_tx = make(optax.clip_by_global_norm(1.0))
    clipax_tx = make(clipax.clip_by_global_norm(1.0))
    old_tx, new_tx = (
        (optax_tx, clipax_tx)
        if direction == "optax_to_clipax"
        else (clipax_tx, optax_tx)
    )
    # 7 micro-steps: 2 optimizer steps, one gradient accumulated.
    params, old_state = train(old_tx, old_tx.init(PARAMS), PARAMS, range(7))
    state = clipax.migrate_state(
        save_and_restore(tmp_path, old_state), new_tx.init(params)
    )
    assert int(state.mini_step) == 1 and int(state.gradient_step) == 2
    chex.assert_trees_all_equal(state.acc_grads, old_state.acc_grads)
    inject = state.inner_opt_state[1]
    assert int(inject.hyperparams_states["learning_rate"].count) == 2
    np.testing.assert_allclose(inject.hyperparams["learning_rate"], schedule(1))
    chex.assert_trees_all_equal(
        inject.inner_state, old_state.inner_opt_state[1].inner_state
    )
    got, _ = train(new_tx, state, params, range(7, 13))
    want, _ = train(old_tx, old_state, params, range(7, 13))
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


def test_masked_states_with_masked_nodes(tmp_path: Any) -> None:
    mask = {"w": True, "b": False}
    old_tx = optax.chain(
        optax.clip_by_global_norm(1.0), optax.masked(optax.adam(0.1), mask)
    )
    new_tx = optax.chain(
        clipax.clip_by_global_norm(1.0), optax.masked(optax.adam(0.1), mask)
    )
    params, old_state = train(old_tx, old_tx.init(PARAMS), PARAMS, range(3))
    state = clipax.migrate_state(
        save_and_restore(tmp_path, old_state), new_tx.init(params)
    )
    chex.assert_trees_all_equal(state[1], old_state[1])
    assert isinstance(state[1].inner_state[0].mu["b"], optax.MaskedNode)


def test_keeps_the_new_states_sharding() -> None:
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    sharding = NamedSharding(mesh, PartitionSpec())
    params = jax.device_put(PARAMS, sharding)
    old_tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
    new_tx = optax.chain(clipax.clip_by_global_norm(1.0), optax.adam(0.1))
    old_state = jax.tree.map(np.asarray, old_tx.init(PARAMS))  # host arrays
    new_state = new_tx.init(params)
    state = clipax.migrate_state(old_state, new_state)
    assert state[1][0].mu["w"].sharding.is_equivalent_to(sharding, 2)
    for got, want in zip(
        jax.tree.leaves(state), jax.tree.leaves(new_state), strict=True
    ):
        assert got.sharding == want.sharding


def test_under_jit() -> None:
    old_tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
    new_tx = optax.chain(clipax.clip_by_global_norm(1.0), optax.adam(0.1))
    _, old_state = train(old_tx, old_tx.init(PARAMS), PARAMS, range(2))
    new_state = new_tx.init(PARAMS)
    got = jax.jit(clipax.migrate_state)(old_state, new_state)
    chex.assert_trees_all_equal(got, clipax.migrate_state(old_state, new_state))


# Wrappers: a clipax state with an `inner_state` field (as skip_spikes keeps).


class _WrapperState(NamedTuple):
    inner_state: Any
    skipped: jax.Array  # int32 scalar


@pytest.fixture
def clipax_wrapper(state_registry: Any) -> Any:
    """A clipax wrapper, registered as `skip_spikes`'s state is."""
    state_registry.declare("test_only_wrapper", inner="inner_state")(_WrapperState)

    def wrap(inner: optax.GradientTransformation) -> optax.GradientTransformation:
        def init(params: Any) -> _WrapperState:
            return _WrapperState(inner.init(params), jnp.zeros((), jnp.int32))

        def update(updates: Any, state: _WrapperState, params: Any = None) -> Any:
            updates, inner_state = inner.update(updates, state.inner_state, params)
            return updates, _WrapperState(inner_state, state.skipped + 1)

        return optax.GradientTransformation(init, update)

    return wrap


@pytest.mark.parametrize("restore", [False, True], ids=["objects", "orbax"])
def test_wraps_and_unwraps_an_optimizer(
    tmp_path: Any, clipax_wrapper: Any, restore: bool
) -> None:
    plain_tx = optax.chain(optax.clip_by_global_norm(1.0), adamw())
    wrapped_tx = clipax_wrapper(optax.chain(clipax.clip_by_global_norm(1.0), adamw()))
    params, plain_state = train(plain_tx, plain_tx.init(PARAMS), PARAMS, range(4))
    saved = save_and_restore(tmp_path, plain_state, "a") if restore else plain_state
    wrapped = clipax.migrate_state(saved, wrapped_tx.init(params))
    assert isinstance(wrapped, _WrapperState) and int(wrapped.skipped) == 0
    chex.assert_trees_all_equal(wrapped.inner_state[1], plain_state[1])

    _, wrapped = train(wrapped_tx, wrapped, params, range(4, 6))
    saved = save_and_restore(tmp_path, wrapped, "b") if restore else wrapped
    back = clipax.migrate_state(saved, plain_tx.init(params))
    chex.assert_trees_all_equal(back[1], wrapped.inner_state[1])
    assert int(back[1][0].count) == 6

    # A wrapper state into the same wrapper keeps everything, its statistics too.
    again = clipax.migrate_state(saved, wrapped_tx.init(params))
    assert int(again.skipped) == 2
    chex.assert_trees_all_equal(again.inner_state, wrapped.inner_state)


def test_clipax_statistics_are_kept_between_clipax_chains(tmp_path: Any) -> None:
    tx = optax.chain(clipax.clip_by_global_norm(1.0), optax.adam(0.1))
    params, old_state = train(tx, tx.init(PARAMS), PARAMS, range(3))
    state = clipax.migrate_state(save_and_restore(tmp_path, old_state), tx.init(params))
    chex.assert_trees_all_equal(state, old_state)


# Errors: never a silent reset.


def test_other_shapes_name_the_path() -> None:
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
    new_tx = optax.chain(clipax.clip_by_global_norm(1.0), optax.adam(0.1))
    other = {"w": jnp.ones((4, 2)), "b": jnp.zeros(3)}
    with pytest.raises(ValueError, match=r"\[1\]\[0\]\.mu\['w'\].*shape \(4, 3\)"):
        clipax.migrate_state(tx.init(PARAMS), new_tx.init(other))


def test_a_missing_inner_state_names_the_path(tmp_path: Any) -> None:
    old = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)).init(PARAMS)
    new_tx = optax.chain(clipax.clip_by_global_norm(1.0), optax.adam(0.1))
    with pytest.raises(ValueError, match=r"at \[1\]\[0\]: the new state holds a Scale"):
        clipax.migrate_state(old, new_tx.init(PARAMS))
    with pytest.raises(
        ValueError, match=r"at \[1\]\[0\]: .* ScaleByAdamState, the old state None"
    ):
        clipax.migrate_state(save_and_restore(tmp_path, old), new_tx.init(PARAMS))


def test_an_extra_part_names_the_path(tmp_path: Any) -> None:
    old = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1)).init(PARAMS)
    new = optax.chain(clipax.clip_by_global_norm(1.0), optax.sgd(0.1)).init(PARAMS)
    with pytest.raises(ValueError, match=r"at \[1\]\[0\]: the old state holds a Scale"):
        clipax.migrate_state(old, new)
    restored = save_and_restore(tmp_path, old)
    with pytest.raises(ValueError, match=r"\[1\]\[0\]: .* dict with keys \['count'"):
        clipax.migrate_state(restored, new)
    restored[1][0]["extra"] = np.zeros(2)
    new_tx = optax.chain(clipax.clip_by_global_norm(1.0), optax.adam(0.1))
    with pytest.raises(ValueError, match=r"\[1\]\[0\] \(key 'extra' of the old"):
        clipax.migrate_state(restored, new_tx.init(PARAMS))


def test_another_optimizer_of_the_same_fields_is_refused() -> None:
    old = optax.adam(0.1).init(PARAMS)
    new = optax.adabelief(0.1).init(PARAMS)  # count, mu, nu as well
    with pytest.raises(
        ValueError, match=r"\[0\]: .*ScaleByBeliefState.*ScaleByAdamState"
    ):
        clipax.migrate_state(old, new)


@pytest.mark.parametrize("restore", [False, True], ids=["objects", "orbax"])
@pytest.mark.parametrize(
    ("old_dtype", "new_dtype"),
    [
        (jnp.bfloat16, jnp.bfloat16),
        (jnp.bfloat16, jnp.float32),
        (jnp.float32, jnp.bfloat16),
        (jnp.float8_e4m3fn, jnp.float8_e4m3fn),
    ],
    ids=["bf16", "bf16_to_f32", "f32_to_bf16", "f8"],
)
def test_ml_dtypes_moments_are_carried_and_cast(
    tmp_path: Any, old_dtype: Any, new_dtype: Any, restore: bool
) -> None:
    # ml_dtypes' floats (bfloat16, float8) are floats, as NumPy does not say.
    old_tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
    new_tx = optax.chain(
        clipax.clip_by_global_norm(1.0), optax.adam(0.1, mu_dtype=new_dtype)
    )
    _, old_state = train(old_tx, old_tx.init(PARAMS), PARAMS, range(2))
    adam = old_state[1][0]
    mu = jax.tree.map(lambda x: x.astype(old_dtype), adam.mu)  # as mu_dtype keeps
    old_state = (old_state[0], (adam._replace(mu=mu), *old_state[1][1:]))
    saved = save_and_restore(tmp_path, old_state) if restore else old_state
    state = clipax.migrate_state(saved, new_tx.init(PARAMS))
    chex.assert_trees_all_equal_shapes_and_dtypes(state, new_tx.init(PARAMS))
    assert int(state[1][0].count) == 2
    chex.assert_trees_all_equal(
        state[1][0].mu, jax.tree.map(lambda x: x.astype(new_dtype), old_state[1][0].mu)
    )


def test_bfloat16_params_with_adam() -> None:
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
    old_tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
    new_tx = optax.chain(clipax.clip_by_global_norm(1.0), optax.adam(0.1))
    old_state = old_tx.init(params)
    _, old_state = old_tx.update(jax.tree.map(jnp.ones_like, params), old_state)
    state = clipax.migrate_state(old_state, new_tx.init(params))
    assert state[1][0].mu["w"].dtype == jnp.bfloat16
    chex.assert_trees_all_equal(state[1], old_state[1])


def noisy(clip: optax.GradientTransformation) -> optax.GradientTransformation:
    """A chain whose state holds a typed PRNG key (`jax.random.key`)."""
    noise = optax.add_noise(0.01, 0.55, key=jax.random.key(0))
    return optax.chain(clip, noise, optax.sgd(0.1))


@pytest.mark.parametrize("restore", [False, True], ids=["objects", "orbax"])
def test_typed_prng_keys_are_carried(tmp_path: Any, restore: bool) -> None:
    old_tx = noisy(optax.clip_by_global_norm(1.0))
    new_tx = noisy(clipax.clip_by_global_norm(1.0))
    params, old_state = train(old_tx, old_tx.init(PARAMS), PARAMS, range(3))
    saved = save_and_restore(tmp_path, old_state) if restore else old_state
    state = clipax.migrate_state(saved, new_tx.init(params))
    assert state[1].rng_key.dtype == old_state[1].rng_key.dtype
    chex.assert_trees_all_equal(state[1:], old_state[1:])  # the key moved on
    assert int(state[1].count) == 3
    jitted = jax.jit(clipax.migrate_state)(old_state, new_tx.init(params))
    chex.assert_trees_all_equal(jitted, state)
    # The same noise as the old chain's from here on.
    got, _ = train(new_tx, state, params, range(3, 6))
    want, _ = train(old_tx, old_state, params, range(3, 6))
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("key", "match"),
    [
        (jax.random.key(0, impl="rbg"), r"\[1\]\.rng_key.*dtype key<rbg>.*key<fry>"),
        (jax.random.split(jax.random.key(0)), r"\[1\]\.rng_key.*shape \(2,\)"),
        (jax.random.key_data(jax.random.key(0)), r"\[1\]\.rng_key.*shape \(2,\)"),
    ],
    ids=["other_impl", "other_shape", "raw_key_data"],
)
def test_another_prng_key_names_the_path(key: jax.Array, match: str) -> None:
    new = noisy(clipax.clip_by_global_norm(1.0)).init(PARAMS)
    old = (new[0], new[1]._replace(rng_key=key), *new[2:])
    with pytest.raises(ValueError, match=match):
        clipax.migrate_state(old, new)


def test_a_dtype_of_another_kind_names_the_path() -> None:
    new = optax.adam(0.1).init(PARAMS)[0]
    old = new._replace(count=jnp.zeros((), jnp.float32))
    with pytest.raises(ValueError, match=r"\.count.*dtype float32.*int32"):
        clipax.migrate_state(old, new)


# Flax NNX.


def test_flax_nnx_optimizer(tmp_path: Any) -> None:
    from flax import nnx

    def make(clip: optax.GradientTransformation) -> Any:
        model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        tx = optax.chain(clip, optax.adam(1e-2))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    def step(model: Any, optimizer: Any, i: int) -> None:
        x = jnp.asarray(np.random.default_rng(i).standard_normal((5, 3)), jnp.float32)
        grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2) * 10.0)(model)
        optimizer.update(model, grads)

    old_model, old_opt = make(optax.clip_by_global_norm(0.5))
    for i in range(3):
        step(old_model, old_opt, i)
    restored = save_and_restore(tmp_path, nnx.state(old_opt))

    new_model, new_opt = make(clipax.clip_by_global_norm(0.5))
    nnx.update(new_model, nnx.state(old_model))
    new_opt.opt_state = clipax.migrate_state(restored["opt_state"], new_opt.opt_state)
    new_opt.step[...] = restored["step"]["value"]

    assert int(new_opt.opt_state[1][0].count[...]) == 3
    chex.assert_trees_all_equal(
        nnx.state(new_opt)["opt_state"][1], nnx.state(old_opt)["opt_state"][1]
    )
    for i in range(3, 6):
        step(old_model, old_opt, i)
        step(new_model, new_opt, i)
    chex.assert_trees_all_close(
        nnx.state(new_model), nnx.state(old_model), rtol=1e-5, atol=1e-6
    )
    assert float(new_opt.opt_state[0].norm[...]) > 0


def test_a_new_state_that_is_not_arrays_is_refused() -> None:
    old = optax.adam(0.1).init(PARAMS)
    abstract = jax.eval_shape(optax.adam(0.1).init, PARAMS)  # ShapeDtypeStructs
    with pytest.raises(ValueError, match=r"\[0\]\.count: .*ShapeDtypeStruct"):
        clipax.migrate_state(old, abstract)


def test_python_numbers_in_the_old_state_are_its_arrays() -> None:
    # A state written by hand or read back as plain numbers, not arrays.
    new = clipax.clip_by_global_norm(1.0).init({"w": jnp.ones(2)})
    old = {"norm": 2.5, "nonfinite_count": 3, "threshold": 1.0}
    got = clipax.migrate_state(old, new)
    assert isinstance(got, clipax.ClipByGlobalNormState)
    assert (got.norm.dtype, got.nonfinite_count.dtype) == (jnp.float32, jnp.int32)
    assert (float(got.norm), int(got.nonfinite_count), float(got.threshold)) == (
        2.5,
        3,
        1.0,
    )
