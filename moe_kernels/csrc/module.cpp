// The Python module of the CPU kernels (`moe_kernels.cpu_kernels`).
#include <omp.h>

#include "kernels.h"

void check_counts(const std::vector<int64_t>& counts, int64_t experts, int64_t rows) {
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == experts, "one count per local expert");
  int64_t total = 0;
  for (int64_t c : counts) {
    TORCH_CHECK(c >= 0, "negative count");
    total += c;
  }
  TORCH_CHECK(total == rows, "the counts do not sum to the rows");
}

// Frees the calling thread's OpenMP team (`common.compute`): libgomp then manages no more
// threads than the compute thread's team, and keeps spinning between its regions.
int release_threads() { return omp_pause_resource_all(omp_pause_soft); }

// Every kernel runs without the GIL: the event loop's thread (I/O, the next request)
// goes on while the compute thread is in a kernel.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("grouped_swiglu_f32", &grouped_swiglu_f32, nogil,
        "float32 grouped SwiGLU over every local expert of one layer (weights in panels)");
  m.def("linear_f32", &linear_f32, nogil, "float32 x [M, K] @ w^T, w in panels [N/16, K, 16]");
  m.def("linear_i8", &linear_i8, nogil,
        "float32 x [M, K] @ (w * s)^T, x quantized to int8 in blocks of 32, w int8 panels "
        "[N/16, K'/4, 16, 4], s [N] column scales");
  m.def("grouped_swiglu_w4a4", &grouped_swiglu_w4a4, nogil,
        "MXFP4 x MXFP4 grouped SwiGLU over every local expert of one layer");
  m.def("mxfp4_linear", &mxfp4_linear, nogil, "MXFP4 x [M, K] @ MXFP4 w [N, K]^T -> float32");
  m.def("decode_attention", &decode_attention, nogil,
        "one query token per sequence over the paged KV cache -> (out, lse)");
  m.def("w4a4_panels", &w4a4_panels, nogil,
        "MXFP4 weights -> the layout the W4A4 kernel reads (panels where it runs VNNI)");
  m.def("quantize_mxfp4", &quantize_mxfp4, nogil, "float32 [M, K] -> MXFP4 (packed, scales)");
  m.def("release_threads", &release_threads, nogil, "free the calling thread's OpenMP team");
  m.def("combine_f32", &combine_f32, nogil, "float32 MoE combine: weighted rows into token order");
  m.def("rms_norm_f32", &rms_norm_f32, nogil, "float32 RMSNorm of rows [R, H]");
  m.def("qk_norm_rope_f32", &qk_norm_rope_f32, nogil,
        "float32 q/k of stacked qkv rows: per-head RMSNorm, then rotary embedding");
  m.def("route_f32", &route_f32, nogil,
        "float32 router: gate logits, softmax, top-k, renormalised: (ids, weights)");
  m.def("route_grouped_f32", &route_grouped_f32, nogil,
        "float32 DeepSeek router: group-limited top-k (V3 noaux_tc or V2): (ids, weights)");
  m.def("sort_rows_cpu", &sort_rows_cpu, nogil,
        "dispatch layout: rows ordered by slot (stable), their weights, rows per slot");
  m.def("head_linear_f32", &head_linear_f32, nogil,
        "float32 x [T, heads, K] through one weight per head (panels) -> [T, heads, N]");
  m.def("head_linear_i8", &head_linear_i8, nogil,
        "linear_i8 per head: int8 panels [heads, N/16, K'/4, 16, 4], scales [heads, N]");
  m.def("rope_f32", &rope_f32, nogil, "float32 rotary embedding of [T, n, D], halves or pairs");
  m.def("mla_block_f32", &mla_block_f32, nogil,
        "float32 decode MLA block: norm, q/kv_a, q_b, rope, W_UK, cache write, attention, "
        "W_UV, o, add, norm");
  m.def("local_moe", &local_moe, nogil,
        "a MoE layer with every expert here: sort by expert, (MXFP4 quantize,) grouped "
        "experts, combine -> (out, rows per expert, marks)");
  m.def("attention_block_f32", &attention_block_f32, nogil,
        "float32 decode attention block: norm, qkv, rope, KV write, attention, o, add, norm");
}
