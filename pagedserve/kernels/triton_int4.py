"""Weight-only int4 GEMM in Triton (w4a16): y = x · dequantize(W)ᵀ + bias, with x float16,
bfloat16 or float32 [M, K] and W in the int4 layout of plugins/int4_quantization.py (read
as it is stored, nothing repacked): uint8 qweight [N, padded / 2], two 4-bit codes a byte in
Q4_0's order (byte i of each block of 32 inputs holds input i in its low nibble, input i + 16
in its high one), float16 scales [N, padded / group] (widened to float32 as they are loaded)
and, asymmetric, uint8 zero points of the same shape in sixteenths of a step (z = z16 / 16;
symmetric: 8). `padded` is K rounded up to the group (a multiple of 32).

Each program computes a [BLOCK_M, BLOCK_N] tile of y and walks K in BLOCK_K steps, BLOCK_K a
power of two that divides the group, so a step lies in one group. A step loads BLOCK_K / 2
bytes of each of its weight rows and splits them into two code tiles, the low and the high
nibbles; x is read in the same order (the inputs of the low nibbles, then those of the
high ones), so nothing is shuffled in registers. The codes minus the zero point (q - 8,
-8..7, symmetric; 16·q - z16, -255..240, with zero points; exact in every float type) are
widened to x's dtype, two tl.dot accumulate x · (q - z) (or 16 times it) into a float32
partial, and the group's scale (divided by 16 with zero points) multiplies that partial once
into the float32 accumulator; the bias is added and the tile rounded to x's dtype at the end. The weight is
read once per BLOCK_M rows of x, as 4-bit codes: a decode step reads a quarter of the bytes
a bf16 weight takes (plus a scale per group). When the output tiles are too few to fill the
GPU (small M), K is split across programs (`split_k_for`) and a second kernel adds their
float32 partials in a fixed order.

Batch invariance. A row's bits depend on the walk over K, not on the other rows: BLOCK_K is
fixed by x's dtype and the group (`block_k_for`), never by M, so in the interpreter every
row is the same whatever M is, for a given split count. The split count (`split_k_for`)
depends on K alone for every M up to 16, is capped at 4 from M = 17 to 64 (the same count
there wherever K <= 4,096 with the 128-wide steps of group 128), and is 1 above 64; a row
computed with another split count is summed in another order and may differ in its last
bits. So a decode step's rows (M <= 16) do not depend on the batch, and a prefill's may
differ from them. Compiled, the 16-row tile and the 64-row tile of M > 16 need not round
alike inside the tensor cores (sm_90 may use wgmma for the larger one). The tests check rows
for M = 1..17 bitwise, with the default split count, 1 and 3, in the interpreter, and
compiled in their `gpu` twin (passed on an H100 before the tiles were retuned).

Above DEQUANTIZE_ABOVE_ROWS rows the registered operator does not run this GEMM: it
dequantizes the weight in one pass (`w4_dequantize`) and multiplies with torch's matmul.

`register_op()` makes the kernel `torch.ops.pagedserve.w4a16_linear`, which `Int4Linear`
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
BLOCK = 32  # inputs per packed block of 16 bytes (Q4_0's order); every group is a multiple of it
SYMMETRIC_ZERO = 8  # the zero point of a symmetric group (no zero points stored)
ZERO_STEPS = 16  # stored zero points are sixteenths of a step: z = z16 / 16

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _w4a16_gemm_kernel(x_ptr, q_ptr, scale_ptr, zero_ptr, bias_ptr, y_ptr, part_ptr, M, N, K, stride_xm,
                           stride_qn, stride_ym, k_per_split, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                           HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, DOT_FP32: tl.constexpr,
                           DOT_PRECISION: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)  # this program's share of K (split-K), k_per_split wide
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rb = tl.arange(0, BLOCK_K // 2)  # the step's bytes of a weight row
        lo = (rb // 16) * 32 + rb % 16  # the input of byte rb's low nibble; its high nibble's is lo + 16
        m_ok = rm < M
        n_ok = rn < N
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
        q_cols = q_ptr + rn.to(tl.int64)[None, :] * stride_qn  # the codes read as [BLOCK_K / 2, BLOCK_N]
        group_cols = rn.to(tl.int64) * (stride_qn * 2 // GROUP)  # each row's first scale (and zero point)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        k_lo = pid_k * k_per_split
        for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
            ka = k0 + lo
            kb = ka + 16
            xa = tl.load(x_rows + ka[None, :], mask=m_ok[:, None] & (ka < K)[None, :], other=0.0)
            xb = tl.load(x_rows + kb[None, :], mask=m_ok[:, None] & (kb < K)[None, :], other=0.0)
            # a step ends inside the padded row (BLOCK_K divides the group): no mask over K
            codes = tl.load(q_cols + (k0 // 2 + rb)[:, None], mask=n_ok[None, :], other=0)
            group = k0 // GROUP
            scale = tl.load(scale_ptr + group_cols + group, mask=n_ok, other=0.0).to(tl.float32)
            if DOT_FP32:
                xa = xa.to(tl.float32)
                xb = xb.to(tl.float32)
            if HAS_ZERO:  # zero points in sixteenths: 16·q - z16 (-255..240, exact), the scale / 16
                zero = tl.load(zero_ptr + group_cols + group, mask=n_ok, other=0).to(tl.int32)
                wa = ((codes & 15).to(tl.int32) * 16 - zero[None, :]).to(xa.dtype)
                wb = ((codes >> 4).to(tl.int32) * 16 - zero[None, :]).to(xa.dtype)
                scale = scale * 0.0625
            else:
                wa = ((codes & 15).to(tl.int32) - 8).to(xa.dtype)
                wb = ((codes >> 4).to(tl.int32) - 8).to(xa.dtype)
            part = tl.dot(xa, wa, input_precision=DOT_PRECISION)
            part = tl.dot(xb, wb, part, input_precision=DOT_PRECISION)
            acc += part * scale[None, :]
        out_ok = m_ok[:, None] & n_ok[None, :]
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            y = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
            tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=out_ok)
        else:  # a float32 partial sum [SPLIT_K, M, N], scales applied; _w4a16_reduce_kernel finishes
            part_out = part_ptr + (pid_k.to(tl.int64) * M + rm.to(tl.int64)[:, None]) * N + rn[None, :]
            tl.store(part_out, acc, mask=out_ok)

    @triton.jit
    def _w4a16_reduce_kernel(part_ptr, bias_ptr, y_ptr, M, N, stride_ym, HAS_BIAS: tl.constexpr,
                             SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        acc = tl.zeros([BLOCK_N], tl.float32)
        for s in range(SPLIT_K):  # in a fixed order: the same result every run
            acc += tl.load(part_ptr + (s * M + row) * N + rn, mask=n_ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_ym + rn, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


    @triton.jit
    def _w4_dequantize_kernel(q_ptr, scale_ptr, zero_ptr, w_ptr, N, K, half, GROUP: tl.constexpr,
                              HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
        # w [N, K] = (q - z) · s in w's dtype, from BLOCK_B bytes (2 · BLOCK_B inputs) of BLOCK_N
        # rows: the float32 product rounded once, as dequantize_ref(...).to(dtype) does
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rb = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        n_ok = rn < N
        lo = (rb // 16) * 32 + rb % 16  # byte rb's low-nibble input; its high nibble's is lo + 16
        rows = rn.to(tl.int64)[:, None]
        codes = tl.load(q_ptr + rows * half + rb[None, :], mask=n_ok[:, None] & (rb < half)[None, :], other=0)
        groups = rows * (half * 2 // GROUP) + (lo // GROUP)[None, :]  # a 32-input block lies in one group
        ok = n_ok[:, None] & (lo < K)[None, :]
        scale = tl.load(scale_ptr + groups, mask=ok, other=0.0).to(tl.float32)
        if HAS_ZERO:  # in sixteenths: (16·q - z16)·(s / 16), the same rounded product as (q - z)·s
            zero = tl.load(zero_ptr + groups, mask=ok, other=0).to(tl.int32)
            low = ((codes & 15).to(tl.int32) * 16 - zero).to(tl.float32) * (scale * 0.0625)
            high = ((codes >> 4).to(tl.int32) * 16 - zero).to(tl.float32) * (scale * 0.0625)
        else:
            low = ((codes & 15).to(tl.int32) - 8).to(tl.float32) * scale
            high = ((codes >> 4).to(tl.int32) - 8).to(tl.float32) * scale
        out = w_ptr + rows * K
        tl.store(out + lo[None, :], low.to(w_ptr.dtype.element_ty), mask=ok)
        tl.store(out + (lo + 16)[None, :], high.to(w_ptr.dtype.element_ty), mask=n_ok[:, None] & (lo + 16 < K)[None, :])


def dequantize_ref(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
                   in_features: int) -> torch.Tensor:
    """The float32 weight [N, in_features] of the int4 layout (plugins/int4_quantization.py's
    `dequantize`, which the kernels may not import): (q - z16 / 16) · s."""
    n, half = qweight.shape
    blocks = qweight.reshape(n, half // (BLOCK // 2), BLOCK // 2)
    codes = torch.stack([blocks & 15, blocks >> 4], dim=2).reshape(n, 2 * half).float()
    zero = zeros.float() / ZERO_STEPS if zeros is not None else torch.full_like(scales, SYMMETRIC_ZERO,
                                                                                dtype=torch.float32)
    w = (codes.reshape(n, -1, group_size) - zero[:, :, None]) * scales.float()[:, :, None]
    return w.reshape(n, 2 * half)[:, :in_features]


def w4a16_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     bias: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """The torch reference: float32 x · dequantize(W)ᵀ + bias, rounded to x's dtype."""
    y = x.float() @ dequantize_ref(qweight, scales, zeros, group_size, x.shape[-1]).to(x.device).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def block_k_for(group_size: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """The K step: the largest power of two that divides the group, up to 128 inputs (64
    codes a row) in float16/bfloat16 and 32 in float32 (whose full-precision dots hold both
    operands in registers). Independent of M: the same walk over K for every batch."""
    step = 32 if dtype == torch.float32 else 128
    while group_size % step:
        step //= 2
    return step


def tiles_for(m: int, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for M rows of x. tl.dot wants 16 rows at least, so a
    decode (M <= 16) takes one 16-row tile, 64 columns wide; above that, in float16 and
    bfloat16, 64 × 64 tiles with 4 warps: on an H100 (benchmarks/gpu_kernels.py's sweep,
    Llama-3-8B's projections in group 128, CUDA-graph times) they beat the 32 × 64 tiles at
    M = 64 by 1.16-1.26× and the 64 × 128 tiles of 8 warps at M = 256 by 1.38-1.92×; 128 × 64
    was within 15% of them there. Compiled for sm_80 with 128-wide K steps (group 128) this
    tile spills a few registers (8-112 bytes of stack; 8 warps spill too), and no A100 has
    timed it. float32 keeps the tiles the AOT check compiled for it, not measured on a GPU:
    32 × 64 up to 64 rows, then 64 × 64 with 8 warps."""
    if m <= 16:
        return 16, 64, 4
    if dtype == torch.float32:
        return (32, 64, 4) if m <= 64 else (64, 64, 8)
    return 64, 64, 4


#: K steps a program walks between K splits: on an H100 a decode step's GEMM in group 128
#: (128-wide steps) was fastest with about 8 steps, 1,024 inputs, a program on every
#: Llama-3-8B projection (4 splits of K = 4096, 14-16 of K = 14336), whatever the output
#: tiles' count (64 for o_proj, 448 for gate_up). Counting steps rather than inputs keeps
#: group 32's 32-wide steps at as many splits as the tile-count rule before it gave them.
STEPS_PER_SPLIT = 8


def split_k_for(m: int, n: int, k: int, group_size: int, device: torch.device,
                dtype: torch.dtype = torch.bfloat16) -> int:
    """K splits for a decode step's GEMM (M <= 64): about STEPS_PER_SPLIT K steps a program,
    at most 16 splits (4 above 16 rows, the most the sweep measured there). It depends on K
    and the step alone up to 16 rows, so a row is summed in the same order for every batch of
    a decode bucket. One split off CUDA (the interpreter) and from M > 64. `n` is kept for
    the callers; the count does not depend on it."""
    if device.type != "cuda" or m > 64:
        return 1
    steps = triton.cdiv(k, block_k_for(group_size, dtype))
    return max(1, min(triton.cdiv(steps, STEPS_PER_SPLIT), 16 if m <= 16 else 4))


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, group_size: int = 32, split_k: int | None = None,
                 tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] · dequantize(qweight, scales, zeros)ᵀ (+ bias [N]), in x's
    dtype (float16, bfloat16 or float32); the layout is `Int4Weights`' (module docstring),
    zeros None: symmetric. `split_k` None: `split_k_for`; above 1 the programs sum float32
    partials of K ranges, which a second kernel adds in a fixed order. `tiles` (BLOCK_M,
    BLOCK_N, num_warps) None: `tiles_for`; given, for tuning (benchmarks/gpu_kernels.py)."""
    triton_ops._need_triton()
    assert qweight.dtype == torch.uint8 and qweight.dim() == 2, "qweight: uint8 [out, padded_in / 2]"
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), f"w4a16 takes float activations, not {x.dtype}"
    n, half = qweight.shape
    k = x.shape[-1]
    assert group_size > 0 and group_size % BLOCK == 0, f"group size {group_size}: not a multiple of {BLOCK}"
    assert 2 * half % group_size == 0 and k <= 2 * half, f"{k} inputs do not fit {2 * half} in groups of {group_size}"
    assert scales.shape == (n, 2 * half // group_size), f"scales {tuple(scales.shape)} for {n} rows of groups"
    assert scales.dtype == torch.float16, f"scales: float16, not {scales.dtype}"
    assert zeros is None or (zeros.dtype == torch.uint8 and zeros.shape == scales.shape), "zeros: uint8 like scales"
    shape = x.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*shape[:-1], n)
    block_m, block_n, warps = tiles or tiles_for(m, x.dtype)
    block_k = block_k_for(group_size, x.dtype)
    splits = split_k or split_k_for(m, n, k, group_size, x.device, x.dtype)
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), splits) * block_k
    splits = triton.cdiv(k, k_per_split)  # none empty
    qweight, scales = qweight.contiguous(), scales.contiguous()
    zero_arg = zeros.contiguous() if zeros is not None else qweight  # unused without HAS_ZERO
    bias_arg = bias if bias is not None else scales  # unused without HAS_BIAS
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else y
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)
    _w4a16_gemm_kernel[grid](
        x2, qweight, scales, zero_arg, bias_arg, y, part, m, n, k, x2.stride(0), half, y.stride(0), k_per_split,
        GROUP=group_size, HAS_ZERO=zeros is not None, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT_K=splits, DOT_FP32=_INTERPRETED and x.dtype != torch.float32,
        # a float32 model gets float32 products, as torch's own matmuls give it (not tf32)
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=warps,
    )
    if splits > 1:
        reduce_n = min(1024, triton.next_power_of_2(n))
        _w4a16_reduce_kernel[(m, triton.cdiv(n, reduce_n))](part, bias_arg, y, m, n, y.stride(0),
                                                            HAS_BIAS=bias is not None, SPLIT_K=splits, BLOCK_N=reduce_n)
    return y.reshape(*shape[:-1], n)


