"""`pagedserve plan` against values computed by hand."""

from __future__ import annotations

import json

import pytest

from pagedserve.common.errors import InvalidParameterError
from pagedserve.common.planner import ModelShape, parse_bytes, plan
from pagedserve.entrypoints.cli import main

GIB = 2**30
LLAMA3_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32,
                 intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False)
LLAMA3_70B = dict(hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, num_hidden_layers=80,
                  intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False)


@pytest.fixture
def config_file(tmp_path):
    def write(cfg):
        path = tmp_path / f"config-{cfg['num_hidden_layers']}.json"
        path.write_text(json.dumps(cfg))
        return path
    return write


def test_llama3_8b_needs_one_gib_per_8k_sequence(config_file):
    shape = ModelShape.from_path(config_file(LLAMA3_8B))
    assert shape.num_parameters == 8_030_261_248  # Llama-3-8B's published count
    assert shape.kv_bytes_per_token("bfloat16") == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    p = plan(shape, 80 * GIB, 8192)
    assert p.kv_bytes_per_sequence == 1 * GIB
    assert p.weight_bytes == 2 * 8_030_261_248
    num_blocks = (80 * GIB - 2 * 8_030_261_248) // (128 * 1024 * 16)
    assert p.num_blocks == num_blocks
    assert p.max_sequences_at_context == num_blocks // 512 == 65


def test_llama3_70b_gqa(config_file):
    shape = ModelShape.from_path(config_file(LLAMA3_70B))
    assert shape.num_parameters == 70_553_706_496
    assert plan(shape, 4 * 80 * GIB, 4096).kv_bytes_per_sequence == 1.25 * GIB
    assert plan(shape, 4 * 80 * GIB, 2048).kv_bytes_per_sequence == 0.625 * GIB
    with pytest.raises(InvalidParameterError):
        plan(shape, 80 * GIB, 4096)  # 141 GB of weights do not fit one 80 GiB GPU


