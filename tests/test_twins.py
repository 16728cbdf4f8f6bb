"""Stacked layers equal their unrolled twin, for random trees and stackings.

Hypothesis draws a tree (`cases`): dicts, lists, tuples, a NamedTuple class and
Equinox modules holding float32 arrays, haliax `NamedArray`s, None and
`optax.MaskedNode`, with some subtrees stacked. A stack is an entry of the
`stacked=` prefix at its node: an int (leading layer axes) or a
`clipax.LayerAxes` (the layer axes anywhere, negative too), one or two layer
axes, on a leaf, a module, the root (one stack per top-level child), or on
siblings of equal layer counts that are their parent's only children.

Its unrolled twin (`unroll`) replaces each stack's node with a list of its
layers (a list of lists for two layer axes), each leaf cut at its layer index.
On the stacked tree with `stacked=` and on the twin without it, jitted:

- every per-tensor rule (`clip_by_norm`, also with `axes=-1`,
  `adaptive_grad_clip`, `adagc`, `stable_spam`, `clip_by_block_rms`), also
  under `optax.masked`, gives the same updates (unrolled) step by step;
- `clipax.metrics` of its state and `clipax.tree.group_norms` (a random
  `depth`, and `prefixes` taken from the twin's paths), logged at each step of
  a `jax.lax.scan`, give the same keys in the same order and the same series;
  each series ends in the value read from the last state, and the twin's keys
  are its own key paths (a masked leaf's gone, no other moved);
- `clipax.tree.per_example_layer_norm_clip` gives the same sums (a
  NamedArray's with the parameter's axes) and counts, and `group_norms` of
  another order the same norms.

Each test checks every property on each drawn case (drawing takes
milliseconds; compiling the stacked and the twin run, seconds). CI runs 4
derandomized cases per test, and STACKS and NESTED (below): about 35 s with
`-n 2` (the default, `-n auto`) and 45 s with `-n 0` on two idle CPU cores. A
longer, random search: 300 cases per test (about 40 minutes with `-n 2`), or
any number (100: 14 minutes):

    CLIPAX_TWINS=long .venv/bin/python -m pytest tests/test_twins.py
    CLIPAX_TWINS=100 .venv/bin/python -m pytest tests/test_twins.py

A failure prints the `Case` drawn and a `@reproduce_failure` blob.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, NamedTuple

import chex
import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import clipax

hax = pytest.importorskip("haliax")

_RUN = os.environ.get("CLIPAX_TWINS", "")
if _RUN not in ("", "long") and not _RUN.isdigit():
    raise ValueError(f"CLIPAX_TWINS must be 'long' or a number; got {_RUN!r}.")
TWINS = settings(
    max_examples=300 if _RUN == "long" else int(_RUN) if _RUN else 4,
    derandomize=not _RUN,  # CI: the same examples every run
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)

RTOL, ATOL = 1e-5, 1e-6
# The steps of the scan: the gradients are `a * scale + b * mix`.
SCALES = np.array([1.0, 0.5, 4.0], np.float32)
MIXES = np.array([0.0, 1.0, 0.3], np.float32)
STEPS = len(SCALES)
BATCH = 3


# The containers.


class Pair(NamedTuple):
    x: Any
    y: Any


class Triple(NamedTuple):
    x: Any
    y: Any
    z: Any


class Single(NamedTuple):
    x: Any


class Mod1(eqx.Module):
    p: Any


class Mod2(eqx.Module):
    p: Any
    q: Any

    def __call__(self, x: Any) -> Any:  # a model: as a prefix, still a prefix
        return x


class Mod3(eqx.Module):
    p: Any
    q: Any
    r: Any


class QK(NamedTuple):  # an attention module: its query and its key
    q: Any
    k: Any


class QKModule(eqx.Module):
    q: Any
    k: Any


NAMEDTUPLES = {1: Single, 2: Pair, 3: Triple}
MODULES = {1: Mod1, 2: Mod2, 3: Mod3}
KINDS = ("dict", "list", "tuple", "namedtuple", "module")
NAMES = ("a", "b", "dec", "enc", "w")
ORDERS = (1, 2, 3.0, math.inf)


def container(kind: str, keys: tuple[str, ...], values: list[Any]) -> Any:
    if keys == ("q", "k") and kind in ("namedtuple", "module"):
        return (QK if kind == "namedtuple" else QKModule)(*values)
    if kind == "dict":
        return dict(zip(keys, values, strict=True))
    if kind == "list":
        return list(values)
    if kind == "tuple":
        return tuple(values)
    return (NAMEDTUPLES if kind == "namedtuple" else MODULES)[len(values)](*values)


# A tree's description, from which its stacked form, prefix and mask are built.


@dataclasses.dataclass(frozen=True)
class Leaf:
    shape: tuple[int, ...]  # one layer's
    named: bool  # a haliax NamedArray
    seed: int
    mask: bool  # True: `optax.masked`'s rule applies to it


@dataclasses.dataclass(frozen=True)
class Empty:
    masked: bool  # optax.MaskedNode(), else None


@dataclasses.dataclass(frozen=True)
class Node:
    kind: str
    children: tuple[tuple[str, Any], ...]  # (dict key, child)
    collapse: bool = False  # in the prefix: one 0, where nothing below is stacked


@dataclasses.dataclass(frozen=True)
class Stack:
    entry: int | clipax.LayerAxes  # the `stacked=` entry at this node
    layers: tuple[int, ...]
    child: Any


@dataclasses.dataclass(frozen=True)
class Case:
    spec: Any
    depth: int  # group_norms' depth
    picks: tuple[tuple[int, int], ...]  # group_norms' prefixes: (path, length)
    uniform: bool  # per_example_layer_norm_clip's
    ord: float = 2  # group_norms' order, outside the scan


def spec_leaves(spec: Any) -> list[Leaf]:
    if isinstance(spec, Leaf):
        return [spec]
    if isinstance(spec, Stack):
        return spec_leaves(spec.child)
    if isinstance(spec, Node):
        return [leaf for _, c in spec.children for leaf in spec_leaves(c)]
    return []


def has_stack(spec: Any) -> bool:
    if isinstance(spec, Node):
        return any(has_stack(c) for _, c in spec.children)
    return isinstance(spec, Stack)


def layer_axes(entry: int | clipax.LayerAxes, rank: int) -> tuple[int, ...]:
    """The positions of an entry's layer axes in a leaf of `rank`, sorted."""
    if isinstance(entry, clipax.LayerAxes):
        return tuple(sorted(a % rank for a in entry.axes))
    return tuple(range(entry))


