"""Shared fixtures: tiny random checkpoints, and markers that skip cleanly."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# In-process tests run the Triton kernels in Triton's interpreter, on CPU tensors, GPU or
# not (the variable is read when a kernel is defined, so it is set before any test imports
# one). The `gpu` test runs them compiled, in a subprocess without it.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`-n N`, as `make test` runs the suite) each worker process gets its
# share of the cores for torch's intra-op threads, so N workers do not each spin up a thread
# per core and fight over them (torch's default is one per core).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

from tiny_models import build_checkpoint  # noqa: E402

ROOT = Path(__file__).parents[1]
#: where ops/docker-engine.sh writes its outcome (`make test-docker` runs it before the tests)
DOCKER_ENGINE_STATUS = Path(os.environ.get("PAGEDSERVE_DOCKER_ENGINE_STATUS", ROOT / ".cache" / "docker-engine.status"))


def _docker_engine_missing() -> str | None:
    """Why no Docker engine answers (None: one does), asked once per session: the CLI and a
    socket file are not enough (CI may have /var/run/docker.sock with no daemon behind it).
    Where ops/docker-engine.sh failed to start one, its reason comes first."""
    if shutil.which("docker") is None:
        why = "no `docker` command"
    else:
        try:
            info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                                  timeout=15)
        except subprocess.TimeoutExpired:
            why = "`docker info` did not answer within 15 s"
        else:
            if info.returncode == 0:
                return None
            why = "`docker info`: " + (info.stderr.strip().splitlines() or [f"exit status {info.returncode}"])[-1]
    try:
        status = DOCKER_ENGINE_STATUS.read_text().strip()
    except OSError:
        status = ""
    if status.startswith("docker engine unavailable:"):
        return f"needs a Docker engine; ops/docker-engine.sh said: {status.removeprefix('docker engine unavailable: ')}"
    return f"needs a Docker engine ({why}; ops/docker-engine.sh starts one)"


def _gpu_missing() -> str | None:
    try:
        import torch
    except ImportError:
        return "needs a CUDA GPU (torch is not installed)"
    return None if torch.cuda.is_available() else "needs a CUDA GPU (torch.cuda.is_available() is False)"


#: the Chromium the browser tests drive: Debian's package (never a browser Playwright downloads)
CHROMIUM = os.environ.get("PAGEDSERVE_CHROMIUM", "/usr/bin/chromium")


def _browser_missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "needs the playwright Python package (the dev extra)"
    if not os.access(CHROMIUM, os.X_OK):
        return f"needs Chromium at {CHROMIUM} (apt-get install chromium; or set PAGEDSERVE_CHROMIUM)"
    return None


#: the markers whose tests skip where this machine lacks something: marker → why (None: it has it)
SKIPPING_MARKERS = {"gpu": _gpu_missing, "docker": _docker_engine_missing, "browser": _browser_missing}


def pytest_collection_modifyitems(config, items):
    for marker, missing in SKIPPING_MARKERS.items():
        marked = [item for item in items if marker in item.keywords]
        reason = missing() if marked else None
        for item in marked if reason else []:
            item.add_marker(pytest.mark.skip(reason=reason))


# -- at the end of the run: how many tests each marker skipped, and why ---------------------
# So a group that skips everywhere (and rots, since nothing runs it) shows in every run's
# output rather than hiding in the "N skipped" count.
_marks_of: dict[str, set[str]] = {}  # test id → its markers registered in pyproject.toml


#: pytest's own markers: a test they skip counts as "no marker"
_PYTEST_MARKERS = {"skip", "skipif", "xfail", "parametrize", "usefixtures", "filterwarnings", "tryfirst", "trylast"}


def _registered_markers(config) -> set[str]:
    """The markers pyproject.toml and the plugins register, but pytest's own."""
    return {line.split(":")[0].split("(")[0].strip() for line in config.getini("markers")} - _PYTEST_MARKERS


def pytest_collection_finish(session):
    registered = _registered_markers(session.config)
    _marks_of.clear()
    for item in session.items:  # those selected (after -m and -k)
        _marks_of[item.nodeid] = {mark.name for mark in item.iter_markers()} & registered


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    """Under pytest-xdist the controller, which writes the summary, collects nothing: a test's
    markers come with its setup report (its keywords hold its markers' names)."""
    if report.when == "setup" and report.nodeid not in _marks_of and _config is not None:
        _marks_of[report.nodeid] = set(report.keywords) & _registered_markers(_config)


_config = None


def pytest_configure(config):
    global _config
    _config = config


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def skip_summary(marks_of: dict[str, set[str]], skipped: dict[str, str]) -> list[str]:
    """One line per marker of SKIPPING_MARKERS that has selected tests, and per other marker
    that skipped any: how many of its tests it skipped, and why; then the skipped tests that
    no registered marker names. `skipped`: test id → its skip reason."""
    lines = []
    for marker in sorted({m for marks in marks_of.values() for m in marks}):
        tests = [t for t, marks in marks_of.items() if marker in marks]
        reasons: dict[str, int] = {}
        for test in tests:
            if test in skipped:
                reasons[skipped[test]] = reasons.get(skipped[test], 0) + 1
        if not reasons and marker not in SKIPPING_MARKERS:
            continue
        why = "; ".join(f"{reason} ({n})" if len(reasons) > 1 else reason for reason, n in reasons.items())
        count = sum(reasons.values())
        lines.append(f"{marker}: {count} of {len(tests)} skipped" + (f": {why}" if why else ""))
    unmarked: dict[str, int] = {}
    for test, reason in skipped.items():
        if not marks_of.get(test):
            unmarked[reason] = unmarked.get(reason, 0) + 1
    if unmarked:
        lines.append(f"no marker: {sum(unmarked.values())} skipped: "
                     + "; ".join(f"{reason} ({n})" for reason, n in unmarked.items()))
    return lines


def pytest_terminal_summary(terminalreporter, config):
    if config.option.collectonly:
        return
    skipped = {report.nodeid: _skip_reason(report) for report in terminalreporter.stats.get("skipped", [])}
    lines = skip_summary(_marks_of, skipped)
    if lines:
        terminalreporter.write_sep("=", "skipped, by marker")
        for line in lines:
            terminalreporter.write_line(line)


#: name → (kind, config overrides): GQA and MHA, odd head counts
TINY_MODELS = {
    "llama-gqa": ("llama", {}),
    "llama-mha-odd": ("llama", {"hidden_size": 60, "num_attention_heads": 5, "num_key_value_heads": 5, "head_dim": 12}),
    "llama3-rope": ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 64}}),
    "qwen2": ("qwen2", {"num_attention_heads": 3, "num_key_value_heads": 1, "hidden_size": 96, "head_dim": 32}),
    "qwen3": ("qwen3", {"num_attention_heads": 7, "num_key_value_heads": 1, "hidden_size": 112, "head_dim": 16}),
    "mistral": ("mistral", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),  # the LM head is the embedding, as in SmolLM2
    "llama-vocab8": ("llama", {"vocab_size": 8}),  # distributions small enough to test by counting
    # a draft model for speculative decoding: the llama models' tokenizer, one smaller layer
    "llama-draft": ("llama", {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "intermediate_size": 96}),
}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Call with a name from TINY_MODELS; each checkpoint is written once per session."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            kind, overrides = TINY_MODELS[name]
            made[name] = build_checkpoint(kind, tmp_path_factory.mktemp(name), **overrides)
        return made[name]

    return get
