"""Every rule on every mesh gives one device's numbers, or clipax refuses it.

Hypothesis draws a case (`cases`) for each rule: a mesh of 1 to 3 axes over
the 8 CPU devices (Auto or Explicit axes), a tree and a layout for it, and a
spelling of the step.

- Layouts: each leaf split along any divisible dimensions over any mesh axes
  (`split`); every leaf along one dimension over one mesh axis, the batch too
  (`fsdp`); every leaf whole, as after `lax.pmean` (`replicated`). A stacked
  leaf whose layer axis (first or second) may be split; an attention module
  with its heads over a mesh axis, a GQA key whole or split, and its
  `max_logits` split over the batch (and the heads, as tensor parallelism
  computes them); per-example gradients with the batch split.
- Spellings: `jax.jit` over the placed arrays (under `jax.set_mesh` for an
  Explicit mesh); `jax.shard_map` with the rule given `specs=` (and
  `logit_specs=`), `axis_name=` (over an FSDP layout), or neither, with
  `check_vma` on and off.

Each transformation runs four steps (init, then updates scaled by BASE, each
tensor or layer of a stack also x8 at the second or third step or never, so
that tensors act at different steps) and returns its updates, its state and
`clipax.metrics` of the state; each tree function its result. Every output,
on every device that holds a copy, must equal the same run on one device
(rtol 1e-5), and `clipax.metrics` of the state the step returns must equal one
device's; or the call raises clipax's own ValueError or TypeError (raised in
clipax, not in JAX). Where the user said the layout (jit, `specs=`,
`axis_name=` over FSDP), or JAX's types prove every leaf whole (`check_vma`, a
replicated layout), or the rule reads no layout (`clip`), a refusal fails too.
The one-device run must act: its updates differ from those of the same recipe
with the rule's action off (`OFF`: a wrapper's inner optimizer, a clip's
identity), and `reset_on_spike` restarts layers at two different steps.

CI runs 2 derandomized cases per rule and the fixed examples (under a
minute with `-n 2`); a random search of 18 cases per rule (342 in all, about 6
minutes), or N per rule:

    CLIPAX_MESH=long .venv/bin/python -m pytest tests/test_mesh_twins.py
    CLIPAX_MESH=5 .venv/bin/python -m pytest tests/test_mesh_twins.py
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import clipax

_RUN = os.environ.get("CLIPAX_MESH", "")
if _RUN not in ("", "long") and not _RUN.isdigit():
    raise ValueError(f"CLIPAX_MESH must be 'long' or a number; got {_RUN!r}.")
MESH_CASES = settings(
    max_examples=18 if _RUN == "long" else int(_RUN) if _RUN else 2,
    derandomize=not _RUN,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    phases=(Phase.explicit, Phase.reuse, Phase.generate),  # a case compiles in seconds
    print_blob=True,
)

AXES = ("x", "y", "z")
MESHES = ((8,), (2, 4), (4, 2), (2, 2, 2))
SPELLINGS = ("jit", "specs", "axis_name", "none")
LAYOUTS = ("split", "fsdp", "replicated")
# Each step scales the gradients by BASE; each tensor (each layer of a
# stack) t is also SPIKE times larger at step SPIKE_AT[t % 3] (or never), so
# that tensors act at different steps.
BASE = (1.0, 0.5, 1.0, 0.5)
SPIKE, SPIKE_AT = 8.0, (1, 2, None)
RTOL, ATOL = 1e-5, 1e-6
TAU = 10.0
LAYERS = 4  # of a stacked leaf (2 for an attention module)
SRC = os.path.dirname(clipax.__file__)

# Each rule: its kind, its factory (whose signature says which of `specs`,
# `axis_name`, `stacked` it takes) and how it is called.
RULES: dict[str, tuple[str, Any, Any]] = {
    "clip": ("tx", clipax.clip, lambda kw: clipax.clip(0.5)),
    "clip_by_value": (
        "tx",
        clipax.clip_by_value,
        lambda kw: clipax.clip_by_value(-0.3, 0.5),
    ),
    "clip_by_norm": (
        "tx",
        clipax.clip_by_norm,
        lambda kw: clipax.clip_by_norm(1.0, **kw),
    ),
    "clip_by_norm_axes": (
        "tx",
        clipax.clip_by_norm,
        lambda kw: clipax.clip_by_norm(1.0, axes=-1, **kw),
    ),
    "clip_by_global_norm": (
        "tx",
        clipax.clip_by_global_norm,
        lambda kw: clipax.clip_by_global_norm(1.0, **kw),
    ),
    "autoclip": (
        "tx",
        clipax.autoclip,
        lambda kw: clipax.autoclip(50.0, history=3, **kw),
    ),
    "zclip": (
        "tx",
        clipax.zclip,
        lambda kw: clipax.zclip(warmup_steps=1, z_threshold=0.5, **kw),
    ),
    "adagc": (
        "tx",
        clipax.adagc,
        lambda kw: clipax.adagc(warmup_steps=1, max_norm=2.0, **kw),
    ),
    "stable_spam": (
        "tx",
        clipax.stable_spam,
        lambda kw: clipax.stable_spam(optax.adam(0.1), reset_every=2, **kw),
    ),
    "skip_spikes": (
        "tx",
        clipax.skip_spikes,
        lambda kw: clipax.skip_spikes(
            optax.adam(0.1), warmup_steps=1, z_threshold=0.5, **kw
        ),
    ),
    "reset_on_spike": (
        "tx",
        clipax.reset_on_spike,
        lambda kw: clipax.reset_on_spike(
            optax.adam(0.1), b1=0.9, b2=0.999, warmup_steps=1, z_threshold=2.0, **kw
        ),
    ),
    "adaptive_grad_clip": (
        "tx",
        clipax.adaptive_grad_clip,
        lambda kw: clipax.adaptive_grad_clip(0.05, **kw),
    ),
    "clip_by_block_rms": (
        "tx",
        clipax.clip_by_block_rms,
        lambda kw: clipax.clip_by_block_rms(0.3, **kw),
    ),
    "clip_by_spectral_norm": (
        "tx",
        clipax.clip_by_spectral_norm,
        lambda kw: clipax.clip_by_spectral_norm(
            0.7, weight_dimension_numbers=_matrices, **kw
        ),
    ),
    "qk_clip": ("qk", clipax.qk_clip, lambda kw: clipax.qk_clip(TAU, **kw)),
    "global_norm": (
        "fn",
        clipax.tree.global_norm,
        lambda kw: lambda g: clipax.tree.global_norm(g, **kw),
    ),
    "group_norms": (
        "fn",
        clipax.tree.group_norms,
        lambda kw: lambda g: clipax.tree.group_norms(g, depth=1, **kw),
    ),
    "per_example_global_norm_clip": (
        "batched",
        clipax.tree.per_example_global_norm_clip,
        lambda kw: lambda g: clipax.tree.per_example_global_norm_clip(g, 1.0, **kw),
    ),
    "per_example_layer_norm_clip": (
        "batched",
        clipax.tree.per_example_layer_norm_clip,
        lambda kw: lambda g: clipax.tree.per_example_layer_norm_clip(g, 1.0, **kw),
    ),
}
ELEMENTWISE = ("clip", "clip_by_value")


def _matrices(tree: Any) -> Any:
    """`clip_by_spectral_norm`'s matrices: axes 0 and 1 of each layer of
    rank 2 or more (the others a batch of matrices); other leaves pass."""
    return jax.tree.map(
        lambda x: optax.contrib.MuonDimensionNumbers() if x.ndim >= 2 else None, tree
    )


# What a wrapper's recipe is with its action off: its inner optimizer (a
# clip's is the identity).
OFF = {r: lambda: optax.adam(0.1) for r in ("stable_spam", "skip_spikes")}
OFF["reset_on_spike"] = OFF["stable_spam"]


def takes(rule: str) -> set[str]:
    """The layout arguments a rule's factory takes."""
    params = inspect.signature(inspect.unwrap(RULES[rule][1])).parameters
    return {"specs", "axis_name", "stacked", "logit_specs"} & set(params)


