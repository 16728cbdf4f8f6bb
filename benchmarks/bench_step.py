"""The whole training step: `chain(clip_by_global_norm, adamw)` + `apply_updates`.

What a user feels: clipax's `clip_by_global_norm` against optax's in the same
step, on model-shaped trees (random values, the models' parameter shapes).
Run time and compile time are measured with `bench_clipping`'s harness: both
steps in one process, called alternately (medians), compiles after
`jax.clear_caches()` in the order clipax, optax, optax, clipax (the least of
each pair counts). The step is `bench_skip.training_step`.

    PYTHONPATH=src python benchmarks/bench_step.py            # every tree
    PYTHONPATH=src python benchmarks/bench_step.py --quick    # smoke run

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
import numpy as np
import optax

import clipax

TARGET = 1.1


def resnet50_shapes() -> dict[str, tuple[int, ...]]:
    """The parameter shapes of ResNet-50 (convolutions HWIO, batch norms)."""
    shapes: dict[str, tuple[int, ...]] = {}

    def conv_bn(name: str, k: int, cin: int, cout: int) -> None:
        shapes[f"{name}.conv"] = (k, k, cin, cout)
        shapes[f"{name}.bn.scale"] = (cout,)
        shapes[f"{name}.bn.bias"] = (cout,)

    conv_bn("stem", 7, 3, 64)
    cin = 64
    stages = zip((3, 4, 6, 3), (64, 128, 256, 512), strict=True)
    for stage, (blocks, width) in enumerate(stages):
        for block in range(blocks):
            name = f"s{stage}.b{block}"
            conv_bn(f"{name}.c1", 1, cin, width)
            conv_bn(f"{name}.c2", 3, width, width)
            conv_bn(f"{name}.c3", 1, width, 4 * width)
            if block == 0:
                conv_bn(f"{name}.proj", 1, cin, 4 * width)
            cin = 4 * width
    shapes["fc.w"] = (cin, 1000)
    shapes["fc.b"] = (1000,)
    return shapes


def llama_shapes(
    vocab: int = 32000, d: int = 512, ffn: int = 1376, layers: int = 8
) -> dict[str, tuple[int, ...]]:
    """A Llama-shaped tree: RMSNorm scales, q/k/v/o, SwiGLU, untied head."""
    shapes: dict[str, tuple[int, ...]] = {"embed": (vocab, d)}
    for i in range(layers):
        block = {
            "attn_norm": (d,),
            "wq": (d, d),
            "wk": (d, d),
            "wv": (d, d),
            "wo": (d, d),
            "mlp_norm": (d,),
            "w_gate": (d, ffn),
            "w_up": (d, ffn),
            "w_down": (ffn, d),
        }
        shapes.update({f"l{i:02d}.{k}": v for k, v in block.items()})
    shapes.update({"final_norm": (d,), "lm_head": (d, vocab)})
    return shapes


def tree_of(shapes: dict[str, tuple[int, ...]], dtype: Any) -> Any:
    rng = np.random.default_rng(3)
    leaves = bench._leaves(rng, list(shapes.values()), dtype)
    return dict(zip(shapes, leaves, strict=True))


def tree_cases(quick: bool) -> list[tuple[str, Any]]:
    if quick:
        return [("gpt2-tiny f32", bench.gpt2_tree(jnp.float32, small=True))]
    return [
        ("resnet-50 f32", tree_of(resnet50_shapes(), jnp.float32)),
        ("gpt2 124M f32", bench.gpt2_tree(jnp.float32)),
        ("gpt2 124M bf16", bench.gpt2_tree(jnp.bfloat16)),
        ("llama 8L f32", tree_of(llama_shapes(), jnp.float32)),
        ("gpt 48L f32", tree_of(bench.gpt2_shapes(d=256, layers=48), jnp.float32)),
    ]


STEPS = {
    "clipax": lambda: optax.chain(clipax.clip_by_global_norm(1.0), optax.adamw(1e-4)),
    "optax": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4)),
}


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    args = parser.parse_args(argv)
    print(f"training step, clipax vs optax clip_by_global_norm: {bench.header()}")
    print(
        "\n| tree | leaves | params | clipax run ms | optax run ms | run ratio "
        "| clipax compile s | optax compile s | compile ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    runs, compiles = [], []
    for name, tree in tree_cases(args.quick):
        leaves, count, _ = bench.describe(tree)
        got = bench_skip.measure(tree, STEPS, args.quick)
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
