"""Prints pyproject.toml's lower bounds as exact pins, one `name==version` a line.

Usage: python .ci/lower_bounds.py [EXTRA ...]

The run-time dependencies and those of each named extra, each pinned to the
version its `>=` bound names: the oldest versions clipax declares, which CI
installs into a second environment to run the suite on. A requirement
without a `>=` bound, or with an environment marker, is an error: every
declared lower bound is one the suite is run on.
"""

from __future__ import annotations

import pathlib
import re
import sys
import tomllib

PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"
# name, optional [extras], then comma-separated specifiers.
REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)$")


def pin(requirement: str) -> str:
    """`requirement` ("name[extras]>=1.2,<2") as "name[extras]==1.2"."""
    match = REQUIREMENT.match(requirement)
    if match is None or ";" in requirement:
        raise SystemExit(f"cannot pin {requirement!r}: expected name>=version")
    name, extras, specifiers = match.groups()
    lower = [s.strip()[2:].strip() for s in specifiers.split(",") if ">=" in s]
    if len(lower) != 1 or not lower[0]:
        raise SystemExit(f"{requirement!r} has no single `>=` lower bound to pin")
    return f"{name}{extras or ''}=={lower[0]}"


def main(extras: list[str]) -> None:
    with open(PYPROJECT, "rb") as f:
        project = tomllib.load(f)["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        if extra not in project["optional-dependencies"]:
            raise SystemExit(f"pyproject.toml has no extra {extra!r}")
        requirements += project["optional-dependencies"][extra]
    print("\n".join(dict.fromkeys(pin(r) for r in requirements)))


if __name__ == "__main__":
    main(sys.argv[1:])