def build(spec: Any, salt: int, batch: int = 0, stack: Stack | None = None) -> Any:
    """The stacked tree: random float32 values, each layer (and example, with
    a `batch` on axis 0) of its own magnitude."""
    if isinstance(spec, Stack):
        return build(spec.child, salt, batch, spec)
    if isinstance(spec, Node):
        values = [build(c, salt, batch, stack) for _, c in spec.children]
        return container(spec.kind, tuple(k for k, _ in spec.children), values)
    if isinstance(spec, Empty):
        return optax.MaskedNode() if spec.masked else None
    layers = stack.layers if stack else ()
    rank = len(spec.shape) + len(layers)
    axes = layer_axes(stack.entry, rank) if stack else ()
    inner, outer = iter(spec.shape), iter(layers)
    full = tuple(next(outer) if d in axes else next(inner) for d in range(rank))
    rng = np.random.default_rng((spec.seed, salt))
    x = rng.normal(size=(batch, *full) if batch else full)
    x = x * np.exp(
        rng.uniform(-1.5, 1.5, [n if d in axes else 1 for d, n in enumerate(full)])
    )
    if batch:
        x = x * np.exp(rng.uniform(-3.0, 1.0, (batch,) + (1,) * rank))
    x = x.astype(np.float32)  # NumPy: the twin is cut without dispatches
    if not spec.named:
        return x
    names = iter(f"a{i}" for i in range(len(spec.shape)))
    stacked = iter(("layers", "layers2"))
    axis_names = [next(stacked) if d in axes else next(names) for d in range(rank)]
    return hax.NamedArray(x, (("batch",) if batch else ()) + tuple(axis_names))


def prefix_of(spec: Any) -> Any:
    """The `stacked=` prefix: each stack's entry at its node, 0 elsewhere."""
    if isinstance(spec, Stack):
        return spec.entry
    if not isinstance(spec, Node) or (spec.collapse and not has_stack(spec)):
        return 0
    values = [prefix_of(c) for _, c in spec.children]
    return container(spec.kind, tuple(k for k, _ in spec.children), values)


