"""A griffe extension that lets mkdocstrings render clipax's docstrings as written.

clipax's docstrings follow the house style (Google style, as optax): an
`Example:` section of doctest lines, and references written as reST links,
`` `Title <https://...>`_ ``. griffe knows only the plural `Examples:` (the
singular would become a note whose `>>>` lines Markdown reads as quotes), and
Markdown has no reST links. This extension rewrites both in the docstring text
that the documentation is built from; the source files are left as they are.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

EXAMPLE_HEADING = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)
REST_LINK = re.compile(r"`([^`<]+?)\s*<(https?://[^>\s]+)>`_")


def _markdown_link(match: re.Match[str]) -> str:
    title = " ".join(match.group(1).split())
    return f"[{title}]({match.group(2)})"


def to_mkdocstrings(text: str) -> str:
    """The docstring with `Example:` as `Examples:` and reST links as Markdown."""
    text = EXAMPLE_HEADING.sub(r"\1Examples:", text)
    return REST_LINK.sub(_markdown_link, text)


class ClipaxDocstrings(griffe.Extension):
    """Applies `to_mkdocstrings` to every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_mkdocstrings(obj.docstring.value)
