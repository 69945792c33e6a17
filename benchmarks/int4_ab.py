"""int4 against int8 and float32 on CPU, interleaved round by round in one process.

    python benchmarks/int4_ab.py [--rounds 5] [--tokens 32] [--threads 2] [--rows 1,16,64] [--batches 1]
                                 [--quantize-lm-head] [--isa avx512vnni|avxvnni|avx2]

Two measurements, on the default model's shapes (or `--model`'s):
- `linears`: one pass over the model's linear layers (qkv, o, gate_up, down of every layer)
  at M rows, with the int8 kernel (`torch.ops.pagedserve.int8_linear`), the int4 kernel
  (`int4_linear`, group 32 and 128; group 32 also with each weight tile unpacked per group of 4
  rows, `set_int4_unpack_rows`, and as dequantize + float32 F.linear, what `Int4Linear` does
  above `int4_kernel_max_rows`) and float32 F.linear, each layer's weights made from the
  checkpoint's; and the products over weights packed at load, what a CPU engine runs by
  default (`int8 packed`, `int4_g32 packed`: csrc/cpu_packed_int8.cpp). This is the kernels
  against each other, nothing else.
- `decode`: greedy decode tok/s of whole engines (float32, int8, int4, int4_g128; packed, the
  default), every one with its decode steps in the fused C++ step, for each batch of
  `--batches` (that many 1-token prompts at once; `int4 eager`, without the fused step, at
  batch 1 only).
`--isa` forces the packed products' kernels for the whole run (csrc/cpu_packed_int8.cpp's
`set_packed_int8_isa` for int8 and int4, and AVX2 for the float32 product below
`avx512vnni`), to estimate a CPU without AVX-512 on one that has it; the line it prints
names the kernels that ran (a CPU runs the best it has at or below the one asked for).
The int4 engines need the int4 entry points installed (pip install -e . after the merge).
"""

from __future__ import annotations

import argparse
import time
from statistics import median

import torch
import torch.nn.functional as F


def _linear_pass(fns, rows: int, shapes, repeats: int = 3) -> dict[str, float]:
    """Seconds of one pass over every shape, median of `repeats`, per kind."""
    xs = {k: torch.randn(rows, k) for k in {s[1] for s in shapes}}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            started = time.perf_counter()
            for i, (_, k) in enumerate(shapes):
                fn(i, xs[k])
            times[name].append(time.perf_counter() - started)
    return {name: median(t) for name, t in times.items()}


def _per_group(kernels, linear, x, qweight, scales):
    previous = kernels.set_int4_unpack_rows(1 << 30)
    try:
        return linear(x, qweight, scales, None, None, 32)
    finally:
        kernels.set_int4_unpack_rows(previous)


def linears(model: str, rows_list: list[int], rounds: int) -> None:
    from pagedserve.common.model_store import resolve_model
    from pagedserve.engine.model_loader import iter_safetensors
    from pagedserve.kernels.cpu_attention import cpu_kernels
    from pagedserve.plugins.int4_quantization import dequantize as dequantize4
    from pagedserve.plugins.int4_quantization import quantize as quantize4
    from pagedserve.plugins.int8_quantization import quantize_per_channel

    kernels = cpu_kernels()
    assert kernels is not None, "the CPU extension is needed"
    by_layer: dict[str, dict[str, torch.Tensor]] = {}
    for name, w in iter_safetensors(resolve_model(model)):
        if w.dim() == 2 and "layers." in name and "proj" in name:
            layer, piece = name.split(".layers.")[1].split(".")[0], name.rsplit(".", 2)[-2]
            by_layer.setdefault(layer, {})[piece] = w.float()
    weights = []
    for pieces in by_layer.values():
        weights += [torch.cat([pieces["q_proj"], pieces["k_proj"], pieces["v_proj"]]), pieces["o_proj"],
                    torch.cat([pieces["gate_proj"], pieces["up_proj"]]), pieces["down_proj"]]
    shapes = [tuple(w.shape) for w in weights]
    int8 = [quantize_per_channel(w) for w in weights]
    g32 = [quantize4(w, 32) for w in weights]
    g128 = [quantize4(w, 128) for w in weights]
    ops = torch.ops.pagedserve
    from pagedserve.kernels.cpu_packed import pack_int4_weight

    int8_packed = [kernels.pack_int8_weight(q) for q, _ in int8]
    g32_packed = [pack_int4_weight(q.qweight, q.scales, None) for q in g32]
    fns = {
        "float32": lambda i, x: F.linear(x, weights[i]),
        "int8": lambda i, x: ops.int8_linear(x, int8[i][0], int8[i][1], None),
        "int4_g32": lambda i, x: ops.int4_linear(x, g32[i].qweight, g32[i].scales, None, None, 32),
        "int4_g128": lambda i, x: ops.int4_linear(x, g128[i].qweight, g128[i].scales, None, None, 128),
        # the int4 kernel unpacking each weight tile per group of 4 rows (as before the unpacked path)
        "int4_g32 per group": lambda i, x: _per_group(kernels, ops.int4_linear, x, g32[i].qweight, g32[i].scales),
        # what Int4Linear does above int4_kernel_max_rows: dequantize, then float32 F.linear
        "int4_g32 dequantize": lambda i, x: F.linear(x, dequantize4(g32[i])),
        "int8 packed": lambda i, x: ops.packed_int8_linear(x, int8_packed[i], int8[i][1], shapes[i][0]),
        "int4_g32 packed": lambda i, x: ops.packed_int4_linear(x, *g32_packed[i], shapes[i][0]),
    }
    bytes_ = {"float32": sum(w.numel() * 4 for w in weights),
              "int8": sum(q.numel() + s.numel() * 4 for q, s in int8),
              "int4_g32": sum(q.qweight.numel() + q.scales.numel() * q.scales.element_size() for q in g32),
              "int4_g128": sum(q.qweight.numel() + q.scales.numel() * q.scales.element_size() for q in g128)}
    bytes_["int4_g32 per group"] = bytes_["int4_g32 dequantize"] = bytes_["int4_g32 packed"] = bytes_["int4_g32"]
    bytes_["int8 packed"] = bytes_["int8"]
    print(f"{len(shapes)} linear layers; kernels: int8 {kernels.int8_kernel()}, int4 {kernels.int4_kernel()}; "
          f"threads {torch.get_num_threads()}")
    print("weights MB: " + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in bytes_.items()))
    for rows in rows_list:
        per_round = [_linear_pass(fns, rows, shapes) for _ in range(rounds)]
        med = {k: median(r[k] for r in per_round) for k in fns}
        ratios = [r["int8"] / r["int4_g32"] for r in per_round]
        print(f"M={rows:3d}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in med.items())
              + f"; int4_g32 speed vs int8 {median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f})"
              + f", vs float32 {med['float32'] / med['int4_g32']:.2f}x"
              + f"; packed: int4_g32 vs int8 {median(r['int8 packed'] / r['int4_g32 packed'] for r in per_round):.2f}x")


