"""The end of every run: how many tests each marker skipped, and why (tests/conftest.py), so a
group that skips everywhere shows instead of rotting unseen."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def _conftest():
    """A copy of tests/conftest.py's module (pytest's own is not importable by name)."""
    spec = importlib.util.spec_from_file_location("conftest_copy", Path(__file__).parent / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_marker_that_skips_says_how_many_of_its_tests_and_why():
    conftest = _conftest()
    docker = "needs a Docker engine; ops/docker-engine.sh said: dockerd is not running, and only root can start it"
    marks_of = {"a.py::t1": {"docker"}, "a.py::t2[local]": set(), "a.py::t2[container]": {"docker"},
                "b.py::t3": {"gpu"}, "b.py::t4": {"gpu"}, "c.py::t5": {"slow"}, "c.py::t6": set(),
                "d.py::t7": {"browser"}, "d.py::t8": {"browser", "slow"}}
    skipped = {"a.py::t1": docker, "a.py::t2[container]": docker, "b.py::t4": "needs a CUDA GPU (no driver)",
               "c.py::t6": "no tomllib", "d.py::t7": "needs a browser", "d.py::t8": "no chromium"}
    assert conftest.skip_summary(marks_of, skipped) == [
        "browser: 2 of 2 skipped: needs a browser (1); no chromium (1)",
        f"docker: 2 of 2 skipped: {docker}",
        "gpu: 1 of 2 skipped: needs a CUDA GPU (no driver)",
        "slow: 1 of 2 skipped: no chromium",  # a marker not known to skip shows once it does
        "no marker: 1 skipped: no tomllib (1)",
    ]


def test_the_docker_gpu_and_browser_markers_always_have_a_line_and_others_only_when_they_skip():
    conftest = _conftest()
    assert set(conftest.SKIPPING_MARKERS) == {"gpu", "docker", "browser"}
    assert conftest.skip_summary({"a.py::t1": {"docker"}, "b.py::t2": {"slow"}, "c.py::t3": {"browser"}}, {}) == [
        "browser: 0 of 1 skipped", "docker: 0 of 1 skipped"]
    assert conftest.skip_summary({}, {}) == []
