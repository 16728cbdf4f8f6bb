"""The package's public surface."""

from __future__ import annotations

import importlib.metadata
import pathlib
import re

import optax

import clipax


def test_public_names_are_exported_and_documented() -> None:
    for name in clipax.__all__:
        obj = getattr(clipax, name)
        if name in ("__version__", "tree"):
            continue
        documented = obj.__doc__ and "Example:" in obj.__doc__
        assert documented or name.endswith("State"), name
    for name in clipax.tree.__all__:
        doc = getattr(clipax.tree, name).__doc__
        assert doc and "Example:" in doc and "Args:" in doc, name


def test_transformations_are_gradient_transformations() -> None:
    for tx in (
        clipax.clip(1.0),
        clipax.clip_by_value(-1.0, 1.0),
        clipax.clip_by_norm(1.0),
        clipax.clip_by_global_norm(1.0),
    ):
        assert isinstance(tx, optax.GradientTransformation)


def test_version_and_typing_marker() -> None:
    assert clipax.__version__ == importlib.metadata.version("clipax")
    assert (pathlib.Path(clipax.__file__).parent / "py.typed").exists()


def test_ci_runs_the_readme_test_command() -> None:
    # CI builds the README's environment once, with the README's extras among
    # its own, and runs the README's test command in it.
    root = pathlib.Path(__file__).parent.parent
    readme = (root / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = [
        line for line in quick.splitlines() if line.startswith("python3 -m venv")
    ]
    assert len(commands) == 2, commands
    assert "examples/quickstart.py" in commands[0]
    make, install, test = commands[1].split(" && ")
    ci = (root / ".ci" / "run").read_text().splitlines()
    assert ci.count(make) == 1, make
    extras = re.compile(r'\.venv/bin/pip install (?:-q )?-e "\.\[([\w,-]+)\]"')
    wanted = extras.fullmatch(install)
    assert wanted, install
    installs = [m for m in map(extras.fullmatch, ci) if m]
    assert len(installs) == 1, installs
    assert set(wanted[1].split(",")) <= set(installs[0][1].split(","))
    assert test in ci, test
