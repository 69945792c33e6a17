// The instruction sets this build of the extension admits, from the compiler's -march: a kernel
// above them is never picked at run time, whatever the CPU's flags say.
//
// The extension is built with -march=native by default, so on the CPU that built it these are
// exactly the CPU's own sets and nothing changes. Built for an older target
// (PAGEDSERVE_CPU_ARCH=x86-64-v3: AVX2, FMA and F16C; kernels/cpu_attention.py), every kernel of
// the extension runs that target's code on any CPU that has the target's sets (on one without
// them the build's own code faults): the run-time choices (packed products, int8 and int4 GEMVs)
// stop at AVX2 there, as the compile-time ones (attention, element-wise ops) already do; built
// for x86-64-v2 or x86-64, at plain C++ and the float path. So the AVX2 paths can be measured
// and tested on an AVX-512 machine.
#pragma once

namespace pagedserve_isa {

// AVX2 with FMA and F16C (every AVX2 CPU has all three; the int4 tiles read float16 scales)
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr bool kBuildAvx2 = true;
#else
constexpr bool kBuildAvx2 = false;
#endif

// AVX-512 F: the float32 products' tile
#if defined(__AVX512F__)
constexpr bool kBuildAvx512 = true;
#else
constexpr bool kBuildAvx512 = false;
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr bool kBuildAvx512Vnni = true;
#else
constexpr bool kBuildAvx512Vnni = false;
#endif

#if defined(__AVXVNNI__)
constexpr bool kBuildAvxVnni = true;
#else
constexpr bool kBuildAvxVnni = false;
#endif

}  // namespace pagedserve_isa
