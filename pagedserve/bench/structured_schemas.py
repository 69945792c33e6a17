"""The JSON Schema suite of structured output, defined once: the default-model test
(tests/engine/test_structured_default_model.py) and `bench offline --workload structured`
(bench/structured.py) both run it. Every string is bounded (`maxLength`, a pattern, an
enum), so a small model cannot run on to max_tokens inside one."""

from __future__ import annotations


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


POINT = _obj({"x": {"type": "integer", "minimum": -100, "maximum": 100},
              "y": {"type": "integer", "minimum": -100, "maximum": 100}})
#: 13 schemas: nested objects, arrays, enums, anyOf/null, $ref, a pattern, formats, numbers, const
SCHEMAS: list[dict] = [
    _obj({"person": _obj({"name": {"type": "string", "maxLength": 20},
                          "age": {"type": "integer", "minimum": 0, "maximum": 120}})}),  # nested objects
    _obj({"colors": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 4}}),
    _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}}),
    _obj({"nickname": {"anyOf": [{"type": "string", "maxLength": 15}, {"type": "null"}]}}),
    {"$defs": {"point": POINT}, **_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})},
    _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    _obj({"date": {"type": "string", "format": "date"}, "email": {"type": "string", "format": "email", "maxLength": 40}}),  # unbounded, one seed repeated "john-" to max_tokens
    _obj({"price": {"type": "number", "minimum": 0, "maximum": 1000},
          "quantity": {"type": "integer", "minimum": 1, "maximum": 10}}),
    _obj({"title": {"type": "string", "minLength": 1, "maxLength": 40}, "done": {"type": "boolean"}}),
    _obj({"items": {"type": "array", "minItems": 1, "maxItems": 3,
                    "items": _obj({"name": {"type": "string", "maxLength": 15},
                                   "qty": {"type": "integer", "minimum": 1, "maximum": 9}})}}),
    _obj({"version": {"const": 2}, "level": {"enum": [1, 2, 3]}}),
    _obj({"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0,
                                                                       "maximum": 10**9}}, required=["city"]),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 3, "maxItems": 5},
]
