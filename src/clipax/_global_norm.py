"""`clip_by_global_norm` as an Optax transformation that keeps the norm."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from clipax import _checks, _engine, _leaves, _states
from clipax.tree import _global_norm as tree_global_norm


@_states.declare("clip_by_global_norm", clip=("norm", "threshold"))
class ClipByGlobalNormState(NamedTuple):
    """State of `clip_by_global_norm`: the norm it saw last, for logging.

    `optax.tree.get(opt_state, "norm")` finds `norm` through optax's wrappers
    (docs/skipping-and-logging.md says what it holds inside each).
    """

    norm: jax.Array  # float32 scalar (float64 for float64 updates): pre-clip norm
    nonfinite_count: jax.Array  # int32 scalar: updates whose norm was NaN or inf
    threshold: jax.Array  # scalar, `norm`'s dtype: the last update's `max_norm`
    # (inf before any), so that `clipax.metrics` can tell whether it clipped


@_checks.peer_names(
    {"clip_norm": "max_norm", "norm_type": "ord", "error_if_nonfinite": "nonfinite"},
    "clipax.tree.clip_by_global_norm(tree, max_norm)",
)
def clip_by_global_norm(
    max_norm: ArrayLike,
    ord: float | str | None = None,
    nonfinite: str | bool = "nan",
    foreach: bool | None = None,
    *,
    axis_name: str | Sequence[str] | None = None,
    specs: Any = None,
) -> optax.GradientTransformation:
    """Scales the updates so that their global norm is at most `max_norm`.

    The drop-in for `optax.clip_by_global_norm`, `tf.clip_by_global_norm` and
    `torch.nn.utils.clip_grad_norm_`, with the rules of
    `clipax.tree.clip_by_global_norm` (docs/semantics.md). The pre-clip norm
    of the last update is kept in the state, for logging at no extra cost.
    It takes the arguments of `clip_grad_norm_` after the parameters, in
    PyTorch's order and names (docs/porting.md).

    Args:
      max_norm: the largest global norm allowed: a positive scalar, `inf`, or
        an array (as under `optax.inject_hyperparams`; docs/semantics.md).
      ord: the norm's order: None (default) or 2, 1, `inf`, or a real p >= 1;
        None, so that `optax.inject_hyperparams` leaves it static.
      nonfinite: `"nan"` (default), `"zero"` or `"error"`: what an update with
        a NaN or inf norm becomes (see `clipax.tree.clip_by_global_norm`).
      foreach: PyTorch's choice of kernels (and TensorFlow's `name`, by
        keyword): ignored.
      axis_name: inside `pmap` or `shard_map`, the mesh axes every leaf is
        split over (docs/scaling-out.md).
      specs: inside `shard_map`, the `in_specs` of the updates.

    Returns:
      An `optax.GradientTransformation` whose state is a
      `ClipByGlobalNormState`.

    Raises:
      ValueError: at construction, if an argument is not accepted.
      TypeError: if `ord` is traced, or a peer's argument is given wrongly; at
        `init` or `update`, if a leaf is not a float array.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import clipax
      >>> tx = optax.chain(clipax.clip_by_global_norm(1.0), optax.sgd(1.0))
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> updates, state = tx.update({"w": jnp.array([3.0, 4.0])}, state)
      >>> updates["w"], optax.tree.get(state, "norm")
      (Array([-0.6, -0.8], dtype=float32), Array(5., dtype=float32))

    References:
      Pascanu et al., `On the difficulty of training recurrent neural networks
      <https://arxiv.org/abs/1211.5063>`_, 2012.
    """
    del foreach  # means nothing in JAX
    max_norm = _checks.threshold("max_norm", max_norm)
    p = _checks.order(ord)
    checked = _leaves.reader("clip_by_global_norm", specs=specs, axis_name=axis_name)
    mode = _checks.nonfinite(nonfinite)

    def init_fn(params: optax.Params) -> ClipByGlobalNormState:
        leaves = _leaves.leaves(params, "clip_by_global_norm")
        dtype = _engine.tree_accum_dtype(leaves.arrays)
        return ClipByGlobalNormState(
            norm=jnp.zeros((), dtype),
            nonfinite_count=jnp.zeros((), jnp.int32),
            threshold=jnp.full((), jnp.inf, dtype),
        )

    def update_fn(
        updates: optax.Updates,
        state: ClipByGlobalNormState,
        params: optax.Params | None = None,
    ) -> tuple[optax.Updates, ClipByGlobalNormState]:
        del params
        leaves = checked(updates)
        clipped, norm, finite = tree_global_norm.clip_leaves(leaves, max_norm, p, mode)
        dtype = state.norm.dtype
        return clipped, ClipByGlobalNormState(
            norm=norm.astype(dtype),
            nonfinite_count=_engine.count_if(~finite, state.nonfinite_count),
            threshold=jnp.asarray(max_norm).astype(dtype),
        )

    return optax.GradientTransformation(init_fn, update_fn)
