"""The whole training step a user compiles: forward, backward, clip, adamw.

A Flax GPT (width 256, 24 layers of 16 parameter leaves each: 390 leaves
unrolled), once with its layers unrolled (one module per layer) and once
stacked by `nn.scan` (one leaf per parameter, layers on its first axis). The
step is `value_and_grad` of the next-byte loss on a batch, `tx.update` with
`tx = chain(rule, adamw)`, and `apply_updates`, under `jax.jit`; each clipax
rule against the step it replaces, measured with `bench_clipping`'s harness
(both steps in one process, run times interleaved (medians), compiles after
`jax.clear_caches()` in the order clipax, reference, reference, clipax: the
least of each side counts). On the scanned model the per-tensor rules take
`stacked=` (each layer a tensor of its own), and the reference of
`clip_by_norm` is the bare formula over each layer's axes.

    PYTHONPATH=src python benchmarks/bench_train_step.py             # both models
    PYTHONPATH=src python benchmarks/bench_train_step.py --quick     # smoke run
    PYTHONPATH=src python benchmarks/bench_train_step.py --models scanned --rule adagc
    PYTHONPATH=src python benchmarks/bench_train_step.py --logging --layers 48
    PYTHONPATH=src python benchmarks/bench_train_step.py --rule qk_clip,adagc_bare

`qk_clip` runs on the model whose attention sows each head's largest logit
(`DenseGeneral` projections with a heads axis), against the same step with
AdamW alone, the logits' max computed and returned in both. `adagc_bare` and
`stable_spam_bare` and `reset_on_spike_bare` hold each rule against its bare
formula: a hand-written `jax.tree.map` version keeping the same statistics in
its state. `spectral` (5 Newton-Schulz steps) and `spectral_10` (10) soft-clip
every matrix (each leaf of rank 2 or more, its last two axes) against
`optax.contrib.scale_by_muon`'s orthogonalisation of the same matrices at its
default 5 steps (no momentum), both before AdamW.

`--logging` measures what logging costs instead: on the scanned model with
`adagc(stacked=...)`, the step that also returns `clipax.metrics(opt_state) |
clipax.tree.group_norms(grads, stacked=..., depth=3)` against the same step
without them, and the time to read every value of `clipax.metrics` outside
jit, on the state the step returned (median of 21 reads).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from statistics import geometric_mean as geo
from typing import Any

# The harness beside this file (its folder is on sys.path when run as a script).
import bench_clipping as bench
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers as Dims

import clipax

VOCAB = 256  # bytes
MAX_NORM = 1.0


class Block(nn.Module):
    """Pre-LayerNorm attention (separate q, k, v) and MLP: 16 leaves. With
    `qk`, the projections keep a heads axis (`query`, `key`, `value`:
    `DenseGeneral((heads, head_dim))`) and the attention sows each head's
    largest logit, as QK-Clip needs (docs/qk-clip.md)."""

    width: int
    heads: int
    qk: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, None]:
        batch, length, width = x.shape
        h = nn.LayerNorm()(x)
        mask = nn.make_causal_mask(jnp.ones((batch, length)))
        if self.qk:
            q, k, v = (
                nn.DenseGeneral((self.heads, width // self.heads), name=n)(h)
                for n in ("query", "key", "value")
            )
            logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
            logits = jnp.where(mask, logits, -jnp.inf)
            self.sow("intermediates", "max_logits", jnp.max(logits, axis=(-2, -1)))
            attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v)
        else:
            q, k, v = (
                nn.Dense(width, name=n)(h).reshape(batch, length, self.heads, -1)
                for n in ("q", "k", "v")
            )
            attn = nn.dot_product_attention(q, k, v, mask=mask)
        x = x + nn.Dense(width, name="out")(attn.reshape(batch, length, width))
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * width, name="fc")(h)
        return x + nn.Dense(width, name="proj")(nn.gelu(h)), None


class GPT(nn.Module):
    width: int
    layers: int
    heads: int
    scanned: bool
    qk: bool = False

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(VOCAB, self.width, name="wte")(tokens)
        pos = self.param(
            "wpe", nn.initializers.normal(0.02), (tokens.shape[1], self.width)
        )
        x = x + pos
        if self.scanned:
            blocks = nn.scan(
                Block,
                variable_axes={"params": 0, "intermediates": 0},
                split_rngs={"params": True},
                length=self.layers,
            )
            x, _ = blocks(self.width, self.heads, self.qk, name="blocks")(x, None)
        else:
            for i in range(self.layers):
                x, _ = Block(self.width, self.heads, self.qk, name=f"block_{i}")(x)
        x = nn.LayerNorm(name="ln_f")(x)
        return nn.Dense(VOCAB, name="head")(x)


def stacked(updates: Any) -> Any:
    """The scanned model's `stacked=` prefix: its blocks' leaves stack layers."""
    return clipax.stacked_prefix(updates, path="^params/blocks/")


def bare_clip_by_norm(scanned: bool) -> optax.GradientTransformation:
    """The per-tensor rule as a user writes it: `g * c / max(norm(g), c)`, the
    norm over each layer's axes where the layers are stacked."""

    def clip(path: Any, g: jax.Array) -> jax.Array:
        inner = scanned and "blocks" in jax.tree_util.keystr(path)
        axes = tuple(range(1, g.ndim)) if inner else None
        return bench.bare_clip_over(g, axes, MAX_NORM)

    return bench.stateless(lambda tree: jax.tree_util.tree_map_with_path(clip, tree))


