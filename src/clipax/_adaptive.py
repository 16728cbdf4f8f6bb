"""The global adaptive rules' transformation: a rule that learns its threshold.

A rule is a pure function of its state and this step's global norm,

    rule(state, norm) -> (threshold, state)        AutoClip, ZClip

`state` is the rule's declared NamedTuple (`_states.declare`) with the fields
every such rule keeps: `count` (steps whose norm was finite), `norm` (the
last global norm) and `threshold`. The rule returns the state with its
statistics updated (`state._replace`); the transformation does the rest once:
the norm (with `specs` / `axis_name` for sharded leaves), `count`, `norm` and
`threshold`, the NaN rule (a NaN or inf norm keeps the statistics and the
threshold, its updates come out NaN, and the step is not counted), and the
clip, TensorFlow's `x * t / max(norm, t)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from clipax import _engine, _leaves

_R = TypeVar("_R", bound="RuleState")


class RuleState(Protocol):
    """The fields every global rule's state has (a NamedTuple's, read-only)."""

    @property
    def count(self) -> jax.Array: ...  # int32 scalar: steps whose norm was finite

    @property
    def norm(self) -> jax.Array: ...  # scalar: the last update's pre-clip norm

    @property
    def threshold(self) -> jax.Array: ...  # scalar: the last threshold (inf first)

    def _replace(self: _R, *args: Any, **changes: Any) -> _R: ...


G = TypeVar("G", bound=RuleState)


def global_rule(
    fn_name: str,
    init: Callable[[np.dtype], G],
    rule: Callable[[G, jax.Array], tuple[jax.Array, G]],
    *,
    p: float,
    specs: Any,
    axis_name: tuple[str, ...],
) -> optax.GradientTransformation:
    """An Optax transformation that clips all leaves by their global p-norm to
    the threshold `rule` gives; `init(dtype)` is the state before any step."""

    def init_fn(params: optax.Params) -> G:
        return init(_engine.tree_accum_dtype(_leaves.leaves(params, fn_name).arrays))

    def update_fn(
        updates: optax.Updates, state: G, params: optax.Params | None = None
    ) -> tuple[optax.Updates, G]:
        del params
        leaves = _leaves.leaves(updates, fn_name, specs=specs, axis_name=axis_name)
        dtype = state.norm.dtype
        norm = _engine.global_norm(leaves, p).astype(dtype)
        threshold, stepped = rule(state, norm)
        finite = jnp.isfinite(norm)
        stepped = stepped._replace(threshold=threshold.astype(dtype))
        new_state = jax.tree.map(
            lambda n, o: jnp.where(finite, n, o).astype(o.dtype), stepped, state
        )._replace(count=_engine.count_if(finite, state.count), norm=norm)
        factor = _engine.clip_factor(norm, threshold.astype(dtype))
        return leaves.rebuild(
            [_engine.scaled(x, factor) for x in leaves.arrays]
        ), new_state

    return optax.GradientTransformation(init_fn, update_fn)
