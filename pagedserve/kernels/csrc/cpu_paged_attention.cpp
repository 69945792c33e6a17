// Decode attention over the paged KV cache, for CPU workers.
//
// One task per (sequence, KV head, context partition): the query heads that share that KV head
// read each cached key and value exactly once, straight from its block (no gather into a padded
// copy), accumulating in float32, in a single pass over the partition's blocks (online softmax);
// a context of several partitions (over 256 tokens) is merged after (merge_partitions). Same
// function as the torch reference in kernels/torch_attention.py; tests compare the two.
// Batches of float32 decodes on the vector path run one task per sequence instead
// (decode_by_sequence): the same per-head steps, each block read whole for all KV heads.
//
// The cache is the model's dtype, or int8 rows (kernels/reference_ops.py): head_dim int8
// values and then the row's float32 scale, a row being head_dim + 4 bytes wide. An int8 key's
// scale multiplies its score after the dot product, and a value's scale its probability
// before the sum, so the loops stay the float ones with the int8 widened on load; under GQA
// a block is widened to float32 once for every query head that shares it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "cpu_balanced_for.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

inline float load(float x) { return x; }
inline float load(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float load(c10::Half x) { return static_cast<float>(x); }
inline float load(double x) { return static_cast<float>(x); }
inline float load(int8_t x) { return static_cast<float>(x); }

// The float32 scale stored after the head_dim int8 values of an int8 cache row.
inline float row_scale(const int8_t* row, int64_t head_dim) {
  float s;
  std::memcpy(&s, row + head_dim, sizeof(s));
  return s;
}

// Asks for the K and V rows of one KV head in one block (`n` rows, `stride` elements apart, each
// `row_bytes` long) to be brought into cache ahead of their use. The blocks of a sequence lie
// anywhere in the pool and a task reads a third (GQA: 1 / KV heads) of each row of a slot,
// so the hardware prefetcher does not see them coming: without this the kernel waited on
// memory for most of its time (benchmarks/attention_cost.py read K/V at 34% of the read
// bandwidth at batch 64).
template <typename C>
inline void prefetch_block(const C* kp, const C* vp, int64_t stride, int64_t n, int64_t row_bytes) {
  for (int64_t t = 0; t < n; ++t) {
    const char* kr = reinterpret_cast<const char*>(kp + t * stride);
    const char* vr = reinterpret_cast<const char*>(vp + t * stride);
    for (int64_t b = 0; b < row_bytes; b += 64) {
      __builtin_prefetch(kr + b, 0, 3);
      __builtin_prefetch(vr + b, 0, 3);
    }
  }
}

// Scores of one query head against `n` cached keys of a block: four keys at a time, so four
// independent accumulators hide the FMA latency and each query load serves four keys.
template <typename T>
inline void block_scores(const float* qg, const T* kp, int64_t token_stride, int64_t n, int64_t head_dim,
                         float* out) {
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    const T* k0 = kp + t * token_stride;
    const T* k1 = k0 + token_stride;
    const T* k2 = k1 + token_stride;
    const T* k3 = k2 + token_stride;
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
    for (int64_t i = 0; i < head_dim; ++i) {
      const float q = qg[i];
      a0 += q * load(k0[i]);
      a1 += q * load(k1[i]);
      a2 += q * load(k2[i]);
      a3 += q * load(k3[i]);
    }
    out[t] = a0;
    out[t + 1] = a1;
    out[t + 2] = a2;
    out[t + 3] = a3;
  }
  for (; t < n; ++t) {
    const T* k0 = kp + t * token_stride;
    float a0 = 0.f;
#pragma omp simd reduction(+ : a0)
    for (int64_t i = 0; i < head_dim; ++i) a0 += qg[i] * load(k0[i]);
    out[t] = a0;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// The float32 path with AVX2 + FMA (a build with AVX-512 takes the 16-lane one below): for float32 queries
// and cache and head_dim 64 or 128. The generic loops below spent most of their time on a
// horizontal sum per key and a scalar exp per score; here eight keys' dot products with one
// query are summed into one vector of eight scores, the softmax runs on those vectors, and
// each query head's output stays in registers (8 or 16 vectors) across a block's values.
// Each row's result depends only on its own sequence (batch-invariant, as before).

// e^x for x <= 0 (scores minus their running max), relative error about 2e-7: 2^(x·log2 e)
// split into 2^n · 2^f, 2^f a degree-6 polynomial on f in [-0.5, 0.5]. Below -87 it returns
// 2^-126 · (a value in [0.7, 1.4]): far under float32's precision beside a score of 1.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(1.4426950408889634f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.6931471805599453f));  // f·ln 2
  __m256 y = _mm256_set1_ps(1.3888949e-3f);
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(8.3333366e-3f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(4.1666664e-2f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.6666667e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(0.5f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.0f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// [a0..a7 each summed over its lanes]: eight dot products' partial vectors into one vector.
inline __m256 sum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 w = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u, w, 0x20), _mm256_permute2f128_ps(u, w, 0x31));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline float hsum(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// Scores of one query (already scaled) against the n <= block keys at kp, eight keys at a
// time; a last partial group of eight reads its last key again in the missing places.
template <int64_t D>
inline void scores_avx2(const float* qg, const float* kp, int64_t stride, int64_t n, float* out) {
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    const float* k[8];
    for (int64_t i = 0; i < 8; ++i) k[i] = kp + std::min(t0 + i, n - 1) * stride;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t j = 0; j < D; j += 8) {
      const __m256 q = _mm256_loadu_ps(qg + j);
      a0 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k[0] + j), a0);
      a1 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k[1] + j), a1);
      a2 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k[2] + j), a2);
      a3 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k[3] + j), a3);
      a4 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k[4] + j), a4);
      a5 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k[5] + j), a5);
      a6 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k[6] + j), a6);
      a7 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k[7] + j), a7);
    }
    _mm256_storeu_ps(out + t0, sum8(a0, a1, a2, a3, a4, a5, a6, a7));
  }
}