def mask_of(spec: Any) -> Any:
    """`optax.masked`'s mask: a full tree of bools (a stacked leaf's for all
    its layers)."""
    if isinstance(spec, Stack):
        return mask_of(spec.child)
    if isinstance(spec, Node):
        values = [mask_of(c) for _, c in spec.children]
        return container(spec.kind, tuple(k for k, _ in spec.children), values)
    if isinstance(spec, Empty):
        return optax.MaskedNode() if spec.masked else None
    return spec.mask


# The unrolled twin.


def is_named(x: Any) -> bool:
    return isinstance(x, hax.NamedArray)


def is_entry(x: Any) -> bool:
    return isinstance(x, (int, clipax.LayerAxes))


def children(node: Any) -> tuple[list[Any], Any]:
    return jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)


def cut_array(skip: int = 0) -> Any:
    """Cuts a leaf (an array, a NamedArray) at a layer index; its layer axes
    count after its first `skip` axes (a batch, the steps of a scan)."""

    def cut(x: Any, axes: tuple[int, ...], index: tuple[int, ...]) -> Any:
        array = x.array if is_named(x) else x
        at = [slice(None)] * array.ndim
        for axis, i in zip(axes, index, strict=True):
            at[axis + skip] = i
        out = array[tuple(at)]
        if not is_named(x):
            return out
        names = [n for d, n in enumerate(x.axis_names) if d - skip not in axes]
        return hax.NamedArray(out, tuple(names))

    return cut


def cut_stat(x: Any, axes: tuple[int, ...], index: tuple[int, ...]) -> Any:
    """A per-layer statistic (shaped as the layers) at a layer index."""
    del axes
    return x[index]


def cut_same(x: Any, axes: tuple[int, ...], index: tuple[int, ...]) -> Any:
    del axes, index
    return x


def _unroll_stack(tree: Any, ref: Any, entry: Any, cut: Any) -> Any:
    """A stack's node as a list of its layers (lists of lists, for two)."""
    refs = jax.tree.leaves(ref, is_leaf=is_named)
    values, treedef = jax.tree.flatten(tree, is_leaf=is_named)
    if not refs:
        return tree
    shapes = [np.shape(r.array if is_named(r) else r) for r in refs]
    axes = [layer_axes(entry, len(s)) for s in shapes]
    (layers,) = {tuple(s[a] for a in ax) for s, ax in zip(shapes, axes, strict=True)}
    if not layers:
        return tree

    def layer(index: tuple[int, ...]) -> Any:
        if len(index) < len(layers):
            return [layer((*index, i)) for i in range(layers[len(index)])]
        return treedef.unflatten(
            [cut(x, ax, index) for x, ax in zip(values, axes, strict=True)]
        )

    return layer(())


def unroll(
    tree: Any, prefix: Any, ref: Any = None, cut: Any = None, top: bool = True
) -> Any:
    """The unrolled twin of `tree` (its layer counts and axes read from
    `ref`, a stacked tree of the same structure, `tree` itself for None): each
    node holding a nonzero `prefix` entry replaced by a list of its layers,
    each leaf cut by `cut` (`cut_array()` for None). An entry for the whole
    tree is one per top-level child."""
    ref = tree if ref is None else ref
    cut = cut_array() if cut is None else cut
    if is_entry(prefix):
        if top and not (is_named(ref) or hasattr(ref, "shape")):
            values, treedef = children(tree)
            refs, _ = children(ref)
            return treedef.unflatten(
                [
                    _unroll_stack(x, r, prefix, cut)
                    for x, r in zip(values, refs, strict=True)
                ]
            )
        return _unroll_stack(tree, ref, prefix, cut)
    entries, _ = children(prefix)
    values, treedef = children(tree)
    refs, _ = children(ref)
    return treedef.unflatten(
        [
            unroll(x, p, r, cut, top=False)
            for x, p, r in zip(values, entries, refs, strict=True)
        ]
    )


