"""Compile the Triton kernels for NVIDIA GPUs ahead of time, on any machine, GPU or not.

The CPU tests run the kernels in Triton's interpreter, which executes their Python: a kernel
can pass there and still fail on a GPU, because its compiled form is refused (an operation
or a `tl.dot` shape the compiler does not take) or because it asks for more shared memory
than the GPU has, which only shows at launch. Triton's compiler and NVIDIA's `ptxas` ship
inside the triton wheel and need no GPU, so this module checks that part everywhere:

1. it calls the real launch wrappers (`triton_ops.*`, `triton_attention.paged_attention`)
   with their kernels swapped for recorders, so it sees exactly the arguments and
   compile-time constants an engine step passes;
2. it derives from each recorded launch the signature Triton's launcher would specialize
   (pointer dtypes, 32/64-bit integers, 16-divisibility of pointers and integers, integers
   equal to 1 as constants) and compiles it for a GPU architecture down to a cubin;
3. it reads registers, local memory (register spills) and shared memory per kernel.

`python -m pagedserve.kernels.triton_aot` prints the table for every kernel configuration
the engine uses; `tests/kernels/test_triton_aot.py` compiles a subset. What it cannot show:
that the cubin computes the right numbers, and how fast it runs; that needs a GPU
(`benchmarks/gpu_kernels.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedserve.common.contracts import AttentionMetadata
from pagedserve.kernels import triton_attention, triton_int4, triton_int8, triton_ops
from pagedserve.kernels.reference_ops import kv_row_width

triton = triton_ops.triton

#: Shared memory one thread block may use (opt-in maximum), by compute capability.
SHARED_MEMORY_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}

#: Constants the wrappers set for the interpreter that a compiled kernel never sees.
_COMPILED_CONSTANTS = {"DOT_FP32": False}  # the interpreter widens bf16 dots to fp32 (triton_attention)

#: Launch keywords that are compiler options, not kernel arguments.
_LAUNCH_OPTIONS = ("num_warps", "num_stages")

_TYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
               torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
               torch.float8_e4m3fn: "fp8e4nv"}


@dataclass
class Launch:
    """One kernel launch as a wrapper made it."""

    kernel: Any  # the JITFunction (or the interpreter's wrapper of it)
    grid: tuple
    args: tuple
    kwargs: dict

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


@dataclass
class CompiledLaunch:
    """What compiling one launch for one architecture gave."""

    label: str
    kernel: str
    arch: int
    constants: dict
    registers: int | None = None  # per thread
    stack_bytes: int | None = None  # stack + local memory per thread; above 0: spilled registers
    shared_bytes: int = 0  # per thread block
    num_warps: int = 0
    over_shared_limit: bool = False  # more shared memory than one block may have on `arch`
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    ptx: str = field(default="", repr=False)


class _Recorder:
    def __init__(self, kernel, launches: list[Launch]):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.launches.append(Launch(self.kernel, tuple(grid), args, kwargs))
        return record


_KERNEL_MODULES = (triton_ops, triton_attention, triton_int8, triton_int4)


@contextlib.contextmanager
def recording():
    """Inside, every Triton kernel launch of the wrappers is recorded instead of run."""
    launches: list[Launch] = []
    saved = []
    for module in _KERNEL_MODULES:
        for name, value in vars(module).items():
            if name.endswith("_kernel") and hasattr(value, "fn"):
                saved.append((module, name, value))
    try:
        for module, name, value in saved:
            setattr(module, name, _Recorder(value, launches))
        yield launches
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def signature_of(
    launch: Launch,
) -> tuple[dict[str, str], dict[tuple[int, ...], Any], dict[tuple[int, ...], list[list[Any]]]]:
    """(signature, constexprs, attrs) for `triton.compile`, as Triton's launcher specializes
    these arguments: pointers by dtype, and 16-byte aligned pointers and integers divisible
    by 16 hinted; integers equal to 1 become constants."""
    jit = _jit_function(launch.kernel)
    names = jit.arg_names
    values = dict(zip(names, launch.args))
    values.update(launch.kwargs)
    constexpr_names = {names[i] for i in jit.constexprs}
    signature: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], Any] = {}  # a constexpr's value: a bool, int, float...
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, name in enumerate(names):
        value = values[name]
        if name in constexpr_names:
            signature[name] = "constexpr"
            constexprs[(i,)] = _COMPILED_CONSTANTS.get(name, value)
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPE_NAMES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1:
                signature[name] = "constexpr"
                constexprs[(i,)] = 1
                continue
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{launch.name}: cannot type argument {name}={value!r}")
    return signature, constexprs, attrs


_JIT: dict = {}


def _jit_function(kernel):
    """The compilable JITFunction behind a kernel (under TRITON_INTERPRET=1 the module holds
    the interpreter's wrapper, which keeps the Python function as `.fn`)."""
    if isinstance(kernel, triton.runtime.jit.JITFunction):
        return kernel
    if kernel.fn not in _JIT:
        _JIT[kernel.fn] = triton.runtime.jit.JITFunction(kernel.fn)
    return _JIT[kernel.fn]


def _tool(name: str) -> Path | None:
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return path if path.exists() else None


def _resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, stack + local bytes) per thread, read from the cubin with cuobjdump;
    spilled registers land in that stack frame."""
    tool = _tool("cuobjdump")
    if tool is None:
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", text)
    frame = [int(m) for m in re.findall(r"(?:STACK|LOCAL):(\d+)", text)]
    return (int(regs.group(1)) if regs else None), (sum(frame) if frame else None)


def _check_not_interpreted() -> None:
    knobs = getattr(triton, "knobs", None)
    interpreted = knobs.runtime.interpret if knobs is not None else os.environ.get("TRITON_INTERPRET") == "1"
    if interpreted:
        raise RuntimeError("compile in a process without TRITON_INTERPRET=1: under it Triton's own library "
                           "functions (tl.cdiv, ...) are interpreter objects the compiler cannot use")


def compile_launch(launch: Launch, arch: int, label: str = "") -> CompiledLaunch:
    """Compile one recorded launch for compute capability `arch` (80 = A100, 90 = H100)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    _check_not_interpreted()
    signature, constexprs, attrs = signature_of(launch)
    names = _jit_function(launch.kernel).arg_names
    shown = {names[path[0]]: value for path, value in constexprs.items()}
    result = CompiledLaunch(label, launch.name, arch, shown)
    try:
        source = ASTSource(_jit_function(launch.kernel), signature, constexprs=constexprs, attrs=attrs)
        options = {k: launch.kwargs[k] for k in _LAUNCH_OPTIONS if k in launch.kwargs}
        if launch.name == "_paged_attention_kernel":  # its warps depend on the architecture too
            options["num_warps"] = triton_attention._num_warps(
                shown["BLOCK_M"] * shown["GROUP_P2"], shown["HEAD_DIM_P2"], launch.args[0].element_size(), arch)
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as exc:  # noqa: BLE001 - reported per launch
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        where = f" ({lines[0]})" if len(lines) > 1 else ""
        result.error = f"{type(exc).__name__}: {lines[-1] if lines else ''}{where}"
        return result
    result.ptx = compiled.asm["ptx"]
    result.shared_bytes = int(compiled.metadata.shared)
    result.num_warps = int(compiled.metadata.num_warps)
    result.registers, result.stack_bytes = _resource_usage(compiled.asm["cubin"])
    limit = SHARED_MEMORY_LIMIT.get(arch)
    result.over_shared_limit = limit is not None and result.shared_bytes > limit
    if result.over_shared_limit:
        result.notes.append(f"needs {result.shared_bytes} B of shared memory, sm_{arch} has {limit}")
    if result.stack_bytes:
        result.notes.append(f"a {result.stack_bytes} B stack frame per thread (spilled registers)")
    return result


