"""The norm engine (`clipax._engine`): buckets give the
same numbers and never reshard; per-tensor norms are the bare formula's."""

from __future__ import annotations

import math
import re
from typing import Any

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import clipax
from clipax import _engine
from tests.helpers import (
    UNFUSED_REDUCTIONS,
    collectives,
    ref_global_norm,
    xla_output_since,
)

ORDS = [1.0, 2.0, 1.5, math.inf]
TOL = {"rtol": 2e-5, "atol": 1e-30}


def ragged_tree(seed: int, dtypes: tuple[Any, ...] = (jnp.float32,)) -> dict:
    """Leaves of many sizes (zero-size and scalars too) and dtypes, with Nones."""
    rng = np.random.default_rng(seed)
    shapes = [(), (0,), (1,), (7,), (3, 5), (0, 4), (64,), (2, 3, 4), (300,), (1000,)]
    tree: dict[str, Any] = {}
    for i in range(40):
        pick = int(rng.integers(len(shapes) + 4))
        shape = shapes[pick] if pick < len(shapes) else (int(rng.integers(1, 90)),)
        dtype = dtypes[i % len(dtypes)]
        values = rng.standard_normal(shape).astype(np.float32) * 10.0 ** rng.integers(
            -2, 3
        )
        tree[f"x{i:02d}"] = jnp.asarray(values, dtype)
        if i % 7 == 0:
            tree[f"none{i:02d}"] = None
    return tree


def per_leaf_total(leaves: list[Any], p: float, dtype: Any) -> jax.Array:
    """The unbucketed sum (max for inf) of each leaf's own power sum."""
    parts = [_engine.power_sum(jnp.asarray(x), p).astype(dtype) for x in leaves]
    if not parts:
        return jnp.zeros((), dtype)
    return total(jnp.stack(parts), p)


def total(partials: jax.Array, p: float) -> jax.Array:
    """The tree's sum of powers (its largest |x| for p = inf) from partials."""
    return jnp.max(partials) if p == math.inf else jnp.sum(partials)


@pytest.fixture
def small_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small thresholds, so that one tree has buckets and lone leaves."""
    monkeypatch.setattr(_engine, "SMALL_LEAF", 100)
    monkeypatch.setattr(_engine, "BUCKET_ELEMENTS", 256)


@pytest.fixture
def always_concatenate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Buckets under jit too (the test session has 8 devices, so by default a
    traced leaf with no known sharding is never concatenated)."""
    monkeypatch.setattr(_engine, "is_whole", lambda x: True)


@pytest.mark.usefixtures("small_buckets")
def test_buckets_hold_small_leaves_by_dtype_within_bounds() -> None:
    leaves = [
        jnp.ones(50),  # 0: f32 bucket
        jnp.ones(60, jnp.bfloat16),  # 1: bf16 bucket
        jnp.ones(0),  # 2: empty, nowhere
        jnp.ones(101),  # 3: too large, alone
        jnp.ones(100),  # 4: f32 bucket
        jnp.ones((2, 5)),  # 5: f32 bucket, whatever its shape
        jnp.ones(30, jnp.bfloat16),  # 6: bf16 bucket
        jnp.ones(10),  # 7: f32 bucket
        jnp.ones((5, 2)),  # 8: f32 bucket
        jnp.ones(10),  # 9: f32 bucket
        jnp.ones(10, jnp.bfloat16),  # 10: bf16 bucket
        jnp.ones(99),  # 11: a new f32 bucket (50 + 100 + 4 x 10 + 99 > 256)
        jnp.ones(90),  # 12: f32 bucket (no bound on the elements bucketed in all)
    ]
    buckets, alone = _engine._buckets(leaves)
    assert buckets == [[0, 4, 5, 7, 8, 9], [1, 6, 10], [11, 12]]
    assert alone == [3]
    for bucket in buckets:
        assert len({leaves[i].dtype for i in bucket}) == 1
        assert sum(leaves[i].size for i in bucket) <= _engine.BUCKET_ELEMENTS


