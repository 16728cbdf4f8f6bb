"""`nonfinite="error"`: a `clipax.NonFiniteError` (a FloatingPointError) that a
user can catch, eagerly, under jit, sharded, and with no noise."""

from __future__ import annotations

import logging
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import clipax
from clipax import _nonfinite
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


def test_without_the_wrapper_jax_raises_its_runtime_error() -> None:
    tx = clipax.clip_by_global_norm(1.0, nonfinite="error")
    match = "NonFiniteError: clip_by_global_norm: " + LEAF_B
    with pytest.raises(jax.errors.JaxRuntimeError, match=match):
        jax.block_until_ready(jax.jit(tx.update)(BAD, tx.init(BAD)))
    _nonfinite._forget_failed_tokens()  # or JAX prints it again at exit


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