@dataclasses.dataclass(frozen=True)
class Input:
    """One array of the inputs: its global shape, how it is split, and where
    its layer axes are (for a stacked leaf)."""

    shape: tuple[int, ...]
    spec: tuple[Any, ...]  # per dimension: None, a mesh axis or a tuple of them
    layers: tuple[int, ...] = ()  # positions of its layer axes
    scale: float = 3.0


@dataclasses.dataclass(frozen=True)
class Case:
    rule: str
    mesh: tuple[int, ...]
    explicit: bool  # Explicit mesh axes, else Auto
    layout: str
    spelling: str
    check_vma: bool
    inputs: tuple[tuple[str, Input], ...]  # "grads/a", "logits/attn", ...
    stacked: Any  # the `stacked=` prefix, or None
    seed: int

    def tree(self, part: str, values: dict[str, Any]) -> dict[str, Any]:
        """The nested dict of `part` ("grads", "logits") from `values`, keyed
        by the inputs' names."""
        out: dict[str, Any] = {}
        for name, _ in self.inputs:
            head, *keys = name.split("/")
            if head == part:
                node = out
                for k in keys[:-1]:
                    node = node.setdefault(k, {})
                node[keys[-1]] = values[name]
        return out


def _fits(n: int, axes: list[str], sizes: dict[str, int]) -> bool:
    return n % math.prod(sizes[a] for a in axes) == 0


