"""Properties of the norm-clipping rules over hypothesis-generated pytrees.

Trees: nested dicts, lists and tuples; None, `optax.MaskedNode`, empty
containers, scalars and zero-size arrays; shapes up to rank 4; float16,
bfloat16, float32, float64 (under x64) and complex64 leaves; magnitudes from
1e-30 to 1e30 (within each dtype's range). Properties, each over 500 examples:
the norm is exact (per-tensor norms: where their sums of squares are normal
floats, and otherwise as docs/semantics.md says); after clipping it is at most
the threshold; clipping twice
equals clipping once; below the threshold nothing changes; the direction is
kept; jit equals eager; vmap over a batch axis (inside jit, where it is used)
equals a loop.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import clipax
from tests import helpers

EXAMPLES = settings(max_examples=500)
DTYPES = ["float16", "bfloat16", "float32", "float64", "complex64"]
# log10 of the largest magnitude each dtype holds comfortably (squares of
# float32 values at 1e30 overflow: that is the point).
RANGE = {"float16": 4, "bfloat16": 30, "float32": 30, "float64": 30, "complex64": 30}
# Relative rounding of each dtype: clipped outputs are rounded to it.
EPS = {
    "float16": 2e-3,
    "bfloat16": 1.6e-2,
    "float32": 4e-7,
    "float64": 1e-14,
    "complex64": 4e-7,
}
ORDS = [1.0, 1.5, 2.0, 3.0, math.inf]


@st.composite
def arrays(draw: st.DrawFn, dtypes: list[str] = DTYPES) -> Any:
    dtype = draw(st.sampled_from(dtypes))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=4)))
    exponent = draw(st.integers(-RANGE[dtype], RANGE[dtype]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    values = rng.uniform(-1, 1, size=shape) * 10.0**exponent
    if dtype == "complex64":
        values = values + 1j * rng.uniform(-1, 1, size=shape) * 10.0**exponent
    return np.asarray(values, dtype=jnp.dtype(dtype))


def trees(leaf: st.SearchStrategy) -> st.SearchStrategy:
    base = st.one_of(
        leaf,
        leaf,
        leaf,
        st.just(None),
        st.just(optax.MaskedNode()),
        st.sampled_from([{}, [], ()]),
    )
    return st.recursive(
        base,
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.tuples(children, children),
            st.dictionaries(st.sampled_from("abcde"), children, max_size=3),
        ),
        max_leaves=6,
    )


def _on_device(tree: Any) -> Any:
    return jax.tree.map(jnp.asarray, tree)


def _eps(tree: Any) -> float:
    return max((EPS[str(x.dtype)] for x in jax.tree.leaves(tree)), default=1e-7)


def _tiny(tree: Any) -> float:
    """Below the smallest normal number of a dtype, rounding is absolute."""
    return max(
        (
            float(jnp.finfo(x.dtype).tiny) * max(x.size, 1)
            for x in jax.tree.leaves(tree)
        ),
        default=0.0,
    )


def _c128(x: Any) -> np.ndarray:
    return np.asarray(x).astype(np.complex128)


def _threshold(norm: float, factor: float) -> float:
    return factor * norm if norm > 0 else 1.0


@pytest.fixture(autouse=True)
def _x64() -> Any:
    with jax.enable_x64(True):
        yield


@EXAMPLES
@given(
    tree=trees(arrays()),
    ord=st.sampled_from(ORDS),
    factor=st.sampled_from([1e-3, 0.5, 0.999, 2.0]),
)
def test_global_norm_clipping(tree: Any, ord: float, factor: float) -> None:
    tree = _on_device(tree)
    reference = helpers.ref_global_norm(tree, ord)
    max_norm = _threshold(reference, factor)
    clipped, norm = clipax.tree.clip_by_global_norm(tree, max_norm, ord=ord)
    eps = _eps(tree)
    # The norm is exact: within 1e-5 of float64, whatever the magnitudes.
    np.testing.assert_allclose(float(norm), reference, rtol=1e-5)
    assert jax.tree.structure(clipped) == jax.tree.structure(tree)
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(clipped), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
    tiny = _tiny(tree)
    # The bound.
    after = helpers.ref_global_norm(clipped, ord)
    assert after <= max_norm * (1 + 4 * eps) + tiny
    # Idempotence.
    twice, _ = clipax.tree.clip_by_global_norm(clipped, max_norm, ord=ord)
    for y, z in zip(jax.tree.leaves(clipped), jax.tree.leaves(twice), strict=True):
        np.testing.assert_allclose(
            _c128(z), _c128(y), rtol=4 * eps, atol=4 * eps * max_norm + tiny
        )
    if reference < max_norm * (1 - 1e-5):  # identity below the threshold
        for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(clipped), strict=True):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    elif reference > 0:  # the direction is kept: one positive factor
        scale = max_norm / max(reference, max_norm)
        for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(clipped), strict=True):
            np.testing.assert_allclose(
                _c128(y),
                _c128(x) * scale,
                rtol=2 * eps,
                atol=2 * eps * max_norm + tiny,
            )


@EXAMPLES
@given(tree=trees(arrays()), factor=st.sampled_from([1e-3, 0.5, 2.0]))
def test_per_leaf_clipping(tree: Any, factor: float) -> None:
    tree = _on_device(tree)
    max_norm = _threshold(helpers.ref_global_norm(tree), factor)
    tx = clipax.clip_by_norm(max_norm)
    clipped, state = tx.update(tree, tx.init(tree))
    leaves = zip(
        jax.tree.leaves(tree),
        jax.tree.leaves(clipped),
        jax.tree.leaves(state.norms),
        strict=True,
    )
    for x, y, norm in leaves:
        eps, tiny = EPS[str(x.dtype)], _tiny(x)
        reference = helpers.ref_global_norm(x)
        where = helpers.per_tensor_range(x)
        if where == "overflow":  # an inf norm: the NaN rule, for this leaf alone
            assert math.isinf(float(norm)) and np.isnan(np.asarray(y)).all()
            continue
        if where == "underflow":  # reads smaller; clipped by what it read
            assert 0 <= float(norm) <= reference * (1 + 1e-5) + tiny
            scale = 1.0 if float(norm) <= max_norm else max_norm / float(norm)
            np.testing.assert_allclose(
                _c128(y), _c128(x) * scale, rtol=2 * eps, atol=tiny
            )
            continue
        if where == "edge":
            continue
        np.testing.assert_allclose(float(norm), reference, rtol=1e-5)
        assert helpers.ref_global_norm(y) <= max_norm * (1 + 4 * eps) + tiny
        if reference < max_norm * (1 - 1e-5):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
        else:
            np.testing.assert_allclose(
                _c128(y),
                _c128(x) * (max_norm / reference),
                rtol=2 * eps,
                atol=2 * eps * max_norm + tiny,
            )
    twice = clipax.tree.clip_by_norm(clipped, max_norm)
    for y, z in zip(jax.tree.leaves(clipped), jax.tree.leaves(twice), strict=True):
        eps, tiny = EPS[str(y.dtype)], _tiny(y)
        np.testing.assert_allclose(
            _c128(z), _c128(y), rtol=4 * eps, atol=4 * eps * max_norm + tiny
        )


SHAPES = [(2, 3), (), (5,), (0, 2)]


@st.composite
def batches(draw: st.DrawFn) -> list[dict[str, Any]]:
    """1 to 3 trees of one structure and dtype, with random magnitudes.

    The structure is fixed per dtype so that jit's cache, not XLA's compiler,
    serves most of the 500 examples; the values, magnitudes (1e-30 to 1e30,
    zeros included), dtypes, orders and thresholds are what vary.
    """
    dtype = draw(st.sampled_from(DTYPES))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    batch = draw(st.integers(1, 3))
    limit = RANGE[dtype]
    trees_ = []
    for _ in range(batch):
        leaves = []
        for shape in SHAPES:
            exponent = draw(st.one_of(st.integers(-limit, limit), st.just(None)))
            scale = 0.0 if exponent is None else 10.0**exponent
            values = rng.uniform(-1, 1, size=shape) * scale
            if dtype == "complex64":
                values = values + 1j * rng.uniform(-1, 1, size=shape) * scale
            leaves.append(jnp.asarray(values, jnp.dtype(dtype)))
        trees_.append({"x": leaves, "n": None})
    return trees_


@EXAMPLES
@given(
    trees_=batches(),
    ord=st.sampled_from(ORDS),
    factor=st.sampled_from([1e-3, 0.5, 2.0]),
)
def test_jit_equals_eager_and_vmap_equals_a_loop(
    trees_: list[dict[str, Any]], ord: float, factor: float
) -> None:
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *trees_)
    max_norm = jnp.float32(_threshold(helpers.ref_global_norm(trees_[0], ord), factor))

    clip = _clip_fn(ord)
    jitted = _jitted(ord)
    batched, batched_state = _vmapped(ord)(stacked, max_norm)
    eps = _eps(trees_[0])
    for i, tree in enumerate(trees_):
        eager, eager_state = clip(tree, max_norm)
        once, once_state = jitted(tree, max_norm)
        # jit equals eager
        for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(once), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_allclose(_c128(b), _c128(a), rtol=2 * eps, atol=_tiny(a))
        np.testing.assert_allclose(once_state.norm, eager_state.norm, rtol=1e-6)
        assert once_state.nonfinite_count == eager_state.nonfinite_count
        # vmap over the batch axis equals the loop
        for a, b in zip(jax.tree.leaves(once), jax.tree.leaves(batched), strict=True):
            np.testing.assert_allclose(
                _c128(b[i]), _c128(a), rtol=2 * eps, atol=_tiny(a)
            )
        np.testing.assert_allclose(batched_state.norm[i], once_state.norm, rtol=1e-6)


def _clip_fn(ord: float) -> Any:
    def clip(t: Any, threshold: jax.Array) -> Any:
        tx = clipax.clip_by_global_norm(threshold, ord=ord)
        return tx.update(t, tx.init(t))

    return clip


_JITTED: dict[float, Any] = {}
_VMAPPED: dict[float, Any] = {}


def _jitted(ord: float) -> Any:
    if ord not in _JITTED:
        _JITTED[ord] = jax.jit(_clip_fn(ord))
    return _JITTED[ord]


def _vmapped(ord: float) -> Any:
    if ord not in _VMAPPED:
        _VMAPPED[ord] = jax.jit(jax.vmap(_clip_fn(ord), in_axes=(0, None)))
    return _VMAPPED[ord]


@settings(max_examples=200)
@given(
    tree=trees(arrays(["float16", "bfloat16", "float32", "float64"])),
    low=st.floats(-2, 0),
    high=st.floats(0, 2),
)
def test_value_clipping(tree: Any, low: float, high: float) -> None:
    tree = _on_device(tree)
    clipped = clipax.tree.clip_by_value(tree, low, high)
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(clipped), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        lo, hi = jnp.asarray(low, x.dtype), jnp.asarray(high, x.dtype)
        assert bool(jnp.all((y >= lo) & (y <= hi)))
        inside = (x >= lo) & (x <= hi)
        assert bool(jnp.all(jnp.where(inside, y == x, True)))
    again = clipax.tree.clip_by_value(clipped, low, high)
    for y, z in zip(jax.tree.leaves(clipped), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(z), np.asarray(y))
