// The CPU kernels of `moe_kernels.cpu_kernels`: what each source file defines, for module.cpp.
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <chrono>
#include <tuple>
#include <vector>

// CLOCK_MONOTONIC, as Python's time.perf_counter_ns on Linux: each expert's start and end.
inline int64_t monotonic_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

// y's first `columns` (a padded linear's real ones), or y whole.
inline torch::Tensor first_columns(const torch::Tensor& y, int64_t columns) {
  return columns == y.size(1) ? y : y.narrow(1, 0, columns);
}

// Checks `counts` (one per local expert, >= 0) sums to `rows`.
void check_counts(const std::vector<int64_t>& counts, int64_t experts, int64_t rows);

// One unit of a grouped call's work: a local expert, its first column (of gate and up, or
// of down) and its first row (of the expert's rows).
struct Tile {
  int64_t expert, column, row;
};

// The tiles of every expert with rows: `width` columns of n_len by `chunk` rows of the
// expert's, column-major per expert (a thread's consecutive tiles reuse its weights).
inline std::vector<Tile> expert_tiles(const std::vector<int64_t>& counts, int64_t n_len,
                                      int64_t width, int64_t chunk) {
  std::vector<Tile> out;
  for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e)
    for (int64_t n = 0; counts[e] && n < n_len; n += width)
      for (int64_t r = 0; r < counts[e]; r += chunk) out.push_back({e, n, r});
  return out;
}

// Each thread's time on each expert's tiles, and from it each expert's share of a call:
// a grouped call runs every expert's tiles in two parallel loops (gate/up, then down)
// with no barrier per expert, so an expert has no start and end of its own.
class ExpertTimes {
 public:
  ExpertTimes(int64_t experts, int64_t threads)
      : experts_(experts), busy_(threads * experts, 0), start_(monotonic_ns()) {}
  // Thread `me` finished a tile of expert e; `last` is its previous mark (updated).
  void spent(int64_t me, int64_t e, int64_t& last) {
    const int64_t now = monotonic_ns();
    busy_[me * experts_ + e] += now - last;
    last = now;
  }
  // Per expert with rows, marks[2e], marks[2e + 1]: one after another from the call's
  // start, in expert order, each its threads' time over `team` long (0 0 without rows).
  std::vector<int64_t> marks(const std::vector<int64_t>& counts, int64_t team) const {
    std::vector<int64_t> out(2 * experts_, 0);
    int64_t t = start_;
    for (int64_t e = 0; e < experts_; ++e) {
      if (!counts[e]) continue;
      int64_t spent = 0;
      for (int64_t i = 0; i < team; ++i) spent += busy_[i * experts_ + e];
      out[2 * e] = t;
      t += std::max<int64_t>(1, spent / team);
      out[2 * e + 1] = t;
    }
    return out;
  }

 private:
  int64_t experts_;
  std::vector<int64_t> busy_;  // [thread, expert] ns
  int64_t start_;
};

// f32_cpu.cpp
std::tuple<torch::Tensor, std::vector<int64_t>> grouped_swiglu_f32(
    const torch::Tensor& x, const std::vector<int64_t>& counts, const torch::Tensor& w_gate_up,
    const torch::Tensor& w_down);
torch::Tensor linear_f32(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor head_linear_f32(const torch::Tensor& x, const torch::Tensor& w);
// float32 panels (s undefined), or int8 panels and their column scales s
torch::Tensor dense_linear(const torch::Tensor& x, const torch::Tensor& w,
                           const c10::optional<torch::Tensor>& s);
torch::Tensor dense_head_linear(const torch::Tensor& x, const torch::Tensor& w,
                                const c10::optional<torch::Tensor>& s);

// int8_cpu.cpp
torch::Tensor linear_i8(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& s);
torch::Tensor head_linear_i8(const torch::Tensor& x, const torch::Tensor& w,
                             const torch::Tensor& s);

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
std::tuple<torch::Tensor, torch::Tensor> route_f32(const torch::Tensor& x,
                                                   const torch::Tensor& gate_panels,
                                                   int64_t experts, int64_t top_k,
                                                   bool normalize);
std::tuple<torch::Tensor, torch::Tensor> route_grouped_f32(
    const torch::Tensor& x, const torch::Tensor& gate_panels, int64_t experts,
    const c10::optional<torch::Tensor>& bias, bool noaux_tc, int64_t n_group,
    int64_t topk_group, int64_t top_k, bool normalize, double scaling);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> sort_rows_cpu(
    const torch::Tensor& key, const torch::Tensor& weights, int64_t slots);
torch::Tensor rope_f32(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                       bool interleaved);
torch::Tensor combine_f32(const torch::Tensor& y, const torch::Tensor& src_token,
                          const torch::Tensor& weights, int64_t num_tokens);

// moe_layer_cpu.cpp
std::tuple<torch::Tensor, std::vector<int64_t>, std::vector<int64_t>> local_moe(
    const torch::Tensor& x, const torch::Tensor& topk_ids, const torch::Tensor& topk_weights,
    const torch::Tensor& gate_up, const c10::optional<torch::Tensor>& gate_up_scales,
    const torch::Tensor& down, const c10::optional<torch::Tensor>& down_scales);

// decode_layer_cpu.cpp
std::tuple<torch::Tensor, torch::Tensor> attention_block_f32(
    const torch::Tensor& h, const torch::Tensor& input_norm, const torch::Tensor& qkv_panels,
    const c10::optional<torch::Tensor>& qkv_scales, int64_t qkv_columns,
    const c10::optional<torch::Tensor>& q_norm,
    const c10::optional<torch::Tensor>& k_norm, const torch::Tensor& cos,
    const torch::Tensor& sin, torch::Tensor k_cache, torch::Tensor v_cache,
    const torch::Tensor& slot_mapping, const torch::Tensor& kv_slots, const torch::Tensor& mask,
    const torch::Tensor& o_panels, const c10::optional<torch::Tensor>& o_scales,
    int64_t o_columns, const torch::Tensor& post_norm, int64_t heads, int64_t kv_heads,
    double eps, double scale);

// mla_cpu.cpp
std::tuple<torch::Tensor, torch::Tensor> mla_block_f32(
    const torch::Tensor& h, const torch::Tensor& input_norm, const torch::Tensor& qkv_a_panels,
    const c10::optional<torch::Tensor>& qkv_a_scales, int64_t qkv_a_columns,
    const c10::optional<torch::Tensor>& q_a_norm, const c10::optional<torch::Tensor>& q_b_panels,
    const c10::optional<torch::Tensor>& q_b_scales, int64_t q_b_columns,
    const torch::Tensor& kv_a_norm, const torch::Tensor& w_uk_panels,
    const c10::optional<torch::Tensor>& w_uk_scales, const torch::Tensor& w_uv_panels,
    const c10::optional<torch::Tensor>& w_uv_scales, const torch::Tensor& cos,
    const torch::Tensor& sin, bool interleaved, torch::Tensor cache,
    const torch::Tensor& slot_mapping, const torch::Tensor& kv_slots, const torch::Tensor& mask,
    const torch::Tensor& o_panels, const c10::optional<torch::Tensor>& o_scales,
    int64_t o_columns, const torch::Tensor& post_norm, int64_t heads, int64_t q_lora,
    int64_t nope, double eps, double scale);
