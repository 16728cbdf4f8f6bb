"""Shared test helpers: float64 NumPy references, data loading, compile counting."""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import math
import os
import pathlib
import re
import subprocess
import sys
from typing import Any

import jax
import numpy as np
import pytest

DATA = pathlib.Path(__file__).parent / "data"
COLLECTIVE = re.compile(r"=\s*(.*?)\s(all-reduce|all-gather|all-to-all)(-start)?\(")


def collectives(hlo: str) -> list[tuple[str, str]]:
    """(result shape, op) for every collective in compiled HLO text."""
    return [(m.group(1), m.group(2)) for m in COLLECTIVE.finditer(hlo)]


# Why a test of XLA's output holds from jaxlib 0.10.2 on only.
UNFUSED_REDUCTIONS = (
    "with an older jaxlib, XLA's CPU backend writes a reduction's elementwise "
    "operands (squares, float32 upcasts) out whole before reducing them"
)


def _release(version: str) -> tuple[int, ...]:
    """The leading numeric components of a version: "0.9.0.1" -> (0, 9, 0, 1)."""
    return tuple(int(p) for p in itertools.takewhile(str.isdigit, version.split(".")))


def xla_output_since(jaxlib: str, why: str) -> pytest.MarkDecorator:
    """Marks a test of the HLO (or the memory) that XLA compiles, which holds
    with jaxlib `jaxlib` and later: skipped with an older jaxlib, the reason
    naming both versions and `why` it differs there.

    Only for tests of XLA's optimizations; a test of behaviour must pass on
    every version clipax supports.
    """
    installed = importlib.metadata.version("jaxlib")
    return pytest.mark.skipif(
        _release(installed) < _release(jaxlib),
        reason=f"checks XLA's compiled output as of jaxlib {jaxlib} and later "
        f"(installed: {installed}): {why}",
    )


def load_vectors() -> list[dict[str, Any]]:
    """The TensorFlow and PyTorch reference cases (copied from shared/reference)."""
    with open(DATA / "vectors.json") as f:
        return json.load(f)["cases"]