def _entry(axes: list[str]) -> Any:
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _split(
    draw: Any, shape: tuple[int, ...], sizes: dict[str, int], free: list
) -> tuple:
    """Each dimension over a random set of the `free` mesh axes it divides by
    (each axis used once)."""
    spec = []
    for n in shape:
        chosen: list[str] = []
        for a in draw(st.permutations(free)):
            if draw(st.booleans()) and _fits(n, [*chosen, a], sizes):
                chosen.append(a)
        free = [a for a in free if a not in chosen]
        spec.append(_entry(chosen))
    return tuple(spec)


def _spec(draw: Any, layout: str, shape: tuple, sizes: dict, fsdp: str) -> tuple:
    """A leaf's spec in `layout` (FSDP: a random dimension that divides)."""
    if layout == "replicated" or not shape:
        return (None,) * len(shape)
    if layout == "split":
        return _split(draw, shape, sizes, list(sizes))
    dims = [d for d, n in enumerate(shape) if _fits(n, [fsdp], sizes)]
    dim = draw(st.sampled_from(dims))
    return tuple(fsdp if d == dim else None for d in range(len(shape)))


def _shape(draw: Any, rank: int) -> tuple[int, ...]:
    """A shape of `rank` whose first dimension is 8 (FSDP splits it)."""
    return (8, *(draw(st.sampled_from((2, 4, 8))) for _ in range(rank - 1)))[:rank]


@st.composite
def cases(draw: Any, rule: str) -> Case:
    kind, _, _ = RULES[rule]
    mesh = draw(st.sampled_from(MESHES))
    names = AXES[: len(mesh)]
    sizes = dict(zip(names, mesh, strict=True))
    spellings = [s for s in SPELLINGS if s != "axis_name" or "axis_name" in takes(rule)]
    spelling = draw(st.sampled_from(spellings))
    layout = "fsdp" if spelling == "axis_name" else draw(st.sampled_from(LAYOUTS))
    fsdp = draw(st.sampled_from(names))
    stacked = "stacked" in takes(rule) and draw(st.booleans())
    inputs: dict[str, Input] = {}
    prefix: Any = None
    if kind == "qk":
        inputs, prefix = _attention(draw, layout, sizes, fsdp, stacked)
    else:
        # Per-example gradients: one batch split for every leaf (FSDP: the
        # batch over the FSDP axis), the other dimensions as the layout says.
        batched = kind == "batched"
        lead: tuple = ()
        if batched:
            lead = _spec(draw, layout, (8,), sizes, fsdp)
            free = [a for a in sizes if a not in jax.tree.leaves(lead)]
            sizes = {a: sizes[a] for a in free} if layout != "fsdp" else {}
        # A spectral clip mixes a matrix's entries: its rounding is relative
        # to the matrix, not the entry, so its outputs (at most c) are kept
        # near 1 for ATOL to cover it.
        scale = 0.1 if rule == "clip_by_spectral_norm" else 3.0
        shapes = {}
        for name in ("a", "b", "c"):
            low = 0 if layout != "fsdp" and rule != "clip_by_norm_axes" else 1
            if rule == "clip_by_spectral_norm" and name == "a":
                low = 2  # a matrix at least, so that the rule acts
            shapes[name] = (_shape(draw, draw(st.integers(low, 3))), ())
        if stacked:
            at = draw(st.integers(0, 1))
            inner = [8, draw(st.sampled_from((2, 4)))]
            inner.insert(at, LAYERS)
            shapes["blocks"] = (tuple(inner), (at + batched,))
            prefix = {"a": 0, "b": 0, "c": 0, "blocks": clipax.LayerAxes(at)}
        for name, (shape, layers) in shapes.items():
            spec = _spec(
                draw, "replicated" if not sizes else layout, shape, sizes, fsdp
            )
            full = (8,) * batched + shape
            inputs[f"grads/{name}"] = Input(full, (*lead, *spec), layers, scale)
    if kind == "tx" and rule == "adaptive_grad_clip":
        for name, x in list(inputs.items()):
            inputs["params/" + name[6:]] = dataclasses.replace(x, scale=1.0)
    return Case(
        rule,
        mesh,
        draw(st.booleans()),
        layout,
        spelling,
        draw(st.booleans()),
        tuple(inputs.items()),
        prefix,
        draw(st.integers(0, 2**16)),
    )


