"""`reset_on_spike`: an optimizer whose moments are reset where a layer spikes."""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from clipax import _checks, _engine, _leaves, _states, _statistics

# The moments it resets, by optax's names (Adam's `mu` and `nu`, Lion's and
# Muon's `mu`), and the argument giving each one's decay.
MOMENTS = {"both": ("mu", "nu"), "first": ("mu",)}
DECAYS = {"mu": "b1", "nu": "b2"}
NAME = "reset_on_spike"
AUTO: Literal["auto"] = "auto"  # a decay read from `inject_hyperparams`
HYPERPARAMS = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


@_states.declare(
    "reset_on_spike",
    per_tensor={"norms": "norm", "spiked": "spiked", "resets": "resets"},
    unreported=("age", "norm_count", "norm_mean", "norm_variance"),
    inner="inner_state",
)
class ResetOnSpikeState(NamedTuple):
    """State of `reset_on_spike`: the wrapped state and each layer's history.

    Each field but `inner_state`, `count` and `stacks` is the updates' tree
    holding, per tensor, an array shaped as its layers (a scalar for a tensor
    not stacked).
    """

    inner_state: optax.OptState  # the wrapped optimizer's state
    count: jax.Array  # type: ignore[assignment]  # int32 scalar: steps taken
    norms: chex.ArrayTree  # float32: the norm watched at the last step
    spiked: chex.ArrayTree  # bool: the last step reset (or shrank) its moments
    resets: chex.ArrayTree  # int32: steps that spiked there (saturates)
    age: chex.ArrayTree  # int32: steps since they restarted (`count` where they
    # never did), for their bias correction
    norm_count: chex.ArrayTree  # int32: norms in its statistics
    norm_mean: chex.ArrayTree  # float32: their EMA (`skip_spikes`' statistics)
    norm_variance: chex.ArrayTree  # float32: the EMA of their variance
    stacks: _leaves.Stacks = _leaves.Stacks()  # static: where each stack starts


class Config(NamedTuple):
    """`reset_on_spike`'s arguments, checked, and its inner optimizer."""

    inner: optax.GradientTransformationExtraArgs
    checked: _leaves.Reader
    watch: str
    names: tuple[str, ...]
    given: dict[str, Any]
    factor: Any
    spike: Callable[..., jax.Array]
    record: Callable[..., tuple]


# One tensor's per-layer entries of the state's per-tensor fields.
Layer = collections.namedtuple(
    "Layer", "norms spiked resets age norm_count norm_mean norm_variance"
)


def next_layer(
    before: Layer, norm: jax.Array, lost: jax.Array, config: Config
) -> Layer:
    """A tensor's entries after a step whose watched `norm` it is: spiked
    where the norm (or, `lost`, its gradient) is NaN or inf or a spike; the
    norm recorded where it is neither; restarted (age 0) where its moments
    were reset, not shrunk by `factor`."""
    history = (before.norm_count, before.norm_mean, before.norm_variance, None)
    spiked = lost | config.spike(norm, history)
    stats = config.record(norm, history, ~spiked)[:3]
    fresh = spiked & (lost | (config.factor == 0))
    age = jnp.where(fresh, 0, optax.safe_int32_increment(before.age))
    return Layer(norm, spiked, _engine.count_if(spiked, before.resets), age, *stats)


class Moment(NamedTuple):
    """A moment of `inner`'s state: its name (`mu`, `nu`), whether its state
    node keeps a `count` (a bias correction), and the hyperparameters of the
    `inject_hyperparams` state around it (or None)."""

    name: str
    counted: bool
    hyperparams: Any


