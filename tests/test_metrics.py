"""clipax.metrics: every clipax statistic in any optimizer state, flat keys."""

from __future__ import annotations

import inspect
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import clipax
from clipax import _states
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
    @state_registry.declare("new_rule", clip=("norm", "threshold"))
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


# Logs stacked over steps, over a list of steps, and made under vmap: each key
# gives the series over the leading axes.

STACKED_GRADS = {"a": jnp.ones(3), "blocks": {"w": jnp.ones((2, 4))}}


def _logging_step(grads: Any, state: Any, tx: Any) -> tuple[Any, Any]:
    _, state = tx.update(grads, state)
    norms = clipax.tree.group_norms(grads, depth=2, stacked={"a": 0, "blocks": 1})
    return state, clipax.metrics(state) | norms


def _series_tx() -> optax.GradientTransformation:
    return optax.chain(
        clipax.adagc(warmup_steps=1, stacked={"a": 0, "blocks": 1}),
        clipax.clip_by_global_norm(1.0),
    )


def _grads_at(step: Any) -> Any:
    scale = 1.0 + step
    return {
        "a": STACKED_GRADS["a"] * scale,
        "blocks": {
            "w": STACKED_GRADS["blocks"]["w"] * jnp.array([[1.0], [3.0]]) * scale
        },
    }


def _want(keys: Any, steps: list[float]) -> dict[str, np.ndarray]:
    """Each key's series, step by step, as single steps log it."""
    tx = _series_tx()
    state, out = tx.init(STACKED_GRADS), {}
    for step in steps:
        state, logs = _logging_step(_grads_at(step), state, tx)
        for key in keys:
            out.setdefault(key, []).append(float(logs[key]))
    return {k: np.asarray(v) for k, v in out.items()}


def test_logs_stacked_by_lax_scan_are_series() -> None:
    tx = _series_tx()

    def body(state: Any, step: jax.Array) -> tuple[Any, Any]:
        return _logging_step(_grads_at(step), state, tx)

    _, logs = jax.jit(lambda s: jax.lax.scan(body, s, jnp.arange(5.0)))(
        tx.init(STACKED_GRADS)
    )
    want = _want(list(logs), [0, 1, 2, 3, 4])
    assert "adagc/blocks/1/w/norm" in logs and "blocks/1/norm" in logs
    for key, series in want.items():
        np.testing.assert_allclose(logs[key], series, rtol=1e-6, err_msg=key)


def test_logs_of_a_list_of_steps_stacked_leaf_by_leaf_are_series() -> None:
    tx = _series_tx()
    state, steps = tx.init(STACKED_GRADS), []
    for step in range(4):
        state, logs = jax.jit(_logging_step, static_argnums=2)(
            _grads_at(step), state, tx
        )
        steps.append(logs)
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *steps)
    for key, series in _want(list(stacked), [0, 1, 2, 3]).items():
        np.testing.assert_allclose(stacked[key], series, rtol=1e-6, err_msg=key)


def test_logs_made_under_vmap_are_one_series_per_run() -> None:
    tx = _series_tx()
    runs = jnp.array([0.0, 2.0, 5.0])

    def run(step: jax.Array) -> Any:
        return _logging_step(_grads_at(step), tx.init(STACKED_GRADS), tx)[1]

    logs = jax.jit(jax.vmap(run))(runs)
    for key in logs:
        want = [float(_want([key], [float(r)])[key][0]) for r in runs]
        np.testing.assert_allclose(logs[key], want, rtol=1e-6, err_msg=key)
        assert np.shape(logs[key]) == (3,)


def test_a_per_layer_state_split_across_devices_is_refused_in_shard_map() -> None:
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4,), ("d",))
    split = jax.sharding.NamedSharding(mesh, P("d"))
    grads = {"w": jax.device_put(jnp.arange(24.0).reshape(4, 6), split)}
    specs = {"w": P("d")}
    tx = clipax.clip_by_norm(1.0, stacked=1, specs=specs)
    state = tx.init(grads)
    state = state._replace(norms={"w": jax.device_put(state.norms["w"], split)})
    state_specs = state._replace(norms={"w": P("d")})

    def step(g: Any, s: Any) -> Any:
        _, s = tx.update(g, s)
        return clipax.metrics(s)

    inside = jax.shard_map(
        step, mesh=mesh, in_specs=(specs, state_specs), out_specs=P()
    )
    with pytest.raises(
        ValueError, match=r"`norms` of the leaf at \['w'\] is split.*'d'"
    ):
        jax.jit(inside)(grads, state)
    # Outside shard_map, as `out_specs` assemble it, it reads every layer.
    update = jax.shard_map(
        tx.update,
        mesh=mesh,
        in_specs=(specs, state_specs),
        out_specs=(specs, state_specs),
    )
    _, state = jax.jit(update)(grads, state)
    logs = clipax.metrics(state)
    np.testing.assert_allclose(
        [logs[f"clip_by_norm/w/{i}/norm"] for i in range(4)],
        np.linalg.norm(np.arange(24.0).reshape(4, 6), axis=1),
        rtol=1e-6,
    )