def key_paths(tree: Any) -> list[str]:
    """Each array's `/`-joined key path (a NamedArray's ends at it)."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_named)[0]
    return [
        "/".join(
            str(next(getattr(k, a) for a in ("key", "name", "idx") if hasattr(k, a)))
            for k in path
        )
        for path, _ in flat
    ]


def plain(tree: Any) -> Any:
    """NamedArrays as their arrays (so that a scan stacks them over steps)."""
    return jax.tree.map(lambda x: x.array if is_named(x) else x, tree, is_leaf=is_named)


# The strategies.


def _leaf(draw: Any) -> Leaf:
    rank = draw(st.sampled_from((0, 1, 1, 2, 2, 3)))
    shape = tuple(draw(st.integers(1, 4)) for _ in range(rank))
    return Leaf(
        shape, draw(st.booleans()), draw(st.integers(0, 2**16)), draw(st.booleans())
    )


def _layers(draw: Any) -> tuple[int, ...]:
    if draw(st.integers(0, 3)) == 0:  # nested stacks: two layer axes
        return (draw(st.integers(1, 2)), draw(st.integers(1, 3)))
    return (draw(st.integers(1, 3)),)


def _entry(draw: Any, child: Any, layers: tuple[int, ...]) -> Any:
    count = len(layers)
    rank = count + min(len(leaf.shape) for leaf in spec_leaves(child))
    how = draw(st.sampled_from(("leading", "positions", "negative")))
    if how == "leading":
        return count
    if how == "negative" and count == 1:
        return clipax.LayerAxes(-draw(st.integers(1, rank)))
    positions = draw(
        st.lists(st.integers(0, rank - 1), min_size=count, max_size=count, unique=True)
    )
    return clipax.LayerAxes(*sorted(positions))


def _stack(draw: Any, n: int, depth: int, layers: tuple[int, ...]) -> Stack:
    child = _body(draw, n, depth, free=False)
    return Stack(_entry(draw, child, layers), layers, child)


def _node(draw: Any, n: int, depth: int, free: bool) -> Any:
    """A subtree holding `n` leaves; `free`: no stack above it."""
    if free and draw(st.integers(0, 3)) == 0:
        return _stack(draw, n, depth, _layers(draw))
    return _body(draw, n, depth, free)


def _body(draw: Any, n: int, depth: int, free: bool) -> Any:
    if n == 1 and (depth >= 3 or draw(st.integers(0, 3)) > 0):
        return _leaf(draw)
    kind = draw(st.sampled_from(KINDS))
    k = draw(st.integers(1 if depth < 2 or n == 1 else 2, min(n, 3)))
    cuts = (
        draw(
            st.lists(st.integers(1, n - 1), min_size=k - 1, max_size=k - 1, unique=True)
        )
        if k > 1
        else []
    )
    parts = np.diff([0, *sorted(cuts), n]).tolist()
    if free and k >= 2 and draw(st.integers(0, 2)) == 0:
        # Sibling stacks of equal layer counts, their parent's only children.
        layers = _layers(draw)
        kids = [_stack(draw, p, depth + 1, layers) for p in parts]
    else:
        kids = [_node(draw, p, depth + 1, free) for p in parts]
    if k < 3 and draw(st.integers(0, 3)) == 0:
        where = draw(st.integers(0, k))
        kids.insert(where, Empty(draw(st.booleans())))
    keys = draw(
        st.lists(
            st.sampled_from(NAMES), min_size=len(kids), max_size=len(kids), unique=True
        )
    )
    return Node(kind, tuple(zip(keys, kids, strict=True)), draw(st.booleans()))


@st.composite
def cases(draw: Any) -> Case:
    spec = _node(draw, draw(st.integers(2, 8)), 0, free=True)
    picks = draw(
        st.lists(
            st.tuples(st.integers(0, 63), st.integers(1, 4)), min_size=1, max_size=3
        )
    )
    depth, uniform = draw(st.integers(1, 4)), draw(st.booleans())
    return Case(spec, depth, tuple(picks), uniform, draw(st.sampled_from(ORDERS)))


# Two layouts every run checks. STACKS: sibling stacks of equal layer counts,
# their parent's only children (`a`); entries on leaves (`b/p/x`, `b/p/y`),
# whose layer index goes after the leaf's key; NamedArrays in stacks, a layer
# axis not leading. NESTED: an entry for the whole tree, two layer axes, none
# leading; a NamedArray, a MaskedNode.


def _block(seed: int, named: bool = False) -> Node:
    return Node(
        "dict",
        (
            ("a", Leaf((2, 3), named, seed, True)),
            ("w", Leaf((3,), False, seed + 1, False)),
        ),
    )


STACKS = Case(
    Node(
        "dict",
        (
            (
                "a",
                Node(
                    "dict",
                    (
                        ("enc", Stack(1, (3,), _block(0))),
                        ("dec", Stack(clipax.LayerAxes(1), (3,), _block(2, True))),
                    ),
                ),
            ),
            (
                "b",
                Node(
                    "module",
                    (
                        (
                            "",
                            Node(
                                "namedtuple",
                                (
                                    ("", Stack(1, (2,), Leaf((2, 2), True, 4, True))),
                                    (
                                        "",
                                        Stack(
                                            clipax.LayerAxes(-1),
                                            (2,),
                                            Leaf((3,), False, 5, False),
                                        ),
                                    ),
                                ),
                            ),
                        ),
                        ("", Leaf((4,), False, 6, True)),
                        ("", Empty(masked=False)),
                    ),
                ),
            ),
        ),
    ),
    depth=3,
    picks=((0, 2), (3, 3), (13, 3)),
    uniform=True,
)
NESTED = Case(
    Stack(
        clipax.LayerAxes(1, 2),
        (2, 3),
        Node(
            "list",
            (
                ("", Leaf((2, 2), True, 7, True)),
                (
                    "",
                    Node(
                        "tuple",
                        (("", Leaf((1,), False, 8, False)), ("", Empty(masked=True))),
                    ),
                ),
            ),
        ),
    ),
    depth=2,
    picks=((5, 2), (0, 1)),
    uniform=False,
    ord=math.inf,
)


def twin_test(test: Any) -> Any:
    """A test of random cases, and of STACKS and NESTED."""
    return TWINS(given(case=cases())(example(case=STACKS)(example(case=NESTED)(test))))


# The runs.


@dataclasses.dataclass
class Inputs:
    a: Any  # the gradients at a step: a * scale + b * mix
    b: Any
    params: Any
    batch: Any  # per-example gradients
    mask: Any  # optax.masked's


def inputs(case: Case) -> tuple[Inputs, Inputs, Any]:
    """The stacked inputs, the twin's, and the `stacked=` prefix."""
    spec, prefix = case.spec, prefix_of(case.spec)
    s = Inputs(
        build(spec, 0),
        build(spec, 1),
        build(spec, 2),
        build(spec, 3, BATCH),
        mask_of(spec),
    )
    twin = Inputs(
        unroll(s.a, prefix),
        unroll(s.b, prefix),
        unroll(s.params, prefix),
        unroll(s.batch, prefix, s.a, cut_array(1)),
        unroll(s.mask, prefix, s.a, cut_same),
    )
    return s, twin, prefix


