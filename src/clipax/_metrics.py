"""`clipax.metrics`: every clipax statistic in an optimizer state, as a flat mapping."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from clipax import _engine, _leaves, _states
from clipax._checks import is_traced, is_transformation, short_repr
from clipax._leaves import is_wrapper, path_str, unwrap, varying

SEPARATOR = "/"
# Optax's wrapper states: the name of their factory, and their documented
# field holding the wrapped state(s).
OPTAX_WRAPPERS: dict[type, tuple[str, str]] = {
    optax.InjectHyperparamsState: ("inject_hyperparams", "inner_state"),
    optax.InjectStatefulHyperparamsState: ("inject_hyperparams", "inner_state"),
    optax.MultiStepsState: ("multi_steps", "inner_opt_state"),
    optax.MaskedState: ("masked", "inner_state"),
    optax.ApplyIfFiniteState: ("apply_if_finite", "inner_state"),
    optax.transforms.PartitionState: ("partition", "inner_states"),
    optax.transforms.ConditionallyMaskState: ("conditionally_mask", "inner_state"),
    optax.transforms.ConditionallyTransformState: (
        "conditionally_transform",
        "inner_state",
    ),
}


@jax.tree_util.register_pytree_node_class
class Metrics(Mapping[str, Any]):
    """A flat mapping from `/`-separated keys to scalars, held as a few arrays.

    What `clipax.metrics` and `clipax.tree.group_norms` return: one array per
    statistic (a vector for per-tensor statistics, one entry per tensor or
    layer, on its last axis), each key naming an entry. It is a pytree of
    those arrays, so a jitted step returns a handful of arrays, not one per
    key; stacked over steps (`lax.scan`, `jnp.stack` leaf by leaf) or made
    under `vmap`, a value is the series over the leading axes. Under
    `jax.jit` a value is the array's entry; outside, the first value read
    fetches every array to the host at once (`jax.device_get`), and values
    are NumPy scalars (arrays, for a series), ready for any logger. `a | b`
    merges two.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> grads = {"a": jnp.ones(4), "b": jnp.ones(9)}
      >>> tx = clipax.clip_by_norm(1.0)
      >>> _, state = tx.update(grads, tx.init(grads))
      >>> logs = clipax.metrics(state) | clipax.tree.group_norms(grads, key_prefix="g")
      >>> {key: float(value) for key, value in logs.items()}
      {'clip_by_norm/a/norm': 2.0, 'clip_by_norm/b/norm': 3.0,
       'g/a/norm': 2.0, 'g/b/norm': 3.0}
    """

    def __init__(self, arrays: list[Any], where: dict[str, tuple[int, int | None]]):
        self._arrays = list(arrays)
        self._where = where  # key -> (array, flat index into it or None)
        self._host: list[Any] | None = None
        self._traced = any(is_traced(a) for a in self._arrays)

    def __getitem__(self, key: str) -> Any:
        j, index = self._where[key]
        at = () if index is None else (..., index)  # leading axes: a series
        if self._traced:
            return self._arrays[j][at]
        if self._host is None:
            self._host = jax.device_get(self._arrays)
        return self._host[j][at][()]

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __repr__(self) -> str:
        return f"Metrics({ {key: self[key] for key in self} })"

    def __or__(self, other: Metrics) -> Metrics:
        shift = len(self._arrays)
        where = dict(self._where)
        for key, (j, index) in other._where.items():
            _put(where, key, (j + shift, index))
        return Metrics(self._arrays + other._arrays, where)

    def tree_flatten(self) -> tuple[list[Any], tuple[Any, ...]]:
        return self._arrays, tuple(self._where.items())

    @classmethod
    def tree_unflatten(cls, where: tuple[Any, ...], arrays: Any) -> Metrics:
        return cls(list(arrays), dict(where))


def _put(out: dict[str, Any], key: str, value: Any) -> None:
    if key in out:
        raise ValueError(
            f"`clipax.metrics` made the key {key!r} twice; rename the groups or "
            "chain entries that give it."
        )
    out[key] = value


def _clip_facts(norm: Any, threshold: Any) -> dict[str, Any]:
    """`clipped` and `clip_factor`, from a `norm` and a `threshold`."""
    threshold = jnp.asarray(threshold).astype(norm.dtype)
    return {
        "clipped": norm > threshold,
        "clip_factor": _engine.clip_factor(norm, threshold),
    }


def _statistics(state: Any, declared: _states.Declared) -> tuple[list[Any], dict]:
    """One clipax state's statistics as arrays, and each key's place in them:
    its 0-d fields, and per-tensor fields as one vector each (every tensor's
    entries, layer by layer where stacked), with `clipped` and `clip_factor`
    beside a `norm` and a `threshold`.

    Raises:
      ValueError: naming both leaves, if two paths join to one key (a dict key
        holding `/`: `{"a/b": x}` beside `{"a": {"b": y}}`); naming the leaf,
        if a per-tensor statistic is split across devices (inside `shard_map`).
    """
    fields = {f: unwrap(getattr(state, f)) for f in declared.fields}
    scalars = {
        f: jnp.asarray(v)
        for f, v in fields.items()
        if f not in (*declared.per_tensor, *declared.unreported, declared.inner)
        and hasattr(v, "dtype")
        and np.shape(v) == ()
    }
    norm, threshold = declared.clip or ("", "")
    if norm in scalars:
        scalars |= _clip_facts(scalars[norm], scalars[threshold])
    arrays = list(scalars.values())
    where = {k: (j, None) for j, k in enumerate(scalars)}
    tensors: dict[str, tuple[Any, list[tuple[str, int]]]] = {}
    depths = getattr(state, "stacks", _leaves.Stacks()).depths
    manual = _leaves.manual_axes()
    known = bool(manual) and _leaves.types_checked(manual)
    for field, stat in declared.per_tensor.items():
        heads = int(field in declared.per_head)  # after the layers, unsplit
        flat = jax.tree_util.tree_flatten_with_path(fields[field], is_leaf=is_wrapper)
        paths, values = [p for p, _ in flat[0]], [unwrap(v) for _, v in flat[0]]
        for path, v in zip(paths, values, strict=True):
            if manual and (varying(v) or (np.ndim(v) > heads and not known)):
                raise ValueError(
                    f"`clipax.metrics` cannot tell whether the `{field}` of the "
                    f"leaf at {path_str(path)} is split across devices (inside "
                    f"shard_map over {manual}, it "
                    + (f"varies over {varying(v)}" if varying(v) else "holds layers")
                    + "): its keys would count each device's share from layer 0. "
                    "Read the state outside shard_map, as its `out_specs` assemble it."
                )
        shapes = [np.shape(v) for v in values]
        vector = jnp.concatenate(
            [_leaves.replicated(jnp.asarray(v)).reshape(-1) for v in values]
            or [jnp.zeros(0)]
        )
        tensors[stat] = (vector, _keyed(paths, shapes, depths, heads))
    if norm in declared.per_tensor:
        n = tensors[declared.per_tensor[norm]]
        t = tensors[declared.per_tensor[threshold]]
        tensors |= {k: (v, n[1]) for k, v in _clip_facts(n[0], t[0]).items()}
    for stat, (vector, entries) in tensors.items():
        arrays.append(vector)
        for joined, flat_index in entries:
            _put(where, f"{joined}{SEPARATOR}{stat}", (len(arrays) - 1, flat_index))
    return arrays, where


def _keyed(
    paths: list[Any], shapes: list[tuple[int, ...]], depths: Any, heads: int
) -> list[tuple[str, int]]:
    """Each entry of a per-tensor statistic's vector: its key and place.

    Raises:
      ValueError: naming both leaves, if two paths join to one key.
    """
    entries: list[tuple[str, int]] = []
    seen: dict[str, Any] = {}
    for i, keys, flat_index in _leaves.flat_keys(paths, shapes, depths, heads):
        joined = SEPARATOR.join(keys if paths[i] else ["root", *keys])
        if seen.setdefault(joined, paths[i]) != paths[i]:
            raise ValueError(
                f"`clipax.metrics` got the leaves at {path_str(seen[joined])} and "
                f"{path_str(paths[i])}, whose paths both join to {joined!r} with "
                f"{SEPARATOR!r}; one key would hide the other. Rename a key so that "
                f"no dict key holds {SEPARATOR!r}."
            )
        entries.append((joined, flat_index))
    return entries


def _walk(node: Any, path: list[str], found: list[tuple[list[str], Any]]) -> None:
    """Every clipax state below `node`, with the path of names to it (chain
    indices, `named_chain` names, wrappers' names)."""
    if node is None or hasattr(node, "dtype") or is_wrapper(node):
        return
    declared = _states.DECLARED.get(type(node))
    if declared is not None:
        found.append((path, node))
        if declared.inner is not None:
            _walk(getattr(node, declared.inner), [*path, declared.name], found)
        return
    label, inner = OPTAX_WRAPPERS.get(type(node), ("", ""))
    for key, child in _states.children(node)[0]:
        name = _states.key_name(key)
        _walk(child, [*path, label if name == inner else name], found)


def _check_state(opt_state: Any) -> None:
    """An optimizer state: a pytree of arrays holding at least one state node
    (every optax and clipax state is a NamedTuple), or None.

    Raises:
      TypeError: for a transformation, a string, a number, a tree of arrays
        with no state in it (parameters, gradients), or a tree holding
        something that is not an array.
    """
    what = (
        "`clipax.metrics` takes an optimizer state (what `tx.init` and "
        "`tx.update` return, or an `nnx.Optimizer`)"
    )
    if is_transformation(opt_state):
        raise TypeError(
            f"{what}; got a {type(opt_state).__name__}, a transformation: pass "
            "its state, `tx.init(params)`."
        )
    nodes = jax.tree.leaves(
        opt_state, is_leaf=lambda x: isinstance(x, tuple) and hasattr(x, "_fields")
    )
    for leaf in nodes:
        if not (isinstance(leaf, tuple) or hasattr(leaf, "dtype")):
            raise TypeError(
                f"{what}; got {short_repr(opt_state)}, which holds a "
                f"{type(leaf).__name__}."
            )
    if opt_state is not None and not any(isinstance(leaf, tuple) for leaf in nodes):
        raise TypeError(
            f"{what}; got a tree of arrays with no optimizer state in it "
            "(parameters or gradients?)."
        )


def metrics(opt_state: Any) -> Metrics:
    """Every statistic clipax keeps in an optimizer state, as a flat mapping.

    Walks `opt_state` (optax's chains and wrappers, `clipax.skip_spikes`, an
    `nnx.Optimizer`) and reports every clipax state in it: its scalar
    statistics, and one entry per tensor for per-tensor ones (`clip_by_norm`'s
    `norms`; one per layer of a stacked tensor, keyed as the unrolled model).
    Beside a `norm` and a `threshold` it adds `clipped` and `clip_factor`.
    Keys are `/`-separated, the rule's name first (`adagc/blocks/0/w/ema`),
    the same every step and wherever the rule sits in a chain; where a state
    holds the same rule twice, each key starts with the path to its rule
    (chain index, `named_chain` name, wrapper). The result is a
    `clipax.Metrics`: a few arrays, so that returning it from a jitted step
    costs a few outputs, and one transfer when read outside jit
    (docs/skipping-and-logging.md).

    Args:
      opt_state: an optimizer state (any pytree), or an `nnx.Optimizer`.

    Returns:
      A `clipax.Metrics`, in the order the states sit in `opt_state`; empty
      when it holds no clipax state.

    Raises:
      TypeError: if `opt_state` is not an optimizer state (a transformation, a
        string, a number, parameters).
      ValueError: if two statistics would get the same key.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import clipax
      >>> tx = optax.chain(
      ...     clipax.zclip(warmup_steps=2), clipax.clip_by_global_norm(1.0)
      ... )
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> _, state = tx.update({"w": jnp.array([3.0, 4.0])}, state)
      >>> logs = clipax.metrics(state)
      >>> float(logs["zclip/norm"]), float(logs["clip_by_global_norm/clip_factor"])
      (5.0, 0.2)
    """
    nnx = _leaves.imported("flax.nnx")
    if nnx is not None and isinstance(opt_state, nnx.Optimizer):
        opt_state = opt_state.opt_state
    _check_state(opt_state)
    found: list[tuple[list[str], Any]] = []
    _walk(opt_state, [], found)
    names = [_states.DECLARED[type(node)].name for _, node in found]
    out = Metrics([], {})
    for (path, node), name in zip(found, names, strict=True):
        prefix = SEPARATOR.join([*path, name] if names.count(name) > 1 else [name])
        arrays, where = _statistics(node, _states.DECLARED[type(node)])
        out = out | Metrics(
            arrays, {f"{prefix}{SEPARATOR}{k}": w for k, w in where.items()}
        )
    return out
