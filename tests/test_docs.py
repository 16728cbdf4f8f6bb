"""The `pycon` examples in the documentation pages run and print what they show.

Every fenced block marked `pycon` in `docs/*.md` is a doctest. The blocks of one
page share their names, in order, like one interactive session.
"""

from __future__ import annotations

import doctest
import re
import textwrap
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
# A fence may be indented (inside a list item); the closing fence matches it.
PYCON_BLOCK = re.compile(
    r"^(?P<indent> *)```pycon\n(?P<body>.*?)^(?P=indent)```$", re.MULTILINE | re.DOTALL
)
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def pages_with_examples() -> list[Path]:
    return [p for p in sorted(DOCS.glob("*.md")) if PYCON_BLOCK.search(p.read_text())]


def page_params() -> list:
    """The pages, those whose examples build a mesh marked as needing devices
    (getting-started.md uses 2 of the suite's 8 CPU devices)."""
    return [
        pytest.param(p, marks=pytest.mark.devices(2), id=p.name)
        if "jax.make_mesh(" in p.read_text()
        else pytest.param(p, id=p.name)
        for p in pages_with_examples()
    ]


def test_the_docs_have_examples() -> None:
    names = {p.name for p in pages_with_examples()}
    expected = {"getting-started.md", "semantics.md", "porting.md", "scaling-out.md"}
    assert expected <= names


def test_readme_links_resolve() -> None:
    """Every relative link in README.md names a file of the repository."""
    root = DOCS.parent
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (root / "README.md").read_text())
    local = [link for link in links if "://" not in link]
    assert local, "README.md links nothing"
    missing = [link for link in local if not (root / link).exists()]
    assert not missing, missing


@pytest.mark.parametrize("page", page_params())
def test_page_examples(page: Path) -> None:
    text = page.read_text()
    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    failures: list[str] = []
    globs: dict[str, object] = {}  # DocTest copies it: carried over by hand
    for match in PYCON_BLOCK.finditer(text):
        lineno = text.count("\n", 0, match.start("body"))
        body = textwrap.dedent(match.group("body"))
        test = parser.get_doctest(body, globs, page.name, str(page), lineno)
        assert test.examples, f"{page.name}, line {lineno + 1}: an empty block"
        runner.run(test, out=failures.append, clear_globs=False)
        globs = test.globs  # the next block sees this block's names
    assert not failures, "\n".join(failures)


def test_public_docstrings_are_about_as_long_as_optaxs() -> None:
    """Summary, Args, Returns, Raises, one example, a link: at most 45 lines;
    the long story (porting recipes, schedules) lives in the docs pages."""
    import inspect

    import clipax

    public = [getattr(clipax, n) for n in clipax.__all__ if n != "__version__"]
    public += [getattr(clipax.tree, n) for n in clipax.tree.__all__]
    long = {
        f.__name__: n
        for f in public
        if callable(f) and (n := len((inspect.getdoc(f) or "").splitlines())) > 45
    }
    assert not long
