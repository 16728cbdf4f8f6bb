"""`clipax.metrics`: every clipax statistic in an optimizer state, as a flat dict."""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import optax

from clipax import _engine, _states
from clipax._checks import short_repr
from clipax._leaves import layer_keys, path_str

SEPARATOR = "/"
TWICE = (
    "`clipax.metrics` made the key {key!r} twice; rename the groups or chain "
    "entries that give it."
)
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


def _nnx() -> Any:
    """Flax NNX, where the program has imported it (an NNX object exists only
    then); None otherwise."""
    return sys.modules.get("flax.nnx")


def _unwrap(node: Any) -> Any:
    """An NNX variable's value; any other node as it is."""
    nnx = _nnx()
    if not (nnx and isinstance(node, nnx.Variable)):
        return node
    # `get_value` from Flax 0.12; `.value` before.
    return node.get_value() if hasattr(type(node), "get_value") else node.value


def _is_variable(node: Any) -> bool:
    nnx = _nnx()
    return bool(nnx) and isinstance(node, nnx.Variable)


def _put(out: dict[str, jax.Array], key: str, value: jax.Array) -> None:
    if key in out:
        raise ValueError(TWICE.format(key=key))
    out[key] = value


def _join(prefix: str, segment: str) -> str:
    return f"{prefix}{SEPARATOR}{segment}" if prefix else segment


def _clip_facts(norm: jax.Array, threshold: jax.Array) -> dict[str, jax.Array]:
    """`clipped` and `clip_factor`, from a `norm` and a `threshold`."""
    return {
        "clipped": norm > threshold.astype(norm.dtype),
        "clip_factor": _engine.clip_factor(norm, threshold),
    }


def _per_tensor(state: Any, declared: _states.Declared) -> dict[str, jax.Array]:
    """One entry per tensor of each per-tensor field, `<tensor path>/<stat>`
    (the empty path `root`); for a stacked tensor, one per layer, its index
    where its stack starts (`_leaves.layer_keys`).

    Raises:
      ValueError: naming both leaves, if two paths join to one key (a dict key
        holding `/`: `{"a/b": x}` beside `{"a": {"b": y}}`).
    """
    fields: dict[str, list[Any]] = {}
    paths: list[Any] = []
    for field, stat in declared.per_tensor.items():
        flat = jax.tree_util.tree_flatten_with_path(
            getattr(state, field), is_leaf=_is_variable
        )[0]
        paths = [path for path, _ in flat]
        fields[stat] = [jnp.asarray(_unwrap(x)) for _, x in flat]
    if not fields:
        return {}
    if "norm" in fields and "threshold" in fields:  # whole vectors, then entries
        facts = [
            _clip_facts(*pair)
            for pair in zip(fields["norm"], fields["threshold"], strict=True)
        ]
        for name in ("clipped", "clip_factor"):
            fields[name] = [fact[name] for fact in facts]
    shapes = [x.shape for x in next(iter(fields.values()))]
    unrolled = layer_keys(paths, shapes)
    seen: dict[str, Any] = {}
    for i, _, keys in unrolled:
        where = SEPARATOR.join(keys) or "root"
        if seen.setdefault(where, paths[i]) != paths[i]:
            raise ValueError(
                f"`clipax.metrics` got the leaves at {path_str(seen[where])} and "
                f"{path_str(paths[i])}, whose paths both join to {where!r} with "
                f"{SEPARATOR!r}; one key would hide the other. Rename a key so that "
                f"no dict key holds {SEPARATOR!r}."
            )
    out: dict[str, jax.Array] = {}
    for stat, values in fields.items():
        for i, index, keys in unrolled:
            value = values[i] if index is None else _engine.entry(values[i], index)
            _put(out, _join(SEPARATOR.join(keys) or "root", stat), value)
    return out


def _statistics(state: Any, declared: _states.Declared) -> dict[str, jax.Array]:
    """One clipax state's statistics, as its class declares them."""
    stats: dict[str, jax.Array] = {}
    for field in declared.fields:
        value = _unwrap(getattr(state, field))
        if field in declared.per_tensor or field == declared.inner:
            continue
        if getattr(value, "shape", None) == ():
            stats[field] = jnp.asarray(value)
    if "norm" in stats and "threshold" in stats:
        stats.update(_clip_facts(stats["norm"], stats["threshold"]))
    for key, value in _per_tensor(state, declared).items():
        _put(stats, key, value)
    return stats


def _walk(node: Any, prefix: str, out: dict[str, jax.Array]) -> None:
    if node is None or hasattr(node, "dtype") or _is_variable(node):
        return
    declared = _states.DECLARED.get(type(node))
    if declared is not None:
        where = _join(prefix, declared.name)
        for name, value in _statistics(node, declared).items():
            _put(out, _join(where, name), value)
        if declared.inner is not None:
            _walk(getattr(node, declared.inner), where, out)
        return
    label, inner = OPTAX_WRAPPERS.get(type(node), ("", ""))
    for key, child in _states.children(node)[0]:
        name = _states.key_name(key)
        _walk(child, _join(prefix, label if name == inner else name), out)


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
    if opt_state is None:
        return
    if callable(getattr(opt_state, "init", None)) and callable(
        getattr(opt_state, "update", None)
    ):
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
    if not any(isinstance(leaf, tuple) for leaf in nodes):
        raise TypeError(
            f"{what}; got a tree of arrays with no optimizer state in it "
            "(parameters or gradients?)."
        )


def metrics(opt_state: Any) -> dict[str, jax.Array]:
    """Every statistic clipax keeps in an optimizer state, as a flat dict.

    Walks `opt_state` (optax's chains and wrappers, `clipax.skip_spikes`, an
    `nnx.Optimizer`) and reports every clipax state in it: its scalar
    statistics, and one entry per tensor for per-tensor ones (`clip_by_norm`'s
    `norms`; one per layer of a stacked tensor). Beside a `norm` and a
    `threshold` it adds `clipped` and `clip_factor`. Every value is a scalar
    `jax.Array` taken from the state: the call is jittable and never syncs
    with the host. Keys are `/`-separated paths ending with the statistic's
    name, the same every step (docs/skipping-and-logging.md gives the scheme).

    Args:
      opt_state: an optimizer state (any pytree), or an `nnx.Optimizer`.

    Returns:
      A dict from key to scalar `jax.Array`, in the order the states sit in
      `opt_state`; empty when it holds no clipax state.

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
      >>> logs["0/zclip/norm"], logs["1/clip_by_global_norm/clip_factor"]
      (Array(5., dtype=float32), Array(0.2, dtype=float32))
    """
    nnx = _nnx()
    if nnx and isinstance(opt_state, nnx.Optimizer):
        opt_state = opt_state.opt_state
    _check_state(opt_state)
    out: dict[str, jax.Array] = {}
    _walk(opt_state, "", out)
    return out
