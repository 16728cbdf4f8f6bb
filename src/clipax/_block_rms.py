"""`clip_by_block_rms`: each leaf clipped to a root-mean-square threshold."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import optax
from jax.typing import ArrayLike

from clipax import _checks, _engine, _leaves


@jax.jit
def _rms_factor(norm: jax.Array, root_size: float, threshold: Any) -> jax.Array:
    """The clip factor of a leaf's RMS, `norm / root_size`. Jitted, so that
    every leaf shares one trace."""
    return _engine.clip_factor(norm / root_size, threshold)


def clip_by_block_rms(
    threshold: ArrayLike,
    *,
    stacked: Any = None,
    axis_name: str | Sequence[str] | None = None,
    specs: Any = None,
) -> optax.GradientTransformation:
    """Scales each update leaf so that its root mean square is <= `threshold`.

    Equal to `optax.clip_by_block_rms` on the same inputs: a leaf whose RMS,
    `sqrt(mean(|u|**2))`, exceeds `threshold` is multiplied by
    `threshold / rms`. With clipax's rules: the RMS is the leaf's norm
    (float32, float64 for float64 leaves) over `sqrt(size)`, each leaf keeps
    its dtype, and a leaf whose RMS is NaN or inf comes out NaN
    (docs/semantics.md). With `stacked`, each layer of a stacked leaf is a
    block of its own (docs/stacked-layers.md).

    Args:
      threshold: the largest RMS allowed for each leaf: a positive scalar,
        `inf`, or an array (docs/semantics.md, "Thresholds").
      stacked: None, or a prefix of the updates holding, per subtree, how many
        leading axes index stacked layers, or a callable that returns one.
      axis_name: inside `pmap` or `shard_map`, the mesh axes every leaf is
        split over (docs/scaling-out.md).
      specs: inside `shard_map`, the `in_specs` of the updates.

    Returns:
      An `optax.GradientTransformation` with state `optax.EmptyState`.

    Raises:
      ValueError: at construction, if an argument is not accepted; at
        `update`, inside `shard_map`, if a leaf's layout is not given.
      TypeError: at `init` or `update`, if a leaf is not a float array.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> tx = clipax.clip_by_block_rms(1.0)
      >>> grads = {"w": jnp.array([3.0, -3.0, 3.0, -3.0]), "b": jnp.array([0.5])}
      >>> updates, _ = tx.update(grads, tx.init(grads))
      >>> updates["w"], updates["b"]  # RMS 3 scaled to 1; RMS 0.5 kept
      (Array([ 1., -1.,  1., -1.], dtype=float32), Array([0.5], dtype=float32))
    """
    threshold = _checks.threshold("threshold", threshold)

    checked = _leaves.reader(
        "clip_by_block_rms", stacked=stacked, specs=specs, axis_name=axis_name
    )

    def init_fn(params: optax.Params) -> optax.EmptyState:
        checked(params)
        return optax.EmptyState()

    def update_fn(
        updates: optax.Updates,
        state: optax.EmptyState,
        params: optax.Params | None = None,
    ) -> tuple[optax.Updates, optax.EmptyState]:
        del params
        leaves = checked(updates)
        norms = _engine.norms(leaves, [leaf.inner for leaf in leaves])
        clipped = []
        for leaf, n in zip(leaves, norms, strict=True):
            factor = _rms_factor(n, math.sqrt(max(leaf.size(leaf.inner), 1)), threshold)
            clipped.append(_engine.scaled(leaf.x, factor))
        return leaves.rebuild(clipped), optax.EmptyState()

    return optax.GradientTransformation(init_fn, update_fn)
