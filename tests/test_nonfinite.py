"""`nonfinite="error"`: a `clipax.NonFiniteError` (a FloatingPointError) that a
user can catch, eagerly, under jit, sharded, and with no noise."""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import clipax
from tests.helpers import run_script

SCRIPT = pathlib.Path(__file__).with_name("_nonfinite_script.py")
BAD = {"w": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}
LEAF_B = r"the leaf at \['b'\] holds NaN or inf"


def test_is_a_floating_point_error() -> None:
    assert issubclass(clipax.NonFiniteError, FloatingPointError)


@pytest.mark.parametrize("transformation", [True, False])
def test_eagerly_raised_as_is(transformation: bool) -> None:
    with pytest.raises(clipax.NonFiniteError, match=LEAF_B):
        if transformation:
            tx = clipax.clip_by_global_norm(1.0, nonfinite="error")
            tx.update(BAD, tx.init(BAD))
        else:
            clipax.tree.clip_by_global_norm(BAD, 1.0, nonfinite="error")


def test_under_jit_with_nonfinite_errors(caplog: pytest.LogCaptureFixture) -> None:
    tx = clipax.clip_by_global_norm(1.0, nonfinite="error")
    update = clipax.nonfinite_errors(jax.jit(tx.update))
    with (
        caplog.at_level(logging.DEBUG),
        pytest.raises(FloatingPointError, match=LEAF_B),
    ):
        update(BAD, tx.init(BAD))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    good = {"w": jnp.ones(3), "b": jnp.array([1.0, 2.0])}
    got, state = update(good, tx.init(good))
    want, _ = jax.jit(clipax.clip_by_global_norm(1.0).update)(good, tx.init(good))
    chex.assert_trees_all_close(got, want)
    np.testing.assert_allclose(state.norm, np.sqrt(8.0), rtol=1e-6)


def _replace_failed_runtime_tokens() -> None:
    """Runs an effectful no-op on every local device.

    JAX raises a failed step's error again at interpreter exit ("Exception
    ignored in atexit callback") unless a later computation with a callback
    ran on the same devices; this is that computation, so that the tests that
    let a check fail without the wrapper leave nothing to print at exit.
    """
    devices = jax.local_devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("all",))
    x = jax.device_put(np.zeros(len(devices)), NamedSharding(mesh, P("all")))

    def no_op(x: jax.Array) -> jax.Array:
        jax.debug.callback(lambda _: None, x, partitioned=True)
        return x

    jax.block_until_ready(jax.jit(no_op)(x))


def test_without_the_wrapper_jax_raises_its_runtime_error() -> None:
    tx = clipax.clip_by_global_norm(1.0, nonfinite="error")
    match = "NonFiniteError: clip_by_global_norm: " + LEAF_B
    with pytest.raises(jax.errors.JaxRuntimeError, match=match):
        jax.block_until_ready(jax.jit(tx.update)(BAD, tx.init(BAD)))
    _replace_failed_runtime_tokens()


@pytest.mark.parametrize("wrapped_error", [None, ZeroDivisionError])
def test_once_the_wrapper_returns_the_check_raises_to_jax_again(
    wrapped_error: type[Exception] | None,
) -> None:
    """The wrapper changes what a failed check does only while it waits: after
    it returned or raised (clipax's error or another), a step run without it
    fails as JAX makes it fail."""
    tx = clipax.clip_by_global_norm(1.0, nonfinite="error")
    step = jax.jit(tx.update)

    def wrapped_run() -> Any:
        out = step(BAD, tx.init(BAD))
        if wrapped_error is not None:
            raise wrapped_error
        return out

    expected = wrapped_error or clipax.NonFiniteError
    with pytest.raises(expected):
        clipax.nonfinite_errors(wrapped_run)()
    with pytest.raises(jax.errors.JaxRuntimeError, match=LEAF_B):
        jax.block_until_ready(step(BAD, tx.init(BAD)))
    _replace_failed_runtime_tokens()
    good = {"w": jnp.ones(3), "b": jnp.array([1.0, 2.0])}
    _, state = clipax.nonfinite_errors(step)(good, tx.init(good))
    np.testing.assert_allclose(state.norm, np.sqrt(8.0), rtol=1e-6)


def test_a_runtime_error_that_carries_the_error_becomes_it() -> None:
    """What JAX raises for a step that ran without the wrapper, if it reaches
    the wrapper (as a broken step's outputs can, where dispatch is async)."""

    def broken() -> None:
        raise jax.errors.JaxRuntimeError(
            "INTERNAL: CpuCallback error calling callback: Traceback ...\n"
            "clipax.NonFiniteError: clip_by_global_norm: the leaf at ['b'] holds "
            "NaN or inf (nonfinite='error').\n"
        )

    with pytest.raises(clipax.NonFiniteError, match=LEAF_B) as info:
        clipax.nonfinite_errors(broken)()
    assert str(info.value).endswith("(nonfinite='error').")


def test_other_errors_pass_the_wrapper_unchanged() -> None:
    def broken(x: jax.Array) -> jax.Array:
        raise jax.errors.JaxRuntimeError("something else")

    with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
        clipax.nonfinite_errors(broken)(jnp.ones(2))
    with pytest.raises(ZeroDivisionError):
        clipax.nonfinite_errors(lambda: 1 / 0)()


def test_every_way_of_running_is_caught_with_no_noise() -> None:
    out = run_script(SCRIPT, with_stderr=True)
    lines = out.splitlines()
    for name in ("eager", "jit", "sharded", "shard_map", "pmap"):
        assert any(
            line.startswith(f"{name}: clip_by_global_norm: the leaf at ['b']")
            for line in lines
        ), out
    assert lines[-1] == f"finite: {float(np.float32(np.sqrt(34.0)))}", out
    assert "Traceback" not in out and "ERROR" not in out, out
    assert len(lines) == 6, out


def test_a_platform_without_a_cpu_backend_fails_at_construction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    local_devices = jax.local_devices

    def no_cpu(*args: object, backend: str | None = None, **kwargs: object) -> list:
        if backend == "cpu":
            raise RuntimeError("Unknown backend cpu")
        return local_devices(*args, backend=backend, **kwargs)

    monkeypatch.setattr(jax, "local_devices", no_cpu)
    match = r"`nonfinite`='error' .* needs a CPU backend.*JAX_PLATFORMS=cuda,cpu"
    with pytest.raises(ValueError, match=match):
        clipax.clip_by_global_norm(1.0, nonfinite="error")
    with pytest.raises(ValueError, match=match):
        clipax.tree.clip_by_global_norm(BAD, 1.0, nonfinite="error")
    clipax.clip_by_global_norm(1.0, nonfinite="nan")  # the other modes need none