def test_paging_gain_for_a_length_distribution(config_file):
    shape = ModelShape.from_path(config_file(LLAMA3_8B))
    # half the sequences use 1,000 tokens, half 3,000: 63 and 188 blocks instead of 512
    p = plan(shape, 80 * GIB, 8192, lengths=[1000, 3000])
    assert p.sequences_reserving_context == 65
    assert p.sequences_paged == int(p.num_blocks // ((63 + 188) / 2))
    assert p.paged_gain == pytest.approx(p.sequences_paged / 65)
    assert p.mean_length == 2000


def test_safetensors_headers_give_the_exact_count(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_checkpoint("qwen2")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert ModelShape.from_path(model_dir).num_parameters == sum(p.numel() for p in model.parameters())


def test_sizes_and_cli(config_file, capsys):
    assert parse_bytes("80GiB") == 80 * GIB and parse_bytes("1.5 GB") == 1_500_000_000 and parse_bytes("4096") == 4096
    with pytest.raises(InvalidParameterError):
        parse_bytes("lots")
    assert main(["plan", "--model", str(config_file(LLAMA3_8B)), "--memory", "80GiB", "--context", "8192",
                 "--lengths", "1000,3000"]) == 0
    out = capsys.readouterr().out
    assert "KV cache per 8192-token sequence      1.000 GiB\n" in out
    assert "sequences at full context             65\n" in out
    assert f"sequences, paged blocks               {int(p_blocks(out) // ((63 + 188) / 2))} " in out


def p_blocks(out: str) -> int:
    return int(out.split("GiB (")[-1].split(" blocks")[0])


def test_fp8_kv_doubles_the_4k_sequences_of_llama3_8b_and_int8_weights_free_memory(config_file, capsys):
    shape = ModelShape.from_path(config_file(LLAMA3_8B))
    linear_per_layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336
    assert shape.num_linear_parameters == 32 * linear_per_layer
    assert shape.num_linear_outputs == 32 * ((4096 + 2 * 1024) + 4096 + 2 * 14336 + 4096)
    bf16 = plan(shape, 80 * GIB, 4096)
    fp8 = plan(shape, 80 * GIB, 4096, kv_dtype="fp8_e4m3")
    int8_kv = plan(shape, 80 * GIB, 4096, kv_dtype="int8")
    # a row (one token's K or V of one KV head): fp8 128 bytes, no scale; int8 128 + a float32 scale
    assert shape.kv_bytes_per_row("fp8_e4m3") == 128 and shape.kv_bytes_per_row("int8") == 132
    assert fp8.kv_bytes_per_token == 64 * 1024 and int8_kv.kv_bytes_per_token == 2 * 32 * 8 * 132 == 67_584
    assert fp8.kv_bytes_per_sequence == 256 * 64 * 1024 * 16
    assert int8_kv.kv_bytes_per_sequence == 256 * 67_584 * 16
    budget = 80 * GIB - 2 * 8_030_261_248
    assert (bf16.max_sequences_at_context, fp8.max_sequences_at_context, int8_kv.max_sequences_at_context) == (
        budget // (128 * 1024 * 16) // 256, budget // (64 * 1024 * 16) // 256,
        budget // (67_584 * 16) // 256) == (130, 260, 252)
    print(f"Llama-3-8B, 80 GiB, 4k tokens: {bf16.max_sequences_at_context} sequences with bf16 KV, "
          f"{fp8.max_sequences_at_context} with fp8 ({fp8.max_sequences_at_context / bf16.max_sequences_at_context:.2f}x), "
          f"{int8_kv.max_sequences_at_context} with int8")
    int8 = plan(shape, 80 * GIB, 4096, kv_dtype="fp8_e4m3", quantization="int8")
    rest = 8_030_261_248 - shape.num_linear_parameters  # embeddings, LM head, norms: bf16
    assert int8.weight_bytes == shape.num_linear_parameters + shape.num_linear_outputs * 4 + 2 * rest
    assert int8.max_sequences_at_context == (80 * GIB - int8.weight_bytes) // (64 * 1024 * 16) // 256
    with pytest.raises(InvalidParameterError, match="quantization"):
        plan(shape, 80 * GIB, 4096, quantization="int3")
    assert main(["plan", "--model", str(config_file(LLAMA3_8B)), "--memory", "80GiB", "--context", "4096",
                 "--quantization", "int8", "--kv-cache-dtype", "fp8_e4m3"]) == 0
    assert f"sequences at full context             {int8.max_sequences_at_context}\n" in capsys.readouterr().out
    assert main(["plan", "--model", str(config_file(LLAMA3_8B)), "--memory", "80GiB", "--context", "4096",
                 "--kv-cache-dtype", "int8"]) == 0
    out = capsys.readouterr().out
    assert "KV cache per token                    66.0 KiB\n" in out
    assert "sequences at full context             252\n" in out


def test_int4_counts_packed_codes_group_scales_and_zero_points(config_file):
    shape = ModelShape.from_path(config_file(LLAMA3_70B))
    # one decoder layer's linear weights: qkv 8192 → 10240, o 8192 → 8192, gate/up 8192 → 57344, down 28672 → 8192
    per_layer = 8192 * 10240 + 8192 * 8192 + 8192 * 57344 + 28672 * 8192
    rest = shape.num_parameters - 80 * per_layer
    # group 32, symmetric: 16 bytes of codes and a 2-byte (float16) scale per 32 weights
    p = plan(shape, 80 * GIB, 4096, quantization="int4")
    assert p.weight_bytes == 80 * per_layer // 32 * (16 + 2) + rest * 2
    # group 128 with zero points: 64 bytes of codes, a scale and a zero point per 128 weights
    p128 = plan(shape, 80 * GIB, 4096, quantization="int4_g128_asym")
    assert p128.weight_bytes == 80 * per_layer // 128 * (64 + 2 + 1) + rest * 2
    assert plan(shape, 80 * GIB, 4096, quantization="int4_asym").weight_bytes == 80 * per_layer // 32 * 19 + rest * 2
    # the linear layers of a 70B model: 0.5625 bytes a weight at group 32 (Q4_0's 4.5 bits), against 1 for int8
    assert p.weight_bytes < plan(shape, 80 * GIB, 4096, quantization="int8").weight_bytes
    assert p.num_blocks > plan(shape, 80 * GIB, 4096, quantization="int8").num_blocks


def test_int4_pads_each_layer_to_whole_groups(config_file):
    # SmolLM2-135M: hidden 576 is 4.5 groups of 128, intermediate 1536 is 12
    cfg = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30,
               intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)
    shape = ModelShape.from_path(config_file(cfg))
    qkv, o, gate_up, down = 576 + 2 * 192, 576, 2 * 1536, 576
    per_layer = (qkv + o + gate_up) * 5 * (64 + 2) + down * 12 * (64 + 2)  # 576 inputs: 5 groups (640)
    assert shape.int4_linear_bytes(128, False) == 30 * per_layer
    rest = shape.num_parameters - shape.num_linear_parameters
    assert plan(shape, GIB, 2048, dtype="float32", quantization="int4_g128").weight_bytes == 30 * per_layer + rest * 4


def test_a_gptq_checkpoint_is_counted_as_it_loads(tmp_path):
    cfg = dict(LLAMA3_8B, quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 128,
                                               "desc_act": False, "sym": True})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"not read: the packed words are not parameters")
    shape = ModelShape.from_path(tmp_path)
    assert shape.prequantized == (128, False) and shape.num_parameters == 8_030_261_248
    per_layer = 4096 * 6144 + 4096 * 4096 + 4096 * 28672 + 14336 * 4096
    rest = 8_030_261_248 - 32 * per_layer
    assert plan(shape, 80 * GIB, 4096).weight_bytes == 32 * per_layer // 128 * (64 + 2) + rest * 2