def _optax_global(scanned: bool) -> optax.GradientTransformation:
    del scanned
    return optax.clip_by_global_norm(MAX_NORM)


def _per_tensor(factory: Callable[..., Any]) -> Callable[[bool], Any]:
    """A per-tensor rule, with `stacked=` on the scanned model."""
    return lambda scanned: factory(stacked=stacked) if scanned else factory()


def _before_adamw(rule: Callable[[bool], Any]) -> Callable[[bool, Any], Any]:
    """The optimizer `chain(rule, adamw)`."""
    return lambda scanned, adamw: optax.chain(rule(scanned), adamw)


def _layer_norms(path: Any, g: jax.Array, scanned: bool) -> jax.Array:
    """A leaf's float32 norm, per layer for the scanned model's blocks."""
    inner = scanned and "blocks" in jax.tree_util.keystr(path)
    axes = tuple(range(1, g.ndim)) if inner else None
    return jnp.sqrt(jnp.sum(jnp.square(g.astype(jnp.float32)), axis=axes))


def _per_layer(n: jax.Array, g: jax.Array) -> jax.Array:
    """Per-layer values `n` shaped to broadcast against the leaf `g`."""
    return n.reshape(n.shape + (1,) * (g.ndim - n.ndim))


def bare_adagc(scanned: bool, adamw: Any) -> optax.GradientTransformation:
    """AdaGC as a user writes it with `jax.tree.map` (defaults: ratio 1.04,
    alpha 0.99, 100 warm-up steps of global clipping to 1.0), keeping the
    statistics clipax's state keeps: each tensor's (layer's) EMA, norm and
    threshold, the step count and the global norm."""
    ratio, alpha, warmup = 1.04, 0.99, 100

    def init(params: Any) -> tuple:
        norms = jax.tree_util.tree_map_with_path(
            lambda p, g: _layer_norms(p, g, scanned), params
        )
        full = lambda v: jax.tree.map(lambda n: jnp.full_like(n, v), norms)  # noqa: E731
        return (
            full(jnp.inf),
            jnp.zeros((), jnp.int32),
            jnp.zeros(()),
            full(0),
            full(jnp.inf),
        )

    def update(updates: Any, state: tuple, params: Any = None) -> tuple:
        del params
        ema, count, _, _, thresholds = state
        norms = jax.tree_util.tree_map_with_path(
            lambda p, g: _layer_norms(p, g, scanned), updates
        )
        total = jnp.sqrt(sum(jnp.sum(jnp.square(n)) for n in jax.tree.leaves(norms)))
        factor = MAX_NORM / jnp.maximum(total, MAX_NORM)
        warming = count < warmup

        def step(e: jax.Array, n: jax.Array, t: jax.Array) -> tuple:
            unseen = e == jnp.inf
            warm_clipped = n * factor
            warm_ema = jnp.where(warm_clipped > 0, jnp.minimum(e, warm_clipped), e)
            previous = jnp.where(unseen, n, e)
            limit = ratio * previous
            after = alpha * previous + (1 - alpha) * jnp.minimum(n, limit)
            after = jnp.where(unseen & (n == 0), e, after)
            new_t = jnp.where(warming, warm_clipped, limit)
            finite = jnp.isfinite(n)
            return (
                jnp.where(finite, jnp.where(warming, warm_ema, after), e),
                jnp.where(finite, new_t, t),
            )

        stepped = jax.tree.map(step, ema, norms, thresholds)
        new_ema = jax.tree.map(lambda _, s: s[0], ema, stepped)
        new_t = jax.tree.map(lambda _, s: s[1], ema, stepped)
        clipped = jax.tree.map(
            lambda g, n, t: (g * _per_layer(t / jnp.maximum(n, t), g)).astype(g.dtype),
            updates,
            norms,
            new_t,
        )
        finite = jnp.isfinite(total)
        state = (new_ema, count + finite, total, norms, new_t)
        return clipped, state

    return optax.chain(optax.GradientTransformation(init, update), adamw)


