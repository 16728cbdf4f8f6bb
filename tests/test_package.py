"""The package's public surface."""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re

import optax
import pytest

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


# A private name in JAX's packages: a dotted path below jax or jaxlib with a part
# that starts with one underscore (`jax._src.dispatch`, `jaxlib._jax`); dunders
# such as `jax.__version__` are public.
_PRIVATE_PART = re.compile(r"^_(?!_)")
_JAX_PATH = re.compile(r"\bjax(?:lib)?(?:\.\w+)+")


def _private_jax_uses(source: str) -> list[str]:
    """Every private JAX module or attribute that `source` imports, reaches or
    names in a string (a module path given to `importlib` or `logging`)."""
    tree = ast.parse(source)
    roots: dict[str, str] = {}  # local name -> the jax path it is bound to
    found = []

    def check(dotted: str) -> None:
        parts = dotted.split(".")
        if parts[0] in ("jax", "jaxlib") and any(
            _PRIVATE_PART.match(part) for part in parts[1:]
        ):
            found.append(dotted)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                check(alias.name)
                local = alias.asname or alias.name.split(".")[0]
                roots[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                check(f"{node.module}.{alias.name}")
                roots[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for dotted in _JAX_PATH.findall(node.value):
                check(dotted)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain: list[str] = []
            value: ast.expr = node
            while isinstance(value, ast.Attribute):
                chain.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in roots:
                check(".".join([roots[value.id], *chain]))
    return found


@pytest.mark.parametrize(
    "source",
    [
        "from jax._src import dispatch",
        "import jax._src.dispatch",
        "from jax import _src",
        "import jax\njax._src.dispatch.runtime_tokens.clear()",
        "import jax.numpy as jnp\njnp._src",
        "import logging\nlogging.getLogger('jax._src.debugging')",
        "import importlib\nimportlib.import_module('jaxlib._jax')",
    ],
)
def test_the_private_module_check_finds(source: str) -> None:
    assert _private_jax_uses(source), source


def test_src_uses_no_private_jax_module() -> None:
    """clipax uses JAX's public API only: a JAX release that moves a private
    module must not break it."""
    src = pathlib.Path(clipax.__file__).parent
    files = sorted(src.rglob("*.py"))
    assert len(files) > 10, files
    for path in files:
        text = path.read_text()
        assert not _private_jax_uses(text), (path.name, _private_jax_uses(text))
    public = "import jax\nfrom jax import lax, tree_util\njax.__version__\nlax.psum"
    assert not _private_jax_uses(public)