def each_moment(
    state: Any,
    names: Sequence[str],
    at: dict[_leaves.KeyPath, _leaves.Leaf],
    fn: Callable[[jax.Array, _leaves.Leaf, Moment], jax.Array],
    hyperparams: Any = None,
) -> Any:
    """`state` with `fn(x, leaf, moment)` for each array `x` of a moment: a
    field named in `names` of a state node (a NamedTuple) holding arrays
    shaped as the leaves at their paths in `at` (optax's `mu`, `nu`; a masked
    one holds some), each kept in its wrapper and dtype. A moment is not
    searched further: a parameter named `mu` is no moment."""
    if isinstance(state, HYPERPARAMS):
        hyperparams = state.hyperparams
    children, treedef = _states.children(state)
    if not children or _leaves.is_wrapper(state):
        return state
    fields, out = getattr(state, "_fields", ()), []
    for key, child in children:
        name = _states.key_name(key)
        flat = jax.tree_util.tree_flatten_with_path(child, is_leaf=_leaves.is_wrapper)
        if (
            name in names
            and name in fields
            and flat[0]
            and all(
                tuple(p) in at and jnp.shape(_leaves.unwrap(x)) == at[tuple(p)].x.shape
                for p, x in flat[0]
            )
        ):
            moment = Moment(name, "count" in fields, hyperparams)
            mapped = []
            for p, node in flat[0]:
                x = _leaves.unwrap(node)
                new = fn(x, at[tuple(p)], moment).astype(x.dtype)
                mapped.append(_leaves.rewrap(node, new) if node is not x else new)
            out.append(jax.tree.unflatten(flat[1], mapped))
        else:
            out.append(each_moment(child, names, at, fn, hyperparams))
    return treedef.unflatten(out)


def decay(moment: Moment, given: Any) -> Any:
    """The decay that restarts `moment`'s bias correction: `given` (`b1` or
    `b2`), or for `"auto"` the `inject_hyperparams` value around it; None for
    none.

    Raises:
      ValueError: naming the argument, where a counted moment's decay is
        neither given nor held, is given beside a held one, or is given for
        a moment that no count corrects.
    """
    arg, held = DECAYS[moment.name], (moment.hyperparams or {}).get(DECAYS[moment.name])
    what = f"`reset_on_spike` restarts the bias correction of `inner`'s `{moment.name}`"
    if given == AUTO and held is None and moment.counted:
        why = f"with its decay: pass `{arg}=` (the optimizer's), `{arg}=None` where "
        why += "it has none (Lion), or build `inner` with `optax.inject_hyperparams`"
    elif given not in (AUTO, None) and held is not None:
        why = f"with the `{arg}` its `optax.inject_hyperparams` state holds; "
        why += f"`{arg}`={given} would be a second one: leave it out"
    elif given not in (AUTO, None) and not moment.counted:
        why = f"by `{arg}`={given}, but the state holding it keeps no `count`: it "
        why += f"has none. Pass `{arg}=None`"
    else:
        return held if given == AUTO else given
    raise ValueError(f"{what} {why}.")


def restarted(
    x: jax.Array, g: jax.Array, b: Any, age: jax.Array, count: jax.Array, leaf: Any
) -> jax.Array:
    """The moment `x` (of decay `b`) scaled and shifted by this step's `g`
    (the gradient for `mu`, its square for `nu`) so that `inner`'s bias
    correction by `count + 1` gives it its own `age`'s: kept as
    `(1 - b**(count + 1)) / (1 - b**(age + 1))` times the moment restarted
    (docs/skipping-and-logging.md)."""
    c = (count + 1).astype(jnp.float32)
    k = (age + 1).astype(jnp.float32)
    now = (1 - b**c) / (1 - b**k)
    before = (1 - b ** (c - 1)) / jnp.where(k > 1, 1 - b ** (k - 1), 1)
    ratio = leaf.broadcast(jnp.where(k > 1, now / before, 0))
    return x * ratio + leaf.broadcast((1 - b) * (now - 1) / b) * g