// acc[D] = acc·rescale + Σ_t p[t]·v_t over the block's n values, acc held in registers.
template <int64_t D>
inline void values_avx2(const float* p, const float* vp, int64_t stride, int64_t n, float rescale, float* acc) {
  constexpr int64_t V = D / 8;
  __m256 a[V];
  const __m256 r = _mm256_set1_ps(rescale);
  for (int64_t j = 0; j < V; ++j) a[j] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * j), r);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 pt = _mm256_set1_ps(p[t]);
    const float* v = vp + t * stride;
    for (int64_t j = 0; j < V; ++j) a[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8 * j), a[j]);
  }
  for (int64_t j = 0; j < V; ++j) _mm256_storeu_ps(acc + 8 * j, a[j]);
}

// One block of n rows of a float32 cache for the `group` query rows of one KV head: the
// online-softmax step of the generic attend_block below, on vectors. qf, acc: `group` rows
// of D; mx, sum: one per row; probs: `group` rows of `padded` (the block rounded up to 16).
template <int64_t D>
void attend_block_avx2(const float* qf, const float* kp, const float* vp, int64_t stride, int64_t n, bool first,
                       int64_t group, int64_t padded, float* probs, float* acc, float* mx, float* sum) {
  for (int64_t g = 0; g < group; ++g) {
    float* pg = probs + g * padded;
    scores_avx2<D>(qf + g * D, kp, stride, n, pg);
    const int64_t full = n / 8 * 8;
    __m256 vmax = _mm256_set1_ps(pg[0]);
    for (int64_t t = 0; t < full; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(pg + t));
    float block_max = hmax(vmax);
    for (int64_t t = full; t < n; ++t) block_max = std::max(block_max, pg[t]);
    const float new_max = first ? block_max : std::max(mx[g], block_max);
    const float rescale = first ? 0.f : std::exp(mx[g] - new_max);
    const __m256 m = _mm256_set1_ps(new_max);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; t += 8) {  // the lanes past n are zeroed
      __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(pg + t), m));
      if (t + 8 > n) {
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - t)), lane)));
      }
      _mm256_storeu_ps(pg + t, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    sum[g] = sum[g] * rescale + hsum(vsum);
    mx[g] = new_max;
    values_avx2<D>(pg, vp, stride, n, rescale, acc + g * D);
  }
}

using VectorBlockFn = void (*)(const float*, const float*, const float*, int64_t, int64_t, bool, int64_t, int64_t,
                               float*, float*, float*, float*);

// The AVX-512 step below where the build has it; false: the AVX2 one (tests run both).
bool use_avx512_attention = true;

#if defined(__AVX512F__)
// The same block step on AVX-512 (a -march=native build on a CPU with it): sixteen keys'
// scores a pass and 16-lane softmax and value sums. The AVX2 path was compute-bound on an
// Intel Xeon: it read K/V at 8.0-8.9 GB/s on one thread whether they came from memory or
// from L3 (against 14.3 GB/s of plain read bandwidth), its FMAs 8 lanes wide.

// e^x for x <= 0 as exp_nonpositive above, on 16 lanes; 2^n applied by `vscalefps`.
inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));  // f·ln 2
  __m512 y = _mm512_set1_ps(1.3888949e-3f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(8.3333366e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(4.1666664e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.6666667e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.5f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// [a0..a15 each summed over its lanes]: sixteen dot products' partial vectors into one
// vector, by halving: each pair of keys' 512-bit halves added (8 vectors of 2 keys × 8 lanes),
// then their 128-bit quarters (4 vectors of 4 keys × 4), then within the quarters; the last
// step leaves key 4i + k at lane 4k + i, which one permutation puts back in order.
inline __m512 sum16(const __m512 a[16]) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  const __m512 d01 = _mm512_add_ps(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
  const __m512 d23 = _mm512_add_ps(_mm512_unpacklo_ps(c[2], c[3]), _mm512_unpackhi_ps(c[2], c[3]));
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(d01, d23, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(d01, d23, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, f);
}

// Scores of one query against the n <= block keys at kp, sixteen at a time (a last partial
// group reads its last key again in the missing places).
template <int64_t D>
inline void scores_avx512(const float* qg, const float* kp, int64_t stride, int64_t n, float* out) {
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const float* k[16];
    for (int64_t i = 0; i < 16; ++i) k[i] = kp + std::min(t0 + i, n - 1) * stride;
    __m512 a[16];
    for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < D; j += 16) {
      const __m512 q = _mm512_loadu_ps(qg + j);
      for (int i = 0; i < 16; ++i) a[i] = _mm512_fmadd_ps(q, _mm512_loadu_ps(k[i] + j), a[i]);
    }
    _mm512_storeu_ps(out + t0, sum16(a));
  }
}

template <int64_t D>
inline void values_avx512(const float* p, const float* vp, int64_t stride, int64_t n, float rescale, float* acc) {
  constexpr int64_t V = D / 16;
  __m512 a[V];
  const __m512 r = _mm512_set1_ps(rescale);
  for (int64_t j = 0; j < V; ++j) a[j] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * j), r);
  for (int64_t t = 0; t < n; ++t) {
    const __m512 pt = _mm512_set1_ps(p[t]);
    const float* v = vp + t * stride;
    for (int64_t j = 0; j < V; ++j) a[j] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + 16 * j), a[j]);
  }
  for (int64_t j = 0; j < V; ++j) _mm512_storeu_ps(acc + 16 * j, a[j]);
}

// attend_block_avx2 on 16 lanes; `padded` is the block rounded up to 16 here.
template <int64_t D>
void attend_block_avx512(const float* qf, const float* kp, const float* vp, int64_t stride, int64_t n, bool first,
                         int64_t group, int64_t padded, float* probs, float* acc, float* mx, float* sum) {
  for (int64_t g = 0; g < group; ++g) {
    float* pg = probs + g * padded;
    scores_avx512<D>(qf + g * D, kp, stride, n, pg);
    const __mmask16 last = static_cast<__mmask16>((1u << (n - (n - 1) / 16 * 16)) - 1);  // the lanes < n of the last 16
    const int64_t tail = (n - 1) / 16 * 16;
    __m512 vmax = _mm512_mask_loadu_ps(_mm512_set1_ps(pg[0]), last, pg + tail);
    for (int64_t t = 0; t < tail; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(pg + t));
    const float block_max = _mm512_reduce_max_ps(vmax);
    const float new_max = first ? block_max : std::max(mx[g], block_max);
    const float rescale = first ? 0.f : std::exp(mx[g] - new_max);
    const __m512 m = _mm512_set1_ps(new_max);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {  // the lanes past n are zeroed
      __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(pg + t), m));
      if (t == tail) e = _mm512_maskz_mov_ps(last, e);
      _mm512_storeu_ps(pg + t, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    sum[g] = sum[g] * rescale + _mm512_reduce_add_ps(vsum);
    mx[g] = new_max;
    values_avx512<D>(pg, vp, stride, n, rescale, acc + g * D);
  }
}
#endif
#endif

