"""Norms of a pytree's groups of leaves (layers, modules), as a flat dict."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import chex
import jax
from jax.sharding import PartitionSpec

from clipax import _common, _placement
from clipax.tree import _global_norm

SEPARATOR = "/"


def _leaf_specs(tree: chex.ArrayTree, specs: Any) -> list[Any] | None:
    """`specs` (a prefix tree of PartitionSpecs) broadcast to one per leaf."""
    if specs is None:
        return None
    full = jax.tree.map(
        lambda spec, sub: jax.tree.map(lambda _: spec, sub),
        specs,
        tree,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
    return jax.tree.leaves(full, is_leaf=lambda x: isinstance(x, PartitionSpec))


def _check_args(depth: Any, prefixes: Any) -> None:
    if depth is not None and prefixes is not None:
        raise ValueError("Give `depth` or `prefixes`, not both.")
    if depth is not None:
        valid = isinstance(depth, numbers.Integral) and not isinstance(depth, bool)
        if not valid or depth < 1:
            raise ValueError(f"`depth` must be an int >= 1; got {depth!r}.")
    if prefixes is not None:
        accepted = "a sequence of non-empty '/'-separated key paths"
        if isinstance(prefixes, str) or not isinstance(prefixes, Sequence):
            raise ValueError(f"`prefixes` must be {accepted}; got {prefixes!r}.")
        if not all(isinstance(p, str) and p.strip(SEPARATOR) for p in prefixes):
            raise ValueError(f"`prefixes` must be {accepted}; got {prefixes!r}.")


def _check_prefix_match(
    path: _common.KeyPath,
    segments: list[str],
    wanted: list[tuple[str, ...]],
    match: list[tuple[str, ...]],
) -> None:
    """ValueError where the leaf's entries and its `/`-joined path disagree on
    the prefix it is under: a key holding `/`, which no grouping reads right."""
    joined = SEPARATOR.join(segments)
    by_text = [
        q
        for q in wanted
        if joined == SEPARATOR.join(q) or joined.startswith(SEPARATOR.join(q) + "/")
    ]
    if by_text[:1] != match[:1]:
        said = SEPARATOR.join(by_text[0]) if by_text else SEPARATOR.join(match[0])
        raise ValueError(
            f"The leaf at {_common.path_str(path)} has a key holding {SEPARATOR!r}, "
            f"so whether it is under the `prefixes` entry {said!r} is ambiguous: "
            f"its path {joined!r} reads one way, its key entries {segments} "
            f"another. Rename the key so that it holds no {SEPARATOR!r}."
        )


def group_norms(
    tree: chex.ArrayTree,
    *,
    depth: int | None = None,
    prefixes: Sequence[str] | None = None,
    key_prefix: str = "",
    ord: float = 2,
    axis_name: _placement.AxisName = None,
    specs: Any = None,
) -> dict[str, jax.Array]:
    """The norm of each group of leaves of `tree`, e.g. per layer or module.

    A leaf's path is its key path written with `/` (`{"dense": {"kernel": x}}`
    gives `dense/kernel`; list and tuple entries give their index, NNX and
    dataclass fields their name). Leaves are grouped

    - with `depth` (1 when neither is given): by the first `depth` entries of
      their path, so `depth=1` gives one norm per top-level module and
      `depth=2` per submodule (a leaf with a shorter path is its own group);
    - with `prefixes`: under the longest of the given paths that starts their
      path (whole entries: `layers/1` holds `layers/1/w`, not `layers/10/w`);
      leaves under none of them are left out.

    Each group's norm is `clipax.tree.global_norm` of its leaves (the exact
    engine, float32 accumulation, `specs` / `axis_name` inside `shard_map`),
    so the norms of all the groups combine to the global norm. The result is a
    flat dict from `"<group>/norm"` (with `key_prefix`, `"<key_prefix>/<group>/
    norm"`; a single-array tree is the group `root`) to a scalar, in the order
    of the leaves: jittable, and ready to merge with `clipax.metrics` for a
    logger, to find the layer where a spike starts.

    Args:
      tree: a pytree of float16, bfloat16, float32, float64 or complex arrays
        (gradients, updates, parameters); None and `optax.MaskedNode` leaves
        are empty.
      depth: group by the first `depth` path entries, an int >= 1.
      prefixes: group under these `/`-separated paths.
      key_prefix: put before every key, e.g. `"grads"`.
      ord: the norm's order: 2 (default), 1, `inf`, or any real p >= 1.
      axis_name: as for `clipax.tree.global_norm`: the mesh axes every leaf is
        split over.
      specs: as for `clipax.tree.global_norm`: the `shard_map` in_specs of
        `tree`, a prefix tree of PartitionSpecs.

    Returns:
      A dict from key to a float32 scalar (float64 for float64 leaves).

    Raises:
      ValueError: if `depth`, `prefixes`, `ord` or `axis_name` is not
        accepted, or both `depth` and `prefixes` are given; or if a dict key
        holding `/` makes two groups write as one key (`{"a/b": x}` beside
        `{"a": {"b": y}}` at `depth=2`) or leaves it ambiguous which prefix a
        leaf is under (the message names the leaves).
      TypeError: if a leaf is not a float16, bfloat16, float32, float64 or complex
        array.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> grads = {
      ...     "embed": {"table": jnp.array([3.0, 4.0])},
      ...     "layers": [{"w": jnp.array([1.0])}, {"w": jnp.array([0.0, 2.0])}],
      ... }
      >>> norms = clipax.tree.group_norms(grads)
      >>> norms["embed/norm"], norms["layers/norm"]
      (Array(5., dtype=float32), Array(2.236068, dtype=float32))
      >>> by_layer = clipax.tree.group_norms(grads, depth=2, key_prefix="grads")
      >>> list(by_layer)
      ['grads/embed/table/norm', 'grads/layers/0/norm', 'grads/layers/1/norm']
      >>> clipax.tree.group_norms(grads, prefixes=["layers/0"])
      {'layers/0/norm': Array(1., dtype=float32)}
    """
    _check_args(depth, prefixes)
    p = _common.check_ord(ord)
    _placement.normalize_axis_name(axis_name)
    flat = _common.check_norm_leaves(tree, "group_norms")
    leaf_specs = _leaf_specs(tree, specs)
    wanted = None
    if prefixes is not None:
        wanted = sorted(
            (tuple(q.strip(SEPARATOR).split(SEPARATOR)) for q in prefixes),
            key=len,
            reverse=True,
        )
    groups: dict[str, list[int]] = {}
    entries: dict[str, tuple[str, ...]] = {}  # each group's name -> its entries
    for i, (path, _) in enumerate(flat):
        segments = _common.path_segments(path)
        if wanted is None:
            group = tuple(segments[: depth or 1])
        else:
            match = [q for q in wanted if tuple(segments[: len(q)]) == q]
            _check_prefix_match(path, segments, wanted, match)
            if not match:
                continue
            group = match[0]
        name = SEPARATOR.join(group) or "root"
        if entries.setdefault(name, group) != group:
            first = flat[groups[name][0]][0]
            raise ValueError(
                f"`group_norms` got the leaves at {_common.path_str(first)} and "
                f"{_common.path_str(path)}, whose groups at `depth`={depth or 1} both "
                f"write as {name!r}: a dict key holding {SEPARATOR!r} reads as two "
                f"path entries, and one norm would hide the other. Rename the key "
                f"so that it holds no {SEPARATOR!r}."
            )
        groups.setdefault(name, []).append(i)
    out = {}
    head = f"{key_prefix}{SEPARATOR}" if key_prefix else ""
    for name, members in groups.items():
        leaves = [flat[i][1] for i in members]
        group_specs = None if leaf_specs is None else [leaf_specs[i] for i in members]
        out[f"{head}{name}{SEPARATOR}norm"] = _global_norm.global_norm(
            leaves, ord=p, axis_name=axis_name, specs=group_specs
        )
    return out
