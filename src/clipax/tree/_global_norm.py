"""The global norm of a pytree, and clipping a pytree by it."""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from clipax import _common, _engine, _nonfinite, _placement
from clipax._peers import peer_names

NONFINITE_MODES = ("nan", "zero", "error")
NORM_NONFINITE_MODES = (None, "error")  # `global_norm`'s


def check_nonfinite(nonfinite: Any, modes: tuple[Any, ...] = NONFINITE_MODES) -> Any:
    """Returns the mode `nonfinite` names, one of `modes`.

    True and False, PyTorch's `error_if_nonfinite`, are `"error"` and the
    default (`modes[0]`).

    Raises:
      ValueError: if `nonfinite` is not one of `modes` or a bool, or is
        `"error"` and JAX has no CPU backend for the check.
    """
    if nonfinite is True or nonfinite is False:
        nonfinite = "error" if nonfinite else modes[0]
    valid = nonfinite is None or isinstance(nonfinite, str)
    if not valid or nonfinite not in modes:
        raise ValueError(
            f"`nonfinite` must be one of {modes}, or a bool as PyTorch's "
            f"`error_if_nonfinite` (True is 'error', False {modes[0]!r}); got "
            f"{_common.short_repr(nonfinite)}."
        )
    if nonfinite == "error":
        _nonfinite.check_host_callback()
    return nonfinite


def _norm_of(
    tree: chex.ArrayTree, fn_name: str, p: float, axis_name: Any, specs: Any
) -> tuple[list[tuple[Any, Any]], jax.Array]:
    flat = _common.check_norm_leaves(tree, fn_name)
    placements = _placement.leaf_placements(flat, specs, axis_name)
    return flat, _engine.global_norm([leaf for _, leaf in flat], p, placements)


def _nonfinite_error(
    fn_name: str, paths: list[str], finite: Any
) -> _nonfinite.NonFiniteError:
    """`nonfinite="error"`: the error naming the first non-finite leaf."""
    for path, ok in zip(paths, finite, strict=True):
        if not ok:
            return _nonfinite.NonFiniteError(
                f"{fn_name}: the leaf at {path} holds NaN or inf {_nonfinite.MARKER}."
            )
    return _nonfinite.NonFiniteError(
        f"{fn_name}: the global norm is not finite although every leaf "
        f"is: it exceeds the largest float32 {_nonfinite.MARKER}."
    )


def _host_bool(x: jax.Array) -> bool:
    """A replicated scalar's value, also when other processes hold it too."""
    return bool(np.asarray(x.addressable_data(0)))


def _raise_if_nonfinite(
    flat: list[tuple[Any, Any]], finite: jax.Array, fn_name: str = "clip_by_global_norm"
) -> None:
    """Raises `NonFiniteError` now (eagerly) or from a host callback (traced)."""
    paths = [_common.path_str(path) for path, _ in flat] or ["<none>"]
    if not _common.is_traced(finite):  # eagerly: raise here, no callback
        if not _host_bool(finite):
            flags = [_host_bool(jnp.all(jnp.isfinite(x))) for _, x in flat] or [False]
            raise _nonfinite_error(fn_name, paths, flags)
        return
    leaf_finite = jnp.stack(
        [jnp.all(jnp.isfinite(leaf)) for _, leaf in flat] or [finite]
    )

    def check(ok: jax.Array, flags: jax.Array) -> None:
        if not ok:  # raised to JAX, or kept for a waiting `nonfinite_errors`
            _nonfinite.raise_or_record(_nonfinite_error(fn_name, paths, flags))

    # partitioned: every device runs the check on its copy of these replicated
    # flags, so that every process of a multi-process job raises, not only the
    # one that holds device 0.
    jax.debug.callback(check, finite, leaf_finite, partitioned=True)