// Context partitions. A sequence's context is cut into partitions of kPartitionTokens (rounded
// to whole blocks); each partition runs the online softmax on its own, from zero, and a
// context of several partitions ends with merge_partitions. The cut depends on the context
// length and the block size only, never on the batch or the threads, so a row's bits do not
// depend on either; a context of one partition (up to 256 tokens with blocks of 16) gives the
// bits it gave before partitions existed. Why: a task per (sequence, KV head) leaves one
// decode's attention to as many threads as the model has KV heads (3 for the default model),
// so at batch 1 on 2 threads one thread read two heads while the other read one, and on 16
// cores 13 sat idle; partitions give a long context more tasks than threads.
constexpr int64_t kPartitionTokens = 256;
// The tokens of one partition: whole blocks, at least one.
inline int64_t partition_tokens(int64_t block_size) {
  return std::max<int64_t>(1, kPartitionTokens / block_size) * block_size;
}
inline int64_t num_partitions(int64_t len, int64_t block_size) {
  const int64_t per = partition_tokens(block_size);
  return len <= per ? 1 : (len + per - 1) / per;
}

// out[g, :] for the query heads g < group of one (sequence, KV head) from its `parts`
// partitions' maxima m[part][g], sums l[part][g] and unnormalized outputs acc[part][g][head_dim]
// (m_stride floats between partitions in m and l, acc_stride in acc): the partitions rescaled to
// the largest maximum and added in order, then normalized.
template <typename T>
void merge_partitions(const float* m, const float* l, const float* acc, int64_t parts, int64_t group,
                      int64_t head_dim, int64_t m_stride, int64_t acc_stride, T* out) {
  std::vector<float> weight(parts), o(head_dim);
  for (int64_t g = 0; g < group; ++g) {
    float top = m[g];
    for (int64_t i = 1; i < parts; ++i) top = std::max(top, m[i * m_stride + g]);
    float total = 0.f;
    for (int64_t i = 0; i < parts; ++i) {
      weight[i] = std::exp(m[i * m_stride + g] - top);
      total += l[i * m_stride + g] * weight[i];
    }
    std::fill(o.begin(), o.end(), 0.f);
    for (int64_t i = 0; i < parts; ++i) {
      const float* a = acc + i * acc_stride + g * head_dim;
      const float w = weight[i];
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) o[d] += a[d] * w;
    }
    const float inv = 1.f / total;
    T* op = out + g * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) op[d] = static_cast<T>(o[d] * inv);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// From this many sequences per thread a float32 decode on the vector path runs one task per
// sequence (decode_by_sequence) instead of one per (sequence, KV head, partition).
constexpr int64_t kSequenceTasksPerThread = 4;

// The vector path with one task per sequence, for batches: a block's rows hold every KV head, so
// a task that takes each block for all its KV heads reads the block's K and V as two contiguous
// runs (block_size × KV heads × head_dim floats each), not KV-heads-many strided thirds, and
// can ask for them ahead: each task prefetches the block after the one it reads, and at its
// last block the first block of the thread's next sequence, into L2 (into L1 the current and
// the next block would not fit: 2 × 12 KB each for the default model). The sequences are split
// across the threads balanced (cpu_balanced_for.h): a batch's contexts differ in length, and a
// thread done with its share takes sequences from the back of the other's. Each head's online softmax
// sees its blocks in the same order as in decode_attention's per-head tasks: the same bits.
// benchmarks/attention_cost.py (batch 64, context 160, 30 layers, 472 MB), 2 threads, AMD EPYC
// Zen 4, alternated in one process, median of 12: 29.4 ms (16.0 GB/s, 0.52 of the read
// bandwidth) against 37.7 ms per (sequence, KV head) (12.5 GB/s); the next block into L1
// instead: 33.0 ms; no prefetch: 40.5 ms; 2 to 4 blocks ahead: as 1 (measured with the static
// split and a cursor over the thread's range, before the balanced split).
void decode_by_sequence(VectorBlockFn vector_block, const float* q, const float* k_cache, const float* v_cache,
                        const int32_t* block_tables, const int32_t* seq_lens, float* out, int64_t num_seqs,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                        int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride, padded = (block_size + 15) / 16 * 16;
  const int64_t per_part = partition_tokens(block_size);
  // block j of sequence s (every KV head) into L2, if the sequence has it; returns its K's
  // address (null: none)
  auto prefetch = [&](int64_t s, int64_t j) -> const float* {
    const int64_t len = seq_lens[s], first = j * block_size;
    if (first >= len) return nullptr;
    const int64_t at = block_tables[s * max_blocks + j] * block_stride;
    const int64_t bytes = std::min(block_size, len - first) * token_stride * static_cast<int64_t>(sizeof(float));
    const char* kp = reinterpret_cast<const char*>(k_cache + at);
    const char* vp = reinterpret_cast<const char*>(v_cache + at);
    for (int64_t b = 0; b < bytes; b += 64) {
      _mm_prefetch(kp + b, _MM_HINT_T1);
      _mm_prefetch(vp + b, _MM_HINT_T1);
    }
    return k_cache + at;
  };
  // a sequence a task, balanced across the threads (cpu_balanced_for.h); each task asks for
  // its next block while it works on one, and at its last block for the first block of the
  // sequence the thread will likely take next
  pagedserve_balanced::balanced_for(num_seqs, [&](int64_t s, int64_t next_s) {
    thread_local std::vector<float> qf, acc, probs, mx, sum, part_m, part_l, part_acc;
    thread_local const float* asked = nullptr;  // the first block this thread asked for last (its K)
    qf.resize(num_heads * head_dim);
    acc.resize(num_heads * head_dim);
    probs.resize(group * padded);
    mx.resize(num_heads);
    sum.resize(num_heads);
    const int64_t len = seq_lens[s], parts = num_partitions(len, block_size);
    if (len > 0 && asked != k_cache + block_tables[s * max_blocks] * block_stride) prefetch(s, 0);
    // the finished partitions of a long context: maxima and sums [part][num_heads], outputs
    // [part][num_heads][head_dim] (merge_partitions)
    if (parts > 1) {
      part_m.resize(parts * num_heads);
      part_l.resize(parts * num_heads);
      part_acc.resize(parts * num_heads * head_dim);
    }
    for (int64_t i = 0; i < num_heads * head_dim; ++i) qf[i] = q[s * num_heads * head_dim + i] * scale;
    for (int64_t part = 0; part < parts; ++part) {
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(sum.begin(), sum.end(), 0.f);
      const int64_t part_end = std::min(len, (part + 1) * per_part);
      for (int64_t start = part * per_part; start < part_end; start += block_size) {
        if (start + block_size < len) {
          prefetch(s, start / block_size + 1);
        } else if (next_s >= 0) {
          asked = prefetch(next_s, 0);
        }
        const int64_t at = block_tables[s * max_blocks + start / block_size] * block_stride;
        for (int64_t h = 0; h < num_kv_heads; ++h)
          vector_block(qf.data() + h * group * head_dim, k_cache + at + h * head_dim, v_cache + at + h * head_dim,
                       token_stride, std::min(block_size, part_end - start), start == part * per_part, group, padded,
                       probs.data(), acc.data() + h * group * head_dim, mx.data() + h * group, sum.data() + h * group);
      }
      if (parts > 1) {
        std::copy(mx.begin(), mx.end(), part_m.begin() + part * num_heads);
        std::copy(sum.begin(), sum.end(), part_l.begin() + part * num_heads);
        std::copy(acc.begin(), acc.end(), part_acc.begin() + part * num_heads * head_dim);
      }
    }
    if (parts > 1) {
      // each KV head's query heads, as decode_attention's tasks merge them
      for (int64_t h = 0; h < num_kv_heads; ++h)
        merge_partitions(part_m.data() + h * group, part_l.data() + h * group, part_acc.data() + h * group * head_dim,
                         parts, group, head_dim, num_heads, num_heads * head_dim,
                         out + (s * num_heads + h * group) * head_dim);
      return;
    }
    for (int64_t g = 0; g < num_heads; ++g) {
      float* op = out + (s * num_heads + g) * head_dim;
      const float inv = len > 0 ? 1.f / sum[g] : 0.f;
      for (int64_t i = 0; i < head_dim; ++i) op[i] = acc[g * head_dim + i] * inv;
    }
  });
}
#endif

