"""The fused CPU decode step inside the engine: the same greedy ids as `--enforce-eager`,
whichever path each step takes."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.kernels.cpu_attention import cpu_kernels

from engine_helpers import assert_pool_clean, mixed_prompts

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels need a C++ compiler")


def _greedy(llm: LLM, prompts, lengths) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("model_name", ["llama-gqa", "qwen3", "llama-tied"])
def test_batches_beyond_the_fused_limit_run_eagerly_with_the_same_ids(tiny_checkpoint, model_name):
    """Eight requests of different lengths with the fused step limited to 3 sequences: decode
    batches of 8 down to 4 run the model's forward, batches of 3, 2 and 1 the fused step; a
    small pool preempts, and the shared prefix of half the prompts is a prefix-cache hit.
    Every id equals the eager engine's."""
    model_dir = str(tiny_checkpoint(model_name))
    prompts = mixed_prompts(8, seed=5)
    lengths = [4, 6, 8, 10, 12, 14, 16, 18]
    options = dict(kv_cache_memory=1 << 22, max_num_batched_tokens=64)
    eager = LLM(model_dir, enforce_eager=True, **options)
    assert eager.engine.runner.fused_decoder is None
    expected = _greedy(eager, prompts, lengths)

    llm = LLM(model_dir, fused_decode_max_batch=3, **options)
    runner = llm.engine.runner
    fused = runner.fused_decoder
    assert fused is not None and fused.max_batch == 3
    decode_batches = []  # the size of every decode-only step
    prepare = runner.prepare_inputs

    def recording(entries):
        batch = prepare(entries)
        if batch.num_decodes == len(batch.query_lens):
            decode_batches.append(batch.num_decodes)
        return batch

    runner.prepare_inputs = recording
    assert _greedy(llm, prompts, lengths) == expected
    assert fused.num_steps == sum(1 for n in decode_batches if n <= 3) > 0
    assert max(decode_batches) > 3  # and larger decode steps ran eagerly
    assert llm.engine.kv_manager.pool.stats.num_hits > 0
    assert_pool_clean(llm.engine)

    # a pool too small for all eight at once: preempted sequences come back through both paths
    small = LLM(model_dir, fused_decode_max_batch=3, kv_cache_memory=1 << 16, max_num_batched_tokens=64)
    assert _greedy(small, prompts, lengths) == expected
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.runner.fused_decoder.num_steps > 0
    assert_pool_clean(small.engine)


def test_large_decode_batches_run_fused_with_the_eager_ids(tiny_checkpoint):
    """With the limit raised to 256, 24 sequences decode together (row groups and register tiles,
    rows split across threads) in the fused step, with the ids of the eager engine."""
    model_dir = str(tiny_checkpoint("llama-gqa"))
    prompts = mixed_prompts(24, seed=7)
    lengths = [6 + i % 5 for i in range(24)]
    options = dict(kv_cache_memory=1 << 23, max_num_batched_tokens=2048)
    expected = _greedy(LLM(model_dir, enforce_eager=True, **options), prompts, lengths)
    llm = LLM(model_dir, fused_decode_max_batch=256, **options)
    fused = llm.engine.runner.fused_decoder
    assert fused is not None and fused.max_batch == 256
    runner = llm.engine.runner
    decode_batches = []
    prepare = runner.prepare_inputs

    def recording(entries):
        batch = prepare(entries)
        if batch.num_decodes == len(batch.query_lens):
            decode_batches.append(batch.num_decodes)
        return batch

    runner.prepare_inputs = recording
    assert _greedy(llm, prompts, lengths) == expected
    assert max(decode_batches) == 24 and fused.num_steps == len(decode_batches)


def test_one_request_decodes_in_the_fused_step(tiny_checkpoint):
    model_dir = str(tiny_checkpoint("qwen2"))
    prompt = mixed_prompts(4, seed=1)[0]
    llm = LLM(model_dir, kv_cache_memory=1 << 22)
    got = _greedy(llm, [prompt], [20])
    assert got == _greedy(LLM(model_dir, enforce_eager=True, kv_cache_memory=1 << 22), [prompt], [20])
    assert llm.engine.runner.fused_decoder.num_steps == 19  # every step after the prefill


