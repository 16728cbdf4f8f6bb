"""Adaptive gradient clipping (AGC): unit-wise, against the parameter norms."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from clipax import _adaptive, _common, _engine

# optax's floor on the update norm in the division: a unit whose update norm
# is below it and above its limit is scaled to below that limit, as in optax.
DIV_EPS = 1e-6
NO_PARAMS = (
    "`adaptive_grad_clip` clips each update against the norm of its parameter, "
    "so `update` needs `params`; got params=None. Call "
    "`tx.update(updates, state, params)`."
)
# optax's unit axes by rank, for ranks 2 to 5 (lower ranks take the whole leaf).
DEFAULT_AXES = {2: (0,), 3: (0,), 4: (0, 1, 2), 5: (0, 1, 2, 3)}


def _is_empty(x: Any) -> bool:
    return x is None or isinstance(x, optax.MaskedNode)


def unit_axes(
    axes: tuple[int, ...] | None, path: _common.KeyPath, shape: tuple[int, ...]
) -> tuple[int, ...]:
    """The axes a leaf's unit norms are taken over, as `optax.unitwise_norm`.

    Without `axes`: the whole leaf when it has at most one dimension longer
    than 1; otherwise axis 0 for rank 2 (Dense kernels, in x out) and 3
    (multi-head Dense), axes (0, 1, 2) for rank 4 (HWIO convolutions) and
    (0, 1, 2, 3) for rank 5 (DHWIO). Other ranks need `axes`.
    """
    if axes is not None:
        try:
            return _common.leaf_axes(axes, path, shape)
        except ValueError as error:  # the shared message names `axes`
            raise ValueError(_axis_message(error)) from None
    if sum(d != 1 for d in shape) <= 1:
        return tuple(range(len(shape)))
    if len(shape) in DEFAULT_AXES:
        return DEFAULT_AXES[len(shape)]
    raise ValueError(
        f"`adaptive_grad_clip` has no default unit axes for the leaf at "
        f"{_common.path_str(path)} with shape {shape} (rank {len(shape)}); it "
        "knows ranks 0 to 5. Pass `axis` to say which axes a unit spans."
    )


def _axis_message(error: Exception) -> str:
    return str(error).replace("`axes`", "`axis`")


@jax.jit
def _clip_unit(
    g: jax.Array, g_norm: jax.Array, w_norm: jax.Array, clipping: Any, eps: Any
) -> jax.Array:
    """Each unit of `g` scaled down to `clipping * max(|w|, eps)` if above it.

    Jitted, so that leaves of one shape and dtype share one trace."""
    ratio_bound = jnp.asarray(clipping, g_norm.dtype)
    limit = ratio_bound * jnp.maximum(w_norm, jnp.asarray(eps, g_norm.dtype))
    # An infinite `clipping` allows every norm, also against a zero parameter
    # norm with eps = 0, where inf * 0 is NaN.
    limit = jnp.where(jnp.isposinf(ratio_bound), jnp.inf, limit)
    # A traced `clipping` <= 0 gives zeros, never flipped signs or NaN. The
    # rules are in the quotient's operands, as in `_common.clip_scale`, so
    # that the factors are finished before the multiply reads them.
    keep = g_norm < limit
    one = jnp.ones_like(g_norm)
    numerator = jnp.where(keep, one, jnp.maximum(limit, 0))
    numerator = jnp.where(jnp.isfinite(g_norm), numerator, jnp.nan)
    denominator = jnp.where(keep, one, jnp.maximum(g_norm, DIV_EPS))
    return _common.apply_scale(g, (numerator / denominator).astype(g_norm.dtype))


def _check_eps(eps: Any) -> None:
    _common.check_scalar("eps", eps, "a finite real number >= 0", low=0, high_open=True)


def adaptive_grad_clip(
    clipping: ArrayLike, eps: ArrayLike = 1e-3, axis: Any = None
) -> optax.GradientTransformation:
    """Clips each unit of the updates to `clipping` times its parameter's norm.

    AGC (Brock et al. 2021), equal to `optax.adaptive_grad_clip` on the same
    inputs. Each leaf is cut into units, the slices along the unit axes (by
    default as optax: a whole vector, each output column of a Dense kernel,
    each output channel of a convolution kernel; see `axis`). A unit whose
    update norm `|g|` is at least `clipping * max(|w|, eps)`, `|w|` being the
    norm of the same unit of the parameters, is scaled down to that
    norm (to less where that norm is below 1e-6, optax's floor on the divisor,
    as in optax); the others pass unchanged. `eps` keeps zero-initialised
    parameters (biases) from freezing.

    As in the rest of clipax, norms are accumulated in float32 (float64 for
    float64 leaves) and each leaf keeps its dtype; optax squares in the leaf's
    own dtype, which for float16 or bfloat16 can overflow. A unit whose update
    norm is NaN or inf comes back all NaN. None and `optax.MaskedNode` update
    leaves come back in place, whatever the parameters hold there. The
    arguments are optax's, in its order: `adaptive_grad_clip(0.01, 1e-3)`
    works as in optax.

    Args:
      clipping: the largest ratio of a unit's update norm to its parameter
        norm: a positive scalar, `inf`, or a traced value. The paper uses 0.01
        to 0.16 depending on the batch size.
      eps: the smallest parameter norm a unit is measured against, a real >= 0.
      axis: None (optax's default by rank, above), an int, or a sequence of
        distinct ints: the axes each unit spans, for every leaf.

    Returns:
      An `optax.GradientTransformation` with state `optax.EmptyState`.

    Raises:
      ValueError: at construction if `clipping`, `eps` or `axis` is not
        accepted; at `init` or `update` if `axis` is out of range for a leaf,
        or a leaf of rank above 5 gets no `axis`; at `update` if `params` is
        None.
      TypeError: if a leaf is not a float16, bfloat16, float32, float64 or complex
        array (of the parameters, only where the update leaf is not None or
        `optax.MaskedNode`), or if `axis` is traced (under
        `optax.inject_hyperparams`, name it in `static_args`).

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> params = {"w": jnp.array([3.0, 4.0]), "b": jnp.zeros(2)}
      >>> tx = clipax.adaptive_grad_clip(0.1)
      >>> state = tx.init(params)
      >>> grads = {"w": jnp.array([6.0, 8.0]), "b": jnp.array([1.0, 0.0])}
      >>> updates, state = tx.update(grads, state, params)
      >>> updates["w"]  # norm 10 clipped to 0.1 * 5
      Array([0.3, 0.4], dtype=float32)
      >>> updates["b"]  # norm 1 clipped to 0.1 * max(0, 1e-3)
      Array([0.0001, 0.    ], dtype=float32)

    References:
      Brock et al., `High-Performance Large-Scale Image Recognition Without
      Normalization <https://arxiv.org/abs/2102.06171>`_, 2021.
    """
    _common.check_max_norm("clipping", clipping)
    _check_eps(eps)
    try:
        axes = _common.normalize_axes(axis)
    except (ValueError, TypeError) as error:  # the shared message names `axes`
        raise type(error)(_axis_message(error)) from None

    def clip(updates: optax.Updates, params: optax.Params | None) -> optax.Updates:
        if params is None:
            raise ValueError(NO_PARAMS)
        updates, params = _common.as_arrays(updates), _common.as_arrays(params)
        _common.check_norm_leaves(updates, "adaptive_grad_clip")

        flat, treedef = jax.tree_util.tree_flatten_with_path(updates, is_leaf=_is_empty)
        weights = treedef.flatten_up_to(params)  # type: ignore[attr-defined]
        units, reduces = [], []  # nonempty update leaves: index, unit axes
        for i, ((path, g), w) in enumerate(zip(flat, weights, strict=True)):
            if _is_empty(g):
                continue
            if getattr(w, "shape", None) != g.shape:
                raise ValueError(
                    f"`adaptive_grad_clip` needs a parameter of the update's shape "
                    f"{g.shape} at {_common.path_str(path)}; got "
                    f"{getattr(w, 'shape', w)!r}."
                )
            _common.check_norm_leaf(path, w, "adaptive_grad_clip")
            reduces.append(unit_axes(axes, path, g.shape))
            units.append(i)
        gs = [jnp.asarray(flat[i][1]) for i in units]
        ws = [jnp.asarray(weights[i]) for i in units]
        norms = _engine.tensor_norms(gs + ws, reduces + reduces)
        out = [g for _, g in flat]
        pairs = zip(units, gs, norms[: len(gs)], norms[len(gs) :], strict=True)
        for i, g, g_norm, w_norm in pairs:
            out[i] = _clip_unit(g, g_norm, w_norm.astype(g_norm.dtype), clipping, eps)
        return jax.tree.unflatten(treedef, out)

    def check_leaf(path: _common.KeyPath, leaf: Any) -> None:
        unit_axes(axes, path, leaf.shape)

    return _adaptive.stateless("adaptive_grad_clip", clip, check_leaf)
