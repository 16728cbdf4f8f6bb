"""clipax against optax: run time, compile time and peak memory of clipping.

Runs both libraries in one process, interleaved call by call, and prints tables
of medians (Markdown, ready for benchmarks/RESULTS.md):

    PYTHONPATH=src python benchmarks/bench_clipping.py            # full run
    PYTHONPATH=src python benchmarks/bench_clipping.py --quick    # smoke run
    PYTHONPATH=src python benchmarks/bench_clipping.py --plot     # + scaling.png
    PYTHONPATH=src python benchmarks/bench_clipping.py --device 20 # + device time
    PYTHONPATH=src python benchmarks/bench_clipping.py --trees gpt2-f32,resnet50
    PYTHONPATH=src python benchmarks/bench_clipping.py --ops tree.clip_by_norm

What is measured, for each tree and each of `clip_by_global_norm`,
`clip_by_norm` and `clip`, on the Optax transformation's `update` under
`jax.jit`:
- run: the median wall time of a call (blocked until ready), clipax and optax
  called alternately so that both see the same machine load;
- floor: one read pass plus one read-and-write pass over the tree's own
  leaves, measured here, interleaved with the rest (`jnp.sum` of each leaf,
  and `x * 2` of each leaf in its dtype);
- compile: trace + lower + XLA compile of a fresh function after
  `jax.clear_caches()` (the first call's cost, less its execution), the least
  of 2 such compiles (`--compiles N`), in the order clipax, optax, optax,
  clipax (other processes on a shared machine only ever add time);
- kernels: fusions plus bare reduce and scatter ops in the optimized HLO of
  `update` (every computation; a loop's body counted once);
- memory: the compiled executable's `memory_analysis()`, arguments + outputs
  + temporaries - aliased bytes: what the step holds at its peak;
- device time (`--device K`): the clip applied K times inside one jitted
  `lax.fori_loop`, so that dispatch is paid once: seconds per pass, TB/s of
  the bytes a clip must move (one read pass and one read-and-write pass of
  the tree), and the ratio to the floor, those two passes timed the same way
  (a sum of every leaf, and `x * 0.75`). It runs on any backend (CPU, GPU).

optax has no per-leaf `clip_by_norm` transformation; it is compared with the
natural equivalent, `jax.tree.map` of `g * max_norm / max(||g||, max_norm)`.
`--ops` adds two more views of it: `tree.clip_by_norm` (clipax's function,
which returns no norms) against that formula, and `clip_by_norm+norms` (the
transformation against the formula that also keeps each leaf's norm in its
state, as clipax's state does).
"""

from __future__ import annotations

import argparse
import functools
import gc
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import clipax

HERE = pathlib.Path(__file__).parent
MAX_NORM = 1.0
Tree = Any


# Trees.


def _leaves(rng: np.random.Generator, shapes: list[tuple[int, ...]], dtype: Any):
    return [
        jnp.asarray(rng.standard_normal(s, dtype=np.float32), dtype=dtype)
        for s in shapes
    ]


def uniform_tree(n: int, size: int, dtype: Any = jnp.float32, seed: int = 0) -> Tree:
    rng = np.random.default_rng(seed)
    leaves = _leaves(rng, [(size,)] * n, dtype)
    return {f"p{i:05d}": x for i, x in enumerate(leaves)}


def gpt2_shapes(
    vocab: int = 50257, ctx: int = 1024, d: int = 768, layers: int = 12
) -> dict[str, tuple[int, ...]]:
    """The parameter shapes of GPT-2 small (124M parameters, 148 leaves)."""
    shapes: dict[str, tuple[int, ...]] = {"wte": (vocab, d), "wpe": (ctx, d)}
    for i in range(layers):
        block = {
            "ln_1.scale": (d,),
            "ln_1.bias": (d,),
            "attn.c_attn.w": (d, 3 * d),
            "attn.c_attn.b": (3 * d,),
            "attn.c_proj.w": (d, d),
            "attn.c_proj.b": (d,),
            "ln_2.scale": (d,),
            "ln_2.bias": (d,),
            "mlp.c_fc.w": (d, 4 * d),
            "mlp.c_fc.b": (4 * d,),
            "mlp.c_proj.w": (4 * d, d),
            "mlp.c_proj.b": (d,),
        }
        shapes.update({f"h{i:02d}.{k}": v for k, v in block.items()})
    shapes.update({"ln_f.scale": (d,), "ln_f.bias": (d,)})
    return shapes


