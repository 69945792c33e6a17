"""Print pagedserve's requirements from pyproject.toml, one a line, less some by name.

The images install pagedserve with `pip install --no-deps` and their requirements from this
list, so pyproject.toml stays the one place versions are written: the gateway leaves out
torch and everything only the engine needs, the CPU worker leaves out Triton.

    python3 ops/requirements.py [--extra pull] [--exclude torch triton ...] [pyproject.toml]

Needs Python 3.11+ (tomllib), which every base image of ops/ has.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import tomllib


def requirement_name(requirement: str) -> str:
    """The normalized project name of a PEP 508 requirement ("Torch>=2.5; ..." -> "torch")."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements(pyproject: Path, extras: list[str], exclude: list[str]) -> list[str]:
    """The project's dependencies plus those of `extras`, without the names in `exclude`."""
    project = tomllib.loads(pyproject.read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in extras:
        wanted += project["optional-dependencies"][extra]
    dropped = {requirement_name(name) for name in exclude}
    return [req for req in wanted if requirement_name(req) not in dropped]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject", nargs="?", default=str(Path(__file__).parent.parent / "pyproject.toml"))
    parser.add_argument("--extra", action="append", default=[], help="an optional-dependencies group to add")
    parser.add_argument("--exclude", nargs="*", default=[], help="project names to leave out")
    args = parser.parse_args(argv)
    for line in requirements(Path(args.pyproject), args.extra, args.exclude):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