@peer_names(
    {
        "t_list": "tree",
        "tensors": "tree",
        "norm_type": "ord",
        "error_if_nonfinite": "nonfinite",
    },
    ignored=["name", "foreach"],
)
def global_norm(
    tree: chex.ArrayTree,
    ord: float | str | None = 2,
    squared: bool = False,
    *,
    nonfinite: str | bool | None = None,
    axis_name: _placement.AxisName = None,
    specs: Any = None,
) -> jax.Array:
    """Returns the norm of all leaves of `tree` taken together.

    The leaves are treated as one long vector. Squares (or |x|**p) are summed in
    float32, or float64 when a leaf is float64, so float16 and bfloat16 trees do
    not overflow where their own dtype would. None and `optax.MaskedNode` leaves
    are empty; a tree with no leaves has norm 0 for every `ord`. Complex leaves
    contribute |x|. The norm is exact (within float32 rounding) for every finite
    input, also where squares overflow or underflow float32: such sums are
    redone with every element scaled by one power of two.

    Inside `shard_map` or `pmap`, leaves are local blocks: pass `specs` or
    `axis_name` and the result is the norm of the whole sharded tree, the same
    on every device. Under `jax.jit` over sharded arrays (GSPMD), pass neither:
    the norm is already global.

    It takes the call of `optax.tree.norm`, `tf.linalg.global_norm` and
    `torch.nn.utils.get_total_norm`, under their names too. The third
    position is optax's `squared`: pass PyTorch's `error_if_nonfinite` by
    keyword. TensorFlow's `name` is accepted by keyword only (the second
    position is `ord`, as in optax and PyTorch).

    Args:
      tree: a pytree of float16, bfloat16, float32, float64 or complex arrays
        (TensorFlow's `t_list`, PyTorch's `tensors`).
      ord: 2 (default, also for None), 1, `inf` (the largest absolute value;
        also the strings `"inf"` and `"infinity"`), or any real p >= 1
        (PyTorch's `norm_type`).
      squared: whether to return the norm squared (for `ord=2`, the sum of
        squares), as optax's `squared`.
      nonfinite: None (default) returns a NaN or inf norm as it is; `"error"`
        raises `clipax.NonFiniteError` naming the first leaf that holds NaN or
        inf, as `clipax.tree.clip_by_global_norm(..., nonfinite="error")` does
        (under `jax.jit`, through a host callback). PyTorch's
        `error_if_nonfinite` is accepted for it (True is `"error"`).
      axis_name: a mesh-axis name, or a sequence of them, over which every leaf
        is split (as per-device shards under `pmap`).
      specs: the tree of `jax.sharding.PartitionSpec` given to `shard_map` as
        `in_specs` for `tree` (a prefix of it); each leaf's partial sum is
        combined over exactly the mesh axes its spec names, so a replicated
        leaf counts once. Leaves that share those axes share one collective.

    Returns:
      A float32 scalar, or float64 when a leaf is float64.

    Raises:
      ValueError: if `ord`, `nonfinite`, `axis_name` or `specs` is not accepted;
        a leaf without a PartitionSpec is named by its path.
      TypeError: if a leaf is not a float16, bfloat16, float32, float64 or complex array
        (the message names its path); if `squared` is not a bool; if an argument is
        given under two of its names (clipax's and a peer's); if `name` or `foreach` is
        not None, a bool or a string.
      clipax.NonFiniteError: with `nonfinite="error"`, for a NaN or inf norm
        (see `clipax.tree.clip_by_global_norm`).

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> grads = {"w": jnp.array([3.0, 0.0]), "b": jnp.array([4.0]), "x": None}
      >>> clipax.tree.global_norm(grads)
      Array(5., dtype=float32)
      >>> clipax.tree.global_norm(grads, ord=jnp.inf)
      Array(4., dtype=float32)
      >>> clipax.tree.global_norm(grads, 2, True)  # squared, as in optax
      Array(25., dtype=float32)
    """
    p = _common.check_ord(ord)
    if not isinstance(squared, (bool, np.bool_)):
        raise TypeError(f"`squared` must be True or False; got {squared!r}.")
    nonfinite = check_nonfinite(nonfinite, NORM_NONFINITE_MODES)
    flat, norm = _norm_of(tree, "global_norm", p, axis_name, specs)
    if nonfinite == "error":
        _raise_if_nonfinite(flat, jnp.isfinite(norm), "global_norm")
    return jnp.square(norm) if squared else norm