// One pass over the context, a block at a time, with an online softmax: each block's keys
// and values are read once, while they are in L1, for every query head of the group.
// T: the query's and output's type; C: the cache's (T, or int8 rows of `width` bytes).
// An int8 block shared by several query heads (GQA) is first widened to float32 with its
// scales applied, so each row is converted once, not once per query head; with one query
// head per KV head the rows are read as int8, and the scales multiply the scores and the
// probabilities instead.
template <typename T, typename C>
void decode_attention(const T* q, const C* k_cache, const C* v_cache, const int32_t* block_tables,
                      const int32_t* seq_lens, T* out, int64_t num_seqs, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t width, int64_t block_size, int64_t max_blocks,
                      float scale) {
  constexpr bool kInt8 = std::is_same_v<C, int8_t>;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * width;  // between positions in a block
  const int64_t block_stride = block_size * token_stride;
  const bool widen = kInt8 && group > 1;
  const int64_t padded = (block_size + 15) / 16 * 16;  // a row of probs (the vector paths' rows of 8 or 16)
#if defined(__AVX2__) && defined(__FMA__)
  // the vector path: float32 queries and cache, head_dim 64 or 128
  VectorBlockFn vector_block = nullptr;
  if constexpr (std::is_same_v<T, float> && std::is_same_v<C, float>) {
    vector_block = head_dim == 64 ? attend_block_avx2<64> : head_dim == 128 ? attend_block_avx2<128> : nullptr;
#if defined(__AVX512F__)
    if (use_avx512_attention)
      vector_block = head_dim == 64 ? attend_block_avx512<64> : head_dim == 128 ? attend_block_avx512<128> : nullptr;
#endif
    if (vector_block && num_seqs >= kSequenceTasksPerThread * at::get_num_threads())
      return decode_by_sequence(vector_block, q, k_cache, v_cache, block_tables, seq_lens, out, num_seqs, num_heads,
                                num_kv_heads, head_dim, block_size, max_blocks, scale);
  }
#endif
  // the work units: (sequence, partition), a sequence's partitions in order; a task is a unit's
  // KV head. Partials of the sequences of several partitions, per unit: maxima and sums
  // [num_heads], outputs [num_heads][head_dim] (merge_partitions, after the tasks).
  const int64_t per_part = partition_tokens(block_size);
  std::vector<int64_t> unit_seq, first_unit(num_seqs + 1);
  unit_seq.reserve(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) {
    first_unit[s] = static_cast<int64_t>(unit_seq.size());
    unit_seq.insert(unit_seq.end(), num_partitions(seq_lens[s], block_size), s);
  }
  first_unit[num_seqs] = static_cast<int64_t>(unit_seq.size());
  const int64_t units = first_unit[num_seqs];
  const bool split = units > num_seqs;
  std::vector<float> part_m(split ? units * num_heads : 0), part_l(split ? units * num_heads : 0),
      part_acc(split ? units * num_heads * head_dim : 0);
  at::parallel_for(0, units * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), probs(group * padded), mx(group), sum(group);
    std::vector<float> k_scale(kInt8 ? block_size : 0), v_scale(kInt8 ? block_size : 0);
    std::vector<float> kf(widen ? block_size * head_dim : 0), vf(widen ? block_size * head_dim : 0);
    // One block of n rows, `stride` elements apart; ks/vs: the int8 rows' scales (null: none).
    auto attend_block = [&](const auto* kp, const auto* vp, int64_t stride, const float* ks, const float* vs,
                            int64_t n, bool first) {
      for (int64_t g = 0; g < group; ++g) {
        float* pg = probs.data() + g * block_size;
        block_scores(qf.data() + g * head_dim, kp, stride, n, head_dim, pg);
        if (ks)
          for (int64_t t = 0; t < n; ++t) pg[t] *= ks[t];
        float block_max = pg[0];
        for (int64_t t = 1; t < n; ++t) block_max = std::max(block_max, pg[t]);
        // no infinities: the build uses -ffast-math, which assumes there are none
        const float new_max = first ? block_max : std::max(mx[g], block_max);
        const float rescale = first ? 0.f : std::exp(mx[g] - new_max);
        float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
        for (int64_t t = 0; t < n; ++t) {
          pg[t] = std::exp(pg[t] - new_max);
          block_sum += pg[t];
        }
        sum[g] = sum[g] * rescale + block_sum;
        mx[g] = new_max;
        if (vs)  // the value's scale rides on its probability (the sum is taken)
          for (int64_t t = 0; t < n; ++t) pg[t] *= vs[t];
        float* ag = acc.data() + g * head_dim;
        if (rescale != 1.f) {
#pragma omp simd
          for (int64_t i = 0; i < head_dim; ++i) ag[i] *= rescale;
        }
      }
      // four values per pass: one load and store of the accumulator per four FMAs
      int64_t t = 0;
      for (; t + 4 <= n; t += 4) {
        const auto* v0 = vp + t * stride;
        const auto* v1 = v0 + stride;
        const auto* v2 = v1 + stride;
        const auto* v3 = v2 + stride;
        for (int64_t g = 0; g < group; ++g) {
          const float* pg = probs.data() + g * block_size + t;
          const float p0 = pg[0], p1 = pg[1], p2 = pg[2], p3 = pg[3];
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t i = 0; i < head_dim; ++i)
            ag[i] += p0 * load(v0[i]) + p1 * load(v1[i]) + p2 * load(v2[i]) + p3 * load(v3[i]);
        }
      }
      for (; t < n; ++t) {
        const auto* vt = vp + t * stride;
        for (int64_t g = 0; g < group; ++g) {
          const float p = probs[g * block_size + t];
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t i = 0; i < head_dim; ++i) ag[i] += p * load(vt[i]);
        }
      }
    };
    const int64_t row_bytes = kInt8 ? width : head_dim * static_cast<int64_t>(sizeof(C));
    // the first block of a task: the previous task asked for it (the first task asks itself)
    auto prefetch_first = [&](int64_t task) {
      const int64_t unit = task / num_kv_heads, h = task % num_kv_heads, s = unit_seq[unit];
      const int64_t start = (unit - first_unit[s]) * per_part;
      if (seq_lens[s] <= start) return;
      const int64_t offset = block_tables[s * max_blocks + start / block_size] * block_stride + h * width;
      prefetch_block(k_cache + offset, v_cache + offset, token_stride,
                     std::min<int64_t>(block_size, seq_lens[s] - start), row_bytes);
    };
    if (begin < end) prefetch_first(begin);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t unit = task / num_kv_heads, h = task % num_kv_heads, s = unit_seq[unit];
      const int64_t parts = first_unit[s + 1] - first_unit[s], part_start = (unit - first_unit[s]) * per_part;
      const int64_t len = std::min<int64_t>(seq_lens[s], part_start + per_part);  // this partition's end
      const int32_t* table = block_tables + s * max_blocks;
      for (int64_t g = 0; g < group; ++g) {
        const T* qp = q + (s * num_heads + h * group + g) * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) qf[g * head_dim + i] = load(qp[i]) * scale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t start = part_start; start < len; start += block_size) {
        const int64_t n = std::min(block_size, len - start);
        const int64_t offset = table[start / block_size] * block_stride + h * width;
        const C* kp = k_cache + offset;
        const C* vp = v_cache + offset;
        if (start + block_size < len) {  // the next block, while this one is worked on
          const int64_t next = table[start / block_size + 1] * block_stride + h * width;
          prefetch_block(k_cache + next, v_cache + next, token_stride,
                         std::min(block_size, len - start - block_size), row_bytes);
        } else if (task + 1 < end) {
          prefetch_first(task + 1);
        }
        if constexpr (kInt8) {
          for (int64_t t = 0; t < n; ++t) {
            k_scale[t] = row_scale(kp + t * token_stride, head_dim);
            v_scale[t] = row_scale(vp + t * token_stride, head_dim);
          }
          if (widen) {
            for (int64_t t = 0; t < n; ++t) {
              const int8_t* kr = kp + t * token_stride;
              const int8_t* vr = vp + t * token_stride;
              float* kd = kf.data() + t * head_dim;
              float* vd = vf.data() + t * head_dim;
              const float ksc = k_scale[t], vsc = v_scale[t];
#pragma omp simd
              for (int64_t i = 0; i < head_dim; ++i) {
                kd[i] = load(kr[i]) * ksc;
                vd[i] = load(vr[i]) * vsc;
              }
            }
            attend_block(kf.data(), vf.data(), head_dim, nullptr, nullptr, n, start == part_start);
          } else {
            attend_block(kp, vp, token_stride, k_scale.data(), v_scale.data(), n, start == part_start);
          }
        } else {
#if defined(__AVX2__) && defined(__FMA__)
          if constexpr (std::is_same_v<C, float>) {
            if (vector_block) {
              vector_block(qf.data(), kp, vp, token_stride, n, start == part_start, group, padded, probs.data(), acc.data(),
                           mx.data(), sum.data());
              continue;
            }
          }
#endif
          attend_block(kp, vp, token_stride, nullptr, nullptr, n, start == part_start);
        }
      }
      if (parts > 1) {  // a partial, merged below
        const int64_t at = unit * num_heads + h * group;
        std::copy(mx.begin(), mx.end(), part_m.begin() + at);
        std::copy(sum.begin(), sum.end(), part_l.begin() + at);
        std::copy(acc.begin(), acc.end(), part_acc.begin() + at * head_dim);
        continue;
      }
      for (int64_t g = 0; g < group; ++g) {
        T* op = out + (s * num_heads + h * group + g) * head_dim;
        const float inv = len > 0 ? 1.f / sum[g] : 0.f;
        for (int64_t i = 0; i < head_dim; ++i) op[i] = static_cast<T>(acc[g * head_dim + i] * inv);
      }
    }
  });
  if (!split) return;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / num_kv_heads, h = task % num_kv_heads, parts = first_unit[s + 1] - first_unit[s];
      if (parts == 1) continue;
      const int64_t at = first_unit[s] * num_heads + h * group;
      merge_partitions(part_m.data() + at, part_l.data() + at, part_acc.data() + at * head_dim, parts, group, head_dim,
                       num_heads, num_heads * head_dim, out + (s * num_heads + h * group) * head_dim);
    }
  });
}

