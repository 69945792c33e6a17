"""`StructuredOutputsParams`: the one constraint a request's output must satisfy.

It is vLLM's `structured_outputs` field, and what the gateway makes of OpenAI's
`response_format` and of a forced `tool_choice`. It travels inside `SamplingParams` (through
Redis as msgspec, like the rest), and the engine's grammar backend (a plugin of the
`pagedserve.structured_output` group, `common/contracts/structured_output.py`) compiles it.

Exactly one kind is set. Decoding is always constrained: a backend that cannot enforce some
part of the spec refuses the request, naming what it cannot enforce; it never drops it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from pagedserve.common.errors import InvalidParameterError

#: the kinds, in the order `kind` reports them
KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """One output constraint; exactly one field is set."""

    json: dict[str, Any] | str | None = None  # a JSON Schema (an object, or its JSON text)
    json_object: bool = False  # any JSON object (OpenAI's `response_format: json_object`)
    regex: str | None = None  # the whole output matches this regular expression
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # a grammar in the backend's syntax (llguidance: Lark, or GBNF)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `InvalidParameterError` unless exactly one kind is set, with the right type
        (what the backend can enforce is the backend's to check: `StructuredOutputBackend.check`)."""
        param = "structured_outputs"
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise InvalidParameterError(param, "set exactly one of json, json_object, regex, choice, grammar; "
                                               f"got {', '.join(set_kinds) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidParameterError(f"{param}.json", "must be a JSON Schema object")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidParameterError(f"{param}.{name}", "must be a non-empty string")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidParameterError(f"{param}.choice", "must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec_size(self) -> int:
        """Characters of the spec, for the size limits."""
        value = getattr(self, self.kind)
        if isinstance(value, str):
            return len(value)
        if isinstance(value, list):
            return sum(len(c) for c in value)
        if isinstance(value, dict):
            return len(msgspec.json.encode(value))
        return 0

    def cache_key(self) -> str:
        """A hash of the canonical spec: equal specs (whatever their key order) share one
        compiled grammar."""
        canonical = msgspec.json.encode(msgspec.to_builtins(self), order="sorted")
        return hashlib.sha256(canonical).hexdigest()
