"""Every clipax name that replaces a peer's takes the peer's call as written.

The pairs are the porting page's (docs/porting.md). optax's signatures are read
from optax itself, so these tests follow it. TensorFlow and PyTorch are not
installed: their signatures are written below as stubs, copied from their API
documentation (names, order and defaults as listed there):

- TensorFlow 2.x, https://www.tensorflow.org/api_docs/python/tf/clip_by_global_norm,
  .../tf/clip_by_norm, .../tf/clip_by_value and .../tf/linalg/global_norm;
- PyTorch 2.x, https://pytorch.org/docs/stable/generated/torch.nn.utils.clip_grad_norm_.html,
  and the pages of `clip_grad_value_`, `get_total_norm` and
  `clip_grads_with_norm_` beside it.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipax

# The peers' signatures, from their documentation (see the module docstring).


def tf_clip_by_global_norm(t_list, clip_norm, use_norm=None, name=None): ...
def tf_clip_by_norm(t, clip_norm, axes=None, name=None): ...
def tf_clip_by_value(t, clip_value_min, clip_value_max, name=None): ...
def tf_global_norm(t_list, name=None): ...
def torch_clip_grad_norm_(
    parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None
): ...
def torch_clip_grad_value_(parameters, clip_value, foreach=None): ...
def torch_get_total_norm(
    tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None
): ...
def torch_clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None): ...


W = jnp.array([[3.0, -1.0, 0.5], [4.0, 2.0, -0.25]])
B = jnp.array([0.5, -2.0, 1.0])
GRADS = {"w": W, "b": B}
PARAMS = {"w": jnp.array([[1.0, 0.5, -1.0], [0.0, 2.0, 1.0]]), "b": jnp.ones(3)}
T_LIST = [W, B]  # TensorFlow and PyTorch take lists of tensors
PER_EXAMPLE = {  # batch of 4 on axis 0
    "w": jnp.arange(24.0).reshape(4, 2, 3) / 10 - 1,
    "b": jnp.arange(12.0).reshape(4, 3) / 5 - 1,
}


@dataclasses.dataclass(frozen=True)
class Case:
    """A peer's call and its clipax replacement.

    `arguments` holds every argument of the peer's call by its peer name
    (the gradients too, for a function that takes them first). `after_gradients`:
    the replacement is a transformation, which takes the arguments after the
    gradients. `positional`: how many leading arguments the positional form
    passes by position (all of them by default); fewer where two peers give
    the same position different meanings (docs/porting.md says which wins).
    """

    peer: Callable[..., Any]
    clipax: Callable[..., Any]
    arguments: dict[str, Any]
    native: Callable[[], Any]  # the same call, written with clipax's own names
    after_gradients: bool = False
    positional: int | None = None


CASES = {
    # optax: the same names; positional as in optax.
    "optax.clip": Case(
        optax.clip, clipax.clip, {"max_delta": 0.5}, lambda: clipax.clip(0.5)
    ),
    "optax.clip_by_global_norm": Case(
        optax.clip_by_global_norm,
        clipax.clip_by_global_norm,
        {"max_norm": 1.0},
        lambda: clipax.clip_by_global_norm(1.0),
    ),
    "optax.adaptive_grad_clip": Case(
        optax.adaptive_grad_clip,
        clipax.adaptive_grad_clip,
        {"clipping": 0.05, "eps": 0.2, "axis": 0},
        lambda: clipax.adaptive_grad_clip(0.05, eps=0.2, axis=0),
    ),
    "optax.clip_by_block_rms": Case(
        optax.clip_by_block_rms,
        clipax.clip_by_block_rms,
        {"threshold": 0.1},
        lambda: clipax.clip_by_block_rms(0.1),
    ),
    "optax.per_example_global_norm_clip": Case(
        optax.per_example_global_norm_clip,
        clipax.tree.per_example_global_norm_clip,
        {"grads": PER_EXAMPLE, "l2_norm_clip": 1.0},
        lambda: clipax.tree.per_example_global_norm_clip(PER_EXAMPLE, 1.0),
    ),
    "optax.per_example_layer_norm_clip": Case(
        optax.per_example_layer_norm_clip,
        clipax.tree.per_example_layer_norm_clip,
        {"grads": PER_EXAMPLE, "global_l2_norm_clip": 1.0, "uniform": False},
        lambda: clipax.tree.per_example_layer_norm_clip(
            PER_EXAMPLE, 1.0, uniform=False
        ),
    ),
    "optax.tree.norm": Case(
        optax.tree.norm,
        clipax.tree.global_norm,
        {"tree": GRADS, "ord": 1, "squared": True},
        lambda: clipax.tree.global_norm(GRADS, ord=1, squared=True),
    ),
    "optax.tree.norm ord='infinity'": Case(
        optax.tree.norm,
        clipax.tree.global_norm,
        {"tree": GRADS, "ord": "infinity"},
        lambda: clipax.tree.global_norm(GRADS, ord=math.inf),
    ),
    # TensorFlow: its names are aliases, `name` is ignored.
    "tf.clip_by_global_norm": Case(
        tf_clip_by_global_norm,
        clipax.tree.clip_by_global_norm,
        {"t_list": T_LIST, "clip_norm": 1.0, "use_norm": 10.0, "name": "clip"},
        lambda: clipax.tree.clip_by_global_norm(T_LIST, 1.0, use_norm=10.0),
    ),
    # In a chain; its second position is PyTorch's norm_type, and `use_norm`
    # belongs to the pure function.
    "tf.clip_by_global_norm in a chain": Case(
        tf_clip_by_global_norm,
        clipax.clip_by_global_norm,
        {"t_list": T_LIST, "clip_norm": 1.0, "name": "clip"},
        lambda: clipax.clip_by_global_norm(1.0),
        after_gradients=True,
        positional=1,
    ),
    "tf.clip_by_norm": Case(
        tf_clip_by_norm,
        clipax.tree.clip_by_norm,
        {"t": W, "clip_norm": 1.0, "axes": [1], "name": "clip"},
        lambda: clipax.tree.clip_by_norm(W, 1.0, axes=[1]),
    ),
    "tf.clip_by_norm in a chain": Case(
        tf_clip_by_norm,
        clipax.clip_by_norm,
        {"t": T_LIST, "clip_norm": 1.0, "axes": [-1], "name": "clip"},
        lambda: clipax.clip_by_norm(1.0, axes=[-1]),
        after_gradients=True,
    ),
    "tf.clip_by_value": Case(
        tf_clip_by_value,
        clipax.tree.clip_by_value,
        {"t": W, "clip_value_min": -0.5, "clip_value_max": 0.25, "name": "clip"},
        lambda: clipax.tree.clip_by_value(W, -0.5, 0.25),
    ),
    "tf.clip_by_value in a chain": Case(
        tf_clip_by_value,
        clipax.clip_by_value,
        {"t": T_LIST, "clip_value_min": -0.5, "clip_value_max": 0.25, "name": "c"},
        lambda: clipax.clip_by_value(-0.5, 0.25),
        after_gradients=True,
    ),
    # The second position is `ord` (optax's and PyTorch's): `name` by keyword.
    "tf.linalg.global_norm": Case(
        tf_global_norm,
        clipax.tree.global_norm,
        {"t_list": T_LIST, "name": "norm"},
        lambda: clipax.tree.global_norm(T_LIST),
        positional=1,
    ),
    # PyTorch: its names are aliases, `foreach` is ignored.
    "torch.nn.utils.clip_grad_norm_": Case(
        torch_clip_grad_norm_,
        clipax.clip_by_global_norm,
        {
            "parameters": GRADS,
            "max_norm": 1.0,
            "norm_type": 1.0,
            "error_if_nonfinite": True,
            "foreach": True,
        },
        lambda: clipax.clip_by_global_norm(1.0, ord=1.0, nonfinite="error"),
        after_gradients=True,
    ),
    "torch.nn.utils.clip_grad_norm_ norm_type='inf'": Case(
        torch_clip_grad_norm_,
        clipax.clip_by_global_norm,
        {"parameters": GRADS, "max_norm": 1.0, "norm_type": "inf"},
        lambda: clipax.clip_by_global_norm(1.0, ord=math.inf),
        after_gradients=True,
    ),
    "torch.nn.utils.clip_grad_value_": Case(
        torch_clip_grad_value_,
        clipax.clip,
        {"parameters": GRADS, "clip_value": 0.5, "foreach": False},
        lambda: clipax.clip(0.5),
        after_gradients=True,
    ),
    # The third position is optax's `squared`: error_if_nonfinite by keyword.
    "torch.nn.utils.get_total_norm": Case(
        torch_get_total_norm,
        clipax.tree.global_norm,
        {
            "tensors": T_LIST,
            "norm_type": 3.0,
            "error_if_nonfinite": True,
            "foreach": None,
        },
        lambda: clipax.tree.global_norm(T_LIST, ord=3.0, nonfinite="error"),
        positional=2,
    ),
    "torch.nn.utils.clip_grads_with_norm_": Case(
        torch_clip_grads_with_norm_,
        clipax.tree.clip_by_global_norm,
        {"parameters": T_LIST, "max_norm": 1.0, "total_norm": 10.0, "foreach": True},
        lambda: clipax.tree.clip_by_global_norm(T_LIST, 1.0, use_norm=10.0),
    ),
}


def peer_call(case: Case, form: str) -> tuple[list[Any], dict[str, Any]]:
    """The peer's call as `(args, kwargs)`, in `form` "positional" or "keyword".

    The arguments are bound to the peer's signature first, so a name the peer
    does not have fails here, not in clipax.
    """
    signature = inspect.signature(case.peer)
    signature.bind(**case.arguments)
    names = list(signature.parameters)[1 if case.after_gradients else 0 :]
    given = [name for name in names if name in case.arguments]
    if form == "keyword":
        return [], {name: case.arguments[name] for name in given}
    count = names.index(given[-1]) + 1 if case.positional is None else case.positional
    args = [
        case.arguments.get(name, signature.parameters[name].default)
        for name in names[:count]
    ]
    kwargs = {name: case.arguments[name] for name in given if name not in names[:count]}
    return args, kwargs


def outcome(result: Any) -> Any:
    """A transformation's updates and state on GRADS; any other result as is."""
    if isinstance(result, optax.GradientTransformation):
        return result.update(GRADS, result.init(PARAMS), PARAMS)
    return result


