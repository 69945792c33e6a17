"""Check and time the Triton attention kernel on a GPU, in one call, and print a table.

    python benchmarks/gpu_kernels.py            # on an NVIDIA GPU (issue #4's figures)
    python benchmarks/gpu_kernels.py --smoke    # tiny shapes; runs anywhere (TRITON_INTERPRET=1 on CPU)

- copy bandwidth: a large device-to-device copy, the ceiling for memory-bound kernels;
- decode attention, batch 64, contexts 1k-8k, Llama-3-8B heads (32 query, 8 KV, head_dim
  128), bf16: bytes of K/V read per second against that ceiling (target >= 70%);
- prefill attention, fresh causal chunks: TFLOP/s against torch's scaled_dot_product_attention
  on the same shapes (target >= 0.8x);
- decode attention over quantized KV caches (int8 rows with their scale, float8_e4m3fn rows;
  float8 on sm_89+ only), same batches: K/V bytes read per second, and the time against the
  bf16 cache's;
- the w8a16 GEMM (int8 weights, bf16 activations) on Llama-3-8B's projections at M = 1-256:
  TFLOP/s, GB/s of weight + activation traffic, and its time against torch's bf16 matmul
  (its "max |diff|" is relative to the output's largest value);
- the w4a16 GEMM (int4 weights, bf16 activations) on the same shapes, group 128 symmetric,
  at M = 1, 16, 64 and 256, timed from CUDA graphs over weight copies past L2 (as a decode
  step runs it), against the bf16 matmul and the w8a16 GEMM timed the same way; and its
  tile and K-split choices against others (`--sweep`), and a prefill's rows through the
  operator that dequantizes above 128 rows (`w4a16_cases`).
`--only attention`, `--only gemm` or `--only w4a16` runs a part.
Every timed case is first checked against a torch reference.

The end-to-end figures (a Llama-3-8B-shaped model against transformers) are
benchmarks/gpu_e2e.py's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial

import torch


def _timed(fn, device: torch.device, repeat: int) -> float:
    """Seconds of one fn(), after one warm-up. On a GPU: the mean of `repeat` calls launched
    back to back between two CUDA events, so the host's launch work overlaps the kernels
    instead of adding to each (the H100 run of 2026-11-26 timed each call by the host clock
    with a sync, which a 0.2 ms kernel feels). On a CPU: the median of `repeat` timed calls."""
    fn()
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        for _ in range(repeat):
            fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3 / repeat
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device, num_bytes: int, repeat: int) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / _timed(lambda: dst.copy_(src), device, repeat)  # read + write


def _batch(query_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype, device, seed=0):
    from pagedserve.common.contracts import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq)
    perm = torch.randperm(num_blocks, generator=g)
    tables, offset = [], 0
    for n in blocks_per_seq:
        tables.append(perm[offset : offset + n].tolist())
        offset += n
    meta = AttentionMetadata.for_batch(query_lens, seq_lens, tables, block_size, device)
    n_tokens = sum(query_lens)
    query = torch.randn(n_tokens, heads, head_dim, generator=g).to(device, dtype)
    key = torch.randn(n_tokens, kv_heads, head_dim, generator=g).to(device, dtype)
    value = torch.randn(n_tokens, kv_heads, head_dim, generator=g).to(device, dtype)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(device, dtype)
    return query, key, value, cache, meta


def _check(query, key, value, cache, meta, block_size, scale) -> float:
    """Max abs difference of the Triton backend from the torch backend on this batch."""
    from pagedserve.kernels.torch_attention import TorchAttentionBackend
    from pagedserve.kernels.triton_attention import TritonAttentionBackend

    outs = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        backend.prepare(meta, block_size)
        outs.append(backend.forward(query, key, value, cache.clone(), meta, scale).float())
    return (outs[0] - outs[1]).abs().max().item()


def pick_device(smoke: bool) -> tuple[torch.device, str] | None:
    """The GPU, or without one the CPU under Triton's interpreter, which only --smoke may use
    (None then, after saying so). Call before importing any kernel."""
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.cuda.get_device_name()
    if not smoke:
        print("no GPU: run with --smoke to check the script on tiny shapes", file=sys.stderr)
        return None
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return torch.device("cpu"), "CPU (Triton interpreter)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script itself")
    parser.add_argument("--only", choices=["attention", "gemm", "w4a16"], help="the attention cases, the GEMM "
                        "cases (w8a16 and w4a16) or the w4a16 ones only")
    parser.add_argument("--sweep", action="store_true", help="also time the w4a16 tile and K-split choices")
    parser.add_argument("--groups", default="128", help="the w4a16 group sizes, comma-separated (default 128; "
                        "32 is the CPU default's group)")
    args = parser.parse_args()
    picked = pick_device(args.smoke)
    if picked is None:
        return 2
    device, name = picked
    if args.smoke:
        heads, kv_heads, head_dim, block_size, batch = 4, 2, 64, 16, 2
        contexts, prefill_lens, copy_bytes, repeat = [40, 70], [32], 1 << 20, 1
    else:
        heads, kv_heads, head_dim, block_size, batch = 32, 8, 128, 16, 64
        contexts, prefill_lens, copy_bytes, repeat = [1024, 2048, 4096, 8192], [1024, 2048, 4096], 1 << 30, 20
    dtype = torch.bfloat16
    scale = head_dim**-0.5
    copy_bw = copy_bandwidth(device, copy_bytes, repeat)
    print(f"device: {name}; torch {torch.__version__}; copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    print(f"{'case':34}{'max |diff|':>12}{'time ms':>10}{'figure':>22}")
    ok = True
    if args.only in (None, "attention"):
        ok &= attention_cases(device, args.smoke, contexts, prefill_lens, batch, heads, kv_heads, head_dim, block_size,
                              dtype, scale, repeat, copy_bw)
    if args.only in (None, "gemm"):
        ok &= gemm_cases(device, args.smoke, repeat)
    if args.only in (None, "gemm", "w4a16"):
        for group in (int(g) for g in args.groups.split(",")):
            ok &= w4a16_cases(device, args.smoke, repeat, args.sweep, group)
    print("all checks passed" if ok else "CHECK FAILED: a Triton kernel disagrees with its torch reference")
    return 0 if ok else 1


def attention_cases(device, smoke, contexts, prefill_lens, batch, heads, kv_heads, head_dim, block_size, dtype, scale,
                    repeat, copy_bw) -> bool:
    from pagedserve.kernels.triton_attention import TritonAttentionBackend, paged_attention

    ok = True
    for ctx in contexts:  # decode: one query per sequence, batch of them
        q, k, v, cache, meta = _batch([1] * batch, [ctx] * batch, heads, kv_heads, head_dim, block_size, dtype, device)
        diff = _check(q, k, v, cache, meta, block_size, scale)
        backend = TritonAttentionBackend()
        backend.prepare(meta, block_size)
        out = torch.empty_like(q)
        seconds = _timed(lambda q=q, cache=cache, meta=meta, out=out: paged_attention(q, cache, meta, scale, out), device, repeat)
        kv_bytes = 2 * batch * ctx * kv_heads * head_dim * cache.element_size()
        bw = kv_bytes / seconds
        ok &= diff < 5e-2
        print(f"{f'decode b={batch} ctx={ctx}':34}{diff:12.2e}{seconds * 1e3:10.3f}"
              f"{f'{bw / 1e9:.0f} GB/s = {100 * bw / copy_bw:.0f}%':>22}")

    for length in prefill_lens:  # prefill: fresh causal chunks, 4 sequences
        n_seq = 4 if not smoke else 1
        q, k, v, cache, meta = _batch([length] * n_seq, [length] * n_seq, heads, kv_heads, head_dim, block_size,
                                      dtype, device)
        diff = _check(q, k, v, cache, meta, block_size, scale)
        backend = TritonAttentionBackend()
        backend.prepare(meta, block_size)
        from pagedserve.kernels.triton_ops import kv_store

        kv_store(k, v, cache, meta.slot_mapping)
        out = torch.empty_like(q)
        seconds = _timed(lambda q=q, cache=cache, meta=meta, out=out: paged_attention(q, cache, meta, scale, out), device, repeat)
        flops = n_seq * 2 * 2 * heads * head_dim * length * length / 2  # QK^T and PV, causal half
        dq = q.view(n_seq, length, heads, head_dim).transpose(1, 2)
        dk = k.view(n_seq, length, kv_heads, head_dim).transpose(1, 2)
        dv = v.view(n_seq, length, kv_heads, head_dim).transpose(1, 2)

        def sdpa(dq=dq, dk=dk, dv=dv):
            return torch.nn.functional.scaled_dot_product_attention(dq, dk, dv, is_causal=True, scale=scale, enable_gqa=True)

        sdpa_seconds = _timed(sdpa, device, repeat)
        ok &= diff < 5e-2
        print(f"{f'prefill {n_seq}x{length}':34}{diff:12.2e}{seconds * 1e3:10.3f}"
              f"{f'{flops / seconds / 1e12:.1f} TF/s = {sdpa_seconds / seconds:.2f}x SDPA':>22}")
    warp_cases(device, prefill_lens[-1:] if not smoke else prefill_lens, heads, kv_heads, head_dim, block_size,
               dtype, scale, repeat)
    ok &= quantized_decode_cases(device, smoke, contexts, batch, heads, kv_heads, head_dim, block_size, scale,
                                 repeat, copy_bw)
    return ok


def warp_cases(device, lengths, heads, kv_heads, head_dim, block_size, dtype, scale, repeat) -> None:
    """The prefill tiles at 4 and at 8 warps (triton_attention._num_warps picks by tile size)."""
    from pagedserve.kernels import triton_attention
    from pagedserve.kernels.triton_attention import TritonAttentionBackend, paged_attention

    chosen = triton_attention._num_warps
    try:
        for length in lengths:
            q, _, _, cache, meta = _batch([length] * 4, [length] * 4, heads, kv_heads, head_dim, block_size, dtype,
                                          device)
            TritonAttentionBackend().prepare(meta, block_size)
            out, times = torch.empty_like(q), {}
            for warps in (4, 8):
                triton_attention._num_warps = lambda *_, w=warps: w
                times[warps] = _timed(lambda q=q, cache=cache, meta=meta, out=out: paged_attention(q, cache, meta, scale, out), device, repeat)
            triton_attention._num_warps = chosen
            picked = chosen(TritonAttentionBackend().block_m * (heads // kv_heads), max(16, head_dim),
                            q.element_size(), triton_attention._arch(q.device))
            print(f"{f'prefill 4x{length} warps':34}{'':12}{times[4] * 1e3:10.3f}"
                  f"{f'4: {times[4] * 1e3:.3f} ms, 8: {times[8] * 1e3:.3f} ms; picks {picked}':>40}")
    finally:
        triton_attention._num_warps = chosen


def quantized_decode_cases(device, smoke, contexts, batch, heads, kv_heads, head_dim, block_size, scale, repeat,
                           copy_bw) -> bool:
    """Decode attention over int8 and float8_e4m3fn caches, checked against the torch
    backend's decode attention over the same cache dequantized to bf16."""
    from pagedserve.kernels import triton_ops
    from pagedserve.kernels.reference_ops import dequantize_kv_rows, quantize_kv_rows
    from pagedserve.kernels.torch_attention import TorchAttentionBackend
    from pagedserve.kernels.triton_attention import TritonAttentionBackend, paged_attention

    dtype, ok = torch.bfloat16, True
    cache_dtypes = [torch.int8, torch.float8_e4m3fn]
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        print("float8_e4m3fn KV cache: skipped, this GPU has no float8 (sm_89+)")
        cache_dtypes.remove(torch.float8_e4m3fn)
    for ctx in contexts:
        q, _, _, cache, meta = _batch([1] * batch, [ctx] * batch, heads, kv_heads, head_dim, block_size, dtype, device)
        backend = TritonAttentionBackend()
        backend.prepare(meta, block_size)
        out = torch.empty_like(q)
        float_seconds = _timed(lambda q=q, cache=cache, meta=meta, out=out: paged_attention(q, cache, meta, scale, out),
                               device, repeat)
        for cache_dtype in cache_dtypes:
            qcache = quantize_kv_rows(cache, cache_dtype)
            triton_ops.check_kv_cache_device(qcache)
            reference = TorchAttentionBackend()
            reference.prepare(meta, block_size)
            want = reference.attend_decodes(q, dequantize_kv_rows(qcache, head_dim, dtype), meta, scale).float()
            backend.prepare(meta, block_size)  # the reference's prepare replaced the plan
            got = paged_attention(q, qcache, meta, scale, torch.empty_like(q)).float()
            diff = (got - want).abs().max().item()
            seconds = _timed(lambda q=q, c=qcache, meta=meta, out=out: paged_attention(q, c, meta, scale, out),
                             device, repeat)
            kv_bytes = 2 * batch * ctx * kv_heads * qcache.shape[-1] * qcache.element_size()
            bw = kv_bytes / seconds
            ok &= diff < 5e-2
            name = "int8" if cache_dtype == torch.int8 else "fp8"
            print(f"{f'decode kv-{name} b={batch} ctx={ctx}':34}{diff:12.2e}{seconds * 1e3:10.3f}"
                  f"{f'{bw / 1e9:.0f} GB/s = {100 * bw / copy_bw:.0f}%, {float_seconds / seconds:.2f}x bf16':>34}")
    return ok


