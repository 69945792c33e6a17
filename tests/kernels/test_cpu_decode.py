"""The fused CPU decode step (kernels/cpu_decode.py) against the model's own forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu_attention import cpu_kernels

from engine_helpers import assert_fused_step_equals_eager

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels need a C++ compiler")


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16])
def test_small_linear_equals_f_linear(rows):
    torch.manual_seed(rows)
    x, w, bias = torch.randn(rows, 70), torch.randn(131, 70), torch.randn(131)
    kernels = cpu_kernels()
    torch.testing.assert_close(kernels.small_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernels.small_linear(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    # a non-contiguous x (a view of every other row) is read as the rows it shows
    wide = torch.randn(2 * rows, 70)
    torch.testing.assert_close(kernels.small_linear(wide[::2], w), F.linear(wide[::2], w), rtol=1e-5, atol=1e-5)


#: batch sizes that put a row in groups of every size and position (the kernel groups up to 6 rows)
BATCHES = [2, 3, 5, 8, 13, 17]


def rows_alone_and_together(linear, x: torch.Tensor) -> None:
    """Each row of x computed alone is bitwise the row computed with m - 1 others, for every m of
    BATCHES and two windows of x (so a row lands in different groups, at different places): a
    sequence's greedy tokens must not depend on the batch it is decoded in."""
    alone = torch.cat([linear(x[r:r + 1]) for r in range(x.shape[0])])
    for m in BATCHES:
        for start in (0, x.shape[0] - m):
            together = linear(x[start:start + m])
            assert torch.equal(together, alone[start:start + m]), (m, start)