@pytest.mark.parametrize("form", ["positional", "keyword"])
@pytest.mark.parametrize("peer", list(CASES))
def test_the_peers_call_gives_the_native_result(peer: str, form: str) -> None:
    case = CASES[peer]
    args, kwargs = peer_call(case, form)
    got = outcome(case.clipax(*args, **kwargs))
    chex.assert_trees_all_equal(got, outcome(case.native()))
    if case.peer.__module__.startswith("optax"):  # the call is optax's own
        want = outcome(case.peer(*args, **kwargs))
        first = (lambda pair: pair[0]) if isinstance(got, tuple) else (lambda x: x)
        chex.assert_trees_all_close(first(got), first(want), rtol=1e-6)


def test_every_pair_of_the_porting_table_is_tested() -> None:
    peers = {case.peer.__name__ for case in CASES.values()}
    assert peers == {
        "clip",
        "clip_by_global_norm",
        "adaptive_grad_clip",
        "clip_by_block_rms",
        "per_example_global_norm_clip",
        "per_example_layer_norm_clip",
        "tree_norm",
        "tf_clip_by_global_norm",
        "tf_clip_by_norm",
        "tf_clip_by_value",
        "tf_global_norm",
        "torch_clip_grad_norm_",
        "torch_clip_grad_value_",
        "torch_get_total_norm",
        "torch_clip_grads_with_norm_",
    }


