"""The benchmark script runs and prints every row (no timing is asserted)."""

from __future__ import annotations

import os
import pathlib

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


def test_step_benchmark_quick_run_prints_its_row_and_the_geometric_mean() -> None:
    title = "training step, clipax vs optax clip_by_global_norm:"
    lines, cells = _quick_row(STEP_SCRIPT, title, 9)
    assert all(float(c.replace(",", "")) > 0 for c in cells[1:]), cells
    assert any(line.startswith("geometric mean: run ") for line in lines), lines