// ---- prefill attention ----
// Prefill chunks over the paged float32 cache, which holds their own K/V already, so a chunk
// with cached context and a fresh one are the same case: sequence s has rows query_starts[s]
// .. query_starts[s + 1] - 1 of q, at the positions that end at seq_lens[s], and the row at
// position p attends to keys 0..p.
//
// Rows in the vector lanes. One task holds kTaskRows rows of one KV head (its query heads ×
// as many positions as fit, the last lanes repeating the last row where they are fewer) and
// walks the keys once for all of them. For each kKeyTile keys: scores St[key][row] = Σ_d Qt[d][row] ·
// K[key][d] (the queries transposed once per task, each key's element broadcast), the causal
// mask and an online softmax lane by lane (no horizontal sums anywhere), then Ot[d][row] =
// Ot[d][row] · rescale + Σ_key p[key][row] · V[key][d]. Each row depends on its own sequence
// only (batch-invariant).
//
// kKeyTile is 128: each tile loads, rescales and stores Ot and runs the softmax's passes once,
// so wider tiles spread that over more keys. One thread, the default model's heads (9 query, 3
// KV, head_dim 64) and one fresh 2048-token prompt, Intel Xeon (AVX-512): 16 keys 65, 64 keys
// 100, 128 keys 101 GFLOP/s (head_dim 128: 64, 95, 101); the 8-float (AVX2) build 34, 52, 54.
//
// GCC's vector extensions, so one source builds for AVX-512 and AVX2 (and other CPUs): vectors
// of 16 floats with AVX-512 (one zmm), of 8 elsewhere (one ymm with AVX2; GCC lowered 16-float
// vectors without AVX-512 through memory, ten times slower). Register tiles: 4 row vectors ×
// 4 keys (scores) or × 4 dimensions (values) in AVX-512's 32 registers, 6 × 2 in AVX2's 16
// (12 accumulators: 4 × 2 ran 15-20% slower).
// The backend calls it on AVX-512 and AVX2 builds (prefill_attention_supported). An AVX2 build
// run on an Intel Xeon against torch's SDPA with MKL and oneDNN held to AVX2, attention of one
// fresh prompt in the engine, 2 threads: 1024 tokens 305-313 against 406-409 ms, 2048 tokens
// 1157-1199 against 1315-1317 (with 4 × 2 tiles and no register hint it had lost at 2048).
#if defined(__AVX512F__)
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
constexpr int kRowVecs = 4, kAtOnce = 4;
#else
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
constexpr int kRowVecs = 6, kAtOnce = 2;
#endif
// A vector kept in a register, on AVX2 builds: without this GCC folded the same row vector's
// load into each of its kAtOnce FMAs, twice the loads (a standalone copy, one thread, 2048
// tokens: 4 × 2 tiles 50.3 GFLOP/s without it, 55.2 with it; 6 × 2 with it 56-66). AVX-512
// builds do without it: no gain measured there.
#if !defined(__AVX512F__) && defined(__AVX__)
#define PSI_IN_REGISTER(x) __asm__("" : "+x"(x))
#else
#define PSI_IN_REGISTER(x) (void)0
#endif
constexpr int64_t kLanes = sizeof(vf) / sizeof(float), kTaskRows = kLanes * kRowVecs, kKeyTile = 128;