def initial(config: Config, params: optax.Params) -> ResetOnSpikeState:
    """The state before any step: `inner`'s, and zero statistics.

    Raises:
      ValueError: if `inner`'s state holds no moment (naming the keys it
        holds), or a moment's decay is missing or held twice (`decay`).
    """
    leaves, inner_state = config.checked(params), config.inner.init(params)
    found = set()

    def check(x: jax.Array, _: Any, moment: Moment) -> jax.Array:
        decay(moment, config.given[moment.name])
        found.add(moment.name)
        return x

    each_moment(inner_state, config.names, {x.path: x for x in leaves}, check)
    if not found:
        flat = jax.tree_util.tree_flatten_with_path(inner_state)[0]
        held = sorted({k for p, _ in flat for k in _leaves.path_keys(p)})[:12]
        raise ValueError(
            f"`reset_on_spike` resets `inner`'s moments {list(config.names)}, trees "
            f"shaped like the params in its state; it holds none: its keys are "
            f"{held}."
        )
    dtype, i32 = _engine.tree_accum_dtype(leaves.arrays), jnp.int32
    kinds = Layer(dtype, bool, i32, i32, i32, dtype, dtype)
    return ResetOnSpikeState(  # each statistic its own arrays: a state may be donated
        inner_state=inner_state,
        count=jnp.zeros((), i32),
        **{f: leaves.full(0, kind) for f, kind in kinds._asdict().items()},
        stacks=leaves.stacks,
    )


def step(
    config: Config, updates: Any, state: ResetOnSpikeState, params: Any, extra: dict
) -> tuple[Any, ResetOnSpikeState]:
    """One step: `inner`'s, its moments restarted where they were reset;
    then each layer tested (`next_layer`) and its moments reset or shrunk
    where it spiked, its update zero where it was NaN or inf."""
    leaves = config.checked(updates)
    at = {leaf.path: leaf for leaf in leaves}
    fields = (
        _leaves.check_state(NAME, leaves, getattr(state, f), state.stacks)
        for f in Layer._fields
    )
    before = dict(zip(at, map(Layer._make, zip(*fields, strict=True)), strict=True))
    norms = dict(zip(at, _engine.layer_norms(leaves), strict=True))
    # A NaN or inf layer steps with a zero gradient, so that nothing NaN
    # enters `inner` (a clip inside it would spread it), and restarts.
    lost = {p: ~jnp.isfinite(n) for p, n in norms.items()}
    grads = {p: jnp.where(at[p].broadcast(lost[p]), 0, at[p].x) for p in at}

    def restart(x: jax.Array, leaf: _leaves.Leaf, moment: Moment) -> jax.Array:
        b, g = decay(moment, config.given[moment.name]), grads[leaf.path]
        if b is None:
            return x
        g = jnp.square(jnp.abs(g)) if moment.name == "nu" else g
        return restarted(x, g, b, before[leaf.path].age, state.count, leaf)

    inner_state = each_moment(state.inner_state, config.names, at, restart)
    new_updates, inner_state = config.inner.update(
        leaves.rebuild(list(grads.values())), inner_state, params, **extra
    )
    out = config.checked(new_updates)
    if config.watch == "update":
        norms = dict(zip(at, _engine.layer_norms(out), strict=True))
        lost = {p: lost[p] | ~jnp.isfinite(n) for p, n in norms.items()}
    after = {p: next_layer(before[p], norms[p], lost[p], config) for p in at}

    def reset(x: jax.Array, leaf: _leaves.Leaf, _: Moment) -> jax.Array:
        """`x` times `factor` where the layer spiked; zero where it was lost."""
        shrunk = jnp.where(leaf.broadcast(lost[leaf.path]), 0, x * config.factor)
        return jnp.where(leaf.broadcast(after[leaf.path].spiked), shrunk, x)

    inner_state = each_moment(inner_state, config.names, at, reset)
    new_updates = out.rebuild(
        [jnp.where(leaf.broadcast(lost[leaf.path]), 0, leaf.x) for leaf in out]
    )
    stats = Layer._make(map(leaves.stats, zip(*after.values(), strict=True)))
    return new_updates, ResetOnSpikeState(
        inner_state=inner_state,
        count=optax.safe_int32_increment(state.count),
        **stats._asdict(),
        stacks=state.stacks,
    )


