"""Properties of every norm-clipping rule over hypothesis-generated trees.

Trees hold None leaves, nested containers, mixed shapes and dtypes (float16,
bfloat16, float32, complex64, and float64 under x64). The properties: the norm
after clipping is at most the threshold; clipping twice equals clipping once;
below the threshold nothing changes; the direction is kept.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import clipax
from tests import helpers

DTYPES = ["float16", "bfloat16", "float32", "complex64"]
# The relative precision of each dtype: outputs are rounded to it.
EPS = {
    "float16": 1e-3,
    "bfloat16": 8e-3,
    "float32": 1e-6,
    "complex64": 1e-6,
    "float64": 1e-12,
}


@st.composite
def leaves(draw: st.DrawFn, dtypes: list[str]) -> Any:
    if draw(st.integers(0, 5)) == 0:
        return None
    dtype = draw(st.sampled_from(dtypes))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    size = int(np.prod(shape)) if shape else 1
    magnitude = draw(st.sampled_from([1e-3, 1.0, 30.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    values = magnitude * rng.normal(size=size)
    if dtype == "complex64":
        values = values + 1j * magnitude * rng.normal(size=size)
    return jnp.asarray(values.reshape(shape), dtype)


def trees(dtypes: list[str]) -> st.SearchStrategy:
    return st.recursive(
        leaves(dtypes),
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.dictionaries(st.sampled_from("abcd"), children, max_size=3),
            st.tuples(children, children),
        ),
        max_leaves=6,
    )


def _rel_eps(tree: Any) -> float:
    dtypes = {str(leaf.dtype) for leaf in jax.tree.leaves(tree)}
    return max((EPS[d] for d in dtypes), default=1e-6)


def _assert_close(a: Any, b: Any, tol: float) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_allclose(
            np.asarray(x, np.complex128),
            np.asarray(y, np.complex128),
            rtol=tol,
            atol=tol,
        )


ORDS = st.sampled_from([1.0, 1.5, 2.0, 3.0, math.inf])
MAX_NORMS = st.sampled_from([1e-2, 0.5, 1.0, 10.0])


@given(tree=trees(DTYPES), max_norm=MAX_NORMS, ord=ORDS)
def test_global_norm_clipping_properties(
    tree: Any, max_norm: float, ord: float
) -> None:
    tol = 4 * _rel_eps(tree)
    clipped, norm = clipax.tree.clip_by_global_norm(tree, max_norm, ord=ord)
    np.testing.assert_allclose(
        norm, helpers.ref_global_norm(tree, ord), rtol=1e-5, atol=1e-30
    )
    assert jax.tree.structure(clipped) == jax.tree.structure(tree)
    after = float(clipax.tree.global_norm(clipped, ord=ord))
    assert after <= max_norm * (1 + tol)  # the bound
    twice, _ = clipax.tree.clip_by_global_norm(clipped, max_norm, ord=ord)
    _assert_close(twice, clipped, tol * max(1.0, max_norm))  # idempotence
    if float(norm) <= max_norm:
        _assert_close(clipped, tree, 0.0)  # identity below the threshold
    else:  # the direction is kept: every leaf scaled by one positive factor
        factor = max_norm / float(norm)
        scaled = jax.tree.map(lambda x: np.asarray(x, np.complex128) * factor, tree)
        for x, y in zip(jax.tree.leaves(clipped), jax.tree.leaves(scaled), strict=True):
            np.testing.assert_allclose(
                np.asarray(x, np.complex128), y, rtol=tol, atol=tol * max_norm
            )


@given(tree=trees(DTYPES), max_norm=MAX_NORMS)
def test_per_leaf_clipping_properties(tree: Any, max_norm: float) -> None:
    tol = 4 * _rel_eps(tree)
    clipped = clipax.tree.clip_by_norm(tree, max_norm)
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(clipped), strict=True):
        norm = helpers.ref_global_norm(x)
        after = helpers.ref_global_norm(y)
        assert after <= max_norm * (1 + tol)
        if norm <= max_norm:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        else:
            np.testing.assert_allclose(
                np.asarray(y, np.complex128),
                np.asarray(x, np.complex128) * (max_norm / norm),
                rtol=tol,
                atol=tol * max_norm,
            )
    _assert_close(clipax.tree.clip_by_norm(clipped, max_norm), clipped, tol * max_norm)


@pytest.mark.parametrize("ord", [1.0, 2.0, math.inf])
@given(tree=trees(["float32"]), max_norm=MAX_NORMS)
def test_float64_trees_under_x64(tree: Any, max_norm: float, ord: float) -> None:
    with jax.enable_x64(True):
        tree64 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), tree)
        clipped, norm = clipax.tree.clip_by_global_norm(tree64, max_norm, ord=ord)
        has_leaves = bool(jax.tree.leaves(tree64))
        assert norm.dtype == (jnp.float64 if has_leaves else jnp.float32)
        np.testing.assert_allclose(
            norm, helpers.ref_global_norm(tree64, ord), rtol=1e-12
        )
        expected, _ = helpers.ref_clip_by_global_norm(tree64, max_norm, ord)
        for x, y in zip(
            jax.tree.leaves(clipped), jax.tree.leaves(expected), strict=True
        ):
            assert x.dtype == jnp.float64
            np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-300)


@given(tree=trees(["float32", "bfloat16"]), low=st.floats(-2, 0), high=st.floats(0, 2))
def test_value_clipping_properties(tree: Any, low: float, high: float) -> None:
    clipped = clipax.tree.clip_by_value(tree, low, high)
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(clipped), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        lo, hi = jnp.asarray(low, x.dtype), jnp.asarray(high, x.dtype)
        assert bool(jnp.all((y >= lo) & (y <= hi)))
        inside = (x >= lo) & (x <= hi)
        assert bool(jnp.all(jnp.where(inside, y == x, True)))
    _assert_close(clipax.tree.clip_by_value(clipped, low, high), clipped, 0.0)