@pytest.mark.usefixtures("small_buckets")
@pytest.mark.parametrize("p", ORDS)
@pytest.mark.parametrize(
    "dtypes",
    [
        (jnp.float32,),
        (jnp.float32, jnp.bfloat16, jnp.float16),
        (jnp.complex64, jnp.float32),
    ],
    ids=["f32", "f32-bf16-f16", "c64-f32"],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bucketed_sums_equal_per_leaf_sums(
    p: float, dtypes: tuple[Any, ...], seed: int
) -> None:
    tree = ragged_tree(seed, dtypes)
    leaves = jax.tree.leaves(tree)
    dtype = _engine.tree_accum_dtype(leaves)
    buckets, alone = _engine._buckets(leaves)  # eager leaves: concatenable
    assert any(len(b) > 1 for b in buckets) and alone
    partials = _engine.partial_sums(leaves, p, dtype)
    assert partials.dtype == dtype
    bucketed = total(partials, p)
    chex.assert_trees_all_close(bucketed, per_leaf_total(leaves, p, dtype), **TOL)
    root = _engine.safe_root(bucketed, p)
    np.testing.assert_allclose(root, ref_global_norm(tree, p), **TOL)


@pytest.mark.usefixtures("small_buckets", "always_concatenate")
@pytest.mark.parametrize("p", ORDS)
def test_bucketed_clip_by_global_norm_under_jit_matches_reference(p: float) -> None:
    tree = ragged_tree(3, (jnp.float32, jnp.bfloat16))
    norm_ref = ref_global_norm(tree, p)
    max_norm = norm_ref / 3
    clipped, norm = jax.jit(
        lambda t: clipax.tree.clip_by_global_norm(t, max_norm, ord=p)
    )(tree)
    np.testing.assert_allclose(norm, norm_ref, **TOL)
    chex.assert_trees_all_equal_shapes_and_dtypes(clipped, tree)
    scale = max_norm / norm_ref
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(clipped), strict=True):
        expected = np.asarray(x, np.float64) * scale
        rtol = 1e-2 if x.dtype == jnp.bfloat16 else 2e-5
        np.testing.assert_allclose(np.asarray(y, np.float64), expected, rtol=rtol)
    assert clipped["none00"] is None


@pytest.mark.usefixtures("always_concatenate")
@pytest.mark.parametrize("p", ORDS)
def test_empty_and_all_zero_size_trees_have_norm_zero(p: float) -> None:
    for tree in ({}, {"a": None}, {"a": jnp.zeros((0,)), "b": jnp.zeros((0, 3))}):
        norm = jax.jit(lambda t, p=p: clipax.tree.global_norm(t, ord=p))(tree)
        assert norm == 0.0 and norm.dtype == jnp.float32


@pytest.mark.usefixtures("small_buckets")
@hypothesis.given(
    sizes=st.lists(st.integers(0, 300), min_size=0, max_size=30),
    p=st.sampled_from(ORDS),
    seed=st.integers(0, 2**16),
)
def test_bucketed_norm_matches_float64_reference(
    sizes: list[int], p: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    tree = [jnp.asarray(rng.standard_normal(n).astype(np.float32)) for n in sizes]
    norm = clipax.tree.global_norm(tree, ord=p)
    np.testing.assert_allclose(norm, ref_global_norm(tree, p), **TOL)


@pytest.mark.parametrize("p", ORDS)
@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
@pytest.mark.parametrize("same_size", [False, True])
def test_non_finite_leaf_in_a_bucket_makes_every_output_nan(
    p: float, bad: float, same_size: bool
) -> None:
    tree = {"a": jnp.ones(10), "b": jnp.array([1.0, bad]), "c": jnp.ones(3)}
    if same_size:  # "b" and "d" have one size
        tree["d"] = jnp.array([2.0, 3.0])
    buckets, alone = _engine._buckets(jax.tree.leaves(tree))
    assert buckets == [list(range(len(tree)))] and alone == []
    clipped, norm = clipax.tree.clip_by_global_norm(tree, 1.0, ord=p)
    assert not np.isfinite(norm)
    for leaf in jax.tree.leaves(clipped):
        assert np.isnan(np.asarray(leaf)).all()


# Sharding: bucketing never concatenates sharded leaves.


def assert_only_scalar_all_reduces(hlo: str) -> None:
    found = collectives(hlo)
    ops = {op for _, op in found}
    assert ops <= {"all-reduce"}, f"unexpected collectives: {found}"
    for shape, _ in found:
        dims = re.findall(r"\[([^\]]*)\]", shape)
        assert all(d == "" for d in dims), f"non-scalar all-reduce of {shape}"


def sharded_tree(mesh: jax.sharding.Mesh) -> dict:
    """Sharded leaves (small and large) next to small replicated ones."""

    def put(x: jax.Array, spec: P) -> jax.Array:
        return jax.device_put(x, NamedSharding(mesh, spec))

    rng = np.random.default_rng(0)

    def normal(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32))

    return {
        "w": put(normal(16, 8), P("a", "b")),
        "v": put(normal(32), P("b")),
        "u": put(normal(8, 4), P(None, "a")),
        "r1": put(normal(5), P()),
        "r2": put(normal(3, 3), P()),
        "n": None,
    }


