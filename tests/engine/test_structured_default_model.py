"""Structured output on the real default model (SmolLM2-135M-Instruct), sampled at
temperature 0.8: every answer satisfies its constraint and finishes by completing it."""

from __future__ import annotations

import json
import re

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.common.structured_outputs import StructuredOutputsParams


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


POINT = _obj({"x": {"type": "integer", "minimum": -100, "maximum": 100},
              "y": {"type": "integer", "minimum": -100, "maximum": 100}})
SCHEMAS = [
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
SEEDS = range(5)
REGEX = r"[A-Z][a-z]{2,8}-[0-9]{3}"
CHOICE = ["yes", "no", "maybe"]
LARK = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'


def chat(llm: LLM, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


@pytest.mark.slow
def test_default_model_answers_every_constraint():
    jsonschema = pytest.importorskip("jsonschema")
    llm = LLM(max_num_batched_tokens=1024, kv_cache_memory=1 << 30, max_num_seqs=128)
    prompts, params, checks = [], [], []
    for schema in SCHEMAS:
        prompt = chat(llm, f"Answer with one JSON value that follows this JSON Schema: {json.dumps(schema)}")
        for seed in SEEDS:
            prompts.append(prompt)
            params.append(SamplingParams(temperature=0.8, seed=seed, max_tokens=256,
                                         structured_outputs=StructuredOutputsParams(json=schema)))
            checks.append(("json", schema))
    others = [("regex", StructuredOutputsParams(regex=REGEX), "Make up a product code like Abcd-123."),
              ("choice", StructuredOutputsParams(choice=CHOICE), "Is the sky blue? Answer yes, no or maybe."),
              ("grammar", StructuredOutputsParams(grammar=LARK), "What is 6 times 7?")]
    for kind, spec, question in others:
        for seed in SEEDS:
            prompts.append(chat(llm, question))
            params.append(SamplingParams(temperature=0.8, seed=seed, max_tokens=64, structured_outputs=spec))
            checks.append((kind, None))
    outputs = llm.generate(prompts, params)
    for (kind, schema), output in zip(checks, outputs):
        completion = output.outputs[0]
        text = completion.text
        assert completion.finish_reason == "stop", (kind, schema, text)
        assert text == text.strip(), text  # no runaway whitespace
        if kind == "json":
            jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        elif kind == "choice":
            assert text in CHOICE
        else:
            assert re.fullmatch(r"The answer is [0-9]{1,3}\.", text), text
