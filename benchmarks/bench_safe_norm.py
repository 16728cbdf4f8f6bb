"""What exact norms cost on the common path.

clipax's global norm is exact for every finite input: a fast float32 pass, and
a rescaled pass under `lax.cond` only when the fast sum overflowed or
underflowed. This script times, in one process and interleaved, the compiled
`clipax.tree.global_norm` and `clipax.tree.clip_by_global_norm` against the
plain computation that has no such guard (a float32 sum of squares and its
square root; the clip as `x * min(1, max_norm / norm)`), on trees whose norms
need no rescaling, and prints the medians and their ratios.

    python benchmarks/bench_safe_norm.py [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import clipax


def trees(quick: bool) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    scale = 16 if quick else 1

    def leaves(count: int, size: int, dtype: Any) -> list[jax.Array]:
        return [
            jnp.asarray(rng.normal(size=size // scale), dtype) for _ in range(count)
        ]

    return {
        "1 x 16M float32": leaves(1, 16_000_000, jnp.float32),
        "400 x 40k float32": leaves(400, 40_000, jnp.float32),
        "1 x 16M bfloat16": leaves(1, 16_000_000, jnp.bfloat16),
    }


def plain_norm(tree: Any) -> jax.Array:
    squares = [
        jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)
    ]
    return jnp.sqrt(sum(squares))


def plain_clip(tree: Any, max_norm: float) -> Any:
    norm = plain_norm(tree)
    scale = jnp.minimum(1.0, max_norm / norm)
    return jax.tree.map(lambda x: (x * scale).astype(x.dtype), tree), norm


def median_seconds(fns: list[Callable[[], Any]], repeats: int) -> list[float]:
    """Interleaved timings of already compiled calls; the median of each."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small trees, few runs")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    repeats = args.repeats or (5 if args.quick else 31)
    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
        f"{platform.processor() or platform.machine()}, repeats={repeats}"
    )
    header = f"{'tree':<20} {'what':<22} {'plain ms':>9} {'clipax ms':>10} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for name, tree in trees(args.quick).items():
        cases = {
            "global_norm": (
                jax.jit(plain_norm),
                jax.jit(clipax.tree.global_norm),
                (tree,),
            ),
            "clip_by_global_norm": (
                jax.jit(plain_clip),
                jax.jit(clipax.tree.clip_by_global_norm),
                (tree, 1.0),
            ),
        }
        for what, (plain, ours, call_args) in cases.items():
            jax.block_until_ready(plain(*call_args))
            jax.block_until_ready(ours(*call_args))
            t_plain, t_ours = median_seconds(
                [
                    lambda p=plain, a=call_args: p(*a),
                    lambda o=ours, a=call_args: o(*a),
                ],
                repeats,
            )
            print(
                f"{name:<20} {what:<22} {1e3 * t_plain:9.2f} {1e3 * t_ours:10.2f} "
                f"{t_ours / t_plain:6.2f}"
            )


if __name__ == "__main__":
    main()
