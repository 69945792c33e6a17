"""Which device and element type a worker runs on."""

from __future__ import annotations

import logging
import platform

import torch

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    """`auto`: float32 on CPU; on a GPU the checkpoint's half type (bfloat16 for float32 ones)."""
    if name != "auto":
        if name == "bfloat16" and device.type == "cpu" and not native_cpu_bf16():
            # measured on an AVX2-only EPYC: a [64x576]x[576x3072] matmul runs 17 GFLOP/s in
            # bfloat16 against 110 in float32
            logger.warning("this CPU has no bfloat16 instructions (avx512_bf16 or AMX): bfloat16 "
                           "matmuls run several times slower than float32 here; consider --dtype float32")
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    config_dtype = DTYPES.get(str(config_dtype).removeprefix("torch."), torch.bfloat16)
    return torch.bfloat16 if config_dtype == torch.float32 else config_dtype


def native_cpu_bf16() -> bool:
    """False only on an x86 CPU that torch finds without avx512_bf16 and AMX."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True  # not known here: no warning
    cpu = getattr(torch, "cpu", None)
    checks = [getattr(cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(check() for check in checks if check is not None)
