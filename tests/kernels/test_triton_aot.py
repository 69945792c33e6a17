"""The Triton kernels compiled for NVIDIA GPUs (sm_80, sm_90) on this machine, GPU or not:
what the interpreter-run tests cannot show (a construct the compiler refuses, shared memory
over a GPU's limit, float32 dots rounded to tf32).

The compiler cannot run in a process that imported Triton under TRITON_INTERPRET=1 (as this
one did), so the compiling parts run in a subprocess without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from pagedserve.kernels import triton_aot, triton_ops  # noqa: E402
from pagedserve.kernels.triton_aot import recording  # noqa: E402

KERNELS = {"_paged_attention_kernel", "_combine_splits_kernel", "_kv_store_kernel", "_rms_norm_kernel",
           "_silu_and_mul_kernel", "_rotary_kernel", "_kv_store_quantized_kernel", "_w8a16_gemm_kernel",
           "_w8a16_reduce_kernel", "_w4a16_gemm_kernel", "_w4a16_reduce_kernel", "_w4_dequantize_kernel"}
TESTS_DIR = Path(__file__).parent.parent


def _compiled(*argv: str, script: str | None = None) -> str:
    """Run `python -m pagedserve.kernels.triton_aot argv`, or `script`, without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-c", textwrap.dedent(script)] if script else \
        [sys.executable, "-m", "pagedserve.kernels.triton_aot", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_every_engine_kernel_compiles_for_a100_and_h100():
    out = _compiled("--quick", "--arch", "80,90", "--json")
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert {r["kernel"] for r in results} == KERNELS
    # bf16, block size 16, two head layouts, three batch kinds, and the elementwise kernels
    # once per layout, each specialization once: 17 launches per architecture with a bf16
    # cache; an int8 and a float8 cache add a quantizing store and three attention kernels
    # per layout (8 each; float8 on sm_90 only); the w8a16 GEMM: 3 tile sizes, and per layout
    # a split-K decode with its reduction (K = 4096 in 4 splits, K = 576 in 3), in fp16 and
    # bf16 (14); the w4a16 GEMM, per dtype: groups 32 and 128, each symmetric and asymmetric,
    # 2 tile sizes and a split-K decode (12), one reduction for 4 splits, for K = 576 in
    # groups of 128 (5 steps of 128) a decode in 3 splits, sym and asym, and its reduction,
    # and the prefill's dequantize pass per group and symmetry (20)
    assert len(results) == 2 * (17 + 8 + 14 + 40) + 8
    for r in results:
        assert r["error"] is None, r
        assert 0 <= r["shared_bytes"] <= triton_aot.SHARED_MEMORY_LIMIT[r["arch"]]
        assert 0 < r["registers"] <= 255
        assert r["tf32_dots"] is False
        # only a prefill tile of 64 rows × 128 dims (Llama-3-8B: 16 tokens × 4 heads) takes 8 warps
        # (whatever the cache), and only below sm_90; the w8a16 GEMM's 64-row tile takes 8 too
        big_tile = (r["kernel"] == "_paged_attention_kernel" and "llama3-8b bs16 mixed" in r["label"]
                    and r["arch"] < 90)
        big_gemm = r["kernel"] == "_w8a16_gemm_kernel" and r["constants"]["BLOCK_M"] == 64
        assert r["num_warps"] == (8 if big_tile or big_gemm else 4), r
    assert "166 launches: 166 compiled, 0 refused by the compiler; 0 over the shared memory limit" in out
    # no GEMM spills registers, but for the w4a16 64 × 64 tile (tiles_for, measured the fastest
    # on an H100) with 128-wide K steps on sm_80: a few bytes there
    spills = {(r["arch"], r["kernel"], r["constants"]["BLOCK_M"], r["constants"]["GROUP"])
              for r in results if "gemm" in r["kernel"] and r["stack_bytes"]}
    assert spills <= {(80, "_w4a16_gemm_kernel", 64, 128)}, spills
    assert max(r["stack_bytes"] for r in results if "gemm" in r["kernel"]) <= 128
    attention = {r["label"].split()[-1]: r["constants"] for r in results
                 if r["arch"] == 90 and r["kernel"] == "_paged_attention_kernel" and "llama3-8b" in r["label"]
                 and "kv-" not in r["label"]}
    # a prefill tile holds 16 query tokens × 4 heads; a decode tile 4 × 4 (tl.dot's 16 rows)
    assert attention["mixed"]["BLOCK_M"] == 16 and attention["decode"]["BLOCK_M"] == 4
    # the CUDA graph plan: the split count fixed for an 8192-token context, compiled in
    assert attention["graph"]["NUM_SPLITS"] == 8 and attention["mixed"]["NUM_SPLITS"] == 1
    assert all(c["DOT_FP32"] is False for c in attention.values())  # the interpreter's widening is off


