"""`migrate_state`: carry a running job's optimizer state into another chain."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any

INNER = "inner_state"
MISMATCH = (
    "`migrate_state` cannot match the old state to the new one at {path}: {why}. "
    "Nothing was reset silently; build the new chain with the same optimizer (and "
    "the same parameters) as the one that wrote the old state."
)


def _clipax_state_classes() -> list[type]:
    """NamedTuple classes named `*State` that clipax's modules define.

    Looked up each call from the loaded `clipax.*` modules, so that a state
    class added by any clipax module (such as `skip_spikes`'s) counts without
    this module importing it.
    """
    found: dict[type, None] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "clipax" or name.startswith("clipax.")):
            continue
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, tuple)
                and hasattr(value, "_fields")
                and value.__name__.endswith("State")
                and value.__module__.startswith("clipax")
            ):
                found[value] = None
    return list(found)


def _keyset(node: Any) -> frozenset[str] | None:
    """The field names a node of clipax's could be recognised by."""
    if _is_clipax(node):
        return frozenset(node._fields)
    if isinstance(node, Mapping):
        return frozenset(str(k) for k in node)
    return None


def _clipax_class_of(node: Any) -> type | None:
    """The clipax state class of `node`: its class, or the one whose fields are
    exactly the keys of a mapping (an orbax restore, an `nnx.State`)."""
    if _is_clipax(node):
        return type(node)
    keys = _keyset(node)
    if not keys:
        return None
    for cls in _clipax_state_classes():
        if frozenset(cls._fields) == keys:  # type: ignore[attr-defined]
            return cls
    return None


def _is_clipax(node: Any) -> bool:
    cls = type(node)
    return (
        isinstance(node, tuple)
        and hasattr(node, "_fields")
        and cls.__module__.startswith("clipax")
    )


def _is_wrapper(node: Any) -> bool:
    cls = _clipax_class_of(node)
    return cls is not None and INNER in cls._fields  # type: ignore[attr-defined]


def _is_statistics(node: Any) -> bool:
    cls = _clipax_class_of(node)
    return cls is not None and INNER not in cls._fields  # type: ignore[attr-defined]


def _is_empty(node: Any) -> bool:
    """None, MaskedNode, EmptyState, or a container without children."""
    if node is None or isinstance(node, (optax.MaskedNode, optax.EmptyState)):
        return True
    return isinstance(node, (tuple, list, Mapping)) and len(node) == 0


def _is_leaf(node: Any) -> bool:
    return isinstance(node, (jax.Array, np.ndarray, np.generic, int, float, complex))


def _key_name(key: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _children(node: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """One level of `node`: [(key, child)] and the treedef to rebuild it."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        node, is_leaf=lambda x: x is not node
    )
    return [(path[0], child) for path, child in flat], treedef


def _old_children(old: Any, new: Any) -> dict[str, Any] | None:
    """`old`'s children by key name, or None when it is not `new`'s kind.

    Plain dicts and lists (orbax's untargeted restore) match by keys; objects
    must be of `new`'s own type.
    """
    if type(old) in (dict, list) or isinstance(old, Mapping):
        if isinstance(old, Mapping):
            return {str(k): v for k, v in old.items()}
        return {str(i): v for i, v in enumerate(old)}
    if type(old) is tuple and type(new) is not tuple:
        return None
    if type(old) is not type(new) and not (
        type(old) in (tuple, list) and type(new) in (tuple, list)
    ):
        return None
    return {_key_name(key): child for key, child in _children(old)[0]}


def _dtype(node: Any) -> Any:
    """`node`'s dtype: a NumPy dtype, or an extended one (a typed PRNG key's,
    `key<fry>`), which NumPy cannot read."""
    dtype = node.dtype if hasattr(node, "dtype") else np.asarray(node).dtype
    return dtype if _is_extended(dtype) else np.dtype(dtype)


def _is_extended(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jax.dtypes.extended))


def _describe(node: Any) -> str:
    if _is_leaf(node):
        return f"an array of shape {np.shape(node)} and dtype {_dtype(node)}"
    if node is None:
        return "None"
    if isinstance(node, Mapping):
        return f"a {type(node).__name__} with keys {sorted(str(k) for k in node)}"
    return f"a {type(node).__name__}"


def _leaf(old: Any, new: Any, where: str) -> Any:
    if not _is_leaf(old) and not (hasattr(old, "shape") and hasattr(old, "dtype")):
        raise ValueError(
            MISMATCH.format(
                path=where,
                why=f"the new state holds {_describe(new)}, the old "
                f"state {_describe(old)}",
            )
        )
    old_shape, new_shape = np.shape(old), np.shape(new)
    old_dtype, new_dtype = _dtype(old), _dtype(new)
    if old_shape != new_shape:
        raise ValueError(
            MISMATCH.format(
                path=where,
                why=f"the old array has shape {old_shape}, the new one {new_shape}",
            )
        )
    # Kinds in jnp's dtype lattice, not NumPy's: it puts bfloat16 and float8
    # (ml_dtypes) under floating, and int4 under integer. A typed PRNG key
    # matches only a key of the same implementation: there is no cast.
    kinds = (jnp.bool_, jnp.integer, jnp.floating, jnp.complexfloating)
    extended = _is_extended(old_dtype) or _is_extended(new_dtype)
    same_kind = (
        old_dtype == new_dtype
        if extended
        else any(
            jnp.issubdtype(old_dtype, k) and jnp.issubdtype(new_dtype, k) for k in kinds
        )
    )
    if not same_kind:
        raise ValueError(
            MISMATCH.format(
                path=where,
                why=f"the old array has dtype {old_dtype}, the new one {new_dtype}",
            )
        )

    def cast(value: Any) -> Any:
        # A key array (a jax.Array or tracer) is of new's dtype already and
        # has no `astype`.
        return value if extended else value.astype(new_dtype)

    if isinstance(new, jax.core.Tracer) or isinstance(old, jax.core.Tracer):
        return cast(jnp.asarray(old))  # under jax.jit
    if isinstance(new, jax.Array):
        value = cast(old if isinstance(old, jax.Array) else np.asarray(old))
        if isinstance(value, jax.Array) and value.sharding == new.sharding:
            return value
        return jax.device_put(value, new.sharding)
    return np.asarray(old).astype(new_dtype)


def _migrate(old: Any, new: Any, path: tuple[Any, ...]) -> Any:
    where = jax.tree_util.keystr(path) if path else "<root>"
    if _is_empty(new):
        if _is_empty(old) or _is_statistics(old):
            return new
        raise ValueError(
            MISMATCH.format(
                path=where,
                why=f"the old state holds {_describe(old)} where the new "
                "state holds nothing",
            )
        )
    if _is_leaf(new):
        return _leaf(old, new, where)
    if jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(new)):
        raise ValueError(
            MISMATCH.format(
                path=where,
                why=f"the new state holds {_describe(new)}, which is "
                "not an array (build it with `new_tx.init(params)`)",
            )
        )
    if _is_statistics(new) and (
        _is_empty(old)
        or (_is_statistics(old) and _clipax_class_of(old) is not _clipax_class_of(new))
    ):
        return new  # clipax's statistics that the old chain did not keep
    same_wrapper = _is_wrapper(new) and _clipax_class_of(old) is _clipax_class_of(new)
    if _is_wrapper(new) and not same_wrapper:
        children, treedef = _children(new)
        return treedef.unflatten(
            [
                _migrate(old, child, (*path, key)) if _key_name(key) == INNER else child
                for key, child in children
            ]
        )
    if _is_wrapper(old) and _clipax_class_of(old) is not _clipax_class_of(new):
        inner = old[INNER] if isinstance(old, Mapping) else getattr(old, INNER)
        return _migrate(inner, new, path)
    by_name = _old_children(old, new)
    if by_name is None:
        raise ValueError(
            MISMATCH.format(
                path=where,
                why=f"the new state holds {_describe(new)}, the old "
                f"state {_describe(old)}",
            )
        )
    children, treedef = _children(new)
    out = []
    for key, child in children:
        name = _key_name(key)
        if name in by_name:
            out.append(_migrate(by_name.pop(name), child, (*path, key)))
        elif _is_empty(child) or _is_statistics(child):
            out.append(child)  # a part the old state left out, or fresh statistics
        else:
            raise ValueError(
                MISMATCH.format(
                    path=jax.tree_util.keystr((*path, key)),
                    why="the old state has no part there",
                )
            )
    for name, child in by_name.items():
        if not (_is_empty(child) or _is_statistics(child)):
            raise ValueError(
                MISMATCH.format(
                    path=f"{where} (key {name!r} of the old state)",
                    why=f"the old state holds {_describe(child)} there, which the new "
                    "state has no place for",
                )
            )
    return treedef.unflatten(out)


def migrate_state(old_state: PyTree, new_state: PyTree) -> PyTree:
    """Carries an optimizer state saved by one chain into another chain's state.

    The way to switch a running job between `optax.clip_by_global_norm` (or
    `optax.clip`, `optax.clip_by_block_rms`, `optax.adaptive_grad_clip`) and
    its clipax replacement, in either direction, without losing the inner
    optimizer's moments, counts, schedule steps and injected hyperparameters.

    The result has the structure, dtypes and shardings of `new_state`. Each
    part of it that the old state also holds comes from `old_state`; the rest
    is taken from `new_state` under these rules, and anything else is an error:

    - clipax's own statistics start fresh (from `new_state`) where the old
      state holds nothing in their place (optax's `EmptyState`, None); when
      the old state holds the same statistics (a clipax checkpoint), they are
      kept. Going back to optax, clipax's statistics are dropped.
    - A clipax wrapper state (a clipax state with a field `inner_state`, such
      as `skip_spikes`'s) in `new_state` that the old state lacks is filled by
      migrating the whole old state at that place into its `inner_state`; its
      other fields start fresh. The reverse, a wrapper in the old state only,
      is unwrapped.
    - "clipax's own statistics" are recognised generically: instances of
      NamedTuple classes named `*State` defined in a `clipax` module, or,
      where the class is gone (orbax's untargeted restore, `nnx.State`), a
      mapping whose keys are exactly the fields of such a class.

    `old_state` may be the state objects, or what orbax gives back without a
    target (`ocp.StandardCheckpointer().restore(path)`): NamedTuples become
    dicts of their fields, tuples become lists, `EmptyState`, `MaskedNode` and
    None become None. Dicts and lists match `new_state`'s nodes by key or
    position; objects must be of the same type as `new_state`'s (Adam moments
    never go into another optimizer's state). Arrays must have the same shape
    and a dtype of the same kind: bool, integer, floating (bfloat16 and
    float8 included) or complex; they are cast to `new_state`'s dtype and
    placed with its sharding. A typed PRNG key (`jax.random.key`, as in
    `optax.add_noise`'s state) matches only a key of the same implementation
    and shape. Any part that cannot be matched (another shape, a missing
    inner state, an unknown extra part) raises a `ValueError` naming its
    path: nothing is reset silently.

    For Flax NNX, migrate `optimizer.opt_state` (from `restored["opt_state"]`
    or the old optimizer's `opt_state`) and assign the result back; the
    porting page shows it.

    Args:
      old_state: the state saved by the old chain: objects, or orbax's
        untargeted restore of them.
      new_state: the new chain's fresh state, `new_tx.init(params)`.

    Returns:
      A state with `new_state`'s structure, ready for `new_tx.update`.

    Raises:
      ValueError: naming the path of the first part that cannot be matched.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import clipax
      >>> params = {"w": jnp.zeros(2)}
      >>> old_tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
      >>> old_state = old_tx.init(params)
      >>> _, old_state = old_tx.update({"w": jnp.ones(2)}, old_state)
      >>> new_tx = optax.chain(clipax.clip_by_global_norm(1.0), optax.adam(0.1))
      >>> state = clipax.migrate_state(old_state, new_tx.init(params))
      >>> state[1][0].count, state[0].norm
      (Array(1, dtype=int32), Array(0., dtype=float32))
    """
    return _migrate(old_state, new_state, ())
