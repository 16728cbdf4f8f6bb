"""QK-Clip (Kimi K2's MuonClip): attention heads' query and key weights rescaled
after the optimizer step, so that each head's largest logit (of the step's own
forward pass) comes down to the threshold (docs/qk-clip.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from clipax import _checks, _engine, _leaves, _states
from clipax._leaves import KeyPath, Leaf, path_str


@_states.declare(
    "qk_clip",
    per_tensor={"max_logit": "max_logit", "clipped_heads": "clipped_heads"},
    per_head=("max_logit",),
)
class QKClipState(NamedTuple):
    """State of `qk_clip`: what the last update saw, per attention module."""

    max_logit: chex.ArrayTree  # the params' containers, holding at each
    # attention module a float32 [layers..., query heads]: each head's
    # largest attention logit (per layer of a stacked module); None elsewhere
    clipped_heads: chex.ArrayTree  # likewise, int32 [layers...]: the query
    # heads clipped (each over the threshold; with gqa="group", every head of
    # a group whose hottest is, all of whose query weights are scaled)
    stacks: _leaves.Stacks = _leaves.Stacks()  # static: where each stack starts


class Config(NamedTuple):
    """`qk_clip`'s arguments, checked."""

    threshold: Any
    alpha: float
    query: str
    key: str
    head_axis: int
    rope_dim: int
    key_dim: int | None
    gqa: str
    logit_specs: Any
    axis_name: tuple[str, ...]


class Module(NamedTuple):
    """An attention module: its path, its query leaves and its key leaves,
    and the layers and heads of its whole tensors (not a block's)."""

    path: KeyPath
    query: list[Leaf]
    key: list[Leaf]
    whole_layers: tuple[int, ...]
    heads: tuple[int, int]  # query heads, key heads


def is_module(node: Any, config: Config) -> bool:
    """Whether `node` holds a query and a key projection."""
    if hasattr(node, "dtype") or _leaves.is_wrapper(node):
        return False
    names = {_states.key_name(k) for k, _ in _states.children(node)[0]}
    return {config.query, config.key} <= names


def head_axes(leaf: Leaf, config: Config) -> list[int]:
    """A projection leaf's layer axes, then its heads' axis."""
    return [*leaf.layer_axes, *leaf.within((config.head_axis,), "head_axis")]


def modules(tree: Any, leaves: _leaves.Leaves, config: Config) -> list[Module]:
    """Every attention module of `tree`, with its leaves in `leaves`.

    Raises:
      ValueError: if `tree` holds no module, or a module's projections
        differ in layers or heads (naming it).
    """
    is_leaf = lambda x: is_module(x, config)  # noqa: E731
    found = []
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    for path in [p for p, x in flat if is_leaf(x)]:
        parts = [
            [x for x in leaves if _leaves.child_of(x.path, path) == name]
            for name in (config.query, config.key)
        ]
        shapes = [
            {tuple(x.size([a]) for a in head_axes(x, config)) for x in p} for p in parts
        ]
        if all(len(s) == 1 for s in shapes):
            (*layers, nq), (*k_layers, nk) = (next(iter(s)) for s in shapes)
            if layers == k_layers and nq % nk == 0:
                found.append(Module(path, parts[0], parts[1], tuple(layers), (nq, nk)))
                continue
        raise ValueError(
            f"`qk_clip` needs, in the attention module at {path_str(path)}, "
            "query and key leaves of one layer count, whose key heads divide "
            f"the query heads (GQA); got (layers..., heads) {sorted(shapes[0])} "
            f"and {sorted(shapes[1])}."
        )
    if not found:
        raise ValueError(
            f"`qk_clip` found no attention module in `params`: no node holds a "
            f"{config.query!r} and a {config.key!r} child (name them with `query=`, "
            "`key=`)."
        )
    return found


