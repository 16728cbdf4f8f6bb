"""`clipax.metrics`: every clipax statistic in an optimizer state, as a flat dict."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp

from clipax import _common, _states

PyTree = Any

SEPARATOR = "/"
TWICE = (
    "`clipax.metrics` made the key {key!r} twice; rename the groups or chain "
    "entries that give it."
)
# Optax wrappers' states, named as their factories are.
_WRAPPER_LABELS = {
    "InjectHyperparamsState": "inject_hyperparams",
    "InjectStatefulHyperparamsState": "inject_hyperparams",
    "MultiStepsState": "multi_steps",
    "PartitionState": "partition",
    "MultiTransformState": "partition",
    "MaskedState": "masked",
    "ApplyIfFiniteState": "apply_if_finite",
}


def _snake(name: str) -> str:
    words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name)
    return words.lower()


def _base_name(cls: type) -> str:
    name = cls.__name__
    return name[: -len("State")] if name.endswith("State") and name != "State" else name


def _is_nnx_variable(node: Any) -> bool:
    module = getattr(type(node), "__module__", "") or ""
    return module.startswith("flax.nnx") and hasattr(node, "get_value")


def _unwrap(node: Any) -> Any:
    return node.get_value() if _is_nnx_variable(node) else node


def _scalar(value: Any) -> jax.Array | None:
    value = _unwrap(value)
    if hasattr(value, "shape") and hasattr(value, "dtype") and value.shape == ():
        return jnp.asarray(value)
    return None


def _put(out: dict[str, jax.Array], key: str, value: jax.Array) -> None:
    """`out[key] = value`, or ValueError when `key` is already there."""
    if key in out:
        raise ValueError(TWICE.format(key=key))
    out[key] = value


def _leaf_stats(field: str, value: Any) -> dict[str, jax.Array]:
    """A field holding a tree of scalars (one per update leaf): one entry per
    leaf, keyed `<leaf path>/<field in singular>`; the empty path is `root`.

    Raises:
      ValueError: naming both leaves, if two leaf paths join to one key (a
        dict key holding `/`: `{"a/b": x}` beside `{"a": {"b": y}}`).
    """
    stat = field[:-1] if field.endswith("s") else field
    flat, _ = jax.tree_util.tree_flatten_with_path(value, is_leaf=_is_nnx_variable)
    out = {}
    seen: dict[str, _common.KeyPath] = {}
    for path, leaf in flat:
        scalar = _scalar(leaf)
        if scalar is None:
            continue
        where = SEPARATOR.join(_common.path_segments(path)) or "root"
        if where in seen:
            raise ValueError(
                f"`clipax.metrics` got the leaves at {_common.path_str(seen[where])}"
                f" and {_common.path_str(path)} of `{field}`, whose paths both "
                f"join to {where!r} with {SEPARATOR!r}; one key would hide the "
                f"other. Rename a key so that no dict key holds {SEPARATOR!r}."
            )
        seen[where] = path
        out[f"{where}{SEPARATOR}{stat}"] = scalar
    return out


def _clip_facts(stats: dict[str, jax.Array], norm: str, threshold: str) -> None:
    """Adds `clipped` and `clip_factor` beside a `norm` / `threshold` pair."""
    if norm not in stats or threshold not in stats:
        return
    base = norm[: -len("norm")]
    n, t = stats[norm], stats[threshold]
    _put(stats, f"{base}clipped", n > t.astype(n.dtype))
    _put(stats, f"{base}clip_factor", _common.clip_scale(n, t))


def _state_stats(
    state: Any, registered: _states.StateClass
) -> tuple[dict[str, jax.Array], list[Any]]:
    """One clipax state's statistics (relative keys) and its inner states."""
    stats: dict[str, jax.Array] = {}
    inner = []
    leaf_fields: dict[str, jax.Array] = {}
    for field in registered.fields:
        value = getattr(state, field)
        if field == registered.inner:
            inner.append(value)
        elif field in registered.per_leaf:
            for key, stat in _leaf_stats(field, value).items():
                _put(leaf_fields, key, stat)
        elif (scalar := _scalar(value)) is not None:
            _put(stats, field, scalar)
    _clip_facts(stats, "norm", "threshold")
    for key in [k for k in leaf_fields if k.endswith(f"{SEPARATOR}norm")]:
        _clip_facts(leaf_fields, key, key[: -len("norm")] + "threshold")
    for key, stat in leaf_fields.items():
        _put(stats, key, stat)
    return stats, inner


def _join(prefix: str, segment: str) -> str:
    return f"{prefix}{SEPARATOR}{segment}" if prefix else segment


