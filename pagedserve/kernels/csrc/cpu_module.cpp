// The CPU extension module, built in one go by kernels/cpu_attention.py: the paged decode
// attention kernel (cpu_paged_attention.cpp), the fused decode step (cpu_decode.cpp), the
// int8 and int4 products (cpu_int8_gemv.cpp, cpu_int4_gemv.cpp), the float32 products over
// packed weights (cpu_packed_gemm.cpp) and the tensor-parallel
// ranks' shared-memory counters (cpu_shm_sync.cpp).
#include <torch/extension.h>
#include "cpu_balanced_for.h"

#include <string>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale);
void store_kv_int8(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor slots);
std::string set_decode_attention_isa(const std::string& name);
bool prefill_attention_supported(int64_t head_dim, int64_t group);
void paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_starts,
                             torch::Tensor out, double scale);
void bind_cpu_decode(pybind11::module& m);
void bind_cpu_int8_gemv(pybind11::module& m);
void bind_cpu_int4_gemv(pybind11::module& m);
void bind_cpu_shm_sync(pybind11::module& m);
void bind_cpu_packed_gemm(pybind11::module& m);

// The vector instruction sets the build's -march enables, spelled as /proc/cpuinfo's flags
// (csrc/cpu_build_isa.h): a kernel runs where the CPU has its sets and the build admits them.
std::vector<std::string> build_instruction_sets() {
  std::vector<std::string> sets;
#if defined(__AVX2__)
  sets.emplace_back("avx2");
#endif
#if defined(__FMA__)
  sets.emplace_back("fma");
#endif
#if defined(__F16C__)
  sets.emplace_back("f16c");
#endif
#if defined(__AVX512F__)
  sets.emplace_back("avx512f");
#endif
#if defined(__AVX512BW__)
  sets.emplace_back("avx512bw");
#endif
#if defined(__AVX512VNNI__)
  sets.emplace_back("avx512_vnni");
#endif
#if defined(__AVXVNNI__)
  sets.emplace_back("avx_vnni");
#endif
  return sets;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("build_instruction_sets", &build_instruction_sets,
        "the vector instruction sets this build's -march enables, as /proc/cpuinfo spells them");
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (CPU)");
  m.def("store_kv_int8", &store_kv_int8, "float32 K/V → int8 KV cache rows (values, then the float32 scale)");
  m.def("set_decode_attention_isa", &set_decode_attention_isa,
        "the float32 decode attention's vector path: avx512 (where built) or avx2; returns the one in use",
        pybind11::arg("name"));
  m.def("prefill_attention_supported", &prefill_attention_supported,
        "whether the backend should call paged_prefill_attention for this head_dim and query heads per KV head",
        pybind11::arg("head_dim"), pybind11::arg("group"));
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "prefill chunks' attention over a paged float32 KV cache holding their K/V (CPU), into out");
  m.def("set_balanced_threads", [](bool on) { return pagedserve_balanced::enabled.exchange(on); },
        "whether a thread done with its share of a product's tiles or a decode batch's sequences takes the "
        "others' (the default) or waits (the static split); returns the old value. The same bits either way",
        pybind11::arg("on"));
  bind_cpu_decode(m);
  bind_cpu_int8_gemv(m);
  bind_cpu_int4_gemv(m);
  bind_cpu_shm_sync(m);
  bind_cpu_packed_gemm(m);
}
