"""Every clipping rule on a small scanned GPT trained on real text, LR by LR.

A byte-level GPT (Flax linen, its transformer blocks under `nn.scan`) learns
the Python standard library's own source, which every machine has offline:
the `*.py` files directly in `sysconfig.get_paths()["stdlib"]`, sorted by
name, read as bytes (vocabulary 256). Every 10th file (the 10th, 20th, ...)
is held out; the rest is the training text. Training batches are random
windows drawn by a seeded numpy Generator; the held-out loss is taken at the
end on a fixed set of evenly spaced held-out windows.

Each rule is chained before AdamW (constant learning rate, no warm-up, Adam's
default eps and betas; activations in bfloat16 by default, `--dtype`), from
the same initialisation and on the same batches for a given seed:

- none: `adamw` alone;
- optax.clip: `chain(optax.clip_by_global_norm(1.0), adamw)`;
- clipax.clip: `chain(clipax.clip_by_global_norm(1.0), adamw)`;
- zclip, autoclip: `chain(clipax.zclip(), adamw)`, `chain(clipax.autoclip(),
  adamw)` (their defaults);
- adagc: `chain(clipax.adagc(stacked=prefix), adamw)`, per tensor and per
  layer of the scanned blocks, `prefix` from `clipax.stacked_prefix`;
- skip_spikes: `clipax.skip_spikes(chain(clipax.clip_by_global_norm(1.0),
  adamw))`, given the loss too (`tx.update(grads, state, params, loss=loss)`);
- trainers.skip: the same with the large trainers' rule (OLMo-core's and
  MaxText's: `z_threshold=6.0, window=128, ddof=1, warmup_steps=63,
  history="all", max_consecutive_skips=None`), given the loss too;
- levanter.update_clip: `chain(adamw, clipax.zclip(mode="std",
  z_threshold=3.0, window=128, warmup_steps=64, history="raw"))`, Levanter's
  clip of the update by its own history, after the optimizer;
- stable_spam: `clipax.stable_spam(adamw, stacked=prefix)`, Stable-SPAM's
  AdaClip and AdaGN per tensor and layer before AdamW (its defaults; no
  moment reset within 400 steps).

The learning rates run from one where every run is smooth (3e-3) to one where
every run diverges (0.3); in between (3e-2) the loss may jump in the first
steps, as Adam without warm-up overshoots. Measured per rule and learning
rate, over the seeds:

- loss spikes: a step whose training loss is above `SPIKE_RATIO` (1.3) times
  the exponential moving average (decay 0.9, started at the first loss) of
  the losses of the steps before it, or is non-finite; consecutive such
  steps count as one spike;
- clipped steps: the rule's `clipped` metric (adagc: any tensor clipped;
  optax's clip: the global norm above 1.0, checked here; skip_spikes: its
  inner clip, on the steps it took);
- skipped steps: skip_spikes' `skipped` metric;
- the held-out loss at the end, and whether the run diverged: a non-finite
  loss (the run stops there), or a final held-out loss above the unigram
  entropy of the training bytes (what predicting byte frequencies alone
  gets, about 3.15 nats): the model knows no more than that.

Every step of every run logs `clipax.metrics(opt_state)`, the per-layer
gradient norms of the scanned blocks (`clipax.tree.group_norms(grads, depth=3,
stacked=prefix)`: `grads/params/blocks/<layer>/norm`) and the global norm
(`grads/norm`) to `lm_spikes_metrics.jsonl`, one line per run and step. The
script prints one summary line per rule and learning rate and writes
`lm_spikes.png`: the loss curves of every rule at the learning rate and seed
where a spike of the unclipped run stands highest above the clipped runs, the
per-layer gradient norms around that spike, and the held-out loss against the
learning rate.

With `--qk-clip` the script runs a study of the largest attention logit
instead (the rules study does not run). The model's blocks then hold an
attention module `attn` whose query, key and value projections keep a heads
axis (`nn.DenseGeneral((heads, head_dim))`, named "query", "key", "value"),
with the logits computed as above and each head's largest logit of the step
sown (`self.sow("intermediates", "max_logits", ...)`, stacked layers first by
`nn.scan`). Four optimizers, from the same initialisation on the same batches
for a seed:

- adamw: `optax.adamw(lr)`, as above;
- muon: `optax.contrib.muon(lr, consistent_rms=0.2, weight_decay=1e-4,
  adam_weight_decay=1e-4, muon_weight_dimension_numbers=...)`: Kimi K2's RMS
  match, each layer's kernel orthogonalised on its own (the layer axis a batch
  axis, the input axis the reduction axis, the rest, e.g. a projection's
  (heads, head_dim), the output axes); embeddings, biases and norm scales go
  to its Adam branch;
- adamw+qk_clip, muon+qk_clip: the same, then `clipax.qk_clip(tau,
  stacked=prefix)` (tau 100 by default, `--tau`), given the sown logits
  (`tx.update(grads, state, params, max_logits={"params": sown})`).

AdamW at 0.01, 0.03 and 0.1 and Muon at 0.03, 0.1 and 0.3 (`--lrs` sets both),
3 seeds, 400 steps: without QK-Clip, the largest logit passes 100 at every
AdamW rate from 0.01 and every Muon rate from 0.1 (and grows to thousands or
millions at the higher ones), while Muon at its best rate (0.03) stays under
31; tau 100 lies in between. Measured per run: the largest attention logit per step
(the max over layers, heads and the batch of the step's forward pass, before
the step's clip), the heads clipped (summed over steps and layers), loss
spikes, the held-out loss and divergence as above. Every step is logged (the
loss, the largest logit per layer, `clipax.metrics(opt_state)`) to
`lm_qk_clip_metrics.jsonl`; the script prints one line per run and rate and
writes `lm_qk_clip.png`: per optimizer the largest logit over the steps with
and without QK-Clip at the rate where it grew most, and the held-out loss and
the largest logit against the rate.

With `--reset` the script runs a study of `clipax.reset_on_spike` instead, on
the default model: AdamW at 0.03 and 0.1 and Muon (as in the QK-Clip study) at
0.1 and 0.3, each alone and with `reset_on_spike(optimizer, stacked=prefix)`
(its defaults: the moments of a layer whose gradient norm spikes reset), the
trainers' skip rule (OLMo-core's, above), `stable_spam(optimizer,
stacked=prefix)` and `chain(adagc(stacked=prefix), optimizer)`, 3 seeds, 400
steps. Beside spikes, divergence and the held-out loss, the steps each loss
spike took to recover (until the loss is back within 5% of the EMA before the
spike) and the layers reset per run. It writes `lm_reset.png` and
`lm_reset_metrics.jsonl`.

With `--spectral` the same study runs SPECTRA's spectral clip
(`clipax.clip_by_spectral_norm(10.0, stacked=prefix)` on Adam's direction,
each layer's kernel a matrix, then SPECTRA's rectangular scale, AdamW's decay
and the learning rate: docs/porting.md, "From SPECTRA") against AdamW alone,
with `clip_by_global_norm(1.0)` and with `adagc(stacked=prefix)`, and Muon
alone, at 0.1 and 0.3, 5 seeds; it writes `lm_spectral.png` and
`lm_spectral_metrics.jsonl`.

With `--qk-clip --gqa` the same study runs on GQA attention (4 query heads
over 2 key and value heads) at the high rates (AdamW at 0.03 and 0.1, Muon at
0.1 and 0.3), each optimizer alone and followed by `clipax.qk_clip` with its
default rule for a group (`gqa="head"`: the group's hottest head at tau, the
others never grown) and with Megatron-LM's (`gqa="group"`: every head of the
group by its hottest, "+qk_clip[group]"). Beside the study's measures, the
norm of the query kernels over that of the key kernels after the last step
(`wq/wk`, logged every step). It writes `lm_qk_gqa.png` and
`lm_qk_gqa_metrics.jsonl`.

Run from the repository root:

    python examples/lm_spikes.py             # 3 rates x 1 seed x 150 steps: minutes
    python examples/lm_spikes.py --full      # 5 rates x 3 seeds x 400 steps: ~67 min
    python examples/lm_spikes.py --seeds 3 --lrs 0.01 0.03   # a part of the study
    python examples/lm_spikes.py --steps 8 --lrs 0.01        # smoke run
    python examples/lm_spikes.py --qk-clip   # 36 runs x 400 steps: ~25 min
    python examples/lm_spikes.py --qk-clip --steps 6 --lrs 0.1 --tau 1   # smoke run
    python examples/lm_spikes.py --qk-clip --gqa   # 36 runs x 400 steps: ~25 min
    python examples/lm_spikes.py --reset     # 60 runs x 400 steps: ~45 min
    python examples/lm_spikes.py --spectral  # 100 runs x 400 steps
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import sysconfig
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from flax import linen as nn
from tqdm import tqdm

import clipax

matplotlib.use("Agg")
import matplotlib.pyplot as plt

OUTPUT = "lm_spikes.png"
LOG = "lm_spikes_metrics.jsonl"  # one line per run and step
VOCAB = 256  # bytes
SEQ = 128
BATCH = 16
D_MODEL = 64
LAYERS = 2
HEADS = 4
HOLD_OUT_EVERY = 10  # every 10th file (by sorted name) is held out
EVAL_WINDOWS = 64
MAX_NORM = 1.0  # the fixed rules' threshold
SPIKE_RATIO = 1.3  # a loss spike: loss > SPIKE_RATIO * EMA of the losses before
SPIKE_DECAY = 0.9
SPIKE_FROM = 1  # the first step tested for a spike
DEFAULT = {"steps": 150, "seeds": 1, "lrs": [0.003, 0.03, 0.3]}
FULL = {"steps": 400, "seeds": 3, "lrs": [0.003, 0.01, 0.03, 0.1, 0.3]}
RULES = (
    "none",
    "optax.clip",
    "clipax.clip",
    "zclip",
    "adagc",
    "autoclip",
    "skip_spikes",
    "trainers.skip",
    "levanter.update_clip",
    "stable_spam",
)
COLORS = {
    "none": "tab:gray",
    "optax.clip": "tab:cyan",
    "clipax.clip": "tab:blue",
    "zclip": "tab:green",
    "adagc": "tab:red",
    "autoclip": "tab:orange",
    "skip_spikes": "tab:brown",
    "trainers.skip": "tab:pink",
    "levanter.update_clip": "tab:olive",
    "stable_spam": "tab:purple",
}
QK_OUTPUT = "lm_qk_clip.png"
QK_LOG = "lm_qk_clip_metrics.jsonl"  # one line per QK run and step
GQA_OUTPUT = "lm_qk_gqa.png"
GQA_LOG = "lm_qk_gqa_metrics.jsonl"
QK_TAU = 100.0  # QK-Clip's threshold in the --qk-clip study (Kimi K2's)
QK_RUNS = ("adamw", "adamw+qk_clip", "muon", "muon+qk_clip")
QK_COLORS = {
    "adamw": "tab:blue",
    "adamw+qk_clip": "tab:cyan",
    "adamw+qk_clip[group]": "tab:green",
    "muon": "tab:red",
    "muon+qk_clip": "tab:orange",
    "muon+qk_clip[group]": "tab:purple",
}
QK = {  # AdamW: where its logits pass 100, up; Muon: its best rate, up
    "steps": 400,
    "seeds": 3,
    "lrs": {"adamw": [0.01, 0.03, 0.1], "muon": [0.03, 0.1, 0.3]},
}
# The GQA study (--gqa): 4 query heads over 2 key heads, the high rates, and
# QK-Clip's two rules for a group (`gqa="head"`, `gqa="group"`: "[group]").
GQA_KV_HEADS = 2
GQA_RUNS = (
    "adamw",
    "adamw+qk_clip",
    "adamw+qk_clip[group]",
    "muon",
    "muon+qk_clip",
    "muon+qk_clip[group]",
)
GQA = {"steps": 400, "seeds": 3, "lrs": {"adamw": [0.03, 0.1], "muon": [0.1, 0.3]}}
# The moment-reset study (--reset): each optimizer alone and with each rule.
RESET_RULES = ("none", "reset_on_spike", "trainers.skip", "stable_spam", "adagc")
RESET = {"steps": 400, "seeds": 3, "lrs": {"adamw": [0.03, 0.1], "muon": [0.1, 0.3]}}
RESET_OUTPUT = "lm_reset.png"
RESET_LOG = "lm_reset_metrics.jsonl"
# The spectral study (--spectral): SPECTRA's clip against the global clip,
# AdaGC and nothing on AdamW, and Muon alone, at the rates where runs diverge.
SPECTRAL_RUNS = (
    "adamw/none",
    "adamw/clip",
    "adamw/adagc",
    "adamw/spectra",
    "muon/none",
)
SPECTRAL = {"steps": 400, "seeds": 5, "lrs": {"adamw": [0.1, 0.3], "muon": [0.1, 0.3]}}
SPECTRAL_OUTPUT = "lm_spectral.png"
SPECTRAL_LOG = "lm_spectral_metrics.jsonl"
SPECTRA_C = 10.0  # SPECTRA's default threshold for the update's singular values
RECOVERED = 1.05  # recovered: the loss back within 5% of its pre-spike EMA
# The large trainers' skip rule (OLMo-core, MaxText; Levanter's has ddof=0 and
# warmup_steps=64): every step's values in a window of 128, 6 sigma.
TRAINERS_SKIP = {
    "z_threshold": 6.0,
    "window": 128,
    "ddof": 1,
    "warmup_steps": 63,
    "history": "all",
    "max_consecutive_skips": None,
}


# -- data ---------------------------------------------------------------------


def load_text() -> tuple[np.ndarray, np.ndarray, int]:
    """The standard library's top-level `*.py` files as bytes: the training
    text, the held-out text (every `HOLD_OUT_EVERY`-th file by name) and the
    number of files."""
    folder = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(folder.glob("*.py"), key=lambda p: p.name)
    train, held = [], []
    for i, path in enumerate(files):
        part = held if i % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1 else train
        part.append(path.read_bytes())
    joined = [np.frombuffer(b"\n".join(part), np.uint8) for part in (train, held)]
    return joined[0], joined[1], len(files)


def corpus() -> tuple[np.ndarray, np.ndarray, int, float, np.ndarray]:
    """The training and held-out bytes, how many files they came from, the
    unigram entropy of the training bytes and the held-out windows."""
    train_text, held_text, files = load_text()
    bound = unigram_entropy(train_text)
    return train_text, held_text, files, bound, eval_windows(held_text)


def seeded(
    model: Any, seeds: list[int], steps: int, text: np.ndarray
) -> Iterator[tuple[int, Any, Any, np.ndarray]]:
    """Per seed: the model's stacked prefix, its initial (unboxed) parameters
    and its batches."""
    for seed in seeds:
        boxed = model.init(jax.random.key(seed), jnp.zeros((1, SEQ), jnp.int32))
        prefix = clipax.stacked_prefix(boxed, axis_name="layers")
        yield seed, prefix, nn.unbox(boxed), batches(text, steps, seed)


def unigram_entropy(text: np.ndarray) -> float:
    """The entropy (nats) of the byte frequencies: the loss of a model that
    predicts every byte from the frequencies alone."""
    p = np.bincount(text, minlength=VOCAB) / text.size
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def batches(text: np.ndarray, steps: int, seed: int) -> np.ndarray:
    """`steps` batches of `BATCH` random windows of `SEQ + 1` bytes, int32:
    the same for every rule and learning rate of a seed."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, text.size - SEQ - 1, size=(steps, BATCH))
    return text[starts[..., None] + np.arange(SEQ + 1)].astype(np.int32)


