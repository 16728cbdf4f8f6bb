"""Runs examples/adaptive_clipping.py for a few steps and checks its figure."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).parent.parent / "examples" / "adaptive_clipping.py"


def test_adaptive_clipping_example_writes_its_figure(tmp_path):
    for module in ("matplotlib", "sklearn", "flax"):  # the `examples` extra
        pytest.importorskip(module)
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "30"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("no clipping", "fixed threshold", "AutoClip", "ZClip"):
        assert name in result.stdout
    figure = tmp_path / "adaptive_clipping.png"
    assert figure.exists()
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert figure.stat().st_size > 20_000  # three panels of curves, not a blank
