"""Faults found by reading the package, each pinned by the test that failed
before its fix: thresholds past int32, exact stacked group norms, the
saturating count of non-finite steps, and an integer count given as data."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipax

BIG = 2**40  # a Python int past int32
GRADS = {"w": jnp.array([3.0, 4.0]), "b": jnp.array([12.0])}  # global norm 13


@pytest.mark.parametrize(
    "call",
    [
        lambda g, t: clipax.tree.clip_by_global_norm(g, t)[0],
        lambda g, t: clipax.tree.clip_by_norm(g, t),
        lambda g, t: clipax.clip_by_global_norm(t).update(
            g, clipax.clip_by_global_norm(t).init(g)
        )[0],
        lambda g, t: clipax.skip_spikes(optax.sgd(1.0), max_norm=t).update(
            g, clipax.skip_spikes(optax.sgd(1.0), max_norm=t).init(g)
        )[0],
        lambda g, t: clipax.tree.per_example_global_norm_clip(
            jax.tree.map(lambda x: x[None], g), t
        )[0],
    ],
    ids=[
        "tree.clip_by_global_norm",
        "tree.clip_by_norm",
        "clip_by_global_norm",
        "skip_spikes",
        "per_example",
    ],
)
def test_a_python_int_threshold_past_int32_is_a_threshold(call: Callable) -> None:
    # It used to go through JAX's default int32 and overflow.
    got = call(GRADS, BIG)
    want = call(GRADS, float(BIG))
    jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize(
    ("ord", "scale"), [(3, 1e13), (2, 1e20), (2, 1e-25), (1, 1e30)]
)
def test_stacked_group_norms_are_exact(ord: float, scale: float) -> None:
    # Powers of these overflow or underflow float32; the norms do not.
    values = np.arange(1.0, 13.0).reshape(3, 4) * scale
    stacked = {"blocks": jnp.asarray(values, jnp.float32)}
    unrolled = {"blocks": [jnp.asarray(row, jnp.float32) for row in values]}
    got = clipax.tree.group_norms(stacked, depth=2, ord=ord, stacked={"blocks": 1})
    want = clipax.tree.group_norms(unrolled, depth=2, ord=ord)
    exact = np.sum(np.abs(values.astype(np.float64)) ** ord, axis=1) ** (1 / ord)
    for i in range(3):
        key = f"blocks/{i}/norm"
        assert math.isfinite(got[key]) and got[key] > 0, key
        np.testing.assert_allclose(got[key], exact[i], rtol=1e-5)
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5)


def test_the_nonfinite_count_saturates() -> None:
    tx = clipax.clip_by_global_norm(1.0)
    broken = {"w": jnp.array([jnp.nan])}
    state = tx.init(broken)._replace(nonfinite_count=jnp.int32(2**31 - 1))
    _, state = jax.jit(tx.update)(broken, state)
    assert int(state.nonfinite_count) == 2**31 - 1  # not wrapped to negative


@pytest.mark.parametrize("value", [jnp.array(2.5), jnp.array(3.0)])
def test_a_count_given_as_an_array_must_be_an_integer(value: Any) -> None:
    with pytest.raises(TypeError, match=r"`warmup_steps` must be an int >= 1.*float32"):
        clipax.skip_spikes(optax.sgd(1.0), warmup_steps=value)
    tx = clipax.skip_spikes(optax.sgd(1.0), warmup_steps=jnp.array(3))  # data: fine
    tx.update(GRADS, tx.init(GRADS))
