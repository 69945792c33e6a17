"""The Triton w8a16 GEMM (kernels/triton_int8.py) against its torch reference, and its use by
`Int8Linear`. In-process the kernel runs in Triton's interpreter on CPU tensors; the `gpu`
test runs this file again, compiled, on CUDA tensors (DEVICE below)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from pagedserve.kernels import triton_int8  # noqa: E402
from pagedserve.kernels.triton_int8 import w8a16_linear, w8a16_linear_ref  # noqa: E402

from triton_twin import run_compiled_twin, twin_device  # noqa: E402

#: CUDA only when the kernels are compiled (the `gpu` twin, triton_twin.py)
DEVICE = twin_device()
#: (rtol, atol) against the float32 reference: the kernel accumulates in float32 in another
#: order, then rounds to x's dtype, so bf16/fp16 outputs may differ by one unit in the last
#: place (2^-8 / 2^-11 relative); float32 by the summation order over K
TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-2, 1e-2), torch.float16: (2e-3, 2e-3)}


def _operands(m, k, n, dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).to(DEVICE)
    scale = (torch.rand(n, generator=g) * 0.05 / 127).to(DEVICE)  # |w * scale| <= 0.05
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    return x, w, scale, b


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize(("k", "n", "bias"), [(200, 75, True), (72, 33, False)], ids=["k200-n75-bias", "k72-n33"])
def test_w8a16_matches_reference_on_odd_shapes(m, k, n, bias, dtype):
    """K and N are no multiple of any tile (BLOCK_K 32/64/128, BLOCK_N 32/64): masked edges."""
    x, w, scale, b = _operands(m, k, n, dtype, bias)
    y = w8a16_linear(x, w, scale, b)
    assert y.shape == (m, n) and y.dtype == dtype and not y.isnan().any()
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(y, w8a16_linear_ref(x, w, scale, b), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(("m", "split_k"), [(1, 3), (17, 2), (3, 7)])
def test_w8a16_split_k_matches_reference(m, split_k, dtype):
    """K = 520 split across programs (as split_k_for does for narrow layers on a GPU): the
    float32 partials, added by the second kernel, give the reference's result. Splits are
    whole BLOCK_K steps: 7 asked of K = 520 in 128-wide steps (bf16, M = 3) leave 5."""
    x, w, scale, b = _operands(m, 520, 75, dtype)
    y = w8a16_linear(x, w, scale, b, split_k=split_k)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(y, w8a16_linear_ref(x, w, scale, b), rtol=rtol, atol=atol)
    assert torch.equal(y, w8a16_linear(x, w, scale, b, split_k=split_k))  # the same sum every run


def test_split_k_only_where_tiles_are_few(monkeypatch):
    class Props:
        multi_processor_count = 132  # an H100/H200

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    cuda = torch.device("cuda")
    assert triton_int8.split_k_for(1, 4096, 4096, torch.device("cpu")) == 1  # the interpreter: never
    assert triton_int8.split_k_for(1, 4096, 4096, cuda) == 3  # 128 tiles of 32 columns: 264 programs wanted
    assert triton_int8.split_k_for(1, 6144, 4096, cuda) == 2
    assert triton_int8.split_k_for(1, 28672, 4096, cuda) == 1  # 896 tiles fill the GPU
    assert triton_int8.split_k_for(16, 1024, 256, cuda) == 1  # K = 256 is two 128-wide steps: too short
    assert triton_int8.split_k_for(128, 1024, 4096, cuda) == 1  # prefill: tiles enough
    # float32 takes 32-wide K steps: 128 tiles want 3 splits, each at least 4 steps
    assert triton_int8.split_k_for(1, 4096, 4096, cuda, torch.float32) == 3
    assert triton_int8.split_k_for(1, 4096, 256, cuda, torch.float32) == 2


def test_w8a16_large_tile_and_leading_dims():
    """M = 70 takes the 64-row tile (two row tiles, the second partial); x [2, 35, K] is
    flattened and y keeps the leading dimensions; a zero scale row gives zeros (plus bias)."""
    x, w, scale, b = _operands(70, 96, 130, torch.bfloat16)
    scale[5] = 0.0
    y = w8a16_linear(x.view(2, 35, 96), w, scale, b)
    assert y.shape == (2, 35, 130)
    ref = w8a16_linear_ref(x, w, scale, b)
    torch.testing.assert_close(y.view(70, 130), ref, rtol=1e-2, atol=1e-2)
    assert torch.equal(y.view(70, 130)[:, 5], b[5].expand(70))


def test_w8a16_reference_is_the_dequantized_linear():
    """The reference is Int8Linear's meaning: F.linear with the dequantized weight."""
    from pagedserve.plugins.int8_quantization import dequantize

    x, w, scale, b = _operands(4, 40, 24, torch.float32)
    torch.testing.assert_close(w8a16_linear_ref(x, w, scale, b),
                               torch.nn.functional.linear(x, dequantize(w, scale), b), rtol=1e-6, atol=1e-6)


