"""Every rule inside optax's combinators, under every container's optimizer.

Each public rule runs inside `optax.partition` (the kernels' group; biases go
to SGD) and inside `optax.masked` (then SGD), in plain optax, in linen's
`TrainState` and in `nnx.Optimizer`, which wraps each masked leaf's
`MaskedNode` in a variable: init, three updates (the second a x100 spike),
and `clipax.metrics`. Each must equal the rule run alone on the kernels' own
tree (updates and logs), and that run must act: its updates differ from those
of the same recipe with the rule left out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx
from flax.training import train_state

import clipax

LR = 0.1
SCALES = (1.0, 100.0, 1.0)  # a spike at the second update
# The attention module's largest logits, (batch, heads): head 0 over 100.
LOGITS = {"attn": jnp.array([[150.0, 20.0], [30.0, 40.0]])}

# Each rule: how it is made, and what the recipe holds in its place when the
# rule is left out (identity for a clip; the wrapped optimizer for a wrapper).
RULES: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "clip": (lambda: clipax.clip(0.1), optax.identity),
    "clip_by_value": (lambda: clipax.clip_by_value(-0.1, 0.2), optax.identity),
    "clip_by_norm": (lambda: clipax.clip_by_norm(1.0), optax.identity),
    "clip_by_global_norm": (lambda: clipax.clip_by_global_norm(1.0), optax.identity),
    "autoclip": (lambda: clipax.autoclip(50.0, history=3), optax.identity),
    "zclip": (lambda: clipax.zclip(warmup_steps=1), optax.identity),
    "adaptive_grad_clip": (lambda: clipax.adaptive_grad_clip(0.01), optax.identity),
    "clip_by_block_rms": (lambda: clipax.clip_by_block_rms(0.01), optax.identity),
    "adagc": (lambda: clipax.adagc(warmup_steps=1), optax.identity),
    "skip_spikes": (
        lambda: clipax.skip_spikes(optax.adam(LR), warmup_steps=1),
        lambda: optax.adam(LR),
    ),
    "stable_spam": (
        lambda: clipax.stable_spam(optax.adam(LR)),
        lambda: optax.adam(LR),
    ),
    "reset_on_spike": (
        lambda: clipax.reset_on_spike(optax.adam(LR), b1=0.9, b2=0.999, warmup_steps=1),
        lambda: optax.adam(LR),
    ),
    "qk_clip": (lambda: clipax.qk_clip(100.0), optax.identity),
    "clip_by_spectral_norm": (
        lambda: clipax.clip_by_spectral_norm(0.1),
        optax.identity,
    ),
}


def test_the_recipes_hold_every_public_rule() -> None:
    public = {n for n in clipax.__all__ if n.islower() and callable(getattr(clipax, n))}
    assert set(RULES) == public - {
        "metrics",
        "migrate_state",
        "nonfinite_errors",
        "stacked_prefix",
    }


class Attention(linen.Module):
    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        q = linen.DenseGeneral((2, 3), name="query")(x)
        k = linen.DenseGeneral((2, 3), name="key")(x)
        return jnp.concatenate([q, k], -1).sum(-2)


class Model(linen.Module):
    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return linen.Dense(4, name="dense")(Attention(name="attn")(x))


class NnxAttention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.query = nnx.LinearGeneral(4, (2, 3), rngs=rngs)
        self.key = nnx.LinearGeneral(4, (2, 3), rngs=rngs)


class NnxModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.attn = NnxAttention(rngs)
        self.dense = nnx.Linear(6, 4, rngs=rngs)


def labels(params: Any) -> Any:
    """ "a" for a kernel, "b" for a bias (through NNX's variables too)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "a" if "kernel" in jax.tree_util.keystr(path) else "b", params
    )


def recipe(rule: Any, combinator: str) -> Any:
    if combinator == "partition":
        return optax.partition({"a": rule, "b": optax.sgd(LR)}, labels)
    mask = lambda p: jax.tree.map(lambda label: label == "a", labels(p))  # noqa: E731
    return optax.chain(optax.masked(rule, mask), optax.sgd(LR))


def gradients(params: dict, scale: float) -> dict:
    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(len(leaves))
    return treedef.unflatten(
        [jnp.asarray(rng.normal(size=x.shape) * scale, x.dtype) for x in leaves]
    )


