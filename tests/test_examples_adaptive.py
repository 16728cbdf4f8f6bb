"""Runs examples/adaptive_clipping.py for a few steps and checks its figure."""

from __future__ import annotations

import os
import pathlib

import pytest

from tests import helpers

SCRIPT = pathlib.Path(__file__).parent.parent / "examples" / "adaptive_clipping.py"


def test_adaptive_clipping_example_writes_its_figure(tmp_path):
    for module in ("matplotlib", "sklearn", "flax"):  # the `examples` extra
        pytest.importorskip(module)
    stdout = helpers.run_script(
        SCRIPT,
        "--steps",
        "30",
        cwd=tmp_path,
        JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
    )
    for name in ("no clipping", "fixed threshold", "AutoClip", "ZClip"):
        assert name in stdout
    figure = tmp_path / "adaptive_clipping.png"
    assert figure.exists()
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert figure.stat().st_size > 20_000  # three panels of curves, not a blank
