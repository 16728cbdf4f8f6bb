"""Per-leaf (and per-slice) norm clipping of a pytree."""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from clipax import _common, _engine, _placement
from clipax._peers import peer_names

# Jitted, so that leaves of one shape and dtype share one trace.
_clip_factor = jax.jit(_common.scale_from_terms)


def _peak(norms: jax.Array) -> jax.Array:
    """The largest of a leaf's slice norms (a whole-leaf norm is its own)."""
    return jnp.reshape(norms, ()) if norms.size == 1 else jnp.max(norms, initial=0.0)


def clip_by_norm_with_norms(
    tree: chex.ArrayTree,
    max_norm: ArrayLike,
    axes: Any,
    axis_name: _placement.AxisName = None,
    specs: Any = None,
) -> tuple[chex.ArrayTree, chex.ArrayTree]:
    """`clip_by_norm`, also returning each leaf's largest pre-clip norm.

    The second tree has the structure of `tree`, with a scalar where `tree` has
    a leaf: the leaf's L2 norm, or with `axes` the largest norm of its slices.
    """
    _common.check_max_norm("max_norm", max_norm)
    axes = _common.normalize_axes(axes)
    if axis_name is not None and axes is not None:
        raise ValueError(
            "`axis_name` says that every leaf is split, but not along which "
            f"dimension, so it cannot be combined with `axes`={axes}; give `specs` "
            "instead."
        )
    flat = _common.check_norm_leaves(tree, "clip_by_norm")
    leaf_axes = [_common.leaf_axes(axes, path, x.shape) for path, x in flat]
    placements = _placement.leaf_placements(flat, specs, axis_name)
    leaves = [x for _, x in flat]
    norms = _engine.tensor_norms(leaves, leaf_axes, placements)
    terms: dict[Any, Any] = {}  # per accumulation dtype, once
    clipped = []
    for x, n in zip(leaves, norms, strict=True):
        if n.dtype not in terms:
            terms[n.dtype] = _common.threshold_terms(max_norm, n.dtype)
        clipped.append(_common.apply_scale(x, _clip_factor(n, terms[n.dtype])))
    peaks = [_peak(n) for n in norms]
    if placements is not None and peaks:  # slices of a leaf may be on other devices
        everywhere = _placement.pmax_everywhere(
            jnp.stack(peaks), [_placement.split_axes(e) for e in placements]
        )
        peaks = [everywhere[i] for i in range(len(peaks))]
    treedef = jax.tree.structure(tree)
    return jax.tree.unflatten(treedef, clipped), jax.tree.unflatten(treedef, peaks)


@peer_names({"t": "tree", "clip_norm": "max_norm"}, ignored=["name"])
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
    The rules of `clipax.tree.clip_by_global_norm` hold for each leaf or slice:
    no epsilon, unchanged at or below the threshold and at norm 0, all NaN when
    its norm is NaN or inf, float32 accumulation, dtypes kept. Each norm is
    one float32 sum of squares (float64 for float64 leaves), the bare
    formula's: a leaf or slice whose squares overflow float32 (entries above
    about 1.8e19) has an inf norm and comes out NaN, alone, and a norm below
    about 1e-19 may read smaller, down to 0 (docs/semantics.md). It takes the
    call of `tf.clip_by_norm`, under its TensorFlow names too.

    Args:
      tree: a pytree of float16, bfloat16, float32, float64 or complex arrays; None
        and `optax.MaskedNode` leaves are empty and come back in place
        (TensorFlow's `t`).
      max_norm: the largest norm allowed for each leaf or slice: a positive
        scalar, `inf`, or a traced value (TensorFlow's `clip_norm`).
      axes: None (the whole leaf), an int, or a sequence of distinct ints
        (negative ones count from the end), applied to every leaf.
      name: TensorFlow's name for the operation: accepted and ignored.
      axis_name: inside `pmap` or `shard_map`, the mesh axes every leaf is split
        over; only with `axes=None`.
      specs: inside `shard_map`, the `in_specs` of `tree` (a prefix tree of
        PartitionSpecs): a norm is completed across devices over exactly the
        mesh axes that shard its reduced dimensions.

    Returns:
      The clipped tree, with the structure, shapes and dtypes of `tree`.

    Raises:
      ValueError: if `max_norm` or `axes` is not accepted, or `axes` is out of
        range for a leaf (the message names the leaf's path and shape).
      TypeError: if a leaf is not a float16, bfloat16, float32, float64 or complex
        array; if an argument is given under two of its names (clipax's and a peer's);
        if `name` is not None, a bool or a string.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> x = jnp.array([[-3.0, 0.0, 0.0], [4.0, 0.0, 3.0]])
      >>> clipax.tree.clip_by_norm({"w": x}, 4.0, axes=1)["w"]
      Array([[-3. ,  0. ,  0. ],
             [ 3.2,  0. ,  2.4]], dtype=float32)
    """
    del name  # means nothing in JAX
    return clip_by_norm_with_norms(tree, max_norm, axes, axis_name, specs)[0]