def rules(stacked: Any, mask: Any) -> dict[str, Any]:
    """Every per-tensor rule, by name; `mask` for `optax.masked`."""
    return {
        "clip_by_norm": clipax.clip_by_norm(1.0, stacked=stacked),
        "clip_by_norm axes=-1": clipax.clip_by_norm(0.5, axes=-1, stacked=stacked),
        "adaptive_grad_clip": clipax.adaptive_grad_clip(0.05, stacked=stacked),
        "clip_by_block_rms": clipax.clip_by_block_rms(0.5, stacked=stacked),
        "masked adaptive_grad_clip": optax.masked(
            clipax.adaptive_grad_clip(0.05, stacked=stacked), mask
        ),
        "adagc": clipax.adagc(warmup_steps=1, stacked=stacked),
        "stable_spam": clipax.stable_spam(
            optax.sgd(0.1), reset_every=None, stacked=stacked
        ),
        "masked adagc": optax.masked(
            clipax.adagc(warmup_steps=1, stacked=stacked), mask
        ),
        "reset_on_spike": clipax.reset_on_spike(
            optax.adam(0.1),
            b1=0.9,
            b2=0.999,
            warmup_steps=1,
            z_threshold=0.5,
            stacked=stacked,
        ),
    }


def assert_well_formed(tree: Any, what: str) -> None:
    """Each NamedArray's axes fit its array (else its `.axes` raises)."""
    for x in jax.tree.leaves(tree, is_leaf=is_named):
        if is_named(x):
            assert np.ndim(x.array) == len(x.axis_names), (what, x.axis_names)