def eval_windows(text: np.ndarray) -> np.ndarray:
    """`EVAL_WINDOWS` evenly spaced windows of the held-out text: fixed."""
    starts = np.linspace(0, text.size - SEQ - 1, EVAL_WINDOWS).astype(int)
    return text[starts[:, None] + np.arange(SEQ + 1)].astype(np.int32)


# -- model --------------------------------------------------------------------

normal = nn.initializers.normal(0.02)
zeros = nn.initializers.zeros_init()
ones = nn.initializers.ones_init()


def logical(init: Callable[..., Any], names: tuple[str, ...]) -> Any:
    """`init` with logical axis names: `nn.scan` puts "layers" before them."""
    return nn.with_logical_partitioning(init, names)


def layer_norm(dtype: Any, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(
        dtype=dtype,
        scale_init=logical(ones, ("embed",)),
        bias_init=logical(zeros, ("embed",)),
        name=name,
    )


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a GELU
    MLP, each added to the residual stream. Scanned: `(x, None) -> (x, None)`."""

    d_model: int
    heads: int
    dtype: Any

    def dense(self, features: int, names: tuple[str, str], name: str) -> nn.Dense:
        return nn.Dense(
            features,
            dtype=self.dtype,
            kernel_init=logical(normal, names),
            bias_init=logical(zeros, names[1:]),
            name=name,
        )

    @nn.compact
    def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
        b, t, d = x.shape
        head = d // self.heads
        h = layer_norm(self.dtype, "ln1")(x)
        qkv = self.dense(3 * d, ("embed", "qkv"), "qkv")(h)
        qkv = qkv.reshape(b, t, 3 * self.heads, head)
        q, k, v = jnp.split(qkv, 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
        causal = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(causal, scores / math.sqrt(head), -1e9)
        weights = jax.nn.softmax(scores).astype(self.dtype)
        y = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
        x = x + self.dense(d, ("qkv", "embed"), "attn_out")(y)
        h = layer_norm(self.dtype, "ln2")(x)
        h = nn.gelu(self.dense(4 * d, ("embed", "mlp"), "mlp_in")(h))
        return x + self.dense(d, ("mlp", "embed"), "mlp_out")(h), None


class Attention(nn.Module):
    """Causal self-attention whose query, key and value projections keep a
    heads axis (`DenseGeneral((heads, head_dim))`, the layout `clipax.qk_clip`
    reads), the logits computed as `Block`'s; sows each head's largest logit
    of the step (`max_logits`, shape `(batch, heads)`)."""

    heads: int
    dtype: Any
    kv_heads: int = 0  # GQA: fewer key and value heads (0: as many as `heads`)

    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        b, t, d = h.shape
        head = d // self.heads

        def project(name: str, heads: int) -> jax.Array:
            return nn.DenseGeneral(
                (heads, head),
                dtype=self.dtype,
                kernel_init=logical(normal, ("embed", "heads", "head")),
                bias_init=logical(zeros, ("heads", "head")),
                name=name,
            )(h)

        group = self.heads // (self.kv_heads or self.heads)
        q = project("query", self.heads)
        k, v = (
            jnp.repeat(project(name, self.kv_heads or self.heads), group, axis=2)
            for name in ("key", "value")
        )
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
        causal = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(causal, scores / math.sqrt(head), -1e9)
        self.sow("intermediates", "max_logits", jnp.max(scores, axis=(-2, -1)))
        weights = jax.nn.softmax(scores).astype(self.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)


class QKBlock(Block):
    """`Block` with its attention an `Attention` module named `attn` (a node
    holding `query` and `key`: `qk_clip`'s attention module)."""

    kv_heads: int = 0

    @nn.compact
    def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
        d = x.shape[-1]
        h = layer_norm(self.dtype, "ln1")(x)
        y = Attention(self.heads, self.dtype, self.kv_heads, name="attn")(h)
        x = x + self.dense(d, ("qkv", "embed"), "attn_out")(y)
        h = layer_norm(self.dtype, "ln2")(x)
        h = nn.gelu(self.dense(4 * d, ("embed", "mlp"), "mlp_in")(h))
        return x + self.dense(d, ("mlp", "embed"), "mlp_out")(h), None


class GPT(nn.Module):
    """Token and learned position embeddings, `layers` scanned blocks, a final
    LayerNorm and the output head tied to the token embedding. Parameters
    are float32; `dtype` is that of the activations."""

    layers: int = LAYERS
    d_model: int = D_MODEL
    heads: int = HEADS
    dtype: Any = jnp.float32
    block: Any = Block  # QKBlock: attention with a heads axis, its logits sown
    kv_heads: int = 0  # QKBlock's key and value heads (GQA; 0: `heads`)

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(
            VOCAB,
            self.d_model,
            dtype=self.dtype,
            embedding_init=logical(normal, ("vocab", "embed")),
            name="embed",
        )
        pos = self.param("pos", logical(normal, ("seq", "embed")), (SEQ, self.d_model))
        x = embed(tokens) + pos[: tokens.shape[1]].astype(self.dtype)
        blocks = nn.scan(
            self.block,
            variable_axes={"params": 0, "intermediates": 0},  # layers first
            split_rngs={"params": True},
            length=self.layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        gqa = {"kv_heads": self.kv_heads} if self.kv_heads else {}
        block = blocks(self.d_model, self.heads, self.dtype, name="blocks", **gqa)
        x, _ = block(x, None)
        x = layer_norm(self.dtype, "ln_final")(x)
        return embed.attend(x).astype(jnp.float32)


def cross_entropy(model: GPT, params: Any, windows: jax.Array) -> jax.Array:
    """The mean next-byte loss over `windows` (each `SEQ + 1` bytes)."""
    logits = model.apply(params, windows[:, :-1])
    labels = windows[:, 1:]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# -- the rules ----------------------------------------------------------------


def optimizer(rule: str, lr: Any, prefix: Any) -> optax.GradientTransformation:
    """The whole optimizer of `rule`; `lr` may be traced (one compilation per
    rule serves every learning rate)."""
    adamw = optax.adamw(lr)  # b1 0.9, b2 0.999, eps 1e-8, weight decay 1e-4
    if rule == "none":
        return adamw
    if rule == "optax.clip":
        return optax.chain(optax.clip_by_global_norm(MAX_NORM), adamw)
    if rule == "clipax.clip":
        return optax.chain(clipax.clip_by_global_norm(MAX_NORM), adamw)
    if rule == "zclip":
        return optax.chain(clipax.zclip(), adamw)
    if rule == "adagc":
        return optax.chain(clipax.adagc(stacked=prefix), adamw)
    if rule == "autoclip":
        return optax.chain(clipax.autoclip(), adamw)
    if rule == "skip_spikes":
        return clipax.skip_spikes(
            optax.chain(clipax.clip_by_global_norm(MAX_NORM), adamw)
        )
    if rule == "trainers.skip":
        clipped = optax.chain(clipax.clip_by_global_norm(MAX_NORM), adamw)
        return clipax.skip_spikes(clipped, **TRAINERS_SKIP)
    if rule == "levanter.update_clip":
        update_clip = clipax.zclip(
            mode="std", z_threshold=3.0, window=128, warmup_steps=64, history="raw"
        )
        return optax.chain(adamw, update_clip)
    if rule == "stable_spam":
        return clipax.stable_spam(adamw, stacked=prefix)
    raise ValueError(f"unknown rule {rule!r}")


def reset_optimizer(
    run: str, lr: Any, prefix: Any, dims: Any
) -> optax.GradientTransformation:
    """The optimizer of a run of the reset study, "<adamw|muon>/<rule>": the
    optimizer alone, or with `reset_on_spike`, the trainers' skip rule,
    Stable-SPAM or AdaGC, each per layer of the scanned blocks."""
    name, rule = run.split("/")
    opt = qk_optimizer(name, lr, prefix, dims, QK_TAU)
    if rule == "reset_on_spike":
        # Both optimizers' Adam moments decay by optax's 0.9 and 0.999; Muon's
        # orthogonalised momentum (beta 0.95) restarts with 0.9 too.
        return clipax.reset_on_spike(opt, b1=0.9, b2=0.999, stacked=prefix)
    if rule == "trainers.skip":
        clipped = optax.chain(clipax.clip_by_global_norm(MAX_NORM), opt)
        return clipax.skip_spikes(clipped, **TRAINERS_SKIP)
    if rule == "stable_spam":
        return clipax.stable_spam(opt, stacked=prefix)
    if rule == "adagc":
        return optax.chain(clipax.adagc(stacked=prefix), opt)
    if rule == "clip":
        return optax.chain(clipax.clip_by_global_norm(MAX_NORM), opt)
    if rule == "spectra":  # SPECTRA's AdamW, as docs/porting.md writes it
        return optax.chain(
            optax.scale_by_adam(),  # AdamW's b1, b2, eps
            clipax.clip_by_spectral_norm(SPECTRA_C, stacked=prefix),
            rectangular(prefix),
            optax.add_decayed_weights(1e-4),
            optax.scale_by_learning_rate(lr),
        )
    return opt


def rectangular(prefix: Any) -> optax.GradientTransformation:
    """SPECTRA's scale of each matrix's update, sqrt(max(1, out / in)), a
    kernel's layer (in, out) a matrix (the leaves the spectral clip takes)."""

    def scale(u: jax.Array, layers: int) -> jax.Array:
        shape = u.shape[layers:]
        return u * max(1.0, shape[1] / shape[0]) ** 0.5 if len(shape) == 2 else u

    return optax.stateless(
        lambda updates, _: jax.tree.map(
            scale, updates, jax.tree.broadcast(prefix, updates)
        )
    )


class Trainer:
    """The jitted steps: one gradient step for every rule (it also takes the
    per-layer norms), one update step per rule, one held-out evaluation;
    `make(rule, lr, prefix)` gives a rule's optimizer (`optimizer`'s)."""

    def __init__(self, model: GPT, prefix: Any, make: Any = None) -> None:
        self.model, self.prefix = model, prefix
        self.optimizer = make or optimizer

        def grad_step(params: Any, windows: jax.Array) -> Any:
            loss, grads = jax.value_and_grad(
                lambda p: cross_entropy(model, p, windows)
            )(params)
            norms = clipax.tree.group_norms(
                grads, depth=3, stacked=prefix, key_prefix="grads"
            )
            return loss, grads, norms, clipax.tree.global_norm(grads)

        def update_step(
            rule: str, grads: Any, opt_state: Any, params: Any, lr: Any, loss: Any
        ) -> Any:
            tx = self.optimizer(rule, lr, prefix)
            if rule.endswith(("skip_spikes", "trainers.skip")):  # the loss too
                updates, opt_state = tx.update(grads, opt_state, params, loss=loss)
            else:
                updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            return params, opt_state, clipax.metrics(opt_state)

        self.grad_step = jax.jit(grad_step)
        self.update_step = jax.jit(update_step, static_argnums=0)
        self.evaluate = jax.jit(lambda p, w: cross_entropy(model, p, w))


# -- one run ------------------------------------------------------------------


def spike_steps(loss: np.ndarray) -> np.ndarray:
    """The steps that are loss spikes as the docstring defines them: above
    `SPIKE_RATIO` times the EMA of the losses before them, or non-finite."""
    out = np.zeros(loss.size, bool)
    ema = float(loss[0])
    for t in range(SPIKE_FROM, loss.size):
        value = float(loss[t])
        out[t] = not value <= SPIKE_RATIO * ema  # NaN: a spike
        if not math.isfinite(value):
            break
        ema = SPIKE_DECAY * ema + (1 - SPIKE_DECAY) * value
    return out


def recoveries(loss: np.ndarray) -> list[int]:
    """Per loss spike (the first step of each), the steps until the loss is
    back within `RECOVERED` times the EMA of the losses before it (to the
    end of the run where it never is)."""
    out, ema, first = [], float(loss[0]), spike_steps(loss)
    starts = {a for a, _ in events(first)}
    for t in range(SPIKE_FROM, loss.size):
        if t in starts:
            back = np.flatnonzero(loss[t:] <= RECOVERED * ema)
            out.append(int(back[0]) if back.size else loss.size - t)
        if not math.isfinite(float(loss[t])):
            break
        ema = SPIKE_DECAY * ema + (1 - SPIKE_DECAY) * float(loss[t])
    return out


def events(steps: np.ndarray) -> list[tuple[int, int]]:
    """The runs of consecutive spike steps: (first, last) of each."""
    edges = np.diff(np.concatenate([[0], steps.astype(int), [0]]))
    return list(
        zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1, strict=True)
    )


def flags(rule: str, metrics: dict[str, float], norm: float) -> tuple[bool, bool]:
    """Whether the step was clipped and whether it was skipped, from the
    metrics (`norm`, the global norm, for optax's clip, which keeps none)."""
    skipped = any(v for k, v in metrics.items() if k.endswith("/skipped"))
    if rule == "none":
        clipped = False
    elif rule == "optax.clip":
        clipped = norm > MAX_NORM
    else:  # a skipped step's inner state (and flag) is the step before's
        clipped = not skipped and any(
            v for k, v in metrics.items() if k.endswith("/clipped")
        )
    return clipped, skipped


def train(
    trainer: Trainer,
    rule: str,
    lr: float,
    seed: int,
    params: Any,
    data: np.ndarray,
    held_out: np.ndarray,
    log: TextIO,
    bar: tqdm,
) -> dict[str, Any]:
    """Trains from `params` on the batches `data` with `rule` at `lr`; logs
    every step to `log`. Stops at a non-finite loss."""
    steps = data.shape[0]
    opt_state = trainer.optimizer(rule, lr, trainer.prefix).init(params)
    loss_curve = np.full(steps, np.nan)
    layer_norms: dict[str, np.ndarray] = {}
    clipped = skipped = 0
    lr_array = jnp.asarray(lr, jnp.float32)
    for t in range(steps):
        loss, grads, norms, total = trainer.grad_step(params, data[t])
        params, opt_state, metrics = trainer.update_step(
            rule, grads, opt_state, params, lr_array, loss
        )
        loss, norms, metrics = jax.device_get((loss, norms, metrics))
        norms = {k: float(v) for k, v in norms.items()} | {"grads/norm": float(total)}
        metrics = {k: float(v) for k, v in metrics.items()}
        row = {"rule": rule, "lr": lr, "seed": seed, "step": t, "loss": float(loss)}
        logged = {k: float(f"{v:.6g}") for k, v in {**norms, **metrics}.items()}
        log.write(json.dumps({**row, **logged}) + "\n")
        loss_curve[t] = float(loss)
        for key, value in norms.items():
            if "/blocks/" in key:
                layer_norms.setdefault(key, np.full(steps, np.nan))[t] = value
        was_clipped, was_skipped = flags(rule, metrics, norms["grads/norm"])
        clipped += was_clipped
        skipped += was_skipped
        bar.update()
        bar.set_postfix(rule=rule, loss=f"{float(loss):.3f}", refresh=False)
        if not math.isfinite(float(loss)):
            bar.update(steps - 1 - t)
            break
    held = float(trainer.evaluate(params, held_out))
    return {
        "loss": loss_curve,
        "layer_norms": layer_norms,
        "held_out": held,
        "clipped": clipped,
        "skipped": skipped,
        "resets": sum(v for k, v in metrics.items() if k.endswith("/resets")),
        "spike_steps": spike_steps(loss_curve),
        "spikes": len(events(spike_steps(loss_curve))),
        "finite": bool(np.isfinite(loss_curve).all()),
    }


# -- summary and figure -------------------------------------------------------


def diverged(run: dict[str, Any], bound: float) -> bool:
    return not run["finite"] or not run["held_out"] <= bound


def mark(ax: Any, y: float, text: str, x: float, **line: Any) -> None:
    """A black horizontal line at `y`, named at `x`."""
    ax.axhline(y, color="black", lw=1, **line)
    ax.annotate(text, (x, y), fontsize=8, xytext=(2, 3), textcoords="offset points")


def finish(ax: Any, title: str, **legend: Any) -> None:
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, frameon=False, **legend)
    ax.grid(alpha=0.3)


def held_out_sweep(
    ax: Any,
    runs: dict[tuple[str, float, int], dict[str, Any]],
    rates: dict[str, list[float]],
    styles: dict[str, dict[str, Any]],
    bound: float,
    **legend: Any,
) -> None:
    """Per run name, its mean held-out loss (capped at 10) over its rates, an
    x where a seed diverged; `styles` gives each name's plot keywords."""
    seeds = sorted({s for _, _, s in runs})
    for name, style in styles.items():
        held = [
            np.mean([runs[name, r, s]["held_out"] for s in seeds]) for r in rates[name]
        ]
        capped = np.clip(np.nan_to_num(held, nan=10.0, posinf=10.0), None, 10.0)
        ax.plot(rates[name], capped, marker="o", label=name, **style)
        for r, h in zip(rates[name], capped, strict=True):
            if any(diverged(runs[name, r, s], bound) for s in seeds):
                ax.plot(r, h, "x", color="black", ms=10)
    ax.axhline(bound, color="black", lw=1, alpha=0.5)
    ax.set(
        xscale="log",
        xlabel="learning rate",
        ylabel="held-out loss at the end (capped at 10)",
    )
    finish(
        ax, f"held-out loss, mean of {len(seeds)} seed(s); x: a run diverged", **legend
    )


def summary(
    runs: dict[tuple[str, float, int], dict[str, Any]], lrs: list[float], bound: float
) -> list[str]:
    """One line per rule and learning rate: means over the seeds."""
    seeds = sorted({seed for _, _, seed in runs})
    head = (
        f"{'rule':>12} {'lr':>8} {'seeds':>5} {'spikes':>7} {'clipped':>8} "
        f"{'skipped':>8} {'held-out':>9} {'diverged':>8}"
    )
    lines = [head]
    for lr in lrs:
        for rule in RULES:
            group = [runs[rule, lr, seed] for seed in seeds]
            held = [r["held_out"] for r in group if math.isfinite(r["held_out"])]
            spikes, clipped, skipped = (
                float(np.mean([r[key] for r in group]))
                for key in ("spikes", "clipped", "skipped")
            )
            lines.append(
                f"{rule:>12} {lr:8.0e} {len(group):5d} {spikes:7.2f} "
                f"{clipped:8.1f} {skipped:8.1f} "
                f"{float(np.mean(held)) if held else math.nan:9.3f} "
                f"{sum(diverged(r, bound) for r in group):4d}/{len(group)}"
            )
    return lines


def per_seed(
    runs: dict[tuple[str, float, int], dict[str, Any]], bound: float
) -> list[str]:
    """One line per run name and learning rate, seed by seed: the held-out
    loss (`*` where the run diverged), the loss spikes and, where measured,
    the mean steps to recover; then the median and range of the held-out
    loss over the seeds and the runs that diverged. At the rates where runs
    diverge a run is chaotic: which seed diverges changes with the last bit
    of a float, so between machines."""
    seeds = sorted({seed for _, _, seed in runs})
    lines = [
        "per seed " + " ".join(map(str, seeds)) + ": held-out loss (* diverged)/"
        "spikes[/steps to recover]; the median and range of the held-out loss"
    ]
    for name, lr in dict.fromkeys((name, lr) for name, lr, _ in runs):
        group = [runs[name, lr, seed] for seed in seeds]
        cells = []
        for run in group:
            cell = f"{run['held_out']:.3f}{'*' if diverged(run, bound) else ''}"
            cell += f"/{run['spikes']}"
            if "recoveries" in run:
                cell += f"/{np.mean(run['recoveries']) if run['recoveries'] else 0:.1f}"
            cells.append(cell)
        held = np.array([run["held_out"] for run in group])
        lines.append(
            f"  {name} @ {lr:g}: {' '.join(cells)} | median "
            f"{np.nanmedian(held):.3f}, range {np.nanmin(held):.3f} to "
            f"{np.nanmax(held):.3f}, diverged "
            f"{sum(diverged(run, bound) for run in group)}/{len(group)}"
        )
    return lines


def pick(
    runs: dict[tuple[str, float, int], dict[str, Any]], lrs: list[float]
) -> tuple[float, int, int]:
    """The unclipped run's spike that stands highest above the clipped runs
    (its loss over their median loss, at its worst step): its learning rate,
    seed and first step. Without a spike: the highest rate, the first seed and
    the step of the unclipped run's highest loss."""
    best: tuple[float, float, int, int] | None = None
    for (rule, lr, seed), run in runs.items():
        if rule != "none":
            continue
        others = np.median([runs[r, lr, seed]["loss"] for r in RULES[1:]], axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):
            excess = np.where(np.isfinite(run["loss"]), run["loss"] / others, np.inf)
        excess = np.nan_to_num(excess, nan=0.0)
        for first, last in events(run["spike_steps"]):
            height = float(excess[first : last + 1].max())
            if best is None or height > best[0]:
                best = (height, lr, seed, int(first))
    if best is None:
        seed = min(s for _, _, s in runs)
        loss = runs["none", max(lrs), seed]["loss"]
        return max(lrs), seed, int(np.argmax(np.nan_to_num(loss, nan=np.inf)))
    return best[1:]


def plot(
    runs: dict[tuple[str, float, int], dict[str, Any]],
    lrs: list[float],
    bound: float,
) -> tuple[float, int, int]:
    """Loss curves of every rule at the learning rate and seed of the spike
    `pick` picks, the per-layer gradient norms around it (unclipped and
    adagc), and the held-out loss against the learning rate. Returns the
    spike's learning rate, seed and step."""
    lr, seed, at = pick(runs, lrs)
    fig = plt.figure(figsize=(14, 9))
    grid = fig.add_gridspec(2, 2, height_ratios=[1.3, 1])
    top = fig.add_subplot(grid[0, :])
    for name in RULES:
        run = runs[name, lr, seed]
        style = "--" if name == "optax.clip" else "-"
        label = f"{name}: {run['spikes']} spikes, held-out {run['held_out']:.3f}"
        top.plot(run["loss"], style, color=COLORS[name], lw=1, label=label)
    top.axvline(at, color="red", alpha=0.3, lw=3)
    top.set(yscale="log", xlabel="step", ylabel="training loss (batch, nats)")
    top.set_title(
        f"byte-level GPT on the Python stdlib, AdamW lr {lr:g}, seed {seed}; red: "
        + (
            f"the unclipped run's spike highest above the others starts (step {at})"
            if runs["none", lr, seed]["spikes"]
            else f"no unclipped spike, its highest loss (step {at})"
        )
    )
    top.legend(ncol=2, fontsize=8, frameon=False)
    top.grid(alpha=0.3)

    near = fig.add_subplot(grid[1, 0])
    steps = len(runs["none", lr, seed]["loss"])
    x = np.arange(max(0, at - 40), min(steps, at + 41))
    palette = ("tab:purple", "tab:olive", "tab:pink", "tab:cyan", "tab:brown")
    for name, style in (("none", "-"), ("adagc", ":")):
        norms = runs[name, lr, seed]["layer_norms"]
        for i, (key, values) in enumerate(sorted(norms.items())):
            layer = key.split("/blocks/")[1].split("/")[0]
            near.plot(
                x,
                values[x],
                style,
                color=palette[i % len(palette)],
                label=f"{name}: block {layer}",
            )
    near.axvline(at, color="red", alpha=0.3, lw=3)
    near.set(yscale="log", xlabel="step", ylabel="gradient norm (before clipping)")
    finish(near, "per-layer gradient norms of the scanned blocks around the spike")

    sweep = fig.add_subplot(grid[1, 1])
    styles = {
        name: {"color": COLORS[name], "ls": "--" if name == "optax.clip" else "-"}
        for name in RULES
    }
    held_out_sweep(sweep, runs, dict.fromkeys(RULES, lrs), styles, bound, ncol=2)
    sweep.annotate(
        "unigram entropy",
        (lrs[0], bound),
        fontsize=8,
        xytext=(2, 3),
        textcoords="offset points",
    )
    fig.tight_layout()
    fig.savefig(OUTPUT, dpi=100)
    plt.close(fig)
    return lr, seed, at


# -- the QK-Clip study (--qk-clip) ---------------------------------------------


def muon_dims(params: Any, prefix: Any) -> Any:
    """Muon's `muon_weight_dimension_numbers` for `params`: each kernel one
    matrix per layer (its layer axes batch axes, the input axis the reduction
    axis, the rest, e.g. a projection's (heads, head_dim), the output axes);
    every other leaf (embeddings, biases, norm scales) None, Muon's Adam."""

    def of(layers: int, subtree: Any) -> Any:
        def dims(path: Any, x: Any) -> Any:
            if not path or getattr(path[-1], "key", None) != "kernel":
                return None
            return optax.contrib.MuonDimensionNumbers(
                reduction_axis=layers, output_axis=tuple(range(layers + 1, x.ndim))
            )

        return jax.tree_util.tree_map_with_path(dims, subtree)

    return jax.tree.map(of, prefix, params)


def qk_optimizer(
    run: str, lr: Any, prefix: Any, dims: Any, tau: float
) -> optax.GradientTransformation:
    """The optimizer of a QK run: "adamw" or "muon", with "+qk_clip" followed
    by `clipax.qk_clip(tau, stacked=prefix)` ("+qk_clip[group]": with
    `gqa="group"`)."""
    name, _, clip = run.partition("+")
    if name == "adamw":
        opt = optax.adamw(lr)  # as the rules study's
    else:  # Kimi K2's RMS match; AdamW's weight decay, on both of its branches
        opt = optax.contrib.muon(
            lr,
            weight_decay=1e-4,
            adam_weight_decay=1e-4,
            consistent_rms=0.2,
            muon_weight_dimension_numbers=dims,
        )
    if clip:
        gqa = "group" if clip.endswith("[group]") else "head"
        opt = optax.chain(opt, clipax.qk_clip(tau, stacked=prefix, gqa=gqa))
    return opt


class QKTrainer:
    """The jitted steps of the QK study: the gradient step (it also returns
    the sown logits), one update step per run, the held-out evaluation."""

    def __init__(self, model: GPT, prefix: Any, dims: Any, tau: float) -> None:
        self.prefix, self.dims, self.tau = prefix, dims, tau

        def loss_fn(params: Any, windows: jax.Array) -> Any:
            logits, sown = model.apply(
                params, windows[:, :-1], mutable=["intermediates"]
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(
                logits, windows[:, 1:]
            ).mean()
            return loss, sown["intermediates"]

        def grad_step(params: Any, windows: jax.Array) -> Any:
            (loss, sown), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                params, windows
            )
            (per_head,) = sown["blocks"]["attn"]["max_logits"]  # (layers, batch, heads)
            return loss, grads, sown, jnp.max(per_head, axis=(1, 2))

        def update_step(
            run: str, grads: Any, opt_state: Any, params: Any, lr: Any, sown: Any
        ) -> Any:
            tx = qk_optimizer(run, lr, prefix, dims, tau)
            if "+" in run:
                updates, opt_state = tx.update(
                    grads, opt_state, params, max_logits={"params": sown}
                )
            else:
                updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            attn = params["params"]["blocks"]["attn"]
            ratio = optax.tree.norm(attn["query"]["kernel"]) / optax.tree.norm(
                attn["key"]["kernel"]
            )
            return params, opt_state, clipax.metrics(opt_state), ratio

        self.grad_step = jax.jit(grad_step)
        self.update_step = jax.jit(update_step, static_argnums=0)
        self.evaluate = jax.jit(lambda p, w: cross_entropy(model, p, w))


def qk_train(
    trainer: QKTrainer,
    run: str,
    lr: float,
    seed: int,
    params: Any,
    data: np.ndarray,
    held_out: np.ndarray,
    log: TextIO,
    bar: tqdm,
) -> dict[str, Any]:
    """Trains from `params` on `data` with the QK study's `run` at `lr`; logs
    every step's loss, largest logit per layer, the norm of the query kernels
    over that of the key kernels (`wq/wk`) and metrics to `log`. Stops at a
    non-finite loss."""
    steps = data.shape[0]
    opt_state = qk_optimizer(run, lr, trainer.prefix, trainer.dims, trainer.tau).init(
        params
    )
    loss_curve = np.full(steps, np.nan)
    logit_curve = np.full(steps, np.nan)
    head_clips = 0
    lr_array = jnp.asarray(lr, jnp.float32)
    for t in range(steps):
        loss, grads, sown, per_layer = trainer.grad_step(params, data[t])
        params, opt_state, metrics, ratio = trainer.update_step(
            run, grads, opt_state, params, lr_array, sown
        )
        loss, per_layer, metrics, ratio = jax.device_get(
            (loss, per_layer, metrics, ratio)
        )
        metrics = {k: float(v) for k, v in metrics.items() if k.startswith("qk_clip/")}
        layers = {f"max_logit/{i}": float(v) for i, v in enumerate(per_layer)}
        layers["wq/wk"] = float(ratio)
        row = {"run": run, "lr": lr, "seed": seed, "step": t, "loss": float(loss)}
        logged = {k: float(f"{v:.6g}") for k, v in {**layers, **metrics}.items()}
        log.write(json.dumps({**row, **logged}) + "\n")
        loss_curve[t] = float(loss)
        logit_curve[t] = float(np.max(per_layer))
        head_clips += int(sum(v for k, v in metrics.items() if "clipped_heads" in k))
        bar.update()
        bar.set_postfix(run=run, loss=f"{float(loss):.3f}", refresh=False)
        if not math.isfinite(float(loss)):
            bar.update(steps - 1 - t)
            break
    held = float(trainer.evaluate(params, held_out))
    finite = logit_curve[np.isfinite(logit_curve)]
    return {
        "loss": loss_curve,
        "max_logit": logit_curve,
        "peak": float(finite.max()) if finite.size else math.nan,
        "last": float(finite[-1]) if finite.size else math.nan,
        "head_clips": head_clips,
        "ratio": float(ratio),  # wq/wk after the last step
        "held_out": held,
        "spikes": len(events(spike_steps(loss_curve))),
        "finite": bool(np.isfinite(loss_curve).all()),
    }


def qk_summary(
    runs: dict[tuple[str, float, int], dict[str, Any]], bound: float
) -> list[str]:
    """One line per run and learning rate: means over the seeds."""
    seeds = sorted({seed for _, _, seed in runs})
    head = (
        f"{'run':>20} {'lr':>8} {'seeds':>5} {'peak':>9} {'last':>9} "
        f"{'clips':>8} {'spikes':>6} {'wq/wk':>6} {'held-out':>9} {'diverged':>8}"
    )
    lines = [head]
    for name, lr in dict.fromkeys((name, lr) for name, lr, _ in runs):
        group = [runs[name, lr, seed] for seed in seeds]
        held = [r["held_out"] for r in group if math.isfinite(r["held_out"])]
        peak, last, clips, spikes, ratio = (
            float(np.nanmean([r[key] for r in group]))
            for key in ("peak", "last", "head_clips", "spikes", "ratio")
        )
        lines.append(
            f"{name:>20} {lr:8.0e} {len(group):5d} {peak:9.1f} {last:9.1f} "
            f"{clips:8.1f} {spikes:6.2f} {ratio:6.3f} "
            f"{float(np.mean(held)) if held else math.nan:9.3f} "
            f"{sum(diverged(r, bound) for r in group):6d}/{len(group)}"
        )
    return lines


def qk_plot(
    runs: dict[tuple[str, float, int], dict[str, Any]],
    names: list[str],
    lrs: dict[str, list[float]],
    tau: float,
    bound: float,
    output: str,
) -> dict[str, float]:
    """Per optimizer, the largest logit over the steps with and without
    QK-Clip at the rate where its unclipped runs' logits grew most; the
    held-out loss and the largest logit against the rate. Returns the rates
    shown."""
    seeds = sorted({s for _, _, s in runs})
    base = [n for n in names if "+" not in n]
    fig, axes = plt.subplots(2, len(base), figsize=(7 * len(base), 9), squeeze=False)
    shown = {}
    for col, opt in enumerate(base):
        grown = {
            lr: np.nanmean([runs[opt, lr, s]["peak"] for s in seeds]) for lr in lrs[opt]
        }
        lr = shown[opt] = max(grown, key=lambda r: np.nan_to_num(grown[r], nan=-1.0))
        ax = axes[0, col]
        for name in (n for n in names if n.split("+")[0] == opt):
            peak = np.nanmean([runs[name, lr, s]["peak"] for s in seeds])
            held = np.mean([runs[name, lr, s]["held_out"] for s in seeds])
            for s in seeds:
                run = runs[name, lr, s]
                label = f"{name}: peak {peak:.1f}, held-out {held:.3f}"
                label = label if s == seeds[0] else None
                ax.plot(
                    run["max_logit"],
                    color=QK_COLORS[name],
                    lw=1,
                    alpha=0.8,
                    label=label,
                )
        mark(ax, tau, f"tau {tau:g}", 0, ls="--", alpha=0.6)
        ax.set(
            yscale="log",
            xlabel="step",
            ylabel="largest attention logit (max over layers, heads, batch)",
        )
        finish(ax, f"{opt}, lr {lr:g}: largest logit per step, {len(seeds)} seed(s)")
    rates = {name: lrs[name.split("+")[0]] for name in names}
    styles = {name: {"color": QK_COLORS[name]} for name in names}
    held_out_sweep(axes[1, 0], runs, rates, styles, bound)
    if len(base) > 1:
        peak_ax = axes[1, -1]
        for name in names:
            peaks = [
                np.nanmean([runs[name, r, s]["peak"] for s in seeds])
                for r in rates[name]
            ]
            peak_ax.plot(rates[name], peaks, marker="o", label=name, **styles[name])
        least = min(min(r) for r in lrs.values())
        mark(peak_ax, tau, f"tau {tau:g}", least, ls="--", alpha=0.6)
        peak_ax.set(
            xscale="log",
            yscale="log",
            xlabel="learning rate",
            ylabel="largest logit of the run",
        )
        finish(peak_ax, f"largest logit of the run, mean of {len(seeds)} seed(s)")
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return shown


def qk_study(args: argparse.Namespace) -> dict[tuple[str, float, int], Any]:
    """The QK-Clip study (`--qk-clip`; with `--gqa`, its GQA variant): every
    optimizer, rate and seed from the same initialisation and batches per
    seed; prints the summary, writes the log and the figure."""
    plan, names = (GQA, list(GQA_RUNS)) if args.gqa else (QK, list(QK_RUNS))
    output, log_path = (GQA_OUTPUT, GQA_LOG) if args.gqa else (QK_OUTPUT, QK_LOG)
    steps = args.steps or plan["steps"]
    seeds = list(range(args.seeds or plan["seeds"]))
    lrs = {opt: sorted(args.lrs or plan["lrs"][opt]) for opt in ("adamw", "muon")}
    train_text, held_text, files, bound, held_out = corpus()
    kv_heads = GQA_KV_HEADS if args.gqa else 0
    model = GPT(dtype=jnp.dtype(args.dtype), block=QKBlock, kv_heads=kv_heads)
    total = sum(len(lrs[n.split("+")[0]]) for n in names) * len(seeds)
    study = f" on GQA ({HEADS} query over {kv_heads} key heads)" if kv_heads else ""
    tqdm.write(
        f"{files} files of the stdlib: {train_text.size:,} training bytes, "
        f"{held_text.size:,} held out; QK-Clip study{study}, tau {args.tau:g}: {total} "
        f"runs ({', '.join(names)}; adamw at {lrs['adamw']}, muon at "
        f"{lrs['muon']}) x {steps} steps, {len(seeds)} seed(s), activations "
        f"{args.dtype}"
    )
    runs: dict[tuple[str, float, int], Any] = {}
    start = time.perf_counter()
    with open(log_path, "w") as log:
        for seed, prefix, params, data in seeded(model, seeds, steps, train_text):
            if seed == seeds[0]:
                dims = muon_dims(params, prefix)
                tqdm.write(f"stacked prefix: {prefix}")
                trainer = QKTrainer(model, prefix, dims, args.tau)
            for name in names:
                for lr in lrs[name.split("+")[0]]:
                    bar = tqdm(
                        total=steps,
                        desc=f"{name} lr {lr:.0e} seed {seed}",
                        unit="step",
                        mininterval=1.0,
                        leave=False,
                    )
                    runs[name, lr, seed] = qk_train(
                        trainer, name, lr, seed, params, data, held_out, log, bar
                    )
                    bar.close()
    seconds = time.perf_counter() - start
    tqdm.write(
        "peak: the largest attention logit of the run (per step the max over "
        "layers, heads and batch, before the step's clip); last: at the last "
        "step; clips: heads clipped per run (summed over steps and layers); "
        "wq/wk: the norm of the query kernels over that of the key kernels "
        f"after the last step; spikes and diverged as in the rules study (bound "
        f"{bound:.3f})"
    )
    for line in qk_summary(runs, bound) + per_seed(runs, bound):
        tqdm.write(line)
    shown = qk_plot(runs, names, lrs, args.tau, bound, output)
    tqdm.write(
        "figure: " + ", ".join(f"{opt} at lr {lr:g}" for opt, lr in shown.items())
    )
    tqdm.write(f"wrote {output} and {log_path} in {seconds:.0f} s")
    return runs


def reset_study(args: argparse.Namespace) -> dict[tuple[str, float, int], Any]:
    """The moment-reset study (`--reset`): AdamW and Muon at their high rates,
    alone and with each rule, from the same initialisation and batches per
    seed; prints the summary, writes the log and the figure. With
    `--spectral`, the spectral study's runs (`SPECTRAL_RUNS`) instead."""
    plan = SPECTRAL if args.spectral else RESET
    output, log_path = (
        (SPECTRAL_OUTPUT, SPECTRAL_LOG) if args.spectral else (RESET_OUTPUT, RESET_LOG)
    )
    steps = args.steps or plan["steps"]
    seeds = list(range(args.seeds or plan["seeds"]))
    lrs = {opt: sorted(args.lrs or plan["lrs"][opt]) for opt in ("adamw", "muon")}
    names = [f"{opt}/{rule}" for opt in lrs for rule in RESET_RULES]
    if args.spectral:
        names = list(SPECTRAL_RUNS)
    train_text, _, files, bound, held_out = corpus()
    model = GPT(dtype=jnp.dtype(args.dtype))
    tqdm.write(
        f"{files} files of the stdlib: {train_text.size:,} training bytes; "
        f"{'spectral' if args.spectral else 'moment-reset'} study: {len(names)} "
        f"runs per seed ({', '.join(names)}; adamw at {lrs['adamw']}, muon at "
        f"{lrs['muon']}) x {steps} steps, {len(seeds)} seed(s)"
    )
    runs: dict[tuple[str, float, int], Any] = {}
    start = time.perf_counter()
    with open(log_path, "w") as log:
        for seed, prefix, params, data in seeded(model, seeds, steps, train_text):
            if seed == seeds[0]:
                dims = muon_dims(params, prefix)
                make = functools.partial(reset_optimizer, dims=dims)
                trainer = Trainer(model, prefix, make)
            for name in names:
                for lr in lrs[name.split("/")[0]]:
                    bar = tqdm(
                        total=steps,
                        desc=f"{name} lr {lr:.0e} seed {seed}",
                        unit="step",
                        mininterval=1.0,
                        leave=False,
                    )
                    run = train(
                        trainer, name, lr, seed, params, data, held_out, log, bar
                    )
                    run["recoveries"] = recoveries(run["loss"])
                    runs[name, lr, seed] = run
                    bar.close()
    tqdm.write(
        "spikes and diverged as in the rules study (bound "
        f"{bound:.3f}); recover: steps from a spike until the loss is within "
        f"{RECOVERED:g} x its EMA before the spike (to the end where it never "
        "is), the mean over the spikes; resets: layers reset per run; skipped: "
        "steps per run"
    )
    tqdm.write(
        f"{'run':>22} {'lr':>7} {'spikes':>6} {'recover':>7} {'resets':>6} "
        f"{'skipped':>7} {'held-out':>9} {'diverged':>8}"
    )
    for name in names:
        for lr in lrs[name.split("/")[0]]:
            group = [runs[name, lr, s] for s in seeds]
            recover = [r for run in group for r in run["recoveries"]]
            spikes, resets, skipped, held = (
                float(np.mean([run[key] for run in group]))
                for key in ("spikes", "resets", "skipped", "held_out")
            )
            tqdm.write(
                f"{name:>22} {lr:7.0e} {spikes:6.2f} "
                f"{np.mean(recover) if recover else 0.0:7.1f} {resets:6.1f} "
                f"{skipped:7.1f} {held:9.3f} "
                f"{sum(diverged(run, bound) for run in group):6d}/{len(group)}"
            )
    for line in per_seed(runs, bound):
        tqdm.write(line)
    styles = {name: {} for name in names}
    fig, ax = plt.subplots(figsize=(8, 5))
    held_out_sweep(ax, runs, {n: lrs[n.split("/")[0]] for n in names}, styles, bound)
    ax.set(xscale="log", xlabel="learning rate", ylabel="held-out loss")
    finish(ax, f"held-out loss, mean of {len(seeds)} seed(s)", ncol=2)
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)
    tqdm.write(f"wrote {output} and {log_path} in {time.perf_counter() - start:.0f} s")
    return runs


