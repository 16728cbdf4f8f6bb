"""QK-Clip (Kimi K2's MuonClip): attention heads' query and key weights rescaled
after the optimizer step, so that each head's largest logit is at most the
threshold."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from clipax import _checks, _engine, _leaves, _states
from clipax._leaves import KeyPath, Leaf, path_str


@_states.declare(
    "qk_clip", per_tensor={"max_logit": "max_logit", "clipped_heads": "clipped_heads"}
)
class QKClipState(NamedTuple):
    """State of `qk_clip`: what the last update saw, per attention module."""

    max_logit: chex.ArrayTree  # the params' containers, holding at each
    # attention module a float32 scalar (a vector, one per layer, for a
    # stacked module): its largest attention logit; None elsewhere
    clipped_heads: chex.ArrayTree  # likewise, int32: its heads clipped
    stacks: _leaves.Stacks = _leaves.Stacks()  # static: where each stack starts


class _Module(NamedTuple):
    path: KeyPath
    parts: tuple[list[Leaf], list[Leaf]]  # its query leaves and its key leaves
    layers: tuple[int, ...]
    heads: tuple[int, int]  # query heads, key heads


def _logits_at(tree: Any, path: KeyPath) -> jax.Array:
    """The logits `tree` holds for the module at `path`, found by its keys:
    an array, a linen `sow`'s tuple (their max) or an NNX intermediate, as
    the module's entry or under its `"max_logits"`.

    Raises:
      ValueError: naming the path, where `tree` holds no array there.
    """
    is_entry = lambda x: isinstance(x, tuple) or _leaves.is_wrapper(x)  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_entry)[0]
    table = {tuple(_leaves.path_keys(p)): _leaves.unwrap(x) for p, x in flat}
    keys = tuple(_leaves.path_keys(path))
    node = table.get((*keys, "max_logits"), table.get(keys))
    if isinstance(node, tuple) and node:
        node = jnp.max(jnp.stack(node), axis=0)
    if not hasattr(node, "shape"):
        raise ValueError(
            f"`max_logits` holds no array for the attention module at "
            f"{path_str(path)}, where it must mirror `params` (docs/qk-clip.md); "
            f"its entries are at {['/'.join(k) for k in list(table)[:4]]}."
        )
    return jnp.asarray(node)


def _placed(values: jax.Array, leaf: Leaf, axes: list[int]) -> jax.Array:
    """`values`, whose dims are the leaf's `axes` in that order, shaped to
    broadcast against the leaf."""
    shape = [1] * leaf.x.ndim
    for a in axes:
        shape[a] = leaf.x.shape[a]
    return jnp.transpose(values, np.argsort(axes).tolist()).reshape(shape)


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
) -> optax.GradientTransformationExtraArgs:
    """Rescales the query and key weights of every attention head whose largest
    logit exceeded `threshold`, so that it is at most `threshold`.

    QK-Clip (Kimi K2's MuonClip), last in a chain: a head whose largest logit
    `S` is above `threshold` has its query weights scaled by `eta**alpha`,
    its key weights by `eta**(1 - alpha)`, `eta = threshold / S`. A module
    is a node of `params` holding a `query` and a `key`; `update(...,
    max_logits=)` mirrors `params` down to each, holding its logits, heads
    last. GQA/MQA: a key head takes its group's smallest share, each query
    head the rest; MLA: `rope_dim`, `key_dim` (docs/qk-clip.md).

    Args:
      threshold: the largest logit allowed (tau), a finite real > 0 or an array.
      alpha: the query's share of the scaling, in [0, 1].
      query: the name of the query projection's node in a module.
      key: the name of the key projection's node in a module.
      head_axis: the heads' axis of each projection leaf, within one layer.
      rope_dim: a query head's trailing entries taking `eta` whole (MLA).
      key_dim: None, or a key head's leading entries scaled (fused k/v).
      stacked: None, or a prefix of the params (docs/stacked-layers.md).
      axis_name: the mesh axes every leaf is split over (docs/scaling-out.md).
      specs: inside `shard_map`, the `in_specs` of the updates.

    Returns:
      A `GradientTransformationExtraArgs`; its state is a `QKClipState`.

    Raises:
      ValueError: if an argument is not accepted, `params` holds no module,
        or `params` or `max_logits` is missing or does not fit a module.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> params = {"attn": {"query": jnp.ones((4, 2, 3)), "key": jnp.ones((4, 2, 3))}}
      >>> tx = clipax.qk_clip(100.0)
      >>> zeros = {"attn": {"query": jnp.zeros((4, 2, 3)), "key": jnp.zeros((4, 2, 3))}}
      >>> logits = {"attn": jnp.array([[400.0, 50.0]])}  # (batch, heads)
      >>> updates, state = tx.update(zeros, tx.init(params), params, max_logits=logits)
      >>> (params["attn"]["query"] + updates["attn"]["query"])[0, :, 0]
      Array([0.5, 1. ], dtype=float32)
      >>> state.max_logit["attn"], state.clipped_heads["attn"]
      (Array(400., dtype=float32), Array(1, dtype=int32))

    References:
      Kimi Team, `Kimi K2 <https://arxiv.org/abs/2507.20534>`_, 2025.
    """
    threshold = _checks.positive("threshold", threshold)
    alpha = _checks.number("alpha", alpha, "a real number in [0, 1]", low=0, high=1)
    head_axis = _checks.integer("head_axis", head_axis, minimum=-64)
    rope_dim = _checks.integer("rope_dim", rope_dim, minimum=0)
    if key_dim is not None:
        key_dim = _checks.integer("key_dim", key_dim)
    checked = _leaves.reader(
        "qk_clip", stacked=stacked, specs=specs, axis_name=axis_name
    )

    def is_module(node: Any) -> bool:
        if hasattr(node, "dtype") or _leaves.is_wrapper(node):
            return False
        children = _states.children(node)[0]
        return {query, key} <= {_states.key_name(k) for k, _ in children}

    def head_of(leaf: Leaf) -> int:
        return int(leaf.within((head_axis,), "head_axis")[0])

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
        """Every attention module of `tree`, with its leaves in `leaves`.

        Raises:
          ValueError: if `tree` holds no module, or a module's projections
            differ in layers or heads (naming it).
        """
        flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_module)[0]
        found = []
        for path in [p for p, x in flat if is_module(x)]:
            parts = (role(path, query, leaves), role(path, key, leaves))
            shapes = [{(x.layers, x.x.shape[head_of(x)]) for x in p} for p in parts]
            if all(len(s) == 1 for s in shapes):
                (layers, nq), (k_layers, nk) = (s.pop() for s in map(set, shapes))
                if layers == k_layers and nq % nk == 0:
                    found.append(_Module(path, parts, layers, (nq, nk)))
                    continue
            raise ValueError(
                f"`qk_clip` needs, in the attention module at {path_str(path)}, "
                "query and key leaves of one layer count, whose key heads divide "
                f"the query heads (GQA); got (layers, heads) {sorted(shapes[0])} "
                f"and {sorted(shapes[1])}."
            )
        if not found:
            raise ValueError(
                f"`qk_clip` found no attention module in `params`: no node holds a "
                f"{query!r} and a {key!r} child (name them with `query=`, `key=`)."
            )
        return found

    def state_of(tree: Any, found: list[_Module], *stats: dict) -> QKClipState:
        """The state: `stats` (per module path) in `tree`'s containers."""
        roots = [m.parts[0][0].root for m in found]
        depths = tuple(None if r is None else len(r) for r in roots)
        peaks, counts = (
            jax.tree_util.tree_map_with_path(
                lambda p, _, v=v: v.get(p),
                tree,
                is_leaf=lambda x: is_module(x) or _leaves.is_wrapper(x),
            )
            for v in stats
        )
        stacks = _leaves.Stacks(depths if any(r is not None for r in roots) else ())
        return QKClipState(peaks, counts, stacks)

    def init_fn(params: optax.Params) -> QKClipState:
        found = modules(params, checked(params))
        return state_of(
            params,
            found,
            {m.path: jnp.zeros(m.layers, jnp.float32) for m in found},
            {m.path: jnp.zeros(m.layers, jnp.int32) for m in found},
        )

    def rescaled(leaf: Leaf, w: Any, base: jax.Array, rest: Any, cut: Any) -> Any:
        """`leaf`'s update such that the parameter `w` plus it is `w` plus the
        incoming update, scaled by `base` per head (by `rest` in a head's
        entries from `cut` on, on the axis after the heads, where given);
        where the scale is 1, the incoming update itself."""
        inner, head = leaf.inner, head_of(leaf)
        axes = [*leaf.layer_axes, head]
        if cut is not None:
            if inner.index(head) + 1 == len(inner):
                raise ValueError(
                    f"`qk_clip` splits a head of the leaf at {path_str(leaf.path)} "
                    f"(`rope_dim`, `key_dim`) on the axis after `head_axis`, and its "
                    f"shape {tuple(leaf.x.shape)} has none."
                )
            axes.append(inner[inner.index(head) + 1])
            size = leaf.x.shape[axes[-1]]
            inside = jnp.arange(size) < (cut if cut >= 0 else size + cut)
            base = jnp.where(inside, base[..., None], rest[..., None])
        scale = _placed(base, leaf, axes)
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
        index = {leaf.path: i for i, leaf in enumerate(leaves)}
        out, tau = list(leaves.arrays), jnp.asarray(threshold, jnp.float32)
        found, peaks, counts = modules(params, leaves), {}, {}
        for m in found:
            (nq, nk), n = m.heads, len(m.layers)
            logits = _logits_at(max_logits, m.path)
            if logits.shape[:n] != m.layers or logits.shape[n:][-1:] != (nq,):
                raise ValueError(
                    f"`max_logits` for the attention module at {path_str(m.path)} "
                    f"has shape {logits.shape}; it needs the module's layers "
                    f"{m.layers} first and its {nq} query heads last."
                )
            s = jnp.max(logits.astype(jnp.float32), tuple(range(n, logits.ndim - 1)))
            first = m.parts[0][0]
            heads = first.split([head_of(first)])
            # The batch may be split across devices: the max over the rest.
            spread = set(_engine.varying(s)) - set(first.split([*first.layer_axes]))
            s = _engine.pmax_all(s, [tuple(spread - set(heads))])
            over = jnp.isfinite(s) & (s > tau)
            eta = jnp.where(over, tau / jnp.where(over, s, 1), 1)
            k_scale = jnp.min(eta.reshape(*m.layers, nk, nq // nk), axis=-1)
            k_scale = k_scale ** (1 - alpha)
            q_scale = eta / jnp.repeat(k_scale, nq // nk, axis=-1)
            for part, base, rest, cut in (
                (m.parts[0], q_scale, eta, -rope_dim if rope_dim else None),
                (m.parts[1], k_scale, jnp.ones_like(k_scale), key_dim),
            ):
                for leaf in part:
                    i = index[leaf.path]
                    out[i] = rescaled(leaf, weights[i], base, rest, cut)
            peaks[m.path] = _engine.pmax_all(jnp.max(s, axis=-1), [heads])
            clipped = jnp.sum(over, axis=-1, dtype=jnp.int32)
            counts[m.path] = _engine.complete([clipped], [heads])[0]
        return leaves.rebuild(out), state_of(params, found, peaks, counts)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