def decode(value: Any) -> Any:
    """JSON numbers with non-finite ones as strings -> nested floats."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, str):
        return float(value)
    return value


def to_array(spec: dict[str, Any] | None) -> np.ndarray | None:
    if spec is None:
        return None
    return np.asarray(decode(spec["value"]), dtype=spec["dtype"]).reshape(spec["shape"])


def ref_leaves(tree: Any) -> list[np.ndarray]:
    """Leaves as float64 (complex128) NumPy arrays."""
    out = []
    for leaf in jax.tree.leaves(tree):
        a = np.asarray(leaf)
        out.append(a.astype(np.complex128 if np.iscomplexobj(a) else np.float64))
    return out


def ref_global_norm(tree: Any, p: float = 2.0) -> float:
    """The global p-norm of `tree`, in float64 NumPy."""
    leaves = ref_leaves(tree)
    if not leaves:
        return 0.0
    flat = np.concatenate([np.abs(a).ravel() for a in leaves])
    if flat.size == 0:
        return 0.0
    if p == math.inf:
        return float(flat.max())
    scale = flat.max()
    if scale == 0 or not np.isfinite(scale):
        return float(np.sum(flat**p) ** (1 / p))
    return float(scale * np.sum((flat / scale) ** p) ** (1 / p))


def per_tensor_range(x: Any) -> str:
    """Where the per-tensor norm of `x` falls under clipax's rule
    (docs/semantics.md): "exact" where its float32 (float64 for float64
    leaves) sum of squares is a normal float well above the terms that may
    underflow; "overflow" past the largest float (an inf norm: the NaN rule);
    "underflow" below (the norm may read smaller, down to 0); "edge" within
    rounding of the largest float (either of its neighbours' outcomes)."""
    x = np.asarray(x)
    wide = x.dtype in (np.float64, np.complex128) and jax.config.read("jax_enable_x64")
    info = np.finfo(np.float64 if wide else np.float32)
    total = ref_global_norm(x) ** 2
    if total > float(info.max) * (1 + 1e-3):
        return "overflow"
    if total > float(info.max) * (1 - 1e-3):
        return "edge"
    if total < float(info.tiny) * max(x.size, 1) * 1e6:
        return "underflow"
    return "exact"


def ref_clip_by_global_norm(tree: Any, max_norm: float, p: float = 2.0) -> Any:
    """TensorFlow's formula in float64: x * max_norm / max(norm, max_norm)."""
    norm = ref_global_norm(tree, p)
    scale = max_norm / max(norm, max_norm) if norm > 0 else 1.0
    return jax.tree.map(lambda x: np.asarray(x, np.float64) * scale, tree), norm


def assert_compiles_once(step: Any, *args: Any, calls: int = 3) -> Any:
    """Runs `jax.jit(step)` `calls` times with the same shapes, feeding each
    output back in, and asserts that it traced and compiled exactly once.

    `step(*args)` must return a tuple like `args`.
    """
    traces = [0]

    def counted(*a: Any) -> Any:
        traces[0] += 1
        return step(*a)

    jitted = jax.jit(counted)
    out = args
    for _ in range(calls):
        out = jitted(*out)
    assert traces[0] == 1, f"traced {traces[0]} times over {calls} calls"
    assert jitted._cache_size() == 1, f"{jitted._cache_size()} compilations"
    return out


def state_after_compiled_steps(tx: Any, tree: Any, calls: int = 8) -> Any:
    """Runs `tx.update` `calls` times under one `jax.jit`, each step's updates
    (scaled by 1.5) being the next step's gradients; asserts that it traced and
    compiled once, and returns the last state."""

    def step(grads: Any, state: Any) -> Any:
        updates, state = tx.update(grads, state)
        return jax.tree.map(lambda u: 1.5 * u, updates), state

    return assert_compiles_once(step, tree, tx.init(tree), calls=calls)[1]


def spike_norms(steps: int = 90, spike_at: int = 50, seed: int = 0) -> np.ndarray:
    """A global-norm sequence like a training run's, with a loss spike.

    Norms fall from about 4 to 1 with 15% log-normal noise; at `spike_at` they
    jump 40-fold, the next steps decay back over a few steps, as after a bad
    batch. Positive, float64, deterministic.
    """
    rng = np.random.default_rng(seed)
    t = np.arange(steps)
    norms = (1.0 + 3.0 * np.exp(-t / 20.0)) * np.exp(0.15 * rng.standard_normal(steps))
    for k, factor in enumerate((40.0, 12.0, 4.0, 1.5)):
        if spike_at + k < steps:
            norms[spike_at + k] *= factor
    return norms


def tree_with_norm(norm: float, dtype: Any = np.float32) -> dict[str, Any]:
    """A fixed-direction tree {"w": [3, 2], "b": [2], "none": None} of L2 norm
    `norm` (the direction has norm 1)."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((3, 2))
    b = rng.standard_normal(2)
    total = math.sqrt(float(np.sum(w**2) + np.sum(b**2)))
    return {
        "w": (w * norm / total).astype(dtype),
        "b": (b * norm / total).astype(dtype),
        "none": None,
    }


def shard_rows(tree: Any) -> Any:
    """`tree` on all devices: leaves whose axis 0 the device count divides are
    split along it (NamedSharding over a 1-D mesh `"d"`), others replicated."""
    from jax.sharding import NamedSharding, PartitionSpec

    devices = jax.device_count()
    mesh = jax.make_mesh((devices,), ("d",))

    def put(x: Any) -> Any:
        rows = np.ndim(x) > 0 and np.shape(x)[0] % devices == 0
        spec = PartitionSpec("d") if rows else PartitionSpec()
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree.map(put, tree)


def run_updates(tx: Any, trees: list) -> tuple[list, list]:
    """Feeds `trees` through `tx.update` under jit; returns outputs and states.

    Each step is waited for: with several CPU devices, steps in flight together
    can fill XLA's thread pool with participants of different all-reduces,
    which then wait for each other until XLA aborts the process.
    """
    update = jax.jit(tx.update)
    state = tx.init(trees[0])
    outputs, states = [], []
    for tree in trees:
        out, state = jax.block_until_ready(update(tree, state))
        outputs.append(out)
        states.append(state)
    return outputs, states


def sharded_and_pmap_runs(make_tx: Any, spike_at: int = 50) -> tuple[list, list, list]:
    """Runs `make_tx()` over a spike sequence three ways, returns the outputs:
    on one device, on row-sharded arrays under jit, and under pmap after a
    pmean of per-device gradients whose mean is the same, saying so
    (`make_tx(specs=PartitionSpec())`: pmap's body has no varying-axes types
    to prove it). The 40 steps hold the spike of `spike_norms` when
    `spike_at` < 40."""
    rng = np.random.default_rng(0)
    direction = {"w": rng.standard_normal((8, 3)), "b": rng.standard_normal(3)}
    trees = [
        jax.tree.map(lambda d, n=n: np.asarray(d * n, np.float32), direction)
        for n in spike_norms(40, spike_at=spike_at)
    ]
    tx = make_tx()
    single, _ = run_updates(tx, trees)
    sharded, _ = run_updates(tx, [shard_rows(t) for t in trees])
    for out, tree in zip(sharded, trees, strict=True):
        want = shard_rows(tree)["w"].sharding
        assert out["w"].sharding.is_equivalent_to(want, 2)  # no resharding
    devices = jax.device_count()

    whole = make_tx(specs=jax.sharding.PartitionSpec())

    def step(grads, state):
        updates, state = whole.update(jax.lax.pmean(grads, "i"), state)
        return updates, state

    pstep = jax.pmap(step, axis_name="i")
    state = jax.tree.map(lambda x: np.stack([x] * devices), tx.init(trees[0]))
    pmapped = []
    for tree in trees:
        noise = jax.tree.map(lambda x: rng.standard_normal((devices, *x.shape)), tree)
        noise = jax.tree.map(lambda z: z - z.mean(0), noise)  # mean zero
        per_device = jax.tree.map(lambda x, z: (x + z).astype(np.float32), tree, noise)
        out, state = jax.block_until_ready(pstep(per_device, state))
        pmapped.append(jax.tree.map(lambda x: x[0], out))
    return single, sharded, pmapped


SRC = pathlib.Path(__file__).resolve().parents[1] / "src"


def with_src_path(env: dict[str, str]) -> dict[str, str]:
    """`env` with the suite's own `src` first on PYTHONPATH, so that a
    subprocess imports the clipax under test whether or not it is installed."""
    paths = [str(SRC), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


def run_script(
    script: pathlib.Path,
    *args: str,
    cwd: pathlib.Path | None = None,
    with_stderr: bool = False,
    **env: str | None,
) -> str:
    """Runs `script` with this interpreter; asserts exit 0 and returns stdout
    (followed by stderr with `with_stderr`).

    The suite's own `src` comes first on PYTHONPATH (`with_src_path`). `env`
    entries override the environment; None removes a variable.
    """
    environment = with_src_path(dict(os.environ))
    for key, value in env.items():
        if value is None:
            environment.pop(key, None)
        else:
            environment[key] = value
    result = subprocess.run(
        [sys.executable, str(script), *args],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, (
        f"{script.name} exited with {result.returncode}\n"
        f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    )
    return result.stdout + result.stderr if with_stderr else result.stdout


def equations(jaxpr: Any, inside: str = "") -> Any:
    """Every equation of `jaxpr` and of the jaxprs inside it (cond branches,
    loop bodies, custom rules), each with the outermost `cond` or `while` it
    sits in ("" at top level)."""
    for eqn in jaxpr.eqns:
        yield eqn, inside
        name = eqn.primitive.name
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    kind = name if name in ("cond", "while") else ""
                    yield from equations(inner, inside or kind)


def clip_with_norms(
    tree: Any, max_norm: float, axes: Any, specs: Any = None
) -> tuple[Any, Any]:
    """`clipax.clip_by_norm`'s update: the clipped tree and the norms it keeps."""
    import clipax

    tx = clipax.clip_by_norm(max_norm, axes, specs=specs)
    out, state = tx.update(tree, tx.init(tree))
    return out, state.norms