def _attention(draw: Any, layout: str, sizes: dict, fsdp: str, stacked: bool) -> tuple:
    """An attention module (query heads 4, key heads 4, 2 or 1; heads on axis
    -2) beside an MLP kernel, and its logits (layers, batch 8, heads)."""
    nk = draw(st.sampled_from((4, 2, 1)))
    lead = (2,) if stacked else ()
    heads = [a for a in sizes if 4 % sizes[a] == 0]
    h = draw(st.sampled_from([None, *heads])) if layout == "split" else None
    rest = [a for a in sizes if a != h]
    layer_axis = (
        draw(st.sampled_from([None, *[a for a in rest if sizes[a] == 2]]))
        if layout == "split" and stacked
        else None
    )
    rest = [a for a in rest if a != layer_axis]
    embed = draw(st.sampled_from([None, *rest])) if layout == "split" else None
    if layout == "fsdp":
        embed = fsdp
    key_h = h if h is not None and nk % sizes[h] == 0 and draw(st.booleans()) else None
    lay = (layer_axis,) if stacked else ()
    inputs = {
        "grads/attn/query": Input(
            (*lead, 8, 4, 4), (*lay, embed, h, None), (0,) * stacked, 0.1
        ),
        "grads/attn/key": Input(
            (*lead, 8, nk, 4), (*lay, embed, key_h, None), (0,) * stacked, 0.1
        ),
        "grads/mlp": Input((8, 8), (embed, None), (), 0.1),
    }
    for name, x in list(inputs.items()):
        inputs["params/" + name[6:]] = dataclasses.replace(x, scale=1.0)
    free = [a for a in sizes if a not in (h, layer_axis)]
    if layout == "split":
        batch = _entry([a for a in draw(st.permutations(free)) if draw(st.booleans())])
        logit_h = h if draw(st.booleans()) else None
    else:
        batch, logit_h = (fsdp if layout == "fsdp" else None), None
    inputs["logits/attn"] = Input(
        (*lead, 8, 4), (*lay, batch, logit_h), (0,) * stacked, 0.0
    )
    return inputs, ({"attn": 1, "mlp": 0} if stacked else None)


# Running a case.


def _values(case: Case) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(case.seed)
    out = {}
    for name, x in case.inputs:
        if name.startswith("logits/"):
            v = rng.normal(size=x.shape) * 3.0
            v[..., 0, 0] = 3 * TAU  # one head over the threshold in each layer
            v[..., 5, -1] = 1.5 * TAU
            out[name] = v.astype(np.float32)
        else:
            out[name] = (rng.normal(size=x.shape) * x.scale).astype(np.float32)
    return out


