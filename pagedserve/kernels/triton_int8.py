"""Weight-only int8 GEMM in Triton (w8a16): y = x · (weight · scale)ᵀ + bias, with x float16,
bfloat16 or float32 [M, K], weight int8 [N, K] and one float32 scale per output row (the
layout of the built-in `int8` method, plugins/int8_quantization.py).

Each program computes a [BLOCK_M, BLOCK_N] tile of y: it walks K in BLOCK_K steps, widens
the int8 weight tile to x's dtype (every int8 value is exact in fp16/bf16) and accumulates
x · wᵀ in float32; the row scales multiply the accumulator once at the end, then the bias
is added and the tile is rounded to x's dtype. The weight is read once per BLOCK_M rows of
x, as int8: a decode step (M of 1-16) reads half the bytes a bf16 weight takes. When the
output tiles are too few to fill the GPU (small M, narrow N), K is split across programs
(`split_k_for`) and a second kernel adds their float32 partials.

`register_op()` makes the kernel `torch.ops.pagedserve.w8a16_linear`, which `Int8Linear`
calls on CUDA (the worker registers it when it runs the Triton kernels). On CPU it runs
under TRITON_INTERPRET=1 (tests only).
"""

from __future__ import annotations

import os

import torch

from pagedserve.kernels import triton_ops

triton = triton_ops.triton
#: Triton's interpreter computes bfloat16 dot products wrongly (see triton_attention), so
#: there the operands are widened to float32; compiled kernels keep x's dtype.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _w8a16_gemm_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, part_ptr, M, N, K, stride_xm, stride_ym,
                           k_per_split, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, DOT_FP32: tl.constexpr,
                           DOT_PRECISION: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)  # this program's share of K (split-K), k_per_split wide
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
        w_cols = w_ptr + rn.to(tl.int64)[None, :] * K  # the weight tile read as [BLOCK_K, BLOCK_N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        k_lo = pid_k * k_per_split
        for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
            k = k0 + rk
            k_ok = k < K
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)
            if DOT_FP32:
                x = x.to(tl.float32)
            acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
        out_ok = m_ok[:, None] & n_ok[None, :]
        if SPLIT_K == 1:
            acc = acc * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            y = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
            tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=out_ok)
        else:  # a float32 partial sum [SPLIT_K, M, N]; _w8a16_reduce_kernel finishes
            part = part_ptr + (pid_k.to(tl.int64) * M + rm.to(tl.int64)[:, None]) * N + rn[None, :]
            tl.store(part, acc, mask=out_ok)

    @triton.jit
    def _w8a16_reduce_kernel(part_ptr, scale_ptr, bias_ptr, y_ptr, M, N, stride_ym, HAS_BIAS: tl.constexpr,
                             SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        acc = tl.zeros([BLOCK_N], tl.float32)
        for s in range(SPLIT_K):  # in a fixed order: the same result every run
            acc += tl.load(part_ptr + (s * M + row) * N + rn, mask=n_ok, other=0.0)
        acc = acc * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_ym + rn, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


def w8a16_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference: float32 x · (weight · scale)ᵀ + bias, rounded to x's dtype."""
    y = x.float() @ (weight.float() * scale.float()[:, None]).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def tiles_for(m: int, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for M rows of x. tl.dot wants 16 rows at least,
    so a decode (M <= 16) takes one 16-row tile and narrow, deep weight tiles: many programs
    over N, each streaming its weight rows (a GEMV bound by the weight's bytes). Larger M
    takes larger tiles that reuse each weight tile across more rows. float32 activations
    multiply in full float32 (not tensor cores), which holds both operands in registers:
    shallower tiles there. The sizes are the largest that compile without spilled registers
    for sm_80 and sm_90 (`python -m pagedserve.kernels.triton_aot`); not tuned on a GPU yet
    (benchmarks/gpu_kernels.py measures them)."""
    if dtype == torch.float32:
        return (16, 32, 32, 4) if m <= 16 else (32, 64, 32, 4) if m <= 64 else (64, 64, 32, 8)
    if m <= 16:
        return 16, 32, 128, 4
    if m <= 64:
        return 32, 64, 32, 4
    return 64, 128, 64, 8


def split_k_for(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> int:
    """K splits for a GEMM whose [BLOCK_M, BLOCK_N] tiles alone would not give every SM two
    programs (a decode step on a narrow projection: Llama-3-8B's o_proj at M = 1 has 128
    tiles of 32 columns for 132 SMs). Each split keeps at least 4 BLOCK_K steps. One split
    off CUDA (the interpreter), and from M > 64 (enough tiles, and the partials would cost
    more than they give)."""
    if device.type != "cuda" or m > 64:
        return 1
    block_m, block_n, block_k, _ = tiles_for(m, dtype)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    want = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(want, tiles), triton.cdiv(k, block_k) // 4, 16))


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None, split_k: int | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] · (weight [N, K] int8 · scale [N] float32)ᵀ (+ bias [N]),
    in x's dtype (float16, bfloat16 or float32). `split_k` None: `split_k_for`; above 1 the
    programs sum float32 partials of K ranges, which a second kernel adds in a fixed order."""
    triton_ops._need_triton()
    assert weight.dtype == torch.int8 and weight.dim() == 2, "weight: int8 [out, in]"
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), f"w8a16 takes float activations, not {x.dtype}"
    n, k = weight.shape
    shape = x.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*shape[:-1], n)
    block_m, block_n, block_k, warps = tiles_for(m, x.dtype)
    splits = split_k or split_k_for(m, n, k, x.device, x.dtype)
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), splits) * block_k
    splits = triton.cdiv(k, k_per_split)  # none empty
    weight, scale = weight.contiguous(), scale.contiguous()
    bias_arg = bias if bias is not None else scale  # unused without HAS_BIAS
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else y
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)
    _w8a16_gemm_kernel[grid](
        x2, weight, scale, bias_arg, y, part, m, n, k, x2.stride(0), y.stride(0), k_per_split,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=splits,
        DOT_FP32=_INTERPRETED and x.dtype != torch.float32,
        # a float32 model gets float32 products, as torch's own matmuls give it (not tf32)
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=warps,
    )
    if splits > 1:
        reduce_n = min(1024, triton.next_power_of_2(n))
        _w8a16_reduce_kernel[(m, triton.cdiv(n, reduce_n))](part, scale, bias_arg, y, m, n, y.stride(0),
                                                            HAS_BIAS=bias is not None, SPLIT_K=splits, BLOCK_N=reduce_n)
    return y.reshape(*shape[:-1], n)