def module_logits(m: Module, records: _leaves.Leaves, config: Config) -> jax.Array:
    """The module's largest logit per layer and head, whole on every device:
    the logits found below its path (a linen `sow`'s tuple: their max),
    reduced over every axis but the leading layers and the last (the batch,
    over the mesh axes that split it), the rest gathered.

    Raises:
      ValueError: naming the module, if no array or several are found below
        its path, or their shape does not fit its layers and heads.
    """
    # Compared as names: the logits' containers need not be the params' own.
    keys = tuple(_leaves.path_keys(m.path))
    below = [r for r in records if keys in _leaves.prefixes(_leaves.path_keys(r.path))]
    homes = {"/".join(_leaves.path_keys(_unsown(r.path))) for r in below}
    if len(homes) != 1:
        found = homes or {"/".join(_leaves.path_keys(_unsown(r.path))) for r in records}
        raise ValueError(
            f"`max_logits` holds {'several arrays' if homes else 'no array'} for "
            f"the attention module at {path_str(m.path)}, where it must mirror "
            f"`params` (docs/qk-clip.md); its entries are at {sorted(found)[:4]}."
        )
    x = jnp.stack([jnp.asarray(r.x, jnp.float32) for r in below]).max(0)
    n, first = len(m.whole_layers), below[0]
    leads = {leaf.x.shape[0] for leaf in m.query + m.key if leaf.x.ndim}
    if not n and x.ndim > 2 and leads == {x.shape[0]}:
        raise ValueError(
            f"`qk_clip` reads the attention module at {path_str(m.path)} as one "
            f"layer, but its projections and `max_logits` (shape {x.shape}) share "
            f"a leading axis of {x.shape[0]}: a scanned module, whose layers the "
            "max over the batch would merge. Pass `stacked=` (e.g. "
            "`clipax.stacked_prefix(params, ...)`); if that axis is no layer "
            "axis, fold it into the batch axis of `max_logits`."
        )
    dims = first.dims if config.logit_specs is not None and first.dims else ()
    s = x
    if x.ndim > n:
        batch = tuple(range(n, x.ndim - 1))
        # The batch may be split across devices: the max over its mesh axes.
        fsdp = config.axis_name and config.logit_specs is None
        split = config.axis_name if fsdp else first.split(batch)
        s = _engine.pmax_all(jnp.max(x, axis=batch), [split])
        for i, d in enumerate([*range(n), x.ndim - 1] if dims else ()):
            s = _engine.gathered(s, i, dims[d]) if dims[d] else s
    if s.shape != (*m.whole_layers, m.heads[0]):
        q = m.query[0]
        raise ValueError(
            f"`max_logits` for the attention module at {path_str(m.path)} has "
            f"shape {x.shape}; it needs the module's layers {m.whole_layers} first "
            f"and its {m.heads[0]} query heads last: the heads read on axis "
            f"{head_axes(q, config)[-1]} (`head_axis`={config.head_axis}) of the "
            f"query leaf at {path_str(q.path)}, shape {tuple(q.x.shape)}."
        )
    return _leaves.replicated(s)