def gpt2_tree(dtype: Any, small: bool = False) -> Tree:
    rng = np.random.default_rng(1)
    kw = dict(vocab=1000, ctx=64, d=64, layers=2) if small else {}
    shapes = gpt2_shapes(**kw)
    return dict(zip(shapes, _leaves(rng, list(shapes.values()), dtype), strict=True))


def mixed_tree(count: int, big: int) -> Tree:
    """Ragged shapes, float32/bfloat16/float16 leaves, scalars and None."""
    rng = np.random.default_rng(2)
    tree: dict[str, Any] = {}
    dtypes = [jnp.float32, jnp.bfloat16, jnp.float16]
    for i in range(count):
        kind = i % 6
        shape = [
            (int(rng.integers(1, 5000)),),
            (int(rng.integers(1, 300)), int(rng.integers(1, 300))),
            (),
            (16, 16, int(rng.integers(1, 9))),
            (int(rng.integers(big // 6, big)),),
            (0,),
        ][kind]
        tree[f"m{i:04d}"] = _leaves(rng, [shape], dtypes[i % 3])[0]
        if i % 5 == 0:
            tree[f"none{i:04d}"] = None
    return tree


def resnet50_shapes() -> dict[str, tuple[int, ...]]:
    """The parameter shapes of ResNet-50 (convolutions HWIO, batch norms)."""
    shapes: dict[str, tuple[int, ...]] = {}

    def conv_bn(name: str, k: int, cin: int, cout: int) -> None:
        shapes[f"{name}.conv"] = (k, k, cin, cout)
        shapes[f"{name}.bn.scale"] = (cout,)
        shapes[f"{name}.bn.bias"] = (cout,)

    conv_bn("stem", 7, 3, 64)
    cin = 64
    stages = zip((3, 4, 6, 3), (64, 128, 256, 512), strict=True)
    for stage, (blocks, width) in enumerate(stages):
        for block in range(blocks):
            name = f"s{stage}.b{block}"
            conv_bn(f"{name}.c1", 1, cin, width)
            conv_bn(f"{name}.c2", 3, width, width)
            conv_bn(f"{name}.c3", 1, width, 4 * width)
            if block == 0:
                conv_bn(f"{name}.proj", 1, cin, 4 * width)
            cin = 4 * width
    shapes["fc.w"] = (cin, 1000)
    shapes["fc.b"] = (1000,)
    return shapes


def llama_shapes(
    vocab: int = 32000, d: int = 512, ffn: int = 1376, layers: int = 8
) -> dict[str, tuple[int, ...]]:
    """A Llama-shaped tree: RMSNorm scales, q/k/v/o, SwiGLU, untied head."""
    shapes: dict[str, tuple[int, ...]] = {"embed": (vocab, d)}
    for i in range(layers):
        block = {
            "attn_norm": (d,),
            "wq": (d, d),
            "wk": (d, d),
            "wv": (d, d),
            "wo": (d, d),
            "mlp_norm": (d,),
            "w_gate": (d, ffn),
            "w_up": (d, ffn),
            "w_down": (ffn, d),
        }
        shapes.update({f"l{i:02d}.{k}": v for k, v in block.items()})
    shapes.update({"final_norm": (d,), "lm_head": (d, vocab)})
    return shapes


def stacked_gpt_shapes(d: int = 256, layers: int = 48) -> dict[str, Any]:
    """`gpt2_shapes` with the blocks stacked as `nn.scan` stacks them: one leaf
    per block parameter, the layers on its first axis (12 leaves for all)."""
    flat = gpt2_shapes(d=d, layers=layers)
    block = {k.split(".", 1)[1]: v for k, v in flat.items() if k.startswith("h00.")}
    outside = {k: v for k, v in flat.items() if not k.startswith("h")}
    return {**outside, "blocks": {k: (layers, *v) for k, v in block.items()}}


def tree_of(shapes: dict[str, Any], dtype: Any) -> Tree:
    rng = np.random.default_rng(3)
    flat, treedef = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
    return jax.tree.unflatten(treedef, _leaves(rng, flat, dtype))


# Every tree by key (`--trees`): its label in the tables and how to build it.
TREES: dict[str, tuple[str, Callable[[], Tree]]] = {
    "1x16M": ("1 x 16M f32", lambda: uniform_tree(1, 1 << 24)),
    "400x40k": ("400 x 40k f32", lambda: uniform_tree(400, 40_000)),
    "2000x1k": ("2000 x 1k f32", lambda: uniform_tree(2000, 1000)),
    "gpt2-f32": ("gpt2 124M f32", lambda: gpt2_tree(jnp.float32)),
    "gpt2-bf16": ("gpt2 124M bf16", lambda: gpt2_tree(jnp.bfloat16)),
    "mixed": ("mixed+None", lambda: mixed_tree(200, 300_000)),
    # More trees of many or large leaves, and model trees sized for a GPU.
    "500x1k": ("500 x 1k f32", lambda: uniform_tree(500, 1000)),
    "100x40k": ("100 x 40k f32", lambda: uniform_tree(100, 40_000)),
    "2x4M": ("2 x 4M f32", lambda: uniform_tree(2, 1 << 22)),
    "llama8L": ("llama 8L f32", lambda: tree_of(llama_shapes(), jnp.float32)),
    "resnet50": ("resnet-50 f32", lambda: tree_of(resnet50_shapes(), jnp.float32)),
    "gpt48L": (
        "gpt 48L f32",
        lambda: tree_of(gpt2_shapes(d=256, layers=48), jnp.float32),
    ),
    "gpt48L-stacked": (
        "gpt 48L stacked f32",
        lambda: tree_of(stacked_gpt_shapes(), jnp.float32),
    ),
    "llama1B": (
        "llama 1B f32",
        lambda: tree_of(llama_shapes(d=2048, ffn=5632, layers=16), jnp.float32),
    ),
    "1x256M": ("1 x 256M f32", lambda: uniform_tree(1, 1 << 28)),
}
DEFAULT_TREES = ["1x16M", "400x40k", "2000x1k", "gpt2-f32", "gpt2-bf16", "mixed"]


def keys_of(known: dict[str, Any], value: str) -> list[str]:
    """A comma-separated list of keys of `known`, checked as the arguments are
    parsed (an `argparse` type)."""
    chosen = value.split(",")
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        known_keys = ", ".join(known)
        raise argparse.ArgumentTypeError(f"unknown {unknown}; known: {known_keys}")
    return chosen


def add_keys_option(
    parser: argparse.ArgumentParser,
    flag: str,
    known: dict[str, Any],
    default: list[str],
    what: str,
    value: list[str] | None = None,
) -> None:
    """`flag KEY,...`: the `what` to measure, keys of `known`; `default` names
    them in the help, and `value` is the parsed default."""
    parser.add_argument(
        flag,
        type=functools.partial(keys_of, known),
        default=value,
        metavar="KEY,...",
        help=f"the {what} to measure, of: {', '.join(known)} (default: "
        f"{','.join(default)})",
    )


def add_trees_option(parser: argparse.ArgumentParser, default: list[str]) -> None:
    """`--trees KEY,...`: keys of `TREES`."""
    add_keys_option(parser, "--trees", TREES, default, "trees")


def tree_cases(quick: bool, keys: list[str] | None = None) -> list[tuple[str, Tree]]:
    if quick:
        return [
            ("1 x 64k f32", uniform_tree(1, 1 << 16)),
            ("40 x 4k f32", uniform_tree(40, 4000)),
            ("100 x 100 f32", uniform_tree(100, 100)),
            ("gpt2-tiny f32", gpt2_tree(jnp.float32, small=True)),
            ("gpt2-tiny bf16", gpt2_tree(jnp.bfloat16, small=True)),
            ("mixed+None", mixed_tree(30, 20_000)),
        ]
    return [(TREES[k][0], TREES[k][1]()) for k in keys or DEFAULT_TREES]


def describe(tree: Tree) -> tuple[int, int, int]:
    leaves = jax.tree.leaves(tree)
    return len(leaves), sum(x.size for x in leaves), sum(x.nbytes for x in leaves)


# Transformations.


def bare_norm(g: jax.Array) -> jax.Array:
    """A leaf's norm as the bare formula takes it."""
    return jnp.sqrt(jnp.sum(jnp.square(g)))


def bare_clip(g: jax.Array, norm: jax.Array, max_norm: float) -> jax.Array:
    """`g` clipped to `max_norm` by the bare formula, given its `norm`."""
    return g * (max_norm / jnp.maximum(norm, max_norm)).astype(g.dtype)


def bare_norm_over(g: jax.Array, axes: Any) -> jax.Array:
    """The float32 norm over `axes` (the whole leaf for None), the reduced dims
    kept where some are left."""
    squares = jnp.square(g.astype(jnp.float32))
    return jnp.sqrt(jnp.sum(squares, axis=axes, keepdims=axes is not None))


def bare_clip_over(g: jax.Array, axes: Any, max_norm: float) -> jax.Array:
    """`bare_clip` with the norm in float32 over `axes` (the whole leaf for None),
    as a user writes the per-tensor rule."""
    return bare_clip(g, bare_norm_over(g, axes), max_norm)


def optax_clip_by_norm(max_norm: float) -> optax.GradientTransformation:
    """optax has no per-leaf norm clipping: the natural `jax.tree.map` form."""

    def update_fn(updates: Tree, state: Any, params: Any = None) -> Any:
        del params
        return jax.tree.map(
            lambda g: bare_clip(g, bare_norm(g), max_norm), updates
        ), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


class NormsState(NamedTuple):
    norms: Any  # the updates' tree with a float32 scalar per leaf


def optax_clip_by_norm_keeping_norms(
    max_norm: float,
    norm_of: Callable[[jax.Array], jax.Array] = bare_norm,
    peak: Callable[[jax.Array], jax.Array] | None = None,
) -> optax.GradientTransformation:
    """The bare formula that, as `clipax.clip_by_norm` does, returns each leaf's
    pre-clip norm in its state: the same outputs as clipax's transformation.
    `norm_of` gives a leaf's norm (or its slices' norms, with `peak`, e.g.
    `jnp.max`, reducing them to the one number the state keeps)."""
    keep = (lambda n: n) if peak is None else peak

    def init_fn(params: Tree) -> NormsState:
        return NormsState(jax.tree.map(lambda _: jnp.zeros((), jnp.float32), params))

    def update_fn(updates: Tree, state: Any, params: Any = None) -> Any:
        del state, params
        norms = jax.tree.map(norm_of, updates)
        clipped = jax.tree.map(lambda g, n: bare_clip(g, n, max_norm), updates, norms)
        peaks = jax.tree.map(lambda n: keep(n).astype(jnp.float32), norms)
        return clipped, NormsState(peaks)

    return optax.GradientTransformation(init_fn, update_fn)


def stateless(clip: Callable[[Tree], Tree]) -> optax.GradientTransformation:
    """A function on pytrees as a transformation with an empty state."""

    def update_fn(updates: Tree, state: Any, params: Any = None) -> Any:
        del params
        return clip(updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


OPS: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "clip_by_global_norm": (
        lambda: clipax.clip_by_global_norm(MAX_NORM),
        lambda: optax.clip_by_global_norm(MAX_NORM),
    ),
    "clip_by_norm": (
        lambda: clipax.clip_by_norm(MAX_NORM),
        lambda: optax_clip_by_norm(MAX_NORM),
    ),
    "clip": (lambda: clipax.clip(MAX_NORM), lambda: optax.clip(MAX_NORM)),
    # Two more views of `clip_by_norm`, not in the default tables:
    # `clipax.tree.clip_by_norm` (the function: no norms out) against the bare
    # formula, and the transformation against the bare formula that also
    # returns each leaf's norm in its state, as the transformation does.
    "tree.clip_by_norm": (
        lambda: stateless(lambda t: clipax.tree.clip_by_norm(t, MAX_NORM)),
        lambda: optax_clip_by_norm(MAX_NORM),
    ),
    "clip_by_norm+norms": (
        lambda: clipax.clip_by_norm(MAX_NORM),
        lambda: optax_clip_by_norm_keeping_norms(MAX_NORM),
    ),
}
DEFAULT_OPS = ["clip_by_global_norm", "clip_by_norm", "clip"]


# Measurement.


class Built(NamedTuple):
    call: Callable[[], Any]
    compile_s: float
    peak_bytes: int
    kernels: int


def kernel_count(compiled: Any) -> int:
    """Kernels in the optimized HLO: fusions plus bare reduce and scatter ops,
    in every computation (a loop's body and a branch counted once each)."""
    text = compiled.as_text()
    return len(re.findall(r"= \S+ fusion\(", text)) + len(
        re.findall(r"= \S+ (?:reduce|scatter)\(", text)
    )


def build(
    tx: optax.GradientTransformation,
    tree: Tree,
    place: Callable[[Tree], Tree] | None = None,
) -> Built:
    """Compiles `tx.update` afresh; returns a zero-argument call and costs.

    `place` (optional) puts the tree and the state on devices (shardings) first.
    """
    state = tx.init(tree)
    if place is not None:
        tree, state = place(tree), place(state)
    jax.clear_caches()
    gc.collect()
    start = time.perf_counter()
    compiled = jax.jit(tx.update).lower(tree, state).compile()
    compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    peak = (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        + mem.temp_size_in_bytes
        - mem.alias_size_in_bytes
    )
    jax.block_until_ready(compiled(tree, state))  # warm-up
    kernels = kernel_count(compiled)
    return Built(lambda: compiled(tree, state), compile_s, peak, kernels)


def build_pair(
    make_ours: Callable[[], optax.GradientTransformation],
    make_theirs: Callable[[], optax.GradientTransformation],
    tree: Tree,
    compiles: int,
    place: Callable[[Tree], Tree] | None = None,
) -> tuple[Built, Built]:
    """`compiles` fresh builds of each side, in the order ours, theirs, theirs,
    ours, ...; each side keeps its first build's call and its least compile
    (the later builds' arrays are dropped at once: on forced host devices a
    model's replicated state fills the memory)."""
    kept: list[Built | None] = [None, None]
    for i in range(compiles):
        for side in (0, 1) if i % 2 == 0 else (1, 0):
            built = build((make_ours, make_theirs)[side](), tree, place)
            first = kept[side]
            kept[side] = (
                built
                if first is None
                else first._replace(compile_s=min(first.compile_s, built.compile_s))
            )
            del built
    ours, theirs = kept
    assert ours is not None and theirs is not None
    return ours, theirs


def interleaved(calls: list[Callable[[], Any]], repeats: int) -> list[float]:
    """Median seconds of each call, the calls taken in turn, order alternating."""
    times: list[list[float]] = [[] for _ in calls]
    for r in range(repeats):
        order = range(len(calls)) if r % 2 == 0 else reversed(range(len(calls)))
        for i in order:
            start = time.perf_counter()
            jax.block_until_ready(calls[i]())
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def floor_calls(tree: Tree) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """A read pass and a read-and-write pass over the tree's own leaves.

    Read: each leaf summed once (float32 accumulation, one scalar out); write:
    each leaf times 2 in its own dtype, into new buffers as clipping does.
    """
    leaves = jax.tree.leaves(tree)
    read = jax.jit(lambda ls: sum(jnp.sum(x, dtype=jnp.float32) for x in ls))
    write = jax.jit(lambda ls: [x * jnp.asarray(2, x.dtype) for x in ls])
    jax.block_until_ready((read(leaves), write(leaves)))
    return lambda: read(leaves), lambda: write(leaves)


def repeats_for(nbytes: int, quick: bool) -> int:
    if quick:
        return 3
    return 15 if nbytes > 100 << 20 else 41


class Row(NamedTuple):
    tree: str
    op: str
    run: tuple[float, float]
    floor: float
    compile_s: tuple[float, float]
    peak: tuple[int, int]
    kernels: tuple[int, int]


def bench_tree(
    name: str,
    tree: Tree,
    quick: bool,
    compiles: int = 2,
    ops: list[str] | None = None,
) -> list[Row]:
    _, _, nbytes = describe(tree)
    reps = repeats_for(nbytes, quick)
    read, write = floor_calls(tree)
    rows = []
    for op in ops or DEFAULT_OPS:
        make_clipax, make_optax = OPS[op]
        ours, theirs = build_pair(
            make_clipax, make_optax, tree, 1 if quick else compiles
        )
        t_ours, t_theirs, t_read, t_write = interleaved(
            [ours.call, theirs.call, read, write], reps
        )
        rows.append(
            Row(
                name,
                op,
                (t_ours, t_theirs),
                t_read + t_write,
                (ours.compile_s, theirs.compile_s),
                (ours.peak_bytes, theirs.peak_bytes),
                (ours.kernels, theirs.kernels),
            )
        )
        print(f"  measured {name} / {op}", file=sys.stderr, flush=True)
    return rows


def chain_rows(cases: list[tuple[str, Tree]], quick: bool) -> list[tuple]:
    """`chain(clip_by_global_norm, adam)` against `adam` alone."""
    out = []
    for name, tree in cases:
        _, _, nbytes = describe(tree)
        reps = repeats_for(nbytes, quick)
        read, _ = floor_calls(tree)
        txs = [
            optax.adam(1e-3),
            optax.chain(clipax.clip_by_global_norm(MAX_NORM), optax.adam(1e-3)),
            optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adam(1e-3)),
        ]
        built = [build(tx, tree) for tx in txs]
        times = interleaved([b.call for b in built] + [read], 3 * reps)
        out.append((name, *times))
        print(f"  measured {name} / chain", file=sys.stderr, flush=True)
    return out


# Device throughput.


def _write_pass(tree: Tree) -> Tree:
    """One read and one write of every leaf: `x * 0.75`, exact in every float
    dtype (a factor that rounds to 1, as 0.999 does in bfloat16, is dropped)."""
    return jax.tree.map(lambda x: x * jnp.asarray(0.75, x.dtype), tree)


def _read_loop(tree: Tree, k: int) -> Callable[[], Any]:
    """One read of every leaf per pass, `k` passes in one `lax.fori_loop`.

    Each pass sums every leaf times a loop-carried scalar, so that the sums
    cannot be hoisted out of the loop as invariant.
    """

    def looped(t: Tree) -> jax.Array:
        def body(_: Any, c: jax.Array) -> jax.Array:
            leaves = jax.tree.leaves(t)
            total = sum(
                jnp.sum(x * c.astype(x.dtype), dtype=jnp.float32) for x in leaves
            )
            return c + 1e-30 * total

        return jax.lax.fori_loop(0, k, body, jnp.float32(1))

    jitted = jax.jit(looped)
    jax.block_until_ready(jitted(tree))
    return lambda: jitted(tree)


def _clipped(tx: optax.GradientTransformation, state: Any, tree: Tree) -> Tree:
    return tx.update(tree, state)[0]


def device_loop(
    update: Callable[[Tree], Tree], tree: Tree, k: int
) -> Callable[[], Any]:
    """`update` applied `k` times inside one jitted `lax.fori_loop`.

    One dispatch for k passes: the time is the device's, not the host's.
    """
    looped = jax.jit(lambda t: jax.lax.fori_loop(0, k, lambda _, u: update(u), t))
    jax.block_until_ready(looped(tree))
    return lambda: looped(tree)


def device_rows(
    cases: list[tuple[str, Tree]], k: int, quick: bool, ops: list[str] | None = None
) -> list[tuple]:
    """Per tree and op: seconds per pass of clipax, optax and the floor.

    The floor is what a clip must move: one read pass of the tree (`_read_loop`)
    plus one read-and-write pass (`_write_pass`), each timed in its own loop.
    TB/s counts those bytes: three times the tree's.
    """
    out = []
    for name, tree in cases:
        _, _, nbytes = describe(tree)
        reps = max(3, repeats_for(nbytes, quick) // 3)
        read = _read_loop(tree, k)
        write = device_loop(_write_pass, tree, k)
        for op in ops or DEFAULT_OPS:
            make_clipax, make_optax = OPS[op]
            calls = []
            for tx in (make_clipax(), make_optax()):
                state = tx.init(tree)
                step = functools.partial(_clipped, tx, state)
                calls.append(device_loop(step, tree, k))
            t_ours, t_theirs, t_read, t_write = interleaved([*calls, read, write], reps)
            t_floor = t_read + t_write
            out.append((name, op, nbytes, t_ours / k, t_theirs / k, t_floor / k))
            print(f"  measured {name} / {op} (device)", file=sys.stderr, flush=True)
    return out


def print_device(rows: list[tuple], k: int) -> None:
    print(f"\n### Device time ({k} passes in one jitted fori_loop; per pass)\n")
    print(
        "| tree | op | clipax ms | optax ms | floor ms | clipax TB/s | "
        "clipax/floor | optax/floor | clipax/optax |"
    )
    print("|---|---|" + "---:|" * 7)
    for name, op, nbytes, ours, theirs, floor in rows:
        print(
            f"| {name} | {op} (device) | {ms(ours)} | {ms(theirs)} | {ms(floor)} "
            f"| {3 * nbytes / ours / 1e12:.3f} | {ours / floor:.2f} "
            f"| {theirs / floor:.2f} | {ours / theirs:.2f} |"
        )


# Output.


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f}"


def header() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(
            line.split(":", 1)[1].strip()
            for line in lscpu.splitlines()
            if line.startswith("Model name")
        )
        cpu = f"{model}, {jax.devices()[0].platform}"
    except (OSError, StopIteration):
        pass
    return (
        f"jax {jax.__version__}, jaxlib {jax.lib.__version__}, optax "
        f"{optax.__version__}, clipax {clipax.__version__}; {cpu}; "
        f"{len(jax.devices())} device(s) {jax.devices()[0].device_kind}"
    )


def print_tables(
    trees: list[tuple[str, Tree]], rows: list[Row], chains: list[tuple]
) -> None:
    print("\n### Trees\n")
    print("| tree | leaves | elements | MiB |")
    print("|---|---:|---:|---:|")
    for name, tree in trees:
        n, size, nbytes = describe(tree)
        print(f"| {name} | {n} | {size:,} | {mib(nbytes)} |")
    print("\n### Run time (median ms), compile time (s), peak memory (MiB)\n")
    print(
        "| tree | op | run clipax | run optax | ratio | floor | clipax/floor "
        "| compile clipax | compile optax | ratio | mem clipax | mem optax | ratio "
        "| kernels clipax | kernels optax |"
    )
    print("|---|---|" + "---:|" * 13)
    for r in rows:
        print(
            f"| {r.tree} | {r.op} | {ms(r.run[0])} | {ms(r.run[1])} "
            f"| {r.run[0] / r.run[1]:.2f} | {ms(r.floor)} | {r.run[0] / r.floor:.2f} "
            f"| {r.compile_s[0]:.2f} | {r.compile_s[1]:.2f} "
            f"| {r.compile_s[0] / r.compile_s[1]:.2f} "
            f"| {mib(r.peak[0])} | {mib(r.peak[1])} | {r.peak[0] / r.peak[1]:.2f} "
            f"| {r.kernels[0]} | {r.kernels[1]} |"
        )
    print("\n### In a chain with adam (median ms)\n")
    print(
        "| tree | adam | clipax + adam | optax + adam | read pass "
        "| clipax added / read pass | optax added / read pass |"
    )
    print("|---|" + "---:|" * 6)
    for name, adam, ours, theirs, read in chains:
        print(
            f"| {name} | {ms(adam)} | {ms(ours)} | {ms(theirs)} | {ms(read)} "
            f"| {(ours - adam) / read:.2f} | {(theirs - adam) / read:.2f} |"
        )


# Scaling chart.


def scaling(path: pathlib.Path, counts: list[int], size: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results: dict[str, dict[str, list[float]]] = {
        lib: {"compile": [], "run": []} for lib in ("clipax", "optax")
    }
    for n in counts:
        tree = uniform_tree(n, size)
        ours = build(clipax.clip_by_global_norm(MAX_NORM), tree)
        theirs = build(optax.clip_by_global_norm(MAX_NORM), tree)
        t_ours, t_theirs = interleaved([ours.call, theirs.call], 21)
        for lib, built, t in (("clipax", ours, t_ours), ("optax", theirs, t_theirs)):
            results[lib]["compile"].append(built.compile_s)
            results[lib]["run"].append(t * 1e3)
        print(
            f"  scaling n={n}: compile {ours.compile_s:.2f} s / "
            f"{theirs.compile_s:.2f} s, run {ms(t_ours)} / {ms(t_theirs)} ms",
            file=sys.stderr,
            flush=True,
        )
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, unit in (
        (axes[0], "compile", "compile time (s)"),
        (axes[1], "run", "run time per step (ms)"),
    ):
        for lib, style in (("clipax", "o-"), ("optax", "s--")):
            ax.plot(counts, results[lib][key], style, label=lib)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"number of leaves ({size} float32 each)")
        ax.set_ylabel(unit)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    axes[0].set_title("clip_by_global_norm: compile (trace+lower+XLA)")
    axes[1].set_title("clip_by_global_norm: run time under jit")
    fig.suptitle(header(), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("\n### Scaling (clip_by_global_norm, leaves of 1000 float32)\n")
    print(
        "| leaves | compile clipax s | compile optax s | run clipax ms | run optax ms |"
    )
    print("|---:|---:|---:|---:|---:|")
    for i, n in enumerate(counts):
        print(
            f"| {n} | {results['clipax']['compile'][i]:.2f} "
            f"| {results['optax']['compile'][i]:.2f} "
            f"| {results['clipax']['run'][i]:.2f} | {results['optax']['run'][i]:.2f} |"
        )
    print(f"\nwrote {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument(
        "--plot", action="store_true", help="also write benchmarks/scaling.png"
    )
    parser.add_argument(
        "--only-plot", action="store_true", help="only the scaling chart"
    )
    parser.add_argument(
        "--device",
        type=int,
        default=0,
        metavar="K",
        help="also time K clips in one jitted fori_loop (device time, TB/s)",
    )
    add_trees_option(parser, DEFAULT_TREES)
    parser.add_argument(
        "--compiles",
        type=int,
        default=2,
        metavar="N",
        help="fresh compiles per library and op; the least counts (default 2)",
    )
    add_keys_option(parser, "--ops", OPS, DEFAULT_OPS, "rows", DEFAULT_OPS)
    args = parser.parse_args(argv)
    print(f"clipax vs optax: {header()}")
    if not args.only_plot:
        cases = tree_cases(args.quick, args.trees)
        rows = [
            row
            for name, tree in cases
            for row in bench_tree(name, tree, args.quick, args.compiles, args.ops)
        ]
        chain_names = {"1 x 16M f32", "2000 x 1k f32", "gpt2 124M f32"}
        chain_cases = (
            cases[:2] if args.quick else [c for c in cases if c[0] in chain_names]
        )
        chains = chain_rows(chain_cases, args.quick)
        print_tables(cases, rows, chains)
        if args.device:
            device_cases = cases[:2] if args.quick else cases
            rows_k = device_rows(device_cases, args.device, args.quick, args.ops)
            print_device(rows_k, args.device)
    if args.plot or args.only_plot:
        counts = [100, 200, 500] if args.quick else [100, 250, 500, 1000, 2000, 4000]
        scaling(HERE / "scaling.png", counts, 1000)


if __name__ == "__main__":
    main()