def _steps(case: Case, values: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """`values` at each step: the gradients scaled by BASE and by each
    tensor's spike (a stack's layers numbered after the leaves before it)."""
    out: list[dict[str, Any]] = [dict(values) for _ in BASE]
    t = 0
    for name, x in case.inputs:
        if not name.startswith("grads/"):
            continue
        axis = x.layers[0] if x.layers else None
        count = x.shape[axis] if axis is not None else 1
        for step, base in enumerate(BASE):
            factor = np.full(count, base, np.float32)
            for layer in range(count):
                if SPIKE_AT[(t + layer) % 3] == step:
                    factor[layer] *= SPIKE
            shape = [count if d == axis else 1 for d in range(len(x.shape))]
            out[step][name] = values[name] * factor.reshape(shape)
        t += count
    return out


def _step(case: Case, kw: dict[str, Any], logs: bool, off: bool = False) -> Any:
    """The function of (each step's grads, params, logits) each spelling
    runs; with `off`, the rule's recipe with its action off (`OFF`)."""
    kind, _, make = RULES[case.rule]
    rule = OFF.get(case.rule, optax.identity)() if off else make(kw)
    if kind in ("fn", "batched"):
        return lambda grads, params, logits: rule(grads[0])

    def run(grads: list[Any], params: Any, logits: Any) -> Any:
        params = params or grads[0]
        state = rule.init(params)
        updates = []
        for g, s in zip(grads, BASE, strict=True):
            extra = (
                {"max_logits": jax.tree.map(lambda x, s=s: x * s, logits)}
                if logits and not off
                else {}
            )
            u, state = rule.update(g, state, params, **extra)
            updates.append(u)
        return updates, state, clipax.metrics(state) if logs else {}

    return run


def _natural_spec(keys: tuple[str, ...], shape: tuple, case: Case) -> P:
    """How an output of the step is split: like the input its path ends in
    (the longest such end; a module's statistic ends in the module's path):
    whole-shaped as it, per layer as its layers, per example summed as it
    without the batch; else whole."""
    best, found = 0, None
    for name, x in case.inputs:
        path = tuple(name.split("/")[1:])
        for j in range(min(len(keys), len(path)), best, -1):
            if keys[-j:] == path[:j]:
                best, found = j, x
                break
    if found is None or not shape:
        return P()
    if shape == found.shape:
        return P(*found.spec)
    if shape == found.shape[1:]:
        return P(*found.spec[1:])
    layers = tuple(found.shape[a] for a in found.layers)
    if found.layers and shape[: len(layers)] == layers:  # per layer (a window)
        return P(*(found.spec[a] for a in found.layers))
    return P()


def _keys(path: Any) -> tuple[str, ...]:
    return tuple(
        str(next((getattr(k, a) for a in ("key", "name", "idx") if hasattr(k, a)), k))
        for k in path
    )


def _is_clipax_error(error: BaseException) -> bool:
    """A ValueError or TypeError that clipax raised itself (not JAX from
    inside clipax's code)."""
    if not isinstance(error, (ValueError, TypeError)) or error.__traceback__ is None:
        return False
    frames = traceback.extract_tb(error.__traceback__)
    return frames[-1].filename.startswith(SRC)


def _run(case: Case, kw: dict[str, Any], logs: bool) -> tuple[Any, Any]:
    """(one device's outputs, each device's copies of the mesh run's outputs:
    every array with a leading axis over its copies)."""
    values = _values(case)
    trees = _trees(case, values)
    alone = {"stacked": case.stacked} if case.stacked is not None else {}
    want = jax.block_until_ready(jax.jit(_step(case, alone, logs))(*trees))
    names = AXES[: len(case.mesh)]
    kind = AxisType.Explicit if case.explicit else AxisType.Auto
    mesh = jax.make_mesh(case.mesh, names, axis_types=(kind,) * len(names))
    specs = {name: P(*x.spec) for name, x in case.inputs}
    args = jax.tree.map(
        lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec)),
        trees,
        _trees(case, specs),
    )
    in_specs = tuple(_trees(case, specs))
    step = _step(case, kw, logs)
    context = jax.set_mesh(mesh) if case.explicit else contextlib.nullcontext()
    with context:
        if case.spelling == "jit":
            got = jax.block_until_ready(jax.jit(step)(*args))
            return want, jax.tree.map(lambda x: np.asarray(x)[None], got)
        flat, treedef = jax.tree_util.tree_flatten_with_path(want)
        natural = [_natural_spec(_keys(p), np.shape(x), case) for p, x in flat]

        def copies(spec: P) -> P:
            rest = [a for a in names if a not in jax.tree.leaves(tuple(spec))]
            return P(_entry(rest), *spec)

        out_specs = treedef.unflatten([copies(s) for s in natural])

        def body(*inputs: Any) -> Any:
            return jax.tree.map(lambda x: x[None], step(*inputs))

        mapped = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            check_vma=case.check_vma,
        )
        got = jax.block_until_ready(jax.jit(mapped)(*args))
    return want, jax.tree.map(np.asarray, got)


