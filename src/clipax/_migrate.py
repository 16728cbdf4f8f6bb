"""`migrate_state`: carry a running job's optimizer state into another chain."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from clipax import _states
from clipax._checks import is_traced
from clipax._leaves import path_str

PyTree = Any

MISMATCH = (
    "`migrate_state` cannot match the old state to the new one at {path}: {why}. "
    "Nothing was reset silently; build the new chain with the same optimizer (and "
    "the same parameters) as the one that wrote the old state."
)


def _inner(node: Any) -> str | None:
    """The field holding the wrapped state, when `node` is a clipax wrapper's."""
    declared = _states.declared(node)
    return None if declared is None else declared.inner


def _is_statistics(node: Any) -> bool:
    return _states.declared(node) is not None and _inner(node) is None


def _is_empty(node: Any) -> bool:
    """A node without children: None, MaskedNode, EmptyState, an empty
    container, a static node (a clipax state's `stacks`)."""
    no_children = jax.tree_util.treedef_is_leaf(jax.tree.structure(node))
    return no_children and not jax.tree.leaves(node)


def _is_leaf(node: Any) -> bool:
    return isinstance(node, (jax.Array, np.ndarray, np.generic, int, float, complex))


def _old_children(old: Any, new: Any) -> dict[str, Any] | None:
    """`old`'s children by key name, or None when it is not `new`'s kind.

    Plain dicts and lists (orbax's untargeted restore) match by keys; objects
    must be of `new`'s own type.
    """
    if isinstance(old, Mapping):
        return {str(k): v for k, v in old.items()}
    if type(old) is list:
        return {str(i): v for i, v in enumerate(old)}
    if type(old) is not type(new):
        return None
    return {_states.key_name(key): child for key, child in _states.children(old)[0]}


def _dtype(node: Any) -> Any:
    """`node`'s dtype: a NumPy dtype, or an extended one (a typed PRNG key's,
    `key<fry>`), which NumPy cannot read."""
    dtype = node.dtype if hasattr(node, "dtype") else np.asarray(node).dtype
    return dtype if jnp.issubdtype(dtype, jax.dtypes.extended) else np.dtype(dtype)


def _kind(dtype: Any) -> Any:
    """What a dtype may be cast from: its kind in jnp's lattice (which puts
    bfloat16 and float8 under floating, int4 under integer); a typed PRNG
    key's only its own dtype (there is no cast)."""
    kinds = (jnp.bool_, jnp.integer, jnp.floating, jnp.complexfloating)
    return next((k for k in kinds if jnp.issubdtype(dtype, k)), dtype)


def _describe(node: Any) -> str:
    if _is_leaf(node):
        return f"an array of shape {np.shape(node)} and dtype {_dtype(node)}"
    if node is None:
        return "None"
    if isinstance(node, Mapping):
        return f"a {type(node).__name__} with keys {sorted(str(k) for k in node)}"
    return f"a {type(node).__name__}"


def _leaf(old: Any, new: Any, where: str) -> Any:
    if not (_is_leaf(old) or hasattr(old, "shape")):
        why = f"the new state holds {_describe(new)}, the old state {_describe(old)}"
        raise _mismatch(where, why)
    old_dtype, new_dtype = _dtype(old), _dtype(new)
    if np.shape(old) != np.shape(new):
        why = f"the old array has shape {np.shape(old)}, the new one {np.shape(new)}"
        raise _mismatch(where, why)
    if _kind(old_dtype) != _kind(new_dtype):
        why = f"the old array has dtype {old_dtype}, the new one {new_dtype}"
        raise _mismatch(where, why)
    if not isinstance(old, jax.Array):
        old = np.asarray(old)
    value = old if old_dtype == new_dtype else old.astype(new_dtype)
    if is_traced(new) or is_traced(old):
        return jnp.asarray(value)  # under jax.jit
    if isinstance(new, jax.Array):
        return jax.device_put(value, new.sharding)
    return np.asarray(value)


