"""The registry of clipax's state classes that `metrics` and `migrate_state` read."""

from __future__ import annotations

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import clipax
from clipax import _states

# class: (name in metric keys, per-leaf fields, field of the wrapped state)
REGISTERED = {
    clipax.ClipByGlobalNormState: ("clip_by_global_norm", (), None),
    clipax.ClipByNormState: ("clip_by_norm", ("norms",), None),
    clipax.AutoClipState: ("autoclip", (), None),
    clipax.ZClipState: ("zclip", (), None),
    clipax.AdaGCState: ("adagc", ("ema", "norms", "thresholds"), None),
    clipax.SkipSpikesState: ("skip_spikes", (), "inner_state"),
}


def test_every_clipax_state_class_is_registered() -> None:
    got = {c.cls: (c.name, c.per_leaf, c.inner) for c in _states.REGISTRY.values()}
    assert got == REGISTERED
    public = {getattr(clipax, n) for n in clipax.__all__ if n.endswith("State")}
    assert public - {clipax.NonFiniteError} == set(_states.REGISTRY)
    for registered in _states.REGISTRY.values():
        assert registered.fields == registered.cls._fields  # type: ignore[attr-defined]
        assert callable(getattr(clipax, registered.name))  # the public factory


def test_a_state_is_found_by_its_class_or_its_restored_fields() -> None:
    state = clipax.clip_by_global_norm(1.0).init({"w": jnp.ones(2)})
    registered = _states.REGISTRY[clipax.ClipByGlobalNormState]
    assert _states.state_class(state) is registered
    assert _states.restored_state_class(state._asdict()) is registered
    assert _states.state_class(state._asdict()) is None
    assert _states.restored_state_class({"norm": 1.0}) is None


# Registering wrongly is an error where the class is defined, so at import.


class _Registered(NamedTuple):
    norm: jax.Array
    count: jax.Array


def test_a_class_registered_twice_raises(state_registry: Any) -> None:
    state_registry.register("registered")(_Registered)
    with pytest.raises(ValueError, match=r"same class and name and fields"):
        state_registry.register("registered")(_Registered)
    with pytest.raises(ValueError, match=r"ClipByNormState.*same class"):
        state_registry.register("other_name")(clipax.ClipByNormState)


def test_a_name_or_fields_registered_already_raise(state_registry: Any) -> None:
    with pytest.raises(ValueError, match=r"as 'zclip'.*ZClipState.*same name\.$"):
        state_registry.register("zclip")(_Registered)
    with pytest.raises(ValueError, match=r"ClipByNormState.*same fields\.$"):

        @state_registry.register("norms_again")
        class NormsState(NamedTuple):
            norms: Any


@pytest.mark.parametrize(
    ("per_leaf", "inner"), [(("norms",), None), ((), "inner_state")]
)
def test_a_field_the_class_lacks_raises(
    state_registry: Any, per_leaf: tuple[str, ...], inner: str | None
) -> None:
    with pytest.raises(ValueError, match=r"has no field '(norms|inner_state)'"):

        @state_registry.register("typo", per_leaf=per_leaf, inner=inner)
        class TypoState(NamedTuple):
            norm: jax.Array

    assert state_registry.REGISTRY.keys() == REGISTERED.keys()


@pytest.mark.parametrize("cls", [dict, tuple], ids=["dict", "tuple"])
def test_only_named_tuples_register(state_registry: Any, cls: type) -> None:
    with pytest.raises(TypeError, match=r"takes a NamedTuple class"):
        state_registry.register("plain")(type("Plain", (cls,), {}))


# A NamedTuple that is not registered is not clipax's, whatever its module.


class _ThirdPartyState(NamedTuple):
    norm: jax.Array
    threshold: jax.Array


@pytest.mark.parametrize("module", ["clipax_ext", "clipax._unregistered"])
def test_an_unregistered_named_tuple_is_no_clipax_state(
    monkeypatch: pytest.MonkeyPatch, module: str
) -> None:
    monkeypatch.setattr(_ThirdPartyState, "__module__", module)
    theirs = _ThirdPartyState(jnp.asarray(4.0), jnp.asarray(2.0))
    assert _states.state_class(theirs) is None
    assert _states.restored_state_class(theirs._asdict()) is None
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
