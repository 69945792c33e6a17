"""Which int8 linear kernel a CPU worker runs: the fastest on this model, timed at load.

The C++ extension can run the int8 linear layers in several ways (kernels/csrc/cpu_int8_gemv.cpp:
`avx512vnni`, `avxvnni` or `avx2` int8 × int8 products, or the `float` path that widens the
weights to float32 in registers). The CPU's flags say which it *can* run, not which is fastest:
on an AMD EPYC with AVX-512 VNNI, batch-1 int8 decode ran faster on the float path (118.3 tok/s)
than on the VNNI kernel (99.6), while on an AVX2 EPYC the `avx2` kernel beat the float path
(docs/performance-history.md). So at load the worker times each kernel on the model's own
int8 layers, as a decode step reads them (every layer's own weights, so they stream from memory),
and keeps the fastest.

The timing: for each row count in `rows` (1 and the fused step's largest batch by default),
one pass over all the layers per kernel per round, the kernels alternated within each round so
that a change in the machine's load falls on all of them; each kernel's median over the rounds.
A kernel's score is the sum over the row counts of its median divided by the best median at that
row count, so batch 1 and the larger batch count alike; the lowest score wins. It costs about
`rounds × len(rows) × len(kernels)` passes over the weights (about 0.3 s for the default model).

Every kernel computes a row's result independently of the other rows in the call, so the
choice changes speed and float rounding, never batch invariance.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import median
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: `EngineConfig.int8_kernel` values besides a kernel's name
AUTO = "auto"  # time the kernels at load and keep the fastest
FLAGS = "flags"  # the best kernel the CPU's flags allow, untimed (the extension's own default)


@dataclass(frozen=True)
class Int8KernelChoice:
    """What the worker chose, and why (logged at load; `bench` prints it)."""

    #: the kernel every int8 linear layer of this process runs from now on
    kernel: str
    #: "timed" (the fastest measured), "asked" (named by the config) or "flags" (the CPU's best)
    reason: str
    #: per kernel, per row count: the median seconds of one pass over the model's int8 layers
    #: (empty unless timed)
    timings: dict[str, dict[int, float]] = field(default_factory=dict)

    def describe(self) -> str:
        if not self.timings:
            return f"int8 linear kernel {self.kernel} ({self.reason})"
        parts = [f"{name}: " + ", ".join(f"M={m} {t * 1e3:.2f} ms" for m, t in sorted(by_rows.items()))
                 for name, by_rows in self.timings.items()]
        return f"int8 linear kernel {self.kernel} (timed on the model's layers; {'; '.join(parts)})"


def int8_layers(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(int8 weight [out, in], float32 scale [out]) of every module that holds an int8 weight
    with per-row scales (the `int8` quantization method's layers, the LM head included when
    quantized), in the model's order."""
    layers = []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        scale = getattr(module, "weight_scale", None)
        if (isinstance(weight, torch.Tensor) and weight.dtype == torch.int8 and weight.dim() == 2
                and isinstance(scale, torch.Tensor) and scale.dim() == 1):
            layers.append((weight, scale))
    return layers


def model_pass_timer(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[int], float]:
    """A timer of one pass of `int8_linear` over `layers` at m rows, by the kernel selected now
    (the real measurement; tests give `choose_int8_kernel` their own)."""
    op = torch.ops.pagedserve.int8_linear
    generator = torch.Generator().manual_seed(0)
    inputs: dict[tuple[int, int], torch.Tensor] = {}

    def seconds(m: int) -> float:
        for weight, _ in layers:
            if (m, weight.shape[1]) not in inputs:
                inputs[m, weight.shape[1]] = torch.randn(m, weight.shape[1], generator=generator)
        with torch.inference_mode():
            started = time.perf_counter()
            for weight, scale in layers:
                op(inputs[m, weight.shape[1]], weight, scale, None)
            return time.perf_counter() - started

    return seconds


def choose_int8_kernel(extension: Any, layers: list[tuple[torch.Tensor, torch.Tensor]], asked: str = AUTO,
                       rows: tuple[int, ...] = (1, 16), rounds: int = 5,
                       timer: Callable[[int], float] | None = None) -> Int8KernelChoice:
    """Select (with `extension.set_int8_kernel`) and return the int8 kernel of this process:
    the one `asked` names, the CPU's best by flags (`asked="flags"`), or, with `asked="auto"`,
    the fastest on `layers` as timed above (`timer(m)`: seconds of one pass at m rows with the
    kernel selected now; by default `model_pass_timer(layers)`). An unknown or unavailable name
    raises ValueError naming the kernels this CPU can run."""
    available: list[str] = list(extension.int8_kernels())
    if asked not in (AUTO, FLAGS):
        if asked not in available:
            raise ValueError(f"int8 kernel {asked!r} cannot run on this CPU; it can run: {', '.join(available)}")
        extension.set_int8_kernel(asked)
        return Int8KernelChoice(asked, "asked")
    if asked == FLAGS or len(available) == 1 or not layers:
        extension.set_int8_kernel(available[0])
        return Int8KernelChoice(available[0], "flags")
    timer = timer or model_pass_timer(layers)
    timings: dict[str, dict[int, list[float]]] = {name: {m: [] for m in rows} for name in available}
    for m in rows:
        for name in available:  # a warm-up pass each: the scratch buffers' first touch
            extension.set_int8_kernel(name)
            timer(m)
        for round_ in range(rounds):
            for name in (available if round_ % 2 == 0 else available[::-1]):
                extension.set_int8_kernel(name)
                timings[name][m].append(timer(m))
    medians = {name: {m: median(ts) for m, ts in by_rows.items()} for name, by_rows in timings.items()}
    best_at = {m: min(medians[name][m] for name in available) for m in rows}
    scores = {name: sum(medians[name][m] / best_at[m] for m in rows) for name in available}
    kernel = min(available, key=lambda name: (scores[name], available.index(name)))
    extension.set_int8_kernel(kernel)
    return Int8KernelChoice(kernel, "timed", medians)
