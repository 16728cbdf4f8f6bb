"""Exploding gradients, and how global-norm clipping tames them.

A Flax port of the TensorFlow 2 tutorial on gradient clipping (lesson 18,
"张量限幅"): that tutorial scales MNIST inputs up, trains an MLP with a
learning rate of 1, prints the norm of every gradient leaf before and after
`tf.clip_by_global_norm(grads, 15)`, and shows that clipping keeps the loss
finite. Here the data is scikit-learn's bundled handwritten digits (no
download), fed as raw pixel values 0..16 instead of 0..1, to a ReLU MLP with
four hidden layers, trained with plain SGD at lr=1:

- without clipping, the gradient norm grows by orders of magnitude within a few
  steps, the loss explodes and turns NaN, and the model never recovers;
- with `optax.chain(clipax.clip_by_global_norm(1.0), optax.sgd(1.0))`, the same
  model from the same initialization trains to about 97% test accuracy.

The threshold is 1 rather than the tutorial's 15: at lr=1 a clipped step moves
the parameters by up to `max_norm`, and a step of 15 is too long for this small
model (try `--max-norm 15`).

The script prints, for the first steps, each leaf's gradient norm before and
after clipping (as the tutorial does), shows a progress bar, writes
`exploding_gradients.png` (loss and pre-clip global norm per step, both runs)
to the current directory and ends with one summary line per run.

    python examples/exploding_gradients.py             # 2 x 300 steps, ~17 s
    python examples/exploding_gradients.py --steps 30  # smoke run
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import _digits
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import clipax

PIXEL_SCALE = 16.0  # raw pixel values, 0..16: the "scaled-up inputs"
HIDDEN = (128, 128, 128, 128)
PRINTED_STEPS = 3  # steps whose per-leaf norms are printed, as in the tutorial


def leaf_name(path: tuple[Any, ...]) -> str:
    """`['params']['Dense_0']['kernel']` -> `Dense_0/kernel`."""
    return "/".join(str(getattr(key, "key", key)) for key in path[1:])


def leaf_norms(tree: Any) -> list[tuple[str, float]]:
    """Each leaf's L2 norm, computed with `clipax.tree.global_norm` per leaf."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(leaf_name(path), float(clipax.tree.global_norm(x))) for path, x in flat]


def print_leaf_norms(step: int, loss: float, grads: Any, max_norm: float | None):
    """The tutorial's `==before==` / `==after==` print-out, as one table."""
    norm = float(clipax.tree.global_norm(grads))
    before = leaf_norms(grads)
    if max_norm is None:
        tqdm.write(f"step {step}: loss {loss:.4f}, global norm {norm:.4g}")
        tqdm.write(f"  {'leaf':<16} {'norm':>12}")
        for name, value in before:
            tqdm.write(f"  {name:<16} {value:>12.4g}")
        return
    clipped, _ = clipax.tree.clip_by_global_norm(grads, max_norm)
    after = leaf_norms(clipped)
    clipped_norm = float(clipax.tree.global_norm(clipped))
    tqdm.write(
        f"step {step}: loss {loss:.4f}, global norm {norm:.4g} -> {clipped_norm:.4g}"
    )
    tqdm.write(f"  {'leaf':<16} {'before':>12} {'after':>12}")
    for (name, value), (_, value_after) in zip(before, after, strict=True):
        tqdm.write(f"  {name:<16} {value:>12.4g} {value_after:>12.4g}")


def train(
    name: str,
    tx: optax.GradientTransformation,
    max_norm: float | None,
    params: Any,
    model: _digits.MLP,
    data: tuple[np.ndarray, ...],
    steps: int,
    batch_size: int,
) -> dict[str, Any]:
    """Trains from `params`; returns per-step losses and pre-clip global norms."""
    x_train, y_train, x_test, y_test = data

    @jax.jit
    def train_step(params, opt_state, x, y):
        def loss_fn(params):
            return _digits.cross_entropy(model.apply(params, x), y)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if max_norm is None:
            norm = clipax.tree.global_norm(grads)
        else:  # clipax already computed it: read it from the optimizer state
            norm = optax.tree.get(opt_state, "norm")
        return params, opt_state, loss, norm, grads

    tqdm.write(f"\n== {name} ==")
    opt_state = tx.init(params)
    losses, norms = [], []
    batches = _digits.batches(x_train, y_train, batch_size)
    bar = tqdm(range(1, steps + 1), desc=name, unit="step", mininterval=0.5)
    for step, (x, y) in zip(bar, batches, strict=False):
        params, opt_state, loss, norm, grads = train_step(params, opt_state, x, y)
        losses.append(float(loss))
        norms.append(float(norm))
        if step <= PRINTED_STEPS:
            print_leaf_norms(step, losses[-1], grads, max_norm)
        if step % 10 == 0:
            bar.set_postfix(
                loss=f"{losses[-1]:.3g}", norm=f"{norms[-1]:.3g}", refresh=False
            )
    bar.close()
    test_acc = float(_digits.accuracy(model.apply(params, x_test), y_test))
    return {
        "name": name,
        "loss": np.array(losses),
        "norm": np.array(norms),
        "test_acc": test_acc,
    }


