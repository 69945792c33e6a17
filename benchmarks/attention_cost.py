"""What decode attention costs per engine step, beside the matmuls of the same step.

    python benchmarks/attention_cost.py [--batch 64] [--context 190] [--dtype float32]

Builds one decode step of the default model's shape (SmolLM2-135M: 30 layers, 9 query
heads, 3 KV heads, head_dim 64) over a shuffled paged pool and times, per step (all
layers): the torch reference backend (gathers blocks, then SDPA; one layer's cache timed
30 times), the C++ CPU kernel (each layer with its own cache, as in a step, so that the K/V
come from memory, not from a cache that the previous layer warmed), and the step's linear
layers (q/k/v, o, gate/up, down and the LM head).

It also measures the machine's memory bandwidth with the same threads (a STREAM-like read:
the sum of a 1 GiB float32 tensor; and a copy of 512 MiB into another, counted as read +
write), and prints the C++ kernel's K/V read rate against it.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pagedserve.common.contracts import AttentionMetadata
from pagedserve.kernels.cpu_attention import CPUAttentionBackend, cpu_kernels
from pagedserve.kernels.torch_attention import TorchAttentionBackend

LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, VOCAB = 30, 9, 3, 64, 576, 1536, 49152


def timed(fn, repeat: int = 10) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t) / repeat


def bandwidth(threads: int) -> tuple[float, float]:
    """GB/s of a 1 GiB read (torch.sum) and of a 512 MiB copy (read + write bytes), the best of 5."""
    torch.set_num_threads(threads)
    big = torch.ones(1 << 28)  # 1 GiB
    dst = torch.empty(1 << 27)
    read = min(timed(lambda: big.sum(), repeat=1) for _ in range(5))
    copy = min(timed(lambda: dst.copy_(big[: 1 << 27]), repeat=1) for _ in range(5))
    return (1 << 30) / read / 1e9, 2 * (1 << 29) / copy / 1e9


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=190)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    bs, n = args.block_size, args.batch
    blocks_per_seq = -(-args.context // bs)
    num_blocks = n * blocks_per_seq + 8
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, num_blocks, bs, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for _ in range(LAYERS)]
    kv_cache = caches[0]
    tables = torch.randperm(num_blocks, generator=g)[: n * blocks_per_seq].view(n, blocks_per_seq).int()
    seq_lens = torch.full((n,), args.context, dtype=torch.int32)
    pos = seq_lens.long() - 1
    slots = tables[torch.arange(n), pos // bs].long() * bs + pos % bs
    q = torch.randn(n, HEADS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    rows = []
    for backend in (TorchAttentionBackend(), CPUAttentionBackend() if cpu_kernels() else None):
        if backend is None:
            continue
        md = AttentionMetadata(slots, torch.arange(n + 1, dtype=torch.int32), seq_lens, tables, n, args.context,
                               [1] * n, [args.context] * n, backend)
        backend.prepare(md, bs)
        if backend.name == "torch":
            seconds = timed(lambda b=backend, m=md: b.forward(q, k, v, kv_cache, m, HEAD_DIM**-0.5)) * LAYERS
        else:
            seconds = timed(lambda b=backend, m=md: [b.forward(q, k, v, c, m, HEAD_DIM**-0.5) for c in caches])
            kernel_seconds = seconds
        rows.append((f"attention ({backend.name})", seconds))
    x = torch.randn(n, HIDDEN, generator=g).to(dtype)
    weights = [torch.randn(o, i, generator=g).to(dtype) for o, i in
               [(HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN)]]
    down = torch.randn(HIDDEN, INTER, generator=g).to(dtype)
    h = torch.randn(n, INTER, generator=g).to(dtype)
    head = torch.randn(VOCAB, HIDDEN, generator=g).to(dtype)

    def linears():
        for _ in range(LAYERS):
            for w in weights:
                F.linear(x, w)
            F.linear(h, down)
        F.linear(x, head)

    mm = timed(linears, repeat=3)
    rows.append(("linear layers + LM head", mm))
    print(f"decode step, batch {n}, context {args.context}, {args.dtype}, {args.threads} threads, {LAYERS} layers")
    for name, seconds in rows:
        print(f"{name:28} {seconds * 1e3:8.1f} ms/step   {seconds / mm:5.2f}x the matmuls")
    if cpu_kernels():
        kv_bytes = 2 * n * args.context * KV_HEADS * HEAD_DIM * kv_cache.element_size() * LAYERS
        read, copy = bandwidth(args.threads)
        rate = kv_bytes / kernel_seconds / 1e9
        print(f"K/V read by the C++ kernel: {kv_bytes / 1e6:.0f} MB a step, {rate:.1f} GB/s; memory bandwidth "
              f"({args.threads} threads): read {read:.1f} GB/s, copy {copy:.1f} GB/s; kernel / read {rate / read:.2f}")


if __name__ == "__main__":
    main()