#: Llama-3-8B's linear layers: (name, out features N, in features K)
LLAMA3_8B_LINEARS = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]


def gemm_cases(device, smoke, repeat) -> bool:
    """The w8a16 GEMM against torch's bf16 matmul of the dequantized weight, checked against
    the float32 reference (relative to the output's largest value)."""
    from pagedserve.kernels.triton_int8 import w8a16_linear, w8a16_linear_ref

    shapes, rows = ([("tiny", 48, 72)], [1, 17]) if smoke else (LLAMA3_8B_LINEARS, [1, 2, 4, 8, 16, 32, 64, 128, 256])
    dtype, ok = torch.bfloat16, True
    g = torch.Generator().manual_seed(0)
    for name, n, k in shapes:
        w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).to(device)
        scale = (torch.rand(n, generator=g) * 0.05 / 127).to(device)
        w_bf16 = (w.float() * scale[:, None]).to(dtype)  # what torch's path multiplies by
        for m in rows:
            x = torch.randn(m, k, generator=g).to(device, dtype)
            want = w8a16_linear_ref(x, w, scale).float()
            rel = ((w8a16_linear(x, w, scale).float() - want).abs().max() / want.abs().max()).item()
            seconds = _timed(lambda x=x, w=w, s=scale: w8a16_linear(x, w, s), device, repeat)
            torch_seconds = _timed(lambda x=x, wb=w_bf16: torch.nn.functional.linear(x, wb), device, repeat)
            traffic = n * k + 4 * n + 2 * m * (k + n)  # int8 weight, scales, bf16 x and y
            ok &= rel < 1e-2
            figure = (f"{2 * m * n * k / seconds / 1e12:.2f} TF/s {traffic / seconds / 1e9:.0f} GB/s, "
                      f"{torch_seconds / seconds:.2f}x bf16")
            print(f"{f'w8a16 {name} M={m} N={n} K={k}':34}{rel:12.2e}{seconds * 1e3:10.3f}{figure:>34}")
    return ok


