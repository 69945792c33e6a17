"""Finds plugins through Python entry points; built-ins register the same way."""

from __future__ import annotations

import logging
from importlib.metadata import entry_points
from typing import Any

from pagedserve.common.contracts import API_VERSION
from pagedserve.common.errors import PluginError

logger = logging.getLogger(__name__)

#: short kind → entry-point group
GROUPS = {
    "schedulers": "pagedserve.schedulers",
    "samplers": "pagedserve.samplers",
    "models": "pagedserve.models",
    "routers": "pagedserve.routers",
    "quantization": "pagedserve.quantization",
    "proposers": "pagedserve.proposers",
    "structured_output": "pagedserve.structured_output",
    "tool_parsers": "pagedserve.tool_parsers",
}


class PluginRegistry:
    """Loads each group once per process; a broken plugin is logged and skipped."""

    def __init__(self) -> None:
        self._loaded: dict[str, dict[str, Any]] = {}
        self._broken: dict[str, dict[str, str]] = {}

    def available(self, kind: str) -> dict[str, Any]:
        """name → factory for every plugin of `kind` that loaded and has our API_VERSION."""
        if kind not in GROUPS:
            raise PluginError(f"unknown plugin kind {kind!r}; known: {', '.join(GROUPS)}")
        if kind not in self._loaded:
            self._load(kind)
        return self._loaded[kind]

    def broken(self, kind: str) -> dict[str, str]:
        """name → why it was skipped."""
        self.available(kind)
        return self._broken[kind]

    def get(self, kind: str, name: str) -> Any:
        """The factory registered as `name`, or a `PluginError` listing the known names."""
        plugins = self.available(kind)
        if name not in plugins:
            known = ", ".join(sorted(plugins)) or "none"
            why = self._broken[kind].get(name)
            detail = f" (it failed to load: {why})" if why else ""
            single = kind.removesuffix("s")
            raise PluginError(f"unknown {single} {name!r}{detail}; known: {known}", param=single)
        return plugins[name]

    def _load(self, kind: str) -> None:
        loaded: dict[str, Any] = {}
        broken: dict[str, str] = {}
        for ep in entry_points(group=GROUPS[kind]):
            if ep.name in loaded:
                continue  # the first distribution on sys.path wins, as Python's import does
            try:
                factory = ep.load()
            except Exception as exc:  # a third-party bug must not take the worker down
                broken[ep.name] = f"{type(exc).__name__}: {exc}"
                logger.warning("skipping %s plugin %r (%s): %s", kind, ep.name, ep.value, broken[ep.name])
                continue
            version = getattr(factory, "API_VERSION", None)
            if version != API_VERSION:
                broken[ep.name] = f"API_VERSION {version!r}, this pagedserve speaks {API_VERSION}"
                logger.warning("skipping %s plugin %r (%s): %s", kind, ep.name, ep.value, broken[ep.name])
                continue
            loaded[ep.name] = factory
        self._loaded[kind] = loaded
        self._broken[kind] = broken


#: The process-wide registry.
registry = PluginRegistry()


def load_plugin(kind: str, name: str) -> Any:
    """The factory of plugin `name` of `kind` ("schedulers", "samplers", "models", "routers", "quantization")."""
    return registry.get(kind, name)
