"""AdaGC: each tensor clipped against an EMA of its own past clipped norms."""

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


@_states.declare(
    "adagc",
    per_tensor={"ema": "ema", "norms": "norm", "thresholds": "threshold"},
    clip=("norms", "thresholds"),
)
class AdaGCState(NamedTuple):
    """State of `adagc`: each tensor's EMA and what the last update saw."""

    ema: chex.ArrayTree  # the updates' tree, a float32 scalar per tensor
    # (float64 for float64 updates; a vector, one per layer, for a stacked
    # leaf): EMA of its clipped norms; inf until seen
    count: jax.Array  # type: ignore[assignment]  # int32 scalar: steps whose norms were all finite
    norm: jax.Array  # float32 scalar: pre-clip global norm of the last update
    norms: chex.ArrayTree  # likewise, each tensor's pre-clip norm
    thresholds: chex.ArrayTree  # likewise, the norm each tensor was clipped
    # to, or would have been (inf before the first step)
    stacks: _leaves.Stacks = _leaves.Stacks()  # static: where each stack starts


def adagc_step(
    ema: jax.Array,
    norm: jax.Array,
    warming: jax.Array,
    factor: jax.Array,
    ratio: jax.Array,
    alpha: jax.Array,
    one_minus_alpha: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """AdaGC's step for one tensor's `norm` (docs/semantics.md, "AdaGC"): its
    threshold and new EMA. `warming` and `factor` (the warm-up's global clip
    factor) are the step's."""
    unseen = ema == np.inf
    # Warm-up: global clipping to `max_norm`; the EMA starts from the smallest
    # nonzero clipped norm of the tensor.
    warm_clipped = norm * factor
    warm_ema = jnp.where(warm_clipped > 0, jnp.minimum(ema, warm_clipped), ema)
    # After: the tensor clipped to `clip_ratio` times its EMA, which then
    # follows the clipped norm; the tensor's first nonzero norm starts it.
    previous = jnp.where(unseen, norm, ema)
    limit = ratio * previous
    ema_after = alpha * previous + one_minus_alpha * jnp.minimum(norm, limit)
    ema_after = jnp.where(unseen & (norm == 0), ema, ema_after)
    threshold = jnp.where(warming, warm_clipped, limit)
    return threshold, jnp.where(warming, warm_ema, ema_after)


@jax.jit
def _tensor_step(
    ema: jax.Array, threshold: jax.Array, norm: jax.Array, *shared: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`adagc_step` with the NaN rule (a NaN or inf norm keeps the tensor's
    statistics), and the tensor's clip factor. Jitted, so that tensors of one
    shape share one trace (benchmarks/RESULTS.md)."""
    new_threshold, new_ema = adagc_step(ema, norm, *shared)
    finite = jnp.isfinite(norm)
    return (
        jnp.where(finite, new_ema, ema),
        jnp.where(finite, new_threshold, threshold),
        _engine.clip_factor(norm, new_threshold),
    )


def adagc(
    *,
    clip_ratio: ArrayLike = 1.04,
    alpha: ArrayLike = 0.99,
    warmup_steps: int = 100,
    max_norm: ArrayLike = 1.0,
    stacked: Any = None,
    axis_name: str | Sequence[str] | None = None,
    specs: Any = None,
) -> optax.GradientTransformation:
    """Clips each update tensor against an EMA of its own past clipped norms.

    AdaGC (Wang et al. 2025): for the first `warmup_steps` steps the updates
    are clipped by global norm to `max_norm` and each tensor's EMA starts from
    its smallest nonzero clipped norm; after them each tensor is clipped on
    its own to `clip_ratio` times its EMA, which follows its clipped norm with
    factor `alpha`. With `stacked`, each layer of a stacked leaf is a tensor
    with its own EMA (docs/stacked-layers.md). docs/semantics.md ("AdaGC")
    gives the rule and where it follows the authors' code.

    Args:
      clip_ratio: a tensor is clipped to this multiple of its EMA (the
        paper's `lambda_rel`), a finite real > 0.
      alpha: the EMA factor (the paper's `beta`), in (0, 1).
      warmup_steps: how many first steps clip by global norm, an int >= 0.
      max_norm: the global-norm threshold of the warm-up (`lambda_abs`): a
        positive scalar, `inf`, or an array.
      stacked: None, or a prefix of the updates (docs/stacked-layers.md).
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
    clip_ratio = _checks.positive("clip_ratio", clip_ratio)
    alpha = _checks.unit("alpha", alpha)
    warmup = _checks.integer("warmup_steps", warmup_steps, minimum=0)
    max_norm = _checks.threshold("max_norm", max_norm)
    checked = _leaves.reader("adagc", stacked=stacked, specs=specs, axis_name=axis_name)

    def init_fn(params: optax.Params) -> AdaGCState:
        leaves = checked(params)
        dtype = _engine.tree_accum_dtype(leaves.arrays)
        return AdaGCState(
            ema=leaves.full(np.inf, dtype),
            count=jnp.zeros((), jnp.int32),
            norm=jnp.zeros((), dtype),
            norms=leaves.full(0, dtype),
            thresholds=leaves.full(np.inf, dtype),
            stacks=leaves.stacks,
        )

    def update_fn(
        updates: optax.Updates, state: AdaGCState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, AdaGCState]:
        del params
        leaves = checked(updates)
        emas = _leaves.check_state("adagc", leaves, state.ema, state.stacks)
        thresholds = _leaves.check_state("adagc", leaves, state.thresholds)
        dtype = state.norm.dtype
        norms = [n.astype(dtype) for n in _engine.layer_norms(leaves)]
        total, finite = _engine.total_norm(
            norms, [leaf.split(leaf.layer_axes) for leaf in leaves]
        )
        a = jnp.asarray(alpha, dtype)
        factor = _engine.clip_factor(total.astype(dtype), max_norm)  # the warm-up's
        ratio = jnp.asarray(clip_ratio, dtype)
        shared = (state.count < warmup, factor, ratio, a, 1 - a)
        # Each tensor's (ema, threshold, clip factor), by `adagc_step`.
        steps = zip(emas, thresholds, norms, strict=True)
        stepped = [_tensor_step(*entries, *shared) for entries in steps]
        clipped = [
            _engine.scaled(leaf.x, leaf.broadcast(factor))
            for leaf, (_, _, factor) in zip(leaves, stepped, strict=True)
        ]
        return leaves.rebuild(clipped), AdaGCState(
            ema=leaves.stats(ema for ema, _, _ in stepped),
            count=_engine.count_if(finite, state.count),
            norm=total.astype(dtype),
            norms=leaves.stats(norms),
            thresholds=leaves.stats(threshold for _, threshold, _ in stepped),
            stacks=state.stacks,
        )

    return optax.GradientTransformation(init_fn, update_fn)
