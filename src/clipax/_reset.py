"""`reset_on_spike`: an optimizer whose moments are reset where a layer spikes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from clipax import _checks, _engine, _leaves, _skip, _states

# The moments it resets, by optax's names: Adam's `mu` and `nu`, Lion's and
# Muon's `mu`.
MOMENTS = {"both": ("mu", "nu"), "first": ("mu",)}


@_states.declare(
    "reset_on_spike",
    per_tensor={"norms": "norm", "spiked": "spiked", "resets": "resets"},
    inner="inner_state",
)
class ResetOnSpikeState(NamedTuple):
    """State of `reset_on_spike`: the wrapped state and each layer's history.

    Each field but `inner_state` and `count` is the updates' tree holding, per
    tensor, an array shaped as its layers (a scalar for a tensor not stacked).
    """

    inner_state: optax.OptState  # the wrapped optimizer's state
    count: jax.Array  # type: ignore[assignment]  # int32 scalar: steps taken
    norms: chex.ArrayTree  # float32: the norm watched at the last step
    spiked: chex.ArrayTree  # bool: the last step reset its moments
    resets: chex.ArrayTree  # int32: steps that reset them (saturates)
    age: chex.ArrayTree  # int32: steps since they restarted (`count` where they
    # never did), for their bias correction
    norm_count: chex.ArrayTree  # int32: norms in its statistics
    norm_mean: chex.ArrayTree  # float32: their EMA (`skip_spikes`' statistics)
    norm_variance: chex.ArrayTree  # float32: the EMA of their variance
    stacks: _leaves.Stacks = _leaves.Stacks()  # static: where each stack starts


def reset_on_spike(
    inner: optax.GradientTransformation,
    *,
    watch: Literal["gradient", "update"] = "gradient",
    moments: Literal["both", "first"] = "both",
    factor: ArrayLike = 0.0,
    b1: float | None = 0.9,
    b2: float | None = 0.999,
    z_threshold: ArrayLike = 6.0,
    alpha: ArrayLike = 0.985,
    warmup_steps: int = 64,
    stacked: Any = None,
    axis_name: str | Sequence[str] | None = None,
    specs: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Resets the optimizer's moments of each layer whose gradient (or update)
    norm spikes, and only that layer's; the step goes on.

    Each tensor's (each layer's, with `stacked`) norm is tested against an EMA
    of its own past norms as `skip_spikes` tests the global norm. Where it
    spikes, `inner`'s moments there (`mu`, and `nu`) are multiplied by
    `factor`; a reset moment restarts its bias correction, as if the optimizer
    started there (docs/skipping-and-logging.md).

    Args:
      inner: the optimizer, e.g. `optax.adamw(1e-3)`, given `update`'s extras.
      watch: `"gradient"` or `"update"` (`inner`'s output): whose norms.
      moments: `"both"` (`mu` and `nu`) or `"first"` (`mu`).
      factor: what a spiking layer's moments are multiplied by, in [0, 1).
      b1: the decay of `mu`, for its bias correction; None: none (Lion, Muon).
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
      ValueError: if an argument is not accepted, or `inner`'s state holds no
        such moment shaped like the params (naming what it holds).
      TypeError: if `inner` is not a transformation, or a leaf not a float.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import clipax
      >>> tx = clipax.reset_on_spike(optax.adam(0.1), warmup_steps=3)
      >>> state = tx.init({"a": jnp.zeros(1), "b": jnp.zeros(1)})
      >>> for g in [1.0, 1.1, 0.9, 1.0, 60.0]:  # a spike in "a" at the last step
      ...     _, state = tx.update({"a": jnp.array([g]), "b": jnp.ones(1)}, state)
      >>> state.spiked
      {'a': Array(True, dtype=bool), 'b': Array(False, dtype=bool)}
      >>> updates, _ = tx.update({"a": jnp.ones(1), "b": jnp.ones(1)}, state)
      >>> updates["a"]  # Adam's first step again, bias-corrected: -lr * sign(g)
      Array([-0.1], dtype=float32)
    """
    _checks.transformation("inner", inner)
    watch = _checks.choice("watch", watch, ("gradient", "update"))
    names = MOMENTS[_checks.choice("moments", moments, tuple(MOMENTS))]
    accepted = "a real number in [0, 1)"
    factor = _checks.number("factor", factor, accepted, low=0, high=1, high_open=True)
    decay = {
        name: None if value is None else _checks.unit(arg, value)
        for name, arg, value in (("mu", "b1", b1), ("nu", "b2", b2))
    }
    z_threshold = _checks.positive("z_threshold", z_threshold, inf_ok=True)
    alpha = _checks.unit("alpha", alpha)
    warmup = _checks.integer("warmup_steps", warmup_steps)
    spike, recorded = _skip.statistics(z_threshold, alpha, None, 0, warmup)
    checked = _leaves.reader(
        "reset_on_spike", stacked=stacked, specs=specs, axis_name=axis_name
    )
    inner = optax.with_extra_args_support(inner)

    def each_moment(state: Any, leaves: _leaves.Leaves, fn: Any) -> Any:
        """`state` with `fn(moment, leaf index, its name)` for each of its
        moments: the leaves under a `names` key shaped like a parameter.

        Raises:
          ValueError: if it holds none, naming the keys it holds.
        """
        wrapper = _leaves.is_wrapper  # a NamedArray's moment is one too
        flat, treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=wrapper)
        index = {leaf.path: i for i, leaf in enumerate(leaves)}
        out, found = [x for _, x in flat], False
        for j, (path, node) in enumerate(flat):
            keys, x = _leaves.path_keys(path), _leaves.unwrap(node)
            for at in [a for a, k in enumerate(keys) if k in names]:
                i = index.get(tuple(path[at + 1 :]), -1)
                if i >= 0 and jnp.shape(x) == leaves[i].x.shape:
                    new = fn(x, i, keys[at]).astype(x.dtype)
                    out[j] = jax.tree.unflatten(jax.tree.structure(node), [new])
                    found = True
        if not found:
            held = sorted({k for p, _ in flat for k in _leaves.path_keys(p)})
            raise ValueError(
                f"`reset_on_spike` resets `inner`'s moments {list(names)}, trees "
                f"shaped like the params in its state; it holds none: its keys are "
                f"{held[:12]}."
            )
        return jax.tree.unflatten(treedef, out)

    def init_fn(params: optax.Params) -> ResetOnSpikeState:
        leaves, inner_state = checked(params), inner.init(params)
        each_moment(inner_state, leaves, lambda x, i, name: x)
        dtype, i32 = _engine.tree_accum_dtype(leaves.arrays), jnp.int32
        kinds = (dtype, bool, i32, i32, i32, dtype, dtype)  # norms ... norm_variance
        stats = [leaves.full(0, kind) for kind in kinds]  # each its own arrays
        return ResetOnSpikeState._make(
            [inner_state, jnp.zeros((), i32), *stats, leaves.stacks]
        )

    def update_fn(
        updates: optax.Updates,
        state: ResetOnSpikeState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, ResetOnSpikeState]:
        leaves = checked(updates)
        age, resets, *stats = (
            _leaves.check_state("reset_on_spike", leaves, tree, state.stacks)
            for tree in (state.age, state.resets, *state[6:9])
        )
        c = (state.count + 1).astype(jnp.float32)

        def restarted(x: jax.Array, i: int, name: str) -> jax.Array:
            """The moment scaled and shifted by this step's gradient so that
            `inner`'s bias correction by `count + 1` gives it its own age's:
            kept as `(1 - b**(count + 1)) / (1 - b**(age + 1))` times the
            moment restarted (docs/skipping-and-logging.md)."""
            b, leaf = decay[name], leaves[i]
            if b is None:
                return x
            k = (age[i] + 1).astype(jnp.float32)
            now = (1 - b**c) / (1 - b**k)
            before = (1 - b ** (c - 1)) / jnp.where(k > 1, 1 - b ** (k - 1), 1)
            g = leaf.x if name == "mu" else jnp.square(jnp.abs(leaf.x))
            ratio = leaf.broadcast(jnp.where(k > 1, now / before, 0))
            return x * ratio + leaf.broadcast((1 - b) * (now - 1) / b) * g

        inner_state = each_moment(state.inner_state, leaves, restarted)
        new_updates, inner_state = inner.update(
            updates, inner_state, params, **extra_args
        )
        norms = _engine.layer_norms(
            checked(new_updates) if watch == "update" else leaves
        )
        spiked, kept = [], []
        for n, *history in zip(norms, *stats, strict=True):
            hit = ~jnp.isfinite(n) | spike(n, (*history, None))
            spiked.append(hit)
            kept.append(recorded(n, (*history, None), jnp.isfinite(n) & ~hit)[:3])
        inner_state = each_moment(
            inner_state,
            leaves,
            lambda x, i, _: jnp.where(leaves[i].broadcast(spiked[i]), x * factor, x),
        )
        restart = [h & (factor == 0) for h in spiked]  # a shrunk moment goes on
        age = [
            jnp.where(r, 0, optax.safe_int32_increment(a))
            for r, a in zip(restart, age, strict=True)
        ]
        resets = list(map(_engine.count_if, spiked, resets))
        fields = map(
            leaves.stats, [norms, spiked, resets, age, *zip(*kept, strict=True)]
        )
        count = optax.safe_int32_increment(state.count)
        return new_updates, ResetOnSpikeState._make(
            [inner_state, count, *fields, state.stacks]
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