def kernels(tree: dict) -> dict:
    """The kernels' group as a tree of its own."""
    return {
        k: v if k == "kernel" else kernels(v) for k, v in tree.items() if k != "bias"
    }


def merged(kernel: dict, bias: dict) -> dict:
    """`bias` with the kernels of `kernel` in their places."""
    return {
        k: kernel[k] if k == "kernel" else v if k == "bias" else merged(kernel[k], v)
        for k, v in bias.items()
    }


def alone(rule: Any, params: dict, combinator: str) -> tuple[list, Any]:
    """The recipe's updates with `rule` run on the kernels' tree alone (the
    biases by SGD), and the rule's last state."""
    rule = optax.with_extra_args_support(rule)
    state, out = rule.init(kernels(params)), []
    for scale in SCALES:
        grads = gradients(params, scale)
        u, state = rule.update(
            kernels(grads), state, kernels(params), max_logits=LOGITS
        )
        if combinator == "masked":
            u = jax.tree.map(lambda x: -LR * x, u)
        out.append(merged(u, jax.tree.map(lambda g: -LR * g, grads)))
        params = optax.apply_updates(params, out[-1])
    return out, state


def in_optax(tx: Any, params: dict, extra: dict) -> tuple[list, Any]:
    state, out = tx.init(params), []
    for scale in SCALES:
        u, state = tx.update(gradients(params, scale), state, params, **extra)
        out.append(u)
        params = optax.apply_updates(params, u)
    return out, state


def in_linen(tx: Any, params: dict, extra: dict) -> tuple[list, Any]:
    """`TrainState.apply_gradients`, or where the rule takes `update`'s extra
    arguments (which it does not pass), the step it takes written out."""
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    out = []
    for scale in SCALES:
        grads = gradients(params, scale)
        if extra:
            u, opt_state = tx.update(grads, state.opt_state, state.params, **extra)
            new = state.replace(
                step=state.step + 1,
                params=optax.apply_updates(state.params, u),
                opt_state=opt_state,
            )
        else:
            new = state.apply_gradients(grads=grads)
        out.append(jax.tree.map(jnp.subtract, new.params, state.params))
        state = new
    return out, state.opt_state


def in_nnx(tx: Any, params: dict, extra: dict) -> tuple[list, Any]:
    model = NnxModel(nnx.Rngs(0))  # whose parameters are `params`
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    out = []
    for scale in SCALES:
        before = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        grads = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
        nnx.replace_by_pure_dict(grads, gradients(before, scale))  # as nnx.grad
        optimizer.update(model, grads, **extra)
        after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        out.append(jax.tree.map(jnp.subtract, after, before))
    return out, optimizer


CONTAINERS = {"optax": in_optax, "linen": in_linen, "nnx": in_nnx}


def model_params(container: str) -> dict:
    if container == "nnx":
        return nnx.to_pure_dict(nnx.state(NnxModel(nnx.Rngs(0)), nnx.Param))
    return Model().init(jax.random.key(0), jnp.ones((1, 4)))["params"]


@functools.cache
def reference(name: str, combinator: str, nnx_params: bool) -> tuple[list, dict]:
    """The rule run alone on the kernels' tree (`alone`) and its logs, once
    per worker; checked to act: its updates differ from the recipe's with
    the rule left out."""
    make, left_out = RULES[name]
    params = model_params("nnx" if nnx_params else "optax")
    want, state = alone(make(), params, combinator)
    without, _ = alone(left_out(), params, combinator)
    assert not all(  # the rule acted on the kernels
        np.allclose(w, o)
        for w, o in zip(jax.tree.leaves(want), jax.tree.leaves(without), strict=True)
    )
    return want, dict(clipax.metrics(state))


@pytest.mark.parametrize("container", list(CONTAINERS))
@pytest.mark.parametrize("combinator", ["partition", "masked"])
@pytest.mark.parametrize("name", list(RULES))
def test_every_rule_in_every_combinator_and_container(
    name: str, combinator: str, container: str
) -> None:
    want, want_logs = reference(name, combinator, container == "nnx")
    extra = {"max_logits": LOGITS} if name == "qk_clip" else {}
    recipe_ = recipe(RULES[name][0](), combinator)
    got, got_state = CONTAINERS[container](recipe_, model_params(container), extra)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    logs = clipax.metrics(got_state)
    assert list(logs) == list(want_logs)
    for key in want_logs:
        np.testing.assert_allclose(logs[key], want_logs[key], rtol=1e-5, err_msg=key)
