"""Per-leaf (and per-slice) norm clipping of a pytree."""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from clipax import _checks, _engine, _placement

# Jitted, so that leaves of one shape and dtype share one trace.
_clip_factor = jax.jit(_engine.clip_factor)


@_checks.peer_names(
    "clipax.tree.clip_by_norm", {"t": "tree", "clip_norm": "max_norm"}, ["name"]
)
def clip_by_norm(
    tree: chex.ArrayTree,
    max_norm: ArrayLike,
    axes: Any = None,
    name: str | None = None,
    *,
    stacked: Any = None,
    axis_name: _placement.AxisName = None,
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
    _checks.threshold("max_norm", max_norm)
    axes, names = _checks.axes_and_axis_name(axes, axis_name, stacked)
    leaves = _checks.norm_leaves(tree, "clip_by_norm", stacked)
    reduced = _checks.each_inner_axes(axes, leaves)
    placements = _placement.leaf_placements(leaves, specs, names)
    return clip_leaves(leaves, max_norm, reduced, placements)[0]


def clip_leaves(
    leaves: _checks.Leaves,
    max_norm: ArrayLike,
    reduced: list[tuple[int, ...]],
    placements: _placement.Placements | None,
) -> tuple[chex.ArrayTree, list[jax.Array]]:
    """`clip_by_norm` of checked `leaves`, each normed over its `reduced` axes,
    also returning each leaf's norms (with the reduced dims kept)."""
    norms = _engine.tensor_norms(leaves.arrays, reduced, placements)
    thresholds: dict[Any, _engine.Threshold] = {}  # once per accumulation dtype
    clipped = []
    for x, n in zip(leaves.arrays, norms, strict=True):
        if n.dtype not in thresholds:
            thresholds[n.dtype] = _engine.threshold(max_norm, n.dtype)
        clipped.append(_engine.scaled(x, _clip_factor(n, thresholds[n.dtype])))
    return leaves.rebuild(clipped), norms


def peak_norms(
    norms: list[jax.Array],
    leaves: _checks.Leaves,
    placements: _placement.Placements | None,
) -> list[jax.Array]:
    """Each tensor's largest slice norm (a whole tensor's norm is its own):
    one per layer of a stacked leaf, the same on every device that holds it."""
    peaks = []
    for i, n in enumerate(norms):
        layers = leaves.layers(i)
        inner = tuple(range(len(layers), n.ndim))
        peaks.append(jnp.max(n, axis=inner, initial=0.0) if inner else n)
    if placements is None or not peaks:
        return peaks
    # One pmax over the axes that split the slices, per set of axes that
    # split the layers (whose peaks are of other layers on other devices).
    layer_axes = _placement.layer_axes(leaves, placements)
    split: dict[_placement.MeshAxes, set[str]] = {}
    for axes, dims in zip(layer_axes, placements, strict=True):
        split.setdefault(axes, set()).update(_placement.split_axes(dims))
    names = [
        tuple(a for a in sorted(split[axes]) if a not in axes) for axes in layer_axes
    ]
    return _placement.psum_each(peaks, names, layer_axes, op=jax.lax.pmax)