def _trees(case: Case, values: dict[str, Any]) -> list[Any]:
    """The step's arguments from `values` (arrays, or their specs): each
    step's gradients, the params, the logits."""
    per_step = (
        _steps(case, values)
        if not isinstance(next(iter(values.values())), P)
        else [values] * len(BASE)
    )
    grads = [case.tree("grads", v) for v in per_step]
    return [
        grads,
        case.tree("params", values) or None,
        case.tree("logits", values) or None,
    ]


def _check(want: Any, got: Any, case: Case) -> None:
    flat_want = jax.tree_util.tree_flatten_with_path(want)[0]
    flat_got = jax.tree.leaves(got)
    assert len(flat_want) == len(flat_got), case
    for (path, w), g in zip(flat_want, flat_got, strict=True):
        for copy in g:
            np.testing.assert_allclose(
                copy,
                np.asarray(w),
                rtol=RTOL,
                atol=ATOL,
                err_msg=f"{jax.tree_util.keystr(path)} in {case}",
            )


def _logged(state: Any) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in clipax.metrics(state).items()}


def _clips(case: Case, want: Any) -> None:
    """The one-device run acted: its outputs differ from those of the recipe
    with the rule's action off (a mesh that clips nothing tests nothing); a
    rule that resets layers restarted them at different steps."""
    kind = RULES[case.rule][0]
    if kind == "fn":
        return
    trees = _trees(case, _values(case))
    if kind == "batched":
        summed = jax.tree.map(lambda g: g.sum(0), trees[0][0])
        assert not all(
            np.allclose(a, b)
            for a, b in zip(
                jax.tree.leaves(want[0]), jax.tree.leaves(summed), strict=True
            )
        ), case
        return
    off = jax.jit(_step(case, {}, logs=False, off=True))(*trees)[0]
    assert any(
        not np.allclose(u, o)
        for step, step_off in zip(want[0], off, strict=True)
        for u, o in zip(jax.tree.leaves(step), jax.tree.leaves(step_off), strict=True)
    ), case
    if case.rule == "reset_on_spike":  # restarted at two steps, or never
        ages = np.concatenate([np.ravel(a) for a in jax.tree.leaves(want[1].age)])
        assert len(set(ages.tolist())) == 3, (ages, case)


def _split_both_sides(case: Case) -> bool:
    """Whether a matrix of `_matrices` (axes 0 and 1 of a layer) is split
    along both of its sides: `clip_by_spectral_norm` refuses it inside
    shard_map, whatever the specs say (a Gram matrix sums over one side)."""
    for name, x in case.inputs:
        sides = [x.spec[d] for d in range(len(x.shape)) if d not in x.layers][:2]
        if name.startswith("grads/") and len(sides) == 2 and None not in sides:
            return True
    return False


def must_work(case: Case) -> bool:
    """Whether the layout was given (or proven), so that a refusal fails."""
    taken = takes(case.rule)
    if case.rule in ELEMENTWISE or case.spelling == "jit":
        return True
    if case.spelling == "specs":
        # The "split" layout draws matrices split along both sides, which
        # `clip_by_spectral_norm` refuses with `specs`: a refusal passes
        # there, and only there.
        spectral = case.rule == "clip_by_spectral_norm"
        return "specs" in taken and not (spectral and _split_both_sides(case))
    if case.spelling == "axis_name":
        return case.stacked is None and case.rule != "clip_by_norm_axes"
    return case.layout == "replicated" and case.check_vma


