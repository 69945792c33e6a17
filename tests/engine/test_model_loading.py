"""Checkpoints: sharded safetensors, tied embeddings, dtypes, logprobs in the outputs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pagedserve import LLM, SamplingParams

from engine_helpers import hf_greedy, mixed_prompts
from tiny_models import build_checkpoint


def test_sharded_checkpoint_with_tied_embeddings(tmp_path):
    from transformers import AutoModelForCausalLM

    single = build_checkpoint("llama", tmp_path / "single", tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(single)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((single / name).read_bytes())
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "lm_head.weight" not in index["weight_map"]
    prompts = mixed_prompts()[:4]
    llm = LLM(str(sharded), kv_cache_memory=1 << 22)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))]
    assert ours == hf_greedy(single, prompts, 8)


def test_float16_engine_runs(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("qwen2")), dtype="float16", kv_cache_memory=1 << 22)
    assert llm.engine.runner.dtype == torch.float16
    assert llm.engine.runner.kv_caches[0].dtype == torch.float16
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5


def test_logprobs_report_the_sampled_token_and_top_n(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_checkpoint("llama-gqa")
    llm = LLM(str(model_dir), kv_cache_memory=1 << 22)
    prompt = [7, 8, 9, 10]
    out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2))[0].outputs[0]
    assert len(out.logprobs) == 3
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1], -1)
    first = out.logprobs[0]
    assert first.sampled.token_id == out.token_ids[0] == int(expected.argmax())
    assert [t.token_id for t in first.top] == expected.topk(2).indices.tolist()
    assert math.isclose(first.sampled.logprob, float(expected.max()), abs_tol=1e-4)
    assert first.top[0].token == llm.get_tokenizer().decode([first.top[0].token_id])


def test_dummy_load_format_needs_no_weights(tiny_checkpoint, tmp_path):
    """`load_format="dummy"`: config.json and a tokenizer are enough; the weights are seeded
    random ones, the same on every load, and generation runs on them."""
    import shutil

    src = tiny_checkpoint("llama-gqa")
    bare = tmp_path / "bare"
    shutil.copytree(src, bare, ignore=shutil.ignore_patterns("*.safetensors*"))
    assert not list(bare.glob("*.safetensors"))
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(str(bare), load_format="dummy", kv_cache_memory=1 << 20)
        model = llm.engine.runner.model
        assert torch.equal(model.layers[0].input_layernorm.weight, torch.ones(96))
        std = float(model.layers[1].mlp.down_proj.weight.std())
        assert 0.019 < std < 0.021
        runs.append(([p.clone() for p in model.parameters()], llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    assert runs[0][1] == runs[1][1] and len(runs[0][1]) == 5
    with pytest.raises(FileNotFoundError, match="no safetensors"):
        LLM(str(bare), kv_cache_memory=1 << 20)


def test_bfloat16_on_a_cpu_without_bf16_instructions_warns(monkeypatch, caplog):
    import platform

    from pagedserve.engine import device

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    with caplog.at_level("WARNING", logger=device.__name__):
        assert device.resolve_dtype("bfloat16", None, torch.device("cpu")) == torch.bfloat16
        assert device.resolve_dtype("float32", None, torch.device("cpu")) == torch.float32
    assert [r.message for r in caplog.records if "no bfloat16 instructions" in r.message] != []
    assert len(caplog.records) == 1
    caplog.clear()
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    with caplog.at_level("WARNING", logger=device.__name__):
        device.resolve_dtype("bfloat16", None, torch.device("cpu"))
    assert caplog.records == []


def test_auto_quantization_is_int8_with_its_head_for_float32_on_cpu_only():
    """`--quantization auto` (what `pagedserve serve` runs when none is named): int8 and an int8
    LM head for a float32 model on CPU; the weights as they are on a GPU, in bfloat16, and for
    a checkpoint quantized already; "none" means None; a named method passes unchanged."""
    from types import SimpleNamespace

    from pagedserve.common.engine_config import EngineConfig
    from pagedserve.engine.model_loader import resolve_quantization

    cpu, cuda, plain = torch.device("cpu"), torch.device("cuda"), SimpleNamespace()
    gptq = SimpleNamespace(quantization_config={"quant_method": "gptq", "bits": 4})

    def resolved(quantization, device=cpu, dtype=torch.float32, hf_config=plain):
        config = resolve_quantization(EngineConfig(quantization=quantization), device, dtype, hf_config)
        return config.quantization, config.quantize_lm_head

    assert resolved("auto") == ("int8", True)
    assert resolved("auto", cpu, torch.bfloat16) == (None, False)
    assert resolved("auto", cuda, torch.bfloat16) == (None, False)
    assert resolved("auto", cuda, torch.float32) == (None, False)
    assert resolved("auto", cpu, torch.float32, gptq) == (None, False)
    assert resolved("none") == (None, False)
    assert resolved("int4") == ("int4", False)
    assert resolved(None) == (None, False)