inline vf splat(float x) { return vf{} + x; }

// e^x for x <= 0 (relative error about 2e-7), as exp_nonpositive: 2^(x·log2 e) = 2^n · 2^f,
// n = trunc(t - 0.5) (t <= 0, so f in (-0.5, 0.5]), 2^f a degree-6 polynomial.
inline vf exp_nonpositive_v(vf x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  const vf t = x * 1.4426950408889634f;
  const vi ni = __builtin_convertvector(t - 0.5f, vi);
  const vf f = (t - __builtin_convertvector(ni, vf)) * 0.6931471805599453f;
  vf y = splat(1.3888949e-3f);
  y = y * f + 8.3333366e-3f;
  y = y * f + 4.1666664e-2f;
  y = y * f + 1.6666667e-1f;
  y = y * f + 0.5f;
  y = y * f + 1.0f;
  y = y * f + 1.0f;
  const vi bits = (ni + 127) << 23;
  return y * reinterpret_cast<const vf&>(bits);
}

template <int64_t D>
void prefill_task(const float* q, int64_t q_row_stride, const float* k_cache, const float* v_cache,
                  const int32_t* table, int64_t token_stride, int64_t block_size, int64_t head, int64_t group,
                  int64_t first_row, int64_t first_pos, int64_t positions, float scale, float* out, int64_t num_heads) {
  alignas(64) float qt[D][kTaskRows], ot[D][kTaskRows], st[kKeyTile][kTaskRows];
  alignas(64) int32_t pos[kTaskRows];
  const int64_t rows = positions * group;
  for (int64_t r = 0; r < kTaskRows; ++r) {
    const int64_t rr = std::min(r, rows - 1), j = rr / group, g = rr % group;
    pos[r] = static_cast<int32_t>(first_pos + j);
    const float* qp = q + (first_row + j) * q_row_stride + (head * group + g) * D;
    for (int64_t d = 0; d < D; ++d) qt[d][r] = qp[d] * scale;
  }
  std::memset(ot, 0, sizeof(ot));
  vf m[kRowVecs], l[kRowVecs];
  vi pv[kRowVecs];
  for (int64_t v = 0; v < kRowVecs; ++v) {
    m[v] = splat(-1e30f);
    l[v] = splat(0.f);
    std::memcpy(&pv[v], pos + v * kLanes, sizeof(vi));
  }
  const int64_t last_pos = first_pos + positions - 1;
  for (int64_t start = 0; start <= last_pos; start += kKeyTile) {
    const int64_t n = std::min(kKeyTile, last_pos + 1 - start);  // keys start .. start + n - 1
    const float* kr[kKeyTile];
    const float* vr[kKeyTile];
    for (int64_t t = 0; t < n; ++t) {
      const int64_t key = start + t, at = table[key / block_size] * block_size + key % block_size;
      kr[t] = k_cache + at * token_stride + head * D;
      vr[t] = v_cache + at * token_stride + head * D;
    }
    // scores, kAtOnce keys × kRowVecs row vectors at a time
    for (int64_t t0 = 0; t0 < n; t0 += kAtOnce) {
      vf acc[kAtOnce][kRowVecs];
      const float* kk[kAtOnce];
      for (int a = 0; a < kAtOnce; ++a) {
        kk[a] = kr[std::min<int64_t>(t0 + a, n - 1)];
        for (int v = 0; v < kRowVecs; ++v) acc[a][v] = splat(0.f);
      }
      for (int64_t d = 0; d < D; ++d) {
        vf b[kAtOnce];
        for (int a = 0; a < kAtOnce; ++a) b[a] = splat(kk[a][d]);
        for (int v = 0; v < kRowVecs; ++v) {
          vf qv;
          std::memcpy(&qv, &qt[d][v * kLanes], sizeof(qv));
          PSI_IN_REGISTER(qv);
          for (int a = 0; a < kAtOnce; ++a) acc[a][v] += qv * b[a];
        }
      }
      for (int a = 0; a < kAtOnce && t0 + a < n; ++a)
        for (int v = 0; v < kRowVecs; ++v) std::memcpy(&st[t0 + a][v * kLanes], &acc[a][v], sizeof(vf));
    }
    // the causal mask, the online softmax: probabilities into st, each row vector's rescale
    vf rescale[kRowVecs];
    for (int v = 0; v < kRowVecs; ++v) {
      vf bm = splat(-1e30f);
      for (int64_t t = 0; t < n; ++t) {
        vf sv;
        std::memcpy(&sv, &st[t][v * kLanes], sizeof(sv));
        bm = (pv[v] >= static_cast<int32_t>(start + t)) & (sv > bm) ? sv : bm;
      }
      const vf mn = bm > m[v] ? bm : m[v];
      rescale[v] = exp_nonpositive_v(m[v] - mn);
      vf sum = splat(0.f);
      for (int64_t t = 0; t < n; ++t) {
        vf sv;
        std::memcpy(&sv, &st[t][v * kLanes], sizeof(sv));
        const vf e = exp_nonpositive_v(sv - mn);
        const vf p = pv[v] >= static_cast<int32_t>(start + t) ? e : splat(0.f);
        std::memcpy(&st[t][v * kLanes], &p, sizeof(p));
        sum += p;
      }
      l[v] = l[v] * rescale[v] + sum;
      m[v] = mn;
    }
    // values, kAtOnce dimensions × kRowVecs row vectors at a time
    for (int64_t d0 = 0; d0 < D; d0 += kAtOnce) {
      vf acc[kAtOnce][kRowVecs];
      for (int a = 0; a < kAtOnce; ++a)
        for (int v = 0; v < kRowVecs; ++v) {
          std::memcpy(&acc[a][v], &ot[d0 + a][v * kLanes], sizeof(vf));
          acc[a][v] *= rescale[v];
        }
      for (int64_t t = 0; t < n; ++t) {
        vf b[kAtOnce];
        for (int a = 0; a < kAtOnce; ++a) b[a] = splat(vr[t][d0 + a]);
        for (int v = 0; v < kRowVecs; ++v) {
          vf p;
          std::memcpy(&p, &st[t][v * kLanes], sizeof(p));
          PSI_IN_REGISTER(p);
          for (int a = 0; a < kAtOnce; ++a) acc[a][v] += p * b[a];
        }
      }
      for (int a = 0; a < kAtOnce; ++a)
        for (int v = 0; v < kRowVecs; ++v) std::memcpy(&ot[d0 + a][v * kLanes], &acc[a][v], sizeof(vf));
    }
  }
  alignas(64) float inv[kTaskRows];
  for (int v = 0; v < kRowVecs; ++v) {
    const vf iv = 1.0f / l[v];
    std::memcpy(inv + v * kLanes, &iv, sizeof(iv));
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* op = out + ((first_row + r / group) * num_heads + head * group + r % group) * D;
    for (int64_t d = 0; d < D; ++d) op[d] = ot[d][r] * inv[r];
  }
}

