"""clipax.metrics: every clipax statistic in any optimizer state, flat keys."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import clipax
from tests import helpers

PARAMS = {"dense": {"kernel": jnp.ones((2, 3)), "bias": jnp.ones(3)}}
GRADS = jax.tree.map(lambda x: 3.0 * x, PARAMS)  # norm 3 * 3 = 9
NORM = 9.0
CLIP = "clip_by_global_norm"


def _stepped(tx: optax.GradientTransformation) -> optax.OptState:
    state = tx.init(PARAMS)
    _, state = jax.jit(tx.update)(GRADS, state, PARAMS)
    return state


def test_two_global_norm_clips_in_a_chain_do_not_collide() -> None:
    tx = optax.chain(
        clipax.clip_by_global_norm(1.0),
        optax.scale(0.5),
        clipax.clip_by_global_norm(2.0),
    )
    state = _stepped(tx)
    with pytest.raises(KeyError):  # what metrics answers
        optax.tree.get(state, "norm")
    logs = jax.jit(clipax.metrics)(state)
    assert logs == {
        f"0/{CLIP}/norm": pytest.approx(NORM),
        f"0/{CLIP}/nonfinite_count": 0,
        f"0/{CLIP}/threshold": 1.0,
        f"0/{CLIP}/clipped": True,
        f"0/{CLIP}/clip_factor": pytest.approx(1.0 / NORM),
        f"2/{CLIP}/norm": pytest.approx(0.5),
        f"2/{CLIP}/nonfinite_count": 0,
        f"2/{CLIP}/threshold": 2.0,
        f"2/{CLIP}/clipped": False,
        f"2/{CLIP}/clip_factor": 1.0,
    }
    for value in logs.values():  # read on the host, after one transfer
        assert isinstance(value, np.generic) and np.shape(value) == ()


def test_zclip_norm_told_apart_from_the_clip_s() -> None:
    tx = optax.chain(clipax.zclip(warmup_steps=1), clipax.clip_by_global_norm(1.0))
    logs = clipax.metrics(_stepped(tx))
    assert set(logs) == {
        *(f"zclip/{k}" for k in ("mean", "variance", "count", "norm", "threshold")),
        "zclip/clipped",
        "zclip/clip_factor",
        *(
            f"{CLIP}/{k}"
            for k in ("norm", "nonfinite_count", "threshold", "clipped", "clip_factor")
        ),
    }  # zclip's buffer array is not a scalar: left out
    np.testing.assert_allclose(logs["zclip/norm"], NORM, rtol=1e-6)
    np.testing.assert_allclose(logs["zclip/mean"], NORM, rtol=1e-6)
    assert logs["zclip/threshold"] == jnp.inf and not logs["zclip/clipped"]


WRAPPED = [
    (optax.MultiSteps(clipax.clip_by_global_norm(1.0), 1), f"multi_steps/{CLIP}"),
    (
        optax.inject_hyperparams(clipax.clip_by_global_norm)(max_norm=1.0),
        f"inject_hyperparams/{CLIP}",
    ),
    (
        optax.masked(clipax.clip_by_global_norm(1.0), {"dense": True}),
        f"masked/{CLIP}",
    ),
    (
        optax.apply_if_finite(clipax.clip_by_global_norm(1.0), 2),
        f"apply_if_finite/{CLIP}",
    ),
    (optax.named_chain(("clip", clipax.clip_by_global_norm(1.0))), f"clip/{CLIP}"),
    (
        optax.partition({"all": clipax.clip_by_global_norm(1.0)}, "all"),
        f"partition/all/masked/{CLIP}",
    ),
    (
        optax.chain(
            optax.MultiSteps(
                optax.apply_if_finite(
                    optax.chain(clipax.clip_by_global_norm(1.0), optax.adam(1e-3)), 2
                ),
                1,
            )
        ),
        f"0/multi_steps/apply_if_finite/0/{CLIP}",
    ),
]


STATS = ("norm", "nonfinite_count", "threshold", "clipped", "clip_factor")


@pytest.mark.parametrize(("tx", "where"), WRAPPED)
def test_found_through_optax_wrappers(
    tx: optax.GradientTransformation, where: str
) -> None:
    # Alone, the rule is keyed by its name, wherever it sits.
    logs = jax.jit(clipax.metrics)(_stepped(tx))
    assert sorted(logs) == sorted(f"{CLIP}/{k}" for k in STATS)
    np.testing.assert_allclose(logs[f"{CLIP}/norm"], NORM, rtol=1e-6)
    assert logs[f"{CLIP}/clipped"]
    # Beside a second one, each is keyed by its path through the wrappers.
    logs = jax.jit(clipax.metrics)(
        _stepped(optax.chain(tx, clipax.clip_by_global_norm(1e9)))
    )
    assert sorted(logs) == sorted(
        [*(f"0/{where}/{k}" for k in STATS), *(f"1/{CLIP}/{k}" for k in STATS)]
    )
    np.testing.assert_allclose(logs[f"0/{where}/norm"], NORM, rtol=1e-6)
    assert logs[f"0/{where}/clipped"] and not logs[f"1/{CLIP}/clipped"]


def test_keys_do_not_move_with_the_chain() -> None:
    # A rule that appears once is keyed by its name: adding a transformation
    # in front of it, or a wrapper around the chain, renames no series.
    chains = [
        optax.chain(clipax.adagc(), optax.adam(1e-3)),
        optax.chain(optax.scale(1.0), clipax.adagc(), optax.adam(1e-3)),
        optax.MultiSteps(optax.chain(optax.identity(), clipax.adagc()), 1),
        clipax.skip_spikes(optax.chain(optax.scale(1.0), clipax.adagc())),
    ]
    keys = [
        [k for k in clipax.metrics(tx.init(PARAMS)) if k.startswith("adagc/")]
        for tx in chains
    ]
    assert keys[0] and all(k == keys[0] for k in keys)
    assert "adagc/dense/kernel/ema" in keys[0]


def test_threshold_injected_as_a_hyperparameter_gives_the_factor() -> None:
    tx = optax.inject_hyperparams(clipax.clip_by_global_norm)(max_norm=3.0)
    state = tx.init(PARAMS)
    state.hyperparams["max_norm"] = jnp.asarray(4.5)  # a scheduled threshold
    _, state = tx.update(GRADS, state)
    logs = clipax.metrics(state)
    assert logs[f"{CLIP}/threshold"] == 4.5
    np.testing.assert_allclose(logs[f"{CLIP}/clip_factor"], 0.5, rtol=1e-6)


def test_per_leaf_norms_one_key_per_leaf() -> None:
    logs = clipax.metrics(_stepped(optax.chain(clipax.clip_by_norm(1.0))))
    assert logs == {
        "clip_by_norm/dense/bias/norm": pytest.approx(3 * np.sqrt(3)),
        "clip_by_norm/dense/kernel/norm": pytest.approx(3 * np.sqrt(6)),
    }
    single = clipax.clip_by_norm(1.0)
    _, state = single.update(jnp.array([3.0, 4.0]), single.init(jnp.zeros(2)))
    assert clipax.metrics(state) == {"clip_by_norm/root/norm": 5.0}


def test_nonfinite_norm_factor_is_nan_and_not_clipped() -> None:
    tx = clipax.clip_by_global_norm(1.0)
    broken = {"w": jnp.array([jnp.nan])}
    _, state = tx.update(broken, tx.init(broken))
    logs = clipax.metrics(state)
    assert jnp.isnan(logs[f"{CLIP}/clip_factor"]) and not logs[f"{CLIP}/clipped"]
    assert logs[f"{CLIP}/nonfinite_count"] == 1


def test_nnx_optimizer_and_its_state() -> None:
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    tx = optax.chain(clipax.clip_by_global_norm(0.5), optax.sgd(0.1))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model: nnx.Linear, optimizer: nnx.Optimizer) -> dict:
        grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((1, 2))) ** 2))(model)
        optimizer.update(model, grads)
        return clipax.metrics(optimizer)

    logs = step(model, optimizer)
    assert logs[f"{CLIP}/norm"] > 0.5 and logs[f"{CLIP}/clipped"]
    assert clipax.metrics(optimizer.opt_state).keys() == logs.keys()
    np.testing.assert_array_equal(
        clipax.metrics(optimizer)[f"{CLIP}/norm"], logs[f"{CLIP}/norm"]
    )


def test_compiles_once_and_keys_are_stable() -> None:
    tx = optax.chain(clipax.clip_by_global_norm(1.0), clipax.zclip(warmup_steps=2))

    def step(grads: dict, state: optax.OptState) -> tuple:
        _, state = tx.update(grads, state)
        return grads, state

    _, state = helpers.assert_compiles_once(step, GRADS, tx.init(PARAMS))
    before = clipax.metrics(tx.init(PARAMS))
    assert list(before) == list(clipax.metrics(state))


def test_no_clipax_state_gives_an_empty_dict() -> None:
    assert clipax.metrics(optax.adam(1e-3).init(PARAMS)) == {}
    assert clipax.metrics(None) == {}


def test_a_new_clipax_state_class_needs_one_declaration(state_registry: Any) -> None:
    @state_registry.declare("new_rule")
    class NewRuleState(NamedTuple):
        norm: jax.Array
        threshold: jax.Array

    state = (NewRuleState(jnp.asarray(4.0), jnp.asarray(2.0)),)
    assert state_registry.declared(state[0]).name == "new_rule"
    assert clipax.metrics(state) == {
        "new_rule/norm": 4.0,
        "new_rule/threshold": 2.0,
        "new_rule/clipped": True,
        "new_rule/clip_factor": 0.5,
    }


def test_duplicate_keys_raise() -> None:
    state = {
        "a/b": clipax.ClipByNormState(norms=jnp.asarray(1.0)),
        "a": {"b": clipax.ClipByNormState(norms=jnp.asarray(2.0))},
    }
    with pytest.raises(ValueError, match="twice"):
        clipax.metrics(state)


@pytest.mark.parametrize("tx", [clipax.clip_by_norm(1.0), clipax.adagc()])
def test_two_leaves_with_one_key_raise_naming_both(
    tx: optax.GradientTransformation,
) -> None:
    # `a/b` and `a`/`b` both write as "a/b": one norm must not hide the other.
    tree = {"a/b": jnp.array([3.0, 4.0]), "a": {"b": jnp.array([1.0])}}
    _, state = tx.update(tree, tx.init(tree))
    with pytest.raises(ValueError, match=r"\['a'\]\['b'\] and \['a/b'\]"):
        clipax.metrics(state)
