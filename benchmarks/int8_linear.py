"""int8 weight-only linear kernels against float32 `F.linear`, on the default model's shapes.

    python benchmarks/int8_linear.py [--rows 1,2,4,8,16,32,64,128,256,512,1024,2048] [--threads 2]

For each linear shape of SmolLM2-135M (qkv 576→960, o 576→576, gate_up 576→3072,
down 1536→576) and each row count M, the median time of:
- `float32`: `F.linear(x, w)` on the float weights;
- `int8pack`: `torch.ops.aten._weight_int8pack_mm(x, w_int8, scales)`;
- `dequant`: dequantize the int8 weights to float32, then `F.linear` (what the int8 linear
  does above its switch-over row count);
- `small_i8`: the int8 kernel of kernels/csrc/cpu_decode.cpp (the fused decode step's GEMV,
  blocked for any M; `torch.ops.pagedserve.int8_linear`): the int8 × int8 kernel of
  cpu_int8_gemv.cpp the CPU has (avx512vnni, avxvnni or avx2: named in the header), and then
  `small_fma` the float path (weights widened to float32) beside it, up to M = 64;
  `small_f32` its float32 twin.
Printed as microseconds; the model's `Int8Linear` picks its switch-over from these figures.

    python benchmarks/int8_linear.py --model-pass [--rows 1,4,16,64] [--threads 1]

instead times whole passes over the default model's 120 linear layers (30 layers of the four
shapes, each with its own weights, 106 MB of int8, so that they stream from memory as in the
decode step rather than from cache as above): for each M, passes with the int8 × int8 kernel,
the float path (weights widened to float32) and dequantize + `F.linear` alternate, and the
minimum and median over `--repeat` passes are printed in ms (the minimum sees through a
loaded machine's stalls).
"""

from __future__ import annotations

import argparse
import time
from statistics import median

SHAPES = {"qkv": (576, 960), "o_proj": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}


def _time(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return median(times) * 1e6


def _model_pass(kernels, rows: list[int], repeat: int) -> None:
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(30):
        for k, n in SHAPES.values():
            wq = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
            layers.append((k, wq, torch.rand(n, generator=g) * 1e-3))
    best = kernels.int8_kernel()
    print(f"one pass over the 120 linears ({sum(w.numel() for _, w, _ in layers) / 1e6:.1f} MB int8), ms: "
          f"min / median of {repeat} passes; int8: the {best} kernel")
    print(f"{'M':>5} {best:>17} {'float path':>17} {'dequant+F.linear':>17}  {best} / float path (min)")
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g) for k, _, _ in layers}
        times: dict[str, list[float]] = {best: [], "float": [], "dequant": []}
        for _ in range(repeat):
            for name in (best, "float"):
                kernels.set_int8_kernel(name)
                started = time.perf_counter()
                for k, wq, scale in layers:
                    kernels.small_linear_int8(xs[k], wq, scale)
                times[name].append((time.perf_counter() - started) * 1e3)
            kernels.set_int8_kernel(best)
            started = time.perf_counter()
            for k, wq, scale in layers:
                F.linear(xs[k], kernels.int8_dequantize(wq, scale))
            times["dequant"].append((time.perf_counter() - started) * 1e3)
        cells = " ".join(f"{min(v):8.2f}/{median(v):8.2f}" for v in times.values())
        print(f"{m:5d} {cells}  {min(times[best]) / min(times['float']):.2f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.nn.functional as F

    from pagedserve.kernels.cpu_attention import cpu_kernels

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512,1024,2048")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--model-pass", action="store_true",
                        help="time passes over the model's 120 linears (weights from memory), not one shape at a time")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernels = cpu_kernels()
    if args.model_pass:
        assert kernels is not None and kernels.int8_kernel() != "float", "--model-pass needs an int8 × int8 kernel"
        _model_pass(kernels, [int(r) for r in args.rows.split(",")], args.repeat)
        return 0
    g = torch.Generator().manual_seed(0)
    int8_int8 = kernels.int8_kernel() if kernels is not None else "float"
    both = int8_int8 != "float"  # an int8 × int8 kernel beside the float path
    print(f"{'shape':8} {'M':>5} {'float32':>9} {'int8pack':>9} {'dequant':>9} {'small_i8':>9} {'small_f32':>9}"
          f"{' small_fma' if both else ''}  (us; small_i8: the {int8_int8} kernel, {args.threads} threads)")
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, generator=g) * 0.02
        scale = w.abs().amax(dim=1) / 127
        wq = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=g)
            repeat = max(3, args.repeat if m <= 256 else args.repeat // 4)
            f32 = _time(lambda: F.linear(x, w), repeat)  # noqa: B023 - called right here
            pack = float("nan")  # it grows linearly with M (0.1-0.5 s at M = 1024): measured up to 64
            if m <= 64:
                pack = _time(lambda: torch.ops.aten._weight_int8pack_mm(x, wq, scale), repeat)  # noqa: B023
            if kernels is not None and hasattr(kernels, "int8_dequantize"):
                deq = _time(lambda: F.linear(x, kernels.int8_dequantize(wq, scale)), repeat)  # noqa: B023
            else:
                deq = _time(lambda: F.linear(x, wq.float().mul_(scale[:, None])), repeat)  # noqa: B023
            small_i8 = small_f32 = float("nan")
            if kernels is not None and hasattr(kernels, "small_linear_int8"):
                small_i8 = _time(lambda: kernels.small_linear_int8(x, wq, scale), repeat)  # noqa: B023
                if m <= 64:  # an unblocked GEMV: meant for the fused step's few rows
                    small_f32 = _time(lambda: kernels.small_linear(x, w), repeat)  # noqa: B023
            fma = ""
            if both and m <= 64:
                kernels.set_int8_kernel("float")
                try:
                    fma = f" {_time(lambda: kernels.small_linear_int8(x, wq, scale), repeat):9.1f}"  # noqa: B023
                finally:
                    kernels.set_int8_kernel(int8_int8)
            print(f"{name:8} {m:5d} {f32:9.1f} {pack:9.1f} {deq:9.1f} {small_i8:9.1f} {small_f32:9.1f}{fma}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
