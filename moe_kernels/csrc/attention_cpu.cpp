// Decode attention over the paged KV cache, for the CPU: each sequence's one query token
// against its cached keys, read in place through the slot table. The torch path gathers
// every sequence's K and V into a padded copy first (`k_all[slots]`), which at 64
// sequences costs more than the attention itself. This reads each key's slot (every KV
// head, contiguous) once for all the query heads (GQA), both cores splitting the
// sequences, and returns the log-sum-exp as well, so that a DCP shard's partial attention
// is the same call (`dcp.merge`).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels.h"

namespace {

typedef float vec8 __attribute__((vector_size(8 * sizeof(float))));

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// a . b over n floats (8 at a time where n allows)
inline float dot(const float* a, const float* b, int64_t n) {
  vec8 acc = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc += load8(a + i) * load8(b + i);
  float sum = 0.f;
  for (int64_t k = 0; k < 8; ++k) sum += acc[k];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// y += p * x over n floats
inline void axpy(float p, const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const vec8 r = load8(y + i) + p * load8(x + i);
    std::memcpy(y + i, &r, sizeof r);
  }
  for (; i < n; ++i) y[i] += p * x[i];
}

}  // namespace

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
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < batch; ++b) {
    std::vector<float> scores(heads * length, neg_inf);  // [H, L]
    const float* qb = qp + b * heads * dim;  // [H, D]
    for (int64_t l = 0; l < length; ++l) {
      if (!mp[b * length + l]) continue;
      const float* key = kp + sp[b * length + l] * kv_heads * dim;  // [KVH, D], one read
      for (int64_t h = 0; h < heads; ++h)
        scores[h * length + l] = dot(qb + h * dim, key + (h / group) * dim, dim) * s;
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* row = scores.data() + h * length;
      float top = neg_inf;
      for (int64_t l = 0; l < length; ++l) top = std::max(top, row[l]);
      if (top == neg_inf) {  // no visible key: out stays 0
        lp[b * heads + h] = neg_inf;
        std::fill(row, row + length, 0.f);
        continue;
      }
      float total = 0.f;
      for (int64_t l = 0; l < length; ++l) total += row[l] = std::exp(row[l] - top);
      lp[b * heads + h] = top + std::log(total);
      const float inv = 1.f / total;
      for (int64_t l = 0; l < length; ++l) row[l] *= inv;
    }
    float* ob = op + b * heads * dim;  // [H, D]
    for (int64_t l = 0; l < length; ++l) {
      if (!mp[b * length + l]) continue;
      const float* value = vp + sp[b * length + l] * kv_heads * dim;  // [KVH, D]
      for (int64_t h = 0; h < heads; ++h)
        axpy(scores[h * length + l], value + (h / group) * dim, ob + h * dim, dim);
    }
  }
  return {out, lse};
}
