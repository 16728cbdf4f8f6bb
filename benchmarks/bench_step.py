"""The whole training step: `chain(clip_by_global_norm, adamw)` + `apply_updates`.

What a user feels: clipax's `clip_by_global_norm` against optax's in the same
step, on model-shaped trees (random values, the models' parameter shapes).
Run time and compile time are measured with `bench_clipping`'s harness: both
steps in one process, called alternately (medians), compiles after
`jax.clear_caches()` in the order clipax, optax, optax, clipax, ... (the least
of `--compiles` each counts, default 2). The step is `bench_skip.training_step`.

    PYTHONPATH=src python benchmarks/bench_step.py            # every tree
    PYTHONPATH=src python benchmarks/bench_step.py --quick    # smoke run
    PYTHONPATH=src python benchmarks/bench_step.py --trees gpt2-f32,llama1B

The trees: ResNet-50 (161 leaves, 25.6M parameters), GPT-2 small in float32
and bfloat16 (148 leaves, 124M), a Llama-shaped tree (8 layers of width 512,
SwiGLU, 32k vocabulary: 75 leaves, 58M) and a 48-layer GPT-shaped tree
(580 leaves, width 256, the layout of GPT-2 XL at a width a 2-core CPU holds).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

# The harnesses beside this file (its folder is on sys.path when run as a script).
import bench_clipping as bench
import bench_skip
import jax.numpy as jnp
import optax

import clipax

TARGET = 1.1


STEP_TREES = ["resnet50", "gpt2-f32", "gpt2-bf16", "llama8L", "gpt48L"]


def tree_cases(quick: bool, keys: list[str] | None) -> list[tuple[str, Any]]:
    if quick:
        return [("gpt2-tiny f32", bench.gpt2_tree(jnp.float32, small=True))]
    return bench.tree_cases(False, keys or STEP_TREES)


STEPS = {
    "clipax": lambda: optax.chain(clipax.clip_by_global_norm(1.0), optax.adamw(1e-4)),
    "optax": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4)),
}


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument(
        "--compiles",
        type=int,
        default=2,
        help="fresh compiles per step; the least counts (default 2)",
    )
    bench.add_trees_option(parser, STEP_TREES)
    args = parser.parse_args(argv)
    print(f"training step, clipax vs optax clip_by_global_norm: {bench.header()}")
    print(
        "\n| tree | leaves | params | clipax run ms | optax run ms | run ratio "
        "| clipax compile s | optax compile s | compile ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    runs, compiles = [], []
    for name, tree in tree_cases(args.quick, args.trees):
        leaves, count, _ = bench.describe(tree)
        got = bench_skip.measure(tree, STEPS, args.quick, args.compiles)
        (run_c, comp_c), (run_o, comp_o) = got["clipax"], got["optax"]
        runs.append(run_c / run_o)
        compiles.append(comp_c / comp_o)
        print(
            f"| {name} | {leaves} | {count:,} | {run_c * 1e3:.1f} | "
            f"{run_o * 1e3:.1f} | {runs[-1]:.3f} | {comp_c:.3f} | {comp_o:.3f} | "
            f"{compiles[-1]:.3f} |",
            flush=True,
        )
    print(
        f"\ngeometric mean: run {geomean(runs):.3f}, compile {geomean(compiles):.3f}"
        f" (target <= 1.0; no case above {TARGET})"
    )


if __name__ == "__main__":
    main()