def w4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
                  in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, in_features] in `dtype`, (q - z) · s rounded once from float32: the
    same values as dequantize_ref(...).to(dtype), in one pass over the packed bytes."""
    triton_ops._need_triton()
    n, half = qweight.shape
    assert scales.shape == (n, 2 * half // group_size) and in_features <= 2 * half
    assert scales.dtype == torch.float16, f"scales: float16, not {scales.dtype}"
    w = torch.empty((n, in_features), dtype=dtype, device=qweight.device)
    block_n, block_b = 32, 64
    _w4_dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(half, block_b))](
        qweight.contiguous(), scales.contiguous(), zeros.contiguous() if zeros is not None else qweight, w,
        n, in_features, half, GROUP=group_size, HAS_ZERO=zeros is not None, BLOCK_N=block_n, BLOCK_B=block_b)
    return w


#: rows of x above which the operator dequantizes the weight to x's dtype (`w4_dequantize`)
#: and multiplies with torch's matmul (cuBLAS on a GPU) instead of running the w4a16 GEMM:
#: on an H100 the GEMM's best tiles take 4x the time of a bf16 matmul at M = 256
#: (docs/performance.md, the w4a16 rows), while a decode batch keeps the 4-bit reads.
DEQUANTIZE_ABOVE_ROWS = 128


def _w4a16_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
              bias: torch.Tensor | None, group_size: int) -> torch.Tensor:
    if x.numel() > DEQUANTIZE_ABOVE_ROWS * x.shape[-1]:  # a prefill
        w = w4_dequantize(qweight, scales, zeros, group_size, x.shape[-1], x.dtype)
        return torch.nn.functional.linear(x, w, bias)
    return w4a16_linear(x, qweight, scales, zeros, bias, group_size)


#: the operator's name in torch's registry, where `Int4Linear` looks it up
OP_NAME = "pagedserve::w4a16_linear"
_registered = False
_LIBRARIES: list = []


def register_op() -> None:
    """Register `torch.ops.pagedserve.w4a16_linear(x, qweight, scales, zeros, bias,
    group_size)` (the arguments of the CPU `int4_linear`): this kernel, for any device
    Triton runs on (CUDA; CPU under the interpreter). Idempotent."""
    global _registered
    if _registered:
        return
    triton_ops._need_triton()
    lib = torch.library.Library("pagedserve", "FRAGMENT")
    lib.define("w4a16_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, "
               "int group_size) -> Tensor")
    lib.impl("w4a16_linear", _w4a16_op, "CompositeExplicitAutograd")
    _LIBRARIES.append(lib)  # the registration lasts as long as its Library object
    _registered = True


def self_check(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Run the GEMM once on odd shapes (group 32 with zero points, group 128 without) against
    the reference: None when they agree, else why not (so the worker keeps dequantize +
    F.linear)."""
    try:
        g = torch.Generator().manual_seed(0)
        for m, group, asym in ((1, 32, True), (19, 128, False)):
            k, n = 200, 40  # padded to 224 / 256 inputs
            padded = -(-k // group) * group
            x = torch.randn(m, k, generator=g).to(device, dtype)
            q = torch.randint(0, 256, (n, padded // 2), generator=g, dtype=torch.uint8).to(device)
            s = (torch.rand(n, padded // group, generator=g) * 0.01).half().to(device)  # float16, as stored
            z = torch.randint(0, 256, s.shape, generator=g, dtype=torch.uint8).to(device) if asym else None  # sixteenths
            b = torch.randn(n, generator=g).to(device, dtype)
            got, want = w4a16_linear(x, q, s, z, b, group).float(), w4a16_linear_ref(x, q, s, z, b, group).float()
            if not torch.allclose(got, want, atol=5e-2, rtol=2e-2):
                return f"w4a16_linear disagrees with the torch reference at M={m}, group {group}"
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use this kernel
        return f"{type(exc).__name__}: {exc}"
    return None
