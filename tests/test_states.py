"""What clipax's state classes declare, which `metrics` and `migrate_state` read."""

from __future__ import annotations

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import clipax
from clipax import _states

# class: (name in metric keys, scalar fields, per-tensor fields, wrapped state)
DECLARED = {
    clipax.ClipByGlobalNormState: (
        "clip_by_global_norm",
        ("norm", "nonfinite_count", "threshold"),
        {},
        None,
    ),
    clipax.ClipByNormState: ("clip_by_norm", (), {"norms": "norm"}, None),
    clipax.AutoClipState: ("autoclip", ("count", "norm", "threshold"), {}, None),
    clipax.ZClipState: (
        "zclip",
        ("mean", "variance", "count", "norm", "threshold"),
        {},
        None,
    ),
    clipax.AdaGCState: (
        "adagc",
        ("count", "norm"),
        {"ema": "ema", "norms": "norm", "thresholds": "threshold"},
        None,
    ),
    clipax.StableSpamState: (
        "stable_spam",
        ("count",),
        {"m_max": "m_max", "m_norm": "m_norm", "v_norm": "v_norm"},
        "inner_state",
    ),
    clipax.QKClipState: (
        "qk_clip",
        (),
        {"max_logit": "max_logit", "clipped_heads": "clipped_heads"},
        None,
    ),
    clipax.ResetOnSpikeState: (
        "reset_on_spike",
        ("count",),
        {"norms": "norm", "spiked": "spiked", "resets": "resets"},
        "inner_state",
    ),
    clipax.ClipBySpectralNormState: (
        "clip_by_spectral_norm",
        ("count",),
        {"sigma_max": "sigma_max", "clipped": "clipped"},
        None,
    ),
    clipax.SkipSpikesState: (
        "skip_spikes",
        tuple(
            f
            for f in clipax.SkipSpikesState._fields
            if f not in ("inner_state", "norm_window", "loss_window")
        ),
        {},
        "inner_state",
    ),
}


EXAMPLES = {
    clipax.ClipByGlobalNormState: clipax.clip_by_global_norm(1.0),
    clipax.ClipByNormState: clipax.clip_by_norm(1.0),
    clipax.AutoClipState: clipax.autoclip(),
    clipax.ZClipState: clipax.zclip(),
    clipax.AdaGCState: clipax.adagc(),
    clipax.SkipSpikesState: clipax.skip_spikes(optax.sgd(1.0)),
    clipax.StableSpamState: clipax.stable_spam(optax.sgd(1.0)),
    clipax.QKClipState: clipax.qk_clip(1.0, query="w", key="w"),
    clipax.ResetOnSpikeState: clipax.reset_on_spike(optax.adam(1.0), b1=0.9, b2=0.999),
    clipax.ClipBySpectralNormState: clipax.clip_by_spectral_norm(1.0),
}


def test_every_clipax_state_class_declares_itself() -> None:
    got = {
        d.cls: (d.name, dict(d.per_tensor), d.inner) for d in _states.DECLARED.values()
    }
    assert got == {
        cls: (name, tensors, inner)
        for cls, (name, _, tensors, inner) in DECLARED.items()
    }
    public = {getattr(clipax, n) for n in clipax.__all__ if n.endswith("State")}
    assert public - {clipax.NonFiniteError} == set(_states.DECLARED)
    for declared in _states.DECLARED.values():
        assert declared.fields == declared.cls._fields  # type: ignore[attr-defined]
        assert callable(getattr(clipax, declared.name))  # the public factory
        # Its scalar statistics are its 0-d fields, as `metrics` reports them.
        state = EXAMPLES[declared.cls].init({"w": jnp.ones((1, 2))})
        name, scalars, _, _ = DECLARED[declared.cls]
        reported = {
            key.split("/")[1]
            for key in clipax.metrics(state)
            if key.count("/") == 1 and key.startswith(f"{name}/")
        }
        assert reported - {"clipped", "clip_factor"} == set(scalars)
        assert set(scalars) <= set(declared.fields)


def test_a_state_is_found_by_its_class_or_its_restored_fields() -> None:
    state = clipax.clip_by_global_norm(1.0).init({"w": jnp.ones(2)})
    declared = _states.DECLARED[clipax.ClipByGlobalNormState]
    assert _states.declared(state) is declared
    assert _states.declared(state._asdict()) is declared
    assert declared.is_restored(state._asdict())
    assert _states.declared({"norm": 1.0}) is None


def test_no_two_states_share_their_fields() -> None:
    # A restored state is recognised by its keys: two classes with the same
    # fields would make that ambiguous.
    fields = [frozenset(d.fields) for d in _states.DECLARED.values()]
    assert len(set(fields)) == len(fields) > 5


# Declaring wrongly is an error where the class is defined, so at import.


class _Declared(NamedTuple):
    norm: jax.Array
    count: jax.Array


def test_a_class_declared_twice_raises(state_registry: Any) -> None:
    state_registry.declare("declared")(_Declared)
    with pytest.raises(ValueError, match=r"same class\.$"):
        state_registry.declare("declared")(_Declared)
    with pytest.raises(ValueError, match=r"ClipByNormState.*same class"):
        state_registry.declare("other_name")(clipax.ClipByNormState)


def test_a_name_declared_already_raises(state_registry: Any) -> None:
    with pytest.raises(ValueError, match=r"as 'zclip'.*ZClipState.*same name\.$"):
        state_registry.declare("zclip")(_Declared)