def test_recording_runs_nothing_and_sees_the_launch_arguments():
    backend, query, key, kv_cache, metadata = triton_aot._attention_batch("graph", 32, 8, 128, 16, torch.bfloat16)
    kv_cache.fill_(3.0)
    store_kernel = triton_ops._kv_store_kernel
    with recording() as launches:
        backend.forward(query, key, key, kv_cache, metadata, 128**-0.5)
    assert [launch.name for launch in launches] == ["_kv_store_kernel", "_paged_attention_kernel",
                                                    "_combine_splits_kernel"]
    assert torch.equal(kv_cache, torch.full_like(kv_cache, 3.0))  # the store did not run
    assert triton_ops._kv_store_kernel is store_kernel  # the kernels are back
    signature, constexprs, attrs = triton_aot.signature_of(launches[1])
    names = triton_aot._jit_function(launches[1].kernel).arg_names
    index = {name: (i,) for i, name in enumerate(names)}
    assert signature["q_ptr"] == "*bf16" and signature["block_tables_ptr"] == "*i32"
    assert signature["part_out_ptr"] == "*fp32" and signature["scale"] == "fp32"
    # the graph plan's minimum split size (1024 tokens / 16) is a runtime integer, hinted 16-divisible
    assert signature["min_blocks_per_split"] == "i32" and attrs[index["min_blocks_per_split"]] == [["tt.divisibility", 16]]
    assert constexprs[index["GROUP"]] == 4 and constexprs[index["NUM_SPLITS"]] == 8
    assert constexprs[index["DOT_FP32"]] is False and constexprs[index["DOT_PRECISION"]] == "tf32"
    assert launches[1].grid == (4, 8, 8)  # 4 sequences × 8 KV heads × 8 splits


def test_compiling_under_the_interpreter_is_refused():
    backend, query, key, kv_cache, metadata = triton_aot._attention_batch("decode", 8, 8, 64, 16, torch.float32)
    with recording() as launches:
        backend.forward(query, key, key, kv_cache, metadata, 0.125)
    with pytest.raises(RuntimeError, match="without TRITON_INTERPRET=1"):
        triton_aot.compile_launch(launches[0], 90)


def test_float32_attention_compiles_without_tf32():
    """tl.dot rounds float32 operands to tf32 on a GPU unless told otherwise; a float32
    model's attention must not (the interpreter computes in float32 either way)."""
    out = _compiled(script="""
        import torch
        from pagedserve.kernels import triton_aot as aot
        [launch] = [launch for _, launch in aot.engine_launches(
            dtypes=(torch.float32,), block_sizes=(16,), layouts=aot.HEAD_LAYOUTS[:1], kinds=("mixed",), kv_cache_dtypes=(None,))
            if launch.name == "_paged_attention_kernel"]
        print(launch.kwargs["DOT_PRECISION"], *("tf32" in aot.compile_launch(launch, arch).ptx for arch in (80, 90)))
        launch.kwargs["DOT_PRECISION"] = "tf32"  # what the kernel compiled to before: the check sees it
        print("tf32" in aot.compile_launch(launch, 90).ptx)
    """)
    assert out.split() == ["ieee", "False", "False", "True"]


def test_a_construct_the_interpreter_runs_but_the_compiler_refuses_is_reported():
    from triton_samples import first_negative

    x, out = torch.tensor([3.0, 1.0, -2.0, -5.0]), torch.zeros(1, dtype=torch.int32)
    first_negative[(1,)](x, out, 4)
    assert out.item() == 2  # the interpreter ran it
    printed = _compiled(script="""
        import torch
        from pagedserve.kernels import triton_aot as aot
        from triton_samples import first_negative
        x, out = torch.tensor([3.0, 1.0, -2.0, -5.0]), torch.zeros(1, dtype=torch.int32)
        result = aot.compile_launch(aot.Launch(first_negative, (1,), (x, out, 4), {}), 90)
        print(result.error)
        print(aot.summary([result]))
    """).splitlines()
    assert printed[0].startswith("UnsupportedLanguageConstruct: unsupported AST node type: Break (at 6:12:")
    assert printed[1].startswith("1 launches: 0 compiled, 1 refused by the compiler;")


