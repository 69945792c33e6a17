"""Triton kernels for the elementwise hot path, each beside the torch reference it must match:
RMSNorm fused with the residual add, SiLU-and-mul, rotary embedding, and the KV-cache store
by slot mapping. On CPU they run under `TRITON_INTERPRET=1` (slow; tests use small shapes).

The model's layers (`plugins/models/`) call these when the engine
runs the Triton attention backend (on CUDA by default), and their torch code otherwise.
The KV store also writes the quantized caches (int8 rows with their scale, float8_e4m3fn).
"""

from __future__ import annotations

import torch

from pagedserve.kernels.reference_ops import (  # noqa: F401 - each kernel beside its reference
    kv_row_width,
    kv_store_ref,
    rms_norm_ref,
    rotary_ref,
    silu_and_mul_ref,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
    triton = None


# -- Triton kernels --------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        base = row * n_cols
        x = tl.load(x_ptr + base + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            # Round the sum to the input dtype first, as the reference's `x + residual` does.
            x = (x.to(tl.float32) + tl.load(res_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(res_out_ptr + base + cols, x, mask=mask)
        h = x.to(tl.float32)
        h = h * tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        # Arithmetic in float32 only (rounding h to the input dtype first, as the reference
        # does); the one rounding of the product happens at the store.
        tl.store(out_ptr + base + cols, (w * h.to(x.dtype).to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, d, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < d
        gate = tl.load(x_ptr + row * 2 * d + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * d + d + cols, mask=mask, other=0.0)
        silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype).to(tl.float32)  # rounded as torch's silu output
        tl.store(out_ptr + row * d + cols, (silu * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(x_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr, num_heads, head_dim,
                       HALF: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0)
        head = tl.program_id(1)
        i = tl.arange(0, BLOCK)
        mask = i < HALF
        pos = tl.load(pos_ptr + token)
        base = (token * num_heads + head) * head_dim
        x1 = tl.load(x_ptr + base + i, mask=mask, other=0.0)
        x2 = tl.load(x_ptr + base + HALF + i, mask=mask, other=0.0)
        c1 = tl.load(cos_ptr + pos * head_dim + i, mask=mask, other=0.0)
        c2 = tl.load(cos_ptr + pos * head_dim + HALF + i, mask=mask, other=0.0)
        s1 = tl.load(sin_ptr + pos * head_dim + i, mask=mask, other=0.0)
        s2 = tl.load(sin_ptr + pos * head_dim + HALF + i, mask=mask, other=0.0)
        tl.store(out_ptr + base + i, x1 * c1 - x2 * s1, mask=mask)
        tl.store(out_ptr + base + HALF + i, x2 * c2 + x1 * s2, mask=mask)

    @triton.jit
    def _kv_store_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, value_offset, row_size, BLOCK: tl.constexpr):
        token = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < row_size
        slot = tl.load(slot_ptr + token).to(tl.int64)
        # slot -1: a padding row (CUDA graph batches), nothing to store
        mask = mask & (tl.zeros([BLOCK], tl.int64) + slot >= 0)
        k = tl.load(k_ptr + token * row_size + cols, mask=mask)
        v = tl.load(v_ptr + token * row_size + cols, mask=mask)
        tl.store(cache_ptr + slot * row_size + cols, k, mask=mask)
        tl.store(cache_ptr + value_offset + slot * row_size + cols, v, mask=mask)

    # -- the quantized KV cache (the row layout of reference_ops.quantize_kv_rows) ----------

    @triton.jit
    def round_half_even(v):
        """float32 v (|v| < 2^31) rounded to the nearest integer, ties to even, as torch.round:
        exact in integer arithmetic (the interpreter has no rint)."""
        t = v.to(tl.int32)  # toward zero
        f = v - t.to(tl.float32)  # exact
        up = (tl.abs(f) > 0.5) | ((tl.abs(f) == 0.5) & ((t % 2) != 0))
        return t.to(tl.float32) + tl.where(up, tl.where(v < 0, -1.0, 1.0), 0.0)

    @triton.jit
    def to_fp8e4m3(x):
        """float32 → float8_e4m3fn as torch converts it after the clamp to +-448: rounded to
        the nearest e4m3 value (ties to even) in float32 first, so the conversion itself is
        exact (the interpreter's own rounding loses the carry into the exponent)."""
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
        bits = x.to(tl.int32, bitcast=True)
        # the spacing of e4m3 values around |x|: 2^(exponent - 3), subnormals below 2^-6
        e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3
        step = ((e + 127) << 23).to(tl.float32, bitcast=True)
        inv_step = ((127 - e) << 23).to(tl.float32, bitcast=True)
        r = round_half_even(tl.abs(x) * inv_step) * step
        signed = r.to(tl.int32, bitcast=True) | (bits & -2147483648)  # keeps the sign of -0.0
        return signed.to(tl.float32, bitcast=True).to(tl.float8e4nv)

    @triton.jit
    def _store_quantized_row(src_ptr, dst_ptr, d, d_ok, slot, HEAD_DIM: tl.constexpr, INT8: tl.constexpr):
        x = tl.load(src_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        store_ok = d_ok & (tl.zeros_like(d).to(tl.int64) + slot >= 0)  # slot -1: a padding row
        if INT8:
            scale = tl.math.div_rn(tl.max(tl.abs(x), axis=0), 127.0)  # IEEE division, as torch's
            q = round_half_even(tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0)))
            q = tl.minimum(tl.maximum(q, -127.0), 127.0)
            tl.store(dst_ptr + d, q.to(tl.int8), mask=store_ok)
            # the row's float32 scale in the 4 bytes after its values (4-byte aligned), stored
            # as a one-element vector (the interpreter takes no scalar mask)
            one = tl.arange(0, 1)
            tl.store((dst_ptr + HEAD_DIM + one).to(tl.pointer_type(tl.float32)), tl.zeros([1], tl.float32) + scale,
                     mask=one.to(tl.int64) + slot >= 0)
        else:
            tl.store(dst_ptr + d, to_fp8e4m3(x), mask=store_ok)

    @triton.jit
    def _kv_store_quantized_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, value_offset, num_kv_heads,
                                   HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, ROW_WIDTH: tl.constexpr,
                                   INT8: tl.constexpr):
        token = tl.program_id(0)
        head = tl.program_id(1)
        slot = tl.load(slot_ptr + token).to(tl.int64)  # -1: a padding row (CUDA graphs), not stored
        d = tl.arange(0, HEAD_DIM_P2)
        d_ok = d < HEAD_DIM
        src = (token.to(tl.int64) * num_kv_heads + head) * HEAD_DIM
        dst = (slot * num_kv_heads + head) * ROW_WIDTH
        _store_quantized_row(k_ptr + src, cache_ptr + dst, d, d_ok, slot, HEAD_DIM, INT8)
        _store_quantized_row(v_ptr + src, cache_ptr + value_offset + dst, d, d_ok, slot, HEAD_DIM, INT8)


#: the cache dtypes whose rows the kernels quantize and dequantize (reference_ops' layout)
QUANTIZED_KV_DTYPES = (torch.int8, torch.float8_e4m3fn)


def check_kv_cache_device(kv_cache: torch.Tensor) -> None:
    """Triton has no float8_e4m3fn below sm_89 (A100 is sm_80): say so instead of failing
    inside the compiler at the first launch. int8 caches compile everywhere."""
    if kv_cache.dtype == torch.float8_e4m3fn and kv_cache.is_cuda:
        major, minor = torch.cuda.get_device_capability(kv_cache.device)
        if (major, minor) < (8, 9):
            raise RuntimeError(f"a float8_e4m3fn KV cache needs a GPU of sm_89 or later for the Triton kernels "
                               f"(this one is sm_{major}{minor}); use an int8 KV cache")


def _need_triton() -> None:
    if triton is None:
        raise RuntimeError("triton is not installed")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Triton version of `rms_norm_ref` over the last dimension (one program per row)."""
    _need_triton()
    shape = x.shape
    x = x.reshape(-1, shape[-1]).contiguous()
    n, hidden = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    res_in = residual.reshape(-1, hidden).contiguous() if residual is not None else x
    _rms_norm_kernel[(n,)](x, res_in, weight, out, res_out, hidden, eps,
                           HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden))
    return out.view(shape) if residual is None else (out.view(shape), res_out.view(shape))


def silu_and_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Triton version of `silu_and_mul_ref`."""
    _need_triton()
    x = x.contiguous()
    n, two_d = x.shape
    d = two_d // 2
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    block = min(block, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(n, triton.cdiv(d, block))](x, out, d, BLOCK=block)
    return out


def rotary(positions: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Triton version of `rotary_ref` (one program per token and head)."""
    _need_triton()
    x = x.contiguous()
    n, num_heads, head_dim = x.shape
    out = torch.empty_like(x)
    half = head_dim // 2
    _rotary_kernel[(n, num_heads)](x, out, positions, cos.contiguous(), sin.contiguous(), num_heads, head_dim,
                                   HALF=half, BLOCK=triton.next_power_of_2(half))
    return out


def kv_store(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             block: int = 1024) -> None:
    """Triton version of `kv_store_ref`; kv_cache must be contiguous. Tokens whose slot is
    -1 are skipped (the padding rows of a CUDA graph batch). An int8 or float8_e4m3fn cache
    gets its rows quantized on the way in (one program per token and KV head), in the layout
    of `reference_ops.quantize_kv_rows`, bit for bit."""
    _need_triton()
    assert kv_cache.is_contiguous(), "the KV pool is one contiguous tensor per layer"
    n, num_kv_heads, head_dim = key.shape
    if kv_cache.dtype in QUANTIZED_KV_DTYPES:
        width = kv_cache.shape[-1]
        assert width == kv_row_width(head_dim, kv_cache.dtype), f"a {kv_cache.dtype} cache of rows {width} wide"
        check_kv_cache_device(kv_cache)
        if n:
            _kv_store_quantized_kernel[(n, num_kv_heads)](
                key.contiguous(), value.contiguous(), kv_cache, slot_mapping, kv_cache[0].numel(), num_kv_heads,
                HEAD_DIM=head_dim, HEAD_DIM_P2=triton.next_power_of_2(head_dim), ROW_WIDTH=width,
                INT8=kv_cache.dtype == torch.int8)
        return
    row_size = num_kv_heads * head_dim
    block = min(block, triton.next_power_of_2(row_size))
    _kv_store_kernel[(n, triton.cdiv(row_size, block))](key.contiguous(), value.contiguous(), kv_cache, slot_mapping,
                                                        kv_cache[0].numel(), row_size, BLOCK=block)