def rule_steps(
    x: Inputs,
    stacked: Any,
    case: Case,
    names: list[str],
    prefixes: list[str] | None = None,
) -> tuple:
    """A function running the rules `names` over the scan's steps, and its
    arguments (`x`'s gradients and parameters). It returns each step's
    updates and logs (`metrics`; with `prefixes`, the first rule's with
    `group_norms` of the step's gradients beside), and the logs read from
    the last states."""
    txs = {name: tx for name, tx in rules(stacked, x.mask).items() if name in names}

    def norms(grads: Any) -> clipax.Metrics:
        by_depth = clipax.tree.group_norms(
            grads, depth=case.depth, stacked=stacked, key_prefix="grads"
        )
        return by_depth | clipax.tree.group_norms(
            grads, prefixes=prefixes, stacked=stacked, key_prefix="pre"
        )

    def run(a: Any, b: Any, params: Any) -> tuple:
        def step(states: dict, at: tuple) -> tuple:
            scale, mix = at
            grads = jax.tree.map(lambda u, v: u * scale + v * mix, a, b)
            updates, logs, new = {}, {}, {}
            for name, tx in txs.items():
                u, new[name] = tx.update(grads, states[name], params)
                assert jax.tree.structure(u) == jax.tree.structure(grads), name
                assert_well_formed((u, new[name]), name)
                updates[name] = plain(u)
                logs[name] = clipax.metrics(new[name])
            if prefixes is not None:  # (group_norms takes long to compile)
                logs[names[0]] = logs[names[0]] | norms(grads)
            return new, (updates, logs)

        states = {name: tx.init(params) for name, tx in txs.items()}
        states, (updates, logs) = jax.lax.scan(step, states, (SCALES, MIXES))
        return updates, logs, {name: clipax.metrics(s) for name, s in states.items()}

    return run, (x.a, x.b, x.params)


def jit_both(stacked: tuple, twin: tuple) -> tuple:
    """Runs the stacked run's function on its arguments, and the twin's on
    its, in one jitted function (one compilation); their outputs on the host."""
    (s_fn, s_args), (t_fn, t_args) = stacked, twin
    both = jax.jit(lambda s, t: (s_fn(*s), t_fn(*t)))
    return jax.device_get(both(s_args, t_args))


def as_float(x: Any) -> np.ndarray:
    return np.asarray(x, np.float64)


def assert_same_logs(got: Any, want: Any, what: str, shape: tuple = ()) -> None:
    """The same keys, in the same order, and the same values (of `shape`)."""
    only_got, only_want = set(got) - set(want), set(want) - set(got)
    assert not only_got and not only_want, (
        f"{what}: the stacked tree's keys are not its twin's: only stacked "
        f"{sorted(only_got)[:6]}, only twin {sorted(only_want)[:6]}"
    )
    assert list(got) == list(want), f"{what}: the same keys, in another order"
    for key in want:
        g, w = as_float(got[key]), as_float(want[key])
        assert g.shape == w.shape == shape, (what, key, g.shape, w.shape)
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=f"{what} {key}")


def assert_series_end_in(series: Any, final: Any, what: str) -> None:
    """Logs stacked over steps read as series, each ending in the value read
    from the last state."""
    assert [k for k in series if k in final] == list(final), what
    for key in final:
        np.testing.assert_allclose(
            as_float(series[key])[-1],
            as_float(final[key]),
            rtol=RTOL,
            atol=ATOL,
            err_msg=f"{what} {key}",
        )


def per_tensor(keys: Any, rule: str) -> list[str]:
    """The keys of a rule's per-tensor statistics (not its scalars)."""
    return [k for k in keys if k.startswith(f"{rule}/") and k.count("/") >= 2]


def pick_prefixes(case: Case, paths: list[str]) -> list[str]:
    """group_norms' `prefixes`: a few of the twin's paths, cut short."""
    picked = ["/".join(paths[i % len(paths)].split("/")[:n]) for i, n in case.picks]
    return list(dict.fromkeys(p for p in picked if p))


# The rules that keep no statistics (their logs are empty).
STATELESS = {"adaptive_grad_clip", "clip_by_block_rms", "masked adaptive_grad_clip"}
# The stat each rule keeps per tensor, to check the twin's keys by.
STATS = {
    "clip_by_norm": "norm",
    "adagc": "ema",
    "stable_spam": "m_norm",
    "reset_on_spike": "resets",
}


