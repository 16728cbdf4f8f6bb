"""Test set-up: the devices JAX sees, the `devices` marker, hypothesis profiles,
and how many processes run the suite.

By default (and in CI) the suite runs on 8 CPU devices, forced before JAX is
imported. `CLIPAX_TEST_DEVICES=native` keeps the machine's own backend and
devices instead (a GPU machine: `CLIPAX_TEST_DEVICES=native python -m pytest`);
tests marked `@pytest.mark.devices(n)` then skip where fewer than n devices
exist, saying so.
"""

import os
from typing import Any

DEVICES = os.environ.get("CLIPAX_TEST_DEVICES", "cpu8")
if DEVICES not in ("cpu8", "native"):
    raise ValueError(
        f"CLIPAX_TEST_DEVICES must be 'cpu8' (default: 8 CPU devices) or 'native' "
        f"(the default backend and its devices); got {DEVICES!r}."
    )
if DEVICES == "cpu8":
    # Must run before JAX is imported anywhere in the test session.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "devices(n): needs at least n JAX devices; skipped with fewer "
        "(CLIPAX_TEST_DEVICES=native on a machine with fewer)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("devices"):
        needed = int(mark.args[0])
        if jax.device_count() < needed:
            pytest.skip(
                f"needs {needed} devices; JAX has {jax.device_count()} "
                f"({jax.default_backend()}, CLIPAX_TEST_DEVICES={DEVICES})"
            )


@pytest.fixture
def state_registry(monkeypatch: pytest.MonkeyPatch) -> Any:
    """`clipax._states`, which forgets after the test the classes it declares."""
    from clipax import _states

    monkeypatch.setattr(_states, "DECLARED", dict(_states.DECLARED))
    return _states


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """How many processes `-n auto` (pyproject.toml's addopts) runs the
    suite in: one per CPU core, at most 4 (one process grew to 4 GB over
    the suite), or none (the suite runs in this process) with
    CLIPAX_TEST_DEVICES=native, where each process would take the whole
    accelerator. PYTEST_XDIST_AUTO_NUM_WORKERS overrides it."""
    del config
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # pytest-xdist reads it
    if DEVICES == "native":
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    return min(cores or os.cpu_count() or 1, 4)


def pytest_report_header() -> str:
    return (
        f"clipax: CLIPAX_TEST_DEVICES={DEVICES}, JAX backend "
        f"{jax.default_backend()} with {jax.device_count()} devices"
    )


hypothesis.settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
    derandomize=True,
)
hypothesis.settings.register_profile(
    "dev",
    max_examples=30,
    deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