@pytest.mark.parametrize(
    ("per_tensor", "inner"), [({"norms": "norm"}, None), ({}, "inner_state")]
)
def test_a_field_the_class_lacks_raises(
    state_registry: Any, per_tensor: dict, inner: str | None
) -> None:
    with pytest.raises(ValueError, match=r"has no field '(norms|inner_state)'"):

        @state_registry.declare("typo", per_tensor=per_tensor, inner=inner)
        class TypoState(NamedTuple):
            norm: jax.Array

    assert state_registry.DECLARED.keys() == DECLARED.keys()


@pytest.mark.parametrize("cls", [dict, tuple], ids=["dict", "tuple"])
def test_only_named_tuples_declare(state_registry: Any, cls: type) -> None:
    with pytest.raises(TypeError, match=r"takes a NamedTuple class"):
        state_registry.declare("plain")(type("Plain", (cls,), {}))


# A NamedTuple that is not declared is not clipax's, whatever its module.


class _ThirdPartyState(NamedTuple):
    norm: jax.Array
    threshold: jax.Array


@pytest.mark.parametrize("module", ["clipax_ext", "clipax._undeclared"])
def test_an_undeclared_named_tuple_is_no_clipax_state(
    monkeypatch: pytest.MonkeyPatch, module: str
) -> None:
    monkeypatch.setattr(_ThirdPartyState, "__module__", module)
    theirs = _ThirdPartyState(jnp.asarray(4.0), jnp.asarray(2.0))
    assert _states.declared(theirs) is None
    assert _states.declared(theirs._asdict()) is None
    assert clipax.metrics((theirs,)) == {}
    # migrate_state carries it as any other optimizer's state: never reset.
    empty = optax.EmptyState()
    with pytest.raises(ValueError, match=r"at \[0\]: the new state holds a _Third"):
        clipax.migrate_state((empty,), (theirs,))
    with pytest.raises(ValueError, match=r"at \[0\]: the old state holds a _Third"):
        clipax.migrate_state((theirs,), (empty,))
    chex.assert_trees_all_equal(clipax.migrate_state((theirs,), (theirs,)), (theirs,))


def test_children_is_one_level_that_rebuilds_the_node() -> None:
    tx = optax.chain(clipax.clip_by_norm(1.0), optax.scale_by_adam())
    state = tx.init({"w": jnp.ones(2)})
    children, treedef = _states.children(state)
    assert [_states.key_name(key) for key, _ in children] == ["0", "1"]
    assert children[1][1] is state[1]
    chex.assert_trees_all_equal(treedef.unflatten([c for _, c in children]), state)
    inner, _ = _states.children(state[1])
    assert [_states.key_name(key) for key, _ in inner] == ["count", "mu", "nu"]
    assert _states.children(jnp.ones(2))[0] == []


# Every rule's default state saves and restores with orbax.

FACTORIES = {
    "adagc": lambda: clipax.adagc(),
    "adaptive_grad_clip": lambda: clipax.adaptive_grad_clip(0.1),
    "autoclip": lambda: clipax.autoclip(),
    "clip": lambda: clipax.clip(1.0),
    "clip_by_block_rms": lambda: clipax.clip_by_block_rms(1.0),
    "clip_by_global_norm": lambda: clipax.clip_by_global_norm(1.0),
    "clip_by_norm": lambda: clipax.clip_by_norm(1.0),
    "clip_by_spectral_norm": lambda: clipax.clip_by_spectral_norm(1.0),
    "clip_by_value": lambda: clipax.clip_by_value(-1.0, 1.0),
    "qk_clip": lambda: clipax.qk_clip(1.0),
    "reset_on_spike": lambda: clipax.reset_on_spike(optax.adam(1e-3), b1=0.9, b2=0.999),
    "skip_spikes": lambda: clipax.skip_spikes(optax.adam(1e-3)),
    "stable_spam": lambda: clipax.stable_spam(optax.adam(1e-3)),
    "zclip": lambda: clipax.zclip(),
}
NOT_TRANSFORMATIONS = {"metrics", "migrate_state", "nonfinite_errors", "stacked_prefix"}


def test_the_checkpoint_table_holds_every_transformation() -> None:
    factories = {
        name
        for name in clipax.__all__
        if callable(getattr(clipax, name))
        and not isinstance(getattr(clipax, name), type)
        and name not in NOT_TRANSFORMATIONS
    }
    assert factories == set(FACTORIES)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_every_default_state_saves_and_restores_with_orbax(
    name: str, tmp_path: Any
) -> None:
    import orbax.checkpoint as ocp

    params = {"w": jnp.ones((2, 3)), "b": jnp.full(3, 0.5)}
    params |= {"attn": {"query": jnp.ones((3, 2, 2)), "key": jnp.ones((3, 2, 2))}}
    logits = {"max_logits": {"attn": jnp.array([5.0, 0.5])}}  # for qk_clip
    tx = optax.chain(FACTORIES[name](), optax.sgd(0.1))
    state = tx.init(params)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    chex.assert_trees_all_equal(
        checkpointer.restore(tmp_path / "ckpt", abstract), state
    )
    # Without a target: plain dicts and lists, resumed through `migrate_state`.
    restored = checkpointer.restore(tmp_path / "ckpt")
    resumed = clipax.migrate_state(restored, tx.init(params))
    chex.assert_trees_all_equal(resumed, state)
    _, stepped = jax.jit(tx.update)(params, resumed, params, **logits)
    checkpointer.save(tmp_path / "stepped", stepped)  # a state after a step too
    checkpointer.wait_until_finished()
    restored = clipax.migrate_state(checkpointer.restore(tmp_path / "stepped"), state)
    chex.assert_trees_all_equal(restored, stepped)
