// int8 × int8 products for the int8 weights' few-row linear layers (AVX-512 VNNI).
//
// The int8 weights (plugins/int8_quantization.py's Int8Linear: int8 rows [out, in], one float32
// scale per row) are used as they are, with no repacked copy. The activation rows are
// quantized on the fly, as llama.cpp's Q8_0 activations: one float32 scale d per block of 32
// values (d = max|x| / 127, q = round(x / d), |q·d - x| <= d/2), so a product is a sum of
// int8 × int8 products per block, `vpdpbusd` (64 of them per instruction into 16 int32 lanes,
// four adjacent products per lane: lanes 0-7 are one block, lanes 8-15 the next) scaled by
// the block's d into a float accumulator. `vpdpbusd` multiplies unsigned by signed bytes: the
// weights go in as w + 128 (one xor per 64 weights, shared by every activation row), and
// 128·Σq of the same four activations, computed once per call when the activations are
// quantized, starts each int32 lane negated, so the int32 sum is exactly Σ q·w.
// Per 64 weights and activation row: one `vpdpbusd`, one conversion, one FMA, against four
// conversions and four FMAs per 64 weights for the float path of cpu_decode.cpp.
// No repacked copy of the weights; the scratch is the quantized activations (m·in bytes, and
// m·in/4 floats and int32s of per-lane scales and offsets).
//
// Built where the compiler targets AVX-512 F+BW+VNNI (the extension is built -march=native);
// elsewhere `int8_vnni_available()` is false and cpu_decode.cpp keeps its float path.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PAGEDSERVE_INT8_VNNI 1
#include <immintrin.h>
#endif

namespace {

#ifdef PAGEDSERVE_INT8_VNNI
constexpr bool kCompiled = true;
#else
constexpr bool kCompiled = false;
#endif

// on by default where compiled; `set_int8_vnni(False)` selects the float path (an A/B switch
// for python benchmarks/int8_ab.py, process-wide)
std::atomic<bool> g_enabled{kCompiled};

#ifdef PAGEDSERVE_INT8_VNNI

constexpr int64_t kBlock = 32;  // activation values per scale
// Software prefetch distance, in weight rows. The weights stream from L3 or memory (the model is
// far larger than L2), and the hardware prefetcher alone left the kernel at about 10 GB/s: with
// the rows 8-32 ahead prefetched, the 120 linear layers of the default model (M = 1, one thread,
// each weight read once per pass) took 7.0-8.5 ms instead of 10.8-11.0 ms.
constexpr int64_t kPrefetchRows = 16;

// Row r of x [m, in] into xq[r * kp ...] (kp = in rounded up to 64; the padding is 0), the
// scale of each 4-value lane into dl[r * kp / 4 ...] (each block's d eight times, 0 in the
// padding), and -128·(the lane's 4 values of q) into nc[r * kp / 4 ...].
void quantize_rows(const float* x, int64_t m, int64_t in, int64_t kp, int8_t* xq, float* dl, int32_t* nc) {
  const __m512i c128 = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * in;
    int8_t* qr = xq + r * kp;
    float* dr = dl + r * (kp / 4);
    for (int64_t k0 = 0; k0 < kp; k0 += kBlock) {
      const int64_t n = std::clamp<int64_t>(in - k0, 0, kBlock);
      const __mmask16 lo = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
      const __mmask16 hi = n >= 32 ? 0xFFFF : (n > 16 ? static_cast<__mmask16>((1u << (n - 16)) - 1) : 0);
      const __m512 v0 = _mm512_maskz_loadu_ps(lo, xr + k0);
      const __m512 v1 = _mm512_maskz_loadu_ps(hi, xr + k0 + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float d = amax / 127.f;
      const __m512 id = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      // round to nearest (the default MXCSR mode); |x·127/amax| <= 127 (up to float rounding)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + k0),
                       _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, id))));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + k0 + 16),
                       _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, id))));
      _mm256_storeu_ps(dr + k0 / 4, _mm256_set1_ps(d));
    }
    for (int64_t k = 0; k < kp; k += 64) {
      const __m512i q = _mm512_loadu_si512(qr + k);
      _mm512_storeu_si512(nc + r * (kp / 4) + k / 4, _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, c128, q)));
    }
  }
}

// The sum of the 16 lanes, always in the same order: -ffast-math may reassociate the plain
// vector adds of _mm512_reduce_add_ps (GCC writes them as `+` of vector types) differently in
// the tiles of different shapes, and a row's result must not depend on how many rows or
// weight rows share its tile (a sequence's greedy tokens must not depend on its batch). The
// empty asm statements pin each partial sum.
template <class T>
inline T pinned(T v) {
  asm("" : "+v"(v));
  return v;
}

inline float sum_lanes(__m512 v) {
  const __m256 h = pinned(_mm256_add_ps(_mm512_castps512_ps256(v),
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
  const __m128 q = pinned(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  const __m128 p = pinned(_mm_add_ps(q, _mm_movehl_ps(q, q)));
  return _mm_cvtss_f32(pinned(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1))));
}

// s[r][j] = Σ_k (q[r, k]·d[r, block(k)])·w[j·in + k] for MR quantized activation rows against
// NW weight rows (accumulators in registers: NW×MR <= 16). The weights go in as w + 128
// (unsigned), and nc takes the activation side's 128·Σq off each int32 lane.
template <int NW, int MR>
inline void dot_tile(const int8_t* w, int64_t in, int64_t kp, const int8_t* xq, const float* dl, const int32_t* nc,
                     float (*s)[4]) {
  __m512 acc[MR][NW];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NW; ++j) acc[r][j] = _mm512_setzero_ps();
  const __m512i c128 = _mm512_set1_epi8(static_cast<char>(0x80));
  auto step = [&](int64_t k, __mmask64 mask) {
    __m512i wu[NW];
#pragma GCC unroll 8
    for (int j = 0; j < NW; ++j) {
      // the rows kPrefetchRows ahead (a prefetch beyond the weights is harmless: it never faults)
      _mm_prefetch(reinterpret_cast<const char*>(w + (j + kPrefetchRows) * in + k), _MM_HINT_T0);
      wu[j] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w + j * in + k), c128);
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m512i xv = _mm512_loadu_si512(xq + r * kp + k);
      const __m512 dv = _mm512_loadu_ps(dl + r * (kp / 4) + k / 4);
      const __m512i cv = _mm512_loadu_si512(nc + r * (kp / 4) + k / 4);
#pragma GCC unroll 8
      for (int j = 0; j < NW; ++j)
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(cv, wu[j], xv)), dv, acc[r][j]);
    }
  };
  const int64_t full = in / 64 * 64;
  for (int64_t k = 0; k < full; k += 64) step(k, ~__mmask64{0});
  if (full < in) step(full, (__mmask64{1} << (in - full)) - 1);
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NW; ++j) s[r][j] = sum_lanes(acc[r][j]);
}

template <int NW>
inline void dot_tile_rows(int mr, const int8_t* w, int64_t in, int64_t kp, const int8_t* xq, const float* dl,
                          const int32_t* nc, float (*s)[4]) {
  switch (mr) {
    case 1: dot_tile<NW, 1>(w, in, kp, xq, dl, nc, s); break;
    case 2: dot_tile<NW, 2>(w, in, kp, xq, dl, nc, s); break;
    case 3: dot_tile<NW, 3>(w, in, kp, xq, dl, nc, s); break;
    default: dot_tile<NW, 4>(w, in, kp, xq, dl, nc, s); break;
  }
}

#endif  // PAGEDSERVE_INT8_VNNI

}  // namespace

bool int8_vnni_available() { return kCompiled; }
bool int8_vnni_enabled() { return g_enabled.load(std::memory_order_relaxed); }

// Selects the VNNI kernel (true) or the float path (false) for every later int8 linear of
// the process; returns the previous choice.
bool set_int8_vnni(bool on) {
  TORCH_CHECK(!on || kCompiled, "set_int8_vnni: this build has no AVX-512 VNNI kernel");
  return g_enabled.exchange(on);
}

// y[r, o] = (x[r, :] · w[o, :]) · scale[o] (+ bias[o]) for r < m, with x quantized per block of
// 32 as above; w int8 [out, in], row-major. As linear_rows_int8 (cpu_decode.cpp): output rows
// split across torch's intra-op threads, each taking blocks of 64 weight rows and applying every
// group of 4 activation rows to the block (4 weight rows at a time) while it is in cache.
void linear_rows_int8_vnni(const float* x, int64_t m, int64_t in, const int8_t* w, const float* scale,
                           const float* bias, int64_t out, float* y) {
#ifdef PAGEDSERVE_INT8_VNNI
  const int64_t kp = (in + 63) / 64 * 64;
  thread_local std::vector<int8_t> xq_buf;
  thread_local std::vector<float> dl_buf;
  thread_local std::vector<int32_t> nc_buf;
  xq_buf.resize(std::max<int64_t>(1, m * kp));
  dl_buf.resize(std::max<int64_t>(1, m * kp / 4));
  nc_buf.resize(std::max<int64_t>(1, m * kp / 4));
  quantize_rows(x, m, in, kp, xq_buf.data(), dl_buf.data(), nc_buf.data());
  const int8_t* xq = xq_buf.data();
  const float* dl = dl_buf.data();
  const int32_t* nc = nc_buf.data();
  constexpr int64_t kRows = 4, kOutBlock = 64;
  at::parallel_for(0, out, 32, [&](int64_t begin, int64_t end) {
    float s[kRows][4];
    for (int64_t ob = begin; ob < end; ob += kOutBlock) {
      const int64_t oe = std::min(end, ob + kOutBlock);
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int mr = static_cast<int>(std::min(kRows, m - r0));
        const int8_t* xr = xq + r0 * kp;
        const float* dr = dl + r0 * (kp / 4);
        const int32_t* cr = nc + r0 * (kp / 4);
        for (int64_t o = ob; o < oe;) {
          const int nw = oe - o >= 4 ? 4 : 1;
          if (nw == 4)
            dot_tile_rows<4>(mr, w + o * in, in, kp, xr, dr, cr, s);
          else
            dot_tile_rows<1>(mr, w + o * in, in, kp, xr, dr, cr, s);
          for (int j = 0; j < nw; ++j) {
            const float b = bias ? bias[o + j] : 0.f;
            for (int r = 0; r < mr; ++r) y[(r0 + r) * out + o + j] = std::fma(s[r][j], scale[o + j], b);
          }
          o += nw;
        }
      }
    }
  });
#else
  (void)x, (void)m, (void)in, (void)w, (void)scale, (void)bias, (void)out, (void)y;
  TORCH_CHECK(false, "linear_rows_int8_vnni: this build has no AVX-512 VNNI kernel");
#endif
}

void bind_cpu_int8_gemv(pybind11::module& m) {
  m.def("int8_vnni_available", &int8_vnni_available,
        "whether this build has the AVX-512 VNNI int8 × int8 kernel for the int8 linear layers");
  m.def("int8_vnni_enabled", &int8_vnni_enabled, "whether the int8 linear layers use the VNNI kernel now");
  m.def("set_int8_vnni", &set_int8_vnni,
        "use the VNNI kernel (True) or the float path (False) for every later int8 linear; returns the previous");
}
