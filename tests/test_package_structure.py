"""The house rules that the import contracts (pyproject.toml, `lint-imports`, which also
forbid any import circle) cannot state: one name for one thing, and no module over 300
lines outside the models, the kernels and the benchmark runners."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pagedserve"
MAX_LINES = 300
# where long modules are allowed: a model, a kernel, a benchmark runner
LONG_ALLOWED = ("plugins/models/", "kernels/", "bench/")


def test_one_name_for_one_thing():
    """No two modules of the package share a file name (besides __init__ and main)."""
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in PACKAGE.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            by_name[path.name].append(str(path.relative_to(PACKAGE)))
    assert {name: paths for name, paths in by_name.items() if len(paths) > 1} == {}


def test_no_long_module_outside_models_kernels_and_benchmarks():
    long = {}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(LONG_ALLOWED):
            continue
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            long[relative] = lines
    assert long == {}


def test_every_kernel_source_and_header_is_package_data():
    """Workers build the C++ extension from the installed package (the images build it at image
    time), so every file of kernels/csrc must be package data: a header left out of the globs
    once failed that build in the image while every test of the checkout passed."""
    import tomllib

    from pagedserve.kernels import cpu_attention

    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]["pagedserve.kernels"]
    kernels = PACKAGE / "kernels"
    shipped = {path for pattern in globs for path in kernels.glob(pattern)}
    assert sorted(p.name for p in (kernels / "csrc").iterdir() if p.is_file()) == sorted(p.name for p in shipped)
    assert set(cpu_attention._SOURCES) | set(cpu_attention._HEADERS) <= shipped
