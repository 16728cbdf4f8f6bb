"""A spike study: which clipping rule survives which kind of gradient spike.

A Flax MLP (`_digits.MLP`) learns scikit-learn's bundled handwritten digits (no
download) with SGD + momentum, once per rule, from the same initialisation and
on the same batches. At known steps the gradient is broken on purpose:

- two global spikes: every gradient leaf multiplied by 100 (a bad batch);
- a local spike: one tensor (the first layer's kernel) multiplied by 1000,
  the others untouched (one bad layer, e.g. an embedding row);
- one NaN step: one tensor's gradient is NaN (an overflow).

The rules, each the whole optimizer a user would write:

- no clipping: `sgd` (SGD with momentum 0.9);
- fixed: `chain(clipax.clip_by_global_norm(2.0), sgd)`;
- apply_if_finite: `optax.apply_if_finite(sgd, ...)`;
- zclip, autoclip, adagc: `chain(clipax.<rule>(...), sgd)`;
- skip_spikes: `clipax.skip_spikes(chain(clipax.clip_by_global_norm(2.0), sgd))`.

Every step logs `clipax.metrics(opt_state)` (every statistic clipax keeps, as
a flat mapping) to `spikes_metrics.jsonl`, under a tqdm progress bar, and the
script writes `spikes.png`
(loss, pre-clip norm, threshold and skipped steps per rule) and one summary
line per rule: the loss before the first spike, the worst loss after it, the
final loss and test accuracy, how many steps were clipped and skipped.

    python examples/spikes.py              # 7 x 400 steps, ~45 s on a CPU
    python examples/spikes.py --steps 60   # smoke run
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, TextIO

import _digits
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from tqdm import tqdm

import clipax

matplotlib.use("Agg")
import matplotlib.pyplot as plt

OUTPUT = "spikes.png"
LOG = "spikes_metrics.jsonl"  # one line per rule and step: clipax.metrics
BATCH = 64
LEARNING_RATE = 0.05
MAX_NORM = 2.0  # the fixed threshold; also AdaGC's warm-up threshold
GLOBAL_FACTOR = 100.0
LOCAL_FACTOR = 1000.0
LOCAL_LEAF = ("params", "Dense_0", "kernel")  # the tensor of the local spike
OTHER_LEAF = ("params", "Dense_2", "kernel")  # a tensor the local spike spares
COLORS = {
    "no clipping": "tab:gray",
    "fixed": "tab:blue",
    "apply_if_finite": "tab:purple",
    "zclip": "tab:green",
    "autoclip": "tab:orange",
    "adagc": "tab:red",
    "skip_spikes": "tab:brown",
}


def spike_schedule(steps: int) -> dict[int, str]:
    """The broken steps: two global spikes, a local one, then a NaN."""
    kinds = {0.3: "global", 0.45: "global", 0.6: "local", 0.8: "nan"}
    return {int(steps * at): kind for at, kind in kinds.items()}


def rules(steps: int) -> dict[str, optax.GradientTransformation]:
    """Each rule as the whole optimizer; the warm-ups take an eighth of the run."""
    warmup = max(1, steps // 8)

    def sgd() -> optax.GradientTransformation:
        return optax.sgd(LEARNING_RATE, momentum=0.9)

    return {
        "no clipping": sgd(),
        "fixed": optax.chain(clipax.clip_by_global_norm(MAX_NORM), sgd()),
        "apply_if_finite": optax.apply_if_finite(sgd(), max_consecutive_errors=5),
        "zclip": optax.chain(clipax.zclip(warmup_steps=warmup), sgd()),
        "autoclip": optax.chain(clipax.autoclip(10.0), sgd()),
        "adagc": optax.chain(
            clipax.adagc(warmup_steps=warmup, max_norm=MAX_NORM), sgd()
        ),
        "skip_spikes": clipax.skip_spikes(
            optax.chain(clipax.clip_by_global_norm(MAX_NORM), sgd()),
            warmup_steps=warmup,
        ),
    }


def break_gradient(grads: Any, kind: jax.Array) -> Any:
    """`kind` 0: as is; 1: all x100; 2: one tensor x1000; 3: one tensor NaN."""

    def leaf(path: Any, g: jax.Array) -> jax.Array:
        local = tuple(getattr(k, "key", k) for k in path) == LOCAL_LEAF
        factor = jnp.select(
            [kind == 1, (kind == 2) & local, (kind == 3) & local],
            [GLOBAL_FACTOR, LOCAL_FACTOR, jnp.nan],
            1.0,
        )
        return g * factor

    return jax.tree_util.tree_map_with_path(leaf, grads)


KINDS = {"global": 1, "local": 2, "nan": 3}


def read_row(
    metrics: dict[str, float], opt_state: Any, raw_norm: float
) -> dict[str, float]:
    """What the figure shows, from `clipax.metrics` (keys end in the statistic's
    name): the pre-clip global norm, the threshold as a global norm (NaN where
    the rule has none; AdaGC's per-tensor thresholds combined), whether the
    step was clipped (any tensor) and skipped, and the factor `OTHER_LEAF`'s
    gradient was scaled by."""

    def ending(suffix: str) -> list[float]:
        return [v for k, v in metrics.items() if k.endswith(suffix)]

    norms = ending("/norm")
    norm = norms[0] if norms else raw_norm  # the outermost: the global one
    thresholds = ending("/threshold")
    threshold = math.nan
    if len(thresholds) == 1:
        threshold = thresholds[0]
    elif thresholds:  # adagc: one per tensor
        threshold = math.sqrt(sum(t * t for t in thresholds))
    other = "/".join(OTHER_LEAF) + "/clip_factor"
    factors = ending(other) or ending("/clip_factor") or [1.0]
    skipped = bool(ending("/skipped") and ending("/skipped")[0])
    for _, last_finite in optax.tree.get_all_with_path(opt_state, "last_finite"):
        skipped = not bool(last_finite)  # optax.apply_if_finite's own state
    return {
        "norm": norm,
        "threshold": threshold,
        "clipped": any(ending("/clipped")),
        "skipped": skipped,
        "kept": 0.0 if skipped else factors[0],
    }


def train(
    name: str,
    tx: optax.GradientTransformation,
    data: tuple[np.ndarray, ...],
    schedule: dict[int, str],
    steps: int,
    log: TextIO,
) -> dict[str, np.ndarray]:
    """Trains the MLP with `tx`, writing `clipax.metrics(opt_state)` to `log`
    every step; returns the per-step curves and the test accuracy."""
    x_train, y_train, x_test, y_test = data
    model = _digits.MLP(features=(64, 64))
    params = model.init(jax.random.key(0), x_train[:1])
    opt_state = tx.init(params)

    @jax.jit
    def step(params: Any, opt_state: Any, x: Any, y: Any, kind: Any) -> Any:
        def loss_fn(p: Any) -> jax.Array:
            return _digits.cross_entropy(model.apply(p, x), y)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = break_gradient(grads, kind)
        raw_norm = clipax.tree.global_norm(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, raw_norm

    batches = _digits.batches(x_train, y_train, BATCH, seed=0)
    curves: dict[str, list[Any]] = {}
    nan_step = max(t for t, kind in schedule.items() if kind == "nan")
    accuracy_before_nan = math.nan
    bar = tqdm(range(steps), desc=f"{name:>15}", unit="step", mininterval=0.5)
    for t in bar:
        if t == nan_step:  # the model as it was before the NaN step
            logits = model.apply(params, x_test)
            accuracy_before_nan = float(_digits.accuracy(logits, y_test))
        x, y = next(batches)
        kind = KINDS.get(schedule.get(t, ""), 0)
        params, opt_state, loss, raw_norm = step(params, opt_state, x, y, kind)
        metrics = {k: float(v) for k, v in clipax.metrics(opt_state).items()}
        log.write(json.dumps({"rule": name, "step": t, **metrics}) + "\n")
        row = {"loss": float(loss), **read_row(metrics, opt_state, float(raw_norm))}
        for key, value in row.items():
            curves.setdefault(key, []).append(value)
        bar.set_postfix(loss=f"{float(loss):.3g}", norm=f"{float(row['norm']):.3g}")
    result = {k: np.asarray(v) for k, v in curves.items()}
    result["accuracy_before_nan"] = np.asarray(accuracy_before_nan)
    result["accuracy"] = np.asarray(
        _digits.accuracy(model.apply(params, x_test), y_test)
    )
    return result


def summary(name: str, run: dict[str, np.ndarray], schedule: dict[int, str]) -> str:
    """One line: the loss before the spikes and between the spikes and the NaN
    step, the share of its gradient another tensor kept at the one-tensor
    spike, the test accuracy before the NaN step and at the end, and how many
    steps were clipped and skipped."""
    first = min(schedule)
    local = next(t for t, kind in schedule.items() if kind == "local")
    nan_step = max(t for t, kind in schedule.items() if kind == "nan")
    loss = run["loss"]
    before = loss[max(0, first - 20) : first].mean()
    after = loss[max(first, nan_step - 20) : nan_step].mean()
    return (
        f"{name:>15}: loss before spikes {before:6.3f}, after them {after:8.3g}, "
        f"others kept {float(run['kept'][local]):7.2g} at the local spike; "
        f"test accuracy before NaN {float(run['accuracy_before_nan']):5.3f}, "
        f"final {float(run['accuracy']):5.3f}; clipped {int(run['clipped'].sum()):3d} "
        f"steps, skipped {int(run['skipped'].sum()):2d}"
    )


def plot(runs: dict[str, dict[str, np.ndarray]], schedule: dict[int, str]) -> None:
    """Loss of every rule on top; below, one panel per rule: pre-clip norm,
    threshold and skipped steps."""
    names = list(runs)
    columns = 4
    rows = math.ceil(len(names) / columns)
    fig = plt.figure(figsize=(16, 4.2 + 2.8 * rows))
    grid = fig.add_gridspec(1 + rows, columns, height_ratios=[1.5] + [1] * rows)
    top = fig.add_subplot(grid[0, :])
    marks = {"global": "x100 all", "local": "x1000 one tensor", "nan": "NaN"}

    def mark(ax: Any, labels: bool) -> None:
        for t, kind in schedule.items():
            color = "black" if kind == "nan" else "red"
            ax.axvline(t, color=color, alpha=0.25, lw=2)
            if labels:
                ax.annotate(
                    marks[kind],
                    (t, 1),
                    xycoords=("data", "axes fraction"),
                    xytext=(2, -10),
                    textcoords="offset points",
                    fontsize=8,
                )

    for name, run in runs.items():
        loss = np.where(np.isfinite(run["loss"]), run["loss"], np.nan)
        before, final = float(run["accuracy_before_nan"]), float(run["accuracy"])
        label = f"{name}: test acc {before:.2f} before NaN, {final:.2f} at end"
        style = "--" if name == "apply_if_finite" else "-"
        top.plot(loss, style, color=COLORS[name], lw=1.2, label=label)
    mark(top, labels=True)
    top.set(yscale="log", ylabel="training loss (batch)", xlabel="step")
    top.set_title(
        "MLP on load_digits, SGD + momentum: spikes at the red lines, NaN at the "
        "black one (a curve that stops went NaN)"
    )
    top.legend(ncol=2, fontsize=8, loc="lower left", frameon=False)
    top.grid(alpha=0.3)
    for i, name in enumerate(names):
        ax = fig.add_subplot(grid[1 + i // columns, i % columns], sharex=top)
        run = runs[name]
        ax.plot(run["norm"], color="0.55", lw=1, label="pre-clip norm")
        if np.isfinite(run["threshold"]).any():
            ax.plot(run["threshold"], color=COLORS[name], lw=1.5, label="threshold")
        for key, y, marker, color in (
            ("clipped", 0.02, "|", COLORS[name]),
            ("skipped", 0.06, "v", "black"),
        ):
            where = np.flatnonzero(run[key])
            if where.size:  # ticks along the bottom of the panel
                ax.plot(
                    where,
                    np.full(where.size, y),
                    marker,
                    color=color,
                    ms=6,
                    transform=ax.get_xaxis_transform(),
                    label=key,
                )
        mark(ax, labels=False)
        ax.set(yscale="log")
        ax.set_title(
            f"{name}: clipped {run['clipped'].sum()}, skipped "
            f"{run['skipped'].sum()} of {len(run['loss'])} steps",
            fontsize=10,
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", frameon=False)
    fig.tight_layout()
    fig.savefig(OUTPUT, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, dict[str, np.ndarray]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="steps per rule")
    steps = parser.parse_args(argv).steps
    data = _digits.load()
    schedule = spike_schedule(steps)
    with open(LOG, "w") as log:
        runs = {
            name: train(name, tx, data, schedule, steps, log)
            for name, tx in rules(steps).items()
        }
    for name, run in runs.items():
        tqdm.write(summary(name, run, schedule))
    plot(runs, schedule)
    tqdm.write(f"wrote {OUTPUT} and {LOG}")
    return runs


if __name__ == "__main__":
    main()
