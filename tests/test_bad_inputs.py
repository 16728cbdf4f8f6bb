"""The bad-input catalogue: every public function, each bad input, one clear error.

Each case asserts the exception type and that the message names the argument
(in backticks) or the leaf (by path). After each error the inputs are
unchanged: NumPy inputs are made read-only, so that any write would raise, and
their values are compared with copies taken before the call.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import clipax


def _frozen(array: np.ndarray) -> np.ndarray:
    array = np.array(array)
    array.flags.writeable = False
    return array


def _tree() -> dict[str, Any]:
    return {"w": _frozen(np.arange(6.0).reshape(2, 3)), "b": _frozen(np.ones(3))}


def _init_update(tx: optax.GradientTransformation, tree: Any) -> Any:
    return tx.update(tree, tx.init(tree))


# (id, call taking the tree, exception type, pattern the message must contain)
CASES: list[tuple[str, Callable[[Any], Any], type[Exception], str]] = [
    # Norm thresholds: negative, zero, NaN, vector, wrong type.
    (
        "max_norm negative",
        lambda t: clipax.clip_by_global_norm(-1.0),
        ValueError,
        r"`max_norm`.*-1\.0",
    ),
    (
        "max_norm zero",
        lambda t: clipax.clip_by_global_norm(0.0),
        ValueError,
        r"`max_norm`.*0\.0",
    ),
    (
        "max_norm NaN",
        lambda t: clipax.clip_by_norm(math.nan),
        ValueError,
        r"`max_norm`.*nan",
    ),
    (
        "max_norm vector",
        lambda t: clipax.tree.clip_by_global_norm(t, np.ones(2)),
        ValueError,
        r"`max_norm`.*shape \(2,\)",
    ),
    (
        "max_norm string",
        lambda t: clipax.tree.clip_by_norm(t, "1"),
        TypeError,
        r"`max_norm`.*'1'",
    ),
    (
        "max_norm bool",
        lambda t: clipax.clip_by_global_norm(True),
        TypeError,
        r"`max_norm`.*True",
    ),
    (
        "max_norm complex",
        lambda t: clipax.clip_by_norm(1j),
        TypeError,
        r"`max_norm`.*complex",
    ),
    (
        "use_norm vector",
        lambda t: clipax.tree.clip_by_global_norm(t, 1.0, use_norm=np.ones(2)),
        ValueError,
        r"`use_norm`.*shape \(2,\)",
    ),
    (
        "use_norm negative",
        lambda t: clipax.tree.clip_by_global_norm(t, 1.0, use_norm=-3.0),
        ValueError,
        r"`use_norm`.*-3\.0",
    ),
    # ord
    (
        "ord 0",
        lambda t: clipax.clip_by_global_norm(1.0, ord=0),
        ValueError,
        r"`ord`.*got 0",
    ),
    (
        "ord -1",
        lambda t: clipax.tree.global_norm(t, ord=-1),
        ValueError,
        r"`ord`.*got -1",
    ),
    (
        "ord fro",
        lambda t: clipax.tree.clip_by_global_norm(t, 1.0, ord="fro"),
        ValueError,
        r"`ord`.*'fro'",
    ),
    ("ord 0.5", lambda t: clipax.autoclip(ord=0.5), ValueError, r"`ord`.*0\.5"),
    # Value bounds
    (
        "min > max",
        lambda t: clipax.clip_by_value(2.0, 1.0),
        ValueError,
        r"`min_value` must be <= `max_value`",
    ),
    (
        "min > max somewhere",
        lambda t: clipax.tree.clip_by_value(t, np.array([0.0, 5.0, 0.0]), 1.0),
        ValueError,
        r"`min_value` must be <= `max_value`",
    ),
    (
        "min NaN",
        lambda t: clipax.clip_by_value(math.nan, 1.0),
        ValueError,
        r"`min_value` must not be NaN",
    ),
    (
        "max_delta negative",
        lambda t: clipax.clip(-0.5),
        ValueError,
        r"`max_delta` must be >= 0.*-0\.5",
    ),
    (
        "max_delta string",
        lambda t: clipax.clip("big"),
        TypeError,
        r"`max_delta`.*'big'",
    ),
    (
        "max_delta list",
        lambda t: clipax.clip([1.0, 2.0]),
        TypeError,
        r"`max_delta` must be .*array.*got \[1\.0, 2\.0\] of type list",
    ),
    (
        "max_delta None",
        lambda t: clipax.clip(None),
        TypeError,
        r"`max_delta` must be .*got None",
    ),
    (
        "bounds do not broadcast",
        lambda t: clipax.tree.clip_by_value(t, np.zeros((4, 3)), 1.0),
        ValueError,
        r"broadcast to the leaf at \['b'\]",
    ),
    # axes
    (
        "axes duplicated",
        lambda t: clipax.clip_by_norm(1.0, axes=(1, 1)),
        ValueError,
        r"`axes`.*repeated",
    ),
    (
        "axes not ints",
        lambda t: clipax.tree.clip_by_norm(t, 1.0, axes="rows"),
        ValueError,
        r"`axes`.*'rows'",
    ),
    (
        "axes a 2-D array of ints",  # as inject_hyperparams would hand it on
        lambda t: clipax.clip_by_norm(1.0, axes=np.array([[0], [1]])),
        ValueError,
        r"`axes` must be None, an int, or a sequence of distinct ints; got array",
    ),
    (
        "axes out of range",
        lambda t: clipax.tree.clip_by_norm(t, 1.0, axes=1),
        ValueError,
        r"`axes`=\(1,\) is out of range for the leaf at \['b'\] with shape \(3,\)",
    ),
    (
        "axes same axis twice",
        lambda t: clipax.tree.clip_by_norm({"w": t["w"]}, 1.0, axes=(1, -1)),
        ValueError,
        r"names the same axis twice for the leaf at \['w'\] with shape \(2, 3\)",
    ),
    (
        "axes out of range at init",
        lambda t: clipax.clip_by_norm(1.0, axes=-3).init(t),
        ValueError,
        r"out of range for the leaf at \['b'\]",
    ),
    # Leaves: int, bool, Python lists, strings.
    (
        "int leaf",
        lambda t: clipax.tree.global_norm({**t, "i": _frozen(np.arange(3))}),
        TypeError,
        r"leaf at \['i'\] has dtype int64",
    ),
    (
        "bool leaf",
        lambda t: clipax.tree.clip_by_norm({**t, "m": _frozen(np.ones(2, bool))}, 1.0),
        TypeError,
        r"leaf at \['m'\] has dtype bool",
    ),
    (
        "int leaf at init",
        lambda t: clipax.clip_by_global_norm(1.0).init({"x": [t["w"], jnp.arange(2)]}),
        TypeError,
        r"leaf at \['x'\]\[1\] has dtype int32",
    ),
    # Python numbers are 0-d leaves (tests/test_inputs.py); ints have no norm.
    (
        "Python int in a list",
        lambda t: clipax.tree.global_norm({"w": [1.0, 2]}),
        TypeError,
        r"leaf at \['w'\]\[1\] has dtype int32",
    ),
    (
        "object in a transformation",
        lambda t: _init_update(clipax.clip_by_global_norm(1.0), {"w": [1.0, object()]}),
        TypeError,
        r"leaf at \['w'\]\[1\] is a object",
    ),
    (
        "string leaf",
        lambda t: clipax.tree.clip_by_global_norm({**t, "name": "dense"}, 1.0),
        TypeError,
        r"leaf at \['name'\] is a str",
    ),
    (
        "string array leaf",
        lambda t: clipax.tree.global_norm({"s": _frozen(np.array(["a", "b"]))}),
        TypeError,
        r"leaf at \['s'\] has dtype <U1",
    ),
    (
        "string leaf in value clipping",
        lambda t: clipax.tree.clip_by_value({"s": "x"}, 0.0, 1.0),
        TypeError,
        r"leaf at \['s'\] is a str",
    ),
    (
        "complex leaf in value clipping",
        lambda t: clipax.tree.clip_by_value(
            {"z": jnp.ones(2, jnp.complex64)}, 0.0, 1.0
        ),
        TypeError,
        r"leaf at \['z'\] has dtype complex64",
    ),
    # Other arguments
    (
        "nonfinite unknown",
        lambda t: clipax.clip_by_global_norm(1.0, nonfinite="skip"),
        ValueError,
        r"`nonfinite`.*'skip'",
    ),
    (
        "axis_name not a name",
        lambda t: clipax.tree.global_norm(t, axis_name=3),
        ValueError,
        r"`axis_name`.*3",
    ),
    (
        "axis_name with axes",
        lambda t: clipax.tree.clip_by_norm(t, 1.0, axes=0, axis_name="d"),
        ValueError,
        r"`axis_name`.*`axes`",
    ),
    (
        "specs missing a leaf",
        lambda t: clipax.tree.global_norm(t, specs={"w": P()}),
        ValueError,
        r"`specs` has no PartitionSpec for the leaf at \['b'\]",
    ),
    (
        "specs longer than rank",
        lambda t: clipax.tree.clip_by_norm(t, 1.0, specs={"w": P(), "b": P("a", "b")}),
        ValueError,
        r"`specs` gives .* to the leaf at \['b'\], which has rank 1",
    ),
    (
        "specs not PartitionSpecs",
        lambda t: clipax.tree.global_norm(t, specs={"w": P(), "b": ("x",)}),
        TypeError,
        r"`specs` must be a tree of jax.sharding.PartitionSpec",
    ),
    # The adaptive rules
    (
        "percentile above 100",
        lambda t: clipax.autoclip(150.0),
        ValueError,
        r"`percentile`.*150\.0",
    ),
    ("history zero", lambda t: clipax.autoclip(history=0), ValueError, r"`history`.*0"),
    (
        "alpha outside (0, 1)",
        lambda t: clipax.zclip(alpha=1.5),
        ValueError,
        r"`alpha`.*1\.5",
    ),
    (
        "mode unknown",
        lambda t: clipax.zclip(mode="median"),
        ValueError,
        r"`mode`.*'median'",
    ),
    (
        "warmup_steps zero",
        lambda t: clipax.zclip(warmup_steps=0),
        ValueError,
        r"`warmup_steps`.*0",
    ),
    (
        "zclip clip_option with mode std",
        lambda t: clipax.zclip(mode="std", clip_option="mean"),
        ValueError,
        r"`clip_option`.*'mean'",
    ),
    (
        "zclip clip_factor where it means nothing",
        lambda t: clipax.zclip(clip_option="mean", clip_factor=0.5),
        ValueError,
        r"`clip_factor`.*0\.5",
    ),
    (
        "zclip skip_update_on_spike not a bool",
        lambda t: clipax.zclip(skip_update_on_spike="yes"),
        TypeError,
        r"`skip_update_on_spike`.*'yes'",
    ),
    (
        "AGC clipping negative",
        lambda t: clipax.adaptive_grad_clip(-1.0),
        ValueError,
        r"`clipping`.*-1\.0",
    ),
    (
        "AGC without params",
        lambda t: clipax.adaptive_grad_clip(0.1).update(
            t, clipax.adaptive_grad_clip(0.1).init(t), None
        ),
        ValueError,
        r"`update` needs `params`",
    ),
    (
        "block RMS vector threshold",
        lambda t: clipax.clip_by_block_rms(np.ones(2)),
        ValueError,
        r"`threshold`.*shape \(2,\)",
    ),
    (
        "DP clip negative",
        lambda t: clipax.tree.per_example_global_norm_clip(t, -1.0),
        ValueError,
        r"`l2_norm_clip`.*-1\.0",
    ),
    (
        "DP ragged batch",
        lambda t: clipax.tree.per_example_global_norm_clip(t, 1.0),
        ValueError,
        r"the leaf at \['w'\] has shape \(2, 3\)",
    ),
    # Peers' calls: a name with its alias, an ignored argument of the wrong kind.
    (
        "max_norm and its alias clip_norm",
        lambda t: clipax.tree.clip_by_global_norm(t, 1.0, clip_norm=2.0),
        TypeError,
        r"`max_norm` and `clip_norm`",
    ),
    (
        "squared not a bool",
        lambda t: clipax.tree.global_norm(t, 2, "yes"),
        TypeError,
        r"`squared` must be True or False; got 'yes'",
    ),
    # A transformation given the tree its `clipax.tree` namesake takes.
    (
        "transformation called like the tree function",
        lambda t: clipax.clip_by_global_norm(t, 1.0),
        TypeError,
        r"(?s)`clipax.clip_by_global_norm` makes an Optax transformation.*"
        r"clipax.tree.clip_by_global_norm\(tree, max_norm\)",
    ),
    (
        "clip_by_norm called like the tree function",
        lambda t: clipax.clip_by_norm(t, 1.0),
        TypeError,
        r"(?s)clipax.tree.clip_by_norm\(tree, max_norm\)",
    ),
    (
        "clip_by_value called like the tree function",
        lambda t: clipax.clip_by_value(t, -1.0, 1.0),
        TypeError,
        r"(?s)`min_value` is a number; got a tree.*clipax.tree.clip_by_value",
    ),
    (
        "clip called with a list of arrays",
        lambda t: clipax.clip([t["w"], t["b"]]),
        TypeError,
        r"(?s)`clipax.clip` makes an Optax transformation.*clipax.tree.clip_by_value",
    ),
    # Updates that are not the tree a stateful rule was initialised with.
    (
        "adagc with an extra leaf",
        lambda t: clipax.adagc().update({**t, "c": np.ones(2)}, clipax.adagc().init(t)),
        ValueError,
        r"`adagc` was initialised for another tree: the updates have a leaf at "
        r"\['c'\] that the state holds no entry for",
    ),
    (
        "adagc with a leaf missing",
        lambda t: clipax.adagc().update({"w": t["w"]}, clipax.adagc().init(t)),
        ValueError,
        r"`adagc` was initialised for another tree: the updates have no leaf at "
        r"\['b'\], which the state holds",
    ),
    (
        "adagc with a renamed leaf",
        lambda t: clipax.adagc().update(
            {"w": t["w"], "v": t["b"]}, clipax.adagc().init(t)
        ),
        ValueError,
        r"the updates have a leaf at \['v'\] where the state expected the leaf at "
        r"\['b'\]",
    ),
    (
        "adagc with a list for a dict",
        lambda t: clipax.adagc().update([t["b"], t["w"]], clipax.adagc().init(t)),
        ValueError,
        r"the updates have a leaf at \[0\] where the state expected the leaf at "
        r"\['b'\]",
    ),
    (
        "clip_by_norm with an extra leaf",
        lambda t: clipax.clip_by_norm(1.0).update(
            {**t, "c": np.ones(2)}, clipax.clip_by_norm(1.0).init(t)
        ),
        ValueError,
        r"`clip_by_norm` was initialised for another tree.*\['c'\]",
    ),
    # What is not an optimizer state, or a group that holds no leaf.
    (
        "metrics of a transformation",
        lambda t: clipax.metrics(clipax.clip_by_global_norm(1.0)),
        TypeError,
        r"`clipax.metrics` takes an optimizer state.*a transformation",
    ),
    (
        "metrics of a string",
        lambda t: clipax.metrics("opt_state"),
        TypeError,
        r"`clipax.metrics` takes an optimizer state.*holds a str",
    ),
    (
        "metrics of a number",
        lambda t: clipax.metrics(3.0),
        TypeError,
        r"`clipax.metrics` takes an optimizer state.*holds a float",
    ),
    (
        "metrics of the parameters",
        lambda t: clipax.metrics(t),
        TypeError,
        r"`clipax.metrics` takes an optimizer state.*no optimizer state in it",
    ),
    (
        "group_norms prefix matching no leaf",
        lambda t: clipax.tree.group_norms(t, prefixes=["encoder"]),
        ValueError,
        r"`prefixes` entry 'encoder' matches no leaf of the tree, whose paths "
        r"start with \['b', 'w'\]",
    ),
    # Stateless rules check the params at init.
    (
        "AGC int param at init",
        lambda t: clipax.adaptive_grad_clip(0.1).init({**t, "i": np.arange(2)}),
        TypeError,
        r"`adaptive_grad_clip`.*\['i'\] has dtype int64",
    ),
    (
        "block RMS int param at init",
        lambda t: clipax.clip_by_block_rms(1.0).init({**t, "i": np.arange(2)}),
        TypeError,
        r"`clip_by_block_rms`.*\['i'\] has dtype int64",
    ),
    # Data (JAX arrays) where a number belongs: the dtype and shape are checked.
    (
        "max_norm a bool array",
        lambda t: clipax.clip_by_global_norm(jnp.asarray(True)),
        TypeError,
        r"`max_norm` must be .*; got an array of dtype bool",
    ),
    (
        "max_norm a vector array",
        lambda t: clipax.tree.clip_by_norm(t, jnp.ones(2)),
        ValueError,
        r"`max_norm` must be .*; got an array of shape \(2,\)",
    ),
    (
        "zclip unknown mode",
        lambda t: clipax.zclip(mode="mad"),
        ValueError,
        r'`mode` must be "adaptive", "std", "zscore" or "percentile"; got \'mad\'',
    ),
    (
        "zclip z_thresh with z_threshold",
        lambda t: clipax.zclip(z_thresh=2.0, z_threshold=3.0),
        TypeError,
        r"`z_threshold` and `z_thresh`",
    ),
    (
        "zclip eps zero",
        lambda t: clipax.zclip(eps=0.0),
        ValueError,
        r"`eps` must be a finite real number > 0; got 0.0",
    ),
    (
        "zclip max_grad_norm zero",
        lambda t: clipax.zclip(max_grad_norm=0.0),
        ValueError,
        r"`max_grad_norm` must be a positive scalar",
    ),
    # `stacked`: a prefix of the updates, an int from 0 to each leaf's rank.
    (
        "stacked not a prefix: a leaf without an entry",
        lambda t: clipax.adagc(stacked={"w": 1}).init(t),
        ValueError,
        r"`stacked` has no entry for the leaf at \['b'\] \(shape \(3,\)\)",
    ),
    (
        "stacked not a prefix: an entry without a node",
        lambda t: clipax.clip_by_norm(1.0, stacked={"w": 1, "b": 0, "c": 1}).init(t),
        ValueError,
        r"`stacked` holds an entry at \['c'\], where the updates have no node",
    ),
    (
        "stacked negative",
        lambda t: clipax.clip_by_block_rms(1.0, stacked={"w": -1, "b": 0}).init(t),
        ValueError,
        r"`stacked` gives -1 stacked axes to the leaf at \['w'\] with shape \(2, 3\)",
    ),
    (
        "stacked more axes than the leaf has",
        lambda t: clipax.adaptive_grad_clip(0.1, stacked={"w": 1, "b": 2}).init(t),
        ValueError,
        r"`stacked` gives 2 stacked axes to the leaf at \['b'\] with shape \(3,\): "
        r"an int from 0 to its rank, 1",
    ),
    (
        "stacked not an int",
        lambda t: clipax.tree.clip_by_norm(t, 1.0, stacked={"w": "layers", "b": 0}),
        TypeError,
        r"`stacked` must be .*; at \['w'\] it holds 'layers'",
    ),
    (
        "stacked callable giving a bool",
        lambda t: clipax.tree.group_norms(t, stacked=lambda u: {"w": True, "b": 0}),
        TypeError,
        r"`stacked` must be .*; at \['w'\] it holds True",
    ),
    (
        "stacked with axis_name",
        lambda t: clipax.adagc(stacked={"w": 1, "b": 0}, axis_name="d"),
        ValueError,
        r"`axis_name` cannot be combined with `stacked`",
    ),
    (
        "stacked per-example: the batch axis is not a layer axis",
        lambda t: clipax.tree.per_example_layer_norm_clip(
            {"w": t["w"]}, 1.0, stacked={"w": 2}
        ),
        ValueError,
        r"whose first axis is the batch: at most 1",
    ),
    (
        "stacked updates with another number of layers",
        lambda t: clipax.adagc(stacked={"w": 1, "b": 0}).update(
            {"w": np.ones((4, 3)), "b": t["b"]},
            clipax.adagc(stacked={"w": 1, "b": 0}).init(t),
        ),
        ValueError,
        r"the leaf at \['w'\] has shape \(4, 3\), and the state holds statistics "
        r"of shape \(2,\) for it, where this shape needs \(4,\)",
    ),
    (
        "stacked_prefix without a mode",
        lambda t: clipax.stacked_prefix(t),
        ValueError,
        r"Give `axis_name` or `path`",
    ),
    (
        "stacked_prefix path not a pattern",
        lambda t: clipax.stacked_prefix(t, path="blocks/["),
        ValueError,
        r"`path` must be a regular expression; got 'blocks/\['",
    ),
    (
        "stacked_prefix axes empty",
        lambda t: clipax.stacked_prefix(t, path="w", axes=()),
        ValueError,
        r"`axes` must be an int >= 0; got \(\)",
    ),
    (
        "stacked_prefix axis_name not a name",
        lambda t: clipax.stacked_prefix(t, axis_name=""),
        ValueError,
        r"`axis_name` must be a logical axis name; got ''",
    ),
    (
        "stacked before another stacking",
        lambda t: clipax.clip_by_norm(1.0, stacked={"m": {"w": 1}}).update(
            {"m": {"w": t["w"]}},
            clipax.clip_by_norm(1.0, stacked={"m": 1}).init({"m": {"w": t["w"]}}),
        ),
        ValueError,
        r"initialised with another `stacked=`",
    ),
    (
        "global_norm nonfinite unknown",
        lambda t: clipax.tree.global_norm(t, nonfinite="zero"),
        ValueError,
        r"`nonfinite` must be one of \(None, 'error'\), .*False None\); got 'zero'",
    ),
]


def test_the_catalogue_is_large() -> None:
    assert len(CASES) >= 30


@pytest.mark.parametrize(
    ("call", "error", "pattern"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_input(
    call: Callable[[Any], Any], error: type[Exception], pattern: str
) -> None:
    tree = _tree()
    before = jax.tree.map(np.copy, tree)
    with pytest.raises(error, match=pattern):
        call(tree)
    for got, expected in zip(
        jax.tree.leaves(tree), jax.tree.leaves(before), strict=True
    ):
        assert not got.flags.writeable
        np.testing.assert_array_equal(got, expected)


def test_numpy_inputs_are_never_written() -> None:
    tree = _tree()
    before = jax.tree.map(np.copy, tree)
    for tx in (
        clipax.clip_by_global_norm(1.0),
        clipax.clip_by_norm(1.0, axes=0),
        clipax.clip(0.5),
        clipax.autoclip(),
        clipax.zclip(warmup_steps=1),
    ):
        _init_update(tx, tree)
        jax.jit(tx.update)(tree, tx.init(tree))
    clipax.tree.clip_by_global_norm(tree, 1.0)
    clipax.tree.clip_by_norm(tree, 1.0)
    clipax.tree.clip_by_value(tree, 0.0, 1.0)
    for got, expected in zip(
        jax.tree.leaves(tree), jax.tree.leaves(before), strict=True
    ):
        np.testing.assert_array_equal(got, expected)


# Float8 and narrower floats: JAX does not promote them to float32 in arithmetic.
NARROW_FLOAT_CALLS: dict[str, Callable[[Any], Any]] = {
    "global_norm": clipax.tree.global_norm,
    "clip_by_global_norm": lambda t: clipax.tree.clip_by_global_norm(t, 1.0),
    "clip_by_global_norm jit": lambda t: jax.jit(clipax.tree.clip_by_global_norm)(
        t, 1.0
    ),
    "clip_by_norm": lambda t: clipax.tree.clip_by_norm(t, 1.0, axes=0),
    "group_norms": clipax.tree.group_norms,
    "per_example_global_norm_clip": lambda t: clipax.tree.per_example_global_norm_clip(
        t, 1.0
    ),
    "clip_by_global_norm transformation": lambda t: _init_update(
        clipax.clip_by_global_norm(1.0), t
    ),
    "clip_by_norm transformation": lambda t: _init_update(clipax.clip_by_norm(1.0), t),
    "adagc": lambda t: _init_update(clipax.adagc(), t),
    "zclip": lambda t: _init_update(clipax.zclip(), t),
    "clip_by_block_rms": lambda t: _init_update(clipax.clip_by_block_rms(1.0), t),
}


@pytest.mark.parametrize(
    "dtype",
    [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float4_e2m1fn],
    ids=lambda d: np.dtype(d).name,
)
@pytest.mark.parametrize(
    "call", list(NARROW_FLOAT_CALLS.values()), ids=list(NARROW_FLOAT_CALLS)
)
def test_float8_leaves_are_rejected_by_path(
    call: Callable[[Any], Any], dtype: Any
) -> None:
    tree = {"w": jnp.ones((2, 3)), "q": jnp.ones((2, 3), dtype)}
    name = np.dtype(dtype).name
    with pytest.raises(
        TypeError,
        match=rf"float16, bfloat16, float32, float64 or complex leaves; the leaf "
        rf"at \['q'\] has dtype {name}",
    ):
        call(tree)


def test_a_value_shown_in_an_error_is_cut_past_60_characters() -> None:
    tree = {"w": jnp.ones(2)}
    with pytest.raises(TypeError) as whole:
        clipax.tree.global_norm(tree, squared="x" * 58)  # its repr: 60 characters
    assert str(whole.value).endswith(f"got {'x' * 58!r}.")
    with pytest.raises(TypeError) as cut:
        clipax.tree.global_norm(tree, squared="x" * 59)  # 61: 57 of them, then ...
    assert str(cut.value).endswith(f"got {repr('x' * 59)[:57]}....")
