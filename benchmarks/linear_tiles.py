"""The fused decode step's float32 products per row count: row groups, register tiles, torch.

    python benchmarks/linear_tiles.py [--rows 1,4,8,16,32,64] [--threads 2] [--repeat 5]

Times whole passes over the default model's 120 linear layers (30 layers of qkv 576→960,
o_proj 576→576, gate_up 576→3072, down 1536→576, each with its own float32 weights, 425 MB,
so that they stream from memory as in a decode step) for each row count M, alternating:
- `groups`: the row-group kernel of kernels/csrc/cpu_decode.cpp (`linear_rows_any`: each
  weight vector applied to up to 6 rows at a time);
- `tiles`: the register-tile kernel of the same file (`linear_rows_tiled`), whose bits are
  the same as `groups`;
- `default choice`: what the fused step runs (tiles from 8 rows at depth ≥ 1024, else groups);
- `packed`: the products over weights packed at load (csrc/cpu_packed_gemm.cpp, what the
  engine runs by default on CPU in float32: one FMA chain per output, other bits than the
  kernels above), on packed copies of the same weights;
- `torch`: `F.linear` (torch's own BLAS: MKL or oneDNN), on the same weights.
Prints the minimum and median ms of `--repeat` passes and GFLOP/s of the minimum
(2·M·106.2 M multiply-adds a pass). Then checks whether `F.linear` is batch-invariant: does
a row's result stay bitwise the same when computed with M - 1 other rows? (The fused step
can use a kernel only where it is.)
"""

from __future__ import annotations

import argparse
import time
from statistics import median

SHAPES = {"qkv": (576, 960), "o_proj": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}


def _pass_times(fn, repeat: int) -> tuple[float, float]:
    fn()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3, median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,8,16,32,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    from pagedserve.kernels.cpu_attention import cpu_kernels

    torch.set_num_threads(args.threads)
    kernels = cpu_kernels()
    assert kernels is not None, "the CPU kernels did not build"
    g = torch.Generator().manual_seed(0)
    layers = [(k, torch.randn(n, k, generator=g) * 0.05) for _ in range(30) for k, n in SHAPES.values()]
    macs = sum(w.numel() for _, w in layers)
    print(f"one pass over the 120 linears ({macs * 4 / 1e6:.0f} MB float32), {args.threads} threads; "
          f"ms min / median of {args.repeat} passes (GFLOP/s of the min)")
    packed = [(k, kernels.pack_linear_weight(w), w.shape[0]) for k, w in layers]
    print(f"{'M':>4} {'groups':>22} {'tiles':>22} {'default choice':>22} {'packed':>22} {'torch F.linear':>22}  "
          "default/groups  packed speed: x default  x torch")
    default_rows = kernels.set_linear_tile_rows(1, 1)
    try:
        for m in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(m, k, generator=g) for k in {k for k, _ in SHAPES.values()}}

            def ours(xs=xs):
                for k, w in layers:
                    kernels.small_linear(xs[k], w)

            def ours_packed(xs=xs):
                for k, wp, n in packed:
                    kernels.packed_linear(xs[k], wp, n)

            def theirs(xs=xs):
                for k, w in layers:
                    F.linear(xs[k], w)

            results = {}
            for name, tile_rows, fn in (("groups", 1 << 30, ours), ("tiles", 1, ours), ("default", 0, ours),
                                        ("packed", 1, ours_packed), ("torch", 1, theirs)):
                if tile_rows == 0:
                    kernels.set_linear_tile_rows(*default_rows)
                else:
                    kernels.set_linear_tile_rows(tile_rows, 1)
                results[name] = _pass_times(fn, args.repeat)
            flops = 2 * m * macs / 1e9
            cells = [f"{lo:8.2f} / {mid:7.2f} ({flops / lo * 1e3:5.1f})" for lo, mid in results.values()]
            print(f"{m:>4} {cells[0]:>22} {cells[1]:>22} {cells[2]:>22} {cells[3]:>22} {cells[4]:>22}  "
                  f"{results['default'][0] / results['groups'][0]:13.2f}x "
                  f"{results['default'][0] / results['packed'][0]:22.2f}x {results['torch'][0] / results['packed'][0]:7.2f}x")
    finally:
        kernels.set_linear_tile_rows(*default_rows)

    x = torch.randn(80, 1536, generator=g)
    w = layers[3][1]
    alone = torch.cat([F.linear(x[r:r + 1], w) for r in range(x.shape[0])])
    differ = [m for m in (2, 4, 8, 16, 17, 32, 64, 80) if not torch.equal(F.linear(x[:m], w), alone[:m])]
    print("F.linear batch-invariant (each row alone = the row among M rows, down 1536→576): "
          + ("yes" if not differ else f"no, differs at M = {differ}"))


if __name__ == "__main__":
    main()
