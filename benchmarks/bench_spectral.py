"""How close `clip_by_spectral_norm`'s Newton-Schulz iterations come to the exact clip.

Prints, as Markdown for docs/spectral.md:
- the relative error (Frobenius, against the float64 SVD of the soft clip
  sigma / sqrt(1 + sigma**2 / c**2)) of the float32 result for ratios
  sigma_max / c and step counts, for clipax's scaled iteration
  (`method="newton_schulz"`) and SPECTRA's (`method="spectra"`): the worst
  over three kinds of matrix (a Gaussian one, one whose singular values fall
  over four decades, a Gaussian bulk below c plus a rank-one spike);
- the steps each needs to reach 1e-4 (or the float32 floor it stops at);
- the worst case in exact arithmetic: the largest alpha = 1 + bound / c**2 (the
  Gram matrix's eigenvalue bound) for which k steps are within 1 % and 1e-4;
- how far below sigma_max the 32 power steps on the Gram matrix land;
- (`--timings`) the cost of one update by each method, and of sigma_max by
  power steps against `jnp.linalg.norm(x, 2)`.

    PYTHONPATH=src python benchmarks/bench_spectral.py [--quick] [--timings]
"""

from __future__ import annotations

import argparse
import platform
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import clipax
from clipax import _spectral

KINDS = ("gauss", "decades", "spike")
RATIOS = (1.0, 10.0, 50.0, 100.0, 300.0, 1000.0)
SHOWN = (5, 8, 10, 12, 16, 20)  # the steps printed; 1e-4 is looked for in all


def matrix(kind: str, shape: tuple[int, int], ratio: float, seed: int = 0) -> Any:
    """A float64 matrix of `kind` whose largest singular value is `ratio`."""
    rng = np.random.default_rng(seed)
    m, n = shape
    if kind == "decades":
        u, _ = np.linalg.qr(rng.standard_normal((m, min(m, n))))
        v, _ = np.linalg.qr(rng.standard_normal((n, min(m, n))))
        x = (u * np.logspace(0, -4, min(m, n))) @ v.T
    else:
        x = rng.standard_normal(shape)
        x /= np.linalg.norm(x, 2)
    if kind == "spike":
        a, b = rng.standard_normal(m), rng.standard_normal(n)
        x = x + ratio * np.outer(a / np.linalg.norm(a), b / np.linalg.norm(b))
    return x * ratio / np.linalg.norm(x, 2)


def exact(x: Any, c: float = 1.0) -> Any:
    u, s, vt = np.linalg.svd(x, full_matrices=False)
    return (u * (s / np.sqrt(1 + (s / c) ** 2))) @ vt


def error_table(
    ratios: tuple[float, ...] = RATIOS,
    steps: tuple[int, ...] = (5, 8, 10, 12, 16, 20),
    shape: tuple[int, int] = (128, 64),
    methods: tuple[str, ...] = ("newton_schulz", "spectra"),
) -> dict[tuple[str, int], dict[float, float]]:
    """Per (method, steps), per ratio: the worst relative error over KINDS."""
    cases = [(r, matrix(kind, shape, r)) for r in ratios for kind in KINDS]
    wants = [exact(x) for _, x in cases]
    out: dict[tuple[str, int], dict[float, float]] = {}
    for method in methods:
        for k in steps:
            tx = clipax.clip_by_spectral_norm(1.0, method=method, ns_steps=k)
            update = jax.jit(tx.update)
            state = tx.init(jnp.zeros(shape))
            row = out.setdefault((method, k), {})
            for (r, x), want in zip(cases, wants, strict=True):
                y = np.asarray(
                    update(jnp.asarray(x, jnp.float32), state)[0], np.float64
                )
                error = np.linalg.norm(y - want) / np.linalg.norm(want)
                row[r] = max(row.get(r, 0.0), float(error))
    return out


def worst_case(alpha: float, steps: int, scaled: bool = True) -> float:
    """The largest relative error of Z = A^(-1/2) after `steps` steps in
    exact arithmetic, over every A whose spectrum lies in [1/alpha, 1]."""
    low = 1 / alpha
    for _ in range(steps):
        s = min(3 / (1 + np.sqrt(low) + low), _spectral.CAP) if scaled else 1.0
        low = min(s * low * (3 - s * low) ** 2, s * (3 - s) ** 2) / 4
    return 1 - float(np.sqrt(low))


