"""GPTQ and AWQ checkpoints made here from the formats' packing rules (no hub download) load
as int4 without dequantizing, and agree with the same weights dequantized to float; the
variants that do not load are refused with the field that says why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve import LLM, SamplingParams
from pagedserve.bench.perplexity import window_logits
from pagedserve.common.errors import InvalidParameterError
from pagedserve.engine.model_loader import checkpoint_format
from pagedserve.plugins.int4_checkpoint import CheckpointFormat, UnsupportedCheckpoint, repack
from pagedserve.plugins.int4_quantization import Int4Linear, dequantize, unpack_codes

from tiny_models import build_checkpoint

GROUP = 32
LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 → the same bits as int32 (as the formats store them)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def gptq_pack(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, offset: int = 1) -> dict:
    """GPTQ's tensors of codes [out, in] (0..15), zeros and scales [out, groups]: qweight int32
    [in / 8, out], input 8·r + i of a column in bits 4·i; qzeros int32 [groups, out / 8], column
    8·c + i in bits 4·i, stored minus `offset`; scales float16 [groups, out]; g_idx = k // group."""
    out, k = codes.shape
    c = codes.T.to(torch.int64).reshape(k // 8, 8, out)  # [in / 8, 8, out]
    qweight = sum(c[:, i, :] << (4 * i) for i in range(8))
    z = ((zeros.T.to(torch.int64) - offset) & 15).reshape(zeros.shape[1], out // 8, 8)
    qzeros = sum(z[:, :, i] << (4 * i) for i in range(8))
    return {"qweight": _to_int32(qweight), "qzeros": _to_int32(qzeros), "scales": scales.T.half().contiguous(),
            "g_idx": (torch.arange(k) // GROUP).to(torch.int32)}


def awq_pack(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict:
    """AWQ's (GEMM) tensors: qweight int32 [in, out / 8], nibble i of word c holding column
    8·c + AWQ_ORDER[i]; qzeros int32 [groups, out / 8] the same way; scales float16 [groups, out]."""
    def pack(values: torch.Tensor) -> torch.Tensor:  # [rows, out] → [rows, out / 8]
        v = values.to(torch.int64).reshape(values.shape[0], -1, 8)
        return _to_int32(sum(v[:, :, AWQ_ORDER[i]] << (4 * i) for i in range(8)))

    return {"qweight": pack(codes.T), "qzeros": pack(zeros.T), "scales": scales.T.half().contiguous()}


def compressed_pack(codes: torch.Tensor, zeros: torch.Tensor | None, scales: torch.Tensor) -> dict:
    """compressed-tensors' pack-quantized tensors of codes [out, in] (0..15) and scales [out,
    groups], zero points [out, groups] (0..15) or None (symmetric), from its packing rules: a
    value is stored as its signed form (code - 8) plus 8, eight a little-endian int32 word along
    the inputs (weight_packed [out, ceil(in / 8)], the inputs padded with zeros) and, for the zero
    points, along the outputs (weight_zero_point [ceil(out / 8), groups])."""
    def pack_rows(values: torch.Tensor) -> torch.Tensor:  # [rows, cols] → [rows, ceil(cols / 8)]
        v = torch.nn.functional.pad(values.to(torch.int64), (0, -values.shape[1] % 8))
        v = v.reshape(values.shape[0], -1, 8)
        return _to_int32(sum(v[:, :, i] << (4 * i) for i in range(8)))

    out, k = codes.shape
    tensors = {"weight_packed": pack_rows(codes), "weight_scale": scales.half().contiguous(),
               "weight_shape": torch.tensor([out, k], dtype=torch.int64)}
    if zeros is not None:
        tensors["weight_zero_point"] = pack_rows(zeros.T).T.contiguous()
    return tensors


def whole_zero_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What GPTQ's and AWQ's own quantizers store (group 32, asymmetric, min/max): codes uint8
    [out, in] (0..15), whole zero points uint8 [out, groups] (0..15) and float16 scales
    [out, groups], with w ≈ (q - z)·s; `in` a multiple of the group."""
    out, k = w.shape
    groups = w.float().reshape(out, k // GROUP, GROUP)
    lo, hi = groups.amin(dim=2).clamp(max=0), groups.amax(dim=2).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-4).half()
    zeros = torch.round(-lo / scales.float()).clamp(0, 15)
    codes = (torch.round(groups / scales.float()[:, :, None]) + zeros[:, :, None]).clamp(0, 15)
    return codes.reshape(out, k).to(torch.uint8), zeros.to(torch.uint8), scales


def make_pair(source: Path, out: Path, method: str) -> tuple[Path, Path]:
    """From a float checkpoint: a `method` checkpoint of its linear layers quantized (group 32,
    zero points) and a float checkpoint of the same weights dequantized."""
    tensors = load_file(str(source / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if name.rsplit(".", 2)[-2] not in LAYERS:
            quantized[name] = dequantized[name] = w
            continue
        codes, zeros, scales = whole_zero_quantize(w)  # scales float16, as the formats store them
        prefix = name.removesuffix(".weight")
        packed = (gptq_pack(codes, zeros, scales) if method == "gptq" else awq_pack(codes, zeros, scales)
                  if method == "awq" else compressed_pack(codes, zeros, scales))
        quantized.update({f"{prefix}.{k}": v.contiguous() for k, v in packed.items()})
        g = zeros.float().repeat_interleave(GROUP, dim=1)
        dequantized[name] = ((codes.float() - g) * scales.float().repeat_interleave(GROUP, dim=1)).contiguous()
    config = json.loads((source / "config.json").read_text())
    dirs = []
    for kind, weights in ((method, quantized), ("float", dequantized)):
        d = out / f"{method}-{kind}"
        shutil.copytree(source, d)
        save_file(weights, str(d / "model.safetensors"))
        c = dict(config)
        if kind != "float":
            c["quantization_config"] = ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
                                         "sym": False, "checkpoint_format": "gptq"} if method == "gptq" else
                                        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                         "version": "gemm"} if method == "awq" else COMPRESSED_CONFIG)
        (d / "config.json").write_text(json.dumps(c))
        dirs.append(d)
    return dirs[0], dirs[1]


#: a compressed-tensors quantization_config as llm-compressor writes it (W4A16, asymmetric, group 32)
COMPRESSED_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                                              "group_size": GROUP, "actorder": None, "dynamic": False}}},
    "ignore": ["lm_head"],
}

#: what the tiny model is trained on: a few hundred tokens of plain English
TRAINING_TEXT = (
    "The capital of France is Paris. Paris is a city on the river Seine, and the capital of France "
    "is also its largest city. Hello world, hello tokens: a model reads tokens and writes tokens. "
    "The world is wide and the river is long. In the morning the city wakes, the shops open, and "
    "the people of Paris walk along the river to their work. In the evening they walk back again. "
    "France is Paris, and Paris is France, say the people of the capital. Hello again, world. "
)


def trained_checkpoint(out_dir: Path, steps: int = 400) -> Path:
    """The tiny llama checkpoint of `tiny_models.build_checkpoint` (its config and tokenizer),
    its weights from transformers' default initialisation trained for `steps` AdamW steps on
    `TRAINING_TEXT`. The random checkpoint itself is no judge of int4 against float: its
    weights of std 0.25 drive activations up to 40, its top-2 logit margin has a median of 0.6
    (11% of the positions under 0.1), and the int8 activations of the kernels (Q8_0's per 32
    values) flip 7% of its greedy ids; int8 weights, per channel, flip 11%. Trained, the model
    predicts as a language model does, by margins its int8 activations do not cross."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    build_checkpoint("llama", out_dir)
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(out_dir)), dtype=torch.float32)
    ids = torch.tensor(tok(TRAINING_TEXT * 4)["input_ids"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(6)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - 65, (8,), generator=generator)
        batch = torch.stack([ids[s : s + 65] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(str(out_dir))
    return out_dir


@pytest.fixture(scope="module")
def float_source(tmp_path_factory) -> Path:
    return trained_checkpoint(tmp_path_factory.mktemp("int4-source"))


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("k", [96, 84])
def test_compressed_tensors_repack_gives_back_the_codes_zeros_and_scales(symmetric, k):
    """pack-quantized layers: codes, zero points (packed along the outputs; absent when
    symmetric) and scales come back; a width that is not whole groups (84) is padded."""
    from pagedserve.plugins.int4_checkpoint import repack_compressed

    torch.manual_seed(9)
    padded = -(-k // GROUP) * GROUP
    codes, zeros, scales = whole_zero_quantize(torch.nn.functional.pad(torch.randn(21, k), (0, padded - k)))
    codes = codes[:, :k]
    if symmetric:
        zeros = torch.full_like(zeros, 8)
    packed = compressed_pack(codes, None if symmetric else zeros, scales)
    fmt = checkpoint_format(_Config(COMPRESSED_CONFIG))
    got = repack_compressed(fmt, "x", packed)
    assert (got.group_size, got.in_features, tuple(got.qweight.shape)) == (GROUP, k, (21, padded // 2))
    assert torch.equal(unpack_codes(got.qweight)[:, :k], codes)
    assert (got.zeros is None) == symmetric
    if not symmetric:
        assert torch.equal(got.zeros, zeros * 16)  # stored in sixteenths
    assert got.scales.dtype == torch.float16 and torch.equal(got.scales, scales)
    z = zeros.float().repeat_interleave(GROUP, 1)[:, :k]
    assert torch.equal(dequantize(got), (codes.float() - z) * scales.float().repeat_interleave(GROUP, 1)[:, :k])
    # an older layout keeps the zero points unpacked and signed
    if not symmetric:
        old = dict(packed, weight_zero_point=(zeros.to(torch.int64) - 8).to(torch.int8))
        assert torch.equal(repack_compressed(fmt, "x", old).zeros, got.zeros)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_repack_gives_back_the_codes_zeros_and_scales(method):
    torch.manual_seed(7)
    w = torch.randn(24, 96)
    codes, zeros, scales = whole_zero_quantize(w)
    assert int(zeros.min()) < int(zeros.max())
    if method == "gptq":
        packed = gptq_pack(codes, zeros, scales)
        got = repack(CheckpointFormat("gptq", GROUP, 1), "x", packed["qweight"], packed["qzeros"], packed["scales"],
                     packed["g_idx"])
    else:
        packed = awq_pack(codes, zeros, scales)
        got = repack(CheckpointFormat("awq", GROUP, 0), "x", packed["qweight"], packed["qzeros"], packed["scales"])
    assert torch.equal(unpack_codes(got.qweight), codes)
    assert got.zeros is not None and torch.equal(got.zeros, zeros * 16)  # stored in sixteenths
    assert got.scales.dtype == torch.float16 and torch.equal(got.scales, scales)
    assert torch.equal(dequantize(got), (codes.float() - zeros.float().repeat_interleave(GROUP, 1))
                       * scales.float().repeat_interleave(GROUP, 1))


def test_a_gptq_v1_zero_point_of_sixteen_is_refused_naming_qzeros():
    """GPTQ's v1 format stores zero - 1 in 4 bits, so a zero point of 0 comes back as 16, which
    no 4-bit zero point (nor its sixteenths in a byte) holds."""
    codes, zeros, scales = whole_zero_quantize(torch.randn(8, 32))
    zeros[3, 0] = 0
    packed = gptq_pack(codes, zeros, scales)
    with pytest.raises(UnsupportedCheckpoint, match="qzeros") as refused:
        repack(CheckpointFormat("gptq", GROUP, 1), "layer", packed["qweight"], packed["qzeros"], packed["scales"])
    assert "a zero point of 16" in str(refused.value)
    v2 = gptq_pack(codes, zeros, scales, offset=0)  # gptq_v2 stores it as it is
    got = repack(CheckpointFormat("gptq", GROUP, 0), "layer", v2["qweight"], v2["qzeros"], v2["scales"])
    assert got.zeros is not None and int(got.zeros[3, 0]) == 0


def test_a_checkpoint_registers_the_kernels_its_int4_layers_call(tmp_path, monkeypatch):
    """A GPTQ checkpoint's int4 layers get their kernels registered as `--quantization`'s do:
    on CPU the C++ extension, on the Triton kernels (CUDA) the Triton GEMMs, w4a16 among them
    (only the registration is faked here: a CUDA device on a CPU machine)."""
    from transformers import AutoConfig

    from pagedserve.engine import model_loader
    from pagedserve.kernels import cpu_attention
    from pagedserve.kernels.selector import select_kernels

    quantized_dir, _ = make_pair(build_checkpoint("llama", tmp_path / "source"), tmp_path, "gptq")
    calls: list[tuple] = []
    monkeypatch.setattr(model_loader, "_register_quantized_kernels", lambda device, kernels: calls.append(
        (device.type, kernels.ops.name)))
    cpu, hf_config = torch.device("cpu"), AutoConfig.from_pretrained(str(quantized_dir))
    model = model_loader.load_model(quantized_dir, hf_config, torch.float32, cpu, select_kernels("triton", cpu))
    assert calls == [("cpu", "triton")] and isinstance(model.layers[0].mlp.down_proj, Int4Linear)
    monkeypatch.undo()
    registered: list[str] = []
    monkeypatch.setattr(model_loader, "_register_triton_gemm", lambda device: registered.append(device.type))
    monkeypatch.setattr(cpu_attention, "cpu_kernels", lambda: registered.append("cpu extension"))
    for device, kernels in (("cuda", "triton"), ("cuda", "torch"), ("cpu", "triton"), ("cpu", "torch")):
        model_loader._register_quantized_kernels(torch.device(device), select_kernels(kernels, cpu))
    assert registered == ["cuda", "cpu extension", "cpu extension"]


@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors"])
def test_checkpoint_loads_as_int4_and_agrees_with_its_weights_dequantized(float_source, tmp_path, method):
    """Greedy ids of the float checkpoint (the same weights dequantized), teacher-forced on the
    int4 one, three ways, each >= 99%:
    - one prefill of each whole sequence (more rows than `int4_kernel_max_rows`: each layer
      dequantizes its int4 weight for F.linear): the loader's repacking;
    - prefill chunks of 4 rows: the C++ int4 × int8 kernel, activations quantized to int8 per
      32 values as Q4_0 × Q8_0;
    - packed at load (the CPU default; the two above run with `pack_cpu_weights` off), one
      prefill of each whole sequence: the packed int4 × int8 product.
    The model is trained (`trained_checkpoint`): on the random one the int8 activations alone
    flipped 7% of the greedy ids (the kernel 92.5%, the same int8 activations emulated in torch
    with the dequantized weights 92.9%: not the kernel, nor the repacking)."""
    from pagedserve.kernels.cpu_attention import cpu_kernels
    from pagedserve.plugins.int4_quantization import int4_kernel_max_rows

    kernels = cpu_kernels()
    # whole sequences (about 77 rows) must go past the kernel's limit (256 with AVX-512 VNNI)
    previous = kernels.set_int4_kernel_max_rows(64) if kernels is not None else None
    try:
        _checkpoint_agrees(float_source, tmp_path, method, int4_kernel_max_rows)
    finally:
        if previous is not None:
            kernels.set_int4_kernel_max_rows(previous)


def _checkpoint_agrees(float_source, tmp_path, method, int4_kernel_max_rows):
    quantized_dir, float_dir = make_pair(float_source, tmp_path, method)
    reference = LLM(str(float_dir), kv_cache_memory=1 << 22)
    prompts = ["The capital of France is", "Hello world", "héllo wörld", "Paris. The", "tokens, hello",
               "The capital", "world ✓", "France is Paris"]
    params = SamplingParams(max_tokens=72, temperature=0.0, ignore_eos=True)
    greedy = [list(o.outputs[0].token_ids) for o in reference.generate(prompts, params)]
    tok = reference.get_tokenizer()
    del reference
    llm = LLM(str(quantized_dir), kv_cache_memory=1 << 22, pack_cpu_weights=False)
    model = llm.engine.runner.model
    layer = model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Int4Linear) and isinstance(layer.mlp.down_proj, Int4Linear)
    assert layer.self_attn.qkv_proj.out_features == 96 + 2 * 32 and layer.mlp.gate_up_proj.out_features == 256
    assert layer.mlp.down_proj.zeros is not None and layer.mlp.down_proj.group_size == GROUP
    assert not any(name.endswith(("qkv_proj.weight", "down_proj.weight")) for name, _ in model.named_parameters())
    assert int4_kernel_max_rows() < 72
    expected = [t for ref in greedy for t in ref]
    agreement = {}
    for path, chunk in (("dequantized", 1000), ("kernel", 4)):
        predicted = []
        for p, ref in zip(prompts, greedy):
            prompt = tok.encode(p)
            for logits, _ in window_logits(llm.engine, prompt + ref, len(prompt), chunk=chunk):
                predicted += logits.argmax(-1).tolist()
        assert len(predicted) == len(expected)
        agreement[path] = sum(a == b for a, b in zip(predicted, expected)) / len(expected)
    del llm
    packed = LLM(str(quantized_dir), kv_cache_memory=1 << 22)
    assert type(packed.engine.runner.model.layers[0].mlp.down_proj).__name__ == "PackedInt4Linear"
    predicted = []
    for p, ref in zip(prompts, greedy):
        prompt = tok.encode(p)
        for logits, _ in window_logits(packed.engine, prompt + ref, len(prompt), chunk=1000):
            predicted += logits.argmax(-1).tolist()
    agreement["packed"] = sum(a == b for a, b in zip(predicted, expected)) / len(expected)
    print(f"{method}: teacher-forced greedy agreement with the float weights: "
          + ", ".join(f"{k} {v:.1%}" for k, v in agreement.items()))
    assert agreement["dequantized"] >= 0.99
    assert agreement["kernel"] >= 0.99
    assert agreement["packed"] >= 0.99


def _compressed(**weights) -> dict:
    """COMPRESSED_CONFIG with its weights' arguments changed."""
    group = COMPRESSED_CONFIG["config_groups"]["group_0"]
    return dict(COMPRESSED_CONFIG, config_groups={"group_0": dict(group, weights=dict(group["weights"], **weights))})


class _Config:
    def __init__(self, quantization_config):
        self.quantization_config = quantization_config


@pytest.mark.parametrize(("config", "field"), [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "desc_act"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128, "desc_act": False}, "bits"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": False}, "bits"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 48, "desc_act": False}, "group_size"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method"),
    (dict(COMPRESSED_CONFIG, format="float-quantized"), "format"),
    (dict(COMPRESSED_CONFIG, format="mixed-precision"), "format"),  # and no scheme names pack-quantized
    (dict(COMPRESSED_CONFIG, sparsity_config={"format": "sparse-24-bitmask"}), "sparsity_config"),
    (_compressed(num_bits=8), "num_bits"),
    (_compressed(type="float"), "type"),
    (_compressed(strategy="tensor"), "strategy"),
    (_compressed(actorder="group"), "actorder"),
    (_compressed(group_size=48), "group_size"),
    (dict(COMPRESSED_CONFIG, config_groups={"group_0": dict(
        COMPRESSED_CONFIG["config_groups"]["group_0"], input_activations={"num_bits": 8, "type": "int"})}),
     "input_activations"),
])
def test_unsupported_variants_are_refused_naming_the_field(config, field):
    with pytest.raises(InvalidParameterError, match=rf"model: quantization_config\.{field}: "):
        checkpoint_format(_Config(config))


def test_an_act_order_checkpoint_is_refused_at_load(float_source, tmp_path):
    quantized_dir, _ = make_pair(float_source, tmp_path, "gptq")
    config = json.loads((quantized_dir / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (quantized_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidParameterError, match=r"quantization_config\.desc_act: act-order GPTQ"):
        LLM(str(quantized_dir), kv_cache_memory=1 << 22)


def test_act_order_with_static_groups_loads_when_every_group_is_in_input_order(float_source, tmp_path):
    """AutoGPTQ's `static_groups` fixes each group's scale before the act-order pass, so its
    g_idx stays k // group: the layout the kernels read. A g_idx out of order is still refused."""
    quantized_dir, _ = make_pair(float_source, tmp_path, "gptq")
    prompts, params = [[5, 9, 14, 3, 8]], SamplingParams(max_tokens=6, temperature=0.0)

    def greedy() -> list[int]:
        return list(LLM(str(quantized_dir), kv_cache_memory=1 << 22).generate(prompts, params)[0].outputs[0].token_ids)

    want = greedy()
    config = json.loads((quantized_dir / "config.json").read_text())
    config["quantization_config"].update(desc_act=True, static_groups=True)
    (quantized_dir / "config.json").write_text(json.dumps(config))
    assert greedy() == want and len(want) == 6
    tensors = load_file(str(quantized_dir / "model.safetensors"))
    name = next(n for n in tensors if n.endswith(".g_idx"))
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(quantized_dir / "model.safetensors"))
    with pytest.raises(InvalidParameterError, match=r"quantization_config\.desc_act: .*g_idx is not in input order"):
        LLM(str(quantized_dir), kv_cache_memory=1 << 22)


def test_quantizing_a_quantized_checkpoint_again_is_refused():
    with pytest.raises(InvalidParameterError, match="quantization: the checkpoint is already quantized"):
        checkpoint_format(_Config({"quant_method": "awq", "bits": 4, "group_size": 128}), "int8")


def test_a_gptq_draft_keeps_its_int4_beside_an_int8_target(float_source, tmp_path):
    """A draft model loads as its checkpoint is, whatever the target's weights became: a GPTQ
    draft beside an int8 target (`pagedserve serve` makes a float32 target int8 on CPU) is not
    quantized again (which would be refused), and speculation leaves the greedy ids as they were."""
    gptq_dir, _ = make_pair(float_source, tmp_path, "gptq")
    options = dict(kv_cache_memory=1 << 22, quantization="int8", quantize_lm_head=True)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = ["The capital of France is"]
    want = LLM(str(float_source), **options).generate(prompt, params)[0].outputs[0].token_ids
    spec = LLM(str(float_source), speculative={"method": "draft", "model": str(gptq_dir), "num_speculative_tokens": 3},
               **options)
    draft = spec.engine.speculator.proposer.runner
    assert (draft.config.quantization, type(draft.model.layers[0].mlp.down_proj).__name__) == (None, "PackedInt4Linear")
    assert type(spec.engine.runner.model.layers[0].mlp.down_proj).__name__ == "PackedInt8Linear"
    assert spec.generate(prompt, params)[0].outputs[0].token_ids == want
