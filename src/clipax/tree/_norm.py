"""Per-leaf (and per-slice) norm clipping of a pytree."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from clipax import _checks, _engine, _leaves
from clipax._leaves import Leaves

# Jitted, so that leaves of one shape and dtype share one trace.
_clip_factor = jax.jit(_engine.clip_factor)


@_checks.peer_names({"t": "tree", "clip_norm": "max_norm"})
def clip_by_norm(
    tree: chex.ArrayTree,
    max_norm: ArrayLike,
    axes: Any = None,
    name: str | None = None,
    *,
    stacked: Any = None,
    axis_name: str | Sequence[str] | None = None,
    specs: Any = None,
) -> chex.ArrayTree:
    """Clips each leaf on its own to L2 norm `max_norm`, like `tf.clip_by_norm`.

    A leaf `x` with norm `n` becomes `x * max_norm / max(n, max_norm)`. With
    `axes`, the norm is taken over those axes only, and every slice along the
    other axes is clipped on its own (`axes=1` on a matrix clips each row).
    Each norm is a float32 sum of squares (float64 for float64 leaves), and
    the rules of `clipax.tree.clip_by_global_norm` hold for each leaf or slice
    (docs/semantics.md). With `stacked`, each layer of a stacked leaf is a
    tensor of its own (docs/stacked-layers.md). It takes the call of
    `tf.clip_by_norm`.

    Args:
      tree: a pytree of float16, bfloat16, float32, float64 or complex arrays.
      max_norm: the largest norm allowed for each leaf or slice: a positive
        scalar, `inf`, or an array (docs/semantics.md, "Thresholds").
      axes: None (the whole leaf), an int, or a sequence of distinct ints
        (negative ones count from the end), for every leaf; within one layer
        of a stacked leaf.
      name: TensorFlow's name for the operation: ignored.
      stacked: None, or a prefix of `tree` holding, per subtree, how many
        leading axes of its leaves index stacked layers (1 for `nn.scan`), or
        a callable that takes `tree` and returns one.
      axis_name: inside `pmap` or `shard_map`, the mesh axes every leaf is
        split over; only with `axes=None`.
      specs: inside `shard_map`, the `in_specs` of `tree` (a prefix tree of
        PartitionSpecs): each norm is completed over the axes of its spec.

    Returns:
      The clipped tree, with the structure, shapes and dtypes of `tree`.

    Raises:
      ValueError: if `max_norm`, `axes` or `stacked` is not accepted, or out
        of range for a leaf (naming its path and shape).
      TypeError: if a leaf is not a float array, or a peer's argument is given
        wrongly.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> x = jnp.array([[-3.0, 0.0, 0.0], [4.0, 0.0, 3.0]])
      >>> clipax.tree.clip_by_norm({"w": x}, 4.0, axes=1)["w"]
      Array([[-3. ,  0. ,  0. ],
             [ 3.2,  0. ,  2.4]], dtype=float32)
    """
    del name  # means nothing in JAX
    max_norm = _checks.threshold("max_norm", max_norm)
    axes, _ = _checks.axes_and_axis_name(axes, axis_name, stacked)
    leaves = _leaves.reader(
        "clip_by_norm", stacked=stacked, specs=specs, axis_name=axis_name
    )(tree)
    return clip_leaves(leaves, max_norm, axes)[0]


def clip_leaves(
    leaves: Leaves, max_norm: ArrayLike, axes: tuple[int, ...] | None
) -> tuple[chex.ArrayTree, list[jax.Array]]:
    """`clip_by_norm` of checked `leaves`, each normed over `axes` within one
    layer, also returning each leaf's largest norm per layer (a whole
    tensor's norm is its own), the same on every device that holds it."""
    norms = _engine.norms(leaves, [leaf.within(axes) for leaf in leaves])
    limit = functools.cache(lambda dtype: _engine.limit(max_norm, dtype))  # per dtype
    clipped, peaks = [], []
    for leaf, n in zip(leaves, norms, strict=True):
        clipped.append(_engine.scaled(leaf.x, _clip_factor(n, limit(n.dtype))))
        slices = leaf.inner if n.ndim else ()  # a scalar: every axis reduced
        peak = jnp.max(n, axis=slices, initial=0.0) if axes is not None else n
        peaks.append(peak.reshape(leaf.layers))
    if axes is not None:
        # Slices of one layer may sit on other devices: a pmax over the axes
        # that split the slices, apart from those that split the layers.
        # One collective per set of layer axes (pmax is idempotent).
        layer_axes = [leaf.split(leaf.layer_axes) for leaf in leaves]
        union: dict[_leaves.MeshAxes, set[str]] = {}
        for leaf, split in zip(leaves, layer_axes, strict=True):
            union.setdefault(split, set()).update(leaf.split())
        slice_axes = [tuple(sorted(union[s].difference(s))) for s in layer_axes]
        peaks = _engine.complete(peaks, slice_axes, layer_axes, op=jax.lax.pmax)
    return leaves.rebuild(clipped), peaks
