// Decode attention over the paged KV cache, for CPU workers.
//
// One task per (sequence, KV head): the query heads that share that KV head read each
// cached key and value exactly once, straight from its block (no gather into a padded
// copy), accumulating in float32. Same function as the torch reference in
// kernels/torch_attention.py; tests compare the two.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <limits>
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

template <typename T>
void decode_attention(const T* q, const T* k_cache, const T* v_cache, const int32_t* block_tables,
                      const int32_t* seq_lens, T* out, int64_t num_seqs, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                      float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;  // between positions in a block
  const int64_t block_stride = block_size * token_stride;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t len = seq_lens[s];
      const int32_t* table = block_tables + s * max_blocks;
      scores.assign(group * len, 0.f);
      for (int64_t g = 0; g < group; ++g) {
        const T* qp = q + (s * num_heads + h * group + g) * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) qf[g * head_dim + i] = load(qp[i]) * scale;
      }
      for (int64_t t = 0; t < len; ++t) {
        const T* kp = k_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride + h * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < head_dim; ++i) dot += qg[i] * load(kp[i]);
          scores[g * len + t] = dot;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * len;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          sg[t] = std::exp(sg[t] - mx);
          sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const T* vp = v_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride + h * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t i = 0; i < head_dim; ++i) ag[i] += p * load(vp[i]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* op = out + (s * num_heads + h * group + g) * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) op[i] = static_cast<T>(acc[g * head_dim + i]);
      }
    }
  });
}

}  // namespace

// q [num_seqs, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size, num_kv_heads,
// head_dim]; block_tables [num_seqs, max_blocks] int32; seq_lens [num_seqs] int32.
// Returns [num_seqs, num_heads, head_dim].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the cache must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  auto qc = q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention<scalar_t>(qc.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                               tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(),
                               qc.size(0), qc.size(1), k_cache.size(2), qc.size(2), k_cache.size(1),
                               tables.size(1), static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (CPU)");
}