@pytest.mark.parametrize(
    "axis_type", [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto]
)
@pytest.mark.parametrize("p", [2.0, math.inf])
@pytest.mark.devices(8)
def test_sharded_leaves_are_never_concatenated(
    axis_type: jax.sharding.AxisType, p: float
) -> None:
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(axis_type,) * 2)
    tree = sharded_tree(mesh)

    def f(t: dict) -> tuple[dict, jax.Array]:
        return clipax.tree.clip_by_global_norm(t, 1.0, ord=p)

    hlo = jax.jit(f).lower(tree).compile().as_text()
    assert_only_scalar_all_reduces(hlo)
    clipped, norm = jax.jit(f)(tree)
    np.testing.assert_allclose(norm, ref_global_norm(tree, p), **TOL)
    for key in ("w", "v", "u", "r1", "r2"):
        assert clipped[key].sharding.is_equivalent_to(
            tree[key].sharding, tree[key].ndim
        ), key
    assert clipped["n"] is None


@pytest.mark.devices(8)
def test_a_traced_value_is_whole_where_the_process_has_one_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[bool] = []

    def probe(x: jax.Array) -> jax.Array:
        seen.append(_engine.is_whole(x))
        return x

    jax.jit(probe)(jnp.ones(3))  # 8 devices: XLA may still split it
    monkeypatch.setattr(jax, "device_count", lambda *args: 1)
    jax.jit(probe)(jnp.ones(4))
    assert seen == [False, True]


