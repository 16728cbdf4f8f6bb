"""The global norm of a pytree, and clipping a pytree by it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from clipax import _checks, _engine, _leaves, _nonfinite
from clipax._leaves import Leaves


@_checks.peer_names(
    {"t_list": "tree", "tensors": "tree", "norm_type": "ord"}
    | {"error_if_nonfinite": "nonfinite"}
)
def global_norm(
    tree: chex.ArrayTree,
    ord: float | str | None = 2,
    squared: bool = False,
    *,
    nonfinite: str | bool | None = None,
    axis_name: str | Sequence[str] | None = None,
    specs: Any = None,
) -> jax.Array:
    """Returns the norm of all leaves of `tree` taken together.

    Powers are summed in float32 (float64 when a leaf is float64), and the
    norm is exact for every finite input, also where squares overflow or
    underflow float32. None and `optax.MaskedNode` leaves are empty; a tree
    with no leaves has norm 0 for every `ord`. It takes the call of
    `optax.tree.norm`, `tf.linalg.global_norm` and
    `torch.nn.utils.get_total_norm` (docs/porting.md).

    Args:
      tree: a pytree of float16, bfloat16, float32, float64 or complex arrays.
      ord: 2 (default; also None), 1, `inf` (also `"inf"`), or a real p >= 1.
      squared: return the norm squared, as optax's `squared`.
      nonfinite: None (default) returns a NaN or inf norm as it is; `"error"`
        raises `clipax.NonFiniteError` naming the first non-finite leaf.
      axis_name: inside `pmap` or `shard_map`, the mesh axes every leaf is
        split over (docs/scaling-out.md).
      specs: inside `shard_map`, the `in_specs` of `tree` (a prefix tree of
        PartitionSpecs): each leaf's sum is completed over its spec's axes.

    Returns:
      A float32 scalar, or float64 when a leaf is float64.

    Raises:
      ValueError: if `ord`, `nonfinite`, `axis_name` or `specs` is not
        accepted (a leaf without a PartitionSpec is named by its path).
      TypeError: if a leaf is not a float array (named by its path), `squared`
        is not a bool, or a peer's argument is given wrongly.
      clipax.NonFiniteError: with `nonfinite="error"`, for a NaN or inf norm.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> grads = {"w": jnp.array([3.0, 0.0]), "b": jnp.array([4.0]), "x": None}
      >>> clipax.tree.global_norm(grads)
      Array(5., dtype=float32)
      >>> clipax.tree.global_norm(grads, ord=jnp.inf)
      Array(4., dtype=float32)
    """
    p = _checks.order(ord)
    squared = _checks.flag("squared", squared)
    mode = _checks.nonfinite(nonfinite, (None, "error"))
    leaves = _leaves.reader("global_norm", specs=specs, axis_name=axis_name)(tree)
    norm = _engine.global_norm(leaves, p)
    if mode == "error":
        _nonfinite.raise_if_nonfinite(leaves, jnp.isfinite(norm), "global_norm")
    return jnp.square(norm) if squared else norm


@_checks.peer_names(
    {"t_list": "tree", "parameters": "tree", "clip_norm": "max_norm"}
    | {"total_norm": "use_norm"}
)
def clip_by_global_norm(
    tree: chex.ArrayTree,
    max_norm: ArrayLike,
    use_norm: ArrayLike | None = None,
    name: str | None = None,
    *,
    ord: float | str = 2,
    axis_name: str | Sequence[str] | None = None,
    specs: Any = None,
    nonfinite: str | bool = "nan",
) -> tuple[chex.ArrayTree, jax.Array]:
    """Scales all leaves by one factor so that their global norm is <= `max_norm`.

    Every leaf is multiplied by `max_norm / max(norm, max_norm)`, TensorFlow's
    formula with no epsilon: a tree at or below `max_norm`, or zero, comes back
    unchanged. When the norm is NaN or inf every output is NaN by default
    (`nonfinite` chooses otherwise). The factor is applied in float32 (float64
    for float64 leaves) and each leaf is cast back to its dtype. It takes the
    call of `tf.clip_by_global_norm` and `torch.nn.utils.clip_grads_with_norm_`
    (docs/porting.md); the rules are on docs/semantics.md.

    Args:
      tree: a pytree of float16, bfloat16, float32, float64 or complex arrays.
      max_norm: the largest global norm allowed: a positive scalar, `inf` (no
        clipping), or an array (docs/semantics.md, "Thresholds").
      use_norm: a norm to use instead of computing one; it is also returned.
      name: TensorFlow's name (or PyTorch's `foreach`): ignored.
      ord: the norm's order: 2 (default), 1, `inf`, or a real p >= 1.
      axis_name: as for `clipax.tree.global_norm`.
      specs: as for `clipax.tree.global_norm`.
      nonfinite: what a NaN or inf norm gives: `"nan"` (default) every output
        NaN, `"zero"` every output zero, `"error"` a `clipax.NonFiniteError`
        naming the first such leaf (under `jax.jit`, wrap the step in
        `clipax.nonfinite_errors`). True and False are `"error"` and `"nan"`.

    Returns:
      `(clipped_tree, norm)`, `norm` being the pre-clip global norm.

    Raises:
      ValueError: if `max_norm`, `use_norm`, `ord`, `axis_name`, `specs` or
        `nonfinite` is not accepted.
      TypeError: if a leaf is not a float array, or a peer's argument is given
        wrongly.
      clipax.NonFiniteError: with `nonfinite="error"`, for a NaN or inf norm.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> grads = {"w": jnp.array([3.0, 0.0]), "b": jnp.array([4.0])}
      >>> clipped, norm = clipax.tree.clip_by_global_norm(grads, 1.0)
      >>> norm
      Array(5., dtype=float32)
      >>> clipped["w"], clipped["b"]
      (Array([0.6, 0. ], dtype=float32), Array([0.8], dtype=float32))
    """
    del name  # means nothing in JAX
    max_norm = _checks.threshold("max_norm", max_norm)
    if use_norm is not None:
        use_norm = _checks.nonnegative(
            "use_norm", use_norm, "None or a scalar norm >= 0"
        )
    mode = _checks.nonfinite(nonfinite)
    p = _checks.order(ord)
    leaves = _leaves.reader("clip_by_global_norm", specs=specs, axis_name=axis_name)(
        tree
    )
    return clip_leaves(leaves, max_norm, p, mode, use_norm)[:2]


def clip_leaves(
    leaves: Leaves,
    max_norm: ArrayLike,
    p: float,
    mode: str,
    use_norm: ArrayLike | None = None,
) -> tuple[chex.ArrayTree, jax.Array, jax.Array]:
    """`clip_by_global_norm` of checked `leaves`, also returning whether the
    norm was finite."""
    if use_norm is None:
        norm = _engine.global_norm(leaves, p)
    else:
        dtype = _engine.tree_accum_dtype(leaves.arrays)
        norm = jnp.asarray(use_norm).astype(dtype)
    finite = jnp.isfinite(norm)
    factor = _engine.clip_factor(norm, max_norm)
    if mode == "error":
        _nonfinite.raise_if_nonfinite(leaves, finite, "clip_by_global_norm")
    clipped = [_engine.scaled(x, factor) for x in leaves.arrays]
    if mode == "zero":
        clipped = [jnp.where(finite, x, jnp.zeros_like(x)) for x in clipped]
    return leaves.rebuild(clipped), norm, finite