#: bytes of weights a timed case cycles through, so that no call finds its weight in L2 (50 MB
#: on an H100): a small weight gets copies up to this much
_PAST_L2 = 256 << 20


def _graph_timed(calls, device, repeat: int) -> float:
    """GPU seconds per call with no host launch cost between calls: `repeat` rounds over
    `calls` (one per copy of a weight) captured in one CUDA graph, replayed three times. A
    decode step runs its linears this way (from a CUDA graph). Off CUDA: `_timed` of the first."""
    if device.type != "cuda":
        return _timed(calls[0], device, 1)
    for fn in calls:  # compile, and allocate outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            for fn in calls:
                fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (3 * repeat * len(calls))


def _copies(nbytes: int, smoke: bool) -> int:
    return 1 if smoke else max(1, min(16, -(-_PAST_L2 // nbytes)))


#: w4a16 tile choices tried at each batch: (BLOCK_M, BLOCK_N, num_warps) x K splits
W4A16_SWEEP = {1: ([(16, 32, 4), (16, 64, 4), (16, 128, 4)], [1, 2, 4, 8, 16]),
               16: ([(16, 32, 4), (16, 64, 4), (16, 128, 4)], [1, 2, 4, 8, 16]),
               64: ([(32, 64, 4), (64, 64, 4), (32, 128, 4), (64, 128, 8)], [1, 2, 4]),
               256: ([(64, 128, 8), (128, 128, 8), (128, 64, 4), (64, 64, 4)], [1])}


def w4a16_cases(device, smoke, repeat, sweep_tiles: bool = False, group: int = 128) -> bool:
    """The w4a16 GEMM (symmetric; group 128 is GPTQ's and AWQ's usual layout) on Llama-3-8B's
    projections, GPU time from CUDA graphs over weight copies past L2: against torch's bf16
    matmul and the w8a16 GEMM of the same shape, its weight bytes per second against the
    copy bandwidth's read half; the same with the host's launches between calls ("launched",
    what an eager step pays); then the tile and K-split choices of W4A16_SWEEP against the
    default ones (`tiles_for`, `split_k_for`), with `--sweep`; last, a prefill's rows (M = 128
    to 4096) through the registered operator, which dequantizes the weight above
    DEQUANTIZE_ABOVE_ROWS, against the GEMM and the bf16 matmul, launched (a prefill runs
    eagerly). Each default case is first checked against the float32 reference (relative to
    the output's largest value)."""
    from pagedserve.kernels import triton_int4
    from pagedserve.kernels.triton_int4 import (
        split_k_for,
        tiles_for,
        w4a16_linear,
        w4a16_linear_ref,
    )
    from pagedserve.kernels.triton_int8 import w8a16_linear

    shapes = [("tiny", 48, 72)] if smoke else LLAMA3_8B_LINEARS
    rows = [1, 17] if smoke else [1, 16, 64, 256]
    sweep = ({1: W4A16_SWEEP[1]} if smoke else W4A16_SWEEP) if sweep_tiles else {}
    dtype, ok = torch.bfloat16, True
    g = torch.Generator().manual_seed(0)
    print(f"{f'w4a16 g{group}, CUDA graphs':34}{'rel diff':>12}{'time ms':>10}   figure")
    best_of: dict = {}
    for name, n, k in shapes:
        padded = -(-k // group) * group
        qs = [torch.randint(0, 256, (n, padded // 2), generator=g, dtype=torch.uint8).to(device)
              for _ in range(_copies(n * padded // 2, smoke))]
        ss = [(torch.rand(n, padded // group, generator=g) * 0.01).half().to(device) for _ in qs]  # float16, as stored
        w16 = [torch.randn(n, k, generator=g).to(device, dtype) for _ in range(_copies(2 * n * k, smoke))]
        w8 = [torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).to(device)
              for _ in range(_copies(n * k, smoke))]
        s8 = (torch.rand(n, generator=g) * 0.05 / 127).to(device)
        for m in rows:
            x = torch.randn(m, k, generator=g).to(device, dtype)
            want = w4a16_linear_ref(x, qs[0], ss[0], None, None, group).float()
            rel = ((w4a16_linear(x, qs[0], ss[0], None, None, group).float() - want).abs().max()
                   / want.abs().max()).item()
            ok &= rel < 1e-2
            mine = _graph_timed([partial(w4a16_linear, x, q, s, None, None, group) for q, s in zip(qs, ss)],
                                device, repeat)
            launched = _timed(partial(w4a16_linear, x, qs[0], ss[0], None, None, group), device, repeat)
            bf16 = _graph_timed([partial(torch.nn.functional.linear, x, w) for w in w16], device, repeat)
            int8 = _graph_timed([partial(w8a16_linear, x, w, s8) for w in w8], device, repeat)
            gbs = (n * padded // 2 + 2 * n * padded // group) / mine / 1e9
            print(f"{f'{name} M={m} N={n} K={k}':34}{rel:12.2e}{mine * 1e3:10.4f}   {gbs:.0f} GB/s of weights, "
                  f"{bf16 / mine:.2f}x bf16 ({bf16 * 1e3:.4f} ms), {int8 / mine:.2f}x w8a16 ({int8 * 1e3:.4f} ms); "
                  f"launched {launched * 1e3:.4f} ms")
            if m not in sweep:
                continue
            tiles, splits = sweep[m]
            times = {}
            for tile in tiles:
                for split in splits:
                    try:
                        times[tile, split] = _graph_timed(
                            [partial(w4a16_linear, x, q, s, None, None, group, split, tile) for q, s in zip(qs, ss)],
                            device, repeat)
                    except Exception as exc:  # noqa: BLE001 - a tile that does not compile here
                        print(f"  tiles {tile} split {split}: {type(exc).__name__}: {str(exc)[:120]}")
            default = (tiles_for(m, dtype), split_k_for(m, n, k, group, device, dtype))
            best = min(times, key=times.get)
            best_of[name, m] = best
            print(f"  sweep M={m}: default {default} {mine * 1e3:.4f} ms; best {best} {times[best] * 1e3:.4f} ms "
                  f"({mine / times[best]:.2f}x); all: "
                  + ", ".join(f"{t[1]}x{t[2]}w/{sk}: {v * 1e3:.4f}" for (t, sk), v in times.items()))
        for m in [32] if smoke else [128, 256, 1024, 4096]:  # a prefill: launched, as it runs
            x = torch.randn(m, k, generator=g).to(device, dtype)
            want = w4a16_linear_ref(x, qs[0], ss[0], None, None, group).float()
            op = triton_int4._w4a16_op(x, qs[0], ss[0], None, None, group)
            rel = ((op.float() - want).abs().max() / want.abs().max()).item()
            ok &= rel < 1e-2
            op_s = _timed(partial(triton_int4._w4a16_op, x, qs[0], ss[0], None, None, group), device, repeat)
            gemm_s = _timed(partial(w4a16_linear, x, qs[0], ss[0], None, None, group), device, repeat)
            bf16_s = _timed(partial(torch.nn.functional.linear, x, w16[0]), device, repeat)
            path = "dequantize + matmul" if m > triton_int4.DEQUANTIZE_ABOVE_ROWS else "GEMM"
            print(f"{f'{name} M={m} operator ({path})':34}{rel:12.2e}{op_s * 1e3:10.4f}   "
                  f"{2 * m * n * k / op_s / 1e12:.1f} TF/s; GEMM {gemm_s * 1e3:.4f} ms ({gemm_s / op_s:.2f}x the "
                  f"operator's time), bf16 {bf16_s * 1e3:.4f} ms ({bf16_s / op_s:.2f}x)")
    if best_of:
        print("w4a16 best (tiles, split) per case: " + "; ".join(f"{k[0]} M={k[1]}: {v}" for k, v in best_of.items()))
    return ok


if __name__ == "__main__":
    sys.exit(main())
