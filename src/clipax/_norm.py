"""`clip_by_norm` as an Optax transformation that keeps the per-leaf norms."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import chex
import optax
from jax.typing import ArrayLike

from clipax import _checks, _leaves, _states
from clipax.tree import _norm as tree_norm


@_states.declare("clip_by_norm", per_tensor={"norms": "norm"})
class ClipByNormState(NamedTuple):
    """State of `clip_by_norm`: each leaf's pre-clip norm at the last update."""

    norms: chex.ArrayTree  # the updates' tree with a float32 scalar per leaf
    # (a vector, one per layer, for a stacked leaf)
    stacks: _leaves.Stacks = _leaves.Stacks()  # static: where each stack starts


@_checks.peer_names(
    {"clip_norm": "max_norm"}, "clipax.tree.clip_by_norm(tree, max_norm)"
)
def clip_by_norm(
    max_norm: ArrayLike,
    axes: Any = None,
    name: str | None = None,
    *,
    stacked: Any = None,
    axis_name: str | Sequence[str] | None = None,
    specs: Any = None,
) -> optax.GradientTransformation:
    """Clips each update leaf on its own to L2 norm `max_norm`.

    The transformation form of `clipax.tree.clip_by_norm` (`tf.clip_by_norm`,
    Keras `clipnorm`). Its state keeps each leaf's pre-clip norm (with `axes`,
    the largest among its slices; with `stacked`, one per layer), for
    `optax.tree.get(opt_state, "norms")` and `clipax.metrics`.

    Args:
      max_norm: the largest norm allowed for each leaf (or slice): a positive
        scalar, `inf`, or an array (docs/semantics.md, "Thresholds").
      axes: None (each whole leaf), an int, or a sequence of distinct ints:
        the axes each norm is taken over, for every leaf (within one layer of
        a stacked leaf).
      name: TensorFlow's name for the operation: ignored.
      stacked: None, or a prefix of the updates holding, per subtree, how many
        leading axes index stacked layers, or a callable that returns one
        (see `clipax.tree.clip_by_norm`).
      axis_name: inside `pmap` or `shard_map`, the mesh axes every leaf is
        split over; only with `axes=None`.
      specs: inside `shard_map`, the `in_specs` of the updates.

    Returns:
      An `optax.GradientTransformation` whose state is a `ClipByNormState`.

    Raises:
      ValueError: at construction, if `max_norm` or `axes` is not accepted; at
        `init`, if `axes` is out of range for a leaf (naming its path and
        shape).
      TypeError: at `init` or `update`, if a leaf is not a float array; at
        construction, if a peer's argument is given wrongly.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> tx = clipax.clip_by_norm(1.0)
      >>> grads = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.5])}
      >>> updates, state = tx.update(grads, tx.init(grads))
      >>> updates["a"], updates["b"]
      (Array([0.6, 0.8], dtype=float32), Array([0.5], dtype=float32))
      >>> state.norms["a"]
      Array(5., dtype=float32)
    """
    del name  # means nothing in JAX
    max_norm = _checks.threshold("max_norm", max_norm)
    axes, _ = _checks.axes_and_axis_name(axes, axis_name, stacked)
    checked = _leaves.reader(
        "clip_by_norm", stacked=stacked, specs=specs, axis_name=axis_name
    )

    def init_fn(params: optax.Params) -> ClipByNormState:
        leaves = checked(params)
        for leaf in leaves:
            leaf.within(axes)  # out of range: an error at init
        return ClipByNormState(norms=leaves.full(0), stacks=leaves.stacks)

    def update_fn(
        updates: optax.Updates,
        state: ClipByNormState,
        params: optax.Params | None = None,
    ) -> tuple[optax.Updates, ClipByNormState]:
        del params
        leaves = checked(updates)
        _leaves.check_state("clip_by_norm", leaves, state.norms, state.stacks)
        clipped, peaks = tree_norm.clip_leaves(leaves, max_norm, axes)
        return clipped, ClipByNormState(leaves.stats(peaks), state.stacks)

    return optax.GradientTransformation(init_fn, update_fn)
