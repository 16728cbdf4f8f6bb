"""Shared by the examples: scikit-learn's bundled digits and small Flax MLPs.

The digits are 1797 real handwritten 8x8 images shipped inside scikit-learn, so
the examples need no download. Each script imports this module as `_digits`
(Python puts the script's own folder first on `sys.path`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import jax
import numpy as np
import optax
from flax import linen as nn
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

NUM_FEATURES = 64
NUM_CLASSES = 10


def load(
    scale: float = 1.0, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Returns `(x_train, y_train, x_test, y_test)`, a stratified 75/25 split.

    Pixels (0 to 16 in the data) become float32 in `[0, scale]`; labels int32.
    """
    x, y = load_digits(return_X_y=True)
    x = (x * (scale / 16.0)).astype(np.float32)
    y = y.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, random_state=seed, stratify=y
    )
    return x_train, y_train, x_test, y_test


def batches(
    x: np.ndarray, y: np.ndarray, batch_size: int, seed: int = 0
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Endless minibatches of a fixed size, reshuffled every epoch."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(x))
        for start in range(0, len(x) - batch_size + 1, batch_size):
            idx = order[start : start + batch_size]
            yield x[idx], y[idx]


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy with integer labels."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Fraction of rows whose largest logit is the label."""
    return (logits.argmax(-1) == labels).mean()


class MLP(nn.Module):
    """A Flax linen MLP: ReLU hidden layers, then 10 logits."""

    features: Sequence[int] = (128, 64)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for width in self.features:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(NUM_CLASSES)(x)


class NnxMLP(nnx.Module):
    """The same MLP written with Flax NNX."""

    def __init__(self, rngs: nnx.Rngs, features: Sequence[int] = (128, 64)):
        widths = [NUM_FEATURES, *features]
        self.hidden = nnx.List(
            [nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(widths)]
        )
        self.out = nnx.Linear(widths[-1], NUM_CLASSES, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.hidden:
            x = nnx.relu(layer(x))
        return self.out(x)
