"""`--quantization-calibration gptq|imatrix` on a tiny model: the calibration passes record
each layer's real inputs (checked against transformers' own forward of the same checkpoint),
every layer is fitted to them, and bad options are refused naming their field."""

from __future__ import annotations

import pytest
import torch

from pagedserve.common.engine_config import EngineConfig
from pagedserve.common.errors import InvalidParameterError
from pagedserve.engine.calibration import CalibrationRequest, TokenCalibration, calibration_tokens
from pagedserve.engine.engine import Engine
from pagedserve.plugins.int4_quantization import Int4Linear, dequantize, quantize

from tiny_models import build_checkpoint

TOKENS = 700  # two windows of the tiny model's 512 positions: 512 and 188


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_checkpoint("llama", tmp_path_factory.mktemp("calibration"))


def _engine(model, **options) -> Engine:
    return Engine(EngineConfig(model=str(model), num_threads=1, kv_cache_memory=2**22, **options))


def _transformers_inputs(model_dir, tokens: list[int], window: int, module: str) -> torch.Tensor:
    """Σ xᵀx of `module`'s inputs in transformers' forward of each window as its own sequence."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    total = None

    def hook(_, args):
        nonlocal total
        x = args[0].reshape(-1, args[0].shape[-1]).double()
        total = x.T @ x if total is None else total + x.T @ x

    handle = hf.get_submodule(module).register_forward_pre_hook(hook)
    with torch.no_grad():
        for start in range(0, len(tokens), window):
            hf(torch.tensor([tokens[start : start + window]]))
    handle.remove()
    return total


def test_calibration_passes_record_the_layers_real_inputs(tiny):
    engine = _engine(tiny)
    model = engine.runner.model
    tokens, source = calibration_tokens(tiny, CalibrationRequest("gptq", TOKENS, None))
    assert len(tokens) == TOKENS and source == f"calibration.txt, its first {TOKENS} tokens"
    runner = engine.runner
    calibration = TokenCalibration("gptq", model, tokens, source, engine.hf_config, runner.kernels, runner.device,
                                   runner.dtype)
    first, last = model.layers[0].self_attn.qkv_proj, model.layers[1].mlp.down_proj
    both = calibration.layer_inputs({"first": first, "last": last})
    alone = calibration.layer_inputs({"first": first})  # this pass stops after layer 0's qkv_proj
    diagonal = calibration.layer_inputs({"first": first}, full=False)
    assert calibration.passes == 3 and both["first"].num_rows == TOKENS
    assert torch.equal(both["first"].hessian, alone["first"].hessian)
    assert diagonal["first"].hessian is None and torch.equal(diagonal["first"].squares, both["first"].squares)
    assert torch.allclose(both["first"].squares, both["first"].hessian.diagonal(), rtol=1e-5)
    for name, hf_name in (("first", "model.layers.0.self_attn.q_proj"), ("last", "model.layers.1.mlp.down_proj")):
        want = _transformers_inputs(tiny, tokens, 512, hf_name)
        got = both[name].hessian.double()
        assert (got - want).abs().max() <= 1e-4 * want.abs().max(), name


def test_gptq_fits_every_layer_to_its_inputs(tiny, caplog):
    float_model = _engine(tiny).runner.model
    qkv_weight = float_model.layers[0].self_attn.qkv_proj.weight.detach().clone()
    tokens, _ = calibration_tokens(tiny, CalibrationRequest("gptq", TOKENS, None))
    with caplog.at_level("INFO", logger="pagedserve.engine.model_loader"):
        # unpacked (pack_cpu_weights off): the quantizer's own Int4Linear modules
        model = _engine(tiny, quantization="int4", quantization_calibration="gptq",
                        quantization_calibration_tokens=TOKENS, pack_cpu_weights=False).runner.model
    assert "calibration gptq on calibration.txt, its first 700 tokens (1 passes)" in caplog.text
    linears = [m for name, m in model.named_modules() if name.endswith("_proj")]
    assert len(linears) == 8 and all(isinstance(m, Int4Linear) for m in linears)
    # layer 0's qkv_proj reads the normed embeddings: its output error on them is GPTQ's objective
    layer = float_model.layers[0]
    x = layer.input_layernorm(float_model.embed_tokens(torch.tensor(tokens))).double()
    gptq = model.layers[0].self_attn.qkv_proj
    error = ((x @ (dequantize(gptq.weights).double() - qkv_weight.double()).T) ** 2).sum()
    data_free = ((x @ (dequantize(quantize(qkv_weight, 32)).double() - qkv_weight.double()).T) ** 2).sum()
    assert error < 0.8 * data_free


def test_imatrix_weighs_the_scale_search_by_each_inputs_squares(tiny):
    engine = _engine(tiny)
    float_model, runner = engine.runner.model, engine.runner
    tokens, source = calibration_tokens(tiny, CalibrationRequest("imatrix", TOKENS, None))
    names = {f"{i}.{n}": m for i, layer in enumerate(float_model.layers)
             for n, m in (("qkv", layer.self_attn.qkv_proj), ("down", layer.mlp.down_proj))}
    weights = {name: m.weight.detach().clone() for name, m in names.items()}
    inputs = TokenCalibration("imatrix", float_model, tokens, source, engine.hf_config, runner.kernels,
                              runner.device, runner.dtype).layer_inputs(names, full=False)
    model = _engine(tiny, quantization="int4_g128_asym", quantization_calibration="imatrix",
                    quantization_calibration_tokens=TOKENS, pack_cpu_weights=False).runner.model
    for name, weight in weights.items():
        i, kind = name.split(".")
        got = model.layers[int(i)].self_attn.qkv_proj if kind == "qkv" else model.layers[int(i)].mlp.down_proj
        want = quantize(weight, 128, symmetric=False, importance=inputs[name].squares)
        assert torch.equal(got.qweight, want.qweight) and torch.equal(got.scales, want.scales), name
        assert torch.equal(got.zeros, want.zeros) and not torch.equal(want.qweight, quantize(weight, 128, False).qweight)


@pytest.mark.parametrize(("options", "field", "message"), [
    ({"quantization": "int4", "quantization_calibration": "awq"}, "quantization_calibration",
     "must be none, gptq, imatrix"),
    ({"quantization_calibration": "gptq"}, "quantization_calibration", "give --quantization too"),
    ({"quantization": "int4", "quantization_calibration": "gptq", "load_format": "dummy"},
     "quantization_calibration", "not dummy ones"),
    ({"quantization": "int4", "quantization_calibration_tokens": 0}, "quantization_calibration_tokens", ">= 1"),
])
def test_bad_options_are_refused_before_loading(options, field, message):
    with pytest.raises(InvalidParameterError, match=f"^{field}: .*{message}"):
        EngineConfig(**options)


@pytest.mark.parametrize(("options", "field", "message"), [
    ({"quantization": "int8", "quantization_calibration": "gptq"}, "quantization_calibration",
     "the int8 method does not calibrate with 'gptq'; it takes: none$"),
    ({"quantization": "int4", "quantization_calibration": "gptq", "quantization_calibration_tokens": 10**7},
     "quantization_calibration_tokens", "10000000 calibration tokens asked for, but calibration.txt has"),
    ({"quantization": "int4", "quantization_calibration": "gptq", "quantization_calibration_text": "/nonexistent.txt"},
     "quantization_calibration_text", "cannot read /nonexistent.txt"),
])
def test_what_only_the_load_can_tell_is_refused_there(tiny, options, field, message):
    with pytest.raises(InvalidParameterError, match=f"^{field}: {message}"):
        _engine(tiny, **options)


def test_a_method_written_before_calibration_still_loads(tiny, monkeypatch):
    from pagedserve.common.contracts import QuantizationPlugin, QuantizationReport
    from pagedserve.engine import model_loader

    calls = []

    class BeforeCalibration(QuantizationPlugin):
        name = "before"

        def quantize(self, model, *, quantize_lm_head=False):  # no `calibration` argument
            calls.append(quantize_lm_head)
            return QuantizationReport("before", 0, 0, 0, 0, False)

    real = model_loader.load_plugin
    monkeypatch.setattr(model_loader, "load_plugin",
                        lambda group, name: BeforeCalibration if group == "quantization" else real(group, name))
    _engine(tiny, quantization="int4")
    assert calls == [False]