def bare_stable_spam(scanned: bool, adamw: Any) -> optax.GradientTransformation:
    """Stable-SPAM's AdaClip and AdaGN as a user writes them with
    `jax.tree.map` (theta 0.999, gamma1 0.7, gamma2 0.9, eps 1e-8, the inner
    state reset every 1000 steps), keeping clipax's statistics."""
    theta, gamma1, gamma2, eps, reset = 0.999, 0.7, 0.9, 1e-8, 1000

    def peaks(tree: Any) -> Any:
        def peak(path: Any, g: jax.Array) -> jax.Array:
            inner = scanned and "blocks" in jax.tree_util.keystr(path)
            axes = tuple(range(1, g.ndim)) if inner else None
            return jnp.max(jnp.abs(g.astype(jnp.float32)), axis=axes)

        return jax.tree_util.tree_map_with_path(peak, tree)

    def init(params: Any) -> tuple:
        zeros = jax.tree.map(jnp.zeros_like, peaks(params))
        return adamw.init(params), jnp.zeros((), jnp.int32), zeros, zeros, zeros

    def update(updates: Any, state: tuple, params: Any = None) -> tuple:
        inner, count, m_max, m_norm, v_norm = state
        t = count + 1
        steps = t.astype(jnp.float32)
        peak = peaks(updates)
        m_max = jax.tree.map(lambda m, p: m + (1 - theta) * (p - m), m_max, peak)

        def ada_clip(g: jax.Array, m: jax.Array, p: jax.Array) -> jax.Array:
            top = _per_layer(m / (1 - theta**steps), g)
            scale = top / _per_layer(jnp.where(p > 0, p, 1), g)
            g = g.astype(jnp.float32)
            return jnp.where(jnp.abs(g) > top, g * scale, g)

        clipped = jax.tree.map(ada_clip, updates, m_max, peak)
        norms = jax.tree_util.tree_map_with_path(
            lambda p, g: _layer_norms(p, g, scanned), clipped
        )
        m_norm = jax.tree.map(lambda m, n: m + (1 - gamma1) * (n - m), m_norm, norms)
        v_norm = jax.tree.map(lambda v, n: v + (1 - gamma2) * (n**2 - v), v_norm, norms)

        def ada_gn(g: Any, n: Any, m: Any, v: Any, u: Any) -> jax.Array:
            target = (m / (1 - gamma1**steps)) / (
                jnp.sqrt(v / (1 - gamma2**steps)) + eps
            )
            factor = jnp.where(n > 0, target / jnp.where(n > 0, n, 1), 1)
            return (g * _per_layer(factor, g)).astype(u.dtype)

        out = jax.tree.map(ada_gn, clipped, norms, m_norm, v_norm, updates)
        inner = jax.lax.cond(t % reset == 0, lambda: adamw.init(params), lambda: inner)
        out, inner = adamw.update(out, inner, params)
        return out, (inner, t, m_max, m_norm, v_norm)

    return optax.GradientTransformation(init, update)


