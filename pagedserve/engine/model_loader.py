"""Builds a model plugin from a checkpoint directory and loads its safetensors weights."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import torch
from safetensors import safe_open

from pagedserve.common.contracts import Kernels, ParallelGroup, QuantizationPlugin
from pagedserve.common.engine_config import CPU_AUTO_QUANTIZATION, EngineConfig
from pagedserve.common.errors import InvalidParameterError
from pagedserve.engine.calibration import CalibrationRequest, TokenCalibration, calibration_tokens
from pagedserve.plugins import load_plugin
from pagedserve.plugins.int4_checkpoint import (
    CheckpointFormat,
    UnsupportedCheckpoint,
    load_prequantized,
    read_format,
)

logger = logging.getLogger(__name__)


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight: model.safetensors, or the shards of its index."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    for file in files:
        with safe_open(str(model_dir / file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                yield name, f.get_tensor(name)


def model_factory(hf_config):
    """The `pagedserve.models` plugin named by config.json's `architectures`."""
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ValueError("the model's config.json names no `architectures`")
    return load_plugin("models", architectures[0])


def check_tensor_parallel(hf_config, world_size: int) -> None:
    """Refuse a model that cannot be split across `world_size` ranks: one that has not opted
    in, or whose sizes do not divide (the message names the sizes that would)."""
    factory = model_factory(hf_config)
    problem_of = getattr(factory, "tensor_parallel_problem", None)
    problem = (problem_of(hf_config, world_size) if problem_of is not None
               else f"{getattr(factory, '__name__', factory)} does not support tensor parallelism")
    if problem is not None:
        raise InvalidParameterError("tensor_parallel_size", problem)


def _choose_int8_kernel(model: torch.nn.Module, asked: str) -> None:
    """Select the int8 linear kernel of this process for the model's int8 layers (timed on
    them with `auto`), where the C++ extension is loaded; an unavailable name is refused."""
    from pagedserve.kernels.cpu_attention import cpu_kernels
    from pagedserve.kernels.int8_kernel_choice import choose_int8_kernel, int8_layers

    extension = cpu_kernels()
    layers = int8_layers(model)
    if extension is None or not layers:
        return
    try:
        choice = choose_int8_kernel(extension, layers, asked)
    except ValueError as exc:
        raise InvalidParameterError("int8_kernel", str(exc)) from None
    logger.info("%s", choice.describe())


def load_model(model_dir: Path, hf_config, dtype: torch.dtype, device: torch.device, kernels: Kernels,
               load_format: str = "auto", quantization: str | None = None,
               quantize_lm_head: bool = False, parallel: ParallelGroup | None = None,
               int8_kernel: str = "auto", calibration: CalibrationRequest | None = None,
               pack_cpu_weights: bool = False) -> torch.nn.Module:
    """The `pagedserve.models` plugin named by config.json's `architectures`, with weights:
    the checkpoint's (`auto`), or seeded random ones (`dummy`: a config.json and a
    tokenizer are enough, to measure a model whose weights are not at hand). With
    `quantization`, the `pagedserve.quantization` plugin of that name then quantizes its
    linear layers, fitted to `calibration`'s tokens when given (engine/calibration.py). With
    `parallel` (tensor parallelism) it holds this rank's shards. On CPU, int8 weights then run
    the kernel `int8_kernel` picks (kernels/int8_kernel_choice.py). With `pack_cpu_weights`, a
    float32 model on CPU gets its float linear layers packed (kernels/cpu_packed.py), where
    the CPU extension builds."""
    prequantized = checkpoint_format(hf_config, quantization) if load_format != "dummy" else None
    if prequantized is not None and parallel is not None:
        raise InvalidParameterError("tensor_parallel_size", f"a {prequantized.method} checkpoint loads on one rank only")
    factory = model_factory(hf_config)
    if parallel is None:
        model = factory(hf_config, dtype=dtype, device=device, kernels=kernels)
    else:
        model = factory(hf_config, dtype=dtype, device=device, kernels=kernels, parallel=parallel)
    if load_format == "dummy":
        dummy_weights(model)
    elif prequantized is not None:
        # GPTQ / AWQ: their int4 codes are repacked into Int4Linear modules, never dequantized
        try:  # a layer's tensors can refuse what the config allowed (an act-order g_idx)
            rest, replaced = load_prequantized(model, iter_safetensors(model_dir), prequantized,
                                               getattr(model, "packed_modules", {}))
            model.load_weights(rest)
        except UnsupportedCheckpoint as exc:
            raise InvalidParameterError("model", str(exc)) from None
        logger.info("%s checkpoint: %d linear layers loaded as int4 (group %d)", prequantized.method, replaced,
                    prequantized.group_size)
    else:
        model.load_weights(iter_safetensors(model_dir))
    model.eval()
    if prequantized is not None or quantization is not None:
        _register_quantized_kernels(device, kernels)
    if quantization is not None:
        method: QuantizationPlugin = load_plugin("quantization", quantization)()
        offered = None
        if calibration is not None:
            if calibration.method not in method.calibration_methods:
                raise InvalidParameterError("quantization_calibration", f"the {quantization} method does not "
                                            f"calibrate with {calibration.method!r}; it takes: "
                                            f"{', '.join(('none', *method.calibration_methods))}")
            tokens, source = calibration_tokens(model_dir, calibration)
            offered = TokenCalibration(calibration.method, model, tokens, source, hf_config, kernels, device, dtype)
        started = time.perf_counter()
        # a method written before calibration (no `calibration` argument) is still called as it was
        extra = {"calibration": offered} if offered is not None else {}
        report = method.quantize(model, quantize_lm_head=quantize_lm_head, **extra)
        logger.info("%s: %d linear layers, %.1f MB of float weights now %.1f MB (LM head %s); model %.1f MB; "
                    "calibration %s; %.1f s", report.method, report.num_linear, report.float_bytes / 1e6,
                    report.quantized_bytes / 1e6, "quantized" if report.lm_head else "float",
                    report.model_bytes / 1e6, report.calibration if offered is None else
                    f"{report.calibration} on {offered.source} ({offered.passes} passes)",
                    time.perf_counter() - started)
    pack = pack_cpu_weights and device.type == "cpu" and dtype == torch.float32
    if quantization is not None and device.type == "cpu" and (not pack or int8_kernel != "auto"):
        # the few-row kernels of unpacked int8 linears; packed ones run their own product, so
        # there is nothing to time (a named kernel is still checked against the CPU)
        _choose_int8_kernel(model, int8_kernel)
    if pack:
        _pack_linears(model)
    if (quantization is not None or prequantized is not None) and device.type == "cuda":
        # the float weights the quantized modules replaced go back to the device, so that the KV
        # pool, sized from the free memory, counts the packed weights and not the float ones
        torch.cuda.empty_cache()
    return model