# Every public rule with a state, made with `stacked=` where it takes it.
KEYED_RULES: dict[str, Any] = {
    "clip_by_global_norm": lambda **kw: clipax.clip_by_global_norm(1.0),
    "clip_by_norm": lambda **kw: clipax.clip_by_norm(1.0, **kw),
    "autoclip": lambda **kw: clipax.autoclip(history=3),
    "zclip": lambda **kw: clipax.zclip(warmup_steps=1),
    "adagc": lambda **kw: clipax.adagc(warmup_steps=1, **kw),
    "skip_spikes": lambda **kw: clipax.skip_spikes(optax.sgd(1.0), warmup_steps=1),
    "stable_spam": lambda **kw: clipax.stable_spam(optax.sgd(1.0), **kw),
    "reset_on_spike": lambda **kw: clipax.reset_on_spike(
        optax.adam(1.0), b1=0.9, b2=0.999, warmup_steps=1, **kw
    ),
    "qk_clip": lambda **kw: clipax.qk_clip(1.0, query="q", key="k", **kw),
    "clip_by_spectral_norm": lambda **kw: clipax.clip_by_spectral_norm(
        1.0, weight_dimension_numbers=optax.contrib.MuonDimensionNumbers(-2, -1), **kw
    ),
}
TREE_KINDS = ("bare", "one leaf", "nested", "stacked")


def _keyed_tree(kind: str, rule: str, shape: tuple[int, ...]) -> tuple[Any, Any]:
    """A tree of `kind` and its `stacked=` prefix (None where not stacked);
    for qk_clip, its attention module (a `q` and a `k`) in the same place."""
    x = jnp.arange(math.prod(shape), dtype=jnp.float32).reshape(shape) + 1.0
    leaf: Any = {"q": x, "k": x} if rule == "qk_clip" else x
    if kind == "stacked":
        return {"blocks": jax.tree.map(lambda a: jnp.stack([a, 2 * a]), leaf)}, 1
    tree = {"bare": leaf, "one leaf": {"a": leaf}, "nested": {"a": {"b": leaf}}}
    return tree[kind], None


def _stat_names(rule: str, kind: str, shape: tuple[int, ...]) -> set[str]:
    tree, prefix = _keyed_tree(kind, rule, shape)
    takes = (
        "stacked" in inspect.signature(inspect.unwrap(getattr(clipax, rule))).parameters
    )
    tx = optax.with_extra_args_support(
        KEYED_RULES[rule](**({"stacked": prefix} if takes and prefix else {}))
    )
    layers = (2,) if prefix else ()
    logits = jax.tree.map(  # (layers..., batch, heads) at each module
        lambda m: jnp.full((*layers, 2, shape[-2]), 5.0),
        tree,
        is_leaf=lambda n: isinstance(n, dict) and "q" in n,
    )
    _, state = tx.update(tree, tx.init(tree), tree, max_logits=logits)
    return {key.rsplit("/", 1)[-1] for key in clipax.metrics(state)}


def test_the_keyed_rules_are_every_rule_with_a_state() -> None:
    assert set(KEYED_RULES) == {d.name for d in _states.DECLARED.values()}


@pytest.mark.parametrize("rule", list(KEYED_RULES))
@given(
    kind=st.sampled_from(TREE_KINDS[1:]),
    shape=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)),
)
@settings(max_examples=4, deadline=None)
def test_the_keys_reported_do_not_depend_on_the_trees_shape(
    rule: str, kind: str, shape: tuple[int, ...]
) -> None:
    """The names `metrics` reports for a rule's state are the same for a bare
    array, a one-leaf dict, nested dicts and a stacked leaf."""
    want = _stat_names(rule, TREE_KINDS[0], shape)
    assert _stat_names(rule, kind, shape) == want
    assert want, rule  # a rule with a state reports something