DECODE_METHODS = ("float32", "int8", "int4", "int4_g128")


def decode(model: str, rounds: int, tokens: int, lm_head: bool = False, batches: tuple[int, ...] = (1,),
           methods: tuple[str, ...] = DECODE_METHODS) -> None:
    from pagedserve import LLM, SamplingParams

    def build(quantization, **kwargs):
        return LLM(model, quantization=quantization, quantize_lm_head=lm_head and quantization is not None,
                   max_num_batched_tokens=512, kv_cache_memory=1 << 26, **kwargs)

    engines = {name: build(None if name == "float32" else name) for name in methods}
    if "int4" in engines:  # int4 without the fused step: the model's eager forward, as every int4 decode ran before it
        engines["int4 eager"] = build("int4", fused_decode_max_batch=0)
    for batch in batches:
        results: dict[str, list[float]] = {name: [] for name in engines if batch == 1 or name != "int4 eager"}
        for _ in range(rounds):
            for name in results:
                engine = engines[name].engine
                for _ in range(batch):  # 1-token prompts of other tokens: no shared prefix
                    engine.add_request(f"ab-{time.monotonic_ns()}", [1 + len(results) + _],
                                       SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True))
                engine.step()  # the prefills
                started = time.perf_counter()
                while engine.has_unfinished_requests():
                    engine.step()
                results[name].append(batch * tokens / (time.perf_counter() - started))
        for name, r in results.items():
            print(f"decode batch {batch} {name}: {median(r):.1f} tok/s (range {min(r):.1f}-{max(r):.1f})")
        for name in results:
            if name.startswith("int4") and name != "int4 eager" and "int8" in results:
                ratios = [a / b for a, b in zip(results[name], results["int8"])]
                print(f"batch {batch}: {name} / int8: {median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f})")
        if batch == 1 and "int4 eager" in results:
            ratios = [a / b for a, b in zip(results["int4"], results["int4 eager"])]
            print(f"int4 fused / int4 eager: {median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--only", choices=["linears", "decode"], default=None)
    parser.add_argument("--quantize-lm-head", action="store_true", help="decode: the quantized engines' LM head too")
    parser.add_argument("--batches", default="1", help="decode: the batch sizes, comma-separated")
    parser.add_argument("--methods", default=",".join(DECODE_METHODS),
                        help="decode: the engines, comma-separated (float32 or a --quantization method)")
    parser.add_argument("--isa", choices=["avx512vnni", "avxvnni", "avx2"], default=None,
                        help="force the packed products' kernels (see the module docstring)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.isa:
        from pagedserve.kernels.cpu_attention import cpu_kernels

        kernels = cpu_kernels()
        kernels.set_packed_int8_isa(args.isa)
        kernels.set_packed_linear_isa("avx512" if args.isa == "avx512vnni" else "avx2")
        print(f"kernels forced: float32 {kernels.packed_linear_isa()}, int8 and int4 {kernels.packed_int8_isa()}")
    if args.only in (None, "linears"):
        linears(args.model, [int(r) for r in args.rows.split(",")], args.rounds)
    if args.only in (None, "decode"):
        decode(args.model, args.rounds, args.tokens, args.quantize_lm_head,
               tuple(int(b) for b in args.batches.split(",")), tuple(args.methods.split(",")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
