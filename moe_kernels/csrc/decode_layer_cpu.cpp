// A decode step's attention block as one call, for the CPU in float32: the input RMSNorm,
// the qkv projection, q/k norm and rotary embedding, the KV cache write, paged attention,
// the o projection, the residual add and the post-attention RMSNorm. The same kernels as
// the Python path's, in the same order, so the results are the same bits; what goes is
// the Python between them (some 20 tensor operations a layer: views, index copies into
// and out of the decode rows, the cache's index_put), which at one decode row cost about
// a fifth of the step (docs/benchmarks.md).
#include <cstring>

#include "kernels.h"

// h [T, H] float32: the residual stream, one decode token per row; input_norm, post_norm
// [H]; qkv_panels [N/16, H, 16] (q, k, v stacked, first qkv_columns of N real; float32,
// or int8 with qkv_scales [N], `dense_linear`, as every weight here); q_norm,
// k_norm [D] or undefined; cos, sin [T, D]; k_cache, v_cache [S, KVH, D] (written at
// slot_mapping [T] int64); kv_slots, mask [T, L]: each row's keys (its own included,
// once written); o_panels [H/16, heads D, 16] (first o_columns real) ->
// (h [T, H] + the attention's output, that sum RMSNorm'd by post_norm).
std::tuple<torch::Tensor, torch::Tensor> attention_block_f32(
    const torch::Tensor& h, const torch::Tensor& input_norm, const torch::Tensor& qkv_panels,
    const c10::optional<torch::Tensor>& qkv_scales, int64_t qkv_columns,
    const c10::optional<torch::Tensor>& q_norm,
    const c10::optional<torch::Tensor>& k_norm, const torch::Tensor& cos,
    const torch::Tensor& sin, torch::Tensor k_cache, torch::Tensor v_cache,
    const torch::Tensor& slot_mapping, const torch::Tensor& kv_slots, const torch::Tensor& mask,
    const torch::Tensor& o_panels, const c10::optional<torch::Tensor>& o_scales,
    int64_t o_columns, const torch::Tensor& post_norm, int64_t heads, int64_t kv_heads,
    double eps, double scale) {
  const int64_t t = h.size(0), d = cos.size(1), kv_width = kv_heads * d;
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.dtype() == torch::kFloat32 && v_cache.dtype() == torch::kFloat32 &&
                  k_cache.dim() == 3 && k_cache.size(1) * k_cache.size(2) == kv_width &&
                  k_cache.sizes() == v_cache.sizes(),
              "K and V caches must be contiguous float32 [S, KVH, D]");
  TORCH_CHECK(slot_mapping.dtype() == torch::kInt64 && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == t, "slot_mapping must be int64 [T]");
  const torch::Tensor x = rms_norm_f32(h, input_norm, eps);
  const torch::Tensor qkv =
      first_columns(dense_linear(x, qkv_panels, qkv_scales), qkv_columns);
  auto [q, k] = qk_norm_rope_f32(qkv, q_norm, k_norm, cos, sin, heads, kv_heads, eps);
  const torch::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0), v_first = (heads + kv_heads) * d;
  const float *kp = k.data_ptr<float>(), *qkvp = qkv.data_ptr<float>();
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  for (int64_t r = 0; r < t; ++r) {
    TORCH_CHECK(sp[r] >= 0 && sp[r] < num_slots, "a token's KV slot is out of the cache");
    std::memcpy(kc + sp[r] * kv_width, kp + r * kv_width, kv_width * sizeof(float));
    std::memcpy(vc + sp[r] * kv_width, qkvp + r * qkv.stride(0) + v_first,
                kv_width * sizeof(float));
  }
  const torch::Tensor out = std::get<0>(decode_attention(q, k_cache, v_cache, kv_slots, mask,
                                                         scale));  // [T, heads, D]
  const torch::Tensor o = first_columns(
      dense_linear(out.view({t, heads * d}), o_panels, o_scales), o_columns);
  torch::Tensor summed = h + o;
  return {summed, rms_norm_f32(summed, post_norm, eps)};
}
