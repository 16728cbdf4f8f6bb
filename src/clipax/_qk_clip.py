"""QK-Clip (Kimi K2's MuonClip): attention heads' query and key weights rescaled
after the optimizer step, so that each head's largest logit is at most the
threshold."""

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


class _Module(NamedTuple):
    path: KeyPath
    parts: tuple[list[Leaf], list[Leaf]]  # its query leaves and its key leaves
    layers: tuple[int, ...]
    heads: tuple[int, int]  # query heads, key heads


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
    threshold = _checks.positive("threshold", threshold)
    alpha = _checks.number("alpha", alpha, "a real number in [0, 1]", low=0, high=1)
    head_axis = _checks.integer("head_axis", head_axis, minimum=-64)
    rope_dim = _checks.integer("rope_dim", rope_dim, minimum=0)
    if key_dim is not None:
        key_dim = _checks.integer("key_dim", key_dim)
    gqa = _checks.choice("gqa", gqa, ("head", "group"))
    checked = _leaves.reader(
        "qk_clip", stacked=stacked, specs=specs, axis_name=axis_name
    )
    names = _checks.axis_name(axis_name)

    def is_module(node: Any) -> bool:
        if hasattr(node, "dtype") or _leaves.is_wrapper(node):
            return False
        children = _states.children(node)[0]
        return {query, key} <= {_states.key_name(k) for k, _ in children}

    def axes_of(leaf: Leaf) -> list[int]:
        """A projection leaf's layer axes, then its heads' axis."""
        return [*leaf.layer_axes, *leaf.within((head_axis,), "head_axis")]

    def role(path: KeyPath, name: str, leaves: _leaves.Leaves) -> list[Leaf]:
        """The leaves under the module at `path`'s child `name`."""
        n = len(path)
        return [
            x
            for x in leaves
            if len(x.path) > n
            and x.path[:n] == path
            and _states.key_name(x.path[n]) == name
        ]

    def modules(tree: Any, leaves: _leaves.Leaves) -> list[_Module]:
        """Every attention module of `tree`, with its leaves in `leaves`, its
        layers and heads those of the whole tensors.

        Raises:
          ValueError: if `tree` holds no module, or a module's projections
            differ in layers or heads (naming it).
        """
        flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_module)[0]
        found = []
        for path in [p for p, x in flat if is_module(x)]:
            parts = (role(path, query, leaves), role(path, key, leaves))
            shapes = [
                {tuple(x.size([a]) for a in axes_of(x)) for x in p} for p in parts
            ]
            if all(len(s) == 1 for s in shapes):
                (*layers, nq), (*k_layers, nk) = (s.pop() for s in map(set, shapes))
                if layers == k_layers and nq % nk == 0:
                    found.append(_Module(path, parts, tuple(layers), (nq, nk)))
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
                f"{query!r} and a {key!r} child (name them with `query=`, `key=`)."
            )
        return found

    def logits_of(m: _Module, records: _leaves.Leaves) -> jax.Array:
        """The module's largest logit per layer and head, whole on every
        device: the logits found below its path (a linen `sow`'s tuple: their
        max), reduced over every axis but the leading layers and the last
        (the batch, over the mesh axes that split it), the rest gathered.

        Raises:
          ValueError: naming the module, if no array or several are found
            below its path, or their shape does not fit its layers and heads.
        """
        mine = _leaves.path_keys(m.path)
        below = [r for r in records if _leaves.path_keys(r.path)[: len(mine)] == mine]
        homes = {"/".join(_leaves.path_keys(_unsown(r.path))) for r in below}
        if len(homes) != 1:
            found = homes or {
                "/".join(_leaves.path_keys(_unsown(r.path))) for r in records
            }
            raise ValueError(
                f"`max_logits` holds {'several arrays' if homes else 'no array'} for "
                f"the attention module at {path_str(m.path)}, where it must mirror "
                f"`params` (docs/qk-clip.md); its entries are at {sorted(found)[:4]}."
            )
        x = jnp.stack([jnp.asarray(r.x, jnp.float32) for r in below]).max(0)
        n, first = len(m.layers), below[0]
        leads = {leaf.x.shape[0] for part in m.parts for leaf in part if leaf.x.ndim}
        if not n and x.ndim > 2 and leads == {x.shape[0]}:
            raise ValueError(
                f"`qk_clip` reads the attention module at {path_str(m.path)} as one "
                f"layer, but its projections and `max_logits` (shape {x.shape}) share "
                f"a leading axis of {x.shape[0]}: a scanned module, whose layers the "
                "max over the batch would merge. Pass `stacked=` (e.g. "
                "`clipax.stacked_prefix(params, ...)`); if that axis is no layer "
                "axis, fold it into the batch axis of `max_logits`."
            )
        dims = first.dims if logit_specs is not None and first.dims else ()
        s = x
        if x.ndim > n:
            batch = tuple(range(n, x.ndim - 1))
            # The batch may be split across devices: the max over its mesh axes.
            split = names if names and logit_specs is None else first.split(batch)
            s = _engine.pmax_all(jnp.max(x, axis=batch), [split])
            for i, d in enumerate([*range(n), x.ndim - 1] if dims else ()):
                s = _engine.gathered(s, i, dims[d]) if dims[d] else s
        if s.shape != (*m.layers, m.heads[0]):
            q = m.parts[0][0]
            raise ValueError(
                f"`max_logits` for the attention module at {path_str(m.path)} has "
                f"shape {x.shape}; it needs the module's layers {m.layers} first "
                f"and its {m.heads[0]} query heads last: the heads read on axis "
                f"{axes_of(q)[-1]} (`head_axis`={head_axis}) of the query leaf at "
                f"{path_str(q.path)}, shape {tuple(q.x.shape)}."
            )
        return _leaves.replicated(s)

    def mine(leaf: Leaf, whole: jax.Array, axes: list[int]) -> jax.Array:
        """`whole`, whose dims are the leaf's `axes` whole, cut to the leaf's
        block inside `shard_map`."""
        for i, d in enumerate(axes):
            split = leaf.dims[d] if leaf.dims else ()
            whole = _engine.block(whole, i, split, leaf.x.shape[d])
        return whole

    def state_of(tree: Any, found: list[_Module], *stats: dict) -> QKClipState:
        """The state: `stats` (per module path) in `tree`'s containers, each
        module's stack where its query's starts."""
        peaks, counts = (
            jax.tree_util.tree_map_with_path(
                lambda p, _, v=v: v.get(p),
                tree,
                is_leaf=lambda x: is_module(x) or _leaves.is_wrapper(x),
            )
            for v in stats
        )
        stacks = _leaves.Leaves([m.parts[0][0] for m in found], None).stacks
        return QKClipState(peaks, counts, stacks)

    def init_fn(params: optax.Params) -> QKClipState:
        found = modules(params, checked(params))
        layers = {m.path: (m.parts[0][0].layers, m.heads[0]) for m in found}
        return state_of(
            params,
            found,
            {p: jnp.zeros((*n, h), jnp.float32) for p, (n, h) in layers.items()},
            {p: jnp.zeros(n, jnp.int32) for p, (n, _) in layers.items()},
        )

    def rescaled(leaf: Leaf, w: Any, base: jax.Array, rest: Any, cut: Any) -> Any:
        """`leaf`'s update such that the parameter `w` plus it is `w` plus the
        incoming update, scaled by `base` per head (by `rest` in a head's
        entries from `cut` on, on the axis after the heads, where given);
        where the scale is 1, the incoming update itself."""
        axes = axes_of(leaf)
        if cut is not None:
            inner = leaf.inner
            if inner.index(axes[-1]) + 1 == len(inner):
                raise ValueError(
                    f"`qk_clip` splits a head of the leaf at {path_str(leaf.path)} "
                    f"(`rope_dim`, `key_dim`) on the axis after `head_axis`, and its "
                    f"shape {tuple(leaf.x.shape)} has none."
                )
            axes.append(inner[inner.index(axes[-1]) + 1])
            size = leaf.size(axes[-1:])
            inside = jnp.arange(size) < (cut if cut >= 0 else size + cut)
            base = jnp.where(inside, base[..., None], rest[..., None])
        scale = leaf.broadcast(mine(leaf, base, axes), axes)
        acc = _leaves.accum_dtype(leaf.x.dtype)
        w = jnp.asarray(w).astype(acc)
        clipped = (w + leaf.x.astype(acc)) * scale - w
        return jnp.where(scale == 1, leaf.x, clipped.astype(leaf.x.dtype))

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
        weights = _leaves.params_of(leaves, updates, params, "qk_clip")
        if max_logits is None:
            raise ValueError(
                "`qk_clip` rescales heads by the step's largest attention logits: "
                "call `tx.update(updates, state, params, max_logits=...)`."
            )
        # An NNX intermediate holds a `sow`'s tuple: the tuple is the node.
        sown = jax.tree.map(_leaves.unwrap, max_logits, is_leaf=_leaves.is_wrapper)
        records = _leaves.leaves(
            sown, "qk_clip", kind="logits", specs=logit_specs, said="logit_specs"
        )
        index = {leaf.path: i for i, leaf in enumerate(leaves)}
        out, tau = list(leaves.arrays), jnp.asarray(threshold, jnp.float32)
        found, peaks, counts = modules(params, leaves), {}, {}
        for m in found:
            (nq, nk), s = m.heads, logits_of(m, records)
            over = jnp.isfinite(s) & (s > tau)
            eta = jnp.where(over, tau / jnp.where(over, s, 1), 1)
            hottest = jnp.min(eta.reshape(*m.layers, nk, nq // nk), axis=-1)
            if gqa == "group":  # Megatron-LM: a group's heads all by its hottest
                eta = jnp.repeat(hottest, nq // nk, axis=-1)
            k_scale = hottest ** (1 - alpha)
            # Each query head shrinks as little as it can without growing.
            q_scale = jnp.minimum(eta / jnp.repeat(k_scale, nq // nk, axis=-1), 1)
            for part, base, rest, cut in (
                (m.parts[0], q_scale, eta, -rope_dim if rope_dim else None),
                (m.parts[1], k_scale, jnp.ones_like(k_scale), key_dim),
            ):
                for leaf in part:
                    i = index[leaf.path]
                    out[i] = rescaled(leaf, weights[i], base, rest, cut)
            first = m.parts[0][0]
            layers = list(first.layer_axes)
            peaks[m.path] = mine(first, s, layers)
            counts[m.path] = mine(first, jnp.sum(eta < 1, -1, dtype=jnp.int32), layers)
        return leaves.rebuild(out), state_of(params, found, peaks, counts)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _unsown(path: KeyPath) -> KeyPath:
    """A path without its last sequence index (an entry of a `sow`'s tuple)."""
    sown = bool(path) and isinstance(path[-1], jax.tree_util.SequenceKey)
    return path[:-1] if sown else path
