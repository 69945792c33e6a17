"""What the runner builds each step: the decode fast path's `ModelInput` and the sampling
settings it keeps from one step to the next."""

from __future__ import annotations

import numpy as np
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.common.contracts import Request, ScheduledRequest
from pagedserve.engine.sampling_inputs import SamplingInputs


def _request(i: int, **params) -> Request:
    return Request(f"r{i}", list(range(3, 3 + 10 + i)), SamplingParams(**params), frozenset(), max_tokens=8)


def test_the_decode_fast_path_builds_what_the_general_path_builds(tiny_checkpoint):
    engine = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22).engine
    entries = []
    for i, length in enumerate([5, 16, 17, 40]):
        request = Request(f"r{i}", list(range(3, 3 + length)), SamplingParams(), frozenset(), max_tokens=4)
        assert engine.kv_manager.allocate_slots(request, length)
        request.num_computed_tokens = length - 1
        entries.append(ScheduledRequest(request, 1, engine.kv_manager.block_ids(request)))
    # the last one is a prompt's one-token chunk that does not end it: nothing to sample
    entries[3].request.prompt_token_ids.append(7)
    entries[3].request.token_ids.append(7)
    fast = engine.runner.prepare_inputs(entries)
    general = engine.runner._prepare_mixed(entries)
    for field in ("input_ids", "query_lens", "seq_lens", "num_decodes", "sample_rows", "sample_entries"):
        assert getattr(fast, field) == getattr(general, field), field
    for field in ("positions", "slots", "block_tables"):
        assert np.array_equal(getattr(fast, field), getattr(general, field)), field
    assert fast.sample_entries == [0, 1, 2]


def test_sampling_settings_are_kept_while_the_rows_are_the_same():
    inputs = SamplingInputs(vocab_size=100, device=torch.device("cpu"))
    a, b = _request(0, temperature=0.7, top_k=5), _request(1, temperature=0.0)
    first = inputs.for_rows([a, b])
    assert inputs.for_rows([a, b]) is first and inputs.num_built == 1
    swapped = inputs.for_rows([b, a])  # another order: other rows
    assert swapped is not first and inputs.num_built == 2
    assert torch.equal(swapped.temperature, torch.tensor([0.0, 0.7]))
    c = _request(1, temperature=0.0)  # equal settings and id, another request object
    assert inputs.for_rows([c, a]) is not swapped and inputs.num_built == 3


def test_settings_that_change_with_the_tokens_are_built_every_step():
    inputs = SamplingInputs(vocab_size=100, device=torch.device("cpu"))
    penalised = _request(0, repetition_penalty=1.2)
    inputs.for_rows([penalised])
    inputs.for_rows([penalised])
    assert inputs.num_built == 2
    held_back = _request(1, min_tokens=2)  # EOS is banned until two tokens are out
    held_back.eos_token_ids = frozenset({1})
    assert inputs.for_rows([held_back]).banned_token_ids == {0: [1]}
    held_back.token_ids += [5, 6]
    assert inputs.for_rows([held_back]).banned_token_ids == {}
    assert inputs.num_built == 4