def test_shared_memory_over_the_limit_is_flagged():
    printed = _compiled(script="""
        import torch
        from pagedserve.kernels import triton_aot as aot
        [launch] = [launch for _, launch in aot.engine_launches(
            dtypes=(torch.bfloat16,), block_sizes=(16,), layouts=aot.HEAD_LAYOUTS[:1], kinds=("mixed",), kv_cache_dtypes=(None,))
            if launch.name == "_paged_attention_kernel"]
        result = aot.compile_launch(launch, 90)
        print(result.notes, result.shared_bytes > 1024)
        aot.SHARED_MEMORY_LIMIT[90] = 1024
        result = aot.compile_launch(launch, 90)
        print(result.notes[0] == f"needs {result.shared_bytes} B of shared memory, sm_90 has 1024")
        print(aot.summary([result]))
    """).splitlines()
    assert printed[:2] == ["[] True", "True"]
    assert "1 compiled, 0 refused by the compiler; 1 over the shared memory limit" in printed[2]


def test_quantized_kv_and_gemm_launches_compile_where_their_types_exist():
    """int8 caches and the w8a16 and w4a16 GEMMs compile for sm_80 and sm_90; float8_e4m3fn
    caches for sm_90 only (Triton has no e4m3 type below sm_89), each kernel told its cache
    layout, the w4a16 GEMM its group and whether it has zero points."""
    printed = _compiled(script="""
        import json, torch
        from pagedserve.kernels import triton_aot as aot
        results = aot.compile_all((80, 90), dtypes=(torch.float16,), block_sizes=(32,), layouts=aot.HEAD_LAYOUTS[:1],
                                  kinds=("decode",), kv_cache_dtypes=(torch.int8, torch.float8_e4m3fn))
        for r in results:
            print(json.dumps([r.arch, r.kernel, r.label, r.error, r.constants.get("KV_INT8"), r.constants.get("ROW_WIDTH"),
                              r.constants.get("INT8"), r.constants.get("BLOCK_M"),
                              [r.constants.get(c) for c in ("GROUP", "HAS_ZERO", "SPLIT_K")]]))
    """)
    rows = [json.loads(line) for line in printed.splitlines()]
    assert all(error is None for _, _, _, error, *_ in rows)
    kv = sorted((arch, kernel, label.split()[-1], kv_int8, width, int8)
                for arch, kernel, label, _, kv_int8, width, int8, *_ in rows if "kv-" in label)
    assert kv == [
        (80, "_kv_store_quantized_kernel", "kv-i8", None, 132, True),
        (80, "_paged_attention_kernel", "kv-i8", True, 132, None),
        (90, "_kv_store_quantized_kernel", "kv-fp8e4nv", None, 128, False),
        (90, "_kv_store_quantized_kernel", "kv-i8", None, 132, True),
        (90, "_paged_attention_kernel", "kv-fp8e4nv", False, 128, None),
        (90, "_paged_attention_kernel", "kv-i8", True, 132, None),
    ]
    gemm = sorted((arch, block_m) for arch, kernel, *_, block_m, _ in rows if kernel == "_w8a16_gemm_kernel")
    assert gemm == [(80, 16), (80, 16), (80, 32), (80, 64), (90, 16), (90, 16), (90, 32), (90, 64)]  # M=1 twice: split-K
    assert sorted(arch for arch, kernel, *_ in rows if kernel == "_w8a16_reduce_kernel") == [80, 90]
    int4 = sorted((arch, *int4, block_m) for arch, kernel, *_, block_m, int4 in rows if kernel == "_w4a16_gemm_kernel")
    # per architecture: groups 32 and 128, without and with zero points, 2 tiles (M = 32 and
    # 256 share the 64-row one) and a split-K decode
    assert int4 == sorted((arch, group, zero, split, block_m) for arch in (80, 90) for group in (32, 128)
                          for zero in (False, True) for block_m, split in ((16, 1), (16, 4), (64, 1)))
    assert sorted(arch for arch, kernel, *_ in rows if kernel == "_w4a16_reduce_kernel") == [80, 90]
    dequantize = sorted((arch, *int4[:2]) for arch, kernel, *_, int4 in rows if kernel == "_w4_dequantize_kernel")
    assert dequantize == [(arch, group, zero) for arch in (80, 90) for group in (32, 128) for zero in (False, True)]


