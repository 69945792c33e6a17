"""The -march target of the CPU extension (`PAGEDSERVE_CPU_ARCH`): named, checked, and part of
the build's key, so a build for one target is never loaded for another."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.kernels import cpu_attention
from pagedserve.kernels.cpu_attention import cpu_kernels

from cpu_flags import kernel_flags

#: the sets the kernels' choices depend on, as /proc/cpuinfo spells them
KERNEL_SETS = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni"}
AVX2 = {"avx2", "fma", "f16c"}


def test_the_default_target_is_native(monkeypatch):
    monkeypatch.delenv(cpu_attention.ARCH_VARIABLE, raising=False)
    assert cpu_attention.build_arch() == "native"
    flags = cpu_attention.build_flags()
    assert [flag for flag in flags if flag.startswith("-march")] == ["-march=native"]
    monkeypatch.setenv(cpu_attention.ARCH_VARIABLE, "  ")
    assert cpu_attention.build_flags() == flags


def test_a_named_target_replaces_native_and_changes_the_build_name(monkeypatch):
    monkeypatch.delenv(cpu_attention.ARCH_VARIABLE, raising=False)
    native = cpu_attention._build_name()
    monkeypatch.setenv(cpu_attention.ARCH_VARIABLE, "x86-64-v3")
    assert cpu_attention.build_arch() == "x86-64-v3"
    assert [flag for flag in cpu_attention.build_flags() if flag.startswith("-march")] == ["-march=x86-64-v3"]
    avx2 = cpu_attention._build_name()
    assert avx2 != native and avx2.startswith("pagedserve_cpu_attention_")
    assert cpu_attention._build_name() == avx2  # the same target, the same build


def test_arm_names_with_extensions_are_march_names(monkeypatch):
    monkeypatch.setenv(cpu_attention.ARCH_VARIABLE, "armv8.2-a+dotprod")
    assert cpu_attention.build_arch() == "armv8.2-a+dotprod"


@pytest.mark.parametrize("value", ["x86-64-v3 -fplugin=x.so", "-O0", "native;rm", "v3/../x"])
def test_a_value_that_is_not_a_march_name_is_refused(monkeypatch, value):
    monkeypatch.setenv(cpu_attention.ARCH_VARIABLE, value)
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_ARCH=.*is not a compiler -march name"):
        cpu_attention.build_flags()


def test_a_bad_target_is_an_error_not_a_silent_fallback(monkeypatch):
    monkeypatch.setenv(cpu_attention.ARCH_VARIABLE, "-O0")
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_ARCH"):
        cpu_attention.cpu_kernels.__wrapped__()  # the uncached function: the cached module stays


def test_a_native_build_enables_every_set_this_cpu_has():
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels need a C++ compiler")
    if cpu_attention.build_arch() != "native":
        pytest.skip("built for PAGEDSERVE_CPU_ARCH's target")
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to compare with")
    assert set(cpuinfo.read_text().split()) & KERNEL_SETS <= set(kernels.build_instruction_sets())


def test_the_run_time_kernel_choices_stay_within_the_build_and_the_cpu():
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels need a C++ compiler")
    flags = kernel_flags(kernels)
    assert set(kernels.build_instruction_sets()) <= KERNEL_SETS
    packed = kernels.packed_linear_isa()
    assert packed == ("avx512" if "avx512f" in flags and flags >= AVX2 else "avx2" if flags >= AVX2 else "scalar")
    int8 = list(kernels.int8_kernels())
    assert ("avx512vnni" in int8) == (AVX2 | {"avx512f", "avx512bw", "avx512_vnni"} <= flags)
    assert ("avxvnni" in int8) == (AVX2 | {"avx_vnni"} <= flags)
    assert ("avx2" in int8) == (flags >= AVX2) and int8[-1] == "float"
    int4 = list(kernels.int4_kernels())
    assert ("avx2" in int4) == (flags >= AVX2) and int4[-1] == "scalar"
