"""What the images install, checked without Docker: ops/requirements.py's lists, and that
the gateway's command runs with none of what its image leaves out."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest
from compose_model import ROOT

pytest.importorskip("tomllib")  # ops/requirements.py runs on the images' Python 3.11+


def _load_requirements_script():
    spec = importlib.util.spec_from_file_location("ops_requirements", ROOT / "ops" / "requirements.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_script = _load_requirements_script()
requirement_name, requirements = _script.requirement_name, _script.requirements
PYPROJECT = ROOT / "pyproject.toml"
#: what ops/gateway.Dockerfile leaves out (its --exclude), and ops/worker.Dockerfile's CPU default
GATEWAY_EXCLUDES = ["torch", "triton", "transformers", "safetensors", "ninja"]


def _dockerfile_excludes(name: str) -> list[str]:
    text = (ROOT / "ops" / name).read_text()
    line = next(line for line in text.splitlines() if "--exclude" in line)
    return [word for word in line.split("--exclude", 1)[1].split(">")[0].split() if word != "\\"]


def test_the_gateway_image_leaves_out_the_engine_and_keeps_the_rest():
    assert _dockerfile_excludes("gateway.Dockerfile") == GATEWAY_EXCLUDES
    every = requirements(PYPROJECT, [], [])
    kept = requirements(PYPROJECT, [], GATEWAY_EXCLUDES)
    assert sorted(requirement_name(r) for r in every if r not in kept) == sorted(GATEWAY_EXCLUDES)
    assert {"litestar", "uvicorn", "redis", "msgspec", "tokenizers", "jinja2", "numpy"} <= {requirement_name(r) for r in kept}


def test_the_cpu_worker_image_leaves_out_triton_only_and_adds_the_pull_extra():
    assert _dockerfile_excludes("worker.Dockerfile") == ["torch", "$EXCLUDE"]
    assert "ARG EXCLUDE=triton" in (ROOT / "ops" / "worker.Dockerfile").read_text()
    names = [requirement_name(r) for r in requirements(PYPROJECT, ["pull"], ["torch", "triton"])]
    every = [requirement_name(r) for r in requirements(PYPROJECT, ["pull"], [])]
    assert [n for n in every if n not in names] == ["torch", "triton"]
    assert names[-2:] == ["gguf", "accelerate"]


def test_requirement_names_are_normalized():
    assert [requirement_name(r) for r in ["Torch>=2.5", "triton>=3.2; platform_system == 'Linux'", "typing_extensions",
                                          "zope.interface==1"]] == ["torch", "triton", "typing-extensions", "zope-interface"]


def test_the_gateway_command_imports_nothing_its_image_leaves_out():
    """`pagedserve gateway`'s imports, up to building the app, with the left-out packages
    made unimportable: what the gateway image runs."""
    script = textwrap.dedent(f"""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {GATEWAY_EXCLUDES!r}:
                    raise ImportError("the gateway image has no " + name)
        sys.meta_path.insert(0, Block())
        from pagedserve.entrypoints.cli import build_parser
        import pagedserve.gateway.server
        build_parser().parse_args(["gateway", "--help"])
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage: pagedserve gateway" in result.stdout
