"""Faults found by reading the package, each pinned by the test that failed
before its fix: thresholds past int32, exact stacked group norms, the
saturating count of non-finite steps, an integer count given as data; a
uint32 `clip` bound with x64 off, a state built under another window or
history, the entry an error names, `stable_spam`'s reset computed every step,
and docstrings that promised errors no call raises."""

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


def test_a_uint32_clip_bound_past_int32_keeps_every_value() -> None:
    tx = clipax.clip(jnp.array(3_000_000_000, jnp.uint32))
    updates, _ = tx.update({"w": jnp.array([-5.0, 0.5, 7.0])}, tx.init(None))
    np.testing.assert_array_equal(updates["w"], [-5.0, 0.5, 7.0])
    ints, _ = tx.update({"i": jnp.array([-(2**31), 7], jnp.int32)}, None)
    np.testing.assert_array_equal(ints["i"], [-(2**31) + 1, 7])


@pytest.mark.parametrize(
    ("built", "used", "field"),
    [
        (clipax.autoclip(history=5), clipax.autoclip(history=7), "buffer"),
        (clipax.zclip(window=4), clipax.zclip(window=6), "buffer"),
        (clipax.zclip(warmup_steps=3), clipax.zclip(warmup_steps=5), "buffer"),
        (
            clipax.skip_spikes(optax.sgd(1.0), window=4),
            clipax.skip_spikes(optax.sgd(1.0)),
            "norm_window",
        ),
    ],
    ids=["autoclip history", "zclip window", "zclip warmup", "skip_spikes window"],
)
def test_a_state_built_under_another_window_is_refused(
    built: Any, used: Any, field: str
) -> None:
    state = built.init(GRADS)
    with pytest.raises(ValueError, match=rf"`{field}` has shape .*another"):
        used.update(GRADS, state)


def test_an_error_names_the_first_bad_prefix_entry() -> None:
    # Several entries where the updates have no node: the first in the
    # prefix's order is named, whatever the string hashes of this process.
    tree = {"w": jnp.ones((2, 3))}
    stacked = {"w": 1, **{f"x{i:02d}": 1 for i in range(12)}}
    with pytest.raises(ValueError, match=r"an entry at \['x00'\],"):
        clipax.clip_by_norm(1.0, stacked=stacked).init(tree)


def test_stable_spams_reset_runs_inner_init_only_when_it_resets() -> None:
    calls = []

    def init(params: Any) -> optax.EmptyState:
        jax.debug.callback(lambda: calls.append(1))
        return optax.EmptyState()

    inner = optax.GradientTransformation(init, optax.identity().update)
    tx = clipax.stable_spam(inner, reset_every=3)
    state = tx.init(GRADS)
    calls.clear()
    update = jax.jit(tx.update)
    for _ in range(6):
        _, state = update(GRADS, state)
    jax.effects_barrier()
    assert len(calls) == 2  # steps 3 and 6


def test_the_ignored_peer_arguments_raise_nothing() -> None:
    # `name` and `foreach` mean nothing in JAX: taken and dropped, whatever
    # they hold, as the docstrings say.
    for tx in (clipax.clip_by_value(-1.0, 1.0, name=3), clipax.clip(1.0, foreach=3)):
        assert "`name`" not in (clipax.clip_by_value.__doc__ or "").split("Raises:")[1]
        tx.update(GRADS, tx.init(GRADS))
    assert "`foreach`" not in (clipax.clip.__doc__ or "").split("Raises:")[1]
    doc = clipax.tree.group_norms.__doc__ or ""
    assert "A dict" not in doc and "clipax.Metrics" in doc.split("Returns:")[1]