def test_int8_linear_calls_the_triton_gemm_where_registered(monkeypatch):
    """On a device in TRITON_GEMM_DEVICES (CUDA; CPU here, for the test) Int8Linear calls the
    registered `w8a16_linear` operator, and its result is the kernel's."""
    from pagedserve.plugins import int8_quantization as quantization

    linear = torch.nn.Linear(72, 40, bias=True).to(DEVICE, torch.bfloat16)
    module = quantization.Int8Linear.from_linear(linear)
    x = torch.randn(2, 3, 72).to(DEVICE, torch.bfloat16)
    calls = []

    def op(name):
        if name != "w8a16_linear":
            return None
        return lambda *args: calls.append(args[0].shape) or w8a16_linear(*args)

    monkeypatch.setattr(quantization, "_cpu_op", op)
    monkeypatch.setattr(quantization, "TRITON_GEMM_DEVICES", (x.device.type,))
    y = module(x)
    assert calls == [torch.Size([6, 72])]
    assert y.shape == (2, 3, 40)
    assert torch.equal(y, w8a16_linear(x, module.weight, module.weight_scale, module.bias))
    monkeypatch.setattr(quantization, "TRITON_GEMM_DEVICES", ())
    assert calls == [torch.Size([6, 72])] and module(x).shape == (2, 3, 40)  # elsewhere: dequantize + F.linear


def test_register_op_and_the_worker_check(monkeypatch):
    """The worker registers the operator after the kernel's self-check passes, and not when
    it fails; once registered, torch.ops.pagedserve.w8a16_linear is the kernel."""
    from pagedserve.engine import model_loader

    registered = []
    monkeypatch.setattr(triton_int8, "register_op", lambda: registered.append(True))
    monkeypatch.setattr(triton_int8, "self_check", lambda device: "broken")
    model_loader._register_triton_gemm(torch.device(DEVICE))
    assert registered == []
    monkeypatch.undo()
    assert triton_int8.self_check(torch.device(DEVICE)) is None
    model_loader._register_triton_gemm(torch.device(DEVICE))
    x, w, scale, b = _operands(3, 64, 20, torch.bfloat16)
    assert torch.equal(torch.ops.pagedserve.w8a16_linear(x, w, scale, b), w8a16_linear(x, w, scale, b))
    triton_int8.register_op()  # a second registration is a no-op


def test_self_check_catches_a_wrong_kernel(monkeypatch):
    monkeypatch.setattr(triton_int8, "w8a16_linear", lambda x, w, s, b: w8a16_linear_ref(x, w, s, b) + 1)
    assert triton_int8.self_check(torch.device(DEVICE)) == "w8a16_linear disagrees with the torch reference at M=1"


@pytest.mark.gpu
def test_the_same_checks_compiled_on_a_gpu():
    """This file's tests again, compiled for the GPU, on CUDA tensors (DEVICE)."""
    run_compiled_twin(__file__)