def resolve_quantization(config: EngineConfig, device: torch.device, dtype: torch.dtype, hf_config) -> EngineConfig:
    """The config with `quantization` a method's name or None: "none" is None; "auto" is
    CPU_AUTO_QUANTIZATION with its LM head for a float32 model on CPU whose checkpoint is not
    quantized already (int8 was faster than float32 there at every batch size measured, on
    AVX2 and AVX-512 machines, for 0.3-0.4% in perplexity: docs/performance.md), else None."""
    if config.quantization == "none":
        return msgspec.structs.replace(config, quantization=None)
    if config.quantization != "auto":
        return config
    if device.type == "cpu" and dtype == torch.float32 and not is_prequantized(hf_config):
        logger.info("weights: %s with its LM head on CPU (--quantization none keeps them float32)",
                    CPU_AUTO_QUANTIZATION)
        return msgspec.structs.replace(config, quantization=CPU_AUTO_QUANTIZATION, quantize_lm_head=True)
    return msgspec.structs.replace(config, quantization=None)


def is_prequantized(hf_config) -> bool:
    """Whether config.json has a `quantization_config` (a GPTQ, AWQ or compressed-tensors checkpoint:
    its weights load as they are)."""
    return getattr(hf_config, "quantization_config", None) is not None


def checkpoint_format(hf_config, quantization: str | None = None) -> CheckpointFormat | None:
    """The pre-quantized format of a checkpoint whose config.json has a `quantization_config`
    (GPTQ, AWQ, compressed-tensors), None for a float one; an `InvalidParameterError` naming the config's field
    for a variant that does not load, or when `quantization` asks to quantize it again."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    if not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    try:
        fmt = read_format(config)
    except UnsupportedCheckpoint as exc:
        raise InvalidParameterError("model", str(exc)) from None
    if quantization is not None:
        raise InvalidParameterError("quantization", f"the checkpoint is already quantized ({fmt.method}, "
                                                    f"its quantization_config); leave --quantization out")
    return fmt


def _pack_linears(model: torch.nn.Module) -> None:
    """The float32 and int8 linears in the packed layouts of the CPU extension's products, if it builds."""
    from pagedserve.kernels.cpu_attention import cpu_kernels
    from pagedserve.kernels.cpu_packed import pack_linears

    extension = cpu_kernels()
    if extension is None:
        logger.info("float32 and int8 linears stay unpacked: the CPU kernels could not be built")
        return
    started = time.perf_counter()
    count = pack_linears(model)
    logger.info("%d linear layers packed for the CPU products (float32; int8 on the %s kernel) in %.1f s", count,
                extension.packed_int8_isa(), time.perf_counter() - started)


def _register_quantized_kernels(device: torch.device, kernels: Kernels) -> None:
    """The operators the quantized modules' forward calls: on CPU the C++ extension's
    (torch.ops.pagedserve.int8_*, int4_linear: kernels/csrc; without a compiler the modules
    fall back to torch), on the Triton kernels the Triton GEMMs."""
    if device.type == "cpu":
        from pagedserve.kernels.cpu_attention import cpu_kernels

        cpu_kernels()
    elif kernels.ops.name == "triton":
        _register_triton_gemm(device)


def _register_triton_gemm(device: torch.device) -> None:
    """Registers torch.ops.pagedserve.w8a16_linear (kernels/triton_int8.py) and w4a16_linear
    (kernels/triton_int4.py), which the int8 and int4 modules' forward call on CUDA, each once
    it has passed its check against the torch reference on this device; without it those
    layers dequantize and call F.linear."""
    from pagedserve.kernels import triton_int4, triton_int8

    for name, module, layers in (("w8a16", triton_int8, "int8"), ("w4a16", triton_int4, "int4")):
        problem = module.self_check(device)
        if problem is not None:
            logger.warning("the Triton %s GEMM failed its self-check (%s); %s layers dequantize instead",
                           name, problem, layers)
            continue
        module.register_op()


@torch.no_grad()
def dummy_weights(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Norm weights 1, biases 0, everything else normal(0, std): the same weights for the
    same seed on the same kind of device (drawn there, one tensor at a time)."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        g = generators.setdefault(param.device, torch.Generator(param.device).manual_seed(seed))
        if "norm" in name:
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.copy_(torch.randn(param.shape, generator=g, device=param.device).mul_(std))