def bare_reset_on_spike(scanned: bool, adamw: Any) -> optax.GradientTransformation:
    """`reset_on_spike(adamw)`'s rule as a user writes it with `jax.tree.map`
    on AdamW's state (its defaults: each layer's gradient norm against its EMA,
    z 6, alpha 0.985, 64 warm-up norms; `mu` and `nu` reset and restarted with
    b1 0.9, b2 0.999), keeping the same statistics."""
    b1, b2, z, alpha, warmup = 0.9, 0.999, 6.0, 0.985, 64

    def norms_of(tree: Any) -> Any:
        return jax.tree_util.tree_map_with_path(
            lambda p, g: _layer_norms(p, g, scanned), tree
        )

    def init(params: Any) -> tuple:
        norms = norms_of(params)
        zeros = lambda d: jax.tree.map(lambda n: jnp.zeros(n.shape, d), norms)  # noqa: E731
        int32, f32 = jnp.int32, jnp.float32
        fields = (f32, bool, int32, int32, int32, f32, f32)
        return (adamw.init(params), jnp.zeros((), int32), *map(zeros, fields))

    def update(updates: Any, state: tuple, params: Any = None) -> tuple:
        inner, count, _, _, resets, age, seen, mean, var = state
        c = (count + 1).astype(jnp.float32)

        def restarted(m: Any, g: Any, a: Any, b: float, square: bool) -> Any:
            k = (a + 1).astype(jnp.float32)
            now = (1 - b**c) / (1 - b**k)
            before = (1 - b ** (c - 1)) / jnp.where(k > 1, 1 - b ** (k - 1), 1)
            ratio = _per_layer(jnp.where(k > 1, now / before, 0), m)
            g = jnp.square(g) if square else g
            return m * ratio + _per_layer((1 - b) * (now - 1) / b, m) * g

        adam = inner[0]
        mu = jax.tree.map(
            lambda m, g, a: restarted(m, g, a, b1, False), adam.mu, updates, age
        )
        nu = jax.tree.map(
            lambda m, g, a: restarted(m, g, a, b2, True), adam.nu, updates, age
        )
        out, inner = adamw.update(
            updates, (adam._replace(mu=mu, nu=nu), *inner[1:]), params
        )
        norms = norms_of(updates)

        def test(n: Any, s: Any, m: Any, v: Any) -> tuple:
            hit = ~jnp.isfinite(n) | ((s >= warmup) & (n - m > z * jnp.sqrt(v)))
            take = jnp.isfinite(n) & ~hit
            w, d = jnp.maximum(1 - alpha, 1 / (s + 1)), n - m
            return (
                hit,
                jnp.where(take, s + 1, s),
                jnp.where(take, m + w * d, m),
                jnp.where(take, (1 - w) * (v + w * d**2), v),
            )

        tested = jax.tree.map(test, norms, seen, mean, var)
        pick = lambda i: jax.tree.map(lambda _, t: t[i], norms, tested)  # noqa: E731
        spiked = pick(0)
        adam = inner[0]
        reset = lambda m, h: jnp.where(_per_layer(h, m), 0, m)  # noqa: E731
        adam = adam._replace(
            mu=jax.tree.map(reset, adam.mu, spiked),
            nu=jax.tree.map(reset, adam.nu, spiked),
        )
        inner = (adam, *inner[1:])
        age = jax.tree.map(lambda h, a: jnp.where(h, 0, a + 1), spiked, age)
        resets = jax.tree.map(lambda h, r: r + h, spiked, resets)
        state = (
            inner,
            count + 1,
            norms,
            spiked,
            resets,
            age,
            pick(1),
            pick(2),
            pick(3),
        )
        return out, state

    return optax.GradientTransformation(init, update)


def matrices(tree: Any) -> Any:
    """Each leaf of rank 2 or more as a batch of matrices over its last two
    axes (the scanned blocks: one matrix a layer); None at the others."""
    return jax.tree.map(
        lambda x: Dims(x.ndim - 2, x.ndim - 1) if x.ndim > 1 else None, tree
    )


def muon_orthogonalisation(scanned: bool) -> optax.GradientTransformation:
    """optax.contrib.muon's orthogonalisation (its default 5 steps) of the
    same matrices, no momentum; the other leaves unchanged."""
    del scanned
    muon = optax.contrib.scale_by_muon(
        beta=0.0, nesterov=False, weight_dimension_numbers=matrices
    )
    labels = lambda t: jax.tree.map(lambda x: "m" if x.ndim > 1 else "o", t)  # noqa: E731
    return optax.partition({"m": muon, "o": optax.identity()}, labels)


def _spectral(steps: int) -> Callable[[bool], Any]:
    return lambda scanned: clipax.clip_by_spectral_norm(
        MAX_NORM, ns_steps=steps, weight_dimension_numbers=matrices
    )


# The large trainers' skip rule (OLMo-core, MaxText) and Levanter's update clip.
TRAINERS_SKIP = {"window": 128, "ddof": 1, "warmup_steps": 63, "history": "all"}
UPDATE_CLIP = {"mode": "std", "z_threshold": 3.0, "window": 128, "warmup_steps": 64}

