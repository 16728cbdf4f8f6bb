"""What each clipax state class declares, for `metrics` and `migrate_state`.

A state class declares itself where it is defined:

    @_states.declare("clip_by_norm", per_tensor={"norms": "norm"})
    class ClipByNormState(NamedTuple): ...

- `name`: its factory's name, which `metrics` puts in its keys;
- `per_tensor`: the fields holding a tree like the updates with one array per
  leaf, shaped as its layers, reported tensor by tensor under the name given
  (`norms` -> `norm`);
- `unreported`: the other per-tensor fields (kept, not reported);
- `per_head`: those per-tensor fields whose arrays hold, after the layers, one
  entry per attention head, keyed after the tensor's path (`attn/3/max_logit`);
- `inner`: for a wrapper, the field holding the wrapped state, which `metrics`
  walks and `migrate_state` fills from the old state;
- `clip`: the fields of a norm and of the threshold it was clipped to (both
  scalars, or both per tensor), from which `metrics` adds `clipped` and
  `clip_factor`.

Every other field holding a 0-d array is a scalar statistic: which fields
`metrics` reports depends on the class alone, never on the tree's shape. A
restored state (orbax's untargeted restore, an `nnx.State`) keeps only its
field names: a mapping whose keys are exactly a declared class's fields is
that class's state. A NamedTuple that is not declared is not clipax's,
whatever its module.

Why a registry: `metrics` and `migrate_state` must find every clipax state in
any optimizer state, restored ones included (DESIGN.md, "Logs" and
"Switching"), without importing every rule; each class says what it is where
it is defined, and nothing is found by its class name or module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax

from clipax._leaves import path_keys

_Class = TypeVar("_Class", bound=type)


@dataclasses.dataclass(frozen=True)
class Declared:
    """A clipax state class and what it declares (see the module)."""

    cls: type
    name: str
    per_tensor: Mapping[str, str]
    inner: str | None
    fields: tuple[str, ...]  # the class's `_fields`
    per_head: tuple[str, ...] = ()
    unreported: tuple[str, ...] = ()
    clip: tuple[str, ...] = ()  # (the norm's field, the threshold's)

    def is_restored(self, node: Mapping[Any, Any]) -> bool:
        """Whether `node` is this class's state with its class gone (a static
        field, which holds no array, may be gone too)."""
        static = {
            f
            for f, v in getattr(self.cls, "_field_defaults", {}).items()
            if not jax.tree.leaves(v)
        }
        return set(self.fields) - static <= {str(k) for k in node} <= set(self.fields)


# Filled as clipax's modules are imported: each state class declares itself.
DECLARED: dict[type, Declared] = {}


def declare(
    name: str,
    *,
    per_tensor: Mapping[str, str] | None = None,
    inner: str | None = None,
    per_head: tuple[str, ...] = (),
    unreported: tuple[str, ...] = (),
    clip: tuple[str, str] | tuple[()] = (),
) -> Callable[[_Class], _Class]:
    """A class decorator that declares a NamedTuple a clipax state class.

    Raises:
      TypeError: if the class is not a NamedTuple.
      ValueError: if the class or its `name` is declared already, or a field
        named in the declaration is not one of the class's.
    """
    per_tensor = dict(per_tensor or {})

    def add(cls: _Class) -> _Class:
        fields = getattr(cls, "_fields", None)
        if not (issubclass(cls, tuple) and isinstance(fields, tuple)):
            raise TypeError(
                f"`declare` takes a NamedTuple class; got {cls.__qualname__}."
            )
        for field in (*per_tensor, *unreported, *clip, *([inner] if inner else [])):
            if field not in fields:
                raise ValueError(
                    f"{cls.__qualname__} has no field {field!r} to declare; its "
                    f"fields are {fields}."
                )
        for other in DECLARED.values():
            if cls is other.cls or name == other.name:
                same = "class" if cls is other.cls else "name"
                raise ValueError(
                    f"{cls.__qualname__} cannot be declared as {name!r}: "
                    f"{other.cls.__qualname__}, declared as {other.name!r}, has "
                    f"the same {same}."
                )
        DECLARED[cls] = Declared(
            cls, name, per_tensor, inner, fields, per_head, unreported, clip
        )
        return cls

    return add


def declared(node: Any) -> Declared | None:
    """What `node`'s class declares: for a mapping (a restored state), the
    class whose fields are its keys; None when `node` is no clipax state."""
    if isinstance(node, Mapping):
        return next((d for d in DECLARED.values() if d.is_restored(node)), None)
    return DECLARED.get(type(node))


def children(node: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """One level of a state: `node`'s children as (key, child), and the
    treedef that rebuilds `node` from them (a leaf has no children)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        node, is_leaf=lambda x: x is not node
    )
    return [(path[0], child) for path, child in flat if path], treedef


def key_name(key: Any) -> str:
    """A child's key as a string: a dict key, an attribute name, an index."""
    return path_keys((key,))[0]
