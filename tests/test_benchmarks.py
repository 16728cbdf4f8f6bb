"""The benchmark script runs and prints every row (no timing is asserted)."""

from __future__ import annotations

import math
import os
import pathlib
import sys

import chex
import jax
import jax.numpy as jnp
import pytest

from tests import helpers

SCRIPT = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench_clipping.py"
TREES = [
    "1 x 64k f32",
    "40 x 4k f32",
    "100 x 100 f32",
    "gpt2-tiny f32",
    "gpt2-tiny bf16",
    "mixed+None",
]
OPS = ["clip_by_global_norm", "clip_by_norm", "clip"]


def test_quick_run_prints_every_row() -> None:
    src = str(SCRIPT.parents[1] / "src")
    stdout = helpers.run_script(
        SCRIPT,
        "--quick",
        "--device",
        "2",
        XLA_FLAGS=None,  # the benchmark runs on one device, as users do
        PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p),
    )
    lines = stdout.splitlines()
    assert lines[0].startswith("clipax vs optax: jax ")
    for tree in TREES:
        for op in OPS:
            row = [line for line in lines if line.startswith(f"| {tree} | {op} |")]
            assert len(row) == 1, (tree, op)
            cells = [c.strip() for c in row[0].strip("|").split("|")]
            assert len(cells) == 15
            numbers = [float(c) for c in cells[2:]]
            assert all(n >= 0 for n in numbers), row
    assert "### In a chain with adam (median ms)" in stdout
    for i, tree in enumerate(TREES):
        rows = [line for line in lines if line.startswith(f"| {tree} | ")]
        # --quick chains adam with, and times device loops of, the first two trees
        first_two = 1 if i < 2 else 0
        assert len(rows) == 1 + len(OPS) + first_two * (1 + len(OPS)), (tree, rows)
    assert "### Device time (2 passes in one jitted fori_loop; per pass)" in stdout
    for tree in TREES[:2]:
        for op in OPS:
            start = f"| {tree} | {op} (device) |"
            row = [line for line in lines if line.startswith(start)]
            assert len(row) == 1, (tree, op)
            cells = [c.strip() for c in row[0].strip("|").split("|")]
            assert len(cells) == 9
            assert all(float(c) > 0 for c in cells[2:]), row


SKIP_SCRIPT = SCRIPT.with_name("bench_skip.py")


def _quick_row(script: pathlib.Path, title: str, columns: int) -> tuple[list, list]:
    """Runs `script --quick`; checks its title and its one gpt2-tiny row of
    `columns` cells; returns the output's lines and that row's cells."""
    lines = helpers.run_script(script, "--quick", XLA_FLAGS=None).splitlines()
    assert lines[0].startswith(title), lines[:3]
    row = [line for line in lines if line.startswith("| gpt2-tiny f32 |")]
    assert len(row) == 1, lines
    cells = [c.strip() for c in row[0].strip("|").split("|")]
    assert len(cells) == columns, row
    return lines, cells


def test_skip_benchmark_quick_run_prints_its_row() -> None:
    _, cells = _quick_row(SKIP_SCRIPT, "skip_spikes vs apply_if_finite: jax ", 8)
    assert all(float(c) > 0 for c in cells[2:]), cells


STEP_SCRIPT = SCRIPT.with_name("bench_step.py")


STEP_TITLE = "training step, clipax rule vs its reference, + adamw: jax "


def _step_rows(lines: list[str], rule: str) -> tuple[list[list[str]], list[str]]:
    """The measured rows of `rule` (as cells) and its geometric-mean row."""
    rows = [line for line in lines if line.startswith(f"| {rule} |")]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert cells and cells[-1][1] == "geometric mean", rows
    return cells[:-1], cells[-1]


def test_step_benchmark_quick_run_prints_a_row_per_rule_and_the_geometric_mean():
    rules = ["clip_by_global_norm", "clip_by_norm", "agc", "adagc"]
    lines = helpers.run_script(
        STEP_SCRIPT, "--quick", "--rule", ",".join(rules), XLA_FLAGS=None
    ).splitlines()
    assert lines[0].startswith(STEP_TITLE), lines[:3]
    for rule in rules:
        rows, mean = _step_rows(lines, rule)
        assert len(rows) == 1 and len(rows[0]) == 12, rows
        assert rows[0][1] == bench_step.RULES[rule][2]
        assert rows[0][2:4] == ["gpt2-tiny f32", "1 device"], rows
        assert all(float(c.replace(",", "")) > 0 for c in rows[0][4:]), rows
        assert float(mean[8]) == pytest.approx(float(rows[0][8]), abs=1e-3)


def test_step_benchmark_shards_over_forced_devices_in_each_layout() -> None:
    lines = helpers.run_script(
        STEP_SCRIPT, "--quick", "--devices", "2", XLA_FLAGS=None
    ).splitlines()
    assert "2 device(s)" in lines[0], lines[0]
    rows, _ = _step_rows(lines, "clip_by_global_norm")
    assert [row[3] for row in rows] == bench_step.LAYOUTS, rows


