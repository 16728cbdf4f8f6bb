"""QK-Clip: each head over the threshold has its query and key weights rescaled
so that its largest logit is the threshold, for MHA, GQA, MQA and MLA.

Checked against a float64 NumPy reference of the formula, and by the property
that matters: the attention recomputed on the same batch with the clipped
weights has every head's largest logit at min(S_h, tau). Stacked equals
unrolled, sharded equals one device, and heads under the threshold pass bit
for bit.
"""

from __future__ import annotations

from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import clipax

D, DH, B, T = 8, 4, 3, 5  # model width, head width, batch, tokens
TAU = 15.0


def attention_params(rng: np.random.Generator, nq: int, nk: int, **extra: Any) -> dict:
    """An attention module's query and key projections (kernel and bias),
    heads on axis -2, sized so that some heads' logits pass TAU."""

    def proj(heads: int, top: float) -> dict:
        spread = np.linspace(top, 0.3, heads)[:, None]  # heads over and under
        return {
            "kernel": rng.normal(size=(D, heads, DH)) * spread,
            "bias": rng.normal(size=(heads, DH)) * 0.3,
        }

    return {"query": proj(nq, 1.2), "key": proj(nk, 1.0), **extra}


def logits(module: dict, x: np.ndarray, rope_dim: int = 0, key_dim: Any = None) -> Any:
    """Every head's attention logits (batch, heads, q, k), float64; with MLA
    (`rope_dim`), the query's last `rope_dim` entries meet a key shared by all
    heads, `module["rope_key"]`."""
    q = (
        np.einsum("btd,dhe->bthe", x, module["query"]["kernel"])
        + module["query"]["bias"]
    )
    k = np.einsum("btd,dhe->bthe", x, module["key"]["kernel"]) + module["key"]["bias"]
    k = k[..., :key_dim] if key_dim is not None else k
    g = q.shape[2] // k.shape[2]
    k = np.repeat(k, g, axis=2)
    if rope_dim:
        q_nope, q_rope = q[..., :-rope_dim], q[..., -rope_dim:]
        k_rope = np.einsum("btd,de->bte", x, module["rope_key"])
        s = np.einsum("bqhe,bkhe->bhqk", q_nope, k)
        s = s + np.einsum("bqhe,bke->bhqk", q_rope, k_rope)
    else:
        s = np.einsum("bqhe,bkhe->bhqk", q, k)
    return s / np.sqrt(q.shape[-1])


def head_max(s: np.ndarray) -> np.ndarray:
    """(batch, heads): the recipe for `max_logits` in plain attention."""
    return np.max(s, axis=(-2, -1))


