"""int4 calibration variants side by side: perplexity of the model with each variant's int4
weights dequantized into it, from one set of calibration statistics.

    python benchmarks/int4_calibration.py [--model M] [--group 32] [--asym] [--tokens 4096]
        [--eval-tokens 4096] VARIANT [VARIANT ...]

VARIANT: `data-free` (the methods' scale search), `rtn` (round-to-nearest), `imatrix` (the
search weighing each input by its Σ x²), `gptq` or `gptq:damp=0.1,weighted=0,search=1,act_order=0,shrink=0`
(GPTQ, plugins/int4_gptq.py, by default as the methods run it: act order, the Hessian shrunk by
`GPTQ_HESSIAN_SHRINK`; but from the float model's Hessians: one pass, not the methods'
sequential passes). The engine is built once (float32); one calibration pass over the first `--tokens`
tokens of engine/data/calibration.txt records every linear's Σ xᵀx; each variant then writes its
dequantized int4 weights into the float model's linears and scores the first `--eval-tokens`
tokens of the perplexity text (context 1024, chunks of 1024: the int4 engine's prefill path also
dequantizes for `F.linear` above 64 rows, so these figures equal the engine's for the same codes).
docs/performance-history.md, "int4 calibration: imatrix and GPTQ", has its figures.
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedserve.bench.perplexity import default_text, perplexity, text_tokens
from pagedserve.common.engine_config import DEFAULT_MODEL, EngineConfig
from pagedserve.engine.calibration import CalibrationRequest, TokenCalibration, calibration_tokens
from pagedserve.engine.engine import Engine
from pagedserve.plugins.int4_gptq import DAMP, GPTQ_ACT_ORDER, GPTQ_HESSIAN_SHRINK, gptq_quantize
from pagedserve.plugins.int4_quantization import Int4Weights, dequantize, pack_codes, quantize


def variant_weight(spec: str, weight: torch.Tensor, hessian: torch.Tensor, group: int, symmetric: bool) -> torch.Tensor:
    """The dequantized int4 weight of one linear under a variant."""
    name, _, options = spec.partition(":")
    if name in ("data-free", "rtn", "imatrix"):
        importance = hessian.diagonal() if name == "imatrix" else None
        return dequantize(quantize(weight, group, symmetric, search=name != "rtn", importance=importance))
    if name != "gptq":
        raise SystemExit(f"unknown variant {spec!r}")
    settings = {"damp": DAMP, "weighted": 1.0, "search": 1.0, "act_order": float(GPTQ_ACT_ORDER),
                "shrink": GPTQ_HESSIAN_SHRINK}
    for item in filter(None, options.split(",")):
        key, _, value = item.partition("=")
        settings[key] = float(value)
    codes, scales, zeros = gptq_quantize(weight, hessian, group, symmetric, bool(settings["search"]),
                                         settings["damp"], weighted_fit=bool(settings["weighted"]),
                                         act_order=bool(settings["act_order"]), shrink=settings["shrink"])
    return dequantize(Int4Weights(pack_codes(codes), scales.half(), None if symmetric else zeros, group,
                                  weight.shape[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("variants", nargs="+")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--asym", action="store_true", help="zero points (int4_asym's layout)")
    parser.add_argument("--tokens", type=int, default=4096, help="calibration tokens")
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    # unpacked float32 linears: the variants are written into each nn.Linear's weight
    engine = Engine(EngineConfig(model=args.model, num_threads=args.threads, pack_cpu_weights=False))
    runner, model = engine.runner, engine.runner.model
    evaluated = text_tokens(engine, default_text(), args.eval_tokens)

    def score() -> str:
        started = time.perf_counter()
        value = perplexity(engine, evaluated, 1024, chunk=1024).value
        return f"perplexity {value:.4f} ({time.perf_counter() - started:.0f} s)"

    print(f"float32: {score()}", flush=True)
    tokens, source = calibration_tokens(engine.model_dir, CalibrationRequest("gptq", args.tokens, None))
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    started = time.perf_counter()
    inputs = TokenCalibration("gptq", model, tokens, source, engine.hf_config, runner.kernels, runner.device,
                              runner.dtype).layer_inputs(linears)
    print(f"calibration: {source}, one pass, {time.perf_counter() - started:.1f} s", flush=True)
    originals = {n: m.weight.detach().clone() for n, m in linears.items()}
    for spec in args.variants:
        started = time.perf_counter()
        with torch.no_grad():
            for n, m in linears.items():
                m.weight.copy_(variant_weight(spec, originals[n], inputs[n].hessian, args.group, not args.asym))
        fitted = time.perf_counter() - started
        print(f"{spec} (group {args.group}, {'asym' if args.asym else 'sym'}): {score()}; fitted in {fitted:.1f} s",
              flush=True)


if __name__ == "__main__":
    main()
