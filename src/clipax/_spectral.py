"""Spectral clipping: each update matrix's singular values soft-clipped (SPECTRA).

A matrix X becomes X (I + X^T X / c^2)^(-1/2), which maps each singular value
sigma to sigma / sqrt(1 + sigma^2 / c^2) (docs/spectral.md). X^T X is the Gram
matrix of the smaller side, and the only quantity that sums over the other: a
matrix split along one side has the Gram matrix of the other, summed over the
split side by one psum (inside shard_map) or by XLA (under jax.jit), and each
device applies the inverse root to its own block; the matrix is never gathered.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec
from jax.typing import ArrayLike
from optax.contrib import MuonDimensionNumbers as Dims

from clipax import _checks, _engine, _leaves, _states
from clipax._leaves import Leaf, MeshAxes, path_str

NAME = "clip_by_spectral_norm"
METHODS = ("newton_schulz", "spectra", "svd")
NS_STEPS = 10  # within 1 % up to sigma_max / c = 100 (docs/spectral.md)
POWER_STEPS = 32  # sigma_max to about 1 % where the top of the spectrum crowds
CAP = 2.97  # a step's scale s keeps s * (largest eigenvalue) below 3 by 1 %
NO_STEPS = "`ns_steps` means nothing with method='svd'; got {value}."
DIMS = "None, a MuonDimensionNumbers, a prefix of the updates holding them or None"

Axes = tuple[tuple[int, ...], tuple[int, ...]]  # a matrix's reduction, output axes
Pair = tuple[jax.Array, jax.Array]


class Plan(NamedTuple):
    """How a leaf's matrices are read: its axes in the order layers, batch,
    rows (the side the Gram matrix sums over), columns; and, inside
    shard_map, the mesh axes that split the rows (the Gram matrix's psum)
    and the batch (the largest singular value's pmax)."""

    order: tuple[int, ...]
    shape: tuple[int, ...]  # the block's layers, batch, rows and columns
    sums: MeshAxes = ()
    spread: MeshAxes = ()


@_states.declare(NAME, per_tensor={"sigma_max": "sigma_max", "clipped": "clipped"})
class ClipBySpectralNormState(NamedTuple):
    """State of `clip_by_spectral_norm`: what the last update's matrices were."""

    count: jax.Array  # type: ignore[assignment]  # int32 scalar: updates seen
    sigma_max: chex.ArrayTree  # the updates' tree, holding at each matrix
    # leaf a float32 [layers...]: its largest singular value before the clip
    # (the largest over its batch axes); None at leaves left alone
    clipped: chex.ArrayTree  # likewise, bool: whether that was above c
    stacks: _leaves.Stacks = _leaves.Stacks()  # static: where each stack starts


def gram(x: jax.Array) -> jax.Array:
    """X^T X of each matrix x[..., :, :], summed over its rows."""
    return x.mT @ x


def _bound(g: jax.Array) -> jax.Array:
    """An upper bound of each Gram matrix's largest eigenvalue: the smaller
    of Gershgorin's (its largest absolute row sum) and its Frobenius norm."""
    rows = jnp.max(jnp.sum(jnp.abs(g), -1), -1, initial=0.0)
    return jnp.minimum(rows, jnp.sqrt(jnp.sum(jnp.square(g), (-2, -1))))


def inverse_root(
    g: jax.Array, k: jax.Array, steps: int, method: str, spread: MeshAxes = ()
) -> jax.Array:
    """(I + k^2 g)^(-1/2) of each Gram matrix g[..., :, :], by `steps` coupled
    Newton-Schulz steps on A = (I + k^2 g) / alpha, alpha an upper bound of
    its largest eigenvalue, so that A's spectrum lies in [1/alpha, 1].

    `"newton_schulz"` scales each step by s, chosen from the interval
    [low, 1] that holds the spectrum of Z Y, so that s * low and s * 1 map to
    the same value (s = 3 / (1 + sqrt(low) + low)); `"spectra"` takes s = 1
    and one alpha per entry of axis 0 (SPECTRA's bound over a batch, axis 1,
    whose blocks inside shard_map are spread over the mesh axes `spread`).
    """
    eye = jnp.eye(g.shape[-1], dtype=g.dtype)
    bound = jax.lax.stop_gradient(_bound(g))  # the exact root does not use it
    if method == "spectra":
        bound = jnp.max(bound, axis=1, keepdims=True, initial=0.0)
        bound = _engine.pmax_all(bound, [spread])
    alpha = (1 + k**2 * bound)[..., None, None]

    def step(_: int, carry: tuple) -> tuple:
        y, z, low = carry
        s = jnp.minimum(3 / (1 + jnp.sqrt(low) + low), CAP)
        s = jnp.ones_like(s) if method == "spectra" else s
        t = jnp.sqrt(s) * (3 * eye - s * (z @ y)) / 2
        low = jnp.minimum(s * low * (3 - s * low) ** 2, s * (3 - s) ** 2) / 4
        return y @ t, t @ z, low  # Z Y's spectrum m maps to m (3 - m)^2 / 4

    z = jnp.zeros_like(g) + eye  # laid out as g (on an Explicit mesh too)
    start = ((eye + k**2 * g) / alpha, z, 1 / alpha)
    return jax.lax.fori_loop(0, steps, step, start)[1] / jnp.sqrt(alpha)


def top_singular_value(g: jax.Array) -> jax.Array:
    """An estimate from below of each matrix's largest singular value from its
    Gram matrix g: sqrt(|g v|), v after POWER_STEPS power steps from a fixed
    random vector (docs/spectral.md: its accuracy)."""
    g = jax.lax.stop_gradient(g)

    def step(_: int, carry: tuple) -> tuple:
        w = jnp.einsum("...ij,...j->...i", g, carry[0])
        norm = jnp.linalg.norm(w, axis=-1, keepdims=True)
        return w / jnp.maximum(norm, np.finfo(g.dtype).tiny), norm[..., 0]

    start = np.random.default_rng(0).standard_normal(g.shape[-1])  # the steps
    v = jnp.zeros_like(g[..., 0]) + start.astype(g.dtype)  # normalise it
    top = jax.lax.fori_loop(0, POWER_STEPS, step, (v, jnp.zeros_like(g[..., 0, 0])))
    return jnp.sqrt(top[1])


@jax.custom_jvp
def svd_soft_clip(x: jax.Array, k: jax.Array) -> Pair:
    """Each matrix x[..., :, :] (rows >= columns) with its singular values
    sigma mapped to sigma / sqrt(1 + (k sigma)^2), by SVD; and the sigmas.
    Its derivative is the spectral function's (no division by differences
    of singular values: finite where they repeat)."""
    u, s, vt = jnp.linalg.svd(x, full_matrices=False)
    return (u * (s / jnp.hypot(1, k * s))[..., None, :]) @ vt, s


@svd_soft_clip.defjvp
def _svd_soft_clip_jvp(primals: tuple, tangents: tuple) -> tuple:
    (x, k), (dx, dk) = primals, tangents
    u, s, vt = jnp.linalg.svd(x, full_matrices=False)
    p = jnp.hypot(1, k * s)  # Y = X h(X^T X), h(l) = (1 + k^2 l)^(-1/2)
    pi, pj = p[..., :, None], p[..., None, :]
    divided = -(k**2) / (pi * pj * (pi + pj))  # (h(l_i) - h(l_j)) / (l_i - l_j)
    dxv = dx @ vt.mT
    a = u.mT @ dxv  # U^T dX V
    b = s[..., :, None] * a
    inner = s[..., :, None] * divided * (b + b.mT)
    diagonal = jnp.arange(s.shape[-1])  # d/dk of sigma h(sigma^2): -k (sigma / p)^3
    inner = inner.at[..., diagonal, diagonal].add(-k * dk * (s / p) ** 3)
    y = (u * (s / p)[..., None, :]) @ vt
    return (y, s), ((dxv / pj + u @ inner) @ vt, jnp.diagonal(a, 0, -2, -1))


def soft_clip(
    x: jax.Array, c: jax.Array, method: str, steps: int, how: Plan | None = None
) -> Pair:
    """SPECTRA's soft clip of each matrix x[l, b, :, :], and its largest
    singular value (`top_singular_value`'s estimate, or the SVD's). Inside
    shard_map, x holds this device's rows of each matrix, and `how` says
    over which mesh axes the rows and the batch are split. A matrix holding
    NaN or inf, or whose Gram matrix overflows, comes out all NaN; c <= 0
    gives zeros, c = inf `x` itself."""
    k = 1 / jnp.where(c <= 0, 1, c)  # NaN stays NaN
    sums, spread = (how.sums, how.spread) if how else ((), ())
    if method == "svd":
        y, s = svd_soft_clip(x, k)
        top = jnp.max(s, axis=-1, initial=0.0)
        top = jnp.where(jnp.all(jnp.isfinite(x), axis=(-2, -1)), top, np.nan)
    else:
        g = gram(x)  # the one quantity summed over the rows: psum the blocks'
        g = jax.lax.psum(g, sums) if sums else g
        y = x @ inverse_root(g, k, steps, method, spread)
        finite = jnp.all(jnp.isfinite(g), axis=(-2, -1))  # x's NaN and inf too
        top = jnp.where(finite, top_singular_value(g), np.nan)
    y = jnp.where(c == np.inf, x, jnp.where(c <= 0, 0, y))
    return jnp.where(jnp.isfinite(top)[..., None, None], y, np.nan), top


def _explicit_dims(x: Any) -> tuple[MeshAxes, ...]:
    """Per dimension of `x`, the mesh axes its type says split it: under
    `jax.jit` on an Explicit mesh; none elsewhere."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = (*getattr(sharding, "spec", ()), *(None,) * x.ndim)[: x.ndim]
    return tuple((e,) if isinstance(e, str) else tuple(e or ()) for e in spec)


def plan(leaf: Leaf, axes: Axes, method: str) -> Plan:
    """How the leaf's matrices over `axes` (reduction, output) are read. The
    rows are the larger side (the output axes for a tie: SPECTRA's X X^T of
    a (reduction, output) matrix); with "newton_schulz", the side split
    across devices where one is, so that its Gram matrix is summed over the
    split side (one psum inside shard_map) and the matrix is never gathered.

    Raises:
      ValueError: naming the leaf, its spec and what is accepted, inside
        shard_map, if both sides are split, or "svd" finds either split, or
        "spectra" the smaller one.
    """
    x, (reduction, output) = leaf.x, axes
    inside = bool(_leaves.manual_axes())  # where `matrix_axes` found dims
    dims = leaf.dims if inside and leaf.dims is not None else _explicit_dims(x)
    on = lambda side: tuple(sorted({n for d in side for n in dims[d]}))  # noqa: E731
    size = lambda side: math.prod(x.shape[d] for d in side)  # noqa: E731
    rows, columns = (output, reduction) if size(reduction) <= size(output) else axes
    if method == "newton_schulz" and bool(on(reduction)) != bool(on(output)):
        rows, columns = axes if on(reduction) else (output, reduction)
    if inside and (on(columns) or (method == "svd" and on(rows))):
        raise ValueError(_refusal(leaf, axes, on, method))
    batch = tuple(d for d in leaf.inner if d not in reduction + output)
    order = (*leaf.layer_axes, *batch, *rows, *columns)
    shape = tuple(size(a) for a in (leaf.layer_axes, batch, rows, columns))
    return Plan(order, shape, *((on(rows), on(batch)) if inside else ()))


def _refusal(leaf: Leaf, axes: Axes, on: Callable, method: str) -> str:
    """Why `plan` refuses the leaf's layout, and what it accepts."""
    entries = [None if not n else n[0] if len(n) == 1 else n for n in leaf.dims or ()]
    where = (
        f"`specs` gives {PartitionSpec(*entries)} to the leaf at "
        f"{path_str(leaf.path)} (its block {tuple(leaf.x.shape)}), which splits "
    )
    sides = zip(("reduction", "output"), axes, strict=True)
    named = [f"its {n} axes {a} over {on(a)}" for n, a in sides if on(a)]
    split = " and ".join(named)
    if method == "svd":
        return (
            f"`method='svd'` needs each matrix whole on its device inside "
            f"shard_map: {where}{split}. Split only its batch and layer axes, or "
            "use method='newton_schulz' (one psum of a Gram matrix), or jax.jit."
        )
    if len(named) == 2:
        return (
            f"`{NAME}` takes a matrix split along one side at most inside "
            f"shard_map (its Gram matrix then sums over that side: one psum): "
            f"{where}{split}. Gather one side first, or clip under jax.jit."
        )
    return (
        "`method='spectra'` sums each matrix's Gram matrix over its larger side, as "
        f"SPECTRA does (its steps depend on the side): {where}{split}, the smaller "
        "side. Split the larger one, or use method='newton_schulz' (either side), "
        "or jax.jit."
    )


def clip_matrix(leaf: Leaf, axes: Axes, c: Any, method: str, steps: int) -> Pair:
    """The leaf with each matrix over `axes` (its reduction and output axes)
    soft-clipped, and its layers' largest singular values (over the other
    axes), as on one device. Split on an Explicit mesh, it is clipped in
    Auto mode and placed as it came: XLA then sums the Gram matrix over the
    split side, as a psum does inside shard_map, instead of gathering it."""
    x, how = jnp.asarray(leaf.x), plan(leaf, axes, method)  # NumPy float64: float32
    acc = _leaves.accum_dtype(x.dtype)

    def clip(x: jax.Array, c: jax.Array) -> Pair:
        xt = jnp.transpose(x, how.order).reshape(how.shape).astype(acc)
        y, top = soft_clip(xt, c, method, steps, how)
        y = y.reshape([x.shape[d] for d in how.order]).transpose(np.argsort(how.order))
        top = jnp.max(top, axis=1, initial=0.0).reshape(leaf.layers)
        return y.astype(x.dtype), _engine.pmax_all(top, [how.spread])

    if not _leaves.manual_axes() and any(_explicit_dims(x)):
        sharding = jax.typeof(x).sharding
        whole = sharding.update(spec=PartitionSpec())
        clip = jax.sharding.auto_axes(clip, out_sharding=(sharding, whole))
    return clip(x, jnp.asarray(c, acc))


def matrix_axes(leaves: _leaves.Leaves, dims: Any, tree: Any) -> list[Axes | None]:
    """Per leaf, its reduction and output axes (axes of the leaf, within one
    layer of a stacked leaf), or None for a leaf left alone.

    Raises:
      ValueError: naming the leaf and its shape, if its axes are out of range
        or overlap; inside shard_map without `specs`, if a matrix may be split.
      TypeError: naming the leaf and its dtype, if a matrix is not float.
    """
    found: list[Any] = [Dims() if len(x.inner) == 2 else None for x in leaves]
    if dims is not None:  # else SPECTRA's apply_to="2d"
        dims = dims(tree) if callable(dims) else dims
        is_entry = lambda e: e is None or isinstance(e, Dims)  # noqa: E731
        name = "weight_dimension_numbers"
        pairs = _leaves.entries(name, dims, tree, leaves, is_entry, "entry", DIMS)
        found = [e for e, _ in pairs]
    out: list[Axes | None] = []
    for leaf, e in zip(leaves, found, strict=True):
        axes = e and tuple(leaf.within(a, n) for n, a in e._asdict().items())
        where = f"the leaf at {path_str(leaf.path)} with shape {tuple(leaf.x.shape)}"
        if axes and set(axes[0]) & set(axes[1]):
            raise ValueError(
                f"`weight_dimension_numbers` gives {where} the reduction axes "
                f"{axes[0]} and the output axes {axes[1]}: they must not overlap."
            )
        if axes and not jnp.issubdtype(leaf.x.dtype, jnp.floating):
            raise TypeError(
                f"`{NAME}` clips float matrices; {where} has dtype {leaf.x.dtype}. "
                "Cast it, or give it None in `weight_dimension_numbers`."
            )
        if axes and leaf.unsaid_axes:
            raise ValueError(
                f"`{NAME}` cannot tell how the leaf at {path_str(leaf.path)} (its "
                f"block {tuple(leaf.x.shape)}) is split across the mesh axes "
                f"{leaf.unsaid_axes} of this shard_map: pass `specs=`, the "
                "`in_specs` you gave shard_map for the updates (`PartitionSpec()` "
                "for a leaf whole on every device). JAX's types prove a leaf whole "
                "only with `check_vma=True`."
            )
        out.append(axes or None)
    return out


def _state(leaves: _leaves.Leaves, tops: list, c: Any, count: Any, stacks: Any) -> Any:
    """The state: `tops` (one per leaf; None at leaves left alone) and
    whether each is above `c`, in the updates' tree."""

    def tree(values: list[Any]) -> Any:
        values = [v if v is None else _leaves.replicated(v) for v in values]
        return jax.tree.unflatten(leaves.treedef, values)

    over = [t if t is None else t > jnp.asarray(c, t.dtype) for t in tops]
    return ClipBySpectralNormState(count, tree(tops), tree(over), stacks)


def clip_by_spectral_norm(
    max_singular_value: ArrayLike | Callable[[jax.Array], ArrayLike],
    *,
    method: str = "newton_schulz",
    ns_steps: int | None = None,
    weight_dimension_numbers: Any = None,
    stacked: Any = None,
    specs: Any = None,
) -> optax.GradientTransformation:
    """Soft-clips the singular values of each update matrix (SPECTRA).

    Each matrix X becomes X (I + X^T X / c^2)^(-1/2): each singular value
    sigma becomes sigma / sqrt(1 + sigma^2 / c^2), c = `max_singular_value`
    (below c nearly kept, above it brought towards c; the singular vectors
    kept). Every axis of a leaf but a matrix's two sides is a batch of
    matrices, each clipped alone; with `stacked`, each layer's. Computed in
    float32 (float64 for float64 leaves), cast back. A matrix holding NaN or
    inf comes out all NaN. docs/spectral.md gives the rule and its accuracy.

    Args:
      max_singular_value: c: a positive scalar, `inf` (no clipping), an
        array, or a schedule (a function of the step count).
      method: `"newton_schulz"` (a scaled Newton-Schulz inverse square root
        of the smaller Gram matrix: within 1 % of the exact clip up to
        sigma_max / c = 100), `"spectra"` (the authors' unscaled iteration,
        to reproduce their runs) or `"svd"` (exact, slow on accelerators).
      ns_steps: Newton-Schulz steps, an int >= 1; None means 10.
      weight_dimension_numbers: which axes make a matrix, as in
        `optax.contrib.muon`; None: each 2-D leaf (layer) is a matrix, with
        reduction axis 0 and output axis 1, and other leaves pass unchanged.
      stacked: None, or a prefix of the updates (docs/stacked-layers.md).
      specs: inside `shard_map`, the `in_specs` of the updates: a matrix may
        be split along one side (its Gram matrix is then summed over it, one
        psum) and along its batch and layer axes (docs/scaling-out.md).

    Returns:
      An `optax.GradientTransformation` whose state is a
      `ClipBySpectralNormState`: per matrix leaf (layer), `sigma_max` (from the
      SVD, or 32 power steps on the Gram matrix) and `clipped`.

    Raises:
      ValueError: if an argument, or a leaf's axes, is not accepted.
      TypeError: if a matrix is not a float array.

    Example:
      >>> import jax.numpy as jnp
      >>> import clipax
      >>> tx = clipax.clip_by_spectral_norm(1.0)
      >>> w = {"w": jnp.diag(jnp.array([100.0, 1.0, 0.01])), "b": jnp.ones(3)}
      >>> updates, state = tx.update(w, tx.init(w))
      >>> jnp.diagonal(updates["w"]).round(4), state.sigma_max["w"]
      (Array([1.    , 0.7071, 0.01  ], dtype=float32), Array(100., dtype=float32))
    """
    schedule = callable(max_singular_value)
    c: Any = max_singular_value
    c = c if schedule else _checks.threshold("max_singular_value", c)
    method = _checks.choice("method", method, METHODS)
    if method == "svd":
        _checks.unused(ns_steps, None, NO_STEPS)
    steps = NS_STEPS if ns_steps is None else _checks.integer("ns_steps", ns_steps)
    reader = _leaves.reader(NAME, stacked=stacked, specs=specs)

    def read(tree: Any) -> tuple[_leaves.Leaves, list[Axes | None], _leaves.Leaves]:
        leaves = reader(tree, kind="array")
        axes = matrix_axes(leaves, weight_dimension_numbers, tree)
        mats = [x for x, a in zip(leaves, axes, strict=True) if a]
        return leaves, axes, _leaves.Leaves(mats, None)

    def init_fn(params: optax.Params) -> ClipBySpectralNormState:
        leaves, axes, matrices = read(params)
        tops = [
            a and jnp.zeros(x.layers, _leaves.accum_dtype(x.x.dtype))
            for x, a in zip(leaves, axes, strict=True)
        ]
        return _state(leaves, tops, 0, jnp.zeros((), jnp.int32), matrices.stacks)

    def update_fn(
        updates: optax.Updates,
        state: ClipBySpectralNormState,
        params: optax.Params | None = None,
    ) -> tuple[optax.Updates, ClipBySpectralNormState]:
        del params
        leaves, axes, matrices = read(updates)
        _leaves.check_state(NAME, matrices, state.sigma_max, state.stacks)
        now = c(state.count) if schedule else c
        ys, tops = [], []
        for leaf, a in zip(leaves, axes, strict=True):
            y, top = clip_matrix(leaf, a, now, method, steps) if a else (leaf.x, None)
            ys.append(y)
            tops.append(top)
        count = optax.safe_int32_increment(state.count)
        return leaves.rebuild(ys), _state(leaves, tops, now, count, state.stacks)

    return optax.GradientTransformation(init_fn, update_fn)