def check_rules(case: Case, names: list[str], norms: bool = False) -> tuple:
    """The rules `names`, on the stacked tree and on its twin: the same
    updates, the same logs at each step, each a series ending in the value
    read from the last state; the twin's keys are its own key paths; with
    `norms`, the same `group_norms` at each step. Returns both runs' last
    logs, the twin's key paths and its mask."""
    stacked, twin, prefix = inputs(case)
    paths = key_paths(twin.a)
    prefixes = pick_prefixes(case, paths) if norms else None
    (s_updates, s_logs, s_final), (t_updates, t_logs, t_final) = jit_both(
        rule_steps(stacked, prefix, case, names, prefixes),
        rule_steps(twin, None, case, names, prefixes),
    )
    for name in names:  # a rule that keeps statistics logs them, stacked or not
        kept = name not in STATELESS
        assert bool(s_final[name]) == bool(t_final[name]) == kept, name
    if norms:
        assert {k.split("/")[0] for k in t_logs[names[0]]} >= {"grads", "pre"}
    for name in names:
        if name in STATS:  # the twin's keys: its own key paths, in order
            stat = STATS[name]
            assert [k for k in per_tensor(t_final[name], name) if k.endswith(stat)] == [
                f"{name}/{p}/{stat}" for p in paths
            ]
        assert_same_logs(s_logs[name], t_logs[name], name, (STEPS,))
        assert_series_end_in(s_logs[name], s_final[name], f"stacked {name}")
        assert_series_end_in(t_logs[name], t_final[name], f"twin {name}")
        chex.assert_trees_all_close(
            unroll(s_updates[name], prefix, stacked.a, cut_array(1)),
            t_updates[name],
            rtol=RTOL,
            atol=ATOL,
        )
    return s_final, t_final, paths, twin.mask


@twin_test
def test_stateless_rules_equal_the_unrolled_twin(case: Case) -> None:
    names = ["clip_by_norm", "adaptive_grad_clip", "clip_by_block_rms"]
    names += ["masked adaptive_grad_clip"]
    if min(len(leaf.shape) for leaf in spec_leaves(case.spec)) >= 1:
        names += ["clip_by_norm axes=-1"]  # counted within one layer
    check_rules(case, names)


@twin_test
def test_per_example_clip_and_group_norms_equal_the_unrolled_twin(case: Case) -> None:
    stacked, twin, prefix = inputs(case)
    prefixes = pick_prefixes(case, key_paths(twin.a))

    def tree_fns(stacked: Any) -> Any:
        def run(batch: Any, grads: Any) -> tuple:
            summed, clipped = clipax.tree.per_example_layer_norm_clip(
                batch, 2.0, case.uniform, stacked=stacked
            )
            norms = [
                clipax.tree.group_norms(grads, stacked=stacked, ord=case.ord, **kw)
                for kw in ({"depth": case.depth}, {"prefixes": prefixes})
            ]
            assert_well_formed(summed, "per_example_layer_norm_clip")
            return summed, clipped, norms

        return run

    (s_summed, s_clipped, s_norms), (t_summed, t_clipped, t_norms) = jit_both(
        (tree_fns(prefix), (stacked.batch, stacked.a)),
        (tree_fns(None), (twin.batch, twin.a)),
    )
    unrolled = unroll(s_summed, prefix, stacked.a)
    assert jax.tree.structure(unrolled) == jax.tree.structure(t_summed)  # names too
    chex.assert_trees_all_close(unrolled, t_summed, rtol=RTOL, atol=ATOL)
    chex.assert_trees_all_equal(
        unroll(s_clipped, prefix, stacked.a, cut_stat), t_clipped
    )
    for got, want, by in zip(s_norms, t_norms, ("depth", "prefixes"), strict=True):
        assert_same_logs(got, want, f"group_norms by {by}, ord={case.ord}")


@twin_test
def test_stateful_rules_and_their_logs_equal_the_unrolled_twin(case: Case) -> None:
    s_final, t_final, paths, mask = check_rules(
        case, ["adagc", "stable_spam", "masked adagc", "reset_on_spike"], norms=True
    )
    # Under `optax.masked`, the masked arrays' keys are gone and no other moved.
    applies = dict(zip(paths, jax.tree.leaves(mask), strict=True))
    kept = [
        k
        for k in per_tensor(t_final["adagc"], "adagc")
        if applies[k[len("adagc/") : k.rindex("/")]]
    ]
    assert per_tensor(s_final["masked adagc"], "adagc") == kept
    assert per_tensor(t_final["masked adagc"], "adagc") == kept


def test_per_example_sums_of_named_arrays_drop_the_batch_axis() -> None:
    # The sum of a NamedArray of per-example gradients is the parameter's
    # NamedArray: its axes, less the batch, on the stacked tree as on the twin.
    params = {"w": hax.NamedArray(np.ones((2, 4), np.float32), ("a0", "layers"))}
    names = ("batch", "a0", "layers")
    batch = {"w": hax.NamedArray(np.ones((3, 2, 4), np.float32), names)}
    twin = unroll(batch, {"w": clipax.LayerAxes(1)}, params, cut_array(1))
    summed, _ = clipax.tree.per_example_layer_norm_clip(
        batch, 1.0, stacked={"w": clipax.LayerAxes(1)}
    )
    twin_summed, _ = clipax.tree.per_example_layer_norm_clip(twin, 1.0)
    assert [x.axis_names for x in twin["w"]] == [("batch", "a0")] * 4
    assert [x.axis_names for x in twin_summed["w"]] == [("a0",)] * 4
    assert summed["w"].axis_names == ("a0", "layers")
    assert_well_formed((summed, twin_summed), "per_example_layer_norm_clip")


