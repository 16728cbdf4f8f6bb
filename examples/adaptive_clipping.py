"""Adaptive gradient clipping against a gradient spike: none, fixed, AutoClip, ZClip.

Trains a small plain-JAX MLP on scikit-learn's bundled digits (no download;
the training split of `_digits.load`) with SGD + momentum, four times: without
clipping, with a fixed global-norm threshold, with `clipax.autoclip` and with
`clipax.zclip`. At two steps the gradient is multiplied by 300, as a bad batch
or a numerical glitch would do. Each run is one `jax.lax.scan`, so the whole
training loop, the clipping statistics included, stays on the device. The
script writes `adaptive_clipping.png` to the current directory: the pre-clip
gradient norm, the clipping threshold and the training loss per step for each
run.

    python examples/adaptive_clipping.py [--steps 400]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import _digits
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax

import clipax

matplotlib.use("Agg")
import matplotlib.pyplot as plt

OUTPUT = "adaptive_clipping.png"
BATCH = 64
SPIKE_FACTOR = 300.0


def init_mlp(key: jax.Array, sizes: list[int]) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {
            "w": jax.random.normal(k, (m, n)) * math.sqrt(2.0 / m),
            "b": jnp.zeros(n),
        }
        for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def loss_fn(
    params: list[dict[str, jax.Array]], x: jax.Array, y: jax.Array
) -> jax.Array:
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return _digits.cross_entropy(x @ params[-1]["w"] + params[-1]["b"], y)


def norm_and_threshold(state: Any, grads: Any) -> tuple[jax.Array, jax.Array]:
    """The pre-clip norm and the threshold of the clipping step in `state`."""
    norms = optax.tree.get_all_with_path(state, "norm")
    if not norms:  # no clipping: measure the norm here, no threshold
        return clipax.tree.global_norm(grads), jnp.array(jnp.nan)
    thresholds = optax.tree.get_all_with_path(state, "threshold")
    threshold = thresholds[0][1] if thresholds else jnp.array(jnp.nan)
    return norms[0][1], threshold


def train(
    clipping: optax.GradientTransformation | None,
    data: tuple[jax.Array, jax.Array],
    batches: jax.Array,
    spikes: jax.Array,
    fixed_threshold: float | None = None,
) -> dict[str, np.ndarray]:
    """Runs SGD on `batches`; returns per step the loss, norm and threshold."""
    x, y = data
    sizes = [_digits.NUM_FEATURES, 64, 64, _digits.NUM_CLASSES]
    params = init_mlp(jax.random.key(0), sizes)
    parts = [clipping] if clipping is not None else []
    tx = optax.chain(*parts, optax.sgd(0.05, momentum=0.9))

    def step(carry: Any, inputs: tuple[jax.Array, jax.Array]) -> tuple[Any, Any]:
        params, opt_state = carry
        index, spike = inputs
        loss, grads = jax.value_and_grad(loss_fn)(params, x[index], y[index])
        grads = jax.tree.map(lambda g: g * spike, grads)  # the injected spike
        updates, opt_state = tx.update(grads, opt_state, params)
        norm, threshold = norm_and_threshold(opt_state, grads)
        if fixed_threshold is not None:
            threshold = jnp.array(fixed_threshold)
        params = optax.apply_updates(params, updates)
        return (params, opt_state), (loss, norm, threshold)

    run = jax.jit(lambda carry: jax.lax.scan(step, carry, (batches, spikes)))
    _, (loss, norm, threshold) = run((params, tx.init(params)))
    threshold = np.where(np.isfinite(threshold), threshold, np.nan)
    return {"loss": np.asarray(loss), "norm": np.asarray(norm), "threshold": threshold}


def plot(runs: dict[str, dict[str, np.ndarray]], spike_steps: list[int]) -> None:
    fig, axes = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    colors = dict(
        zip(runs, ["tab:gray", "tab:blue", "tab:orange", "tab:green"], strict=True)
    )
    for name, result in runs.items():
        steps = np.arange(1, len(result["loss"]) + 1)
        axes[0].plot(steps, result["norm"], color=colors[name], lw=1, label=name)
        if not np.isnan(result["threshold"]).all():
            axes[1].plot(
                steps, result["threshold"], color=colors[name], lw=1.2, label=name
            )
        axes[2].plot(steps, result["loss"], color=colors[name], lw=1, label=name)
    for ax in axes:
        for s in spike_steps:
            ax.axvline(s + 1, color="red", alpha=0.25, lw=3)
        ax.grid(alpha=0.3)
    axes[0].set(yscale="log", ylabel="pre-clip gradient norm")
    axes[0].set_title(
        f"MLP on load_digits, SGD + momentum; gradient x{SPIKE_FACTOR:g} "
        "at the red steps",
        pad=22,
    )
    axes[1].set(yscale="log", ylabel="clipping threshold")
    axes[2].set(yscale="log", ylabel="training loss (batch)", xlabel="step")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=4, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.965))
    fig.savefig(OUTPUT, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, dict[str, np.ndarray]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="training steps")
    args = parser.parse_args(argv)
    steps = args.steps

    x_train, y_train, _, _ = _digits.load()
    x, y = jnp.asarray(x_train), jnp.asarray(y_train)
    rng = np.random.default_rng(0)
    batches = jnp.asarray(rng.integers(0, len(y), (steps, BATCH)))
    spike_steps = sorted({int(steps * f) for f in (0.5, 0.75)})
    spikes = np.ones(steps, np.float32)
    spikes[spike_steps] = SPIKE_FACTOR

    fixed = 1.0
    methods: dict[str, tuple[Callable[[], Any], float | None]] = {
        "no clipping": (lambda: None, None),
        f"fixed threshold ({fixed:g})": (
            lambda: clipax.clip_by_global_norm(fixed),
            fixed,
        ),
        "AutoClip (p=10, history=1000)": (lambda: clipax.autoclip(10.0), None),
        "ZClip (adaptive, z=2.5)": (
            lambda: clipax.zclip(warmup_steps=min(25, steps)),
            None,
        ),
    }
    runs = {}
    for name, (make, threshold) in methods.items():
        runs[name] = train(make(), (x, y), batches, jnp.asarray(spikes), threshold)
        result = runs[name]
        tail = result["loss"][-max(1, steps // 10) :].mean()
        print(
            f"{name:32s} largest loss {np.nanmax(result['loss']):10.3g}  "
            f"mean loss over the last 10% {tail:8.3g}"
        )
    plot(runs, spike_steps)
    print(f"wrote {OUTPUT}")
    return runs


if __name__ == "__main__":
    main()
