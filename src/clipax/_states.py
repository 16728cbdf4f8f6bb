"""The registry of clipax's state classes, which `metrics` and `migrate_state` read.

Every clipax transformation that keeps a state registers its NamedTuple class
once, where the class is defined, saying what the two readers cannot guess:

    @_states.register("clip_by_norm", per_leaf=("norms",))
    class ClipByNormState(NamedTuple): ...

- `name`: the public factory's name, which `clipax.metrics` puts in its keys
  (`0/clip_by_norm/...`);
- `per_leaf`: the fields that hold a tree with one scalar per update leaf,
  which `metrics` reports leaf by leaf;
- `inner`: for a wrapper (`skip_spikes`), the field holding the wrapped
  transformation's state, which `metrics` walks for more clipax states and
  `migrate_state` fills from the old state.

Every other field is one of the rule's statistics: reported by `metrics` when
it is a scalar, started fresh by `migrate_state` where the old chain kept none.
A NamedTuple that is not registered is not clipax's, whatever its module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax

from clipax import _common

_Class = TypeVar("_Class", bound=type)


@dataclasses.dataclass(frozen=True)
class StateClass:
    """A registered clipax state class and what its fields hold (see the module)."""

    cls: type
    fields: tuple[str, ...]
    name: str
    per_leaf: tuple[str, ...]
    inner: str | None


# Filled as clipax's modules are imported: each state class registers itself.
REGISTRY: dict[type, StateClass] = {}


def register(
    name: str, *, per_leaf: tuple[str, ...] = (), inner: str | None = None
) -> Callable[[_Class], _Class]:
    """A class decorator that registers a NamedTuple as a clipax state class.

    Args:
      name: the public factory's name (`"zclip"`), used in `clipax.metrics`'s
        keys.
      per_leaf: the fields holding one scalar per update leaf.
      inner: the field holding a wrapped transformation's state, or None.

    Returns:
      The decorator, which returns the class unchanged.

    Raises:
      TypeError: if the class is not a NamedTuple.
      ValueError: if the class, its `name` or its set of fields is registered
        already (`migrate_state` tells a restored state's class by its fields),
        or if a field named in `per_leaf` or `inner` is not one of the class's.
    """

    def add(cls: _Class) -> _Class:
        fields = getattr(cls, "_fields", None)
        if not (issubclass(cls, tuple) and isinstance(fields, tuple)):
            raise TypeError(
                f"`register` takes a NamedTuple class; got {cls.__qualname__}."
            )
        for field in (*per_leaf, *([] if inner is None else [inner])):
            if field not in fields:
                raise ValueError(
                    f"{cls.__qualname__} has no field {field!r} to register; "
                    f"its fields are {fields}."
                )
        for other in REGISTRY.values():
            same = {
                "class": cls is other.cls,
                "name": name == other.name,
                "fields": set(fields) == set(other.fields),
            }
            if any(same.values()):
                raise ValueError(
                    f"{cls.__qualname__} cannot be registered as {name!r}: "
                    f"{other.cls.__qualname__}, registered as {other.name!r}, has "
                    f"the same {' and '.join(k for k, v in same.items() if v)}."
                )
        REGISTRY[cls] = StateClass(cls, fields, name, tuple(per_leaf), inner)
        return cls

    return add


def state_class(node: Any) -> StateClass | None:
    """The registration of `node`'s class; None when `node` is no clipax state."""
    return REGISTRY.get(type(node))


def restored_state_class(node: Mapping[Any, Any]) -> StateClass | None:
    """The registered class whose fields are exactly the keys of `node`: a
    clipax state whose class is gone (orbax's untargeted restore, `nnx.State`)."""
    keys = {str(key) for key in node}
    for registered in REGISTRY.values():
        if keys == set(registered.fields):
            return registered
    return None


def children(node: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """One level of an optimizer state: `node`'s children as (key, child), and
    the treedef that rebuilds `node` from them (a leaf has no children)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        node, is_leaf=lambda x: x is not node
    )
    return [(path[0], child) for path, child in flat if path], treedef


def key_name(key: Any) -> str:
    """A child's key as a string: a dict key, an attribute name, an index."""
    return _common.path_segments((key,))[0]
