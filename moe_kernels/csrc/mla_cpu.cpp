// A decode step's MLA block (DeepSeek-V2/V3) as one call, for the CPU in float32: the
// input RMSNorm, q_a/kv_a (one stacked projection), q_a's norm and q_b, the latent's norm,
// the rotary key and queries, the absorbed queries (W_UK), the cache write, attention over
// the latent rows, W_UV, o, the residual add and the post-attention RMSNorm. The same
// kernels as the Python path's (`services.attention.mla`) in the same order, so the same
// bits, without some 40 tensor operations a layer between them.
#include <cstring>

#include "kernels.h"

// h [T, H] float32, one decode token per row; input_norm, post_norm [H]; qkv_a_panels
// [(Q + C + R)/16, H, 16] (q_a or q, stacked on kv_a; first qkv_a_columns real); q_a_norm
// [Q] and q_b_panels [heads (N + R)/16, Q, 16] (first q_b_columns real), or undefined
// without q_lora_rank; kv_a_norm [C]; w_uk_panels [heads, C/16, N, 16]; w_uv_panels
// [heads, V/16, C, 16]; cos, sin [T, R]; cache [S, 1, C + R] (written at slot_mapping [T]
// int64); kv_slots, mask [T, L]; o_panels [H/16, heads V, 16] (first o_columns real) ->
// (h [T, H] + the attention's output, that sum RMSNorm'd by post_norm). Each weight is
// float32 panels, or int8 ones with its column scales ([N], per head [heads, N]: the
// `*_scales` beside it, `dense_linear`).
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
    int64_t nope, double eps, double scale) {
  const int64_t t = h.size(0), rope = cos.size(1), c = kv_a_norm.numel(), row = c + rope;
  TORCH_CHECK(cache.is_contiguous() && cache.dtype() == torch::kFloat32 && cache.dim() == 3 &&
                  cache.size(1) == 1 && cache.size(2) == row,
              "the latent cache must be contiguous float32 [S, 1, kv_lora_rank + rope]");
  TORCH_CHECK(slot_mapping.dtype() == torch::kInt64 && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == t, "slot_mapping must be int64 [T]");
  const torch::Tensor x = rms_norm_f32(h, input_norm, eps);
  const torch::Tensor a =
      first_columns(dense_linear(x, qkv_a_panels, qkv_a_scales), qkv_a_columns);
  const int64_t split = q_lora ? q_lora : heads * (nope + rope);
  torch::Tensor q = a.narrow(1, 0, split);
  if (q_lora)
    q = first_columns(dense_linear(rms_norm_f32(q, *q_a_norm, eps), *q_b_panels, q_b_scales),
                      q_b_columns);
  q = q.reshape({t, heads, nope + rope});
  const torch::Tensor latent = rms_norm_f32(a.narrow(1, split, c), kv_a_norm, eps);  // [T, C]
  const torch::Tensor k_pe = rope_f32(a.narrow(1, split + c, rope).view({t, 1, rope}), cos,
                                      sin, interleaved);  // [T, 1, R]
  const torch::Tensor q_pe = rope_f32(q.narrow(2, nope, rope), cos, sin, interleaved);
  const torch::Tensor q_latent = dense_head_linear(q.narrow(2, 0, nope), w_uk_panels,
                                                         w_uk_scales);
  const torch::Tensor queries = torch::cat({q_latent, q_pe}, 2);  // [T, heads, C + R]
  const torch::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const float *lp = latent.data_ptr<float>(), *kp = k_pe.data_ptr<float>();
  float* cp = cache.data_ptr<float>();
  for (int64_t r = 0; r < t; ++r) {
    TORCH_CHECK(sp[r] >= 0 && sp[r] < cache.size(0), "a token's KV slot is out of the cache");
    std::memcpy(cp + sp[r] * row, lp + r * c, c * sizeof(float));
    std::memcpy(cp + sp[r] * row + c, kp + r * rope, rope * sizeof(float));
  }
  const torch::Tensor out = std::get<0>(decode_attention(queries, cache, cache, kv_slots, mask,
                                                         scale));  // [T, heads, C + R]
  const torch::Tensor values = dense_head_linear(out.narrow(2, 0, c), w_uv_panels,
                                                       w_uv_scales);
  const torch::Tensor o = first_columns(dense_linear(values.view({t, -1}), o_panels, o_scales),
                                        o_columns);
  torch::Tensor summed = h + o;
  return {summed, rms_norm_f32(summed, post_norm, eps)};
}
