"""The cost of `clipax.skip_spikes` in a training step, against `optax.apply_if_finite`.

One training step is `tx.update` + `optax.apply_updates` under `jax.jit`, with
`tx` = `skip_spikes(chain(clipax.clip_by_global_norm, adamw))` against
`apply_if_finite(chain(clipax.clip_by_global_norm, adamw))` (the same inner
chain: the difference is the wrapper), on GPT-2-shaped trees. Run time and
compile time are measured with `bench_clipping`'s harness: both steps in one
process, called alternately (medians), compiles after `jax.clear_caches()`
in the order skip, optax, optax, skip (the least of each pair counts).

    PYTHONPATH=src python benchmarks/bench_skip.py            # GPT-2 small
    PYTHONPATH=src python benchmarks/bench_skip.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
from typing import Any

# The harness beside this file (its folder is on sys.path when run as a script).
import bench_clipping as bench
import jax.numpy as jnp
import optax

import clipax

TARGET = 1.05


def training_step(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """A training step as a transformation, for `bench.build`: its state is
    `(params, opt_state)` and its update applies the updates to the params."""

    def init(params: Any) -> tuple:
        return params, tx.init(params)

    def update(grads: Any, state: tuple, params: Any = None) -> tuple:
        del params
        params, opt_state = state
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, (params, opt_state)

    return optax.GradientTransformation(init, update)


def inner() -> optax.GradientTransformation:
    return optax.chain(clipax.clip_by_global_norm(1.0), optax.adamw(1e-4))


STEPS = {
    "skip_spikes": lambda: clipax.skip_spikes(inner()),
    "apply_if_finite": lambda: optax.apply_if_finite(inner(), 10),
}


def measure(
    tree: Any,
    steps: dict[str, Any],
    quick: bool,
    compiles: int = 2,
    place: Any = None,
) -> dict[str, tuple[float, float]]:
    """Median run seconds and least compile seconds of each of the two steps
    (`steps` maps a name to a factory of the step's transformation), from
    `compiles` fresh compiles of each (1 when `quick`), in the order clipax's,
    the reference's, the reference's, clipax's, and so on; `place` puts the
    tree and the state on devices (`bench_clipping.build`)."""
    names = list(steps)
    ours, theirs = bench.build_pair(
        lambda: training_step(steps[names[0]]()),
        lambda: training_step(steps[names[1]]()),
        tree,
        1 if quick else compiles,
        place,
    )
    reps = bench.repeats_for(bench.describe(tree)[2], quick)
    t_ours, t_theirs = bench.interleaved([ours.call, theirs.call], reps)
    return {
        names[0]: (t_ours, ours.compile_s),
        names[1]: (t_theirs, theirs.compile_s),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    args = parser.parse_args(argv)
    cases = [("gpt2-tiny f32", bench.gpt2_tree(jnp.float32, small=True))]
    if not args.quick:
        cases.append(("gpt2-small f32", bench.gpt2_tree(jnp.float32)))
    print(f"skip_spikes vs apply_if_finite: {bench.header()}")
    print(
        "\n| tree | params | skip_spikes run ms | apply_if_finite run ms | run ratio "
        "| skip_spikes compile s | apply_if_finite compile s | compile ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, tree in cases:
        _, count, _ = bench.describe(tree)
        got = measure(tree, STEPS, args.quick)
        (run_s, comp_s), (run_o, comp_o) = got["skip_spikes"], got["apply_if_finite"]
        print(
            f"| {name} | {count:,} | {run_s * 1e3:.2f} | {run_o * 1e3:.2f} | "
            f"{run_s / run_o:.3f} | {comp_s:.3f} | {comp_o:.3f} | "
            f"{comp_s / comp_o:.3f} |",
            flush=True,
        )
    print(f"\ntarget: both ratios <= {TARGET}")


if __name__ == "__main__":
    main()