void prefill_attention_f32(const float* q, int64_t q_row_stride, const float* k_cache, const float* v_cache,
                           const int32_t* block_tables, const int32_t* seq_lens, const int32_t* query_starts,
                           float* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t per_task = std::max<int64_t>(1, kTaskRows / group);  // positions a task holds
  struct Task {
    int64_t seq, head, first_row, positions, first_pos, cost;
  };
  std::vector<Task> tasks;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = query_starts[s + 1] - query_starts[s], first_pos = seq_lens[s] - q_len;
    for (int64_t c = 0; c < q_len; c += per_task)
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t n = std::min(per_task, q_len - c);
        tasks.push_back({s, h, query_starts[s] + c, n, first_pos + c, first_pos + c + n});
      }
  }
  // the costliest first (the last rows of a long prompt read the most keys), each thread
  // taking the next task left
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  const int64_t token_stride = num_kv_heads * head_dim;
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < static_cast<int64_t>(tasks.size()); i = next++) {
      const Task& t = tasks[i];
      auto run = head_dim == 64 ? prefill_task<64> : prefill_task<128>;
      run(q, q_row_stride, k_cache, v_cache, block_tables + t.seq * max_blocks, token_stride, block_size, t.head,
          group, t.first_row, t.first_pos, t.positions, scale, out, num_heads);
    }
  });
}

}  // namespace

// One int8 KV cache row from n floats, exactly as kernels/reference_ops.quantize_kv_rows:
// scale = max|x| / 127, round-half-even(x / scale) in [-127, 127] (all 0 when the scale is 0),
// then the scale's 4 bytes. Compiled without -ffast-math, which would turn the divisions into
// products by a reciprocal and round some values the other way than the reference.
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
void quantize_kv_row_int8(const float* x, int64_t n, int8_t* row) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax / 127.f;
  if (scale > 0.f) {
    for (int64_t i = 0; i < n; ++i)
      row[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[i] / scale))));
  } else {
    std::memset(row, 0, n);
  }
  std::memcpy(row + n, &scale, sizeof(scale));
}
#pragma GCC pop_options

