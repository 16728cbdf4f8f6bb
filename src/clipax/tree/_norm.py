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
    axis_name: _placement.AxisName = None,
    specs: Any = None,
) -> chex.ArrayTree:
    """Clips each leaf on its own to L2 norm `max_norm`, like `tf.clip_by_norm`.

    A leaf `x` with norm `n` becomes `x * max_norm / max(n, max_norm)`. With
    `axes`, the norm is taken over those axes only, and every slice along the
    other axes is clipped on its own (`axes=1` on a matrix clips each row).
    Each norm is a float32 sum of squares (float64 for float64 leaves), and
    the rules of `clipax.tree.clip_by_global_norm` hold for each leaf or slice
    (docs/semantics.md). It takes the call of `tf.clip_by_norm`.

    Args:
      tree: a pytree of float16, bfloat16, float32, float64 or complex arrays.
      max_norm: the largest norm allowed for each leaf or slice: a positive
        scalar, `inf`, or an array (docs/semantics.md, "Thresholds").
      axes: None (the whole leaf), an int, or a sequence of distinct ints
        (negative ones count from the end), for every leaf.
      name: TensorFlow's name for the operation: ignored.
      axis_name: inside `pmap` or `shard_map`, the mesh axes every leaf is
        split over; only with `axes=None`.
      specs: inside `shard_map`, the `in_specs` of `tree` (a prefix tree of
        PartitionSpecs): each norm is completed over the axes of its spec.

    Returns:
      The clipped tree, with the structure, shapes and dtypes of `tree`.

    Raises:
      ValueError: if `max_norm` or `axes` is not accepted, or `axes` is out of
        range for a leaf (naming its path and shape).
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
    axes, names = _checks.axes_and_axis_name(axes, axis_name)
    leaves = _checks.norm_leaves(tree, "clip_by_norm")
    reduced = _checks.each_leaf_axes(axes, leaves)
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
    norms: list[jax.Array], placements: _placement.Placements | None
) -> list[jax.Array]:
    """Each leaf's largest slice norm (a whole-leaf norm is its own), the same
    on every device."""
    peaks = [
        jnp.reshape(n, ()) if n.size == 1 else jnp.max(n, initial=0.0) for n in norms
    ]
    if placements is not None and peaks:  # slices may be on other devices
        everywhere = _placement.pmax_everywhere(
            jnp.stack(peaks), [_placement.split_axes(e) for e in placements]
        )
        peaks = [everywhere[i] for i in range(len(peaks))]
    return peaks