def test_recording_sees_the_quantized_cache_and_the_gemm():
    backend, query, key, kv_cache, metadata = triton_aot._attention_batch("decode", 32, 8, 128, 16, torch.bfloat16,
                                                                          torch.float8_e4m3fn)
    assert kv_cache.shape[-1] == 128 and kv_cache.dtype == torch.float8_e4m3fn
    with recording() as launches:
        backend.forward(query, key, key, kv_cache, metadata, 128**-0.5)
        from pagedserve.kernels.triton_int8 import w8a16_linear

        w8a16_linear(torch.empty(1, 64), torch.empty(48, 64, dtype=torch.int8), torch.empty(48))
        w8a16_linear(torch.empty(1, 512), torch.empty(48, 512, dtype=torch.int8), torch.empty(48), split_k=2)
    assert [launch.name for launch in launches] == ["_kv_store_quantized_kernel", "_paged_attention_kernel",
                                                    "_w8a16_gemm_kernel", "_w8a16_gemm_kernel", "_w8a16_reduce_kernel"]
    assert launches[3].grid == (1, 2, 2) and launches[3].kwargs["SPLIT_K"] == 2  # 2 column tiles × 2 K splits
    assert triton_aot.uses_fp8(launches[0]) and not triton_aot.uses_fp8(launches[2])
    signature, constexprs, _ = triton_aot.signature_of(launches[1])
    assert signature["k_cache_ptr"] == "*fp8e4nv" and signature["q_ptr"] == "*bf16"
    signature, constexprs, _ = triton_aot.signature_of(launches[2])
    names = triton_aot._jit_function(launches[2].kernel).arg_names
    assert signature["w_ptr"] == "*i8" and signature["M"] == "constexpr"  # M = 1 is specialized
    assert constexprs[(names.index("DOT_PRECISION"),)] == "ieee"  # float32 activations: no tf32


def test_recording_sees_the_w4a16_gemm():
    """The w4a16 launches as an int4 model's linear makes them: uint8 codes, float16 scales,
    uint8 zero points (a symmetric layout passes its codes in their place, unused)."""
    from pagedserve.kernels.triton_int4 import w4a16_linear

    qweight, zeros = torch.empty(48, 80, dtype=torch.uint8), torch.empty(48, 5, dtype=torch.uint8)
    scales = torch.empty(48, 5, dtype=torch.float16)
    with recording() as launches:
        w4a16_linear(torch.empty(1, 150), qweight, scales, zeros, None, 32, split_k=2)
        w4a16_linear(torch.empty(3, 100, dtype=torch.bfloat16), qweight[:, :64], scales[:, :1], None, None, 128)
    assert [launch.name for launch in launches] == ["_w4a16_gemm_kernel", "_w4a16_reduce_kernel", "_w4a16_gemm_kernel"]
    assert launches[0].grid == (1, 1, 2) and launches[2].grid == (1, 1, 1)  # 48 columns: one tile of 64
    names = triton_aot._jit_function(launches[0].kernel).arg_names
    signature, constexprs, _ = triton_aot.signature_of(launches[0])
    assert signature["q_ptr"] == "*u8" and signature["scale_ptr"] == "*fp16" and signature["zero_ptr"] == "*u8"
    assert [constexprs[(names.index(c),)] for c in ("GROUP", "HAS_ZERO", "BLOCK_K", "DOT_PRECISION")] == [
        32, True, 32, "ieee"]
    signature, constexprs, _ = triton_aot.signature_of(launches[2])
    assert signature["x_ptr"] == "*bf16" and signature["zero_ptr"] == "*u8"  # the codes, unused
    assert [constexprs[(names.index(c),)] for c in ("GROUP", "HAS_ZERO", "BLOCK_K", "DOT_PRECISION")] == [
        128, False, 128, "tf32"]