def main(argv: list[str] | None = None) -> dict[tuple[str, float, int], Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="the whole study")
    parser.add_argument("--steps", type=int, help="steps per run")
    parser.add_argument("--seeds", type=int, help="how many seeds (0, 1, ...)")
    parser.add_argument(
        "--lrs",
        type=float,
        nargs="+",
        help="learning rates (with --qk-clip: of both optimizers)",
    )
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="the activations' dtype (parameters and Adam stay float32)",
    )
    parser.add_argument(
        "--qk-clip",
        action="store_true",
        help="the QK-Clip study instead: AdamW and Muon, each with and without "
        "clipax.qk_clip, the largest attention logit per step (~25 min)",
    )
    parser.add_argument(
        "--gqa",
        action="store_true",
        help="with --qk-clip: its GQA variant (4 query heads over 2 key heads), "
        'QK-Clip\'s gqa="head" against gqa="group" at the high rates',
    )
    parser.add_argument(
        "--reset",
        action="store_true",
        help="the moment-reset study instead: AdamW and Muon at their high rates, "
        "alone and with reset_on_spike, the trainers' skip, Stable-SPAM, AdaGC",
    )
    parser.add_argument(
        "--spectral",
        action="store_true",
        help="the spectral study instead: AdamW alone, with the global clip, AdaGC "
        "and SPECTRA's spectral clip, and Muon alone, at the rates where runs diverge",
    )
    parser.add_argument(
        "--tau",
        type=float,
        default=QK_TAU,
        help=f"with --qk-clip: QK-Clip's threshold (default {QK_TAU:g})",
    )
    args = parser.parse_args(argv)
    if args.qk_clip:
        if args.full:
            parser.error("--full is the rules study's plan; --qk-clip has its own")
        return qk_study(args)
    if args.gqa:
        parser.error("--gqa is a variant of the --qk-clip study: give both")
    if args.reset or args.spectral:
        return reset_study(args)
    plan = FULL if args.full else DEFAULT
    steps = args.steps or plan["steps"]
    seeds = list(range(args.seeds or plan["seeds"]))
    lrs = sorted(args.lrs or plan["lrs"])

    train_text, held_text, files, bound, held_out = corpus()
    model = GPT(dtype=jnp.dtype(args.dtype))
    tqdm.write(
        f"{files} files of the stdlib: {train_text.size:,} training bytes, "
        f"{held_text.size:,} held out; {len(RULES)} rules x {len(lrs)} learning "
        f"rates x {len(seeds)} seeds x {steps} steps, activations {args.dtype}"
    )
    runs: dict[tuple[str, float, int], Any] = {}
    start = time.perf_counter()
    with open(LOG, "w") as log:
        for seed, prefix, params, data in seeded(model, seeds, steps, train_text):
            if seed == seeds[0]:
                tqdm.write(f"stacked prefix: {prefix}")
                trainer = Trainer(model, prefix)
            for lr in lrs:
                bar = tqdm(
                    total=len(RULES) * steps,
                    desc=f"lr {lr:.0e} seed {seed}",
                    unit="step",
                    mininterval=1.0,
                )
                for rule in RULES:
                    runs[rule, lr, seed] = train(
                        trainer, rule, lr, seed, params, data, held_out, log, bar
                    )
                bar.close()
    seconds = time.perf_counter() - start
    tqdm.write(
        f"loss spike: a step whose training loss is above {SPIKE_RATIO} x the EMA "
        f"(decay {SPIKE_DECAY}) of the losses before it, from step {SPIKE_FROM} "
        "on, or non-finite; consecutive ones count once"
    )
    tqdm.write(
        f"diverged: a non-finite loss, or a held-out loss at the end above "
        f"{bound:.3f} (the unigram entropy of the training bytes)"
    )
    tqdm.write(
        "means over the seeds (held-out: over the finite ones); clipped and "
        "skipped: steps per run; diverged: runs of all"
    )
    for line in summary(runs, lrs, bound) + per_seed(runs, bound):
        tqdm.write(line)
    lr, seed, at = plot(runs, lrs, bound)
    if any(run["spikes"] for (rule, _, _), run in runs.items() if rule == "none"):
        what = "the unclipped run's spike highest above the clipped runs starts"
    else:
        what = "no unclipped spike; the unclipped run's highest loss is"
    tqdm.write(f"figure: lr {lr:g}, seed {seed}; {what} at step {at}")
    tqdm.write(f"wrote {OUTPUT} and {LOG} in {seconds:.0f} s")
    return runs


if __name__ == "__main__":
    main()
