"""AdaGC: each tensor clipped against an EMA of its own past clipped norms."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from clipax import _adaptive, _common, _engine, _states
from clipax._placement import AxisName


@_states.register("adagc", per_leaf=("ema", "norms", "thresholds"))
class AdaGCState(NamedTuple):
    """State of `adagc`: each leaf's EMA and what the last update saw."""

    ema: chex.ArrayTree  # the updates' tree, a float32 scalar per leaf (float64
    # for float64 updates): EMA of the leaf's clipped norms; inf until seen
    count: jax.Array  # type: ignore[assignment]  # int32 scalar: steps whose
    # norms were all finite (saturates at 2**31 - 1)
    norm: jax.Array  # float32 scalar: pre-clip global norm of the last update
    norms: chex.ArrayTree  # a float32 scalar per leaf: its pre-clip norm
    thresholds: chex.ArrayTree  # a float32 scalar per leaf: the norm it was
    # clipped to, or would have been clipped to (inf before the first step)


def adagc_shared(
    count: jax.Array, total: jax.Array, *, max_norm: ArrayLike, warmup_steps: int
) -> dict[str, jax.Array]:
    """What every leaf's step reads, once per step: whether the step is in the
    warm-up, and the warm-up's global clip factor."""
    return {
        "warming": count < warmup_steps,
        "factor": _common.clip_scale(total, max_norm),
    }


def adagc_leaf(
    stats: _adaptive.Stats,
    norm: jax.Array,
    shared: dict[str, jax.Array],
    *,
    clip_ratio: ArrayLike,
    alpha: ArrayLike,
) -> tuple[jax.Array, _adaptive.Stats]:
    """AdaGC's rule for one leaf's `norm` (or a vector of them), given
    `adagc_shared`."""
    ema = stats["ema"]
    dtype = ema.dtype
    unseen = ema == np.inf

    # Warm-up: global clipping to `max_norm`; the EMA starts from the smallest
    # nonzero clipped norm of each leaf.
    warm_clipped = norm * shared["factor"]  # all NaN when the total is not finite
    warm_ema = jnp.where(warm_clipped > 0, jnp.minimum(ema, warm_clipped), ema)

    # After: each leaf clipped to `clip_ratio` times its EMA, which then
    # follows the clipped norm. A leaf seen for the first time starts from its
    # own norm; while its norms are 0 it stays unseen.
    previous = jnp.where(unseen, norm, ema)
    limit = jnp.asarray(clip_ratio, dtype) * previous
    a = jnp.asarray(alpha, dtype)
    ema_after = a * previous + (1 - a) * jnp.minimum(norm, limit)
    ema_after = jnp.where(unseen & (norm == 0), ema, ema_after)

    warming = shared["warming"]
    threshold = jnp.where(warming, warm_clipped, limit)
    return threshold, {"ema": jnp.where(warming, warm_ema, ema_after)}


def adagc_rule(
    stats: _adaptive.Stats,
    norms: jax.Array,
    count: jax.Array,
    total: jax.Array | None = None,
    *,
    max_norm: ArrayLike,
    clip_ratio: ArrayLike,
    alpha: ArrayLike,
    warmup_steps: int,
) -> tuple[jax.Array, _adaptive.Stats]:
    """AdaGC's rule for the leaves' `norms` (see `adagc`), with `total` their
    global norm (by default that of `norms`)."""
    if total is None:
        total = _engine.norm_of_norms(norms)
    shared = adagc_shared(count, total, max_norm=max_norm, warmup_steps=warmup_steps)
    return adagc_leaf(stats, norms, shared, clip_ratio=clip_ratio, alpha=alpha)


