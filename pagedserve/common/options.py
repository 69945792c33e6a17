"""Command-line flags for config Structs: one flag per field, `PAGEDSERVE_<FIELD>` in the
environment as the fallback, then the Struct's default. Values are converted by msgspec."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

import msgspec

from pagedserve.common.errors import InvalidParameterError


def _is_bool(field: msgspec.structs.FieldInfo) -> bool:
    return field.type is bool or field.type == (bool | None)  # None: "decide for me" (auto)


def add_arguments(parser: argparse.ArgumentParser, struct_type: type, skip: tuple[str, ...] = ()) -> None:
    for f in msgspec.structs.fields(struct_type):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        env = "PAGEDSERVE_" + f.name.upper()
        help_text = f"(env {env}; default {f.default!r})"
        if _is_bool(f):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper(), help=help_text)


def build(struct_type: type, args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None,
          **overrides: Any):
    """The Struct from overrides, then flags, then the environment, then its defaults."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in msgspec.structs.fields(struct_type):
        value = overrides.get(f.name)
        if value is None and args is not None:
            value = getattr(args, f.name, None)
        if value is None:
            value = environ.get("PAGEDSERVE_" + f.name.upper())
            if value is not None and value.lower() in ("", "none", "null") and f.default is None:
                value = None
        if isinstance(value, str) and f.name.endswith("memory") and value.lower() not in ("", "none", "null"):
            from pagedserve.common.planner import parse_bytes  # noqa: PLC0415 - only for sizes

            try:
                value = parse_bytes(value)  # "8GiB" as well as "8589934592"
            except InvalidParameterError as exc:
                raise InvalidParameterError(f.name, str(exc).split(": ", 1)[-1]) from None
        if value is not None:
            values[f.name] = value
    try:
        return msgspec.convert(values, struct_type, strict=False)
    except msgspec.ValidationError as exc:
        param = str(exc).rsplit("`$.", 1)[-1].rstrip("`") if "`$." in str(exc) else "config"
        raise InvalidParameterError(param, str(exc)) from None


def to_flags(struct: msgspec.Struct) -> list[str]:
    """Flags that rebuild `struct` in another process (fields that differ from the default)."""
    flags: list[str] = []
    for f in msgspec.structs.fields(type(struct)):
        value = getattr(struct, f.name)
        if value == f.default or value is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        if _is_bool(f):
            flags.append(flag if value else "--no-" + f.name.replace("_", "-"))
        else:
            flags += [flag, str(value)]
    return flags
