"""The -march target of the CPU extension (`PAGEDSERVE_CPU_ARCH`): named, checked, and part of
the build's key, so a build for one target is never loaded for another."""

from __future__ import annotations

import pytest

from pagedserve.kernels import cpu_attention


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


@pytest.mark.parametrize("value", ["x86-64-v3 -fplugin=x.so", "-O0", "native;rm", "v3/../x"])
def test_a_value_that_is_not_a_march_name_is_refused(monkeypatch, value):
    monkeypatch.setenv(cpu_attention.ARCH_VARIABLE, value)
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_ARCH=.*is not a compiler -march name"):
        cpu_attention.build_flags()
