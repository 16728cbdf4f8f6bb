"""The whole training step: `chain(rule, adamw)` + `apply_updates`.

What a user feels: a clipax rule against what it replaces, in the same step,
on model-shaped trees (random values, the models' parameter shapes). Run time
and compile time are measured with `bench_clipping`'s harness: both steps in
one process, called alternately (medians), compiles after `jax.clear_caches()`
in the order clipax, reference, reference, clipax, ... (the least of
`--compiles` each counts, default 2). The step is `bench_skip.training_step`.

    PYTHONPATH=src python benchmarks/bench_step.py            # every tree
    PYTHONPATH=src python benchmarks/bench_step.py --quick    # smoke run
    PYTHONPATH=src python benchmarks/bench_step.py --trees gpt2-f32,llama8L
    PYTHONPATH=src python benchmarks/bench_step.py --rule clip_by_norm,agc
    PYTHONPATH=src python benchmarks/bench_step.py --devices 8 --trees gpt48L

`--rule` picks the rules (see `RULES`: each with the step it is measured
against). `--devices N` forces N host devices (set before JAX starts) and
places every array with a `NamedSharding` over a one-axis mesh with automatic
axes (GSPMD under `jax.jit`), in each of `--layouts`: `replicated` (every
array whole on every device) and `fsdp` (dimension 0 split over the mesh where
it divides, as fully sharded data parallelism does; the rest replicated).

The trees: ResNet-50 (161 leaves, 25.6M parameters), GPT-2 small in float32
and bfloat16 (148 leaves, 124M), a Llama-shaped tree (8 layers of width 512,
SwiGLU, 32k vocabulary: 75 leaves, 58M), a 48-layer GPT-shaped tree (580
leaves, width 256, the layout of GPT-2 XL at a width a 2-core CPU holds), and
the same 48 layers stacked as `nn.scan` stacks them (`gpt48L-stacked`: 16
leaves, the `*_stacked` rules).
"""

from __future__ import annotations

import os
import sys


def _forced_devices(argv: list[str]) -> int:
    """The `--devices N` of `argv` (1 without it), read before JAX starts."""
    for i, arg in enumerate(argv):
        if arg == "--devices" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--devices="):
            return int(arg.split("=", 1)[1])
    return 1


if __name__ == "__main__" and _forced_devices(sys.argv) > 1:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={_forced_devices(sys.argv)}"
    ).strip()

import argparse  # noqa: E402
import functools  # noqa: E402
from collections.abc import Callable  # noqa: E402
from statistics import geometric_mean as geo  # noqa: E402
from typing import Any  # noqa: E402

# The harnesses beside this file (its folder is on sys.path when run as a script).
import bench_clipping as bench  # noqa: E402
import bench_skip  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import clipax  # noqa: E402

STEP_TREES = ["resnet50", "gpt2-f32", "gpt2-bf16", "llama8L", "gpt48L"]
MAX_NORM = 1.0


def bare_clip_by_norm(axes: Any = None) -> optax.GradientTransformation:
    """The per-leaf rule as a user writes it without clipax: `jax.tree.map` of
    `g * c / max(norm(g), c)`, the norm over `axes` (the whole leaf for None)."""
    return bench.stateless(
        lambda tree: jax.tree.map(
            lambda g: bench.bare_clip_over(g, axes, MAX_NORM), tree
        )
    )


def bare_clip_by_norm_keeping_peaks(axes: Any) -> optax.GradientTransformation:
    """`bare_clip_by_norm(axes)` that also keeps each leaf's largest norm over
    its slices in its state, as `clipax.clip_by_norm` does: the same outputs."""
    return bench.optax_clip_by_norm_keeping_norms(
        MAX_NORM, lambda g: bench.bare_norm_over(g, axes), peak=jnp.max
    )


def stacked(updates: Any) -> Any:
    """The `stacked=` prefix of the stacked trees: their `blocks` stack layers
    (none of the other trees has a `blocks` subtree)."""
    return clipax.stacked_prefix(updates, path="^blocks/")


def bare_clip_by_norm_stacked() -> optax.GradientTransformation:
    """The bare formula with each stacked layer a tensor: the norm over every
    axis of a `blocks` leaf but the first."""

    def clip(path: Any, g: jax.Array) -> jax.Array:
        inner = "blocks" in jax.tree_util.keystr(path)
        return bench.bare_clip_over(
            g, tuple(range(1, g.ndim)) if inner else None, MAX_NORM
        )

    return bench.stateless(lambda tree: jax.tree_util.tree_map_with_path(clip, tree))


def _optax_global() -> optax.GradientTransformation:
    return optax.clip_by_global_norm(MAX_NORM)


