"""Gradients through every clip, checked for value.

`jax.grad` of a loss through each clip (the tree functions and the
transformations, jitted and not) equals autodiff of the same formula written
here in float64, `x * t / max(norm(x), t)`: where the clip is active and
where it is not, for the global norm of order 2, 1 and inf, per leaf and per
slice (`axes`), and on the global norm's exact path, where the squares of the
entries overflow or underflow float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import clipax

SHAPES = {"a": (3, 4), "b": (5,)}


def inputs(scale: float) -> tuple[dict, dict]:
    """A tree of entries about `scale`, and the loss's weights."""
    rng = np.random.default_rng(int(math.log10(scale)) + 40)
    tree = {
        k: (rng.normal(size=s) * scale).astype(np.float32) for k, s in SHAPES.items()
    }
    weights = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    return tree, weights


def norm64(x: jax.Array, p: float, axis: Any = None) -> jax.Array:
    if p == math.inf:
        return jnp.max(jnp.abs(x), axis=axis, keepdims=axis is not None)
    total = jnp.sum(jnp.abs(x) ** p, axis=axis, keepdims=axis is not None)
    return total ** (1 / p)


def clipped64(x: jax.Array, n: jax.Array, t: float) -> jax.Array:
    return x * t / jnp.maximum(n, t)


def reference(kind: str, tree: dict, weights: dict, t: float, p: float) -> dict:
    """The float64 gradient of `sum(weights * clip(tree))` by the formula."""

    def loss(tree: dict) -> jax.Array:
        if kind == "global":
            n = norm64(jnp.concatenate([x.ravel() for x in tree.values()]), p)
            out = {k: clipped64(x, n, t) for k, x in tree.items()}
        elif kind == "leaf":
            out = {k: clipped64(x, norm64(x, 2.0), t) for k, x in tree.items()}
        else:  # each row: the norm over the last axis
            out = {k: clipped64(x, norm64(x, 2.0, -1), t) for k, x in tree.items()}
        return sum(jnp.sum(weights[k] * out[k]) for k in tree)

    with jax.enable_x64(True):
        wide = {k: jnp.asarray(x, jnp.float64) for k, x in tree.items()}
        weights = {k: jnp.asarray(w, jnp.float64) for k, w in weights.items()}
        return jax.tree.map(np.asarray, jax.grad(loss)(wide))


def threshold(kind: str, tree: dict, p: float, active: bool) -> float:
    """Half (active) or twice (not) the norm the clip reads, the smallest of
    them per leaf or per row."""
    wide = {k: x.astype(np.float64) for k, x in tree.items()}
    if kind == "global":
        flat = np.concatenate([x.ravel() for x in wide.values()])
        n = np.linalg.norm(flat, p)
    elif kind == "leaf":
        n = min(np.linalg.norm(x.ravel()) for x in wide.values())
    else:
        n = min(np.linalg.norm(x, axis=-1).min() for x in wide.values())
    return float(n * (0.5 if active else 2.0))


CLIPS: dict[str, tuple[str, Callable[[float, float], Callable[[dict], dict]]]] = {
    "tree.clip_by_global_norm": (
        "global",
        lambda t, p: lambda g: clipax.tree.clip_by_global_norm(g, t, ord=p)[0],
    ),
    "clip_by_global_norm": (
        "global",
        lambda t, p: (
            lambda g: (tx := clipax.clip_by_global_norm(t, ord=p)).update(
                g, tx.init(g)
            )[0]
        ),
    ),
    "tree.clip_by_norm": (
        "leaf",
        lambda t, p: lambda g: clipax.tree.clip_by_norm(g, t),
    ),
    "clip_by_norm": (
        "leaf",
        lambda t, p: lambda g: (tx := clipax.clip_by_norm(t)).update(g, tx.init(g))[0],
    ),
    "tree.clip_by_norm axes": (
        "rows",
        lambda t, p: lambda g: clipax.tree.clip_by_norm(g, t, axes=-1),
    ),
    "clip_by_norm axes": (
        "rows",
        lambda t, p: (
            lambda g: (tx := clipax.clip_by_norm(t, axes=-1)).update(g, tx.init(g))[0]
        ),
    ),
}
# The global norm's order, and the entries' scale: where their squares
# overflow (1e25) or underflow (1e-25) float32, on its exact path.
GLOBAL = [(p, s) for p in (2.0, 1.0, math.inf) for s in (1.0, 1e25, 1e-25)]
CASES = [
    pytest.param(name, p, scale, id=f"{name}-ord{p}-{scale:g}")
    for name, (kind, _) in CLIPS.items()
    for p, scale in (GLOBAL if kind == "global" else [(2.0, 1.0)])
]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("active", [True, False], ids=["active", "inactive"])
@pytest.mark.parametrize(("name", "p", "scale"), CASES)
def test_the_gradient_through_the_clip_is_the_formulas(
    name: str, p: float, scale: float, active: bool, jit: bool
) -> None:
    kind, make = CLIPS[name]
    tree, weights = inputs(scale)
    t = threshold(kind, tree, p, active)
    clip = make(t, p)

    def loss(g: dict) -> jax.Array:
        out = clip(g)
        return sum(jnp.sum(weights[k] * out[k]) for k in g)

    grad = jax.grad(loss)
    got = (jax.jit(grad) if jit else grad)({k: jnp.asarray(x) for k, x in tree.items()})
    want = reference(kind, tree, weights, t, p)
    for k in SHAPES:
        assert np.all(np.isfinite(got[k])), k
        # Scaled by the largest entry: the gradient's size is O(t / norm).
        top = np.max(np.abs(want[k]))
        np.testing.assert_allclose(
            np.asarray(got[k]) / top, want[k] / top, rtol=1e-4, atol=1e-5, err_msg=k
        )
    if not active:  # the clip does nothing: the gradient is the weights
        for k in SHAPES:
            np.testing.assert_allclose(got[k], weights[k], rtol=1e-6)
