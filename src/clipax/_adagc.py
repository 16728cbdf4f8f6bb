"""AdaGC: each tensor clipped against an EMA of its own past clipped norms."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from clipax import _adaptive, _checks, _engine, _states
from clipax._placement import AxisName


@_states.declare(
    "adagc",
    scalars=("count", "norm"),
    per_tensor={"ema": "ema", "norms": "norm", "thresholds": "threshold"},
)
class AdaGCState(NamedTuple):
    """State of `adagc`: each tensor's EMA and what the last update saw."""

    ema: chex.ArrayTree  # the updates' tree, a float32 scalar per tensor
    # (float64 for float64 updates; one per layer of a stacked leaf, in a
    # `StackedStats`): EMA of its clipped norms; inf until seen
    count: jax.Array  # type: ignore[assignment]  # int32 scalar: steps whose norms were all finite
    norm: jax.Array  # float32 scalar: pre-clip global norm of the last update
    norms: chex.ArrayTree  # a float32 scalar per tensor: its pre-clip norm
    thresholds: chex.ArrayTree  # a float32 scalar per tensor: the norm it was
    # clipped to, or would have been (inf before the first step)


class Shared(NamedTuple):
    """What every tensor's AdaGC step reads, computed once per step (each
    operation of the tensor's step is compiled once per leaf)."""

    warming: jax.Array  # bool scalar: the step is in the warm-up
    factor: jax.Array  # scalar: the warm-up's global clip factor
    ratio: jax.Array  # `clip_ratio`, in the statistics' dtype
    alpha: jax.Array  # `alpha`, likewise
    rest: jax.Array  # 1 - `alpha`


def adagc_shared(
    state: AdaGCState,
    total: jax.Array,
    *,
    max_norm: ArrayLike,
    warmup_steps: int,
    clip_ratio: ArrayLike,
    alpha: ArrayLike,
) -> Shared:
    dtype = state.norm.dtype
    a = jnp.asarray(alpha, dtype)
    return Shared(
        warming=state.count < warmup_steps,
        factor=_engine.clip_factor(total, max_norm),
        ratio=jnp.asarray(clip_ratio, dtype),
        alpha=a,
        rest=1 - a,
    )


def adagc_rule(
    state: AdaGCState, norm: jax.Array, shared: Shared
) -> tuple[jax.Array, AdaGCState]:
    """AdaGC's step for one tensor's `norm` (docs/semantics.md, "AdaGC")."""
    ema = state.ema
    unseen = ema == np.inf

    # Warm-up: global clipping to `max_norm`; the EMA starts from the smallest
    # nonzero clipped norm of the tensor.
    warm_clipped = norm * shared.factor
    warm_ema = jnp.where(warm_clipped > 0, jnp.minimum(ema, warm_clipped), ema)

    # After: the tensor clipped to `clip_ratio` times its EMA, which then
    # follows the clipped norm; the tensor's first nonzero norm starts it.
    previous = jnp.where(unseen, norm, ema)
    limit = shared.ratio * previous
    ema_after = shared.alpha * previous + shared.rest * jnp.minimum(norm, limit)
    ema_after = jnp.where(unseen & (norm == 0), ema, ema_after)

    threshold = jnp.where(shared.warming, warm_clipped, limit)
    new_ema = jnp.where(shared.warming, warm_ema, ema_after)
    return threshold, state._replace(ema=new_ema)


def adagc(
    *,
    clip_ratio: ArrayLike = 1.04,
    alpha: ArrayLike = 0.99,
    warmup_steps: int = 100,
    max_norm: ArrayLike = 1.0,
    stacked: Any = None,
    axis_name: AxisName = None,
    specs: Any = None,
) -> optax.GradientTransformation:
    """Clips each update tensor against an EMA of its own past clipped norms.

    AdaGC (Wang et al. 2025): for the first `warmup_steps` steps the updates
    are clipped by global norm to `max_norm` and each tensor's EMA starts from
    its smallest nonzero clipped norm; after them each tensor is clipped on
    its own to `clip_ratio` times its EMA, which follows its clipped norm with
    factor `alpha`. A spike in one tensor changes no other's update. With
    `stacked`, each layer of a stacked leaf is a tensor of its own, with its
    own EMA (docs/stacked-layers.md). It follows the authors' reference code
    where the paper leaves room; docs/semantics.md ("AdaGC") gives the rule
    and the differences.

    Args:
      clip_ratio: a tensor is clipped to this multiple of its EMA (the
        paper's `lambda_rel`), a finite real > 0.
      alpha: the EMA factor (the paper's `beta`), in (0, 1).
      warmup_steps: how many first steps clip by global norm, an int >= 0.
      max_norm: the global-norm threshold of the warm-up (`lambda_abs`): a
        positive scalar, `inf`, or an array.
      stacked: None, or a prefix of the updates holding, per subtree, how many
        leading axes index stacked layers, or a callable that returns one.
      axis_name: inside `pmap` or `shard_map`, the mesh axes every leaf is
        split over (docs/scaling-out.md).
      specs: inside `shard_map`, the `in_specs` of the updates: a tensor's
        norm is then the whole tensor's.

    Returns:
      An `optax.GradientTransformation` whose state is an `AdaGCState`.

    Raises:
      ValueError: at construction, if an argument is not accepted.
      TypeError: at construction, if `warmup_steps` is traced; at `init` or
        `update`, if a leaf is not a float array.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> tx = clipax.adagc(warmup_steps=1, max_norm=10.0, alpha=0.5)
      >>> state = tx.init({"a": jnp.zeros(1), "b": jnp.zeros(1)})
      >>> for a in [2.0, 2.0, 8.0]:  # a spike in "a" at the third step
      ...     updates, state = tx.update({"a": jnp.array([a]), "b": jnp.ones(1)},
      ...                                state)
      >>> updates["a"], updates["b"]  # "a" clipped to 1.04 * 2; "b" untouched
      (Array([2.08], dtype=float32), Array([1.], dtype=float32))

    References:
      Wang et al., `AdaGC: Enhancing LLM Pretraining Stability via Adaptive
      Gradient Clipping <https://arxiv.org/abs/2502.11034>`_, 2025.
    """
    _checks.positive("clip_ratio", clip_ratio)
    _checks.open_unit("alpha", alpha)
    warmup = _checks.count("warmup_steps", warmup_steps, minimum=0)
    _checks.threshold("max_norm", max_norm)
    _, names = _checks.axes_and_axis_name(None, axis_name, stacked)

    def init(per_tensor: Callable[[Any], Any], dtype: np.dtype) -> AdaGCState:
        return AdaGCState(
            ema=per_tensor(jnp.inf),
            count=jnp.zeros((), jnp.int32),
            norm=jnp.zeros((), dtype),
            norms=per_tensor(0),
            thresholds=per_tensor(jnp.inf),
        )

    return _adaptive.tensor_rule(
        "adagc",
        init,
        functools.partial(
            adagc_shared,
            max_norm=max_norm,
            warmup_steps=warmup,
            clip_ratio=clip_ratio,
            alpha=alpha,
        ),
        adagc_rule,
        stacked=stacked,
        specs=specs,
        axis_name=names,
    )
