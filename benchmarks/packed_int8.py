"""The packed int8 and int4 products against the packed float32 product, per row count and kernel.

    python benchmarks/packed_int8.py [--rows 1,4,16,64,256,1024] [--isa avx512vnni,avxvnni,avx2] [--threads 2]

Times whole passes over the default model's 120 linear layers (30 layers of qkv 576→960,
o_proj 576→576, gate_up 576→3072, down 1536→576, each with its own weights so that they
stream from memory as in a decode step) for each row count M, alternating within a round:
- `float32`: the packed float32 product (csrc/cpu_packed_gemm.cpp, the engine's CPU default);
- `int8 packed`: the packed int8 product (csrc/cpu_packed_int8.cpp, `--quantization int8`);
- `int4 packed`: the packed int4 product at group 32, symmetric (the same file, `--quantization
  int4`);
- `int8 rows`: the earlier int8 kernel over unpacked rows (csrc/cpu_int8_gemv.cpp, what
  `--no-pack-cpu-weights` runs), up to 128 rows.
`--isa` runs the whole table once per kernel set: `avx2` forces the packed products to their
AVX2 kernels (on an AVX-512 CPU: an estimate of an AVX2-only CPU of the same clock and
memory, not a measurement of one); `avxvnni` forces the integer ones to their AVX-VNNI
kernels and the float32 one to AVX2 (on a CPU with AVX-512 and AVX-VNNI: an estimate of an
AVX-VNNI CPU without AVX-512). A set the CPU cannot run falls back to the best below it, and
the line above its table names what ran. Prints the minimum and median ms of `--repeat` rounds,
the GFLOP/s of the minimum (2·M·106.2 M multiply-adds a pass) and float32 ÷ int8.
"""

from __future__ import annotations

import argparse
import time
from statistics import median

SHAPES = {"qkv": (576, 960), "o_proj": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
UNPACKED_INT8_MAX_ROWS = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,16,64,256,1024")
    parser.add_argument("--isa", default="avx512vnni,avx2",
                        help="kernel sets to time: avx512vnni, avxvnni, avx2, scalar")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    import torch

    from pagedserve.kernels.cpu_attention import cpu_kernels
    from pagedserve.kernels.cpu_packed import pack_int4_weight
    from pagedserve.plugins.int4_quantization import quantize as quantize_int4
    from pagedserve.plugins.int8_quantization import quantize_per_channel

    torch.set_num_threads(args.threads)
    kernels = cpu_kernels()
    assert kernels is not None, "the CPU kernels did not build"
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(30):
        for k, n in SHAPES.values():
            w = torch.randn(n, k, generator=g) * 0.05
            q, scale = quantize_per_channel(w)
            w4 = quantize_int4(w, 32, symmetric=True, search=False)
            layers.append((k, n, kernels.pack_linear_weight(w), q, scale, kernels.pack_int8_weight(q),
                           pack_int4_weight(w4.qweight, w4.scales, w4.zeros)))
    macs = sum(k * n for k, n, *_ in layers)
    print(f"one pass over the 120 linears: {macs * 4 / 1e6:.0f} MB float32, {macs / 1e6:.0f} MB int8; "
          f"{args.threads} threads; ms min / median of {args.repeat} rounds (GFLOP/s of the min)")
    # per kernel set: the packed float32 kernel, the packed int8 one, the unpacked int8 rows' one
    isa_names = {"avx512vnni": ("avx512", "avx512vnni", "avx512vnni"), "avxvnni": ("avx2", "avxvnni", "avxvnni"),
                 "avx2": ("avx2", "avx2", "avx2"), "scalar": ("scalar", "scalar", "float")}
    rows_kernel = kernels.int8_kernel()
    try:
        for isa in args.isa.split(","):
            float_isa, int8_isa, rows_isa = isa_names[isa]
            kernels.set_packed_linear_isa(float_isa)
            kernels.set_packed_int8_isa(int8_isa)
            kernels.set_int8_kernel(rows_isa if rows_isa in kernels.int8_kernels() else "float")
            print(f"\nkernels: float32 {kernels.packed_linear_isa()}, int8 packed {kernels.packed_int8_isa()}, "
                  f"int8 rows {kernels.int8_kernel()}")
            print(f"{'M':>5} {'float32':>24} {'int8 packed':>24} {'int4 packed':>24} {'int8 rows':>24}  "
                  "float32 ÷ int8 packed, int8 ÷ int4 packed")
            for m in (int(r) for r in args.rows.split(",")):
                xs = {k: torch.randn(m, k, generator=g) for k in {k for k, _ in SHAPES.values()}}
                fns = {
                    "float32": lambda xs=xs: [kernels.packed_linear(xs[k], pf, n) for k, n, pf, *_ in layers],
                    "int8 packed": lambda xs=xs: [kernels.packed_int8_linear(xs[k], p8, s, n)
                                                  for k, n, _, _, s, p8, _ in layers],
                    "int4 packed": lambda xs=xs: [kernels.packed_int4_linear(xs[k], *p4, n)
                                                  for k, n, *_, p4 in layers],
                }
                if m <= UNPACKED_INT8_MAX_ROWS:
                    fns["int8 rows"] = lambda xs=xs: [kernels.small_linear_int8(xs[k], q, s)
                                                      for k, _, _, q, s, *_ in layers]
                times: dict[str, list[float]] = {name: [] for name in fns}
                for fn in fns.values():
                    fn()
                for _ in range(args.repeat):
                    for name, fn in fns.items():
                        started = time.perf_counter()
                        fn()
                        times[name].append((time.perf_counter() - started) * 1e3)
                flops = 2 * m * macs / 1e9
                cells = [f"{min(t):8.2f} / {median(t):7.2f} ({flops / min(t) * 1e3:5.1f})" for t in times.values()]
                cells += [""] * (4 - len(cells))
                print(f"{m:>5} {cells[0]:>24} {cells[1]:>24} {cells[2]:>24} {cells[3]:>24}  "
                      f"{min(times['float32']) / min(times['int8 packed']):8.2f}x "
                      f"{min(times['int8 packed']) / min(times['int4 packed']):8.2f}x", flush=True)
    finally:
        kernels.set_packed_linear_isa("avx512")
        kernels.set_packed_int8_isa("avx512vnni")
        kernels.set_int8_kernel(rows_kernel)


if __name__ == "__main__":
    main()
