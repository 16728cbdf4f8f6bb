"""The adaptive rules' transformations: a rule that learns its threshold.

A rule is a pure function of its state and this step's norms:

    GlobalRule: rule(state, norm) -> (threshold, state)             AutoClip, ZClip
    TensorRule: rule(state, norms, total) -> (thresholds, state)    AdaGC

`state` is the rule's declared NamedTuple (`_states.declare`): its statistics
and the fields every rule keeps, `count` (steps whose norms were all finite)
and `norm` (the last global norm), with `threshold` for a global rule, or
`norms` and `thresholds` (trees, one value per tensor) for a tensor rule. The
rule returns the state with its statistics updated (`state._replace`). A
tensor rule sees its per-tensor fields as vectors, one entry per tensor, with
`norms` this step's and `total` their global norm: a few vector operations
whatever the number of tensors.

The transformations do the rest once: the norms (`_engine`, with `specs` /
`axis_name` for sharded leaves), `count`, `norm` and the thresholds, the NaN
rule (a norm that is NaN or inf keeps its statistics and threshold, its
updates come out NaN, and the step is not counted), and the clip, TensorFlow's
`x * t / max(norm, t)`. Each rule is tested against its paper's formula.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from clipax import _checks, _engine, _placement, _states


class RuleState(Protocol):
    """The fields every adaptive rule's state has."""

    count: jax.Array  # int32 scalar: steps whose norms were all finite
    norm: jax.Array  # scalar: the last update's pre-clip global norm

    def _replace(self: S, **changes: Any) -> S: ...


class GlobalRuleState(RuleState, Protocol):
    threshold: jax.Array  # scalar: the last threshold (inf before any)


S = TypeVar("S", bound=RuleState)
G = TypeVar("G", bound=GlobalRuleState)
GlobalRule = Callable[[G, jax.Array], tuple[jax.Array, G]]
TensorRule = Callable[[S, jax.Array, jax.Array], tuple[jax.Array, S]]


def _kept(finite: jax.Array, new: Any, old: Any) -> Any:
    """The NaN rule: `new` where `finite`, else `old` (trees, leaf by leaf)."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o).astype(o.dtype), new, old)


def _counted(finite: jax.Array, count: jax.Array) -> jax.Array:
    return jnp.where(finite, optax.safe_int32_increment(count), count)


def global_rule(
    fn_name: str,
    init: Callable[[np.dtype], G],
    rule: GlobalRule[G],
    *,
    p: float,
    specs: Any,
    axis_name: tuple[str, ...],
) -> optax.GradientTransformation:
    """An Optax transformation that clips all leaves by their global p-norm to
    the threshold `rule` gives; `init(dtype)` is the state before any step."""

    def init_fn(params: optax.Params) -> G:
        leaves = _checks.norm_leaves(params, fn_name)
        return init(_engine.tree_accum_dtype(leaves.arrays))

    def update_fn(
        updates: optax.Updates, state: G, params: optax.Params | None = None
    ) -> tuple[optax.Updates, G]:
        del params
        leaves = _checks.norm_leaves(updates, fn_name)
        placements = _placement.leaf_placements(leaves, specs, axis_name)
        dtype = state.norm.dtype
        norm = _engine.global_norm(leaves.arrays, p, placements).astype(dtype)
        threshold, stepped = rule(state, norm)
        threshold = threshold.astype(dtype)
        finite = jnp.isfinite(norm)
        new_state = _kept(finite, stepped._replace(threshold=threshold), state)
        new_state = new_state._replace(count=_counted(finite, state.count), norm=norm)
        factor = _engine.clip_factor(norm, threshold)
        clipped = [_engine.scaled(x, factor) for x in leaves.arrays]
        return leaves.rebuild(clipped), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def tensor_rule(
    fn_name: str,
    init: Callable[[Callable[[Any], Any], np.dtype], S],
    rule: TensorRule[S],
    *,
    specs: Any,
    axis_name: tuple[str, ...],
) -> optax.GradientTransformation:
    """An Optax transformation that clips each leaf by its own norm to the
    threshold `rule` gives it; `init(per_tensor, dtype)` is the state before
    any step, `per_tensor(value)` a tree of the params' structure holding
    `value` for each tensor."""

    def init_fn(params: optax.Params) -> S:
        leaves = _checks.norm_leaves(params, fn_name)
        dtype = _engine.tree_accum_dtype(leaves.arrays)

        def per_tensor(value: Any) -> Any:
            return leaves.rebuild([jnp.asarray(value, dtype) for _ in leaves.arrays])

        return init(per_tensor, dtype)

    def update_fn(
        updates: optax.Updates, state: S, params: optax.Params | None = None
    ) -> tuple[optax.Updates, S]:
        del params
        leaves = _checks.norm_leaves(updates, fn_name)
        placements = _placement.leaf_placements(leaves, specs, axis_name)
        dtype = state.norm.dtype
        whole = [tuple(range(x.ndim)) for x in leaves.arrays]
        norms = _vector(_engine.tensor_norms(leaves.arrays, whole, placements), dtype)
        total = _engine.norm_of_norms(norms)
        fields = _states.DECLARED[type(state)].per_tensor
        vectors = {
            f: _vector(jax.tree.leaves(getattr(state, f)), dtype) for f in fields
        }
        thresholds, stepped = rule(state._replace(**vectors), norms, total)
        finite = jnp.isfinite(norms)
        kept = {f: _kept(finite, getattr(stepped, f), vectors[f]) for f in fields}
        kept["thresholds"] = _kept(
            finite, thresholds.astype(dtype), vectors["thresholds"]
        )
        kept["norms"] = norms
        new_state = stepped._replace(
            **{f: leaves.rebuild(list(v)) for f, v in kept.items()},
            count=_counted(jnp.all(finite), state.count),
            norm=total,
        )
        factors = _engine.clip_factor(norms, thresholds.astype(dtype))
        clipped = [_engine.scaled(x, factors[i]) for i, x in enumerate(leaves.arrays)]
        return leaves.rebuild(clipped), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def _vector(values: list[jax.Array], dtype: Any) -> jax.Array:
    """One entry per tensor."""
    if not values:
        return jnp.zeros((0,), dtype)
    return jnp.stack([jnp.asarray(v).astype(dtype) for v in values])