def reset_on_spike(
    inner: optax.GradientTransformation,
    *,
    watch: Literal["gradient", "update"] = "gradient",
    moments: Literal["both", "first"] = "both",
    factor: ArrayLike = 0.0,
    b1: float | Literal["auto"] | None = AUTO,
    b2: float | Literal["auto"] | None = AUTO,
    z_threshold: ArrayLike = 6.0,
    alpha: ArrayLike = 0.985,
    warmup_steps: int = 64,
    stacked: Any = None,
    axis_name: str | Sequence[str] | None = None,
    specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Resets the optimizer's moments of each layer whose gradient (or update)
    norm spikes, and only that layer's; the step goes on.

    Each tensor's (layer's) norm is tested against an EMA of its own past
    norms as `skip_spikes` tests the global norm. Where it spikes, `inner`'s
    moments there are multiplied by `factor`, a reset one restarting its bias
    correction; a NaN or inf layer takes no step and restarts from zero
    (docs/skipping-and-logging.md).

    Args:
      inner: the optimizer, e.g. `optax.adamw(1e-3)`, given `update`'s extras.
      watch: `"gradient"` or `"update"` (`inner`'s output): whose norms.
      moments: `"both"` (`mu` and `nu`) or `"first"` (`mu`).
      factor: what a spiking layer's moments are multiplied by, in [0, 1).
      b1: the decay of `mu`, for its bias correction: `"auto"` reads it from
        `inner`'s `optax.inject_hyperparams` state; None: none (Lion).
      b2: the decay of `nu`, likewise.
      z_threshold: the z-score of a spike, > 0.
      alpha: the EMA factor of the statistics, in (0, 1).
      warmup_steps: norms recorded before the z-tests start, an int >= 1.
      stacked: None, or a prefix of the updates (docs/stacked-layers.md).
      axis_name: the mesh axes every leaf is split over (docs/scaling-out.md).
      specs: inside `shard_map`, the `in_specs` of the updates.

    Returns:
      A `GradientTransformationExtraArgs` whose state is a `ResetOnSpikeState`.

    Raises:
      ValueError: if an argument is not accepted, `inner`'s state holds no
        moment (naming what it holds), or one's decay is missing (naming it).
      TypeError: if `inner` is not a transformation, or a leaf not a float.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import clipax
      >>> adam = optax.adam(0.1, b1=0.9, b2=0.95)
      >>> tx = clipax.reset_on_spike(adam, b1=0.9, b2=0.95, warmup_steps=3)
      >>> state = tx.init({"a": jnp.zeros(1), "b": jnp.zeros(1)})
      >>> for g in [1.0, 1.1, 0.9, 1.0, 60.0]:  # a spike in "a" at the last step
      ...     _, state = tx.update({"a": jnp.array([g]), "b": jnp.ones(1)}, state)
      >>> updates, _ = tx.update({"a": jnp.ones(1), "b": jnp.ones(1)}, state)
      >>> updates["a"]  # Adam's first step again, bias-corrected: -lr * sign(g)
      Array([-0.1], dtype=float32)
    """
    _checks.transformation("inner", inner)
    watch = _checks.choice("watch", watch, ("gradient", "update"))
    names = MOMENTS[_checks.choice("moments", moments, tuple(MOMENTS))]
    accepted = "a real number in [0, 1)"
    factor = _checks.number("factor", factor, accepted, low=0, high=1, high_open=True)
    given = {
        name: value if value in (AUTO, None) else _checks.unit(arg, value)
        for name, arg, value in (("mu", "b1", b1), ("nu", "b2", b2))
    }
    z_threshold = _checks.positive("z_threshold", z_threshold, inf_ok=True)
    alpha = _checks.unit("alpha", alpha)
    warmup = _checks.integer("warmup_steps", warmup_steps)

    config = Config(
        optax.with_extra_args_support(inner),
        _leaves.reader(NAME, stacked=stacked, specs=specs, axis_name=axis_name),
        watch,
        names,
        given,
        factor,
        *_statistics.statistics(z_threshold, alpha, None, 0, warmup),
    )

    def init_fn(params: optax.Params) -> ResetOnSpikeState:
        return initial(config, params)

    def update_fn(
        updates: optax.Updates,
        state: ResetOnSpikeState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, ResetOnSpikeState]:
        return step(config, updates, state, params, extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