@peer_names(
    {
        "t_list": "tree",
        "parameters": "tree",
        "clip_norm": "max_norm",
        "total_norm": "use_norm",
    },
    ignored=["name", "foreach"],
)
def clip_by_global_norm(
    tree: chex.ArrayTree,
    max_norm: ArrayLike,
    use_norm: ArrayLike | None = None,
    name: str | None = None,
    *,
    ord: float | str = 2,
    axis_name: _placement.AxisName = None,
    specs: Any = None,
    nonfinite: str | bool = "nan",
) -> tuple[chex.ArrayTree, jax.Array]:
    """Scales all leaves by one factor so that their global norm is <= `max_norm`.

    Every leaf is multiplied by `max_norm / max(norm, max_norm)`, TensorFlow's
    formula with no epsilon: a tree whose norm is at most `max_norm` comes back
    unchanged, a zero tree too. When the norm is NaN or inf, every output leaf
    is NaN by default, as in TensorFlow: a broken step is never turned silently
    into a small or partial update (`nonfinite` chooses otherwise). The factor
    is applied in float32 (float64 for float64 leaves) and each leaf is cast
    back to its dtype. The gradient of any loss of the result is finite
    everywhere, also at a zero tree.

    It takes the call of `tf.clip_by_global_norm` and of
    `torch.nn.utils.clip_grads_with_norm_`, under their names too (whose
    fourth positions, TensorFlow's `name` and PyTorch's `foreach`, are both
    ignored).

    Args:
      tree: a pytree of float16, bfloat16, float32, float64 or complex arrays; None
        and `optax.MaskedNode` leaves are empty and come back in place
        (TensorFlow's `t_list`, PyTorch's `parameters`).
      max_norm: the largest global norm allowed: a positive scalar of any dtype,
        `inf` for no clipping, or a traced value (not checked; a traced value <= 0
        maps every nonzero tree to zeros). TensorFlow's `clip_norm`.
      use_norm: a norm to use instead of computing one, as in
        `tf.clip_by_global_norm`; it is also the norm returned (PyTorch's
        `total_norm`).
      name: TensorFlow's name for the operation (or PyTorch's `foreach`):
        accepted and ignored.
      ord: the norm's order: 2 (default), 1, `inf`, or any real p >= 1.
      axis_name: as for `global_norm`: the mesh axes every leaf is split over.
      specs: as for `global_norm`: the `shard_map` in_specs of `tree`.
      nonfinite: what a NaN or inf norm gives: `"nan"` (default) every output
        NaN; `"zero"` every output zero (the rest of a chain sees a zero
        gradient, so momentum still decays; to leave the optimizer state as it
        was, wrap the chain in `optax.apply_if_finite`); `"error"` the program
        stops with `clipax.NonFiniteError` (a `FloatingPointError`) naming the
        first leaf, by path, that holds NaN or inf. Under `jax.jit` the check
        runs through `jax.debug.callback` on every device (the one place where
        clipax calls back to the host, and only when asked to): wrap the
        jitted step in `clipax.nonfinite_errors` to receive the
        `NonFiniteError`; without the wrapper, JAX stops the program with a
        `jax.errors.JaxRuntimeError`. It needs JAX's CPU backend for the
        callback; without one, `"error"` is a `ValueError` when given. True
        and False (PyTorch's `error_if_nonfinite`) are `"error"` and `"nan"`.

    Returns:
      `(clipped_tree, norm)`, `norm` being the pre-clip global norm (float32, or
      float64 when a leaf is float64).

    Raises:
      ValueError: if `max_norm`, `use_norm`, `ord`, `axis_name`, `specs` or
        `nonfinite` is not accepted.
      TypeError: if a leaf is not a float16, bfloat16, float32, float64 or complex
        array; if an argument is given under two of its names (clipax's and a peer's);
        if `name` or `foreach` is not None, a bool or a string.
      clipax.NonFiniteError: (a `FloatingPointError`) with `nonfinite="error"`,
        for a NaN or inf norm, when called eagerly, or under `jax.jit` out of
        `clipax.nonfinite_errors`; without that wrapper, JAX raises a
        `jax.errors.JaxRuntimeError` whose message ends with this error's.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> grads = {"w": jnp.array([3.0, 0.0]), "b": jnp.array([4.0])}
      >>> clipped, norm = clipax.tree.clip_by_global_norm(grads, 1.0)
      >>> norm
      Array(5., dtype=float32)
      >>> clipped["w"], clipped["b"]
      (Array([0.6, 0. ], dtype=float32), Array([0.8], dtype=float32))

    References:
      Pascanu et al., `On the difficulty of training recurrent neural networks
      <https://arxiv.org/abs/1211.5063>`_, 2012.
    """
    del name  # means nothing in JAX
    return clip_with_norm(tree, max_norm, use_norm, ord, axis_name, specs, nonfinite)[
        :2
    ]


def clip_with_norm(
    tree: chex.ArrayTree,
    max_norm: ArrayLike,
    use_norm: ArrayLike | None,
    ord: Any,
    axis_name: _placement.AxisName,
    specs: Any,
    nonfinite: str | bool,
) -> tuple[chex.ArrayTree, jax.Array, jax.Array]:
    """`clip_by_global_norm`, also returning whether the norm was finite."""
    tree = _common.as_arrays(tree)
    _common.check_max_norm("max_norm", max_norm)
    _common.check_use_norm(use_norm)
    nonfinite = check_nonfinite(nonfinite)
    p = _common.check_ord(ord)
    if use_norm is None:
        flat, norm = _norm_of(tree, "clip_by_global_norm", p, axis_name, specs)
    else:
        flat = _common.check_norm_leaves(tree, "clip_by_global_norm")
        dtype = _common.tree_accum_dtype([leaf for _, leaf in flat])
        norm = jnp.asarray(use_norm).astype(dtype)
    finite = jnp.isfinite(norm)
    scale = _common.clip_scale(norm, max_norm)
    if nonfinite == "error":
        _raise_if_nonfinite(flat, finite)
    if nonfinite == "zero":
        clipped = jax.tree.map(
            lambda x: jnp.where(finite, _common.apply_scale(x, scale), 0).astype(
                x.dtype
            ),
            tree,
        )
    else:
        clipped = jax.tree.map(lambda x: _common.apply_scale(x, scale), tree)
    return clipped, norm, finite
