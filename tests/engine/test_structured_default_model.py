"""Structured output on the real default model (SmolLM2-135M-Instruct), sampled at
temperature 0.8: every answer satisfies its constraint and finishes by completing it."""

from __future__ import annotations

import json
import re

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.bench.structured_schemas import SCHEMAS
from pagedserve.common.structured_outputs import StructuredOutputsParams

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
