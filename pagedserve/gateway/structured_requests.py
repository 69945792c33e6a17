"""What a request's output must satisfy, from the fields clients use to say it:

- OpenAI's `response_format`: `text` (nothing), `json_object`, or `json_schema`
  (`{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`). Decoding is
  constrained whatever `strict` says: a schema the backend cannot enforce is refused.
- vLLM's `structured_outputs` (`json`, `json_object`, `regex`, `choice`, `grammar`) and its
  older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

At most one of them may constrain a request (and none with a forced `tool_choice`); two are
a 400. Only a `StructuredOutputsParams` crosses to the engine.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pagedserve.common.errors import InvalidParameterError
from pagedserve.common.structured_outputs import StructuredOutputsParams

#: vLLM's older fields → the kind of `StructuredOutputsParams` each sets
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def from_response_format(response_format: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidParameterError("response_format.json_schema", "must be an object with `name` and `schema`")
        schema = spec.get("schema", spec.get("json_schema"))  # some clients nest it once more
        if not isinstance(schema, dict):
            raise InvalidParameterError("response_format.json_schema.schema", "must be a JSON Schema object")
        return StructuredOutputsParams(json=schema)
    raise InvalidParameterError("response_format.type", f"must be text, json_object or json_schema; got {str(kind)[:32]!r}")


def from_structured_outputs(value: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidParameterError("structured_outputs", "must be an object")
    try:
        return msgspec.convert(value, StructuredOutputsParams)
    except msgspec.ValidationError as exc:
        raise InvalidParameterError("structured_outputs", str(exc)) from None


def from_guided(fields: dict[str, Any]) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint vLLM's `guided_*` fields give, and the field that gave it."""
    given = [(name, value) for name, value in fields.items() if value is not None]
    if not given:
        return None, None
    if len(given) > 1:
        raise InvalidParameterError(given[1][0], f"only one output constraint per request; {given[0][0]} is set too")
    name, value = given[0]
    try:
        return StructuredOutputsParams(**{GUIDED_FIELDS[name]: value}), name
    except InvalidParameterError as exc:
        raise InvalidParameterError(name, exc.message.split(": ", 1)[-1]) from None


def one_constraint(candidates: list[tuple[str, StructuredOutputsParams | None]]) -> tuple[StructuredOutputsParams | None, str]:
    """The one constraint among (field, spec) pairs, and the field it came from; a 400 naming
    the second field when two are set."""
    given = [(name, spec) for name, spec in candidates if spec is not None]
    if len(given) > 1:
        raise InvalidParameterError(given[1][0], f"only one output constraint per request; {given[0][0]} is set too")
    if not given:
        return None, ""
    name, spec = given[0]
    return spec, name