# QK-Clip: attention modules (a dict, a NamedTuple or an Equinox module holding
# a query "q" and a key "k", heads on axis -2, GQA), stacked at any axes or
# not, beside a leaf it passes through; `max_logits` per module, its layers
# first, over the steps of the scan at three sizes about TAU.

QK_TAU = 4.0


@st.composite
def attention_cases(draw: Any) -> Node:
    children = []
    for name in ("a", "b"):
        nq = draw(st.sampled_from((2, 4)))
        nk = draw(st.sampled_from([n for n in (1, 2, 4) if nq % n == 0]))
        named, seed = draw(st.booleans()), draw(st.integers(0, 2**16))
        module = Node(
            draw(st.sampled_from(("dict", "namedtuple", "module"))),
            (
                ("q", Leaf((2, nq, 2), named, seed, True)),
                ("k", Leaf((2, nk, 2), named, seed + 1, True)),
            ),
            collapse=True,
        )
        if draw(st.booleans()):
            layers = _layers(draw)
            module = Stack(_entry(draw, module, layers), layers, module)
        children.append((name, module))
    return Node("dict", (*children, ("w", Leaf((3,), False, 9, False))))


def attention_logits(spec: Any, layers: tuple[int, ...] = ()) -> Any:
    """`max_logits` for `spec`'s tree: per module (layers..., batch, heads)."""
    if isinstance(spec, Stack):
        return attention_logits(spec.child, spec.layers)
    if isinstance(spec, Node) and [k for k, _ in spec.children] == ["q", "k"]:
        leaf = spec.children[0][1]
        rng = np.random.default_rng(leaf.seed)
        shape = (*layers, BATCH, leaf.shape[1])
        return rng.uniform(0, 2 * QK_TAU, shape).astype(np.float32)
    if isinstance(spec, Node):
        return {k: attention_logits(c) for k, c in spec.children}
    return None


@TWINS
@given(spec=attention_cases())
def test_qk_clip_equals_the_unrolled_twin(spec: Node) -> None:
    prefix, case = prefix_of(spec), Case(spec, 1, (), True)
    stacked, twin, _ = inputs(case)
    logits = attention_logits(spec)
    # The logits' layers come first: each stack's entry as its count of axes.
    leading = jax.tree.map(
        lambda e: len(e.axes) if isinstance(e, clipax.LayerAxes) else e,
        prefix,
        is_leaf=is_entry,
    )
    twin_logits = unroll(logits, leading)

    def steps(stacked: Any, x: Inputs, logits: Any) -> tuple:
        tx = clipax.qk_clip(QK_TAU, query="q", key="k", stacked=stacked)

        def run(a: Any, b: Any, params: Any) -> tuple:
            def step(state: Any, at: tuple) -> tuple:
                scale, mix = at
                grads = jax.tree.map(lambda u, v: u * scale + v * mix, a, b)
                seen = jax.tree.map(lambda s: s * scale, logits)
                updates, state = tx.update(grads, state, params, max_logits=seen)
                assert_well_formed((updates, state), "qk_clip")
                return state, (plain(updates), clipax.metrics(state))

            state, (updates, logs) = jax.lax.scan(
                step, tx.init(params), (SCALES, MIXES)
            )
            return updates, logs, clipax.metrics(state)

        return run, (x.a, x.b, x.params)

    (s_updates, s_logs, s_final), (t_updates, t_logs, t_final) = jit_both(
        steps(prefix, stacked, logits), steps(None, twin, twin_logits)
    )
    assert_same_logs(s_logs, t_logs, "qk_clip", (STEPS,))
    assert_series_end_in(s_logs, s_final, "stacked qk_clip")
    assert_series_end_in(t_logs, t_final, "twin qk_clip")
    assert any(np.any(as_float(v) > 0) for k, v in t_final.items() if "clipped" in k)
    chex.assert_trees_all_close(
        unroll(s_updates, prefix, stacked.a, cut_array(1)),
        t_updates,
        rtol=RTOL,
        atol=ATOL,
    )