def check_case(case: Case) -> None:
    taken = takes(case.rule)
    kw: dict[str, Any] = {}
    if case.stacked is not None:
        kw["stacked"] = case.stacked
    if case.spelling == "specs" and "specs" in taken:
        kw["specs"] = {k: P(*x.spec) for k, x in case.inputs if k.startswith("grads/")}
        kw["specs"] = case.tree("grads", kw["specs"])
        if "logit_specs" in taken:
            logit = {k: P(*x.spec) for k, x in case.inputs if k.startswith("logits/")}
            kw["logit_specs"] = case.tree("logits", logit)
    if case.spelling == "axis_name":
        kw["axis_name"] = next(
            a for a in jax.tree.leaves([x.spec for _, x in case.inputs])
        )
    logs = RULES[case.rule][0] in ("tx", "qk")
    try:
        try:
            want, got = _run(case, kw, logs)
        except (ValueError, TypeError) as error:
            if not (logs and _is_clipax_error(error)):
                raise
            # `clipax.metrics` may refuse inside shard_map: the rest not.
            want, got = _run(case, kw, logs=False)
    except (ValueError, TypeError) as error:
        if must_work(case) or not _is_clipax_error(error):
            raise AssertionError(f"{case}: {type(error).__name__}: {error}") from error
        return
    _clips(case, want)
    _check(want, got, case)
    if logs:  # the state the step returns, logged outside the mesh
        state = jax.tree.map(lambda x: x[0], got[1])
        _check(_logged(want[1]), {k: v[None] for k, v in _logged(state).items()}, case)


@pytest.fixture(autouse=True, scope="module")
def _unfiltered_tracebacks() -> Any:
    """Whole tracebacks, so that an error JAX raises inside clipax's code is
    told from clipax's own."""
    old = jax.config.jax_traceback_filtering
    jax.config.update("jax_traceback_filtering", "off")
    yield
    jax.config.update("jax_traceback_filtering", old)


@pytest.mark.devices(8)
@pytest.mark.parametrize("rule", list(RULES))
@MESH_CASES
@given(data=st.data())
def test_every_rule_on_every_mesh_equals_one_device(rule: str, data: Any) -> None:
    check_case(data.draw(cases(rule)))


# The layouts users write, each once in CI whatever the draws.


def _case(rule: str, mesh: tuple, spelling: str, inputs: dict, **kw: Any) -> Case:
    fields = {"explicit": False, "layout": "split", "check_vma": True, "stacked": None}
    fields |= kw
    return Case(
        rule,
        mesh,
        fields["explicit"],
        fields["layout"],
        spelling,
        fields["check_vma"],
        tuple(inputs.items()),
        fields["stacked"],
        seed=3,
    )


def _attention_inputs(query: tuple, key: tuple, logits: tuple, nk: int = 4) -> dict:
    """An attention module's inputs (no layers): the query's spec, the key's,
    the logits' (batch, heads); the MLP kernel split as the query's first
    dimension."""
    out = {
        "grads/attn/query": Input((8, 4, 4), query, (), 0.1),
        "grads/attn/key": Input((8, nk, 4), key, (), 0.1),
        "grads/mlp": Input((8, 8), (query[0], None), (), 0.1),
    }
    for name, x in list(out.items()):
        out["params/" + name[6:]] = dataclasses.replace(x, scale=1.0)
    return out | {"logits/attn": Input((8, 4), logits, (), 0.0)}


def _stack_inputs(layer: Any) -> dict:
    """A leaf beside a stack of 4 layers, the layer axis split over `layer`."""
    return {
        "grads/a": Input((8, 4), (None, "y")),
        "grads/blocks": Input((4, 8, 2), (layer, None, None), (0,)),
    }