def _walk(node: Any, prefix: str, out: dict[str, jax.Array]) -> None:
    if node is None or _is_nnx_variable(node) or hasattr(node, "dtype"):
        return
    registered = _states.state_class(node)
    if registered is not None:
        where = _join(prefix, registered.name)
        stats, inner = _state_stats(node, registered)
        for name, value in stats.items():
            _put(out, _join(where, name), value)
        for state in inner:
            _walk(state, where, out)
        return
    cls = type(node)
    fields = getattr(cls, "_fields", None) if isinstance(node, tuple) else None
    label = _WRAPPER_LABELS.get(cls.__name__, _snake(_base_name(cls)))
    for key, child in _states.children(node)[0]:
        segment = _states.key_name(key)
        if fields is not None:  # a NamedTuple: a wrapper's inner state(s)
            segment = label if segment.startswith("inner") else segment
        _walk(child, _join(prefix, segment), out)


def metrics(opt_state: PyTree) -> dict[str, jax.Array]:
    """Every statistic clipax keeps in an optimizer state, as a flat dict.

    Walks `opt_state` (any pytree: optax's `chain`, `named_chain`,
    `MultiSteps`, `inject_hyperparams`, `masked`, `partition` /
    `multi_transform` and `apply_if_finite` states, `clipax.skip_spikes`, an
    NNX `nnx.Optimizer` or its `opt_state`) and finds every clipax state in it:
    an instance of a state class that clipax registers where it defines it.
    Its scalar fields become entries, and a field registered as holding one
    scalar per update leaf (`clip_by_norm`'s `norms`) one entry per leaf; a
    wrapper's inner state (`skip_spikes`'s `inner_state`) is walked for more
    clipax states. Arrays of more than one element (`autoclip`'s buffer) are
    left out: every value is a scalar `jax.Array`, taken from the state as it
    is, so the call is jittable, cheap and never syncs with the host. The dict
    goes straight into `wandb.log`, a TensorBoard writer or `print` (there, as
    into any logger, after `jax.device_get`).

    Keys are `/`-separated paths that end with the statistic's own name:

    - where the state sits: a chain entry's index (`0/`), a `named_chain` or
      `partition` name (`clip/`), `multi_steps/`, `inject_hyperparams/`,
      `masked/`, `apply_if_finite/` for those wrappers' inner states
      (`optax.partition` masks each group: `partition/<group>/masked/`), and the
      state's own transformation, named as its factory (`clip_by_global_norm/`,
      `zclip/`, `skip_spikes/`; a wrapping clipax transformation's inner
      states follow its name);
    - for a per-leaf field, the leaf's path in the updates (`dense/kernel/`;
      `root/` for a single-array tree) and the field's name in singular
      (`norms` -> `norm`);
    - the field's name: `norm`, `threshold`, `nonfinite_count`, `mean`,
      `skipped`, ...

    So two `clip_by_global_norm`s in one chain give `0/clip_by_global_norm/norm`
    and `2/clip_by_global_norm/norm`, and a chain of `zclip` and a clip gives
    `0/zclip/norm` beside `1/clip_by_global_norm/norm`. Keys depend only on
    the structure of the optimizer, never on values: the same keys every step.

    Derived facts are added where a state has a `norm` and a `threshold`
    (global, or per leaf): `clipped` (bool, whether the last update was
    clipped: `norm > threshold`) and `clip_factor` (what the updates were
    multiplied by: `threshold / max(norm, threshold)`, NaN for a non-finite
    norm). `skip_spikes` keeps `skipped` in its state.

    This is the answer when `optax.tree.get(opt_state, "norm")` raises
    because two transformations of a chain keep a `norm`.

    Args:
      opt_state: an optimizer state (any pytree), or an `nnx.Optimizer`.

    Returns:
      A dict from key to scalar `jax.Array`, ordered as the states sit in
      `opt_state`; empty when it holds no clipax state.

    Raises:
      ValueError: if two statistics would get the same key (a `partition`
        group name or a dict key holding `/`, for example).

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
      >>> logs["0/zclip/norm"], logs["1/clip_by_global_norm/norm"]
      (Array(5., dtype=float32), Array(5., dtype=float32))
      >>> logs["1/clip_by_global_norm/clipped"]
      Array(True, dtype=bool)
      >>> logs["1/clip_by_global_norm/clip_factor"]
      Array(0.2, dtype=float32)
    """
    module = getattr(type(opt_state), "__module__", "") or ""
    if module.startswith("flax.nnx") and hasattr(opt_state, "opt_state"):
        opt_state = opt_state.opt_state  # an nnx.Optimizer
    out: dict[str, jax.Array] = {}
    _walk(opt_state, "", out)
    return out