def test_a_compressed_tensors_checkpoint_is_counted_as_it_loads(tmp_path):
    scheme = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": False,
                                                 "strategy": "group", "group_size": 128}}
    cfg = dict(LLAMA3_8B, quantization_config={"quant_method": "compressed-tensors", "format": "pack-quantized",
                                               "config_groups": {"group_0": scheme}})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = ModelShape.from_path(tmp_path)
    assert shape.prequantized == (128, True) and shape.num_parameters == 8_030_261_248
    per_layer = 4096 * 6144 + 4096 * 4096 + 4096 * 28672 + 14336 * 4096
    rest = 8_030_261_248 - 32 * per_layer
    # codes, a float16 scale and a uint8 zero point per group of 128
    assert plan(shape, 80 * GIB, 4096).weight_bytes == 32 * per_layer // 128 * (64 + 2 + 1) + rest * 2


def test_plan_cli_takes_int4(config_file, capsys):
    assert main(["plan", "--model", str(config_file(LLAMA3_70B)), "--quantization", "int4", "--memory", "80GiB",
                 "--context", "4096"]) in (0, None)
    assert "weights" in capsys.readouterr().out
    with pytest.raises(InvalidParameterError, match="int4_g128_asym, got 'int3'"):
        plan(ModelShape.from_path(config_file(LLAMA3_70B)), 80 * GIB, 4096, quantization="int3")


def test_llama3_70b_split_over_four_devices(config_file, capsys):
    """Tensor parallelism: each of 4 devices holds a quarter of the weights and 2 of the 8 KV heads."""
    shape = ModelShape.from_path(config_file(LLAMA3_70B))
    p = plan(shape, 80 * GIB, 4096, tensor_parallel_size=4)
    assert p.weight_bytes == 2 * (70_553_706_496 // 4)
    assert p.kv_bytes_per_token == 2 * 80 * 2 * 128 * 2  # 2 KV heads per device
    assert p.kv_bytes_per_sequence == 4096 * 2 * 80 * 2 * 128 * 2 == 0.3125 * GIB
    assert p.num_blocks == (80 * GIB - 2 * (70_553_706_496 // 4)) // (2 * 80 * 2 * 128 * 2 * 16)
    assert plan(shape, 80 * GIB, 4096, tensor_parallel_size=16).kv_bytes_per_token == 2 * 80 * 1 * 128 * 2  # replicated
    with pytest.raises(InvalidParameterError, match=r"tensor_parallel_size 3 does not divide num_attention_heads "
                                                    r"\(64\).*sizes that work for this model: 1, 2, 4, 8, 16, 32, 64$"):
        plan(shape, 80 * GIB, 4096, tensor_parallel_size=3)
    assert main(["plan", "--model", str(config_file(LLAMA3_70B)), "--memory", "80GiB", "--context", "4096",
                 "--tensor-parallel-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel                       4 devices; weights and KV cache per device" in out
    assert "weights                               32.85 GiB" in out
