"""float32 products over packed weights (csrc/cpu_packed_gemm.cpp, kernels/cpu_packed.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.cpu_attention import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels need a C++ compiler")

#: (out, in): outputs not a multiple of the 16-row panel, depths of 1 and odd ones
SHAPES = [(1, 1), (17, 7), (33, 64), (131, 70), (48, 577)]


@pytest.fixture
def isa():
    """Restores the kernel choice a test changed."""
    kernels = cpu_kernels()
    yield kernels
    kernels.set_packed_linear_isa("avx512")  # at most the best this CPU runs


@pytest.mark.parametrize("out,inp", SHAPES)
def test_pack_round_trip_pads_with_zeros(out, inp):
    from pagedserve.kernels.cpu_packed import unpack_weight

    kernels = cpu_kernels()
    w = torch.randn(out, inp)
    packed = kernels.pack_linear_weight(w)
    assert packed.shape == ((out + 15) // 16, inp, 16)
    assert torch.equal(unpack_weight(packed, out), w)
    assert torch.equal(packed.permute(0, 2, 1).reshape(-1, inp)[out:], torch.zeros(packed.shape[0] * 16 - out, inp))


@pytest.mark.parametrize("out,inp", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 9, 17, 70])
def test_packed_linear_equals_f_linear(out, inp, rows):
    torch.manual_seed(out * 1000 + rows)
    kernels = cpu_kernels()
    x, w, bias = torch.randn(rows, inp), torch.randn(out, inp), torch.randn(out)
    packed = kernels.pack_linear_weight(w)
    exact = (x.double() @ w.double().t()).float()
    torch.testing.assert_close(kernels.packed_linear(x, packed, out), exact, rtol=1e-5, atol=1e-5 * inp ** 0.5)
    torch.testing.assert_close(kernels.packed_linear(x, packed, out, bias), exact + bias, rtol=1e-5,
                               atol=1e-5 * inp ** 0.5)
    # through the operator, with leading dimensions
    y = torch.ops.pagedserve.packed_linear(x.view(1, rows, inp), packed, out, bias)
    assert y.shape == (1, rows, out)
    assert torch.equal(y[0], kernels.packed_linear(x, packed, out, bias))


def test_each_row_is_the_same_bits_in_any_batch_any_kernel_and_any_thread_count(isa):
    """A row's result does not depend on how many rows share the call, where it sits among
    them, which kernel (AVX-512, AVX2, plain C++: whichever this CPU runs) or how many threads
    split the panels: every output is one chain of FMAs over k, whatever the tile."""
    torch.manual_seed(0)
    out, inp = 200, 333
    x, w, bias = torch.randn(90, inp), torch.randn(out, inp), torch.randn(out)
    packed = isa.pack_linear_weight(w)
    alone = torch.cat([isa.packed_linear(x[r:r + 1], packed, out, bias) for r in range(x.shape[0])])
    for m in [2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 31, 64, 90]:
        for start in (0, x.shape[0] - m, (x.shape[0] - m) // 2):
            assert torch.equal(isa.packed_linear(x[start:start + m], packed, out, bias), alone[start:start + m]), (m, start)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(isa.packed_linear(x, packed, out, bias), alone)
    finally:
        torch.set_num_threads(threads)
    best = isa.packed_linear_isa()
    for name in ("avx2", "scalar"):
        isa.set_packed_linear_isa(name)
        assert isa.packed_linear_isa() in (name, "scalar") or best == "scalar"
        for m in (1, 3, 7, 90):
            assert torch.equal(isa.packed_linear(x[:m], packed, out, bias), alone[:m]), (name, m)


def test_bad_shapes_are_refused():
    kernels = cpu_kernels()
    packed = kernels.pack_linear_weight(torch.randn(40, 8))
    with pytest.raises(RuntimeError, match="last dimension"):
        kernels.packed_linear(torch.randn(2, 9), packed, 40)
    with pytest.raises(RuntimeError, match="ceil"):
        kernels.packed_linear(torch.randn(2, 8), packed, 60)  # 4 panels hold at most 64, at least 49 rows
    with pytest.raises(RuntimeError, match="float32"):
        kernels.pack_linear_weight(torch.randn(4, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="avx512, avx2 or scalar"):
        kernels.set_packed_linear_isa("sse")


def test_pack_linears_replaces_float_linears_only():
    from pagedserve.kernels.cpu_packed import PackedLinear, pack_linears

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Sequential(nn.Linear(40, 17, bias=False)),
                          nn.Linear(17, 3).double(), nn.Embedding(5, 3))
    x = torch.randn(6, 24)
    before = model[2](model[1](model[0](x)))
    weight = model[0].weight.detach().clone()
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert type(model[3]) is nn.Linear  # float64 stays
    assert torch.equal(model[0].weight, weight)  # unpacked on demand
    assert model[2][0].bias is None
    after = model[2](model[1](model[0](x)))
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert "packed" in repr(model[0])


@pytest.mark.parametrize("tied", [True, False])
def test_a_cpu_float32_engine_packs_its_linears_and_its_lm_head(tmp_path, tied):
    """The loader packs (pack_cpu_weights, on by default); the fused step reads the packed
    tensors, and a packed copy of a tied LM head (an untied one is a PackedLinear itself).
    Greedy ids are the same in any batch and the same as the unpacked engine's."""
    from pagedserve import SamplingParams
    from pagedserve.engine.llm import LLM
    from pagedserve.kernels.cpu_packed import PackedLinear

    from tiny_models import build_checkpoint

    model_dir = build_checkpoint("llama", tmp_path / "m", tie_word_embeddings=tied)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [3]]
    packed = LLM(str(model_dir), kv_cache_memory=1 << 20)
    runner = packed.engine.runner
    layer = runner.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, PackedLinear) and isinstance(layer.mlp.down_proj, PackedLinear)
    assert (runner.model.lm_head is None) == tied
    assert tied or isinstance(runner.model.lm_head, PackedLinear)
    assert runner.fused_decoder is not None and runner.fused_decoder.lm_head.dim() == 3
    together = [o.outputs[0].token_ids for o in packed.generate(prompts, greedy)]
    alone = [packed.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
    assert together == alone  # batch-invariant in prefill and decode
    plain = LLM(str(model_dir), kv_cache_memory=1 << 20, pack_cpu_weights=False)
    assert type(plain.engine.runner.model.layers[0].self_attn.qkv_proj) is nn.Linear
    assert plain.engine.runner.fused_decoder.lm_head.dim() == 2
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)] == together


def test_packed_module_matches_the_linear_it_replaced_on_a_3d_input():
    from pagedserve.kernels.cpu_packed import PackedLinear

    torch.manual_seed(2)
    linear = nn.Linear(70, 131)
    packed = PackedLinear(linear)
    x = torch.randn(2, 5, 70)
    torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