#: the operator's name in torch's registry, where `Int8Linear` looks it up
OP_NAME = "pagedserve::w8a16_linear"
_registered = False


def register_op() -> None:
    """Register `torch.ops.pagedserve.w8a16_linear(x, weight, scale, bias=None)`: this
    kernel, for any device Triton runs on (CUDA; CPU under the interpreter). Idempotent."""
    global _registered
    if _registered:
        return
    triton_ops._need_triton()
    lib = torch.library.Library("pagedserve", "FRAGMENT")
    lib.define("w8a16_linear(Tensor x, Tensor w, Tensor scale, Tensor? bias=None) -> Tensor")
    lib.impl("w8a16_linear", w8a16_linear, "CompositeExplicitAutograd")
    _LIBRARIES.append(lib)  # the registration lasts as long as its Library object
    _registered = True


_LIBRARIES: list = []


def self_check(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Run the GEMM once on odd shapes against the reference: None when they agree, else why
    not (so the worker keeps the dequantize + F.linear path)."""
    try:
        g = torch.Generator().manual_seed(0)
        for m in (1, 19):
            x = torch.randn(m, 72, generator=g).to(device, dtype)
            w = torch.randint(-127, 128, (40, 72), generator=g, dtype=torch.int8).to(device)
            s = (torch.rand(40, generator=g) / 127).to(device)
            b = torch.randn(40, generator=g).to(device, dtype)
            got, want = w8a16_linear(x, w, s, b).float(), w8a16_linear_ref(x, w, s, b).float()
            if not torch.allclose(got, want, atol=5e-2, rtol=2e-2):
                return f"w8a16_linear disagrees with the torch reference at M={m}"
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use this kernel
        return f"{type(exc).__name__}: {exc}"
    return None