def head_scales(
    s: jax.Array, heads: tuple[int, int], config: Config
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The query heads' scale, the key heads' and each query head's `eta`
    (`threshold / S` where its largest logit `S` is over the threshold, else
    1; with `gqa="group"`, its group's hottest): a group's key by its hottest
    head's `eta**(1 - alpha)`, each query head as little as it can so that
    its logit comes down to `eta` times itself, never grown."""
    (nq, nk), tau = heads, jnp.asarray(config.threshold, jnp.float32)
    over = jnp.isfinite(s) & (s > tau)
    eta = jnp.where(over, tau / jnp.where(over, s, 1), 1)
    hottest = jnp.min(eta.reshape(*s.shape[:-1], nk, nq // nk), axis=-1)
    if config.gqa == "group":  # Megatron-LM: a group's heads all by its hottest
        eta = jnp.repeat(hottest, nq // nk, axis=-1)
    k_scale = hottest ** (1 - config.alpha)
    q_scale = jnp.minimum(eta / jnp.repeat(k_scale, nq // nk, axis=-1), 1)
    return q_scale, k_scale, eta


class Tail(NamedTuple):
    """Part of each head, on the axis after the heads, scaled apart: the
    trailing `size` entries (`trailing`), or the entries from `size` on."""

    scale: jax.Array
    size: int
    trailing: bool


def rescaled(
    leaf: Leaf, w: Any, per_head: jax.Array, config: Config, tail: Tail | None
) -> Any:
    """`leaf`'s update such that the parameter `w` plus it is `w` plus the
    incoming update scaled by `per_head` (by `tail.scale` in a head's tail);
    where the scale is 1, the incoming update itself."""
    axes = head_axes(leaf, config)
    if tail is not None:
        inner = leaf.inner
        if inner.index(axes[-1]) + 1 == len(inner):
            raise ValueError(
                f"`qk_clip` splits a head of the leaf at {path_str(leaf.path)} "
                f"(`rope_dim`, `key_dim`) on the axis after `head_axis`, and its "
                f"shape {tuple(leaf.x.shape)} has none."
            )
        axes.append(inner[inner.index(axes[-1]) + 1])
        size = leaf.size(axes[-1:])
        start = size - tail.size if tail.trailing else tail.size
        in_tail = jnp.arange(size) >= start
        per_head = jnp.where(in_tail, tail.scale[..., None], per_head[..., None])
    scale = leaf.broadcast(leaf.own(per_head, axes), axes)
    w = _engine.upcast(jnp.asarray(w), leaf.x.dtype)
    clipped = (w + _engine.upcast(leaf.x, leaf.x.dtype)) * scale - w
    return jnp.where(scale == 1, leaf.x, clipped.astype(leaf.x.dtype))


def read_logits(max_logits: Any, config: Config) -> _leaves.Leaves:
    """`max_logits` as records, an NNX intermediate's `sow` tuple its node.

    Raises:
      ValueError: if `max_logits` is None.
      TypeError: naming the entry, if it holds a non-float array.
    """
    if max_logits is None:
        raise ValueError(
            "`qk_clip` rescales heads by the step's largest attention logits: "
            "call `tx.update(updates, state, params, max_logits=...)`."
        )
    sown = jax.tree.map(_leaves.unwrap, max_logits, is_leaf=_leaves.is_wrapper)
    return _leaves.leaves(
        sown, "qk_clip", kind="logits", specs=config.logit_specs, argument="logit_specs"
    )


def clip_module(
    m: Module, s: jax.Array, out: dict, weights: dict, config: Config
) -> tuple[jax.Array, jax.Array]:
    """The module's projections rescaled in `out` (by path) by the largest
    logits `s`, their parameters `weights` (by path); its logged peaks and
    clipped heads, this device's block of them."""
    q_scale, k_scale, eta = head_scales(s, m.heads, config)
    rope = Tail(eta, config.rope_dim, True) if config.rope_dim else None
    fused = None  # a fused key-value head: its values, after `key_dim`, unscaled
    if config.key_dim is not None:
        fused = Tail(jnp.ones_like(k_scale), config.key_dim, False)
    for part, scale, tail in ((m.query, q_scale, rope), (m.key, k_scale, fused)):
        for leaf in part:
            out[leaf.path] = rescaled(leaf, weights[leaf.path], scale, config, tail)
    layers, first = m.query[0].layer_axes, m.query[0]
    clipped = jnp.sum(eta < 1, -1, dtype=jnp.int32)
    return first.own(s, layers), first.own(clipped, layers)


def zero_stats(found: list[Module]) -> tuple[dict, dict]:
    """Each module's largest logits and clipped heads before any step."""
    layers = {m.path: (m.query[0].layers, m.heads[0]) for m in found}
    peaks = {p: jnp.zeros((*n, h), jnp.float32) for p, (n, h) in layers.items()}
    return peaks, {p: jnp.zeros(n, jnp.int32) for p, (n, _) in layers.items()}


def state_of(
    tree: Any, found: list[Module], config: Config, peaks: dict, counts: dict
) -> QKClipState:
    """The state: `peaks` and `counts` (per module path) in `tree`'s
    containers, each module's stack where its query's starts."""
    is_leaf = lambda x: is_module(x, config) or _leaves.is_wrapper(x)  # noqa: E731
    at = jax.tree_util.tree_map_with_path
    return QKClipState(
        at(lambda p, _: peaks.get(p), tree, is_leaf=is_leaf),
        at(lambda p, _: counts.get(p), tree, is_leaf=is_leaf),
        _leaves.Leaves([m.query[0] for m in found], None).stacks,
    )


def qk_clip(
    threshold: ArrayLike = 100.0,
    *,
    alpha: ArrayLike = 0.5,
    query: str = "query",
    key: str = "key",
    head_axis: int = -2,
    rope_dim: int = 0,
    key_dim: int | None = None,
    stacked: Any = None,
    axis_name: str | Sequence[str] | None = None,
    specs: Any = None,
    logit_specs: Any = None,
    gqa: str = "head",
) -> optax.GradientTransformationExtraArgs:
    """Rescales the query and key weights of heads whose logit passed `threshold`.

    QK-Clip (Kimi K2's MuonClip), last in a chain: a head whose largest logit
    `S` is above `threshold` has its query weights scaled by `eta**alpha`, its
    key weights by `eta**(1 - alpha)`, `eta = threshold / S` (in GQA a group's
    hottest head; no weight grows). `max_logits=` mirrors `params` down to each
    module (a node holding a `query` and a `key`), heads last; the state's
    `clipped_heads` counts the query heads whose weights were scaled (every
    head of a group, with `gqa="group"`; docs/qk-clip.md).

    Args:
      threshold: the largest logit allowed (tau), a finite real > 0 or an array.
      alpha: the query's share of the scaling, in [0, 1].
      query: the name of the query projection's node in a module.
      key: the name of the key projection's node in a module.
      head_axis: the heads' axis of each projection leaf, within one layer.
      rope_dim: MLA: a query head's trailing entries, scaled by `eta` whole.
      key_dim: MLA: None, or a key head's leading entries, scaled (fused k/v).
      gqa: `"head"`, or `"group"`: each group by its hottest head (Megatron-LM).
      stacked: None, or a prefix of the params (docs/stacked-layers.md).
      axis_name: FSDP: the mesh axes splitting every leaf and the batch.
      specs: inside `shard_map`, the `in_specs` of the updates.
      logit_specs: inside `shard_map`, the `in_specs` of `max_logits`.

    Returns:
      A `GradientTransformationExtraArgs` whose state is a `QKClipState`.

    Raises:
      ValueError: if an argument, `params`, `max_logits` or a layout is wrong.
      TypeError: if a leaf, parameter or logit is not a float array.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import clipax
      >>> params = {"attn": {"query": jnp.ones((4, 2, 3)), "key": jnp.ones((4, 2, 3))}}
      >>> tx, zeros = clipax.qk_clip(100.0), jax.tree.map(jnp.zeros_like, params)
      >>> logits = {"attn": jnp.array([[400.0, 50.0]])}  # (batch, heads)
      >>> updates, state = tx.update(zeros, tx.init(params), params, max_logits=logits)
      >>> (params["attn"]["query"] + updates["attn"]["query"])[0, :, 0]
      Array([0.5, 1. ], dtype=float32)
      >>> state.max_logit["attn"], state.clipped_heads["attn"]
      (Array([400.,  50.], dtype=float32), Array(1, dtype=int32))

    References:
      Kimi Team, `Kimi K2 <https://arxiv.org/abs/2507.20534>`_, 2025.
    """
    checked = _leaves.reader(
        "qk_clip", stacked=stacked, specs=specs, axis_name=axis_name
    )
    config = Config(
        _checks.positive("threshold", threshold),
        _checks.number("alpha", alpha, "a real number in [0, 1]", low=0, high=1),
        query,
        key,
        _checks.integer("head_axis", head_axis, minimum=-64),
        _checks.integer("rope_dim", rope_dim, minimum=0),
        None if key_dim is None else _checks.integer("key_dim", key_dim),
        _checks.choice("gqa", gqa, ("head", "group")),
        logit_specs,
        _checks.axis_name(axis_name),
    )

    def init_fn(params: optax.Params) -> QKClipState:
        found = modules(params, checked(params), config)
        return state_of(params, found, config, *zero_stats(found))

    def update_fn(
        updates: optax.Updates,
        state: QKClipState,
        params: optax.Params | None = None,
        *,
        max_logits: Any = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, QKClipState]:
        del state, extra_args  # the state holds only what the last step saw
        leaves = checked(updates)
        paths = [leaf.path for leaf in leaves]
        params_of = _leaves.params_of(leaves, updates, params, "qk_clip")
        weights = dict(zip(paths, params_of, strict=True))
        records = read_logits(max_logits, config)
        out = dict(zip(paths, leaves.arrays, strict=True))
        found, peaks, counts = modules(params, leaves, config), {}, {}
        for m in found:
            s = module_logits(m, records, config)
            peaks[m.path], counts[m.path] = clip_module(m, s, out, weights, config)
        new_state = state_of(params, found, config, peaks, counts)
        return leaves.rebuild(list(out.values())), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _unsown(path: KeyPath) -> KeyPath:
    """A path without its last sequence index (an entry of a `sow`'s tuple)."""
    sown = bool(path) and isinstance(path[-1], jax.tree_util.SequenceKey)
    return path[:-1] if sown else path