def test_fused_decode_is_off_where_it_cannot_run(tiny_checkpoint):
    model_dir = str(tiny_checkpoint("llama-gqa"))
    assert LLM(model_dir, fused_decode_max_batch=0, kv_cache_memory=1 << 22).engine.runner.fused_decoder is None
    assert LLM(model_dir, dtype="bfloat16", kv_cache_memory=1 << 22).engine.runner.fused_decoder is None
    # another attention backend chosen: its kernels run every step
    assert LLM(model_dir, attention_backend="torch", kv_cache_memory=1 << 22).engine.runner.fused_decoder is None


@pytest.mark.parametrize("model_name", ["llama-gqa", "qwen2"])
def test_fused_steps_with_blas_products_keep_the_eager_ids(tiny_checkpoint, model_name):
    """`fused_decode_blas_rows=4`: fused decode steps of 4 rows and more run their float32
    products (and the LM head) through torch's BLAS, smaller ones our own kernels; the ids equal
    the eager engine's, and the step's hidden states and logits its forward's (qwen2: a bias on
    q/k/v, through addmm)."""
    from engine_helpers import assert_fused_step_equals_eager

    model_dir = str(tiny_checkpoint(model_name))
    prompts = mixed_prompts(10, seed=3)
    lengths = [5 + i % 4 for i in range(10)]
    # unpacked weights: packed ones always run the packed product, whatever blas_rows says
    options = dict(kv_cache_memory=1 << 23, max_num_batched_tokens=2048, pack_cpu_weights=False)
    expected = _greedy(LLM(model_dir, enforce_eager=True, **options), prompts, lengths)
    llm = LLM(model_dir, fused_decode_max_batch=256, fused_decode_blas_rows=4, **options)
    fused = llm.engine.runner.fused_decoder
    assert fused is not None and fused.blas_rows == 4
    calls = []
    forward = fused.forward

    def counting(batch):
        calls.append(batch.num_decodes)
        return forward(batch)

    fused.forward = counting
    assert _greedy(llm, prompts, lengths) == expected
    assert max(calls) == 10 and min(calls) < 4  # both kinds of step ran
    assert_fused_step_equals_eager(LLM(model_dir, fused_decode_blas_rows=1, kv_cache_memory=1 << 22,
                                       pack_cpu_weights=False).engine)


def test_blas_rows_must_not_be_negative():
    from pagedserve.common.engine_config import EngineConfig
    from pagedserve.common.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="must be >= 0"):
        EngineConfig(fused_decode_blas_rows=-1)
    assert EngineConfig().fused_decode_blas_rows == 0


def test_the_fused_step_takes_every_default_batch_in_float32_and_packed_int8_and_16_rows_of_unpacked_int8(
        tiny_checkpoint):
    model_dir = str(tiny_checkpoint("llama-gqa"))
    assert LLM(model_dir, kv_cache_memory=1 << 22).engine.runner.fused_decoder.max_batch == 256
    assert LLM(model_dir, kv_cache_memory=1 << 22, max_num_seqs=40).engine.runner.fused_decoder.max_batch == 40
    int8 = LLM(model_dir, kv_cache_memory=1 << 22, quantization="int8").engine.runner.fused_decoder
    assert int8.max_batch == 256 and int8.max_query_len == 1  # packed int8: the product of every row count
    int8 = LLM(model_dir, kv_cache_memory=1 << 22, quantization="int8", pack_cpu_weights=False).engine.runner
    assert int8.fused_decoder.max_batch == 16 and int8.fused_decoder.max_query_len == 1
    spec = LLM(model_dir, kv_cache_memory=1 << 22, max_num_seqs=2, speculative={"method": "ngram"})
    # ngram's default of 8 drafts: 9 rows a sequence, 2 sequences
    assert (spec.engine.runner.fused_decoder.max_batch, spec.engine.runner.fused_decoder.max_query_len) == (18, 9)