@pytest.mark.parametrize(("k", "n"), [(200, 131), (576, 33), (70, 7), (1, 3), (1536, 65)])
def test_small_linear_rows_are_batch_invariant(k, n):
    """float32: K off multiples of 64 and of 16 (the partial last vector), N odd."""
    g = torch.Generator().manual_seed(k * 100 + n)
    x, w, bias = torch.randn(20, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    kernels = cpu_kernels()
    rows_alone_and_together(lambda rows: kernels.small_linear(rows, w), x)
    rows_alone_and_together(lambda rows: kernels.small_linear(rows, w, bias), x)
    exact = x.double() @ w.double().T
    torch.testing.assert_close(kernels.small_linear(x, w).double(), exact, rtol=1e-5, atol=1e-4 * k ** 0.5)


#: row counts across the switch from row groups to register tiles and every tile remainder
MANY_ROWS = [1, 2, 4, 6, 7, 8, 9, 12, 16, 17, 23, 31, 32, 45, 64, 79, 80]


@pytest.fixture
def tile_rows():
    """Set from how many rows the products run in register tiles; restored afterwards."""
    kernels = cpu_kernels()
    default = kernels.set_linear_tile_rows(1, 1)
    kernels.set_linear_tile_rows(*default)
    yield lambda rows: kernels.set_linear_tile_rows(rows, 1)
    kernels.set_linear_tile_rows(*default)


@pytest.mark.parametrize(("k", "n"), [(576, 960), (1536, 65), (200, 131), (70, 7), (1, 5), (80, 12)])
def test_register_tiles_give_the_row_groups_bits_at_every_row_count(tile_rows, k, n):
    """Tiles and row groups are two schedules of the same sums: every row bitwise equal, for
    row counts that leave every tile remainder (rows and weight rows), K off multiples of 64
    and 16 and N odd; and each row of an 80-row call is the row computed alone."""
    g = torch.Generator().manual_seed(k + n)
    x, w, bias = torch.randn(90, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    kernels = cpu_kernels()
    tile_rows(1 << 30)  # row groups only
    alone = torch.cat([kernels.small_linear(x[r:r + 1], w, bias) for r in range(x.shape[0])])
    for m in MANY_ROWS:
        assert torch.equal(kernels.small_linear(x[:m], w, bias), alone[:m]), ("groups", m)
    tile_rows(1)  # tiles from one row
    for m in MANY_ROWS:
        for start in (0, 90 - m):
            assert torch.equal(kernels.small_linear(x[start:start + m], w, bias), alone[start:start + m]), ("tiles", m)
    exact = x.double() @ w.double().T + bias.double()
    torch.testing.assert_close(kernels.small_linear(x, w, bias).double(), exact, rtol=1e-5, atol=1e-4 * k ** 0.5)


def test_rows_are_batch_invariant_up_to_80_rows_at_the_default_switch():
    """With the kernel's own choice of row groups or tiles per call: rows alone and among up to
    80 others, on the default model's down_proj shape (deep enough for tiles)."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(90, 1536, generator=g), torch.randn(576, 1536, generator=g)
    kernels = cpu_kernels()
    alone = torch.cat([kernels.small_linear(x[r:r + 1], w) for r in range(x.shape[0])])
    for m in MANY_ROWS:
        assert torch.equal(kernels.small_linear(x[90 - m:], w), alone[90 - m:]), m


def test_int8_float_path_tiles_are_batch_invariant(tile_rows):
    """int8 weights widened to float in the tiles (the float path): the row groups' bits."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(40, 200, generator=g)
    q = torch.randint(-127, 128, (37, 200), generator=g, dtype=torch.int8)
    scale = torch.rand(37, generator=g) * 1e-2
    kernels = cpu_kernels()
    previous = kernels.set_int8_kernel("float")
    try:
        tile_rows(1 << 30)
        alone = torch.cat([kernels.small_linear_int8(x[r:r + 1], q, scale) for r in range(x.shape[0])])
        tile_rows(1)
        for m in (1, 5, 13, 40):
            assert torch.equal(kernels.small_linear_int8(x[:m], q, scale), alone[:m]), m
    finally:
        kernels.set_int8_kernel(previous)


def test_set_linear_tile_rows_refuses_zero():
    with pytest.raises(RuntimeError, match="at least 1 row"):
        cpu_kernels().set_linear_tile_rows(0, 1)


def test_small_linear_refuses_other_dtypes():
    with pytest.raises(RuntimeError, match="float32 only"):
        cpu_kernels().small_linear(torch.randn(1, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("model_name", ["llama-gqa", "llama-mha-odd", "llama3-rope", "qwen2", "qwen3", "llama-tied"])
def test_fused_step_equals_the_eager_forward(tiny_checkpoint, model_name):
    """Hidden states, logits and the KV written by one decode step of 3 sequences at different
    positions: the fused step and the model's forward agree to float rounding."""
    from pagedserve import LLM

    assert_fused_step_equals_eager(LLM(str(tiny_checkpoint(model_name)), kv_cache_memory=1 << 22).engine)


def test_fused_step_profile_counts_each_stage_kind(tiny_checkpoint):
    from pagedserve import LLM, SamplingParams

    llm = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 22)
    fused = llm.engine.runner.fused_decoder
    assert fused.take_profile() == (0.0, 0.0, 0.0)  # off: nothing counted
    fused.set_profile(True)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    linear, attention, other = fused.take_profile()
    assert linear > 0 and attention > 0 and other > 0
    assert fused.take_profile() == (0.0, 0.0, 0.0)  # taking resets


def test_fused_step_refuses_bad_inputs(tiny_checkpoint):
    """Ids, positions and slots out of range raise instead of reading or writing past a tensor."""
    import numpy as np

    from pagedserve import LLM
    from pagedserve.common.contracts import ModelInput

    engine = LLM(str(tiny_checkpoint("llama-gqa")), kv_cache_memory=1 << 20).engine
    fused = engine.runner.fused_decoder
    num_slots = engine.runner.num_blocks * engine.runner.block_size

    def batch(token=5, position=3, slot=3):
        return ModelInput([token], np.array([position]), np.array([slot]), [1], [position + 1],
                          np.zeros((1, 1), dtype=np.int32), 1, [0], [0])

    fused.forward(batch())  # in range: runs
    for bad, match in ((dict(token=320), "vocabulary"), (dict(position=512), "rotary table"),
                       (dict(slot=num_slots), "beyond the KV cache"), (dict(slot=-2), "beyond the KV cache"),
                       (dict(position=40), "longer than its block table")):
        with pytest.raises(RuntimeError, match=match):
            fused.forward(batch(**bad))
    far = batch()
    far.block_tables[0, 0] = engine.runner.num_blocks  # a block id past the cache
    with pytest.raises(RuntimeError, match="block id beyond"):
        fused.forward(far)


def test_a_subclass_with_its_own_lm_head_is_never_fused():
    from pagedserve.plugins.models.llama import LlamaForCausalLM

    class Capped(LlamaForCausalLM):
        def compute_logits(self, hidden_states):
            return super().compute_logits(hidden_states).clamp(-30, 30)

    assert Capped.decoder_weights(object.__new__(Capped)) is None