def test_step_placer_splits_dimension_zero_only_where_it_divides() -> None:
    tree = {"w": jnp.ones((4, 3)), "b": jnp.ones(3), "s": jnp.ones(())}
    placed = bench_step.placer("fsdp", 2)(tree)
    specs = {k: tuple(v.sharding.spec) for k, v in placed.items()}
    assert specs == {"w": ("data",), "b": (), "s": ()}
    replicated = bench_step.placer("replicated", 2)(tree)
    assert all(v.sharding.is_fully_replicated for v in replicated.values())
    chex.assert_trees_all_equal(placed, tree)


@pytest.mark.parametrize(
    "rule", ["clip_by_norm", "clip_by_norm_axes", "clip_by_norm_axes_peaks", "agc"]
)
def test_each_per_tensor_reference_computes_what_clipax_does(rule) -> None:
    """The per-tensor rules' references give clipax's outputs, so that the
    step benchmark compares only how they are computed."""
    params = {"w": jnp.arange(1.0, 13.0).reshape(3, 4), "b": jnp.full((4,), 0.1)}
    grads = jax.tree.map(lambda x: 3.0 * x[::-1], params)
    ours, theirs = (make() for make in bench_step.RULES[rule][:2])
    got = [tx.update(grads, tx.init(params), params)[0] for tx in (ours, theirs)]
    chex.assert_trees_all_close(got[0], got[1], rtol=1e-6)
    assert not all(
        bool(jnp.allclose(a, b))
        for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(grads), strict=True)
    ), "nothing was clipped: the comparison would prove nothing"


def test_the_reference_keeping_peaks_keeps_clipax_s_norms() -> None:
    params = {"w": jnp.arange(1.0, 13.0).reshape(3, 4), "b": jnp.full((4,), 0.1)}
    ours, theirs = (make() for make in bench_step.RULES["clip_by_norm_axes_peaks"][:2])
    got = [tx.update(params, tx.init(params))[1].norms for tx in (ours, theirs)]
    chex.assert_trees_all_close(got[0], got[1], rtol=1e-6)
    assert float(got[0]["w"]) == pytest.approx(float(jnp.linalg.norm(params["w"][2])))


def test_the_stacked_reference_computes_what_clipax_does_per_layer() -> None:
    grads = {
        "blocks": {"w": jnp.arange(60.0).reshape(3, 4, 5) / 10},
        "wte": jnp.full((4,), 3.0),
    }
    ours, theirs = (make() for make in bench_step.RULES["clip_by_norm_stacked"][:2])
    got = [tx.update(grads, tx.init(grads))[0] for tx in (ours, theirs)]
    chex.assert_trees_all_close(got[0], got[1], rtol=1e-6)
    norms = jnp.linalg.norm(got[0]["blocks"]["w"].reshape(3, -1), axis=1)
    assert jnp.allclose(norms, 1.0)  # each layer clipped to 1 on its own


TRAIN_SCRIPT = SCRIPT.with_name("bench_train_step.py")


def test_train_step_benchmark_quick_run_prints_both_models() -> None:
    # One rule: the script's rows, not the rules (bench_step's tests run them).
    lines = helpers.run_script(
        TRAIN_SCRIPT, "--quick", "--rule", "adagc", XLA_FLAGS=None
    ).splitlines()
    assert lines[0].startswith("whole training step (forward, backward, rule, adamw)")
    for rule in ("adagc",):
        rows = [line for line in lines if line.startswith(f"| {rule} |")]
        cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
        assert [c[2] for c in cells] == ["unrolled", "scanned", ""], cells
        assert cells[-1][1] == "geometric mean"
        assert all(float(c) > 0 for c in cells[0][3:]), cells


# The harness's own pieces, imported (the scripts' folder is not a package).
sys.path.insert(0, str(SCRIPT.parent))
import bench_clipping as bench  # noqa: E402
import bench_skip  # noqa: E402
import bench_step  # noqa: E402


def test_tree_keys_name_the_model_shapes() -> None:
    labels = [label for label, _ in bench.TREES.values()]
    assert len(set(labels)) == len(labels)
    assert set(bench.DEFAULT_TREES) <= set(bench.TREES)
    assert set(bench_step.STEP_TREES) <= set(bench.TREES)
    stacked = bench.TREES["gpt48L-stacked"][1]()
    assert bench.describe(stacked)[:2] == (16, 51_036_928)  # gpt48L's parameters
    assert {x.shape[0] for x in jax.tree.leaves(stacked["blocks"])} == {48}
    for shapes, leaves, params in (
        (bench.gpt2_shapes(), 148, 124_439_808),
        (bench.resnet50_shapes(), 161, 25_557_032),
        (bench.llama_shapes(), 75, 58_073_600),
        (bench.llama_shapes(d=2048, ffn=5632, layers=16), 147, 953_223_168),
    ):
        assert len(shapes) == leaves
        assert sum(math.prod(s) for s in shapes.values()) == params
    [(label, tree)] = bench.tree_cases(False, ["2x4M"])
    assert label == "2 x 4M f32"
    assert [x.shape for x in jax.tree.leaves(tree)] == [(1 << 22,)] * 2


