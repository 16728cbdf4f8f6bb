"""`clip_by_global_norm` as an Optax transformation that keeps the norm."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from clipax import _common, _states
from clipax._peers import peer_names
from clipax._placement import AxisName, normalize_axis_name
from clipax.tree import _global_norm


@_states.register("clip_by_global_norm")
class ClipByGlobalNormState(NamedTuple):
    """State of `clip_by_global_norm`: the norm it saw last, for logging.

    `norm` is the pre-clip global norm of the last update this transformation
    saw. Inside `optax.MultiSteps` that is the norm of the accumulated mean
    gradient at each k-th micro-step (between them, the last value); inside
    `optax.masked`, of the masked-in leaves; inside `optax.apply_if_finite`, of
    the last finite step. `optax.tree.get(opt_state, "norm")` finds it through
    these wrappers and `optax.inject_hyperparams`; with one clip per group
    (`optax.partition`), `optax.tree.get_all_with_path(opt_state, "norm")`
    lists each group's.
    """

    norm: jax.Array  # float32 scalar (float64 for float64 updates): pre-clip norm
    nonfinite_count: jax.Array  # int32 scalar: updates whose norm was NaN or inf
    threshold: jax.Array  # scalar, `norm`'s dtype: the `max_norm` of the last
    # update (inf before any), so `clipax.metrics` can tell whether it clipped


@peer_names(
    {"clip_norm": "max_norm", "norm_type": "ord", "error_if_nonfinite": "nonfinite"},
    ignored=["foreach", "name"],
)
def clip_by_global_norm(
    max_norm: ArrayLike,
    ord: float | str | None = None,
    nonfinite: str | bool = "nan",
    foreach: bool | None = None,
    *,
    axis_name: AxisName = None,
    specs: Any = None,
) -> optax.GradientTransformation:
    """Scales the updates so that their global norm is at most `max_norm`.

    The drop-in for `optax.clip_by_global_norm`, `tf.clip_by_global_norm` and
    `torch.nn.utils.clip_grad_norm_`, with the rules of
    `clipax.tree.clip_by_global_norm`: TensorFlow's formula with no epsilon,
    float32 accumulation, exact norms for every finite input, every output NaN
    when the norm is NaN or inf (or zeros, or an error: `nonfinite`; or wrap the
    chain in `optax.apply_if_finite` to skip such steps). The pre-clip norm of
    the last update is kept in the state's `norm` field, so a training loop can
    log it with `optax.tree.get(opt_state, "norm")` at no extra cost; the state
    also counts the updates whose norm was not finite.

    It takes the call of `optax.clip_by_global_norm`, and the arguments of
    `torch.nn.utils.clip_grad_norm_` after the parameters, in PyTorch's order
    and under PyTorch's names too: `clip_by_global_norm(1.0, 2.0, True)` is
    `clip_grad_norm_(params, 1.0, 2.0, True)`. TensorFlow's `clip_norm` and
    `name` are accepted by keyword; its `use_norm` belongs to
    `clipax.tree.clip_by_global_norm`.

    Args:
      max_norm: the largest global norm allowed: a positive scalar of any
        dtype, `inf`, or a traced value (as under `optax.inject_hyperparams`).
        TensorFlow's `clip_norm`.
      ord: the norm's order: None (the default) or 2 for L2, 1, `inf` (also
        the strings `"inf"` and `"infinity"`), or any real p >= 1 (PyTorch's
        `norm_type`). The default is None rather than 2 so that
        `optax.inject_hyperparams` leaves it static; to pass an `ord` through
        `inject_hyperparams`, name it in `static_args`.
      nonfinite: `"nan"` (default), `"zero"` or `"error"`: what an update with
        a NaN or inf norm becomes (see `clipax.tree.clip_by_global_norm`).
        PyTorch's `error_if_nonfinite`: True is `"error"`, False `"nan"`.
      foreach: PyTorch's choice of kernels: accepted and ignored (XLA fuses
        the per-leaf work under `jax.jit`). TensorFlow's `name` is also
        accepted, by keyword, and ignored.
      axis_name: inside `pmap` or `shard_map`, the mesh axes every update leaf
        is split over (see `clipax.tree.global_norm`).
      specs: inside `shard_map`, the `in_specs` of the updates: a prefix tree
        of PartitionSpecs (see `clipax.tree.global_norm`).

    Returns:
      An `optax.GradientTransformation` whose state is a
      `ClipByGlobalNormState`.

    Raises:
      ValueError: at construction, if `max_norm`, `ord`, `axis_name` or
        `nonfinite` is not accepted.
      TypeError: if `ord` is traced, an argument is given under two of its names
        (clipax's and a peer's), or `foreach` or `name` is not None, a bool or a string.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import clipax
      >>> params = {"w": jnp.zeros(2)}
      >>> tx = optax.chain(clipax.clip_by_global_norm(1.0), optax.sgd(1.0))
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.array([3.0, 4.0])}, state)
      >>> updates["w"]
      Array([-0.6, -0.8], dtype=float32)
      >>> optax.tree.get(state, "norm")
      Array(5., dtype=float32)

    References:
      Pascanu et al., `On the difficulty of training recurrent neural networks
      <https://arxiv.org/abs/1211.5063>`_, 2012.
    """
    del foreach  # means nothing in JAX
    _common.check_max_norm("max_norm", max_norm)
    p = _common.check_ord(ord)
    normalize_axis_name(axis_name)
    nonfinite = _global_norm.check_nonfinite(nonfinite)

    def init_fn(params: optax.Params) -> ClipByGlobalNormState:
        flat = _common.check_norm_leaves(params, "clip_by_global_norm")
        dtype = _common.tree_accum_dtype([leaf for _, leaf in flat])
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
        clipped, norm, finite = _global_norm.clip_with_norm(
            updates, max_norm, None, p, axis_name, specs, nonfinite
        )
        count = state.nonfinite_count + jnp.where(finite, 0, 1).astype(jnp.int32)
        dtype = state.norm.dtype
        new_state = ClipByGlobalNormState(
            norm=norm.astype(dtype),
            nonfinite_count=count,
            threshold=jnp.asarray(max_norm).astype(dtype),
        )
        return clipped, new_state

    return optax.GradientTransformation(init_fn, update_fn)
