"""The CPU attention backend: the torch backend with decodes and prefills in C++ kernels.

The torch reference gathers every decode's blocks into a padded copy before attending;
on CPU that copy costs as much as the attention itself. The kernel in
csrc/cpu_paged_attention.cpp reads each cached key and value once, in place. Prefill chunks
over a float32 cache (head_dim 64 or 128) go to the same file's prefill kernel, after their
K/V are stored: many query rows in the vector lanes against each key, one pass over the
blocks per 64 rows (48 on AVX2), fresh chunks and chunks after a cached context alike, on
AVX-512 and AVX2 builds; elsewhere the torch backend's SDPA calls, per group of fresh chunks
(docs/performance.md, "CPU prefill attention kernel"). It is built
with torch's extension builder on first use (cached under ~/.cache/torch_extensions); if
it cannot be built, the worker logs why and stays on the torch backend.

With an int8 KV cache (`--kv-cache-dtype int8`) the kernel reads the int8 rows and their
scales in place, and float32 K/V are stored by one C++ pass (`store_kv_int8`) that
quantizes exactly as the torch reference does.

The same extension holds the fused decode step (csrc/cpu_decode.cpp, used through
kernels/cpu_decode.py): both are built in one go, once per source and CPU.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import re
import time
from pathlib import Path

import torch

from pagedserve.common.contracts import AttentionMetadata
from pagedserve.kernels.reference_ops import dequantize_kv_rows
from pagedserve.kernels.torch_attention import TorchAttentionBackend

logger = logging.getLogger(__name__)
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "cpu_module.cpp", _CSRC / "cpu_paged_attention.cpp", _CSRC / "cpu_decode.cpp",
            _CSRC / "cpu_int8_gemv.cpp", _CSRC / "cpu_int4_gemv.cpp", _CSRC / "cpu_shm_sync.cpp",
            _CSRC / "cpu_packed_gemm.cpp", _CSRC / "cpu_packed_int8.cpp"]


#: -ffast-math, but no approximate reciprocals (-mno-recip): under -ffast-math GCC divides
#: vectors by VRCPPS and a Newton step, whose bits differ between CPU models (SiLU gave
#: silu(200) one ulp under 200 on one Intel Xeon and exactly 200 on another). The true
#: division measured no slower: SiLU·mul of 64 × 1536 for 30 layers, one thread, 4.1-5.0 ms
#: against 6.0-7.2 ms with the estimate (Intel Xeon, AVX-512, loaded; alternated processes).
_CFLAGS = ["-O3", "-fopenmp", "-ffast-math", "-mno-recip"]
#: the headers the sources include: part of the build's key, not compiled on their own
_HEADERS = [_CSRC / "cpu_build_isa.h", _CSRC / "cpu_balanced_for.h"]
#: the environment variable that names the compiler's -march target instead of `native`, e.g.
#: `x86-64-v3` (AVX2, FMA, F16C: no AVX-512 and no VNNI anywhere, whatever this CPU has; the
#: run-time kernel choices stop at the build's sets too, csrc/cpu_build_isa.h)
ARCH_VARIABLE = "PAGEDSERVE_CPU_ARCH"
_ARCH_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")  # x86-64-v3, armv8.2-a+dotprod


def build_arch() -> str:
    """The -march target of the extension: `native` unless `PAGEDSERVE_CPU_ARCH` names another."""
    arch = os.environ.get(ARCH_VARIABLE, "").strip() or "native"
    if not _ARCH_PATTERN.fullmatch(arch):
        raise ValueError(f"{ARCH_VARIABLE}={arch!r} is not a compiler -march name (such as native or x86-64-v3)")
    return arch


def build_flags() -> list[str]:
    """The compiler flags of the extension: `_CFLAGS` and -march."""
    return [*_CFLAGS, f"-march={build_arch()}"]


def _build_name() -> str:
    """Extension name keyed by source, flags and CPU: -march=native code must never be
    loaded on another kind of CPU sharing the same cache directory."""
    cpu = platform.machine() + platform.processor()
    with contextlib.suppress(OSError):
        info = Path("/proc/cpuinfo").read_text()
        cpu += next((line for line in info.splitlines() if line.startswith(("flags", "Features"))), "")
        cpu += next((line for line in info.splitlines() if line.startswith("model name")), "")
    digest = hashlib.sha256(cpu.encode() + " ".join(build_flags()).encode()
                            + b"".join(p.read_bytes() for p in [*_SOURCES, *_HEADERS])).hexdigest()[:12]
    return f"pagedserve_cpu_attention_{digest}"


#: a build lock older than this was left by a process killed while building (a cold build
#: takes 1 to 3 minutes here); torch would wait on it forever, so it is removed
STALE_LOCK_SECONDS = 900


def _remove_stale_lock(name: str) -> None:
    """torch's builder waits while `lock` exists in the build folder; a worker killed in the
    middle of the first build leaves it behind, and every later start would hang."""
    with contextlib.suppress(Exception):
        from torch.utils.cpp_extension import _get_build_directory

        lock = Path(_get_build_directory(name, verbose=False)) / "lock"
        age = time.time() - lock.stat().st_mtime
        if age > STALE_LOCK_SECONDS:
            logger.warning("removing a build lock left %.0f s ago by a process that did not finish: %s", age, lock)
            lock.unlink()


@functools.cache
def cpu_kernels():
    """The compiled extension module, or None when it cannot be built here. A
    `PAGEDSERVE_CPU_ARCH` that is not a -march name raises ValueError: asked for, it is not
    silently replaced by the torch backend."""
    build_arch()
    try:
        from torch.utils.cpp_extension import load

        logger.info("loading the CPU kernels (the first build takes about a minute)")
        started = time.monotonic()
        name = _build_name()
        _remove_stale_lock(name)
        module = load(
            name=name,
            sources=[str(p) for p in _SOURCES],
            extra_cflags=build_flags(),
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
        logger.info("CPU kernels (-march=%s) ready in %.1f s", build_arch(), time.monotonic() - started)
        return module
    except Exception as exc:  # no compiler, no ninja, ...: the torch backend still works
        logger.warning("CPU attention kernel unavailable, using the torch backend: %s", exc)
        return None


class CPUAttentionBackend(TorchAttentionBackend):
    """The torch backend, with decodes and (float32) prefill chunks in the C++ kernels."""

    name = "cpu"
    #: prefill chunks through paged_prefill_attention where the build supports it (float32
    #: cache, head_dim 64 or 128; AVX-512 or AVX2); off: the torch backend's SDPA calls
    prefill_kernel = True

    def attend_prefills(self, query, key, value, kv_cache, metadata, scale, out):
        """The prefill chunks' rows of `out`, from their K/V stored in the cache already, by
        paged_prefill_attention where it is supported; else the torch backend's SDPA calls."""
        kernels = cpu_kernels()
        if (not self.prefill_kernel or kernels is None or query.dtype != torch.float32
                or kv_cache.dtype != torch.float32 or not out.is_contiguous()
                or not kernels.prefill_attention_supported(query.shape[-1], query.shape[1] // kv_cache.shape[3])):
            return super().attend_prefills(query, key, value, kv_cache, metadata, scale, out)
        nd = metadata.num_decodes
        if len(metadata.query_lens_cpu) > nd:
            kernels.paged_prefill_attention(query, kv_cache[0], kv_cache[1], metadata.block_tables[nd:],
                                            metadata.seq_lens[nd:], metadata.query_start_loc[nd:], out, scale)

    def prepare(self, metadata: AttentionMetadata, block_size: int, gather_decodes: bool = False) -> None:
        # the kernel reads the decodes' blocks in place: nothing to gather unless asked
        super().prepare(metadata, block_size, gather_decodes=gather_decodes)

    def store(self, key, value, kv_cache, metadata):
        """float32 K/V into an int8 cache in one C++ pass (the torch reference takes a dozen
        ops per layer); anything else as the torch backend stores it."""
        if kv_cache.dtype != torch.int8 or key.dtype != torch.float32:
            return super().store(key, value, kv_cache, metadata)
        slots = metadata.slot_mapping.long()
        cpu_kernels().store_kv_int8(key, value, kv_cache[0], kv_cache[1], slots)
        if not metadata.backend_state.prefill_groups:
            return key, value  # decodes only: they read the cache
        num_kv_heads, head_dim, width = key.shape[1], key.shape[2], kv_cache.shape[4]
        return (dequantize_kv_rows(kv_cache[0].view(-1, num_kv_heads, width)[slots], head_dim, key.dtype),
                dequantize_kv_rows(kv_cache[1].view(-1, num_kv_heads, width)[slots], head_dim, key.dtype))

    def attend_decodes(self, query, kv_cache, metadata, scale):
        nd = query.shape[0]
        return cpu_kernels().paged_decode_attention(
            query, kv_cache[0], kv_cache[1], metadata.block_tables[:nd], metadata.seq_lens[:nd], scale
        )
