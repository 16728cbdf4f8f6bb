"""Two processes on this machine form one JAX runtime; clipping across them
equals clipping on one process (the worker script does the checks)."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

WORKER = pathlib.Path(__file__).with_name("_multiprocess_worker.py")
TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_processes_clip_like_one() -> None:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(port)],
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
    norms = {
        line.split("norm=")[1]
        for out in outputs
        for line in out.splitlines()
        if ": OK norm=" in line
    }
    assert len(norms) == 1, norms
