"""Quick start: train a small Flax MLP on handwritten digits with clipping.

The optimizer is `optax.chain(clipax.clip_by_global_norm(1.0), optax.sgd(...))`.
The whole training step runs under `jax.jit`; after each step the script prints
the loss and the gradient's global norm before clipping, which clipax keeps in
the optimizer state (`optax.tree.get(opt_state, "norm")`), so it costs nothing
to log. The data is scikit-learn's bundled digits: no download.

Run from the repository root:

    python examples/quickstart.py            # 200 steps, a few seconds on a CPU
    python examples/quickstart.py --steps 20
"""

from __future__ import annotations

import argparse
import time

import _digits
import jax
import jax.numpy as jnp
import optax

import clipax

MAX_NORM = 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    x_train, y_train, x_test, y_test = _digits.load(seed=args.seed)
    model = _digits.MLP()
    params = model.init(jax.random.key(args.seed), jnp.zeros((1, 64)))

    # Clip first, then let SGD (with momentum) turn the clipped gradient into a step.
    tx = optax.chain(
        clipax.clip_by_global_norm(MAX_NORM),
        optax.sgd(args.lr, momentum=0.9),
    )
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, x, y):
        def loss_fn(params):
            return _digits.cross_entropy(model.apply(params, x), y)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        # The norm of `grads` before clipping, kept by clipax in its state.
        norm = optax.tree.get(opt_state, "norm")
        return params, opt_state, loss, norm

    print(f"clipax {clipax.__version__}: clip_by_global_norm({MAX_NORM}) + sgd")
    # "grad norm" is the global norm before clipping; "clipped" is norm > max_norm.
    print(f"{'step':>5}  {'loss':>8}  {'grad norm':>9}  clipped")
    start = time.perf_counter()
    data = _digits.batches(x_train, y_train, args.batch_size, seed=args.seed)
    num_clipped = 0
    for step, (x, y) in zip(range(1, args.steps + 1), data, strict=False):
        params, opt_state, loss, norm = train_step(params, opt_state, x, y)
        clipped = bool(norm > MAX_NORM)
        num_clipped += clipped
        flag = "yes" if clipped else "no"
        print(f"{step:>5}  {float(loss):8.4f}  {float(norm):9.4f}  {flag}")

    test_acc = _digits.accuracy(model.apply(params, x_test), y_test)
    seconds = time.perf_counter() - start
    print(f"clipped steps: {num_clipped} of {args.steps}")
    print(f"test accuracy: {float(test_acc):.3f} ({len(y_test)} digits)")
    print(f"done: {args.steps} steps in {seconds:.1f} s")


if __name__ == "__main__":
    main()