# Each rule: (clipax's optimizer, given whether the model is scanned and adamw;
# the reference's; its label).
RULES: dict[str, tuple[Callable[..., Any], Callable[..., Any], str]] = {
    "clip_by_global_norm": (
        _before_adamw(lambda scanned: clipax.clip_by_global_norm(MAX_NORM)),
        _before_adamw(_optax_global),
        "optax.clip_by_global_norm",
    ),
    "clip_by_norm": (
        _before_adamw(_per_tensor(lambda **kw: clipax.clip_by_norm(MAX_NORM, **kw))),
        _before_adamw(bare_clip_by_norm),
        "the bare formula (per layer)",
    ),
    "adagc": (
        _before_adamw(_per_tensor(clipax.adagc)),
        _before_adamw(_optax_global),
        "optax.clip_by_global_norm",
    ),
    "zclip": (
        _before_adamw(lambda scanned: clipax.zclip()),
        _before_adamw(_optax_global),
        "optax.clip_by_global_norm",
    ),
    "trainers_skip": (
        lambda scanned, adamw: clipax.skip_spikes(
            optax.chain(clipax.clip_by_global_norm(MAX_NORM), adamw),
            max_consecutive_skips=None,
            **TRAINERS_SKIP,
        ),
        _before_adamw(_optax_global),
        "optax.clip_by_global_norm",
    ),
    "update_clip": (
        lambda scanned, adamw: optax.chain(
            adamw, clipax.zclip(history="raw", **UPDATE_CLIP)
        ),
        _before_adamw(_optax_global),
        "optax.clip_by_global_norm",
    ),
    "stable_spam": (
        lambda scanned, adamw: clipax.stable_spam(
            adamw, stacked=stacked if scanned else None
        ),
        _before_adamw(_optax_global),
        "optax.clip_by_global_norm",
    ),
    "adagc_bare": (
        _before_adamw(_per_tensor(clipax.adagc)),
        bare_adagc,
        "the bare AdaGC (tree.map, same state)",
    ),
    "stable_spam_bare": (
        lambda scanned, adamw: clipax.stable_spam(
            adamw, stacked=stacked if scanned else None
        ),
        bare_stable_spam,
        "the bare Stable-SPAM (tree.map, same state)",
    ),
    "reset_on_spike_bare": (
        lambda scanned, adamw: clipax.reset_on_spike(
            adamw, b1=0.9, b2=0.999, stacked=stacked if scanned else None
        ),
        bare_reset_on_spike,
        "the bare reset (tree.map, same state)",
    ),
    "qk_clip": (
        lambda scanned, adamw: optax.chain(
            adamw, clipax.qk_clip(100.0, stacked=stacked if scanned else None)
        ),
        lambda scanned, adamw: adamw,
        "adamw alone (the logits' max computed in both)",
    ),
    "spectral": (
        _before_adamw(_spectral(5)),
        _before_adamw(muon_orthogonalisation),
        "muon's orthogonalisation (5 steps)",
    ),
    "spectral_10": (
        _before_adamw(_spectral(10)),
        _before_adamw(muon_orthogonalisation),
        "muon's orthogonalisation (5 steps)",
    ),
}
# The rules whose model sows each head's largest logit (QK-Clip's input).
QK_RULES = {"qk_clip"}
MODELS = {"unrolled": False, "scanned": True}