def _mismatch(path: str, why: str) -> ValueError:
    return ValueError(MISMATCH.format(path=path, why=why))


def _spare(node: Any) -> bool:
    """A part one state may have and the other not: empty, or statistics."""
    return _is_empty(node) or _is_statistics(node)


def _migrate(old: Any, new: Any, path: tuple[Any, ...]) -> Any:
    where = path_str(path)
    if _is_empty(new):
        if _spare(old):
            return new
        why = f"the old state holds {_describe(old)} where the new state holds nothing"
        raise _mismatch(where, why)
    if _is_leaf(new):
        return _leaf(old, new, where)
    if jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(new)):
        why = f"the new state holds {_describe(new)}, which is not an array"
        raise _mismatch(where, why + " (build it with `new_tx.init(params)`)")
    new_class, old_class = _states.declared(new), _states.declared(old)
    if _is_statistics(new) and _spare(old) and old_class is not new_class:
        return new  # clipax's statistics that the old chain did not keep
    children, treedef = _states.children(new)
    if _inner(new) is not None and old_class is not new_class:  # a wrapper added
        return treedef.unflatten(
            [
                _migrate(old, c, (*path, k))
                if _states.key_name(k) == _inner(new)
                else c
                for k, c in children
            ]
        )
    if (inner := _inner(old)) is not None and old_class is not new_class:
        return _migrate(
            old[inner] if isinstance(old, Mapping) else getattr(old, inner), new, path
        )
    by_name = _old_children(old, new)
    if by_name is None:
        why = f"the new state holds {_describe(new)}, the old state {_describe(old)}"
        raise _mismatch(where, why)
    out = []
    for key, child in children:
        if (name := _states.key_name(key)) in by_name:
            out.append(_migrate(by_name.pop(name), child, (*path, key)))
        elif _spare(child):
            out.append(child)  # a part the old state left out, or fresh statistics
        else:
            raise _mismatch(path_str((*path, key)), "the old state has no part there")
    for name, child in by_name.items():
        if not _spare(child):
            why = f"the old state holds {_describe(child)} there, which the new "
            why += "state has no place for"
            raise _mismatch(f"{where} (key {name!r} of the old state)", why)
    return treedef.unflatten(out)


def migrate_state(old_state: PyTree, new_state: PyTree) -> PyTree:
    """Carries an optimizer state saved by one chain into another chain's state.

    The way to switch a running job between an optax clip and its clipax
    replacement, in either direction, or to add or drop a clipax wrapper such as
    `skip_spikes`, without losing the optimizer's moments, counts, schedule steps
    and injected hyperparameters. Every part both states hold comes from
    `old_state`, cast to `new_state`'s dtype and placed with its sharding; clipax's
    statistics start fresh where the old state kept none; anything else that does
    not match is an error: nothing is reset silently. `old_state` may be the state
    objects or orbax's untargeted restore of them (dicts and lists, where a
    clipax state is known by its field names). docs/porting.md, "Switching a
    running job", gives the rules and the Flax NNX recipe.

    Args:
      old_state: the state saved by the old chain: objects, or orbax's
        untargeted restore of them.
      new_state: the new chain's fresh state, `new_tx.init(params)`.

    Returns:
      A state with `new_state`'s structure, ready for `new_tx.update`.

    Raises:
      ValueError: naming the path of the first part that cannot be matched
        (another optimizer, another shape, a missing or an extra part).

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import clipax
      >>> params = {"w": jnp.zeros(2)}
      >>> old_tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
      >>> _, old_state = old_tx.update({"w": jnp.ones(2)}, old_tx.init(params))
      >>> new_tx = optax.chain(clipax.clip_by_global_norm(1.0), optax.adam(0.1))
      >>> state = clipax.migrate_state(old_state, new_tx.init(params))
      >>> state[1][0].count, state[0].norm
      (Array(1, dtype=int32), Array(0., dtype=float32))
    """
    return _migrate(old_state, new_state, ())