// key, value float32 [n, num_kv_heads, head_dim] → int8 rows at slots[i] of k_cache, v_cache
// [num_blocks, block_size, num_kv_heads, head_dim + 4] (what kv_store_ref does, in one pass
// instead of a dozen torch ops per layer).
void store_kv_int8(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor slots) {
  TORCH_CHECK(key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat, "store_kv_int8: float32 K/V");
  TORCH_CHECK(k_cache.scalar_type() == at::kChar && v_cache.scalar_type() == at::kChar && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "store_kv_int8: contiguous int8 caches [blocks, block_size, kv_heads, head_dim + 4]");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.size(1) == k_cache.size(2) &&
                  k_cache.size(3) == key.size(2) + 4, "store_kv_int8: K/V [n, kv_heads, head_dim] for these rows");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == key.size(0),
              "store_kv_int8: one int64 slot per row");
  auto kc = key.contiguous();
  auto vc = value.contiguous();
  auto sc = slots.contiguous();
  const int64_t n = kc.size(0), heads = kc.size(1), head_dim = kc.size(2), width = head_dim + 4;
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = sc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "store_kv_int8: slot beyond the cache");
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  int8_t* kd = k_cache.data_ptr<int8_t>();
  int8_t* vd = v_cache.data_ptr<int8_t>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t src = (i * heads + h) * head_dim, dst = (sp[i] * heads + h) * width;
        quantize_kv_row_int8(kp + src, head_dim, kd + dst);
        quantize_kv_row_int8(vp + src, head_dim, vd + dst);
      }
  });
}

// q [num_seqs, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size, num_kv_heads,
// width]: width = head_dim in q's dtype, or head_dim + 4 int8 (the values, then the row's
// float32 scale); block_tables [num_seqs, max_blocks] int32; seq_lens [num_seqs] int32.
// Returns [num_seqs, num_heads, head_dim].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the cache must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "K and V caches of one dtype");
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  const int64_t head_dim = q.size(2), width = k_cache.size(3);
  if (int8_cache) {
    TORCH_CHECK(width == head_dim + 4, "an int8 cache row is head_dim int8 values and a float32 scale");
  } else {
    TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && width == head_dim,
                "a float cache has the query's dtype and head_dim");
  }
  auto qc = q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    if (int8_cache) {
      decode_attention<scalar_t, int8_t>(qc.data_ptr<scalar_t>(), k_cache.data_ptr<int8_t>(),
                                         v_cache.data_ptr<int8_t>(), tables.data_ptr<int32_t>(),
                                         lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), qc.size(0), qc.size(1),
                                         k_cache.size(2), head_dim, width, k_cache.size(1), tables.size(1),
                                         static_cast<float>(scale));
    } else {
      decode_attention<scalar_t, scalar_t>(qc.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                                           v_cache.data_ptr<scalar_t>(), tables.data_ptr<int32_t>(),
                                           lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), qc.size(0),
                                           qc.size(1), k_cache.size(2), head_dim, width, k_cache.size(1),
                                           tables.size(1), static_cast<float>(scale));
    }
  });
  return out;
}

// Whether the backend should call paged_prefill_attention for this head_dim and number of
// query heads per KV head (at most one task's rows): a build with AVX-512, or with AVX2 and FMA
// (the AVX2 figures against SDPA are in the "prefill attention" section above); other builds
// keep SDPA.
bool prefill_attention_supported(int64_t head_dim, int64_t group) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  return (head_dim == 64 || head_dim == 128) && group >= 1 && group <= kTaskRows;
#else
  return false;
#endif
}

// The prefill rows of a step (the section "prefill attention" above): q [rows, num_heads,
// head_dim] float32 (rows may be strided); caches as paged_decode_attention's, float32, holding
// these rows' K/V already; block_tables [num_seqs, max_blocks] and seq_lens [num_seqs] int32 of
// the prefill sequences; query_starts [num_seqs + 1] int32: sequence s's rows of q (and of out)
// from query_starts[s]. Writes those rows of out [rows, num_heads, head_dim] (contiguous).
void paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_starts,
                             torch::Tensor out, double scale) {
  TORCH_CHECK(q.dim() == 3 && (q.size(2) == 64 || q.size(2) == 128),
              "paged_prefill_attention: q [rows, heads, head_dim] with head_dim 64 or 128");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(2) > 0 && q.size(1) / k_cache.size(2) <= kTaskRows,
              "paged_prefill_attention: at most ", kTaskRows, " query heads per KV head");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "paged_prefill_attention: float32 queries, cache and output");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q: rows of [num_heads, head_dim]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out: contiguous, q's shape");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0,
              "paged_prefill_attention: contiguous caches [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_starts.scalar_type() == at::kInt, "int32 tables");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto starts = query_starts.contiguous();
  const int64_t num_seqs = lens.size(0), max_blocks = tables.size(1), block_size = k_cache.size(1);
  TORCH_CHECK(starts.size(0) == num_seqs + 1 && tables.size(0) == num_seqs, "one table row and start per sequence");
  const int32_t* sp = starts.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(0 <= sp[s] && sp[s] <= sp[s + 1] && sp[s + 1] <= q.size(0) && sp[s + 1] - sp[s] <= lp[s] &&
                    lp[s] <= max_blocks * block_size, "paged_prefill_attention: sequence ", s, " out of bounds");
    for (int64_t b = 0; b < (lp[s] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tp[s * max_blocks + b] >= 0 && tp[s * max_blocks + b] < k_cache.size(0),
                  "paged_prefill_attention: a block beyond the cache");
  }
  prefill_attention_f32(q.data_ptr<float>(), q.stride(0), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tp,
                        lp, sp, out.data_ptr<float>(), num_seqs, q.size(1), k_cache.size(2), q.size(2), block_size,
                        max_blocks, static_cast<float>(scale));
}

// The float32 decode attention's vector path: "avx512" (where the build has AVX-512) or "avx2";
// returns the one now in use. The two give different bits (other summation orders), each
// batch-invariant; tests compare both with the reference.
std::string set_decode_attention_isa(const std::string& name) {
  TORCH_CHECK(name == "avx512" || name == "avx2", "set_decode_attention_isa: avx512 or avx2");
#if defined(__AVX2__) && defined(__FMA__)
  use_avx512_attention = name == "avx512";
#if defined(__AVX512F__)
  return use_avx512_attention ? "avx512" : "avx2";
#else
  return "avx2";
#endif
#else
  return "scalar";
#endif
}
