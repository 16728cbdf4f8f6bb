"""Sharded norms: `specs` and `axis_name` under shard_map and pmap, and GSPMD.

On 8 forced CPU devices, a (2, 4) mesh with sharded, replicated and partially
sharded leaves: every result equals the same call on the unsharded arrays.
"""

from __future__ import annotations

import math
import re
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import clipax
from tests import helpers

ORDS = [1, 2, math.inf]

SPECS = {
    "w": P("data", "model"),  # sharded over both axes
    "b": P("model"),  # sharded over one, replicated over the other
    "c": P("data"),  # likewise, the other axis
    "r": P(),  # replicated
    "v": P(None, ("data", "model")),  # one dimension over both axes
    "stack": [P("model", None), P()],
}


def _host_tree(scale: float = 1.0) -> dict[str, Any]:
    rng = np.random.default_rng(7)

    def normal(*shape: int) -> np.ndarray:
        return (scale * rng.normal(size=shape)).astype(np.float32)

    return {
        "w": normal(8, 16),
        "b": normal(16),
        "c": normal(4, 3),
        "r": normal(3, 5),
        "v": normal(2, 24),
        "stack": [normal(4, 6), normal(5)],
    }


@pytest.fixture(scope="module")
def mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 4), ("data", "model"))


def _shard(mesh: jax.sharding.Mesh, tree: Any, specs: Any = SPECS) -> Any:
    return jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
    )


def _shard_map(mesh: jax.sharding.Mesh, fn: Any, out_specs: Any) -> Any:
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(SPECS,), out_specs=out_specs))


@pytest.mark.parametrize("ord", ORDS)
@pytest.mark.devices(8)
def test_global_norm_in_shard_map_equals_one_device(
    mesh: jax.sharding.Mesh, ord: float
) -> None:
    host = _host_tree()
    fn = _shard_map(
        mesh, lambda t: clipax.tree.global_norm(t, ord=ord, specs=SPECS), P()
    )
    got = fn(_shard(mesh, host))
    np.testing.assert_allclose(got, clipax.tree.global_norm(host, ord=ord), rtol=1e-6)
    # Without `specs`, a device's block is not the leaf: refused, naming it.
    local = _shard_map(
        mesh,
        lambda t: clipax.tree.global_norm(t, ord=ord).reshape(1),
        P(("data", "model")),
    )
    with pytest.raises(ValueError, match=r"leaf at \['b'\].*\('data', 'model'\)"):
        local(_shard(mesh, host))