def reference(
    module: dict, s: np.ndarray, alpha: float, rope_dim: int = 0, key_dim: Any = None
) -> dict:
    """QK-Clip's rule in float64 NumPy, on a module's weights: each group's
    hottest head lands at TAU, its factor split by `alpha`; the other query
    heads of the group shrink as little as they can without growing."""
    nq, nk = module["query"]["kernel"].shape[1], module["key"]["kernel"].shape[1]
    eta = np.where(s > TAU, TAU / s, 1.0)
    k_scale = eta.reshape(nk, nq // nk).min(axis=1) ** (1 - alpha)
    q_scale = np.minimum(eta / np.repeat(k_scale, nq // nk), 1.0)
    out = jax.tree.map(np.array, module)
    for name in ("kernel", "bias"):
        q = out["query"][name]
        width = q.shape[-1]
        q_full = np.repeat(q_scale[:, None], width, axis=1)
        if rope_dim:
            q_full[:, width - rope_dim :] = eta[:, None]
        out["query"][name] = q * q_full
        k = out["key"][name]
        k_full = np.repeat(k_scale[:, None], k.shape[-1], axis=1)
        if key_dim is not None:
            k_full[:, key_dim:] = 1.0
        out["key"][name] = k * k_full
    return out


LAYOUTS = {
    "MHA": dict(nq=4, nk=4),
    "GQA": dict(nq=4, nk=2),
    "MQA": dict(nq=4, nk=1),
    "MLA": dict(nq=3, nk=3, rope_dim=2, key_dim=DH - 2),
}


@pytest.mark.parametrize("alpha", [0.5, 0.0, 1.0, 0.3])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_equals_the_formula_and_caps_each_heads_logit(
    layout: str, alpha: float
) -> None:
    shape = dict(LAYOUTS[layout])
    rope_dim, key_dim = shape.pop("rope_dim", 0), shape.pop("key_dim", None)
    rng = np.random.default_rng(0)
    extra = {"rope_key": rng.normal(size=(D, rope_dim))} if rope_dim else {}
    module = attention_params(rng, **shape, **extra)
    x = rng.normal(size=(B, T, D))
    before = logits(module, x, rope_dim, key_dim)
    s = head_max(before).max(axis=0)
    assert (s > TAU).any() and (s < TAU).any()  # some heads clipped, some not
    params = {"attn": jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), module)}
    tx = clipax.qk_clip(TAU, alpha=alpha, rope_dim=rope_dim, key_dim=key_dim)
    zeros = jax.tree.map(jnp.zeros_like, params)
    max_logits = {"attn": jnp.asarray(head_max(before), jnp.float32)}
    updates, state = jax.jit(tx.update)(
        zeros, tx.init(params), params, max_logits=max_logits
    )
    clipped = jax.tree.map(lambda p, u: np.asarray(p + u, np.float64), params, updates)
    want = reference(module, s, alpha, rope_dim, key_dim)
    chex.assert_trees_all_close(clipped["attn"], want, rtol=2e-5, atol=1e-6)
    # Every head at or below min(S, TAU); each group's hottest head at TAU.
    after = head_max(logits(clipped["attn"], x, rope_dim, key_dim)).max(axis=0)
    assert np.all(after <= np.minimum(s, TAU) * (1 + 1e-5))
    nk = shape["nk"]
    hottest = s.reshape(nk, -1).max(axis=1)
    landed = after.reshape(nk, -1).max(axis=1)
    np.testing.assert_allclose(landed, np.minimum(hottest, TAU), rtol=1e-5)
    if nk == shape["nq"]:  # MHA, MLA: every head at exactly min(S, TAU)
        np.testing.assert_allclose(after, np.minimum(s, TAU), rtol=1e-5)
    np.testing.assert_allclose(state.max_logit["attn"], s, rtol=1e-6)
    assert int(state.clipped_heads["attn"]) == int((s > TAU).sum())
    if rope_dim:  # the shared rotary key is untouched
        np.testing.assert_array_equal(updates["attn"]["rope_key"], 0.0)


def megatron_group(module: dict, s: np.ndarray, alpha: float) -> dict:
    """Megatron-LM's `SelfAttention.clip_qk` (GQA) in float64 NumPy, as it
    computes it: per query group, its largest logit; `eta = clamp(TAU / that,
    max=1)`; the group's query heads times `eta**alpha`, its key head times
    `eta**(1 - alpha)`. (Megatron leaves biases alone; clipax scales them so
    that the logits land exactly, as for the kernels here.)"""
    nq, nk = module["query"]["kernel"].shape[1], module["key"]["kernel"].shape[1]
    grouped_max = s.reshape(nk, nq // nk).max(axis=1)
    eta = np.minimum(TAU / grouped_max, 1.0)
    out = jax.tree.map(np.array, module)
    for name in ("kernel", "bias"):
        q = out["query"][name].reshape(*out["query"][name].shape[:-2], nk, -1, DH)
        out["query"][name] = (q * eta[:, None, None] ** alpha).reshape(
            out["query"][name].shape
        )
        out["key"][name] = out["key"][name] * eta[:, None] ** (1 - alpha)
    return out


@pytest.mark.parametrize("alpha", [0.5, 0.0, 0.3])
def test_gqa_group_is_megatrons_rule(alpha: float) -> None:
    rng = np.random.default_rng(11)
    module = attention_params(rng, 8, 2)
    s = np.array([300.0, 20.0, 90.0, 5.0, 14.0, 2.0, 9.0, 1.0])  # group 1 under
    params = {"attn": jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), module)}
    zeros = jax.tree.map(jnp.zeros_like, params)
    tx = clipax.qk_clip(TAU, alpha=alpha, gqa="group")
    updates, state = jax.jit(tx.update)(
        zeros, tx.init(params), params, max_logits={"attn": jnp.asarray(s[None])}
    )
    clipped = jax.tree.map(lambda p, u: np.asarray(p + u, np.float64), params, updates)
    want = megatron_group(module, s, alpha)
    chex.assert_trees_all_close(clipped["attn"], want, rtol=2e-5, atol=1e-6)
    for part in ("query", "key"):  # the group under TAU: bit for bit
        got = np.asarray(updates["attn"][part]["kernel"])
        assert np.all(got[:, -(got.shape[1] // 2) :] == 0.0)
    assert int(state.clipped_heads["attn"]) == 4  # group 0's query heads, scaled


@pytest.mark.parametrize("alpha", [0.5, 0.0])
def test_gqa_never_grows_a_weight_and_leaves_cool_groups_alone(alpha: float) -> None:
    # Group 0: head 0 at 300 (over TAU), head 1 at 10 (under); group 1 under.
    rng = np.random.default_rng(12)
    params = {"attn": jax.tree.map(jnp.asarray, attention_params(rng, 4, 2))}
    incoming = jax.tree.map(
        lambda a: jnp.asarray(rng.normal(size=a.shape) * 1e-3, a.dtype), params
    )
    s = jnp.array([[300.0, 10.0, 3.0, 2.0]])
    tx = clipax.qk_clip(100.0, alpha=alpha)
    out, state = tx.update(incoming, tx.init(params), params, max_logits={"attn": s})
    new = optax.apply_updates(params, out)["attn"]
    moved = optax.apply_updates(params, incoming)["attn"]
    eta = 100.0 / 300.0
    for name in ("kernel", "bias"):
        q, q0 = np.asarray(new["query"][name]), np.asarray(moved["query"][name])
        k, k0 = np.asarray(new["key"][name]), np.asarray(moved["key"][name])
        # The hottest head lands at TAU, split by alpha; head 1 keeps its
        # query weights (the old rule grew them by 1.73 at alpha 0.5, 3 at 0).
        np.testing.assert_allclose(q[..., 0, :], q0[..., 0, :] * eta**alpha, rtol=1e-6)
        np.testing.assert_allclose(q[..., 1, :], q0[..., 1, :], rtol=1e-6)
        np.testing.assert_allclose(
            k[..., 0, :], k0[..., 0, :] * eta ** (1 - alpha), rtol=1e-6
        )
        # Group 1 (query heads 2, 3; key head 1): the incoming update, bit for bit.
        np.testing.assert_array_equal(
            np.asarray(out["attn"]["query"][name])[..., 2:, :],
            np.asarray(incoming["attn"]["query"][name])[..., 2:, :],
        )
        np.testing.assert_array_equal(
            np.asarray(out["attn"]["key"][name])[..., 1, :],
            np.asarray(incoming["attn"]["key"][name])[..., 1, :],
        )
    np.testing.assert_allclose(state.max_logit["attn"], s[0])
    assert int(state.clipped_heads["attn"]) == 1


def test_heads_under_the_threshold_and_other_leaves_pass_bit_for_bit() -> None:
    rng = np.random.default_rng(1)
    module = attention_params(rng, 4, 4)
    params = {
        "attn": jax.tree.map(jnp.asarray, module),
        "mlp": jnp.asarray(rng.normal(size=(D, D))),
    }
    updates = jax.tree.map(
        lambda a: jnp.asarray(rng.normal(size=a.shape) * 1e-3), params
    )
    s = jnp.array([[1.0, 60.0, 2.0, 3.0]])  # only head 1 over TAU
    tx = clipax.qk_clip(TAU)
    out, _ = tx.update(updates, tx.init(params), params, max_logits={"attn": s})
    np.testing.assert_array_equal(out["mlp"], updates["mlp"])
    for part in ("query", "key"):
        got, came = out["attn"][part]["kernel"], updates["attn"][part]["kernel"]
        np.testing.assert_array_equal(
            np.delete(got, 1, axis=1), np.delete(came, 1, axis=1)
        )
        assert not np.array_equal(got[:, 1], came[:, 1])
        np.testing.assert_allclose(
            (params["attn"][part]["kernel"] + got)[:, 1],
            (params["attn"][part]["kernel"] + came)[:, 1] * (TAU / 60.0) ** 0.5,
            rtol=1e-6,
        )


def stacked_tree(rng: np.random.Generator, layers: int, axis: int) -> tuple[dict, list]:
    """An attention module stacked over `layers` at `axis`, and its layers."""
    units = [attention_params(rng, 4, 2) for _ in range(layers)]
    stacked = jax.tree.map(lambda *a: np.stack(a, axis=axis), *units)
    return stacked, units


@pytest.mark.parametrize("axis", [0, 1], ids=["layers first", "layer axis 1"])
def test_stacked_equals_unrolled(axis: int) -> None:
    rng = np.random.default_rng(2)
    layers = 3
    stacked, units = stacked_tree(rng, layers, axis)
    x = rng.normal(size=(B, T, D))
    per_layer = np.stack([head_max(logits(u, x)) for u in units])  # (L, B, H)
    entry = 1 if axis == 0 else clipax.LayerAxes(1)
    params = {
        "blocks": {"attn": jax.tree.map(jnp.asarray, stacked)},
        "head": jnp.ones(D),
    }
    prefix = {"blocks": entry, "head": 0}
    tx = clipax.qk_clip(TAU, stacked=prefix)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, state = jax.jit(tx.update)(
        zeros, tx.init(params), params, max_logits={"blocks": {"attn": per_layer}}
    )
    unrolled = {"blocks": [{"attn": jax.tree.map(jnp.asarray, u)} for u in units]}
    u_tx = clipax.qk_clip(TAU)
    u_zeros = jax.tree.map(jnp.zeros_like, unrolled)
    u_logits = {"blocks": [{"attn": per_layer[i]} for i in range(layers)]}
    u_updates, u_state = u_tx.update(
        u_zeros, u_tx.init(unrolled), unrolled, max_logits=u_logits
    )
    new = optax.apply_updates(params, updates)["blocks"]["attn"]
    u_new = optax.apply_updates(unrolled, u_updates)["blocks"]
    for i in range(layers):
        got = jax.tree.map(lambda a, i=i: np.take(np.asarray(a), i, axis=axis), new)
        chex.assert_trees_all_close(got, u_new[i]["attn"], rtol=1e-6)
    logs, u_logs = clipax.metrics(state), clipax.metrics(u_state)
    assert list(logs) == list(u_logs)
    assert list(logs)[:5] == [  # layers first, then heads
        "qk_clip/blocks/0/attn/0/max_logit",
        "qk_clip/blocks/0/attn/1/max_logit",
        "qk_clip/blocks/0/attn/2/max_logit",
        "qk_clip/blocks/0/attn/3/max_logit",
        "qk_clip/blocks/1/attn/0/max_logit",
    ]
    assert "qk_clip/blocks/2/attn/clipped_heads" in logs
    np.testing.assert_allclose(
        logs["qk_clip/blocks/1/attn/3/max_logit"], per_layer[1, :, 3].max(), rtol=1e-6
    )
    for k in logs:
        np.testing.assert_allclose(logs[k], u_logs[k], rtol=1e-6, err_msg=k)


def test_the_logits_as_linen_and_nnx_sow_them() -> None:
    class Attention(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            q = nn.DenseGeneral((2, DH), name="query")(x)
            k = nn.DenseGeneral((2, DH), name="key")(x)
            s = jnp.einsum("bqhe,bkhe->bhqk", q, k) / np.sqrt(DH)
            self.sow("intermediates", "max_logits", jnp.max(s, axis=(-2, -1)))
            return jnp.einsum("bhqk,bkhe->bqhe", jax.nn.softmax(s), k)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return Attention(name="attn")(x)

    x = jnp.asarray(np.random.default_rng(3).normal(size=(B, T, D)) * 3)
    variables = Model().init(jax.random.key(0), x)
    _, inter = Model().apply(variables, x, mutable=["intermediates"])
    sown = {"params": inter["intermediates"]}  # {"attn": {"max_logits": (s,)}}
    tx = clipax.qk_clip(1.0)
    zeros = jax.tree.map(jnp.zeros_like, variables)
    got, state = tx.update(zeros, tx.init(variables), variables, max_logits=sown)
    array = inter["intermediates"]["attn"]["max_logits"][0]
    want, _ = tx.update(zeros, state, variables, max_logits={"params": {"attn": array}})
    chex.assert_trees_all_equal(got, want)
    chex.assert_trees_all_close(state.max_logit["params"]["attn"], array.max(axis=0))
    # NNX: an Intermediate variable holding the sown tuple.
    nnx_logits = {"params": {"attn": {"max_logits": nnx.Intermediate((array,))}}}
    got_nnx, _ = tx.update(zeros, state, variables, max_logits=nnx_logits)
    chex.assert_trees_all_equal(got_nnx, want)


def test_with_muon_and_adamw_before_it() -> None:
    rng = np.random.default_rng(4)
    params = {"attn": jax.tree.map(jnp.asarray, attention_params(rng, 4, 4))}
    grads = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape)), params)
    s = {"attn": jnp.array([[50.0, 1.0, 2.0, 3.0]])}
    for optimizer in (optax.contrib.muon(1e-2), optax.adamw(1e-2)):
        tx = optax.chain(optimizer, clipax.qk_clip(10.0))
        alone = optimizer.update(grads, optimizer.init(params), params)[0]
        updates, state = jax.jit(tx.update)(
            grads, tx.init(params), params, max_logits=s
        )
        new = optax.apply_updates(params, updates)
        want = optax.apply_updates(params, alone)
        np.testing.assert_allclose(
            new["attn"]["query"]["kernel"][:, 0],
            want["attn"]["query"]["kernel"][:, 0] * 0.2**0.5,
            rtol=1e-5,
        )
        np.testing.assert_allclose(
            new["attn"]["key"]["kernel"][:, 1:],
            want["attn"]["key"]["kernel"][:, 1:],
            rtol=1e-6,
        )
        assert clipax.metrics(state)["qk_clip/attn/clipped_heads"] == 1


@pytest.mark.devices(4)
def test_sharded_heads_and_batch_equal_one_device() -> None:
    rng = np.random.default_rng(5)
    params = {"attn": jax.tree.map(jnp.asarray, attention_params(rng, 4, 2))}
    batch_logits = jnp.asarray(rng.normal(size=(4, 4)) * 5)  # (batch, heads)
    batch_logits = batch_logits.at[3, 1].set(4 * TAU).at[2, 2].set(2 * TAU)
    tx = clipax.qk_clip(TAU)
    zeros = jax.tree.map(jnp.zeros_like, params)
    want, want_state = tx.update(
        zeros, tx.init(params), params, max_logits={"attn": batch_logits}
    )
    assert want_state.clipped_heads["attn"] == 2  # a sharded run that clips
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    # GSPMD: the heads split over "model", the batch over "data".
    heads = {
        "attn": {
            part: {"kernel": P(None, "model"), "bias": P("model")}
            for part in ("query", "key")
        }
    }
    place = lambda t, s: jax.tree.map(  # noqa: E731
        lambda x, p: jax.device_put(x, NamedSharding(mesh, p)), t, s
    )
    sharded = place(params, heads)
    logits_sharded = {
        "attn": jax.device_put(batch_logits, NamedSharding(mesh, P("data", "model")))
    }
    got, _state = jax.jit(tx.update)(
        place(zeros, heads), tx.init(params), sharded, max_logits=logits_sharded
    )
    chex.assert_trees_all_close(got, want, rtol=1e-6)
    # shard_map with `specs`: each device its heads and its share of the batch.
    sm_tx = clipax.qk_clip(TAU, specs=heads, logit_specs={"attn": P("data", "model")})
    state_specs = jax.tree.map(lambda _: P(), want_state)
    update = jax.shard_map(
        lambda u, p, s: sm_tx.update(u, sm_tx.init(p), p, max_logits={"attn": s}),
        mesh=mesh,
        in_specs=(heads, heads, P("data", "model")),
        out_specs=(heads, state_specs),
    )
    got_sm, sm_state = jax.jit(update)(
        place(zeros, heads), sharded, logits_sharded["attn"]
    )
    chex.assert_trees_all_close(got_sm, want, rtol=1e-6)
    chex.assert_trees_all_close(sm_state, want_state)


@pytest.mark.devices(2)
def test_logits_split_inside_shard_map_without_logit_specs_are_refused() -> None:
    """Inside `shard_map`, logits whose batch varies over a mesh axis, with no
    `logit_specs`: which of their dims is split is unknown, and a max over
    this device's share of the batch is not the step's, so it is refused."""
    rng = np.random.default_rng(5)
    params = {"attn": jax.tree.map(jnp.asarray, attention_params(rng, 4, 2))}
    logits = jnp.full((4, 4), 2 * TAU)  # (batch, heads): every head clips
    mesh = jax.make_mesh((2,), ("data",))
    tx = clipax.qk_clip(TAU, specs=P())
    state_specs = jax.tree.map(lambda _: P(), tx.init(params))
    update = jax.shard_map(
        lambda p, s: tx.update(p, tx.init(p), p, max_logits={"attn": s}),
        mesh=mesh,
        in_specs=(P(), P("data")),
        out_specs=(P(), state_specs),
    )
    with pytest.raises(ValueError, match=r"\['attn'\].*pass `logit_specs=`"):
        jax.jit(update)(params, jax.device_put(logits, NamedSharding(mesh, P("data"))))


@pytest.mark.parametrize(
    ("make", "call", "error", "match"),
    [
        (
            lambda: clipax.qk_clip(0.0),
            None,
            ValueError,
            r"`threshold` must be a finite real number > 0; got 0.0",
        ),
        (
            lambda: clipax.qk_clip(float("inf")),
            None,
            ValueError,
            r"`threshold` .*; got inf",
        ),
        (
            lambda: clipax.qk_clip(float("nan")),
            None,
            ValueError,
            r"`threshold` .*; got nan",
        ),
        (
            lambda: clipax.qk_clip(1.0, alpha=1.5),
            None,
            ValueError,
            r"`alpha` must be a real number in \[0, 1\]; got 1.5",
        ),
        (
            lambda: clipax.qk_clip(1.0, rope_dim=-1),
            None,
            ValueError,
            r"`rope_dim` must be an int >= 0; got -1",
        ),
        (
            lambda: clipax.qk_clip(1.0, gqa="kv"),
            None,
            ValueError,
            r"`gqa` must be \"head\" or \"group\"; got 'kv'",
        ),
        (
            lambda: clipax.qk_clip(1.0),
            "no params",
            ValueError,
            r"needs a parameter|got params=None",
        ),
        (lambda: clipax.qk_clip(1.0), "no logits", ValueError, r"max_logits=\.\.\."),
        (
            lambda: clipax.qk_clip(1.0),
            "wrong path",
            ValueError,
            r"no array for the attention module at \['attn'\].*entries are at "
            r"\['blocks'\]",
        ),
        (
            lambda: clipax.qk_clip(1.0),
            "wrong heads",
            ValueError,
            r"shape \(2, 3\); it needs .* its 4 query heads last",
        ),
        (
            lambda: clipax.qk_clip(1.0),
            "gqa",
            ValueError,
            r"key heads divide the query heads.*\(4,\).*\(3,\)",
        ),
        (
            lambda: clipax.qk_clip(1.0),
            "int logits",
            TypeError,
            r"^`max_logits` holds the step's largest attention logits, floats; the "
            r"leaf at \['attn'\] has dtype int32\. Cast it",
        ),
        (
            lambda: clipax.qk_clip(1.0, query="q"),
            "no module",
            ValueError,
            r"no node holds a 'q' and a 'key' child",
        ),
    ],
)
def test_bad_input_is_refused(make: Any, call: Any, error: type, match: str) -> None:
    rng = np.random.default_rng(6)
    params = {
        "attn": jax.tree.map(
            jnp.asarray, attention_params(rng, 4, 4 if call != "gqa" else 3)
        )
    }
    good = {"attn": jnp.ones((2, 4))}
    with pytest.raises(error, match=match):
        tx = make()
        state = tx.init(params)
        if call == "no params":
            tx.update(params, state, None, max_logits=good)
        elif call == "no logits":
            tx.update(params, state, params)
        elif call == "wrong path":
            tx.update(params, state, params, max_logits={"blocks": good["attn"]})
        elif call == "wrong heads":
            tx.update(params, state, params, max_logits={"attn": jnp.ones((2, 3))})
        elif call == "int logits":
            ints = {"attn": jnp.ones((2, 4), jnp.int32)}
            tx.update(params, state, params, max_logits=ints)


def test_nnx_optimizer_passes_the_intermediates() -> None:
    class Attention(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.query = nnx.LinearGeneral(D, (2, DH), rngs=rngs)
            self.key = nnx.LinearGeneral(D, (2, DH), rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            q, k = self.query(x), self.key(x)
            s = jnp.einsum("bqhe,bkhe->bhqk", q, k) / np.sqrt(DH)
            self.max_logits = nnx.Intermediate(jnp.max(s, axis=(-2, -1)))
            return jnp.einsum("bhqk,bkhe->bqhe", jax.nn.softmax(s), k)

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.attn = Attention(rngs)

    model = Model(nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(7).normal(size=(B, T, D)) * 3)
    tx = optax.chain(optax.sgd(0.0), clipax.qk_clip(2.0))  # the clip alone
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    grads = nnx.grad(lambda m: jnp.sum(m.attn(x) ** 2))(model)
    inter = nnx.pop(model, nnx.Intermediate)
    optimizer.update(model, grads, max_logits=inter)
    model.attn(x)
    after = nnx.pop(model, nnx.Intermediate)["attn"]["max_logits"]
    assert float(jnp.max(after[...])) <= 2.0 * (1 + 1e-5)
    assert clipax.metrics(optimizer)["qk_clip/attn/clipped_heads"] >= 1


def test_a_layer_count_that_does_not_match_is_refused() -> None:
    rng = np.random.default_rng(8)
    stacked, _ = stacked_tree(rng, 3, 0)
    params = {"blocks": jax.tree.map(jnp.asarray, stacked)}
    tx = clipax.qk_clip(1.0, stacked=1)
    with pytest.raises(
        ValueError, match=r"shape \(2, 5, 4\); it needs the module's layers \(3,\)"
    ):
        tx.update(
            params, tx.init(params), params, max_logits={"blocks": jnp.ones((2, 5, 4))}
        )


def test_a_scanned_module_without_stacked_is_refused_never_merged() -> None:
    # Query and key (layers 2, embed 4, heads 2, head_dim 3); only layer 0's
    # head 0 over TAU. Read as one layer, its max would clip layer 1's head 0.
    rng = np.random.default_rng(13)
    params = {
        "attn": {
            part: jnp.asarray(rng.normal(size=(2, 4, 2, 3)), jnp.float32)
            for part in ("query", "key")
        }
    }
    s = jnp.array([[[4 * TAU, 1.0]], [[2.0, 3.0]]])  # (layers, batch, heads)
    zeros = jax.tree.map(jnp.zeros_like, params)
    tx = clipax.qk_clip(TAU)
    with pytest.raises(ValueError, match=r"\['attn'\].*leading axis of 2.*`stacked=`"):
        tx.update(zeros, tx.init(params), params, max_logits={"attn": s})
    stacked = clipax.qk_clip(TAU, stacked=1)
    out, state = stacked.update(
        zeros, stacked.init(params), params, max_logits={"attn": s}
    )
    for part in ("query", "key"):
        moved = np.asarray(out["attn"][part])
        assert np.any(moved[0, :, 0] != 0) and np.all(moved[0, :, 1] == 0)
        assert np.all(moved[1] == 0)  # layer 1 untouched
    np.testing.assert_array_equal(state.clipped_heads["attn"], [1, 0])


def test_maxtexts_nnx_logits_below_the_module_are_found() -> None:
    # MaxText NNX sows at self_attention/attention_op/max_logits.
    rng = np.random.default_rng(14)
    attn = jax.tree.map(jnp.asarray, attention_params(rng, 4, 4))
    params = {"decoder": {"layers": {"self_attention": attn}}}
    s = jnp.asarray(rng.normal(size=(B, 4)) * 5).at[0, 2].set(3 * TAU)
    sown = {"attention_op": {"max_logits": nnx.Intermediate((s,))}}
    logits = {"decoder": {"layers": {"self_attention": sown}}}
    tx = clipax.qk_clip(TAU)
    zeros = jax.tree.map(jnp.zeros_like, params)
    got, state = tx.update(zeros, tx.init(params), params, max_logits=logits)
    plain = {"decoder": {"layers": {"self_attention": s}}}
    want, _ = tx.update(zeros, state, params, max_logits=plain)
    chex.assert_trees_all_equal(got, want)
    assert int(state.clipped_heads["decoder"]["layers"]["self_attention"]) == 1
    # Two arrays below one module: refused, naming both.
    both = {"decoder": {"layers": {"self_attention": {"a": s, "b": s}}}}
    with pytest.raises(ValueError, match=r"several arrays.*self_attention/a.*/b"):
        tx.update(zeros, state, params, max_logits=both)


def test_each_heads_logit_and_each_layers_count_are_logged() -> None:
    rng = np.random.default_rng(15)
    params = {"attn": jax.tree.map(jnp.asarray, attention_params(rng, 4, 2))}
    s = jnp.array([[50.0, 1.0, 20.0, 3.0], [2.0, 4.0, 5.0, 6.0]])  # (batch, heads)
    tx = clipax.qk_clip(TAU)
    zeros = jax.tree.map(jnp.zeros_like, params)
    _, state = jax.jit(tx.update)(
        zeros, tx.init(params), params, max_logits={"attn": s}
    )
    logs = clipax.metrics(state)
    assert list(logs) == [
        *(f"qk_clip/attn/{h}/max_logit" for h in range(4)),
        "qk_clip/attn/clipped_heads",
    ]
    np.testing.assert_allclose(
        [logs[f"qk_clip/attn/{h}/max_logit"] for h in range(4)], [50.0, 4.0, 20.0, 6.0]
    )
    assert logs["qk_clip/attn/clipped_heads"] == 2


def test_a_flat_kernel_is_named_with_the_heads_axis_read() -> None:
    # (embed, heads * head_dim): `head_axis=-2` reads the embed axis as heads.
    params = {"attn": {"query": jnp.ones((16, 8)), "key": jnp.ones((16, 8))}}
    tx = clipax.qk_clip(TAU)
    zeros = jax.tree.map(jnp.zeros_like, params)
    with pytest.raises(
        ValueError,
        match=r"its 16 query heads last: the heads read on axis 0 \(`head_axis`=-2\) "
        r"of the query leaf at \['attn'\]\['query'\], shape \(16, 8\)",
    ):
        tx.update(zeros, tx.init(params), params, max_logits={"attn": jnp.ones((3, 2))})
