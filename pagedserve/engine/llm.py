"""`LLM`: offline, in-process generation over the engine (the vLLM-style entry point)."""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Sequence
from typing import Any, cast

from pagedserve.common.engine_config import DEFAULT_MODEL, EngineConfig
from pagedserve.common.errors import InvalidParameterError
from pagedserve.common.outputs import RequestOutput
from pagedserve.common.sampling_params import SamplingParams
from pagedserve.engine.engine import Engine

Prompt = str | list[int]
Message = dict[str, str]

#: `LLM(speculative={...})` keys → EngineConfig fields
SPECULATIVE_KEYS = {
    "method": "speculative_method",
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_max": "prompt_lookup_max",
    "prompt_lookup_min": "prompt_lookup_min",
    "max_batch": "speculative_max_batch",
    "min_acceptance": "speculative_min_acceptance",
    "pause_steps": "speculative_pause_steps",
    "model": "speculative_model",
    "kv_memory": "speculative_kv_memory",
}


def speculative_options(settings: dict) -> dict:
    """EngineConfig fields from a vLLM-style `speculative` dict (`{"method": "ngram", ...}`)."""
    unknown = sorted(set(settings) - set(SPECULATIVE_KEYS))
    if unknown:
        raise InvalidParameterError("speculative", f"unknown keys {unknown}; known: {sorted(SPECULATIVE_KEYS)}")
    return {SPECULATIVE_KEYS[key]: value for key, value in settings.items()}


class LLM:
    """Generate from text or token ids with continuous batching, in this process.

        llm = LLM()                                   # the default model
        llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=8, temperature=0))
    """

    def __init__(self, model: str = DEFAULT_MODEL, speculative: dict | None = None, **engine_options):
        """`engine_options` are EngineConfig fields; `speculative` ({"method": "ngram",
        "num_speculative_tokens": 8, "prompt_lookup_max": 4, ...}) sets its speculative_* fields."""
        if speculative:
            engine_options.update(speculative_options(speculative))
        self.engine = Engine(EngineConfig(model=model, **engine_options))
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop what the engine started (the tensor-parallel ranks, the KV tier's writes)."""
        self.engine.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidParameterError("sampling_params", f"{len(params)} given for {len(prompts)} prompts")
        request_ids = []
        try:
            for prompt, p in zip(prompts, params):
                request_id = f"llm-{next(self._ids)}"
                self.engine.add_request(request_id, prompt, p)
                request_ids.append(request_id)
            return self._run(request_ids)
        except BaseException:
            for request_id in request_ids:  # leave the engine clean, even on Ctrl-C
                self.engine.abort_request(request_id)
            raise

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list) and generate."""
        # one conversation (a list of messages) or a list of them, told apart by the first item
        conversations = cast("list[Sequence[Message]]",
                             [messages] if messages and isinstance(messages[0], dict) else list(messages))
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params)

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        tokenizer = self.engine.tokenizer
        if not tokenizer.chat_template:
            raise InvalidParameterError("messages", "this model has no chat template")
        # token ids (tokenize=True), or a BatchEncoding of them; transformers types it as every form it can return
        ids: Any = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                                 tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        pending = set(request_ids)
        while pending:
            deltas = self.engine.step()
            assert deltas or self.engine.scheduler.has_unfinished_requests(), "requests pending but nothing scheduled"
            for delta in deltas:
                if delta.output is not None:
                    final[delta.request_id] = delta.output
                    pending.discard(delta.request_id)
        failed = [o for o in final.values() if o.error is not None]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(request_ids)} requests failed: {failed[0].error}")
        return [final[r] for r in request_ids]


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, numbers.Integral) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts
