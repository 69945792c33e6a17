"""benchmarks/prefill_cost.py's FMA peak: FLOP a cycle from /proc/cpuinfo's vendor, family and flags."""

from __future__ import annotations

import pytest

from benchmark_scripts import load_benchmark


def cpuinfo(vendor: str, family: int, flags: str, mhz: float = 2500.0) -> str:
    core = f"vendor_id\t: {vendor}\ncpu family\t: {family}\ncpu MHz\t\t: {mhz:.3f}\nflags\t\t: {flags}\n"
    return core + "\n" + core  # two cores, as the kernel lists them


@pytest.mark.parametrize(("vendor", "family", "flags", "per_cycle"), [
    ("GenuineIntel", 6, "fpu avx2 fma avx512f avx512_vnni", 64),  # two 512-bit FMA units
    ("AuthenticAMD", 25, "fpu avx2 fma avx512f avx512_bf16", 32),  # Zen 4: 512 bits on two 256-bit pipes
    ("AuthenticAMD", 26, "fpu avx2 fma avx512f avx512_vp2intersect", 64),  # Zen 5: two 512-bit pipes
    ("AuthenticAMD", 25, "fpu avx2 fma", 32),  # Zen 3: two 256-bit pipes
    ("GenuineIntel", 6, "fpu sse4_2", 8),
])
def test_fma_peak_from_the_cpu(vendor, family, flags, per_cycle):
    peak, how = load_benchmark("prefill_cost").fma_peak(2, cpuinfo(vendor, family, flags))
    assert peak == 2 * 2500.0 * 1e6 * per_cycle / 1e9
    assert f"x {per_cycle} FLOP/cycle" in how
    assert ("family" in how) == (vendor == "AuthenticAMD")


def test_fma_peak_takes_the_flop_per_cycle_given():
    info = cpuinfo("AuthenticAMD", 26, "fpu avx2 fma avx512f", mhz=2000.0)
    peak, how = load_benchmark("prefill_cost").fma_peak(1, info, per_cycle=32)
    assert (peak, how) == (64.0, "1 threads x 2000 MHz x 32 FLOP/cycle (AMD family 26, avx512f)")
