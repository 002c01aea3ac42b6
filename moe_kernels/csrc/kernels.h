// The CPU kernels of `moe_kernels.cpu_kernels`: what each source file defines, for module.cpp.
#pragma once
#include <torch/extension.h>

#include <chrono>
#include <tuple>
#include <vector>

// CLOCK_MONOTONIC, as Python's time.perf_counter_ns on Linux: each expert's start and end.
inline int64_t monotonic_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Checks `counts` (one per local expert, >= 0) sums to `rows`.
void check_counts(const std::vector<int64_t>& counts, int64_t experts, int64_t rows);

// Inside a parallel region, every thread: body(e, start, rows) for each local expert e
// with rows, start its first row; the master thread marks each one's start and end
// (monotonic ns) in marks[2e], marks[2e + 1]. body ends in a barrier (an `omp for`'s), so
// an expert's end mark follows every thread's work on it.
template <class Body>
inline void each_expert(const std::vector<int64_t>& counts, std::vector<int64_t>& marks,
                        Body body) {
  int64_t start = 0;
  for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e) {
    const int64_t c = counts[e];
    if (c == 0) continue;
#pragma omp master
    marks[2 * e] = monotonic_ns();
    body(e, start, c);
#pragma omp master
    marks[2 * e + 1] = monotonic_ns();
    start += c;
  }
}

// f32_cpu.cpp
std::tuple<torch::Tensor, std::vector<int64_t>> grouped_swiglu_f32(
    const torch::Tensor& x, const std::vector<int64_t>& counts, const torch::Tensor& w_gate_up,
    const torch::Tensor& w_down);
torch::Tensor linear_f32(const torch::Tensor& x, const torch::Tensor& w);

// w4a4_cpu.cpp
std::tuple<torch::Tensor, std::vector<int64_t>> grouped_swiglu_w4a4(
    const torch::Tensor& x_packed, const torch::Tensor& x_scales,
    const std::vector<int64_t>& counts, const torch::Tensor& gu_packed,
    const torch::Tensor& gu_scales, const torch::Tensor& down_packed,
    const torch::Tensor& down_scales);
torch::Tensor mxfp4_linear(const torch::Tensor& x_packed, const torch::Tensor& x_scales,
                           const torch::Tensor& w_packed, const torch::Tensor& w_scales);
std::tuple<torch::Tensor, torch::Tensor> quantize_mxfp4(const torch::Tensor& x);
std::tuple<torch::Tensor, torch::Tensor> w4a4_panels(const torch::Tensor& packed,
                                                     const torch::Tensor& scales);

// attention_cpu.cpp
std::tuple<torch::Tensor, torch::Tensor> decode_attention(
    const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
    const torch::Tensor& slots, const torch::Tensor& mask, double scale);

// layers_cpu.cpp
torch::Tensor rms_norm_f32(const torch::Tensor& x, const torch::Tensor& w, double eps);
std::tuple<torch::Tensor, torch::Tensor> qk_norm_rope_f32(
    const torch::Tensor& qkv, const c10::optional<torch::Tensor>& q_norm,
    const c10::optional<torch::Tensor>& k_norm, const torch::Tensor& cos,
    const torch::Tensor& sin, int64_t heads, int64_t kv_heads, double eps);
torch::Tensor combine_f32(const torch::Tensor& y, const torch::Tensor& src_token,
                          const torch::Tensor& weights, int64_t num_tokens);
