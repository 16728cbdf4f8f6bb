"""Every layout the trainers use: the layer axis anywhere, and never silent.

A MaxText-shaped tree (the layer axis second, `param_scan_axis: 1`) runs every
per-tensor rule against the same values unrolled; `stacked_prefix` reads the
layer axis's position from linen's and NNX's logical names; a prefix that
matches nothing, or leaves of one stack with other layer counts, are errors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import chex
import equinox as eqx
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

L = 4
# MaxText's layout: the layers on axis 1 of every scanned parameter.
SHAPES = {
    "decoder": {
        "layers": {
            "attn": {"kernel": (8, L, 12)},
            "mlp": {"wi": (8, L, 16), "wo": (16, L, 8)},
            "norm": {"scale": (8, L)},
        },
        "final_norm": {"scale": (8,)},
    },
    "token_embedder": {"embedding": (32, 8)},
}
STACKED = {
    "decoder": {"layers": clipax.LayerAxes(1), "final_norm": 0},
    "token_embedder": 0,
}


def maxtext_tree(seed: int, spike: tuple[int, float] | None = None) -> dict:
    """Random values in MaxText's layout; `spike` multiplies one layer of the
    attention kernel."""
    rng = np.random.default_rng(seed)
    tree = jax.tree.map(
        lambda s: jnp.asarray(rng.normal(size=s).astype(np.float32)),
        SHAPES,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    if spike is not None:
        layer, factor = spike
        kernel = tree["decoder"]["layers"]["attn"]["kernel"]
        tree["decoder"]["layers"]["attn"]["kernel"] = kernel.at[:, layer].multiply(
            factor
        )
    return tree


def unrolled(tree: dict) -> dict:
    """The same values with each layer a subtree of its own."""
    layers = tree["decoder"]["layers"]
    each = [jax.tree.map(lambda x, i=i: x[:, i], layers) for i in range(L)]
    return {**tree, "decoder": {**tree["decoder"], "layers": each}}


def restacked(tree: dict) -> dict:
    """`unrolled`'s inverse."""
    layers = jax.tree.map(lambda *xs: jnp.stack(xs, 1), *tree["decoder"]["layers"])
    return {**tree, "decoder": {**tree["decoder"], "layers": layers}}


def assert_same_logs(got_state: Any, want_state: Any) -> None:
    got, want = clipax.metrics(got_state), clipax.metrics(want_state)
    assert list(got) == list(want)  # the same keys, in the same order
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-6, err_msg=key)


