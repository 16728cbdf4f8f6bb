"""The adaptive family: one shape for every rule that learns its threshold.

A rule is a pure function of the statistics it keeps and the norm it sees:

    rule(stats, norm, count) -> (threshold, new_stats)    # global rules
    rule(stats, norm, shared) -> (threshold, new_stats)   # per-tensor rules

- `stats`: the rule's own statistics, a dict of arrays (AutoClip's ring buffer,
  ZClip's mean and variance, AdaGC's EMA); for a per-tensor rule, one leaf's;
- `norm`: the pre-clip norm of this step: the global norm for a global rule,
  one leaf's norm for a per-tensor rule (which is called once per leaf);
- `count`: an int32 scalar, how many steps the statistics have seen (warm-ups
  read it);
- `shared`: for a per-tensor rule, what every leaf's step reads, computed once
  per step by the rule's `shared(count, total)` (`total` being the global norm
  of all the leaves; by default `{"count": count, "total": total}`);
- `threshold`: the shape of `norm`, the norm it is clipped to: `inf` lets it
  pass, NaN makes it all NaN.

Each rule is tested on its own against its paper's formula. `transformation`
makes an Optax transformation of a rule and does the parts every rule shares,
once: the norms through the engine (`clipax._engine`, with `specs` /
`axis_name` for sharded leaves), the state's `count`, `norm` and threshold
fields, the NaN rule (a leaf, or an update, whose norm is NaN or inf keeps its
statistics and comes out NaN; the count advances only on a step whose norms
are all finite), and the clipping itself, TensorFlow's formula
`x * t / max(norm, t)`.

To add a rule: write its `NamedTuple` state (its statistics, then `count`,
`norm` and `threshold`, or `norms` and `thresholds` per leaf), registered with
`_states.register` (its factory's name and its per-leaf fields), its initial
statistics, and its rule; the factory checks the arguments and returns
`transformation(...)`. `zclip` in `_zclip.py` is the model to copy.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from clipax import _common, _engine, _placement

Stats = dict[str, jax.Array]
Rule = Callable[..., tuple[jax.Array, Stats]]
InitStats = Callable[[np.dtype], Stats]


# Arguments shared by the rules.

INT32_MAX = 2**31 - 1  # counts are compared with the state's int32 counters


def check_count(
    name: str, value: Any, minimum: int = 1, *, traced_ok: bool = False
) -> Any:
    """A concrete int >= `minimum` and <= 2**31 - 1 (a Python or NumPy int),
    returned as an int.

    The bound above is the int32 step counters': a larger count would fail as
    an OverflowError at the first update, where it meets them.

    A traced value is returned unchecked when `traced_ok` (a count that is only
    compared with, as under `optax.inject_hyperparams`).

    Raises:
      TypeError: if `value` is traced and not `traced_ok` (it sets a shape or a
        schedule).
      ValueError: if `value` is not an int >= `minimum`, or is above 2**31 - 1.
    """
    if _common.is_traced(value):
        if traced_ok:
            return value
        raise TypeError(f"`{name}` got a traced value; {_common.STATIC_HINT}.")
    integer_array = (  # a concrete one, e.g. from optax.inject_hyperparams
        isinstance(value, (jax.Array, np.ndarray))
        and value.ndim == 0
        and jnp.issubdtype(value.dtype, jnp.integer)
    )
    if integer_array:
        value = int(value)
    valid = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not valid or value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}; got {value!r}.")
    if value > INT32_MAX:
        raise ValueError(
            f"`{name}` must be an int <= {INT32_MAX} (2**31 - 1, the limit of the "
            f"int32 step counters); got {value!r}."
        )
    return int(value)


def check_open_unit(name: str, value: Any) -> None:
    """A real number strictly between 0 and 1, unless traced."""
    accepted = "a real number strictly between 0 and 1"
    _common.check_scalar(
        name, value, accepted, low=0, high=1, low_open=True, high_open=True
    )


def check_positive(name: str, value: Any, *, inf_ok: bool = False) -> None:
    """A real number > 0, finite unless `inf_ok`; not checked when traced."""
    accepted = "a real number > 0 or inf" if inf_ok else "a finite real number > 0"
    _common.check_scalar(
        name, value, accepted, low=0, low_open=True, high_open=not inf_ok
    )


# The transformation every rule shares.


def transformation(
    fn_name: str,
    state_cls: Any,
    init_stats: InitStats,
    rule: Rule,
    *,
    per_leaf: bool = False,
    shared: Callable[[jax.Array, jax.Array], Any] | None = None,
    ord: float = 2.0,
    axis_name: _placement.AxisName = None,
    specs: Any = None,
) -> optax.GradientTransformation:
    """An Optax transformation that clips the updates by `rule`.

    Args:
      fn_name: the public name, for error messages.
      state_cls: the state NamedTuple. A global rule's has the fields of
        `init_stats`, `count`, `norm` and `threshold`; a per-leaf rule's has
        the fields of `init_stats` (each a tree with a scalar per leaf),
        `count`, `norm` (the global norm), `norms` and `thresholds` (trees).
      init_stats: the statistics before the first step, given the dtype they
        are kept in: the arrays of a global rule, or one leaf's scalars for a
        per-leaf rule (every leaf starts from them).
      rule: `rule(stats, norm, count) -> (threshold, new_stats)`; for a
        per-leaf rule `rule(stats, norm, shared)`, called for each leaf with
        its own statistics and norm.
      per_leaf: whether each leaf is clipped by its own norm (else all leaves
        by their global norm).
      shared: for a per-leaf rule, `shared(count, total)`: the values every
        leaf's step reads, computed once per step (every operation in the
        per-leaf step is repeated for each leaf, and costs compile time).
      ord: the global norm's order (global rules only).
      axis_name: inside `pmap` or `shard_map`, the mesh axes every leaf is
        split over (see `clipax.tree.global_norm`).
      specs: inside `shard_map`, the `in_specs` of the updates.
    """
    _placement.normalize_axis_name(axis_name)

    def init_fn(params: optax.Params) -> Any:
        flat = _common.check_norm_leaves(params, fn_name)
        dtype = _common.tree_accum_dtype([leaf for _, leaf in flat])
        count = jnp.zeros((), jnp.int32)
        norm = jnp.zeros((), dtype)
        stats = init_stats(dtype)
        if not per_leaf:
            threshold = jnp.full((), jnp.inf, dtype)
            return state_cls(**stats, count=count, norm=norm, threshold=threshold)

        def per_leaf_tree(value: Any) -> Any:
            return jax.tree.map(lambda _: jnp.asarray(value, dtype), params)

        return state_cls(
            **{name: per_leaf_tree(value) for name, value in stats.items()},
            count=count,
            norm=norm,
            norms=per_leaf_tree(0),
            thresholds=per_leaf_tree(jnp.inf),
        )

    def update_fn(
        updates: optax.Updates, state: Any, params: optax.Params | None = None
    ) -> tuple[optax.Updates, Any]:
        del params
        dtype = state.norm.dtype
        flat = _common.check_norm_leaves(updates, fn_name)
        leaves = [leaf for _, leaf in flat]
        placements = _placement.leaf_placements(flat, specs, axis_name)
        names = [name for name in state_cls._fields if name not in _SHARED_FIELDS]
        if per_leaf:
            return _per_leaf_update(updates, leaves, placements, state, names)
        norm = _engine.global_norm(leaves, ord, placements).astype(dtype)
        stats = {name: getattr(state, name) for name in names}
        kept, threshold, scale = _step(stats, norm, state.threshold, state.count)
        count = jnp.where(
            jnp.isfinite(norm), optax.safe_int32_increment(state.count), state.count
        )
        clipped = jax.tree.map(lambda x: _common.apply_scale(x, scale), updates)
        return clipped, state_cls(**kept, count=count, norm=norm, threshold=threshold)

    def _step(
        stats: Stats,
        norm: jax.Array,
        old_threshold: jax.Array,
        context: Any,
    ) -> tuple[Stats, jax.Array, jax.Array]:
        """The rule, with the NaN rule (a non-finite norm leaves its
        statistics and threshold alone), and the clip factor."""
        threshold, new_stats = rule(stats, norm, context)
        threshold = threshold.astype(norm.dtype)
        finite = jnp.isfinite(norm)
        kept = {
            name: jnp.where(finite, new_stats[name], value).astype(value.dtype)
            for name, value in stats.items()
        }
        kept_threshold = jnp.where(finite, threshold, old_threshold)
        return (
            kept,
            kept_threshold.astype(norm.dtype),
            _common.clip_scale(norm, threshold),
        )

    def _per_leaf_update(
        updates: optax.Updates,
        leaves: list[jax.Array],
        placements: _placement.Placements | None,
        state: Any,
        names: list[str],
    ) -> tuple[optax.Updates, Any]:
        """Each leaf clipped by the rule on its own norm, one leaf at a time:
        one jitted step, traced once per dtype, for every leaf."""
        dtype = state.norm.dtype
        whole = [tuple(range(x.ndim)) for x in leaves]
        norms = [
            n.astype(dtype) for n in _engine.tensor_norms(leaves, whole, placements)
        ]
        stacked = jnp.stack(norms) if norms else jnp.zeros((0,), dtype)
        total = _engine.norm_of_norms(stacked)
        context = (shared or _count_and_total)(state.count, total)
        step = jax.jit(_step)
        stats = (
            [
                dict(zip(names, v, strict=True))
                for v in zip(
                    *(jax.tree.leaves(getattr(state, name)) for name in names),
                    strict=True,
                )
            ]
            if names
            else [{} for _ in leaves]
        )
        thresholds = jax.tree.leaves(state.thresholds)
        results = [
            step(s, n, t, context)
            for s, n, t in zip(stats, norms, thresholds, strict=True)
        ]
        count = jnp.where(
            jnp.all(jnp.isfinite(stacked)),
            optax.safe_int32_increment(state.count),
            state.count,
        )
        treedef = jax.tree.structure(updates)

        def as_tree(values: list[jax.Array]) -> Any:
            return jax.tree.unflatten(treedef, values)

        scaled = [
            _common.apply_scale(x, scale)
            for x, (_, _, scale) in zip(leaves, results, strict=True)
        ]
        new_state = state_cls(
            **{name: as_tree([kept[name] for kept, _, _ in results]) for name in names},
            count=count,
            norm=total,
            norms=as_tree(norms),
            thresholds=as_tree([threshold for _, threshold, _ in results]),
        )
        return as_tree(scaled), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def _count_and_total(count: jax.Array, total: jax.Array) -> dict[str, jax.Array]:
    return {"count": count, "total": total}


_SHARED_FIELDS = ("count", "norm", "threshold", "norms", "thresholds")


def stateless(
    fn_name: str,
    clip: Callable[[optax.Updates, optax.Params | None], optax.Updates],
    check_leaf: Callable[[_common.KeyPath, Any], None] | None = None,
) -> optax.GradientTransformation:
    """A transformation with `optax.EmptyState` whose update is `clip`.

    For the rules with no statistics (AGC, block RMS): their threshold is a
    function of each leaf (or slice) alone. `init` checks that every leaf of the params
    can have a norm, and `check_leaf(path, leaf)` if given.
    """

    def init_fn(params: optax.Params) -> optax.EmptyState:
        for path, leaf in _common.check_norm_leaves(params, fn_name):
            if check_leaf is not None:
                check_leaf(path, leaf)
        return optax.EmptyState()

    return optax.GradientTransformation(init_fn, optax.stateless(clip).update)