# Each rule: (clipax's transformation, the reference, the reference's label).
# Both are chained with `optax.adamw(1e-4)`.
RULES: dict[str, tuple[Callable[[], Any], Callable[[], Any], str]] = {
    "clip_by_global_norm": (
        lambda: clipax.clip_by_global_norm(MAX_NORM),
        _optax_global,
        "optax.clip_by_global_norm",
    ),
    "clip_by_norm": (
        lambda: clipax.clip_by_norm(MAX_NORM),
        bare_clip_by_norm,
        "the bare tree.map formula",
    ),
    "clip_by_norm_axes": (
        lambda: clipax.clip_by_norm(MAX_NORM, axes=-1),
        lambda: bare_clip_by_norm(axes=-1),
        "the bare formula per row (axes=-1)",
    ),
    # The same, against the bare formula that also keeps each leaf's largest
    # row norm in its state, as clipax does.
    "clip_by_norm_axes_peaks": (
        lambda: clipax.clip_by_norm(MAX_NORM, axes=-1),
        lambda: bare_clip_by_norm_keeping_peaks(axes=-1),
        "the bare formula per row, keeping each leaf's largest row norm",
    ),
    "agc": (
        lambda: clipax.adaptive_grad_clip(0.01),
        lambda: optax.adaptive_grad_clip(0.01),
        "optax.adaptive_grad_clip",
    ),
    "adagc": (clipax.adagc, _optax_global, "optax.clip_by_global_norm"),
    # On stacked trees (`gpt48L-stacked`): each layer of a block leaf a tensor.
    "clip_by_norm_stacked": (
        lambda: clipax.clip_by_norm(MAX_NORM, stacked=stacked),
        bare_clip_by_norm_stacked,
        "the bare formula per layer",
    ),
    "agc_stacked": (
        lambda: clipax.adaptive_grad_clip(0.01, stacked=stacked),
        lambda: optax.adaptive_grad_clip(0.01),
        "optax.adaptive_grad_clip",
    ),
    "adagc_stacked": (
        lambda: clipax.adagc(stacked=stacked),
        _optax_global,
        "optax.clip_by_global_norm",
    ),
    "zclip": (clipax.zclip, _optax_global, "optax.clip_by_global_norm"),
    "autoclip": (clipax.autoclip, _optax_global, "optax.clip_by_global_norm"),
    "skip_spikes": (
        lambda: clipax.skip_spikes(clipax.clip_by_global_norm(MAX_NORM)),
        _optax_global,
        "optax.clip_by_global_norm",
    ),
}
LAYOUTS = ["replicated", "fsdp"]


def steps_of(rule: str) -> dict[str, Callable[[], optax.GradientTransformation]]:
    ours, theirs, _ = RULES[rule]
    return {
        "clipax": lambda: optax.chain(ours(), optax.adamw(1e-4)),
        "reference": lambda: optax.chain(theirs(), optax.adamw(1e-4)),
    }


def tree_cases(quick: bool, keys: list[str] | None) -> list[tuple[str, Any]]:
    if quick:
        return [("gpt2-tiny f32", bench.gpt2_tree(jnp.float32, small=True))]
    return bench.tree_cases(False, keys or STEP_TREES)


def placer(layout: str, count: int) -> Callable[[Any], Any]:
    """Puts every array of a tree on `count` devices, as `layout` says."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:count]), ("data",))

    def place(x: Any) -> Any:
        x = jnp.asarray(x)
        split = layout == "fsdp" and x.ndim >= 1 and x.shape[0] % count == 0
        spec = PartitionSpec("data") if split else PartitionSpec()
        return jax.device_put(x, NamedSharding(mesh, spec))

    return functools.partial(jax.tree.map, place)


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
    bench.add_keys_option(
        parser,
        "--rule",
        RULES,
        ["clip_by_global_norm"],
        "rules",
        ["clip_by_global_norm"],
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=1,
        help="force this many host devices and shard the arrays (default 1)",
    )
    bench.add_keys_option(
        parser,
        "--layouts",
        {k: k for k in LAYOUTS},
        LAYOUTS,
        "layouts (with --devices)",
        LAYOUTS,
    )
    args = parser.parse_args(argv)
    if args.devices > jax.device_count():
        parser.error(f"--devices {args.devices}: JAX has {jax.device_count()}")
    layouts = args.layouts if args.devices > 1 else [None]
    print(f"training step, clipax rule vs its reference, + adamw: {bench.header()}")
    print(
        "\n| rule | against | tree | layout | leaves | params | clipax run ms "
        "| reference run ms | run ratio | clipax compile s | reference compile s "
        "| compile ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    cases = tree_cases(args.quick, args.trees)
    for rule in args.rule:
        runs, compiles = [], []
        for name, tree in cases:
            leaves, count, _ = bench.describe(tree)
            for layout in layouts:
                place = None if layout is None else placer(layout, args.devices)
                placed = tree if place is None else place(tree)  # once, shared
                got = bench_skip.measure(
                    placed, steps_of(rule), args.quick, args.compiles, place
                )
                del placed
                (run_c, comp_c), (run_o, comp_o) = got["clipax"], got["reference"]
                runs.append(run_c / run_o)
                compiles.append(comp_c / comp_o)
                where = layout or "1 device"
                print(
                    f"| {rule} | {RULES[rule][2]} | {name} | {where} | {leaves} | "
                    f"{count:,} | {run_c * 1e3:.1f} | {run_o * 1e3:.1f} | "
                    f"{runs[-1]:.3f} | {comp_c:.3f} | {comp_o:.3f} | "
                    f"{compiles[-1]:.3f} |",
                    flush=True,
                )
        print(
            f"| {rule} | geometric mean | | | | | | | {geo(runs):.3f} | | | "
            f"{geo(compiles):.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
