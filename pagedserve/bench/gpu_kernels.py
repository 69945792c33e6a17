"""Check and time the Triton attention kernel on a GPU, in one call, and print a table.

    python -m pagedserve.bench.gpu_kernels            # on an NVIDIA GPU (issue #4's figures)
    python -m pagedserve.bench.gpu_kernels --smoke    # tiny shapes; runs anywhere (TRITON_INTERPRET=1 on CPU)

- copy bandwidth: a large device-to-device copy, the ceiling for memory-bound kernels;
- decode attention, batch 64, contexts 1k-8k, Llama-3-8B heads (32 query, 8 KV, head_dim
  128), bf16: bytes of K/V read per second against that ceiling (target >= 70%);
- prefill attention, fresh causal chunks: TFLOP/s against torch's scaled_dot_product_attention
  on the same shapes (target >= 0.8x).
Every timed case is first checked against the torch backend.

The end-to-end figures (a Llama-3-8B-shaped model against transformers) are
pagedserve.bench.gpu_e2e's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def _timed(fn, device: torch.device, repeat: int) -> float:
    """Median seconds of fn() over `repeat` runs, after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
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
    args = parser.parse_args()
    picked = pick_device(args.smoke)
    if picked is None:
        return 2
    device, name = picked
    from pagedserve.kernels.triton_attention import TritonAttentionBackend, paged_attention

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
        n_seq = 4 if not args.smoke else 1
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
    print("all checks passed" if ok else "CHECK FAILED: the Triton kernel disagrees with the torch backend")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
