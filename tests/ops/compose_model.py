"""compose.yaml read the way Docker Compose reads it, for the tests that run without Docker:
variables resolved from `${NAME:-default}`, and the services a set of profiles starts."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
ENV_FILE = ROOT / ".env"
PROMETHEUS_FILE = ROOT / "ops" / "prometheus.yml"

#: `${NAME:-default}` (compose's interpolation with a default); `$$` is a literal dollar
VARIABLE = re.compile(r"(?<!\$)\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<op>:-|-|:\?|\?)?(?P<default>[^}]*)\}")


def load_compose() -> dict[str, Any]:
    """compose.yaml as YAML (anchors and merge keys resolved, variables not)."""
    return yaml.safe_load(COMPOSE_FILE.read_text())


def variables(text: str) -> list[tuple[str, str | None]]:
    """Every `${...}` of `text`: (name, default), the default None when the form gives none."""
    return [(m["name"], m["default"] if m["op"] == ":-" else None) for m in VARIABLE.finditer(text)]


def resolve(value: str, environ: Mapping[str, str] = {}) -> str:
    """A compose string with its `${NAME:-default}` replaced: the environment, else the default."""
    return VARIABLE.sub(lambda m: environ.get(m["name"]) or m["default"], value)


def dotenv() -> dict[str, str]:
    """The .env file beside compose.yaml (NAME=value lines, # comments)."""
    pairs = (line.split("=", 1) for line in ENV_FILE.read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#"))
    return {name.strip(): value.strip() for name, value in pairs}


def active_services(compose: dict[str, Any], cli_profiles: list[str], environ: Mapping[str, str]) -> set[str]:
    """The services `docker compose [--profile P ...] up` starts: those in no profile, and
    those in an active one. The --profile flags, when given, replace COMPOSE_PROFILES (from
    the environment, else .env) — Compose's rule."""
    active = set(cli_profiles) or {p for p in environ.get("COMPOSE_PROFILES", "").split(",") if p}
    return {name for name, service in compose["services"].items()
            if not service.get("profiles") or active & set(service["profiles"])}
