"""The int8 product over packed int8 weights (kernels/csrc/cpu_packed_int8.cpp,
kernels/cpu_packed.py's PackedInt8Linear): the reference's numbers on odd shapes, the same bits
from every kernel and every batch, and the engine's int8 models running it everywhere."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagedserve.kernels.cpu_attention import cpu_kernels
from pagedserve.plugins.int8_quantization import Int8Linear, quantize_per_channel

from cpu_flags import kernel_flags
from int8_reference import assert_equals_the_reference

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels need a C++ compiler")

ISAS = ("avx512vnni", "avxvnni", "avx2", "scalar")


@contextlib.contextmanager
def _isa(name: str) -> Iterator[None]:
    """At most this kernel for the block (the CPU's best where it has less); restored after."""
    previous = cpu_kernels().packed_int8_isa()
    cpu_kernels().set_packed_int8_isa(name)
    try:
        yield
    finally:
        cpu_kernels().set_packed_int8_isa("avx512vnni")
        assert cpu_kernels().packed_int8_isa() == previous


def _weights(out: int, inp: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    q, scale = quantize_per_channel(torch.randn(out, inp) * 0.05)
    return q, scale, torch.randn(out)


@pytest.mark.parametrize(("out", "inp"), [(1, 1), (17, 33), (45, 67), (64, 96), (130, 200)])
@pytest.mark.parametrize("rows", [1, 2, 5, 9, 17, 100])
def test_every_kernel_gives_the_references_numbers_and_the_same_bits(out, inp, rows):
    q, scale, bias = _weights(out, inp, out * 1000 + inp + rows)
    x = torch.randn(rows, inp) * 3
    packed = cpu_kernels().pack_int8_weight(q)
    assert packed.shape == (-(-out // 16), -(-inp // 32) * 8, 16, 4) and packed.dtype == torch.uint8
    results = {}
    for isa in ISAS:
        with _isa(isa):
            results[isa] = cpu_kernels().packed_int8_linear(x, packed, scale, out, bias)
    for isa in ISAS:
        assert torch.equal(results[isa], results["scalar"]), isa
    assert_equals_the_reference(results["scalar"], x, q, scale, bias)
    assert_equals_the_reference(cpu_kernels().packed_int8_linear(x, packed, scale, out), x, q, scale)


@pytest.mark.parametrize("isa", ISAS)
def test_a_rows_bits_do_not_depend_on_its_batch(isa):
    q, scale, bias = _weights(96, 200, 7)
    x = torch.randn(37, 200)
    packed = cpu_kernels().pack_int8_weight(q)
    with _isa(isa):
        together = cpu_kernels().packed_int8_linear(x, packed, scale, 96, bias)
        for size in (1, 3, 4, 5, 8, 13):
            for start in range(0, 37, size):
                part = cpu_kernels().packed_int8_linear(x[start:start + size], packed, scale, 96, bias)
                assert torch.equal(part, together[start:start + size]), (size, start)


def test_threads_do_not_change_the_bits():
    q, scale, _ = _weights(300, 100, 3)
    x = torch.randn(20, 100)
    packed = cpu_kernels().pack_int8_weight(q)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels().packed_int8_linear(x, packed, scale, 300)
        torch.set_num_threads(2)
        two = cpu_kernels().packed_int8_linear(x, packed, scale, 300)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_a_forced_kernel_falls_back_to_the_best_this_cpu_runs_below_it():
    """The order is avx512vnni, avxvnni, avx2, scalar, and a CPU need not have every kernel
    below its best (an AMD Zen 4 has AVX-512 VNNI and no AVX-VNNI): each name gives the best
    the CPU's flags allow at or below it."""
    ran = {}
    for forced in ISAS:
        with _isa(forced):
            ran[forced] = cpu_kernels().packed_int8_isa()
        assert ISAS.index(ran[forced]) >= ISAS.index(forced), (forced, ran[forced])  # never above the one asked for
    assert ran["scalar"] == "scalar"
    if Path("/proc/cpuinfo").exists():  # Linux: the kernel's flags say which ones the CPU has (the build admits)
        flags = kernel_flags(cpu_kernels())
        avx2 = {"avx2", "fma", "f16c"} <= flags
        runs = {"avx512vnni": avx2 and {"avx512f", "avx512bw", "avx512_vnni"} <= flags,
                "avxvnni": avx2 and "avx_vnni" in flags, "avx2": avx2, "scalar": True}
        assert ran == {forced: next(name for name in ISAS[ISAS.index(forced):] if runs[name]) for forced in ISAS}
    with pytest.raises(RuntimeError, match="avx512vnni, avxvnni, avx2 or scalar"):
        cpu_kernels().set_packed_int8_isa("avx512")


def test_extreme_weights_and_zero_rows_are_exact():
    """-128 and 127 weights (never saturated on AVX2: 2·128·127 fits int16), an all-zero
    activation row (its scale is 0) and a row of one large value."""
    q = torch.tensor([[-128] * 40, [127] * 40, [(-1) ** k * 127 for k in range(40)]], dtype=torch.int8)
    scale = torch.tensor([1.0, 0.5, 0.25])
    x = torch.zeros(3, 40)
    x[1] = 127.0  # every block's scale d is 1 and every code 127: each product is exact
    x[2, 5] = 127.0 * 1024  # d = 1024 in the first block, 0 in the second
    packed = cpu_kernels().pack_int8_weight(q)
    expected = torch.tensor([[0.0, 0.0, 0.0],
                             [-128 * 127 * 40.0, 127 * 127 * 40 * 0.5, 0.0],
                             [-128 * 127 * 1024.0, 127 * 127 * 1024 * 0.5, -127 * 127 * 1024 * 0.25]])
    for isa in ISAS:
        with _isa(isa):
            y = cpu_kernels().packed_int8_linear(x, packed, scale, 3)
        assert torch.equal(y, expected), isa


def test_the_module_packs_unpacks_and_computes_as_the_int8_linear():
    from pagedserve.kernels.cpu_packed import PackedInt8Linear, is_int8_linear

    torch.manual_seed(0)
    linear = torch.nn.Linear(70, 33)
    int8 = Int8Linear.from_linear(linear)
    assert is_int8_linear(int8) and not is_int8_linear(linear)
    packed = PackedInt8Linear(int8)
    assert torch.equal(packed.weight, int8.weight) and torch.equal(packed.weight_scale, int8.weight_scale)
    with pytest.raises(ValueError, match="a packed linear of 70 inputs got rows of 65"):
        packed(torch.randn(2, 65))  # the same padded depth (96): only the module can tell
    x = torch.randn(2, 5, 70)
    y = packed(x)
    assert y.shape == (2, 5, 33)
    assert_equals_the_reference(y.view(10, 33), x.view(10, 70), int8.weight, int8.weight_scale, linear.bias.detach())


def test_bad_shapes_are_refused():
    q, scale, _ = _weights(20, 40, 1)
    packed = cpu_kernels().pack_int8_weight(q)
    with pytest.raises(RuntimeError, match="packed int8 weight"):
        cpu_kernels().packed_int8_linear(torch.randn(2, 40), packed, scale[:10], 20)
    with pytest.raises(RuntimeError, match="packed int8 weight"):  # a depth of 65 rounds up past the packed 64
        cpu_kernels().packed_int8_linear(torch.randn(2, 65), packed, scale, 20)
    with pytest.raises(RuntimeError, match="int8"):
        cpu_kernels().pack_int8_weight(torch.randn(4, 4))


@pytest.mark.parametrize(("model_name", "lm_head"), [("llama-gqa", False), ("qwen3", True), ("llama-tied", True),
                                                     ("llama-tied", False)])
def test_an_int8_model_runs_packed_and_its_eager_step_has_the_fused_steps_bits(tiny_checkpoint, model_name, lm_head):
    """The loader packs an int8 model's linears; the fused step takes every default batch, and
    with the C++ element-wise ops the model's own forward computes each decode row as the
    fused step does: the hidden states, the KV written and the logits are bitwise equal. A
    tied float head (the embedding) gets a packed copy in the fused step, whose logits then
    match the eager forward's `F.linear` to float rounding (torch's BLAS: other bits)."""
    from pagedserve import LLM
    from pagedserve.kernels.cpu_packed import PackedInt8Linear

    from engine_helpers import eager_then_fused

    engine = LLM(str(tiny_checkpoint(model_name)), kv_cache_memory=1 << 22, quantization="int8",
                 quantize_lm_head=lm_head).engine
    runner = engine.runner
    assert runner.fused_decoder.max_batch == 256 and runner.kernels.ops.name == "cpu"
    assert isinstance(runner.model.layers[0].mlp.down_proj, PackedInt8Linear)
    assert isinstance(runner.model.lm_head, PackedInt8Linear) == lm_head
    tied_float_head = model_name == "llama-tied" and not lm_head
    assert runner.fused_decoder.lm_head.dim() == (4 if lm_head else 3)  # packed int8, else packed float32
    with torch.inference_mode():
        eager, eager_kv, before, fused = eager_then_fused(engine)
        assert torch.equal(fused, eager)
        for cache, expected, old in zip(runner.kv_caches, eager_kv, before):
            assert torch.equal(cache, expected) and not torch.equal(cache, old)
        logits, eager_logits = runner.fused_decoder.logits(fused), runner.model.compute_logits(eager)
        if tied_float_head:
            torch.testing.assert_close(logits, eager_logits, rtol=1e-4, atol=1e-4)
            assert torch.equal(logits.argmax(-1), eager_logits.argmax(-1))
        else:
            assert torch.equal(logits, eager_logits)