INF_GRADS = {"w": W, "b": jnp.array([1.0, jnp.inf, 0.0])}


@pytest.mark.parametrize(
    "call",
    [
        lambda: outcome_on(clipax.clip_by_global_norm(1.0, 2.0, True), INF_GRADS),
        lambda: outcome_on(
            clipax.clip_by_global_norm(max_norm=1.0, error_if_nonfinite=True),
            INF_GRADS,
        ),
        lambda: clipax.tree.global_norm(tensors=INF_GRADS, error_if_nonfinite=True),
        lambda: clipax.nonfinite_errors(
            jax.jit(lambda g: clipax.tree.global_norm(g, error_if_nonfinite=True))
        )(INF_GRADS),
    ],
    ids=[
        "clip_grad_norm_ positional",
        "clip_grad_norm_ keyword",
        "get_total_norm",
        "get_total_norm under jit",
    ],
)
def test_error_if_nonfinite_raises(call: Callable[[], Any]) -> None:
    with pytest.raises(clipax.NonFiniteError, match=r"the leaf at \['b'\]"):
        call()


def outcome_on(tx: optax.GradientTransformation, grads: Any) -> Any:
    return tx.update(grads, tx.init(grads))


def test_error_if_nonfinite_false_is_the_default() -> None:
    updates, state = outcome_on(clipax.clip_by_global_norm(1.0, 2.0, False), INF_GRADS)
    assert all(np.isnan(leaf).all() for leaf in (updates["w"], updates["b"]))
    assert int(state.nonfinite_count) == 1
    assert (
        float(clipax.tree.global_norm(INF_GRADS, error_if_nonfinite=False)) == math.inf
    )