@pytest.mark.devices(8)
def test_is_whole_rules() -> None:
    # Axis types named: `jax.make_mesh`'s default is Auto before JAX 0.9.
    explicit = jax.make_mesh(
        (2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
    )
    auto = jax.make_mesh(
        (2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )
    sharded = jax.device_put(jnp.ones(8), NamedSharding(explicit, P("b")))
    replicated = jax.device_put(jnp.ones(8), NamedSharding(explicit, P()))
    auto_replicated = jax.device_put(jnp.ones(8), NamedSharding(auto, P()))
    seen: dict[str, bool] = {}

    def record(name: str) -> Any:
        def probe(x: jax.Array) -> jax.Array:
            seen[name] = _engine.is_whole(x)
            return x

        return probe

    assert _engine.is_whole(jnp.ones(3))  # one device
    assert _engine.is_whole(np.ones(3))
    assert not _engine.is_whole(sharded)
    assert _engine.is_whole(replicated)
    pair = jax.make_mesh((2,), ("a",), devices=jax.devices()[:2])
    assert not _engine.is_whole(  # split over exactly two devices
        jax.device_put(jnp.ones(8), NamedSharding(pair, P("a")))
    )
    jax.jit(record("jit, explicit sharded"))(sharded)
    jax.jit(record("jit, explicit replicated"))(replicated)
    jax.jit(record("jit, auto"))(auto_replicated)
    jax.jit(record("jit, no mesh"))(jnp.ones(8))
    jax.shard_map(
        record("shard_map block"), mesh=explicit, in_specs=P("b"), out_specs=P("b")
    )(sharded)
    jax.jit(
        jax.shard_map(
            record("partial shard_map, sharded over b"),
            mesh=explicit,
            in_specs=P("a"),
            out_specs=P("a"),
            axis_names={"a"},
        )
    )(jax.device_put(jnp.ones((8, 4)), NamedSharding(explicit, P("a", "b"))))
    jax.pmap(record("pmap"))(jnp.ones((8, 3)))
    assert seen == {
        "jit, explicit sharded": False,
        "jit, explicit replicated": True,
        "jit, auto": False,
        "jit, no mesh": jax.device_count() == 1,
        "shard_map block": True,
        "partial shard_map, sharded over b": False,
        "pmap": True,
    }


@pytest.mark.devices(8)
def test_shard_map_blocks_are_bucketed_without_collectives() -> None:
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    tree = {"x": jnp.arange(64.0).reshape(8, 8), "y": jnp.arange(16.0)}
    specs = {"x": P("a", "b"), "y": P("b")}
    tree = jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
    )

    def local_norm(t: dict) -> jax.Array:
        leaves = jax.tree.leaves(t)
        assert all(_engine.is_whole(x) for x in leaves)
        buckets, alone = _engine._buckets(leaves)
        assert buckets == [[0, 1]] and alone == []
        # Each device's blocks as tensors of their own, as `specs=P()` says
        # (with JAX's types off: on, they show the leaves split).
        return clipax.tree.global_norm(t, specs=P())[None, None]

    f = jax.jit(
        jax.shard_map(
            local_norm,
            mesh=mesh,
            in_specs=(specs,),
            out_specs=P("a", "b"),
            check_vma=False,
        )
    )
    hlo = f.lower(tree).compile().as_text()
    assert collectives(hlo) == []
    norms = np.asarray(f(tree))
    x, y = np.arange(64.0).reshape(8, 8), np.arange(16.0)
    for i in range(2):
        for j in range(4):
            block = np.concatenate(
                [x[4 * i : 4 * i + 4, 2 * j : 2 * j + 2].ravel(), y[4 * j : 4 * j + 4]]
            )
            np.testing.assert_allclose(norms[i, j], np.linalg.norm(block), **TOL)


@pytest.mark.parametrize("op", ["global", "per-leaf"])
@xla_output_since("0.10.2", UNFUSED_REDUCTIONS)
def test_bfloat16_leaves_are_not_copied_to_float32(op: str) -> None:
    """The float32 upcast for the norm is fused, never written out whole.

    (On CPU, XLA's YNNPACK reduction does not fuse a float16 -> float32
    conversion, so float16 leaves are still upcast into a temporary there.)
    """
    tree = {f"w{i}": jnp.ones((256, 256), jnp.bfloat16) for i in range(4)}

    def f(t: dict) -> Any:
        if op == "global":
            return clipax.tree.clip_by_global_norm(t, 1.0)
        return clipax.tree.clip_by_norm(t, 1.0)

    compiled = jax.jit(f).lower(tree).compile()
    nbytes = sum(x.nbytes for x in tree.values())
    assert compiled.memory_analysis().temp_size_in_bytes < nbytes / 4
    clipped = compiled(tree)[0] if op == "global" else compiled(tree)
    chex.assert_trees_all_equal_shapes_and_dtypes(clipped, tree)


@pytest.mark.usefixtures("small_buckets")
@pytest.mark.parametrize("p", ORDS)
def test_scaled_partial_sums_equal_sums_of_scaled_leaves(p: float) -> None:
    """`scale` (for a rescaled pass) multiplies every element before the power."""
    tree = ragged_tree(4, (jnp.float32, jnp.bfloat16, jnp.complex64))
    leaves = [x * (1 - 2j) if jnp.iscomplexobj(x) else x for x in jax.tree.leaves(tree)]
    dtype = _engine.tree_accum_dtype(leaves)
    scale = jnp.float32(2.0**-40)
    scaled = [
        np.asarray(x).astype(np.complex64 if jnp.iscomplexobj(x) else np.float32)
        * np.float32(2.0**-40)
        for x in leaves
    ]
    got = total(_engine.partial_sums(leaves, p, dtype, scale=scale), p)
    chex.assert_trees_all_close(got, per_leaf_total(scaled, p, dtype), **TOL)
