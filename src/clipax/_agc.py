"""Adaptive gradient clipping (AGC): unit-wise, against the parameter norms."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from clipax import _checks, _engine, _leaves

# optax's floor on the update norm in the division: a unit whose update norm
# is below it and above its limit is scaled to below that limit, as in optax.
DIV_EPS = 1e-6
# optax's unit axes by rank, for ranks 2 to 5 (lower ranks take the whole leaf).
DEFAULT_AXES = {2: (0,), 3: (0,), 4: (0, 1, 2), 5: (0, 1, 2, 3)}


def unit_axes(axes: tuple[int, ...] | None, leaf: _leaves.Leaf) -> tuple[int, ...]:
    """The axes a leaf's unit norms are taken over (within one layer), as
    `optax.unitwise_norm`: the whole layer when at most one of its dimensions
    is longer than 1, else `DEFAULT_AXES` by rank; other ranks need `axis`."""
    if axes is not None:
        return leaf.within(axes, "axis")
    shape = tuple(leaf.size([d]) for d in leaf.inner)  # the tensor's, not a block's
    if sum(d != 1 for d in shape) <= 1:
        return leaf.inner
    if len(shape) in DEFAULT_AXES:
        return leaf.within(DEFAULT_AXES[len(shape)])
    raise ValueError(
        f"`adaptive_grad_clip` has no default unit axes for the leaf at "
        f"{_leaves.path_str(leaf.path)} with shape {shape} (rank {len(shape)}); it "
        "knows ranks 0 to 5. Pass `axis` to say which axes a unit spans."
    )


@jax.jit
def _clip_units(
    g: jax.Array, g_norm: jax.Array, w_norm: jax.Array, clipping: Any, eps: Any
) -> jax.Array:
    """Each unit of `g` scaled down to `clipping * max(|w|, eps)` if above it.
    Jitted, so that leaves of one shape and dtype share one trace."""
    ratio_bound = jnp.asarray(clipping, g_norm.dtype)
    limit = ratio_bound * jnp.maximum(w_norm, jnp.asarray(eps, g_norm.dtype))
    # An inf `clipping` allows every norm, also against a zero parameter norm
    # with eps = 0, where inf * 0 is NaN.
    limit = jnp.where(jnp.isposinf(ratio_bound), jnp.inf, limit)
    # A `clipping` <= 0 gives zeros, never flipped signs or NaN; the rules sit
    # in the quotient's operands, as in `_engine.clip_factor`.
    keep = g_norm < limit
    one = jnp.ones_like(g_norm)
    numerator = jnp.where(keep, one, jnp.maximum(limit, 0))
    numerator = jnp.where(jnp.isfinite(g_norm), numerator, jnp.nan)
    denominator = jnp.where(keep, one, jnp.maximum(g_norm, DIV_EPS))
    return _engine.scaled(g, (numerator / denominator).astype(g_norm.dtype))


def adaptive_grad_clip(
    clipping: ArrayLike,
    eps: ArrayLike = 1e-3,
    axis: Any = None,
    *,
    stacked: Any = None,
    specs: Any = None,
) -> optax.GradientTransformation:
    """Clips each unit of the updates to `clipping` times its parameter's norm.

    AGC (Brock et al. 2021), equal to `optax.adaptive_grad_clip` on the same
    inputs and taking its call. Each leaf is cut into units (by default as
    optax: a whole vector, each output column of a Dense kernel, each output
    channel of a convolution kernel); a unit whose update norm is at least
    `clipping * max(|w|, eps)`, `|w|` being the same unit's parameter norm,
    is scaled down to that norm. Norms are accumulated in float32 (float64
    for float64 leaves); a unit whose norm is NaN or inf comes out NaN
    (docs/semantics.md). With `stacked`, units are those of one layer of a
    stacked leaf (docs/stacked-layers.md).

    Args:
      clipping: the largest ratio of a unit's update norm to its parameter
        norm: a positive scalar, `inf`, or an array.
      eps: the smallest parameter norm a unit is measured against, >= 0.
      axis: None (optax's default by rank), an int, or a sequence of distinct
        ints: the axes each unit spans, for every leaf (within one layer).
      stacked: None, or a prefix of the updates holding, per subtree, how many
        leading axes index stacked layers, or a callable that returns one.
      specs: inside `shard_map`, the `in_specs` of the updates and params.

    Returns:
      An `optax.GradientTransformation` with state `optax.EmptyState`.

    Raises:
      ValueError: at construction, if an argument is not accepted; at `init`
        or `update`, if `axis` is out of range for a leaf, a leaf of rank
        above 5 gets no `axis`, or inside `shard_map` its layout is not
        given; at `update`, if `params` is None.
      TypeError: if a leaf is not a float array, or `axis` is traced.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> params = {"w": jnp.array([3.0, 4.0]), "b": jnp.zeros(2)}
      >>> tx = clipax.adaptive_grad_clip(0.1)
      >>> grads = {"w": jnp.array([6.0, 8.0]), "b": jnp.array([1.0, 0.0])}
      >>> updates, _ = tx.update(grads, tx.init(params), params)
      >>> updates["w"], updates["b"]  # clipped to 0.1 * 5 and 0.1 * 1e-3
      (Array([0.3, 0.4], dtype=float32), Array([0.0001, 0.    ], dtype=float32))

    References:
      Brock et al., `High-Performance Large-Scale Image Recognition Without
      Normalization <https://arxiv.org/abs/2102.06171>`_, 2021.
    """
    clipping = _checks.threshold("clipping", clipping)
    eps = _checks.number("eps", eps, "a finite real number >= 0", low=0, high_open=True)
    axes = _checks.axes(axis, name="axis")

    checked = _leaves.reader("adaptive_grad_clip", stacked=stacked, specs=specs)

    def units(tree: optax.Updates) -> tuple[_leaves.Leaves, list[tuple[int, ...]]]:
        leaves = checked(tree)
        return leaves, [unit_axes(axes, leaf) for leaf in leaves]

    def init_fn(params: optax.Params) -> optax.EmptyState:
        units(params)
        return optax.EmptyState()

    def update_fn(
        updates: optax.Updates,
        state: optax.EmptyState,
        params: optax.Params | None = None,
    ) -> tuple[optax.Updates, optax.EmptyState]:
        leaves, reduced = units(updates)
        weights = _leaves.params_of(leaves, updates, params, "adaptive_grad_clip")
        w_leaves = [
            dataclasses.replace(leaf, x=w)
            for leaf, w in zip(leaves, weights, strict=True)
        ]
        # The updates' and the params' unit norms in one call: one collective
        # per set of mesh axes for both.
        norms = _engine.norms([*leaves, *w_leaves], reduced + reduced)
        g_norms, w_norms = norms[: len(leaves)], norms[len(leaves) :]
        clipped = [
            _clip_units(leaf.x, gn, wn.astype(gn.dtype), clipping, eps)
            for leaf, gn, wn in zip(leaves, g_norms, w_norms, strict=True)
        ]
        return leaves.rebuild(clipped), optax.EmptyState()

    return optax.GradientTransformation(init_fn, update_fn)
