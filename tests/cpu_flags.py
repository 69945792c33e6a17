"""The vector instruction sets the CPU extension's kernels may use here: the CPU's flags, as
/proc/cpuinfo lists them, that the extension's build also enables (its -march: native, or
`PAGEDSERVE_CPU_ARCH`; kernels/csrc/cpu_build_isa.h). Empty where /proc/cpuinfo is missing."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def kernel_flags(kernels: Any) -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    return flags & set(kernels.build_instruction_sets())