def train_step(
    model: GPT, tx: optax.GradientTransformation, log: bool = False
) -> optax.GradientTransformation:
    """The training step as a transformation for `bench_clipping.build`: its
    input is a batch of tokens, its state `(params, opt_state)`; with `log`,
    it also returns every clipax statistic and the per-layer gradient norms.
    A model with `qk` returns each head's largest logit too, and passes them
    to `tx.update` as `max_logits`."""

    def loss_fn(params: Any, tokens: jax.Array) -> tuple[jax.Array, Any]:
        logits, sown = model.apply(params, tokens[:, :-1], mutable=["intermediates"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
        return loss.mean(), {"params": sown.get("intermediates", {})}

    @jax.jit  # one compile: run op by op, each build's init compiles ~170 ops
    def init(tokens: jax.Array) -> tuple:
        params = model.init(jax.random.key(0), tokens[:, :-1])
        return params, tx.init(params)

    def update(tokens: jax.Array, state: tuple, params: Any = None) -> tuple:
        del params
        params, opt_state = state
        (loss, sown), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens)
        extra = {"max_logits": sown} if model.qk else {}
        updates, opt_state = optax.with_extra_args_support(tx).update(
            grads, opt_state, params, **extra
        )
        if model.qk:  # returned, so that both sides compute the logits' max
            loss = (loss, sown)
        if log:
            norms = clipax.tree.group_norms(grads, depth=3, stacked=stacked)
            loss = (loss, clipax.metrics(opt_state) | norms)
        return loss, (optax.apply_updates(params, updates), opt_state)

    return optax.GradientTransformation(init, update)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--compiles", type=int, default=2)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=256)
    bench.add_keys_option(parser, "--rule", RULES, list(RULES), "rules", list(RULES))
    bench.add_keys_option(
        parser, "--models", MODELS, list(MODELS), "models", list(MODELS)
    )
    parser.add_argument(
        "--logging", action="store_true", help="the cost of logging, not the rules"
    )
    args = parser.parse_args(argv)
    width, layers, heads = (32, 2, 2) if args.quick else (args.width, args.layers, 4)
    tokens = jnp.asarray(
        np.random.default_rng(0).integers(0, VOCAB, size=(4, 65)), jnp.int32
    )
    if args.logging:
        logging_cost(GPT(width, layers, heads, True), tokens, args)
        return
    print(
        f"whole training step (forward, backward, rule, adamw), GPT width {width}, "
        f"{layers} layers: {bench.header()}"
    )
    print(
        "\n| rule | against | model | leaves | clipax run ms | reference run ms "
        "| run ratio | clipax compile s | reference compile s | compile ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rule in args.rule:
        ours, theirs, label = RULES[rule]
        runs, compiles = [], []
        for name in args.models:
            scanned = MODELS[name]
            model = GPT(width, layers, heads, scanned, rule in QK_RULES)
            leaves = len(
                jax.tree.leaves(
                    jax.eval_shape(model.init, jax.random.key(0), tokens[:, :-1])
                )
            )
            mine, ref = bench.build_pair(
                lambda m=model, f=ours, s=scanned: train_step(
                    m, f(s, optax.adamw(1e-4))
                ),
                lambda m=model, f=theirs, s=scanned: train_step(
                    m, f(s, optax.adamw(1e-4))
                ),
                tokens,
                1 if args.quick else args.compiles,
            )
            run_c, run_o = bench.interleaved(
                [mine.call, ref.call], 3 if args.quick else 21
            )
            runs.append(run_c / run_o)
            compiles.append(mine.compile_s / ref.compile_s)
            print(
                f"| {rule} | {label} | {name} | {leaves} | {run_c * 1e3:.1f} | "
                f"{run_o * 1e3:.1f} | {runs[-1]:.3f} | {mine.compile_s:.3f} | "
                f"{ref.compile_s:.3f} | {compiles[-1]:.3f} |",
                flush=True,
            )
        if len(runs) > 1:
            print(
                f"| {rule} | geometric mean | | | | | {geo(runs):.3f} | | | "
                f"{geo(compiles):.3f} |",
                flush=True,
            )


def logging_cost(model: GPT, tokens: jax.Array, args: argparse.Namespace) -> None:
    """The scanned model's step with `adagc(stacked=...)`, returning its logs
    or not; and `clipax.metrics` read outside jit."""
    tx = optax.chain(clipax.adagc(stacked=stacked), optax.adamw(1e-4))
    logged, plain = bench.build_pair(
        lambda: train_step(model, tx, log=True),
        lambda: train_step(model, tx),
        tokens,
        1 if args.quick else args.compiles,
    )
    run_l, run_p = bench.interleaved([logged.call, plain.call], 3 if args.quick else 21)
    (_, logs), (_, opt_state) = logged.call()
    reads = []
    for _ in range(3 if args.quick else 21):
        start = time.perf_counter()
        values = {key: float(value) for key, value in clipax.metrics(opt_state).items()}
        reads.append(time.perf_counter() - start)
    print(
        f"logging every statistic, GPT width {model.width}, {model.layers} layers "
        f"scanned, adagc(stacked=...): {bench.header()}\n\n"
        "| keys returned | step run ms | with logs run ms | run ratio | step compile s "
        "| with logs compile s | compile ratio | metrics read outside jit ms |\n"
        "|---|---|---|---|---|---|---|---|\n"
        f"| {len(logs)} ({len(values)} from metrics) | {run_p * 1e3:.1f} | "
        f"{run_l * 1e3:.1f} | {run_l / run_p:.3f} | {plain.compile_s:.3f} | "
        f"{logged.compile_s:.3f} | {logged.compile_s / plain.compile_s:.3f} | "
        f"{statistics.median(reads) * 1e3:.1f} |",
        flush=True,
    )


if __name__ == "__main__":
    main()
