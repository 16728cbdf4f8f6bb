"""`clip_by_norm` as an Optax transformation that keeps the per-leaf norms."""

from __future__ import annotations

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from clipax import _common, _states
from clipax._peers import peer_names
from clipax._placement import AxisName, normalize_axis_name
from clipax.tree import _norm


@_states.register("clip_by_norm", per_leaf=("norms",))
class ClipByNormState(NamedTuple):
    """State of `clip_by_norm`: each leaf's pre-clip norm at the last update."""

    norms: chex.ArrayTree  # the updates' tree with a float32 scalar per leaf


@peer_names({"clip_norm": "max_norm"}, ignored=["name"])
def clip_by_norm(
    max_norm: ArrayLike,
    axes: Any = None,
    name: str | None = None,
    *,
    axis_name: AxisName = None,
    specs: Any = None,
) -> optax.GradientTransformation:
    """Clips each update leaf on its own to L2 norm `max_norm`.

    The transformation form of `clipax.tree.clip_by_norm` (`tf.clip_by_norm`,
    Keras `clipnorm`). Its state keeps one scalar per leaf: the leaf's pre-clip
    norm, or with `axes` the largest norm among its slices, for logging
    with `optax.tree.get(opt_state, "norms")`. It takes the arguments of
    `tf.clip_by_norm` after the tensor, under their TensorFlow names too.

    Args:
      max_norm: the largest norm allowed for each leaf (or slice): a positive
        scalar, `inf`, or a traced value (TensorFlow's `clip_norm`).
      axes: None (each whole leaf), an int, or a sequence of distinct ints: the
        axes each norm is taken over, for every leaf.
      name: TensorFlow's name for the operation: accepted and ignored.
      axis_name: inside `pmap` or `shard_map`, the mesh axes every update leaf
        is split over; only with `axes=None`.
      specs: inside `shard_map`, the `in_specs` of the updates (see
        `clipax.tree.clip_by_norm`).

    Returns:
      An `optax.GradientTransformation` whose state is a `ClipByNormState`.

    Raises:
      ValueError: at construction if `max_norm` or `axes` is not accepted; at
        `init` if `axes` is out of range for a leaf (naming its path and shape).
      TypeError: at `init` if a leaf is not a float16, bfloat16, float32, float64 or
        complex array; at construction if an argument is given under two of its names
        (clipax's and a peer's), or `name` is not None, a bool or a string.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import clipax
      >>> tx = clipax.clip_by_norm(1.0)
      >>> grads = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.5])}
      >>> state = tx.init(grads)
      >>> updates, state = tx.update(grads, state)
      >>> updates["a"], updates["b"]
      (Array([0.6, 0.8], dtype=float32), Array([0.5], dtype=float32))
      >>> state.norms["a"]
      Array(5., dtype=float32)
    """
    del name  # means nothing in JAX
    _common.check_max_norm("max_norm", max_norm)
    axes = _common.normalize_axes(axes)
    normalize_axis_name(axis_name)
    if axis_name is not None and axes is not None:
        raise ValueError(
            "`axis_name` cannot be combined with `axes`; give `specs` instead."
        )

    def init_fn(params: optax.Params) -> ClipByNormState:
        flat = _common.check_norm_leaves(params, "clip_by_norm")
        for path, leaf in flat:
            _common.leaf_axes(axes, path, leaf.shape)
        norms = jax.tree.map(
            lambda x: jnp.zeros((), _common.accum_dtype(_common.as_array(x).dtype)),
            params,
        )
        return ClipByNormState(norms=norms)

    def update_fn(
        updates: optax.Updates,
        state: ClipByNormState,
        params: optax.Params | None = None,
    ) -> tuple[optax.Updates, ClipByNormState]:
        del params
        clipped, norms = _norm.clip_by_norm_with_norms(
            updates, max_norm, axes, axis_name, specs
        )
        return clipped, ClipByNormState(norms=norms)

    return optax.GradientTransformation(init_fn, update_fn)