def first_nonfinite(values: np.ndarray) -> int | None:
    """The 1-based step of the first NaN or inf, or None."""
    bad = np.flatnonzero(~np.isfinite(values))
    return int(bad[0]) + 1 if bad.size else None


def summary(run: dict[str, Any]) -> str:
    """One line a reader (or a test) can check: did the run stay finite?"""
    loss = run["loss"]
    step = first_nonfinite(loss)
    return (
        f"summary: {run['name']}: final_loss={loss[-1]:.4g} "
        f"max_loss={np.nanmax(loss) if np.isfinite(loss).any() else math.nan:.4g} "
        f"first_nonfinite_step={step if step is not None else 'none'} "
        f"test_acc={run['test_acc']:.3f}"
    )


def plot(runs: list[dict[str, Any]], max_norm: float, lr: float, path: str) -> None:
    """Loss and pre-clip global norm per step, on log scales; NaN/inf marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {0: "tab:red", 1: "tab:blue"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for ax, key, label in (
        (axes[0], "loss", "training loss (cross-entropy)"),
        (axes[1], "norm", "gradient global norm before clipping"),
    ):
        for i, run in enumerate(runs):
            values = run[key]
            steps = np.arange(1, len(values) + 1)
            finite = np.isfinite(values)
            ax.plot(
                steps[finite],
                values[finite],
                color=colors[i],
                lw=1.2,
                marker="o" if finite.sum() < 20 else None,
                ms=4,
                label=f"{run['name']}, test accuracy {run['test_acc']:.2f}",
            )
            bad = first_nonfinite(values)
            if bad is not None:
                what = "NaN" if np.isnan(values[bad - 1]) else "inf"
                ax.axvline(bad, color=colors[i], ls=":", lw=1.5)
                ax.annotate(
                    f"{run['name']}: {what} from step {bad} on\n(not plotted)",
                    xy=(bad, 0.5),
                    xycoords=("data", "axes fraction"),
                    xytext=(8, 0),
                    textcoords="offset points",
                    color=colors[i],
                    fontsize=9,
                    va="center",
                )
        if key == "norm":
            ax.axhline(
                max_norm, color="black", ls="--", lw=1, label=f"max_norm = {max_norm:g}"
            )
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(label + " (log scale)")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(loc="upper right", fontsize=9)
    axes[0].set_title("Loss: unclipped diverges, clipped trains")
    axes[1].set_title("Pre-clip gradient norm")
    fig.suptitle(
        f"Digits MLP, inputs 0..{PIXEL_SCALE:g}, SGD lr={lr:g}: "
        f"clipax.clip_by_global_norm({max_norm:g}) vs no clipping"
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="steps per run")
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="exploding_gradients.png")
    args = parser.parse_args()

    start = time.perf_counter()
    data = _digits.load(scale=PIXEL_SCALE, seed=args.seed)
    model = _digits.MLP(features=HIDDEN)
    params = model.init(jax.random.key(args.seed), jnp.zeros((1, 64)))
    runs = [
        train(
            "unclipped",
            optax.sgd(args.lr),
            None,
            params,
            model,
            data,
            args.steps,
            args.batch_size,
        ),
        train(
            f"clipped (max_norm={args.max_norm:g})",
            optax.chain(clipax.clip_by_global_norm(args.max_norm), optax.sgd(args.lr)),
            args.max_norm,
            params,
            model,
            data,
            args.steps,
            args.batch_size,
        ),
    ]
    plot(runs, args.max_norm, args.lr, args.plot)
    print()
    for run in runs:
        print(summary(run))
    print(f"wrote {args.plot} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