STACK = {"a": 0, "blocks": 1}
SPLIT = {"grads/w": Input((8, 4), ("x", "y")), "grads/b": Input((4,), ("y",))}
LAYOUTS_USERS_WRITE = {
    # FSDP through `axis_name`: every leaf and the batch over "x".
    "qk_clip fsdp axis_name": _case(
        "qk_clip",
        (8,),
        "axis_name",
        _attention_inputs(("x", None, None), ("x", None, None), ("x", None)),
        layout="fsdp",
    ),
    # Data parallel with JAX's types off: the batch's max over "x" all the same.
    "qk_clip data parallel check_vma off": _case(
        "qk_clip",
        (8,),
        "specs",
        _attention_inputs((None,) * 3, (None,) * 3, ("x", None)),
        check_vma=False,
    ),
    # The query heads over "y", a GQA key whole: its scale from all its heads.
    **{
        f"qk_clip heads split gqa key whole check_vma {vma}": _case(
            "qk_clip",
            (2, 4),
            "specs",
            _attention_inputs((None, "y", None), (None,) * 3, ("x", "y"), nk=2),
            check_vma=vma,
        )
        for vma in (True, False)
    },
    # Without specs, the heads split: refused, never the max across heads.
    "qk_clip heads split no specs": _case(
        "qk_clip",
        (2, 4),
        "none",
        _attention_inputs((None, "y", None), (None, "y", None), ("x", "y")),
    ),
    # Explicit meshes under jit: heads split, layer axes split.
    "qk_clip explicit heads split": _case(
        "qk_clip",
        (2, 4),
        "jit",
        _attention_inputs((None, "y", None), (None,) * 3, ("x", "y"), nk=2),
        explicit=True,
    ),
    **{
        f"{rule} explicit layers split": _case(
            rule, (2, 4), "jit", _stack_inputs("x"), explicit=True, stacked=STACK
        )
        for rule in ("adagc", "stable_spam")
    },
    # Without specs, the leaves split: refused, never a local norm.
    **{
        f"clip_by_global_norm no specs check_vma {vma}": _case(
            "clip_by_global_norm", (2, 4), "none", SPLIT, check_vma=vma
        )
        for vma in (True, False)
    },
    # The rules that took no layout: AGC, block RMS, per-example clipping.
    "adaptive_grad_clip specs": _case(
        "adaptive_grad_clip",
        (2, 4),
        "specs",
        SPLIT
        | {
            "params/" + k[6:]: dataclasses.replace(x, scale=1.0)
            for k, x in SPLIT.items()
        },
    ),
    "clip_by_block_rms specs": _case("clip_by_block_rms", (2, 4), "specs", SPLIT),
    # A spectral clip's Gram matrix summed over the split rows, the layers split.
    "clip_by_spectral_norm specs rows and layers split": _case(
        "clip_by_spectral_norm",
        (2, 4),
        "specs",
        {
            "grads/w": Input((8, 4), ("x", None), (), 0.1),
            "grads/blocks": Input((4, 8, 2), ("y", "x", None), (0,), 0.1),
        },
        stacked={"w": 0, "blocks": 1},
    ),
    "per_example_global_norm_clip specs check_vma off": _case(
        "per_example_global_norm_clip",
        (2, 4),
        "specs",
        {
            "grads/w": Input((8, 8, 4), ("x", "y", None)),
            "grads/b": Input((8, 4), ("x", "y")),
        },
        check_vma=False,
    ),
}


@pytest.mark.devices(8)
@pytest.mark.parametrize("case", LAYOUTS_USERS_WRITE.values(), ids=LAYOUTS_USERS_WRITE)
def test_the_layouts_users_write(case: Case) -> None:
    check_case(case)


def test_a_layout_that_does_not_fit_is_refused_naming_it() -> None:
    params = {"attn": {"query": jnp.ones((8, 4, 4)), "key": jnp.ones((8, 4, 4))}}
    qk = clipax.qk_clip(TAU, logit_specs={"blocks": P()})
    with pytest.raises(
        ValueError,
        match=r"`logit_specs` has no PartitionSpec .*\['attn'\].* of `max_logits`",
    ):
        qk.update(
            params, qk.init(params), params, max_logits={"attn": jnp.ones((2, 4))}
        )
    grads = {"a": jnp.ones((8, 2)), "b": jnp.ones((8, 2))}
    with pytest.raises(ValueError, match=r"pairs the examples.*\[\('x',\), \('y',\)\]"):
        clipax.tree.per_example_global_norm_clip(
            grads, 1.0, specs={"a": P("x"), "b": P("y")}
        )
    agc = clipax.adaptive_grad_clip(0.1, specs={"a": P()})
    with pytest.raises(ValueError, match=r"`specs` has no PartitionSpec for .*\['b'\]"):
        agc.update(grads, agc.init(grads), grads)
    with pytest.raises(
        ValueError, match=r"`axis_name` cannot be combined with `stacked`"
    ):
        clipax.clip_by_block_rms(1.0, axis_name="x", stacked=1)
    with pytest.raises(
        ValueError, match=r"`axis_name` cannot be combined with `stacked`"
    ):
        clipax.reset_on_spike(optax.adam(0.1), axis_name="x", stacked=1)
