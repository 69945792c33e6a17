"""The int8 linear kernel a CPU worker runs: timed on the model's layers at load (`auto`),
the CPU's best by flags (`flags`), or named (kernels/int8_kernel_choice.py)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.common.engine_config import EngineConfig
from pagedserve.common.errors import InvalidParameterError
from pagedserve.kernels.cpu_attention import cpu_kernels
from pagedserve.kernels.int8_kernel_choice import choose_int8_kernel, int8_layers
from pagedserve.plugins.int8_quantization import Int8Linear

needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels need a C++ compiler")


class FakeExtension:
    """The extension's kernel switch, recording what was selected when."""

    def __init__(self, available: list[str]):
        self.available = available
        self.selected = available[0]
        self.history: list[str] = []

    def int8_kernels(self) -> list[str]:
        return self.available

    def set_int8_kernel(self, name: str) -> str:
        assert name in self.available
        previous, self.selected = self.selected, name
        self.history.append(name)
        return previous


def _timer(extension: FakeExtension, seconds: dict[tuple[str, int], float], calls: list[tuple[str, int]]):
    def timer(m: int) -> float:
        calls.append((extension.selected, m))
        return seconds[extension.selected, m]
    return timer


LAYERS = [(torch.zeros(4, 8, dtype=torch.int8), torch.ones(4))]


def test_auto_keeps_the_kernel_with_the_lowest_summed_ratio_to_the_best():
    """avx2 is 2x faster at one row and 1.25x slower at 16: its score 1 + 1.25 = 2.25 beats
    float's 2 + 1 = 3, although float's summed time (2 + 8 = 10 ms) is below avx2's (1 + 10)."""
    ext = FakeExtension(["avx2", "float"])
    seconds = {("avx2", 1): 1e-3, ("float", 1): 2e-3, ("avx2", 16): 10e-3, ("float", 16): 8e-3}
    calls: list[tuple[str, int]] = []
    choice = choose_int8_kernel(ext, LAYERS, "auto", rows=(1, 16), rounds=3, timer=_timer(ext, seconds, calls))
    assert (choice.kernel, choice.reason, ext.selected) == ("avx2", "timed", "avx2")
    assert choice.timings == {"avx2": {1: 1e-3, 16: 10e-3}, "float": {1: 2e-3, 16: 8e-3}}
    # a warm-up pass per kernel, then rounds alternating the order; the winner selected last
    assert calls == [("avx2", 1), ("float", 1), ("avx2", 1), ("float", 1), ("float", 1), ("avx2", 1),
                     ("avx2", 1), ("float", 1),
                     ("avx2", 16), ("float", 16), ("avx2", 16), ("float", 16), ("float", 16), ("avx2", 16),
                     ("avx2", 16), ("float", 16)]
    assert ext.history[-1] == "avx2"
    assert "avx2: M=1 1.00 ms, M=16 10.00 ms; float: M=1 2.00 ms, M=16 8.00 ms" in choice.describe()


def test_auto_takes_the_median_of_the_rounds_and_prefers_the_flags_order_on_a_tie():
    ext = FakeExtension(["avx512vnni", "avx2", "float"])
    runs = {"avx512vnni": iter([5.0, 1.0, 9.0, 1.0]), "avx2": iter([5.0, 3.0, 1.0, 3.0]), "float": iter([5.0, 3.0, 3.0, 3.0])}

    def timer(m: int) -> float:
        return next(runs[ext.selected])

    choice = choose_int8_kernel(ext, LAYERS, "auto", rows=(1,), rounds=3, timer=timer)
    # medians: avx512vnni 1 (of 1, 9, 1), avx2 3, float 3
    assert choice.kernel == "avx512vnni" and choice.timings["avx2"] == {1: 3.0}
    ext = FakeExtension(["avx2", "float"])
    choice = choose_int8_kernel(ext, LAYERS, "auto", rows=(1,), rounds=2, timer=lambda m: 1.0)
    assert choice.kernel == "avx2"  # level: the CPU's preference order decides


def test_named_flags_and_single_kernel_choices_time_nothing():
    def never(m: int) -> float:
        raise AssertionError("timed")

    ext = FakeExtension(["avx2", "float"])
    choice = choose_int8_kernel(ext, LAYERS, "float", timer=never)
    assert (choice.kernel, choice.reason, ext.selected) == ("float", "asked", "float")
    choice = choose_int8_kernel(ext, LAYERS, "flags", timer=never)
    assert (choice.kernel, choice.reason, ext.selected) == ("avx2", "flags", "avx2")
    only = FakeExtension(["float"])
    assert choose_int8_kernel(only, LAYERS, "auto", timer=never).kernel == "float"
    assert choose_int8_kernel(ext, [], "auto", timer=never).reason == "flags"  # no int8 layers
    with pytest.raises(ValueError, match="int8 kernel 'avx512vnni' cannot run on this CPU; it can run: avx2, float"):
        choose_int8_kernel(ext, LAYERS, "avx512vnni", timer=never)


def test_int8_layers_are_the_modules_with_int8_rows_and_scales():
    model = torch.nn.Sequential(Int8Linear(torch.randn(6, 4), None, torch.float32), torch.nn.Linear(4, 4),
                                Int8Linear(torch.randn(3, 6), None, torch.float32))
    layers = int8_layers(model)
    assert [tuple(w.shape) for w, _ in layers] == [(6, 4), (3, 6)]
    assert layers[0][0] is model[0].weight and layers[1][1] is model[2].weight_scale


def test_the_config_names_its_choices():
    assert EngineConfig().int8_kernel == "auto"
    with pytest.raises(InvalidParameterError, match="must be auto, flags, avx512vnni, avxvnni, avx2, float, got 'int9'"):
        EngineConfig(int8_kernel="int9")


@needs_kernels
def test_a_loaded_int8_engine_runs_the_kernel_it_chose(tiny_checkpoint):
    """With the real extension: `auto` leaves one of this CPU's kernels selected; a named one is
    selected as asked; one the CPU lacks is refused as an invalid parameter."""
    from pagedserve import LLM

    extension = cpu_kernels()
    available = list(extension.int8_kernels())
    previous = extension.int8_kernel()
    try:
        LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22, quantization="int8")
        assert extension.int8_kernel() in available
        LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22, quantization="int8", int8_kernel="float")
        assert extension.int8_kernel() == "float"
        missing = [k for k in ("avx512vnni", "avxvnni", "avx2") if k not in available]
        if missing:
            with pytest.raises(InvalidParameterError, match=f"'{missing[0]}' cannot run on this CPU") as info:
                LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22, quantization="int8",
                    int8_kernel=missing[0])
            assert info.value.param == "int8_kernel"
    finally:
        extension.set_int8_kernel(previous)
