// Decode attention over the paged KV cache, for the CPU: each sequence's one query token
// against its cached keys, read in place through the slot table. The torch path gathers
// every sequence's K and V into a padded copy first (`k_all[slots]`), which at 64
// sequences costs more than the attention itself; this reads each key once, per KV head
// for all the query heads that share it (GQA), both cores splitting the (sequence, KV
// head) pairs. Returns the log-sum-exp as well, so a DCP shard's partial attention is the
// same call (`dcp.merge`).
#include <cmath>
#include <limits>

#include "kernels.h"

// q [B, H, D] float32; k_cache, v_cache [S, KVH, D] float32 (slot-major, contiguous);
// slots [B, L] int64 (into S); mask [B, L] bool, True where the query sees that key;
// scale: the softmax scale -> (out [B, H, D] float32, normalised over the visible keys,
// 0 where none; lse [B, H] float32, the visible scores' log-sum-exp, -inf where none).
std::tuple<torch::Tensor, torch::Tensor> decode_attention(
    const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
    const torch::Tensor& slots, const torch::Tensor& mask, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
                  v_cache.dtype() == torch::kFloat32, "float32 q and KV cache only");
  TORCH_CHECK(slots.dtype() == torch::kInt64 && mask.dtype() == torch::kBool,
              "int64 slots and a bool mask");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && slots.dim() == 2 &&
                  k_cache.sizes() == v_cache.sizes() && mask.sizes() == slots.sizes() &&
                  slots.size(0) == q.size(0) && k_cache.size(2) == q.size(2) &&
                  q.size(1) % k_cache.size(1) == 0,
              "q [B, H, D], K and V [S, KVH, D], slots and mask [B, L]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous KV cache only");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(1), group = heads / kv_heads, length = slots.size(1);
  const int64_t num_slots = k_cache.size(0);
  const torch::Tensor qc = q.contiguous(), sc = slots.contiguous(), mc = mask.contiguous();
  torch::Tensor out = torch::zeros_like(qc);
  torch::Tensor lse = torch::empty({batch, heads}, q.options());
  const float *qp = qc.data_ptr<float>(), *kp = k_cache.data_ptr<float>(),
              *vp = v_cache.data_ptr<float>();
  const int64_t* sp = sc.data_ptr<int64_t>();
  const bool* mp = mc.data_ptr<bool>();
  float *op = out.data_ptr<float>(), *lp = lse.data_ptr<float>();
  for (int64_t i = 0; i < batch * length; ++i)
    TORCH_CHECK(!mp[i] || (sp[i] >= 0 && sp[i] < num_slots), "a visible key's slot is out "
                "of the cache");
  const float s = static_cast<float>(scale), neg_inf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
      std::vector<float> scores(group * length, neg_inf);  // [G, L]
      const float* qb = qp + (b * heads + kh * group) * dim;  // [G, D]
      for (int64_t l = 0; l < length; ++l) {
        if (!mp[b * length + l]) continue;
        const float* key = kp + (sp[b * length + l] * kv_heads + kh) * dim;
        for (int64_t j = 0; j < group; ++j) {
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += qb[j * dim + d] * key[d];
          scores[j * length + l] = dot * s;
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        float* row = scores.data() + j * length;
        float top = neg_inf;
        for (int64_t l = 0; l < length; ++l) top = std::max(top, row[l]);
        const int64_t h = kh * group + j;
        if (top == neg_inf) {  // no visible key: out stays 0
          lp[b * heads + h] = neg_inf;
          continue;
        }
        float total = 0.f;
        for (int64_t l = 0; l < length; ++l) total += row[l] = std::exp(row[l] - top);
        lp[b * heads + h] = top + std::log(total);
        const float inv = 1.f / total;
        for (int64_t l = 0; l < length; ++l) row[l] *= inv;
      }
      float* ob = op + (b * heads + kh * group) * dim;  // [G, D]
      for (int64_t l = 0; l < length; ++l) {
        if (!mp[b * length + l]) continue;
        const float* value = vp + (sp[b * length + l] * kv_heads + kh) * dim;
        for (int64_t j = 0; j < group; ++j) {
          const float p = scores[j * length + l];
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) ob[j * dim + d] += p * value[d];
        }
      }
    }
  return {out, lse};
}
