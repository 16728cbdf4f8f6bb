"""The adaptive rules' transformations: a rule that learns its threshold.

A rule is a pure function of its state and this step's norm:

    GlobalRule: rule(state, norm) -> (threshold, state)         AutoClip, ZClip
    TensorRule: rule(state, norm, shared) -> (threshold, state)  AdaGC

`state` is the rule's declared NamedTuple (`_states.declare`): its statistics
and the fields every rule keeps, `count` (steps whose norms were all finite)
and `norm` (the last global norm), with `threshold` for a global rule, or
`norms` and `thresholds` (trees, one value per tensor) for a tensor rule. The
rule returns the state with its statistics updated (`state._replace`). A
tensor rule runs once per tensor: its state's per-tensor fields hold that
tensor's entries, and `shared` is what `shared(state, total)` computed once
for the step from the global norm `total`.

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

_R = TypeVar("_R", bound="RuleState")


class RuleState(Protocol):
    """The fields every adaptive rule's state has (a NamedTuple's, read-only)."""

    @property
    def count(self) -> jax.Array: ...  # int32 scalar: steps whose norms were finite

    @property
    def norm(self) -> jax.Array: ...  # scalar: the last update's pre-clip global norm

    def _replace(self: _R, *args: Any, **changes: Any) -> _R: ...


class GlobalRuleState(RuleState, Protocol):
    @property
    def threshold(self) -> jax.Array: ...  # scalar: the last threshold (inf first)


class TensorRuleState(RuleState, Protocol):
    @property
    def norms(self) -> Any: ...  # one pre-clip norm per tensor

    @property
    def thresholds(self) -> Any: ...  # one threshold per tensor (inf first)


S = TypeVar("S", bound=TensorRuleState)
G = TypeVar("G", bound=GlobalRuleState)
H = TypeVar("H")
GlobalRule = Callable[[G, jax.Array], tuple[jax.Array, G]]
Shared = Callable[[S, jax.Array], H]
TensorRule = Callable[[S, jax.Array, H], tuple[jax.Array, S]]


def _kept(finite: jax.Array, new: Any, old: Any) -> Any:
    """The NaN rule: `new` where `finite`, else `old` (trees, leaf by leaf)."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o).astype(o.dtype), new, old)


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
        new_state = new_state._replace(
            count=_engine.count_if(finite, state.count), norm=norm
        )
        factor = _engine.clip_factor(norm, threshold)
        clipped = [_engine.scaled(x, factor) for x in leaves.arrays]
        return leaves.rebuild(clipped), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def tensor_rule(
    fn_name: str,
    init: Callable[[Callable[[Any], Any], np.dtype], S],
    shared: Shared[S, H],
    rule: TensorRule[S, H],
    *,
    stacked: Any,
    specs: Any,
    axis_name: tuple[str, ...],
) -> optax.GradientTransformation:
    """An Optax transformation that clips each tensor (each layer of a
    stacked leaf) by its own norm to the threshold `rule` gives it.
    `init(per_tensor, dtype)` is the state before any step, `per_tensor(value)`
    the per-tensor field holding `value` for each tensor."""

    def tensor_step(
        statistics: tuple[str, ...], state: S, norm: jax.Array, values: H
    ) -> tuple[dict[str, jax.Array], jax.Array]:
        """One leaf's rule (elementwise over its layers), with the NaN rule,
        and its clip factor."""
        threshold, stepped = rule(state, norm, values)
        threshold = threshold.astype(norm.dtype)
        finite = jnp.isfinite(norm)
        new = {
            f: _kept(finite, getattr(stepped, f), getattr(state, f)) for f in statistics
        }
        new["thresholds"] = _kept(finite, threshold, state.thresholds)
        new["norms"] = norm
        return new, _engine.clip_factor(norm, threshold)

    # Jitted, so that tensors of one shape share one trace (benchmarks/RESULTS.md).
    step = jax.jit(tensor_step, static_argnums=0)

    def checked(tree: optax.Params) -> _checks.Leaves:
        return _checks.norm_leaves(tree, fn_name, stacked)

    def init_fn(params: optax.Params) -> S:
        leaves = checked(params)
        dtype = _engine.tree_accum_dtype(leaves.arrays)

        def per_tensor(value: Any) -> Any:
            return _states.per_tensor(
                leaves,
                [
                    jnp.full(leaves.layers(i), value, dtype)
                    for i in range(len(leaves.arrays))
                ],
            )

        return init(per_tensor, dtype)

    def update_fn(
        updates: optax.Updates, state: S, params: optax.Params | None = None
    ) -> tuple[optax.Updates, S]:
        del params
        leaves = checked(updates)
        placements = _placement.leaf_placements(leaves, specs, axis_name)
        dtype = state.norm.dtype
        norms = [n.astype(dtype) for n in _engine.layer_norms(leaves, placements)]
        layer_axes = None
        if placements is not None:
            layer_axes = _placement.layer_axes(leaves, placements)
        total, finite = _engine.norm_of_layer_norms(norms, layer_axes)
        values = shared(state, total.astype(dtype))
        fields = tuple(_states.DECLARED[type(state)].per_tensor)
        shapes = [leaves.layers(i) for i in range(len(norms))]
        entries = zip(
            *(
                _checks.state_entries(
                    fn_name, leaves, _states.per_tensor_tree(getattr(state, f)), shapes
                )
                for f in fields
            ),
            strict=True,
        )
        statistics = tuple(f for f in fields if f not in ("norms", "thresholds"))
        steps = [
            step(
                statistics,
                state._replace(**dict(zip(fields, own, strict=True))),
                norm,
                values,
            )
            for norm, own in zip(norms, entries, strict=True)
        ]
        new_state = state._replace(
            **{
                f: _states.per_tensor(leaves, [new[f] for new, _ in steps])
                for f in fields
            },
            count=_engine.count_if(finite, state.count),
            norm=total.astype(dtype),
        )
        clipped = [
            _engine.scaled(
                x, factor.reshape(factor.shape + (1,) * (x.ndim - factor.ndim))
            )
            for x, (_, factor) in zip(leaves.arrays, steps, strict=True)
        ]
        return leaves.rebuild(clipped), new_state

    return optax.GradientTransformation(init_fn, update_fn)