# -- the configurations the engine launches -------------------------------------------------

#: (label, query heads, KV heads, head_dim): the model head layouts to compile attention for
HEAD_LAYOUTS = [
    ("llama3-8b", 32, 8, 128),  # GQA 4
    ("smollm2-135m", 9, 3, 64),  # GQA 3
    ("mha", 16, 16, 64),  # GQA 1
    ("gqa8", 64, 8, 128),  # GQA 8 (Llama-3-70B)
]


def _attention_batch(kind: str, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                     cache_dtype: torch.dtype | None = None):
    """A small batch of the given kind: 'mixed' (decodes + prefill chunks), 'decode'
    (decode-only, one pass), 'graph' (the decode plan a CUDA graph captures: fixed splits).
    The KV cache is in `dtype`, or quantized to `cache_dtype` (int8 or float8_e4m3fn rows)."""
    query_lens, seq_lens = {"mixed": ([1, 1, 20, 37], [90, 3, 20, 60]),
                            "decode": ([1] * 4, [90, 3, 40, 60]),
                            "graph": ([1] * 4, [90, 3, 40, 60])}[kind]
    blocks = [-(-s // block_size) for s in seq_lens]
    tables, next_block = [], 0
    for b in blocks:
        tables.append(list(range(next_block, next_block + b)))
        next_block += b
    # a CUDA graph's tables are as wide as the longest context allows (8192 tokens here)
    metadata = AttentionMetadata.for_batch(query_lens, seq_lens, tables, block_size,
                                           width=8192 // block_size if kind == "graph" else None)
    n = sum(query_lens)
    backend = triton_attention.TritonAttentionBackend()
    if kind == "graph":  # as DecodeGraphs plans it for max_model_len 8192
        metadata.backend_state = backend.decode_plan(len(query_lens), 8192, block_size, "cpu")
    else:
        backend.prepare(metadata, block_size)
    query = torch.empty(n, heads, head_dim, dtype=dtype)
    key = torch.empty(n, kv_heads, head_dim, dtype=dtype)
    cache_dtype = cache_dtype or dtype
    kv_cache = torch.empty(2, next_block, block_size, kv_heads, kv_row_width(head_dim, cache_dtype), dtype=cache_dtype)
    return backend, query, key, kv_cache, metadata


#: KV caches: None (the model's dtype), and the quantized ones (reference_ops' row layout)
KV_CACHE_DTYPES = (None, torch.int8, torch.float8_e4m3fn)
#: rows of x for the w8a16 GEMM: a decode step, a small batch, a prefill (its three tile sizes)
GEMM_ROWS = (1, 32, 256)
#: the K splits recorded for a decode step's GEMM (any count above 1 compiles the same code)
GEMM_SPLIT_K = 4
#: int4 group sizes for the w4a16 GEMM (the built-in methods'), each symmetric and with zero points
INT4_GROUPS = (32, 128)
#: float8_e4m3fn needs sm_89 or later (Triton refuses the type below); sm_80 gets int8 only
FP8_MIN_ARCH = 89


def engine_launches(dtypes=(torch.bfloat16, torch.float16, torch.float32), block_sizes=(16, 32), layouts=HEAD_LAYOUTS,
                    kinds=("mixed", "decode", "graph"), kv_cache_dtypes=KV_CACHE_DTYPES,
                    gemm_dtypes=None) -> list[tuple[str, Launch]]:
    """(label, launch) for every kernel launch the engine makes in these configurations,
    duplicates (same kernel, same compile-time specialization) removed. The w8a16 GEMM (an
    int8 model's linear layers) and the w4a16 GEMM (an int4 model's, in each of INT4_GROUPS,
    symmetric and asymmetric) run in `gemm_dtypes` (default: `dtypes`) on each layout's QKV
    projection shape."""
    out, seen = [], set()

    def add(label: str, launches: list[Launch]):
        for launch in launches:
            key = (launch.name, repr(signature_of(launch)))
            if key not in seen:
                seen.add(key)
                out.append((label, launch))

    for dtype in dtypes:
        dt = _TYPE_NAMES[dtype]
        for name, heads, kv_heads, head_dim in layouts:
            for block_size in block_sizes:
                for kind in kinds:
                    for cache_dtype in kv_cache_dtypes:
                        backend, query, key, kv_cache, metadata = _attention_batch(kind, heads, kv_heads, head_dim,
                                                                                   block_size, dtype, cache_dtype)
                        with recording() as launches:
                            backend.forward(query, key, key, kv_cache, metadata, head_dim**-0.5)
                        kv = f" kv-{_TYPE_NAMES[cache_dtype]}" if cache_dtype is not None else ""
                        add(f"{dt} {name} bs{block_size} {kind}{kv}", launches)
            hidden, inter = heads * head_dim, 4 * heads * head_dim
            x = torch.empty(5, hidden, dtype=dtype)
            with recording() as launches:
                triton_ops.rms_norm(x, torch.empty(hidden, dtype=dtype), 1e-6)
                triton_ops.rms_norm(x, torch.empty(hidden, dtype=dtype), 1e-6, residual=x)
                triton_ops.silu_and_mul(torch.empty(5, 2 * inter, dtype=dtype))
                cos = torch.empty(64, head_dim // 2, dtype=torch.float32)
                triton_ops.rotary(torch.zeros(5, dtype=torch.int64), torch.empty(5, heads, head_dim, dtype=dtype), cos, cos)
            add(f"{dt} {name}", launches)
    for dtype in dtypes if gemm_dtypes is None else gemm_dtypes:
        for name, heads, kv_heads, head_dim in layouts:
            hidden, qkv = heads * head_dim, (heads + 2 * kv_heads) * head_dim
            with recording() as launches:
                weight, scale = torch.empty(qkv, hidden, dtype=torch.int8), torch.empty(qkv)
                for m in GEMM_ROWS:
                    triton_int8.w8a16_linear(torch.empty(m, hidden, dtype=dtype), weight, scale, None)
                # a decode step split over K (split_k_for on a GPU), and its reduction
                triton_int8.w8a16_linear(torch.empty(1, hidden, dtype=dtype), weight, scale, None, split_k=GEMM_SPLIT_K)
            add(f"{_TYPE_NAMES[dtype]} {name} w8a16 M={'/'.join(map(str, GEMM_ROWS))}", launches)
            for group in INT4_GROUPS:
                padded = -(-hidden // group) * group
                qweight = torch.empty(qkv, padded // 2, dtype=torch.uint8)
                scales = torch.empty(qkv, padded // group, dtype=torch.float16)
                for zeros in (None, torch.empty(qkv, padded // group, dtype=torch.uint8)):
                    with recording() as launches:
                        for m in GEMM_ROWS:
                            x = torch.empty(m, hidden, dtype=dtype)
                            triton_int4.w4a16_linear(x, qweight, scales, zeros, None, group)
                        triton_int4.w4a16_linear(torch.empty(1, hidden, dtype=dtype), qweight, scales, zeros, None,
                                                 group, split_k=GEMM_SPLIT_K)
                        # a prefill's one pass to the float weight (above DEQUANTIZE_ABOVE_ROWS rows)
                        triton_int4.w4_dequantize(qweight, scales, zeros, group, hidden, dtype)
                    kind = "sym" if zeros is None else "asym"
                    add(f"{_TYPE_NAMES[dtype]} {name} w4a16 g{group} {kind} M={'/'.join(map(str, GEMM_ROWS))}",
                        launches)
    return out


def uses_fp8(launch: Launch) -> bool:
    return any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in launch.args)


def compile_all(archs=(90,), quick: bool = False, **kwargs) -> list[CompiledLaunch]:
    """Compile every engine launch for each architecture (float8 caches only where the
    architecture has float8: FP8_MIN_ARCH)."""
    if quick:
        kwargs.setdefault("dtypes", (torch.bfloat16,))
        kwargs.setdefault("block_sizes", (16,))
        kwargs.setdefault("layouts", HEAD_LAYOUTS[:2])
        kwargs.setdefault("gemm_dtypes", (torch.float16, torch.bfloat16))
    launches = engine_launches(**kwargs)
    return [compile_launch(launch, arch, label) for arch in archs for label, launch in launches
            if arch >= FP8_MIN_ARCH or not uses_fp8(launch)]


def format_table(results: list[CompiledLaunch]) -> str:
    lines = ["| sm | kernel | configuration | compile-time constants | warps | registers | stack B | shared B | |",
             "|---|---|---|---|---:|---:|---:|---:|---|"]
    for r in results:
        consts = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in r.constants.items())
        status = r.error or "; ".join(r.notes) or "ok"
        lines.append(f"| {r.arch} | {r.kernel.strip('_')} | {r.label} | {consts} | {r.num_warps} | "
                     f"{r.registers if r.registers is not None else '?'} | "
                     f"{r.stack_bytes if r.stack_bytes is not None else '?'} | {r.shared_bytes} | {status} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="80,90", help="compute capabilities, comma-separated (default 80,90)")
    parser.add_argument("--quick", action="store_true",
                        help="bfloat16 (the GEMM also float16), block size 16, two head layouts")
    parser.add_argument("--json", action="store_true", help="one JSON object per launch instead of the table")
    args = parser.parse_args(argv)
    if triton is None:
        print("triton is not installed", file=sys.stderr)
        return 2
    results = compile_all(tuple(int(a) for a in args.arch.split(",")), quick=args.quick)
    if args.json:
        for r in results:
            row = {k: v for k, v in asdict(r).items() if k != "ptx"}
            row["tf32_dots"] = "tf32" in r.ptx
            print(json.dumps(row))
    else:
        print(format_table(results))
    print("\n" + summary(results))
    return 1 if any(r.error for r in results) else 0


def summary(results: list[CompiledLaunch]) -> str:
    errors = sum(r.error is not None for r in results)
    spills = sum(bool(r.stack_bytes) for r in results)
    over = sum(r.over_shared_limit for r in results)
    return (f"{len(results)} launches: {len(results) - errors} compiled, {errors} refused by the compiler; "
            f"{over} over the shared memory limit; {spills} with a stack frame (spilled registers)")


if __name__ == "__main__":
    sys.exit(main())
