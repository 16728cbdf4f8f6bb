"""Log the pre-clip norm and the fraction of clipped steps with Flax NNX.

`nnx.Optimizer` wraps `optax.chain(clip, optax.adamw(...))` where `clip` is
`clipax.clip_by_global_norm` under `optax.inject_hyperparams`, so that its
`max_norm` follows a warmup schedule: tight (0.1) at the start, when gradients
are large and noisy, rising linearly to 1.0, after which the chain is exactly
`optax.chain(clipax.clip_by_global_norm(1.0), optax.adamw(...))`.

Everything logged is read back from the optimizer state, at no extra cost:

- the pre-clip global norm: `optax.tree.get(opt_state, "norm")`, the field
  clipax keeps in its state;
- the threshold in force at that step: `opt_state[0].hyperparams["max_norm"]`,
  kept by `inject_hyperparams`;
- whether the step was clipped: norm > max_norm. Every `--log-every` steps the
  script prints the fraction of clipped steps in the window.

It plots the norm against the schedule and the clipped fraction per window to
`nnx_logging.png` in the current directory.

    python examples/nnx_logging.py              # 400 steps, ~14 s on 2 cores
    python examples/nnx_logging.py --steps 40 --log-every 10
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import _digits
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import clipax

FINAL_MAX_NORM = 1.0
INITIAL_MAX_NORM = 0.1  # a concrete max_norm must be > 0, so warmup starts above 0


def make_optimizer(model: nnx.Module, lr: float, warmup_steps: int) -> nnx.Optimizer:
    """AdamW after global-norm clipping whose `max_norm` warms up."""
    max_norm = optax.linear_schedule(
        init_value=INITIAL_MAX_NORM,
        end_value=FINAL_MAX_NORM,
        transition_steps=warmup_steps,
    )
    tx = optax.chain(
        optax.inject_hyperparams(clipax.clip_by_global_norm)(max_norm=max_norm),
        optax.adamw(lr, weight_decay=1e-4),
    )
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


@nnx.jit
def train_step(
    model: nnx.Module, optimizer: nnx.Optimizer, x: jnp.ndarray, y: jnp.ndarray
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """One AdamW step; returns the loss, the pre-clip norm and the max_norm."""

    def loss_fn(model: nnx.Module) -> jnp.ndarray:
        return _digits.cross_entropy(model(x), y)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    # The optimizer state holds nnx Variables; `as_pure` gives the plain arrays.
    opt_state = nnx.as_pure(optimizer.opt_state)
    norm = optax.tree.get(opt_state, "norm")  # kept by clipax
    max_norm = opt_state[0].hyperparams["max_norm"]  # kept by inject_hyperparams
    return loss, norm, max_norm


def plot(log: dict[str, Any], path: str) -> None:
    """Pre-clip norm against the max_norm schedule; clipped fraction per window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(1, len(log["norm"]) + 1)
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(9, 6.5), sharex=True, constrained_layout=True
    )
    top.plot(steps, log["norm"], color="tab:blue", lw=1, label="pre-clip global norm")
    top.plot(steps, log["max_norm"], color="black", ls="--", lw=1.5, label="max_norm")
    clipped = log["norm"] > log["max_norm"]
    top.scatter(
        steps[clipped],
        log["norm"][clipped],
        s=8,
        color="tab:red",
        zorder=3,
        label="clipped steps",
    )
    top.set_yscale("log")
    top.set_ylabel("gradient global norm (log scale)")
    top.set_title("Pre-clip norm (from the optimizer state) and the max_norm warmup")
    top.legend(loc="lower left", fontsize=9)
    top.grid(True, alpha=0.3)

    ends = np.asarray(log["window_end"])
    widths = np.diff(np.concatenate([[0], ends]))
    bottom.bar(
        ends - widths / 2,
        log["clipped_fraction"],
        width=widths * 0.9,
        color="tab:red",
        alpha=0.7,
    )
    bottom.set_ylim(0, 1.05)
    bottom.set_xlabel("step")
    bottom.set_ylabel("fraction of steps clipped")
    bottom.set_title("Clipped steps per logging window")
    bottom.grid(True, axis="y", alpha=0.3)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="max_norm warmup length (default: half the steps)",
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="nnx_logging.png")
    args = parser.parse_args()
    warmup = args.warmup_steps or max(1, args.steps // 2)

    start = time.perf_counter()
    x_train, y_train, x_test, y_test = _digits.load(seed=args.seed)
    model = _digits.NnxMLP(nnx.Rngs(args.seed))
    optimizer = make_optimizer(model, args.lr, warmup)

    log: dict[str, list[float]] = {
        "norm": [],
        "max_norm": [],
        "window_end": [],
        "clipped_fraction": [],
    }
    window_losses, window_clipped = [], []
    # Per window: mean loss; the last step's pre-clip norm and max_norm; the
    # fraction of the window's steps whose norm was above their max_norm.
    print(f"{'step':>5}  {'loss':>7}  {'norm':>7}  {'max_norm':>8}  clipped")
    data = _digits.batches(x_train, y_train, args.batch_size, seed=args.seed)
    for step, (x, y) in zip(range(1, args.steps + 1), data, strict=False):
        loss, norm, max_norm = train_step(model, optimizer, x, y)
        norm, max_norm = float(norm), float(max_norm)
        log["norm"].append(norm)
        log["max_norm"].append(max_norm)
        window_losses.append(float(loss))
        window_clipped.append(norm > max_norm)
        if step % args.log_every == 0 or step == args.steps:
            fraction = float(np.mean(window_clipped))
            log["window_end"].append(step)
            log["clipped_fraction"].append(fraction)
            print(
                f"{step:>5}  {np.mean(window_losses):7.4f}  {norm:7.4f}  "
                f"{max_norm:8.4f}  {fraction:6.0%}"
            )
            window_losses, window_clipped = [], []

    test_acc = _digits.accuracy(model(jnp.asarray(x_test)), y_test)
    arrays = {key: np.asarray(value) for key, value in log.items()}
    plot(arrays, args.plot)
    total = float(np.mean(arrays["norm"] > arrays["max_norm"]))
    print(f"clipped steps overall: {total:.0%} of {args.steps}")
    print(f"test accuracy: {float(test_acc):.3f}")
    print(f"wrote {args.plot} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