@pytest.mark.parametrize("script", [bench, bench_step])
def test_an_unknown_tree_key_is_refused(script, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--trees", "gpt2-f32,gpt3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--trees: unknown ['gpt3']" in err and "resnet50" in err, err


def test_compiles_sets_the_fresh_builds_per_side(monkeypatch) -> None:
    built = []

    def counting_build(tx, tree, place=None):
        built.append(tx)
        return real_build(tx, tree, place)

    real_build = bench.build
    monkeypatch.setattr(bench, "build", counting_build)
    monkeypatch.setattr(bench, "repeats_for", lambda nbytes, quick: 1)
    rows = bench.bench_tree("tiny", {"a": jnp.ones(3), "b": jnp.ones((2, 2))}, False, 3)
    assert len(built) == 3 * 2 * len(bench.DEFAULT_OPS)
    assert [r.op for r in rows] == bench.DEFAULT_OPS == OPS
    assert all(r.kernels[0] >= 1 and r.kernels[1] >= 1 for r in rows), rows


def test_ops_chooses_the_rows(monkeypatch, capsys) -> None:
    monkeypatch.setattr(bench, "repeats_for", lambda nbytes, quick: 1)
    tiny = {"a": jnp.ones(3), "b": jnp.ones((2, 2))}
    monkeypatch.setattr(bench, "tree_cases", lambda quick, keys: [("tiny", tiny)])
    chosen = ["tree.clip_by_norm", "clip_by_norm+norms"]
    bench.main(["--quick", "--ops", ",".join(chosen)])
    lines = capsys.readouterr().out.splitlines()
    ops = [line.split("|")[2].strip() for line in lines if line.startswith("| tiny |")]
    assert [op for op in ops if op.startswith(("clip", "tree"))] == chosen, lines
    with pytest.raises(SystemExit):
        bench.main(["--ops", "clip_by_norm,clip_by_nrom"])
    err = capsys.readouterr().err
    assert "--ops: unknown ['clip_by_nrom']" in err and "tree.clip_by_norm" in err


def test_the_extra_clip_by_norm_references_compute_what_clipax_does() -> None:
    """Each reference of `--ops` has the same outputs as the clipax side it is
    set against, so that only the way they are computed is compared."""
    tree = {"a": jnp.arange(1.0, 7.0).reshape(2, 3), "b": jnp.full((4,), 0.1)}
    for op in ("tree.clip_by_norm", "clip_by_norm+norms"):
        ours, theirs = (make() for make in bench.OPS[op])
        got = [tx.update(tree, tx.init(tree)) for tx in (ours, theirs)]
        chex.assert_trees_all_close(got[0][0], got[1][0], rtol=1e-6)
        if op == "clip_by_norm+norms":
            chex.assert_trees_all_close(got[0][1].norms, got[1][1].norms, rtol=1e-6)
            assert got[1][1].norms["a"] > bench.MAX_NORM > got[1][1].norms["b"]


def test_kernel_count_counts_each_leafs_kernels() -> None:
    def count(n: int) -> int:
        leaves = [jnp.ones(10 + i) for i in range(n)]
        scaled = jax.jit(lambda ls: [jnp.sum(x * x) for x in ls])
        return bench.kernel_count(scaled.lower(leaves).compile())

    assert 1 <= count(1) < count(4)


@pytest.mark.parametrize("compiles", [1, 2, 3])
def test_step_measure_takes_the_least_of_compiles_in_alternating_order(
    monkeypatch, compiles
) -> None:
    seconds = [5.0, 4.0, 3.0, 6.0, 2.0, 7.0]  # handed out in build order
    built: list[str] = []

    def fake_build(name: str, tree, place=None) -> bench.Built:
        built.append(name)
        return bench.Built(lambda: None, seconds[len(built) - 1], 0, 0)

    monkeypatch.setattr(bench_skip.bench, "build", fake_build)
    monkeypatch.setattr(bench_skip, "training_step", lambda name: name)
    steps = {"ours": lambda: "ours", "theirs": lambda: "theirs"}
    got = bench_skip.measure(jnp.zeros(4), steps, False, compiles)
    order = ["ours", "theirs", "theirs", "ours", "ours", "theirs"][: 2 * compiles]
    assert built == order
    pairs = list(zip(order, seconds[: len(order)], strict=True))
    least = {n: min(s for b, s in pairs if b == n) for n in steps}
    assert {name: compile_s for name, (_, compile_s) in got.items()} == least