def largest_alpha(steps: int, target: float, scaled: bool = True) -> float:
    """The largest alpha (on a grid of 100 per decade) within `target`."""
    grid = np.logspace(0, 14, 1401)
    return float(max(a for a in grid if worst_case(a, steps, scaled) <= target))


def power_accuracy(shapes: tuple[tuple[int, int], ...]) -> dict:
    """Per kind and shape, 1 - (the power steps' sigma_max) / sigma_max."""
    out = {}
    for kind in KINDS:
        for shape in shapes:
            x = matrix(kind, shape, 10.0, seed=1)
            tx = clipax.clip_by_spectral_norm(1.0)
            _, state = jax.jit(tx.update)(jnp.asarray(x, jnp.float32), tx.init(x))
            out[kind, shape] = 1 - float(state.sigma_max) / np.linalg.norm(x, 2)
    return out


def median_ms(fn: Any, *args: Any, repeats: int = 7) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def timings(shapes: tuple[tuple[int, int], ...]) -> list[list[Any]]:
    """Per shape: ms of one update by each method, of the power steps alone,
    and of `jnp.linalg.norm(x, 2)` (an SVD)."""
    rows = []
    for shape in shapes:
        x = jnp.asarray(matrix("gauss", shape, 10.0), jnp.float32)
        row: list[Any] = [f"{shape[0]} x {shape[1]}"]
        for method in ("newton_schulz", "svd"):
            tx = clipax.clip_by_spectral_norm(1.0, method=method)
            row.append(median_ms(jax.jit(tx.update), x, tx.init(x)))
        g = x.T @ x if shape[0] >= shape[1] else x @ x.T
        row.append(median_ms(jax.jit(_spectral.top_singular_value), g))
        row.append(median_ms(jax.jit(lambda x: jnp.linalg.norm(x, 2)), x))
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small matrices")
    parser.add_argument("--timings", action="store_true", help="also time them")
    args = parser.parse_args()
    shape = (48, 32) if args.quick else (128, 64)
    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
        f"{platform.processor() or platform.machine()}; float32, shape {shape}\n"
    )
    table = error_table(shape=shape, steps=tuple(range(4, 25)))
    print("| method | steps | " + " | ".join(f"{r:g}" for r in RATIOS) + " |")
    print("|---|---|" + "---|" * len(RATIOS))
    for (method, k), row in table.items():
        if k not in SHOWN:
            continue
        cells = " | ".join(f"{row[r]:.1e}" for r in RATIOS)
        print(f"| {method} | {k} | {cells} |")
    print("\nSteps to 1e-4 (the float32 floor where it is never reached):\n")
    print("| method | " + " | ".join(f"{r:g}" for r in RATIOS) + " |")
    print("|---|" + "---|" * len(RATIOS))
    for method in ("newton_schulz", "spectra"):
        cells = []
        for r in RATIOS:
            rows = [(k, table[method, k][r]) for (m, k) in table if m == method]
            hit = [k for k, e in rows if e <= 1e-4]
            floor = min(e for _, e in rows)
            cells.append(str(min(hit)) if hit else f"never: {floor:.1e}")
        print(f"| {method} | " + " | ".join(cells) + " |")
    print("\nExact arithmetic, the largest alpha = 1 + bound / c**2 within:\n")
    print("| steps | scaled 1 % | scaled 1e-4 | spectra 1 % | spectra 1e-4 |")
    print("|---|---|---|---|---|")
    for k in range(5, 13):
        cells = [largest_alpha(k, t, s) for s in (True, False) for t in (1e-2, 1e-4)]
        print(f"| {k} | " + " | ".join(f"{a:.1e}" for a in cells) + " |")
    shapes = ((64, 64), (256, 128), (1024, 1024)) if not args.quick else ((64, 32),)
    print("\nsigma_max by power steps, 1 - estimate / sigma_max:\n")
    for (kind, s), gap in power_accuracy(shapes).items():
        print(f"| {kind} | {s[0]} x {s[1]} | {gap:.1e} |")
    if args.timings:
        print(
            "\n| shape | newton_schulz ms | svd ms | power steps ms | norm(x, 2) ms |"
        )
        print("|---|---|---|---|---|")
        for row in timings(((256, 256), (1024, 1024), (2048, 1024))):
            print(f"| {row[0]} | " + " | ".join(f"{v:.2f}" for v in row[1:]) + " |")


if __name__ == "__main__":
    main()
