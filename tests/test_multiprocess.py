"""Two processes on this machine form one JAX runtime; clipping across them
equals clipping on one process (the worker script does the checks)."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

from tests.helpers import with_src_path

WORKER = pathlib.Path(__file__).with_name("_multiprocess_worker.py")
TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_workers(*args: str) -> list[str]:
    """Runs the two worker processes; asserts they exit 0, returns outputs."""
    port = _free_port()
    env = with_src_path({k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(port), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for i, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"process {i} failed:\n{out}"
        assert f"process {i}: OK" in out, out
    return outputs


def test_two_processes_clip_like_one() -> None:
    outputs = _run_workers()
    norms = {
        line.split("norm=")[1]
        for out in outputs
        for line in out.splitlines()
        if ": OK norm=" in line
    }
    assert len(norms) == 1, norms
    skips = {
        line.split("skips=")[1]
        for out in outputs
        for line in out.splitlines()
        if ": skips=" in line
    }
    assert skips == {"....S."}, skips  # skip_spikes decided alike everywhere


def test_nonfinite_error_is_raised_in_both_processes_with_no_noise() -> None:
    for i, out in enumerate(_run_workers("nonfinite")):
        assert f"process {i}: OK nonfinite" in out, out
        assert "Traceback" not in out and "ERROR" not in out, out
        assert "Exception ignored" not in out, out