@pytest.mark.parametrize("ord", ORDS)
@pytest.mark.devices(8)
def test_transformation_in_shard_map_equals_one_device(
    mesh: jax.sharding.Mesh, ord: float
) -> None:
    host = _host_tree(scale=3.0)
    tx = clipax.clip_by_global_norm(1.0, ord=ord, specs=SPECS)
    reference = clipax.clip_by_global_norm(1.0, ord=ord)
    expected, expected_state = reference.update(host, reference.init(host))

    def step(t: Any) -> Any:
        return tx.update(t, tx.init(t))

    state_specs = clipax.ClipByGlobalNormState(
        norm=P(), nonfinite_count=P(), threshold=P()
    )
    updates, state = _shard_map(mesh, step, (SPECS, state_specs))(_shard(mesh, host))
    chex.assert_trees_all_close(updates, expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(state.norm, expected_state.norm, rtol=1e-6)


@pytest.mark.parametrize("ord", ORDS)
@pytest.mark.devices(8)
def test_tree_clip_in_shard_map_with_nonfinite_policies(
    mesh: jax.sharding.Mesh, ord: float
) -> None:
    host = _host_tree(scale=3.0)
    expected, norm = clipax.tree.clip_by_global_norm(host, 2.0, ord=ord)
    fn = _shard_map(
        mesh,
        lambda t: clipax.tree.clip_by_global_norm(
            t, 2.0, ord=ord, specs=SPECS, nonfinite="zero"
        ),
        (SPECS, P()),
    )
    got, got_norm = fn(_shard(mesh, host))
    chex.assert_trees_all_close(got, expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got_norm, norm, rtol=1e-6)


@pytest.mark.parametrize("axes", [None, 0, -1])
@pytest.mark.devices(8)
def test_per_leaf_clipping_in_shard_map_equals_one_device(
    mesh: jax.sharding.Mesh, axes: Any
) -> None:
    host = _host_tree(scale=2.0)
    if axes is not None:  # every leaf needs the axis: leave the vector out
        host["b"] = host["b"].reshape(4, 4)
        host["stack"][1] = host["stack"][1].reshape(1, 5)
    tx = clipax.clip_by_norm(1.5, axes=axes, specs=SPECS)
    reference = clipax.clip_by_norm(1.5, axes=axes)
    expected, expected_state = reference.update(host, reference.init(host))

    def step(t: Any) -> Any:
        return tx.update(t, tx.init(t))

    norms_specs = jax.tree.map(lambda _: P(), host)
    updates, state = _shard_map(
        mesh, step, (SPECS, clipax.ClipByNormState(norms=norms_specs))
    )(_shard(mesh, host))
    chex.assert_trees_all_close(updates, expected, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(state.norms, expected_state.norms, rtol=1e-6)


@pytest.mark.parametrize("axes", [None, -1])
@pytest.mark.devices(8)
def test_small_leaves_in_shard_map_equal_one_device(
    mesh: jax.sharding.Mesh, axes: Any
) -> None:
    # Inside shard_map every leaf is a local block: the sums of row-sharded
    # leaves (one of them of large values) are completed across devices
    # together, in one psum; replicated leaves, and per-row norms of
    # row-sharded leaves, need none.
    rng = np.random.default_rng(11)
    host = {
        "rows": [rng.normal(size=(8, 3)).astype(np.float32) for _ in range(5)],
        "reps": [rng.normal(size=(4,)).astype(np.float32) for _ in range(3)],
    }
    host["rows"][2] *= np.float32(1e15)
    specs = {"rows": P("data", None), "reps": P()}
    reference = helpers.clip_with_norms(host, 1.5, axes)
    fn = jax.jit(
        jax.shard_map(
            lambda t: helpers.clip_with_norms(t, 1.5, axes, specs=specs),
            mesh=mesh,
            in_specs=(specs,),
            out_specs=(specs, jax.tree.map(lambda _: P(), specs)),
        )
    )
    sharded = jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
        host,
        {"rows": [specs["rows"]] * 5, "reps": [specs["reps"]] * 3},
    )
    chex.assert_trees_all_close(fn(sharded), reference, rtol=1e-6, atol=1e-7)
    psums = [
        eqn
        for eqn, _ in helpers.equations(jax.make_jaxpr(fn)(sharded).jaxpr)
        if eqn.primitive.name.replace("_invariant", "") == "psum"
    ]
    assert len(psums) == (1 if axes is None else 0), psums  # rows: not reduced


@pytest.mark.devices(8)
def test_local_per_leaf_clipping_keeps_what_each_leaf_varies_over(
    mesh: jax.sharding.Mesh,
) -> None:
    # With `specs=P()` and `check_vma=False` (each device's block a tensor of
    # its own), each leaf is clipped by its block's norm. The leaves vary over
    # different mesh axes (or none), in stacks of small leaves of one shape
    # and as whole leaves. With `check_vma=True` JAX's types show those leaves
    # varying where `specs` says they are the same: refused, naming the leaf.
    rng = np.random.default_rng(5)
    shapes = {"x": (4, 4), "y": (8,), "z": (3,)}
    shapes |= {"s0": (4, 3), "s1": (4, 3), "t0": (8, 3), "t1": (8, 3), "r": (2, 3)}
    host = {k: (3.0 * rng.normal(size=s)).astype(np.float32) for k, s in shapes.items()}
    specs = {"x": P("data"), "y": P("model"), "z": P(), "r": P()}
    specs |= {"s0": P("data"), "s1": P("data"), "t0": P("model"), "t1": P("model")}

    def local(check_vma: bool) -> Any:
        return jax.jit(
            jax.shard_map(
                lambda t: clipax.tree.clip_by_norm(t, 1.0, specs=P()),
                mesh=mesh,
                in_specs=(specs,),
                out_specs=specs,
                check_vma=check_vma,
            )
        )

    got = local(False)(_shard(mesh, host, specs))
    for key, x in host.items():
        blocks = {"data": 2, "model": 4}.get(specs[key][0] if specs[key] else "", 1)
        want = []
        for block in np.split(x.astype(np.float64), blocks):
            norm = np.linalg.norm(block)
            want.append(block * 1.0 / max(norm, 1.0))
        np.testing.assert_allclose(got[key], np.concatenate(want), rtol=1e-6)
        assert np.linalg.norm(x) > 1.0, key  # every leaf is clipped
    with pytest.raises(
        ValueError,
        match=r"`specs` gives P\(\) to the leaf at \['s0'\], which JAX's types show "
        r"varying over the mesh axes \['data'\] of this shard_map",
    ):
        local(True)(_shard(mesh, host, specs))


def _collectives(jaxpr: Any, counts: dict[str, int]) -> None:
    """Counts psum/pmax equations, those inside `cond` branches and `while`
    loops apart (keyed "cond psum", "while psum")."""
    for eqn, inside in helpers.equations(jaxpr):
        name = eqn.primitive.name.replace("_invariant", "")
        if name in ("psum", "pmax"):
            key = f"{inside} {name}" if inside else name
            counts[key] = counts.get(key, 0) + 1


@pytest.mark.devices(8)
def test_one_collective_per_axis_set(mesh: jax.sharding.Mesh) -> None:
    # Axis sets in SPECS: {data, model} (w, v), {model} (b, stack[0]),
    # {data} (c), and none (r, stack[1]): three collectives, not seven.
    host = _host_tree()
    fn = jax.shard_map(
        lambda t: clipax.tree.global_norm(t, specs=SPECS),
        mesh=mesh,
        in_specs=(SPECS,),
        out_specs=P(),
    )
    counts: dict[str, int] = {}
    _collectives(jax.make_jaxpr(fn)(_shard(mesh, host)).jaxpr, counts)
    assert counts == {"psum": 3, "cond psum": 3}, counts
    # (The plain pass takes one psum per axis set, and so does the rescaled
    # pass, in the branch taken only on overflow or underflow.)

    per_leaf = jax.shard_map(
        lambda t: helpers.clip_with_norms(t, 1.0, None, specs=SPECS)[0],
        mesh=mesh,
        in_specs=(SPECS,),
        out_specs=SPECS,
    )
    counts = {}
    _collectives(jax.make_jaxpr(per_leaf)(_shard(mesh, host)).jaxpr, counts)
    # Per axis set, one psum carries the sums of squares, which makes each
    # leaf's norm kept in the state the same on all devices: no pmax is needed.
    assert counts == {"psum": 3}, counts

    inf_norm = jax.shard_map(
        lambda t: clipax.tree.global_norm(t, ord=math.inf, specs=SPECS),
        mesh=mesh,
        in_specs=(SPECS,),
        out_specs=P(),
    )
    counts = {}
    _collectives(jax.make_jaxpr(inf_norm)(_shard(mesh, host)).jaxpr, counts)
    assert counts == {"pmax": 1}, counts


@pytest.mark.parametrize("ord", ORDS)
@pytest.mark.devices(8)
def test_pmap_with_axis_name_over_per_device_shards(ord: float) -> None:
    rng = np.random.default_rng(3)
    full = {
        "w": rng.normal(size=(8, 5, 3)).astype(np.float32),
        "b": rng.normal(size=(8, 7)).astype(np.float32),
    }
    expected, norm = clipax.tree.clip_by_global_norm(full, 1.0, ord=ord)
    tx = clipax.clip_by_global_norm(1.0, ord=ord, axis_name="devices")

    def step(t: Any) -> Any:
        return tx.update(t, tx.init(t))

    updates, state = jax.pmap(step, axis_name="devices")(full)
    chex.assert_trees_all_close(updates, expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(state.norm, np.full(8, norm), rtol=1e-6)

    per_leaf = jax.pmap(
        lambda t: clipax.tree.clip_by_norm(t, 1.0, axis_name="devices"),
        axis_name="devices",
    )(full)
    chex.assert_trees_all_close(
        per_leaf, clipax.tree.clip_by_norm(full, 1.0), rtol=1e-6, atol=1e-7
    )


@pytest.mark.devices(8)
def test_axis_name_and_specs_together(mesh: jax.sharding.Mesh) -> None:
    # Leaves sharded by specs over "model", and split over "data" as well.
    host = {"a": np.arange(32, dtype=np.float32).reshape(8, 4)}
    specs = {"a": P("data", "model")}
    fn = jax.jit(
        jax.shard_map(
            lambda t: clipax.tree.global_norm(
                t, specs={"a": P(None, "model")}, axis_name="data"
            ),
            mesh=mesh,
            in_specs=(specs,),
            out_specs=P(),
        )
    )
    got = fn(_shard(mesh, host, specs))
    np.testing.assert_allclose(got, np.linalg.norm(host["a"]), rtol=1e-6)


@pytest.mark.parametrize(
    ("specs", "error", "match"),
    [
        ({"w": P()}, ValueError, r"no PartitionSpec for the leaf at \['x'\]"),
        (
            {"w": P(), "x": P("data", "model")},
            ValueError,
            # Spelled `P(...)` whichever way this JAX prints a PartitionSpec.
            r"gives P\('data', 'model'\) to the leaf at \['x'\], "
            r"which has rank 1",
        ),
        ({"w": P(), "x": "data"}, TypeError, r"at \['x'\] it holds 'data'"),
        ([P(), P()], ValueError, r"no PartitionSpec for the leaf at \['w'\]"),
    ],
)
def test_mismatched_specs_name_the_leaf(specs: Any, error: type, match: str) -> None:
    tree = {"w": jnp.ones((2, 2)), "x": jnp.ones(3)}
    with pytest.raises(error, match=match):
        clipax.tree.global_norm(tree, specs=specs)
    with pytest.raises(error, match=match):
        clipax.tree.clip_by_norm(tree, 1.0, specs=specs)
    tx = clipax.clip_by_global_norm(1.0, specs=specs)
    with pytest.raises(error, match=match):
        tx.update(tree, tx.init(tree))


def test_specs_may_be_a_prefix_and_cover_masked_leaves() -> None:
    tree = {"layer": {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}, "skip": None}
    specs = {"layer": P(), "skip": P()}
    np.testing.assert_allclose(clipax.tree.global_norm(tree, specs=specs), math.sqrt(6))
    masked = {"layer": {"w": jnp.ones((2, 2)), "b": optax.MaskedNode()}, "skip": None}
    np.testing.assert_allclose(clipax.tree.global_norm(masked, specs=specs), 2.0)


@pytest.mark.parametrize("axis_name", [3, "", ["a", 1], ()])
def test_bad_axis_name(axis_name: Any) -> None:
    with pytest.raises(ValueError, match="`axis_name` must be None, a mesh-axis name"):
        clipax.clip_by_global_norm(1.0, axis_name=axis_name)


def test_axis_name_with_axes_is_refused() -> None:
    with pytest.raises(ValueError, match="`axis_name` cannot be combined with `axes`"):
        clipax.clip_by_norm(1.0, axes=0, axis_name="data")


# GSPMD: jit over NamedSharding arrays, no arguments.

_ALL_REDUCE = re.compile(r"=\s*(\([^)]*\)|\S+)\s+all-reduce(?:-start)?\(")


@pytest.mark.parametrize("ord", ORDS)
@pytest.mark.devices(8)
def test_gspmd_only_scalar_all_reduces(mesh: jax.sharding.Mesh, ord: float) -> None:
    host = _host_tree()
    sharded = _shard(mesh, host)
    tx = clipax.clip_by_global_norm(1.0, ord=ord)
    compiled = jax.jit(tx.update).lower(sharded, tx.init(sharded)).compile()
    hlo = compiled.as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    shapes = _ALL_REDUCE.findall(hlo)
    assert shapes, "the global norm needs at least one all-reduce"
    for shape in shapes:
        dims = re.findall(r"\[([^\]]*)\]", shape)
        assert all(d == "" for d in dims), f"non-scalar all-reduce: {shape}"
    updates, state = compiled(sharded, tx.init(sharded))
    expected, expected_state = tx.update(host, tx.init(host))
    chex.assert_trees_all_close(updates, expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(state.norm, expected_state.norm, rtol=1e-6)
    for got, given in zip(
        jax.tree.leaves(updates), jax.tree.leaves(sharded), strict=True
    ):
        assert got.sharding.is_equivalent_to(given.sharding, got.ndim)


@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: clipax.autoclip(50.0, history=4, **kw),
        lambda **kw: clipax.zclip(warmup_steps=2, **kw),
        lambda **kw: clipax.adagc(warmup_steps=2, max_norm=20.0, **kw),
    ],
    ids=["autoclip", "zclip", "adagc"],
)
@pytest.mark.devices(8)
def test_adaptive_rules_in_shard_map_equal_one_device(
    mesh: jax.sharding.Mesh, make: Any
) -> None:
    tx, reference = make(specs=SPECS), make()
    hosts = [_host_tree(scale) for scale in (1.0, 2.0, 1.5, 40.0, 1.0)]
    state, expected_state = None, reference.init(hosts[0])
    for host in hosts:  # a spike at the fourth step
        expected, expected_state = reference.update(host, expected_state)
        sharded = _shard(mesh, host)
        state_specs = jax.tree.map(lambda _: P(), expected_state)
        if state is None:
            state = tx.init(host)
        step = jax.jit(
            jax.shard_map(
                tx.update,
                mesh=mesh,
                in_specs=(SPECS, state_specs),
                out_specs=(SPECS, state_specs),
            )
        )
        updates, state = step(sharded, state)
        chex.assert_trees_all_close(updates, expected, rtol=1e-5, atol=1e-7)
        chex.assert_trees_all_close(state, expected_state, rtol=1e-5)
