"""The one-off benchmark scripts of `benchmarks/` (not installed), imported by file path as
`python benchmarks/NAME.py` runs them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/NAME.py as a module (its own folder on sys.path, as when run as a script)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def benchmark_command(name: str, *args: str) -> list[str]:
    """The command line that runs benchmarks/NAME.py with this interpreter."""
    return [sys.executable, str(BENCHMARKS / f"{name}.py"), *args]
