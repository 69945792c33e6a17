"""Threads that take the others' work (kernels/csrc/cpu_balanced_for.h): a decode batch's
product tiles and attention sequences give the same bits balanced, split statically, and on
one thread."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch

from pagedserve.kernels.cpu_attention import cpu_kernels
from pagedserve.kernels.cpu_packed import pack_int4_weight
from pagedserve.plugins.int4_quantization import quantize as quantize_int4
from pagedserve.plugins.int8_quantization import quantize_per_channel

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels need a C++ compiler")


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def _balanced(on: bool) -> Iterator[None]:
    previous = cpu_kernels().set_balanced_threads(on)
    try:
        yield
    finally:
        cpu_kernels().set_balanced_threads(previous)


def _same_bits_every_way(fn: Callable[[], torch.Tensor], rounds: int = 20) -> None:
    """fn's result on one thread equals every result on two threads, balanced (many calls:
    which thread runs which items varies from call to call) and split statically."""
    with _threads(1):
        alone = fn()
    with _threads(2):
        with _balanced(False):
            assert torch.equal(fn(), alone)
        with _balanced(True):
            for _ in range(rounds):
                assert torch.equal(fn(), alone)


def test_the_switch_reports_its_previous_value():
    kernels = cpu_kernels()
    assert kernels.set_balanced_threads(False) is True  # the default: balanced
    assert kernels.set_balanced_threads(True) is False


@pytest.mark.parametrize("rows", [1, 5, 16, 64, 1500])  # 1500: several blocks of rows (prefill)
def test_packed_products_give_the_same_bits_balanced(rows):
    kernels = cpu_kernels()
    torch.manual_seed(rows)
    out, inp = 1000, 96  # 63 panels: a last tile narrower than the others
    weight, bias, x = torch.randn(out, inp) * 0.05, torch.randn(out), torch.randn(rows, inp)
    packed = kernels.pack_linear_weight(weight)
    _same_bits_every_way(lambda: kernels.packed_linear(x, packed, out, bias))
    q, scale = quantize_per_channel(weight)
    packed8 = kernels.pack_int8_weight(q)
    _same_bits_every_way(lambda: kernels.packed_int8_linear(x, packed8, scale, out, bias))
    int4 = quantize_int4(weight, 32, symmetric=False, search=False)
    codes, scales, zeros = pack_int4_weight(int4.qweight, int4.scales, int4.zeros)
    _same_bits_every_way(lambda: kernels.packed_int4_linear(x, codes, scales, zeros, out, bias))


def test_decode_attention_by_sequence_gives_the_same_bits_balanced():
    """24 sequences (a task a sequence from 4 a thread; here 12) of contexts from 0 to 700
    tokens: the threads' shares hold unequal work, the long ones run in several partitions,
    and an empty one gives zeros."""
    kernels = cpu_kernels()
    torch.manual_seed(5)
    seqs, heads, kv_heads, dim, block = 24, 9, 3, 64, 16
    lens = torch.randint(1, 700, (seqs,), dtype=torch.int32)
    lens[0], lens[1], lens[-1] = 700, 0, 1
    per = int((lens.max() + block - 1) // block)
    k_cache = torch.randn(seqs * per, block, kv_heads, dim)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(seqs * per, dtype=torch.int32).view(seqs, per)
    q = torch.randn(seqs, heads, dim)
    _same_bits_every_way(lambda: kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125), rounds=10)
    with _threads(2):
        assert not kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)[1].any()