def adagc(
    *,
    clip_ratio: ArrayLike = 1.04,
    alpha: ArrayLike = 0.99,
    warmup_steps: int = 100,
    max_norm: ArrayLike = 1.0,
    axis_name: AxisName = None,
    specs: Any = None,
) -> optax.GradientTransformation:
    """Clips each update leaf against an EMA of its own past clipped norms.

    AdaGC (Wang et al. 2025). With `g_i` the L2 norm of leaf `i` (a whole
    tensor) and `gamma_i` its EMA, kept in the state:

    1. Warm-up, the first `warmup_steps` steps: the updates are clipped by
       global norm to `max_norm` (as `clipax.clip_by_global_norm`), and each
       `gamma_i` is the smallest nonzero clipped norm `c_i` of the leaf so far.
    2. After: each leaf is clipped on its own to `clip_ratio * gamma_i` (the
       paper's `lambda_rel`), and `gamma_i <- alpha * gamma_i + (1 - alpha) *
       c_i`, `c_i = min(g_i, clip_ratio * gamma_i)` being its clipped norm.

    Every leaf has its own threshold, so a spike in one tensor changes the
    update of no other, and a tensor whose gradients shrink as training goes
    on is held to its own scale, not to the whole model's.

    This follows the authors' reference code (`AdaGC` in
    `megatron/optimizer/clip_grads.py` of github.com/lishuai-97/AdaGC) where
    the paper leaves room or differs: its defaults (`clip_ratio` 1.04,
    `alpha` (the paper's beta) 0.99, 100 warm-up steps, Megatron's
    `--clip-grad` 1.0 as `max_norm`, where ports of the paper's first version,
    such as pytorch_optimizer's `AdaGC`, use 1.05 and 0.98); the warm-up EMA
    seeded with the minimum of the clipped norms; norms of whole tensors
    across model-parallel shards.
    Differences from that code: the clip factor is `t / g` (clipax's formula)
    where it divides by `g + 1e-6`; a leaf's zero norm does not seed its EMA
    (the code's minimum would then be 0 and clip that leaf to zero for the rest
    of training, as happens to LoRA's `A` at initialisation), so the EMA starts
    from the first nonzero norm; and a step with a NaN or inf norm is not
    counted (below).

    A leaf whose norm is NaN or inf keeps its EMA and comes out all NaN; during
    warm-up, as in `clipax.clip_by_global_norm`, every leaf then comes out NaN.
    Such a step does not count towards the warm-up. Wrap the chain in
    `optax.apply_if_finite` to skip such steps. Norms are clipax's
    per-tensor norms (float32 sums of squares; a tensor whose squares
    overflow follows the NaN rule: docs/semantics.md), kept in float32
    (float64 for float64 updates), on the device: the step compiles once.

    The state's `thresholds` hold, per leaf, the norm the leaf was clipped to
    during warm-up (its own norm when not clipped) and afterwards
    `clip_ratio * gamma_i`; `norms` the pre-clip norms; `norm` the global
    pre-clip norm; all readable with `clipax.metrics` or `optax.tree.get`.

    Args:
      clip_ratio: the relative threshold `lambda_rel`: a leaf is clipped to
        this multiple of its EMA, a finite real > 0; 1.04 by default. May be
        traced (not checked then).
      alpha: the EMA factor (the paper's `beta`), in (0, 1); 0.99 by default.
        May be traced (not checked then).
      warmup_steps: how many first steps clip by global norm and seed the
        EMAs, an int >= 0 (0: the first step seeds each EMA with the leaf's
        norm); 100 by default. It cannot be traced: under
        `optax.inject_hyperparams`, name it in `static_args`.
      max_norm: the global-norm threshold during warm-up (`lambda_abs`): a
        positive scalar, `inf` (warm-up only records the norms), or traced.
      axis_name: inside `pmap` or `shard_map`, the mesh axes every update leaf
        is split over.
      specs: inside `shard_map`, the `in_specs` of the updates, a prefix tree of
        PartitionSpecs: a leaf's norm is then the norm of the whole tensor, the
        same on every device.

    Returns:
      An `optax.GradientTransformation` whose state is an `AdaGCState`.

    Raises:
      ValueError: at construction, if an argument is not accepted (the message
        names it).
      TypeError: at construction, if `warmup_steps` is traced; at `init` or
        `update`, if a leaf is not a float16, bfloat16, float32, float64 or complex
        array.

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
      >>> state.ema["a"], state.thresholds["a"]
      (Array(2.04, dtype=float32), Array(2.08, dtype=float32))

    References:
      Wang et al., `AdaGC: Enhancing LLM Pretraining Stability via Adaptive
      Gradient Clipping <https://arxiv.org/abs/2502.11034>`_, 2025.
    """
    _adaptive.check_positive("clip_ratio", clip_ratio)
    _adaptive.check_open_unit("alpha", alpha)
    warmup = _adaptive.check_count("warmup_steps", warmup_steps, minimum=0)
    _common.check_max_norm("max_norm", max_norm)
    rule = functools.partial(adagc_leaf, clip_ratio=clip_ratio, alpha=alpha)
    shared = functools.partial(adagc_shared, max_norm=max_norm, warmup_steps=warmup)
    return _adaptive.transformation(
        "adagc",
        AdaGCState,
        lambda dtype: {"ema": jnp.full((), jnp.inf, dtype)},
        rule,
        per_leaf=True,
        shared=shared,
        axis_name=axis_name,
        specs=specs,
    )