@pytest.mark.parametrize(
    ("call", "names"),
    [
        (
            lambda: clipax.clip_by_global_norm(1.0, clip_norm=1.0),
            "`max_norm` and `clip_norm`",
        ),
        (
            lambda: clipax.clip_by_global_norm(1.0, 2, norm_type=2),
            "`ord` and `norm_type`",
        ),
        (
            lambda: clipax.clip_by_global_norm(
                1.0, nonfinite="nan", error_if_nonfinite=True
            ),
            "`nonfinite` and `error_if_nonfinite`",
        ),
        (
            lambda: clipax.clip(max_delta=1.0, clip_value=1.0),
            "`max_delta` and `clip_value`",
        ),
        (
            lambda: clipax.tree.clip_by_global_norm(
                t_list=T_LIST, parameters=T_LIST, max_norm=1.0
            ),
            "`t_list` and `parameters`",
        ),
        (
            lambda: clipax.tree.clip_by_value(T_LIST, 0.0, 1.0, clip_value_max=1.0),
            "`max_value` and `clip_value_max`",
        ),
        (
            lambda: clipax.tree.global_norm(T_LIST, tensors=T_LIST),
            "`tree` and `tensors`",
        ),
    ],
)
def test_a_name_and_its_alias_together_are_an_error(
    call: Callable[[], Any], names: str
) -> None:
    with pytest.raises(TypeError, match=names):
        call()


@pytest.mark.parametrize(
    ("call", "plain"),
    [
        (lambda: clipax.clip(0.5, 1.0), lambda: clipax.clip(0.5)),
        (
            lambda: clipax.clip_by_value(-1.0, 1.0, 0.5),
            lambda: clipax.clip_by_value(-1.0, 1.0),
        ),
        (
            lambda: clipax.clip_by_global_norm(1.0, foreach=[True]),
            lambda: clipax.clip_by_global_norm(1.0),
        ),
    ],
)
def test_an_ignored_argument_is_accepted_and_ignored(
    call: Callable[[], Any], plain: Callable[[], Any]
) -> None:
    # As optax does: TensorFlow's `name` and PyTorch's `foreach` mean nothing
    # in JAX, whatever their value.
    chex.assert_trees_all_close(outcome_on(call(), GRADS), outcome_on(plain(), GRADS))
    chex.assert_trees_all_close(
        clipax.tree.global_norm(T_LIST, name=3, foreach=np.ones(2)),
        clipax.tree.global_norm(T_LIST),
    )


def test_optax_positional_call_under_inject_hyperparams() -> None:
    theirs = optax.inject_hyperparams(optax.adaptive_grad_clip)(0.05, 0.2)
    ours = optax.inject_hyperparams(clipax.adaptive_grad_clip)(0.05, 0.2)
    want, _ = theirs.update(GRADS, theirs.init(PARAMS), PARAMS)
    got, state = ours.update(GRADS, ours.init(PARAMS), PARAMS)
    chex.assert_trees_all_close(got, want, rtol=1e-6)
    assert float(state.hyperparams["eps"]) == np.float32(0.2)


def test_clipax_keywords_still_work() -> None:
    tx = clipax.clip_by_global_norm(
        max_norm=1.0, ord=2, axis_name=None, specs=None, nonfinite="zero"
    )
    updates, _ = outcome_on(tx, INF_GRADS)
    assert all((leaf == 0).all() for leaf in (updates["w"], updates["b"]))
    _, norm = clipax.tree.clip_by_global_norm(
        tree=GRADS, max_norm=1.0, use_norm=10.0, ord=1, nonfinite="nan"
    )
    assert float(norm) == 10.0