RULES: dict[str, Callable[..., optax.GradientTransformation]] = {
    "clip_by_norm": lambda **kw: clipax.clip_by_norm(1.5, **kw),
    "clip_by_norm axes=-1": lambda **kw: clipax.clip_by_norm(0.5, axes=-1, **kw),
    "clip_by_norm axes=0": lambda **kw: clipax.clip_by_norm(0.5, axes=0, **kw),
    "adaptive_grad_clip": lambda **kw: clipax.adaptive_grad_clip(0.05, **kw),
    "clip_by_block_rms": lambda **kw: clipax.clip_by_block_rms(0.3, **kw),
    "adagc": lambda **kw: clipax.adagc(warmup_steps=3, max_norm=5.0, **kw),
    "stable_spam": lambda **kw: clipax.stable_spam(
        optax.adam(1e-2), reset_every=4, **kw
    ),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_layer_axis_second_equals_the_unrolled_model(rule: str) -> None:
    stacked_tx, unrolled_tx = RULES[rule](stacked=STACKED), RULES[rule]()
    params = maxtext_tree(100)
    s_state = stacked_tx.init(params)
    u_state = unrolled_tx.init(unrolled(params))
    s_update, u_update = jax.jit(stacked_tx.update), jax.jit(unrolled_tx.update)
    for step in range(8):
        grads = maxtext_tree(step, spike=(1, 30.0) if step == 6 else None)
        got, s_state = s_update(grads, s_state, params)
        want, u_state = u_update(unrolled(grads), u_state, unrolled(params))
        chex.assert_trees_all_close(got, restacked(want), rtol=2e-6, atol=1e-7)
        assert_same_logs(s_state, u_state)


@pytest.mark.parametrize("kwargs", [{}, {"depth": 3}, {"depth": 4}, {"ord": 1}])
def test_group_norms_and_per_example_clip_with_the_layer_axis_second(
    kwargs: dict,
) -> None:
    grads = maxtext_tree(3)
    got = jax.jit(lambda g: clipax.tree.group_norms(g, stacked=STACKED, **kwargs))(
        grads
    )
    want = clipax.tree.group_norms(unrolled(grads), **kwargs)
    assert list(got) == list(want)
    chex.assert_trees_all_close(dict(got), dict(want), rtol=2e-6)
    # Per example: the batch first, then the parameter's axes (layers at 1).
    batch = jax.tree.map(lambda x: jnp.stack([x, 2 * x, -x]), grads)
    summed, clipped = clipax.tree.per_example_layer_norm_clip(
        batch, 3.0, stacked=STACKED
    )
    per_layer = jax.tree.map(lambda x: jnp.stack([x, 2 * x, -x]), unrolled(grads))
    want_summed, want_clipped = clipax.tree.per_example_layer_norm_clip(per_layer, 3.0)
    chex.assert_trees_all_close(summed, restacked(want_summed), rtol=2e-6)
    assert clipped["decoder"]["layers"]["mlp"]["wi"].shape == (L,)
    np.testing.assert_array_equal(
        clipped["decoder"]["layers"]["mlp"]["wi"],
        [c["mlp"]["wi"] for c in want_clipped["decoder"]["layers"]],
    )


def _layer_split(x: jax.Array) -> P:
    return P(None, "d") if x.ndim >= 2 and x.shape[1] == L else P()


def _inner_split(x: jax.Array) -> P:
    return P("d") if x.shape[0] % 4 == 0 else P()


@pytest.mark.devices(4)
@pytest.mark.parametrize("split", [_layer_split, _inner_split], ids=["layers", "inner"])
@pytest.mark.parametrize("rule", ["clip_by_norm axes=-1", "adagc"])
def test_sharded_with_the_layer_axis_second_equals_one_device(
    rule: str, split: Any
) -> None:
    mesh = jax.make_mesh((4,), ("d",))
    tx = RULES[rule](stacked=STACKED)
    update = jax.jit(tx.update)
    state = tx.init(maxtext_tree(0))
    place = lambda t: jax.tree.map(  # noqa: E731
        lambda x: jax.device_put(x, NamedSharding(mesh, split(x))), t
    )
    sharded_state = tx.init(place(maxtext_tree(0)))
    for step in range(4):
        grads = maxtext_tree(step, spike=(2, 20.0) if step == 3 else None)
        want, state = update(grads, state)
        got, sharded_state = update(place(grads), sharded_state)
        chex.assert_trees_all_close(got, want, rtol=2e-6, atol=1e-7)
    assert_same_logs(sharded_state, state)


@pytest.mark.devices(4)
def test_shard_map_with_specs_and_the_layer_axis_second() -> None:
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    specs = jax.tree.map(
        lambda s: P("d") if s[0] % 4 == 0 else P(),
        SHAPES,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    tx = clipax.adagc(warmup_steps=2, max_norm=5.0, stacked=STACKED, specs=specs)
    one = clipax.adagc(warmup_steps=2, max_norm=5.0, stacked=STACKED)
    state, one_state = tx.init(maxtext_tree(0)), one.init(maxtext_tree(0))
    state_specs = jax.tree.map(lambda _: P(), state)
    update = jax.jit(
        jax.shard_map(
            tx.update,
            mesh=mesh,
            in_specs=(specs, state_specs),
            out_specs=(specs, state_specs),
        )
    )
    place = lambda t, s: jax.tree.map(  # noqa: E731
        lambda x, p: jax.device_put(x, NamedSharding(mesh, p)), t, s
    )
    state = place(state, state_specs)
    for step in range(4):
        grads = maxtext_tree(step, spike=(0, 20.0) if step == 3 else None)
        want, one_state = one.update(grads, one_state)
        got, state = update(place(grads, specs), state)
        chex.assert_trees_all_close(got, want, rtol=2e-6, atol=1e-7)
    assert_same_logs(state, one_state)
    norms = jax.jit(
        jax.shard_map(
            lambda g: clipax.tree.group_norms(g, depth=3, stacked=STACKED, specs=specs),
            mesh=mesh,
            in_specs=(specs,),
            out_specs=P(),
        )
    )(place(maxtext_tree(5), specs))
    want = clipax.tree.group_norms(maxtext_tree(5), depth=3, stacked=STACKED)
    chex.assert_trees_all_close(dict(norms), dict(want), rtol=2e-6)


# Flax linen: `nn.scan(variable_axes={"params": 1})`, MaxText's default.


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, _: None = None) -> tuple[jax.Array, None]:
        dense = lambda n, names: nn.Dense(  # noqa: E731
            n,
            kernel_init=nn.with_logical_partitioning(
                nn.initializers.lecun_normal(), names
            ),
        )
        return x + dense(8, ("mlp", "embed"))(
            nn.gelu(dense(16, ("embed", "mlp"))(x))
        ), None


class _ScannedOnAxis1(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Dense(8, name="embed")(x)
        blocks = nn.scan(
            _Block,
            variable_axes={"params": 1},
            split_rngs={"params": True},
            length=L,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        return nn.Dense(3, name="head")(blocks(name="blocks")(x, None)[0])


class _Unrolled(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Dense(8, name="embed")(x)
        for i in range(L):
            x, _ = _Block(name=f"block_{i}")(x)
        return nn.Dense(3, name="head")(x)


def test_stacked_prefix_reads_the_layer_axis_position_from_linen_names() -> None:
    boxed = _ScannedOnAxis1().init(jax.random.key(0), jnp.ones((2, 4)))
    prefix = clipax.stacked_prefix(boxed, axis_name="layers")
    # The biases carry no names: they take their kernels' position.
    assert prefix == {"params": {"blocks": clipax.LayerAxes(1), "embed": 0, "head": 0}}
    params = nn.unbox(boxed)
    assert clipax.stacked_prefix(params, path="^params/blocks/", axes=(1,)) == prefix


def test_nn_scan_on_axis_1_trains_as_its_unrolled_twin() -> None:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(16, 4)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 3, size=16))
    boxed = _ScannedOnAxis1().init(jax.random.key(0), x)
    prefix = clipax.stacked_prefix(boxed, axis_name="layers")
    s_params = nn.unbox(boxed)
    blocks = s_params["params"]["blocks"]
    u_params = {
        "params": {
            **{k: v for k, v in s_params["params"].items() if k != "blocks"},
            **{
                f"block_{i}": jax.tree.map(lambda a, i=i: a.take(i, axis=1), blocks)
                for i in range(L)
            },
        }
    }

    def make(stacked: Any) -> optax.GradientTransformation:
        return optax.chain(
            clipax.adagc(warmup_steps=2, max_norm=0.5, alpha=0.9, stacked=stacked),
            clipax.clip_by_norm(0.3, stacked=stacked),
            optax.adamw(1e-2),
        )

    def trainer(model: nn.Module, stacked: Any) -> Any:
        tx = make(stacked)

        @jax.jit
        def step(params: Any, state: Any, inputs: jax.Array) -> tuple:
            def loss_fn(p: Any) -> jax.Array:
                logits = model.apply(p, inputs)
                return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss, grads

        return step

    s_step, u_step = trainer(_ScannedOnAxis1(), prefix), trainer(_Unrolled(), None)
    s_state, u_state = make(prefix).init(s_params), make(None).init(u_params)
    for step in range(6):
        inputs = x * (25.0 if step == 4 else 1.0)  # a spike at step 4
        s_params, s_state, s_loss, s_grads = s_step(s_params, s_state, inputs)
        u_params, u_state, u_loss, u_grads = u_step(u_params, u_state, inputs)
        np.testing.assert_allclose(s_loss, u_loss, rtol=1e-5)
    np.testing.assert_allclose(
        s_params["params"]["blocks"]["Dense_0"]["kernel"][:, 1],
        u_params["params"]["block_1"]["Dense_0"]["kernel"],
        rtol=1e-4,
        atol=1e-6,
    )
    logs = clipax.metrics(s_state)
    assert "adagc/params/blocks/2/Dense_1/kernel/ema" in logs
    s_norms = clipax.tree.group_norms(s_grads, depth=4, stacked=prefix)
    u_norms = clipax.tree.group_norms(u_grads, depth=3)
    for i in range(L):
        np.testing.assert_allclose(
            s_norms[f"params/blocks/{i}/Dense_0/norm"],
            u_norms[f"params/block_{i}/Dense_0/norm"],
            rtol=1e-5,
        )


# Flax NNX: `nnx.vmap` with `transform_metadata` names the layer axis.


class _NNXBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
        self.linear = nnx.Linear(4, 4, kernel_init=init, rngs=rngs)


def test_stacked_prefix_reads_nnx_sharding_names() -> None:
    @nnx.split_rngs(splits=L)
    @nnx.vmap(
        in_axes=(0,), out_axes=1, transform_metadata={nnx.PARTITION_NAME: "layers"}
    )
    def make(rngs: nnx.Rngs) -> _NNXBlock:
        return _NNXBlock(rngs)

    # Flax 0.12 shards named variables when they are made: off where it can be
    # turned off, else under a mesh with those names (Flax 0.12.0).
    eager = getattr(nnx, "use_eager_sharding", None)
    names = ("embed", "layers", "mlp")
    with eager(False) if eager else jax.set_mesh(jax.make_mesh((1, 1, 1), names)):
        blocks = make(nnx.Rngs(0))
    state = nnx.state(blocks)
    prefix = clipax.stacked_prefix(state, axis_name="layers")
    assert prefix == {"linear": clipax.LayerAxes(1)}
    assert state["linear"]["kernel"].shape == (4, L, 4)
    tx = clipax.clip_by_norm(1.0, stacked=prefix)
    norms = tx.init(state).norms  # nnx variables are read as their values
    assert norms["linear"]["kernel"].shape == norms["linear"]["bias"].shape == (L,)


# Never silent.


def test_an_axis_name_no_leaf_has_names_those_found() -> None:
    boxed = _ScannedOnAxis1().init(jax.random.key(0), jnp.ones((2, 4)))
    with pytest.raises(ValueError, match=r"'layer'.*\['embed', 'layers', 'mlp'\]"):
        clipax.stacked_prefix(boxed, axis_name="layer")
    with pytest.raises(ValueError, match=r"carry no names.*pass the boxed"):
        clipax.stacked_prefix(nn.unbox(boxed), axis_name="layers")


class _PlainNormBlock(nn.Module):
    """A scanned block whose LayerNorm carries no logical names."""

    @nn.compact
    def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("a", "b"))
        return nn.LayerNorm()(nn.Dense(4, kernel_init=init)(x)), None


class _PlainNormModel(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Dense(4, name="embed")(x)
        blocks = nn.scan(
            _PlainNormBlock,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=L,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        return blocks(name="blocks")(x, None)[0]


def test_a_leaf_without_names_in_a_scan_is_never_silently_unstacked() -> None:
    boxed = _PlainNormModel().init(jax.random.key(0), jnp.ones((2, 5)))
    with pytest.raises(
        ValueError,
        match=r"under 'params/blocks'.*LayerNorm_0/bias, params/blocks/LayerNorm_0/"
        r"scale carry no logical axis names.*Annotate them.*give `path=`",
    ):
        clipax.stacked_prefix(boxed, axis_name="layers")
    # The fix `path=`: every leaf under the scanned module is stacked.
    params = nn.unbox(boxed)
    by_path = clipax.stacked_prefix(params, path="^params/blocks/")
    assert by_path == {"params": {"blocks": 1, "embed": 0}}
    scale = params["params"]["blocks"]["LayerNorm_0"]["scale"]
    norms = clipax.clip_by_norm(1.0, stacked=by_path).init(params).norms
    assert norms["params"]["blocks"]["LayerNorm_0"]["scale"].shape == (L,)
    assert scale.shape == (L, 4)


def test_a_path_that_matches_nothing_names_a_few_paths() -> None:
    with pytest.raises(
        ValueError, match=r"`path`='\^blocks/' matches no leaf.*'decoder/layers"
    ):
        clipax.stacked_prefix(maxtext_tree(0), path="^blocks/")


@pytest.mark.parametrize(
    ("stacked", "error", "match"),
    [
        ({"w": -1, "b": 0}, ValueError, r"an int from 0 to its rank.*LayerAxes"),
        ({"w": clipax.LayerAxes(2), "b": 0}, ValueError, r"LayerAxes\(2\).*rank, 2"),
        ((1,), ValueError, r"`stacked` has no entry.*A tuple .* `clipax.LayerAxes"),
    ],
    ids=["negative", "out of range", "a tuple"],
)
def test_a_wrong_prefix_is_an_error(stacked: Any, error: type, match: str) -> None:
    tree = {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}
    for tx in (
        clipax.adagc(stacked=stacked),
        clipax.clip_by_norm(1.0, stacked=stacked),
    ):
        with pytest.raises(error, match=match):
            tx.init(tree)
    one_stack = {"blocks": {"a": jnp.ones((3, 2)), "b": jnp.ones((4, 2))}}
    with pytest.raises(
        ValueError,
        match=r"\['blocks'\]\['a'\] and \['blocks'\]\['b'\] one stack.*"
        r"\(3,\) and \(4,\) layers",
    ):
        clipax.adagc(stacked={"blocks": 1}).init(one_stack)
    # A whole tree's entry is one per top-level child: each its own count.
    state = clipax.adagc(stacked=1).init(one_stack["blocks"])
    assert state.ema["a"].shape == (3,) and state.ema["b"].shape == (4,)


def test_layer_axes_takes_ints() -> None:
    with pytest.raises(TypeError, match=r"`LayerAxes` takes one or more ints"):
        clipax.LayerAxes((1,))
    assert repr(clipax.LayerAxes(1, 2)) == "LayerAxes(1, 2)"


# Where the layer index goes: right after the node of the `stacked=` entry.


def test_the_layer_index_goes_after_the_entrys_node() -> None:
    grads = {
        "blocks": {"w": jnp.ones((3, 2, 2)), "b": jnp.ones((3, 2))},
        "head": jnp.ones(2),
    }
    keys = {}
    for name, stacked in {
        "at the module": {"blocks": 1, "head": 0},
        "from stacked_prefix": lambda u: clipax.stacked_prefix(u, path="^blocks/"),
        "at each leaf": {"blocks": {"w": 1, "b": 1}, "head": 0},
    }.items():
        tx = clipax.adagc(warmup_steps=1, stacked=stacked)
        _, state = tx.update(grads, tx.init(grads))
        keys[name] = [k for k in clipax.metrics(state) if k.endswith("/ema")]
    assert keys["at the module"] == keys["from stacked_prefix"]
    assert keys["at the module"][:2] == ["adagc/blocks/0/b/ema", "adagc/blocks/0/w/ema"]
    assert keys["at each leaf"][:2] == ["adagc/blocks/b/0/ema", "adagc/blocks/b/1/ema"]
    # A whole tree's entry is one for each top-level child.
    norms = clipax.tree.group_norms(grads["blocks"], depth=2, stacked=1)
    assert list(norms) == [f"b/{i}/norm" for i in range(3)] + [
        f"w/{i}/norm" for i in range(3)
    ]


def _t5(enc_layers: int = 3, dec_layers: int = 3) -> dict:
    """A T5-shaped tree: the encoder's and decoder's scans are `params`' only
    children."""
    rng = np.random.default_rng(0)

    def block(n: int, scale: float) -> dict:
        return {
            "attn": {"kernel": jnp.asarray(rng.normal(size=(n, 6, 6)) * scale)},
            "mlp": {"kernel": jnp.asarray(rng.normal(size=(n, 6, 8)) * scale)},
        }

    return {
        "params": {
            "encoder": {"layers": block(enc_layers, 5.0)},
            "decoder": {"layers": block(dec_layers, 3.0)},
        }
    }


T5_STACKED = {"params": {"encoder": {"layers": 1}, "decoder": {"layers": 1}}}


def test_two_stacks_that_are_a_parents_only_children_stay_two() -> None:
    grads = _t5()
    norms = clipax.tree.group_norms(grads, depth=4, stacked=T5_STACKED)
    for part in ("encoder", "decoder"):
        layers = grads["params"][part]["layers"]
        for i in range(3):
            want = np.sqrt(
                sum(np.sum(np.square(x[i])) for x in jax.tree.leaves(layers))
            )
            np.testing.assert_allclose(
                norms[f"params/{part}/layers/{i}/norm"], want, rtol=1e-6
            )
    by_prefix = clipax.tree.group_norms(
        grads, prefixes=["params/encoder"], stacked=T5_STACKED
    )
    np.testing.assert_allclose(
        by_prefix["params/encoder/norm"],
        clipax.tree.global_norm(grads["params"]["encoder"]),
        rtol=1e-6,
    )
    for spelling in (
        "^params/(encoder|decoder)/layers/",
        "^params/[a-z]+coder/layers",
    ):
        assert clipax.stacked_prefix(grads, path=spelling) == T5_STACKED


def _ema_keys(grads: Any, stacked: Any, wrap: Any = None) -> list[str]:
    tx = clipax.adagc(warmup_steps=0, stacked=stacked)
    tx = tx if wrap is None else wrap(tx)
    _, state = tx.update(grads, tx.init(grads))
    return [k for k in clipax.metrics(state) if k.endswith("/ema")]


def test_a_stacks_keys_depend_on_its_entry_alone() -> None:
    grads = _t5()
    keys = _ema_keys(grads, T5_STACKED)
    encoder = [k for k in keys if "/encoder/" in k]
    assert encoder[0] == "adagc/params/encoder/layers/0/attn/kernel/ema"
    # A sibling leaf beside the stacks.
    grads_more = {"params": {**grads["params"], "embed": jnp.ones((5, 6))}}
    stacked_more = {"params": {**T5_STACKED["params"], "embed": 0}}
    assert [
        k for k in _ema_keys(grads_more, stacked_more) if "/encoder/" in k
    ] == encoder
    # The decoder masked by `optax.masked`.
    mask = {"params": {"encoder": True, "decoder": False}}
    masked = _ema_keys(grads, T5_STACKED, lambda tx: optax.masked(tx, mask))
    assert masked == encoder
    # Other layer counts: the same places.
    uneven = _ema_keys(_t5(3, 5), T5_STACKED)
    assert [k for k in uneven if "/encoder/" in k] == encoder
    assert "adagc/params/decoder/layers/4/mlp/kernel/ema" in uneven


# Equinox: the prefix as `stacked_prefix` returns it (a module), and None fields.


class _Layer(eqx.Module):
    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, key: jax.Array) -> None:
        self.linear = eqx.nn.Linear(4, 4, key=key)
        self.dropout = eqx.nn.Dropout(0.1)


class _Model(eqx.Module):
    layers: _Layer
    head: eqx.nn.Linear

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(x)


def test_equinox_prefix_works_as_returned_and_none_fields_move_no_key() -> None:
    keys = jax.random.split(jax.random.key(0), L + 1)
    model = _Model(eqx.filter_vmap(_Layer)(keys[:L]), eqx.nn.Linear(4, 2, key=keys[L]))
    params = eqx.filter(model, eqx.is_array)
    prefix = clipax.stacked_prefix(params, path="^layers/")
    assert callable(prefix)  # a model: passed as it is, it is still a prefix
    tx = clipax.adagc(warmup_steps=1, stacked=prefix)
    _, state = jax.jit(tx.update)(params, tx.init(params))
    assert state.ema.layers.linear.weight.shape == (L,)
    assert state.ema.layers.dropout.p is None
    logs = clipax.metrics(state)
    assert "adagc/layers/0/linear/weight/ema" in logs
    norms = clipax.tree.group_norms(params, depth=2, stacked=prefix)
    assert [k for k in norms if k.startswith("layers/")] == [
        f"layers/{i}/norm" for i in range(L)
    ]
    # Under inject_hyperparams a callable prefix is static, as the docs say.
    injected = optax.inject_hyperparams(
        clipax.adagc, static_args=("stacked", "warmup_steps")
    )(stacked=prefix, warmup_steps=1)
    _, injected_state = jax.jit(injected.update)(params, injected.init(params))
    assert injected_state.inner_state.ema.layers.linear.weight.shape == (L,)


def test_compiles_once_with_the_layer_axis_second() -> None:
    tx = optax.chain(clipax.adagc(stacked=STACKED), optax.adam(1e-3))
    traces = []

    @jax.jit
    def step(grads: Any, state: Any) -> tuple:
        traces.append(1)
        _, state = tx.update(grads, state, grads)
        norms = clipax.tree.group_norms(grads, depth=3, stacked=STACKED)
        return state, clipax.metrics(state) | norms

    state = tx.init(maxtext_tree(0))
    for seed in range(3):
        state, logs = step(maxtext_tree(seed), state)
    assert len(traces) == 1 and step._cache_size() == 1
    assert (
        "decoder/layers/3/norm" in logs and "adagc/decoder/layers/3/mlp/wi/ema" in logs
    )


def test_a_partial_of_stacked_prefix_is_called() -> None:
    # functools.partial is a pytree to JAX, but a function to call here.
    tx = clipax.clip_by_norm(
        1.0,
        stacked=functools.partial(
            clipax.stacked_prefix, path="^decoder/layers/", axes=(1,)
        ),
    )
    assert tx.init(maxtext_tree(0)).norms["decoder"]["layers"]["mlp"]["wi"].shape == (
        L,
    )
