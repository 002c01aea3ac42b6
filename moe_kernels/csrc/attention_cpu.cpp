// Decode attention over the paged KV cache, for the CPU: each sequence's one query token
// against its cached keys, read in place through the slot table. The torch path gathers
// every sequence's K and V into a padded copy first (`k_all[slots]`), which at 64
// sequences costs more than the attention itself. This reads each visible key once for
// the query heads that share its KV head (GQA), the cores splitting the (sequence, KV
// head) pairs, with the exponentials 16 at a time, and returns the log-sum-exp as well, so
// that a DCP shard's partial attention is the same call (`dcp.merge`).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels.h"

namespace {

typedef float vec16 __attribute__((vector_size(16 * sizeof(float))));
typedef int32_t ivec16 __attribute__((vector_size(16 * sizeof(int32_t))));

inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Lanes [chunk of 2g: x's g-blocks summed, then y's]: one step of a 16 x 16 transpose-sum.
template <int G>
inline vec16 fold(vec16 x, vec16 y) {
  constexpr ivec16 a = G == 8 ? ivec16{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}
                     : G == 4 ? ivec16{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}
                     : G == 2 ? ivec16{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}
                              : ivec16{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  return __builtin_shuffle(x, y, a) + __builtin_shuffle(x, y, a + G);
}

// out[l] = the sum of acc[l]'s 16 lanes, for 16 vectors at once (15 folds, not 16 serial
// sums of 16 lanes): fed in bit-reversed order, the folds leave lane l with acc[l].
inline vec16 sum_lanes16(const vec16* acc) {
  vec16 r[8], s[4], t[2];
  constexpr int rev[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  for (int m = 0; m < 8; ++m) r[m] = fold<8>(acc[rev[2 * m]], acc[rev[2 * m + 1]]);
  for (int m = 0; m < 4; ++m) s[m] = fold<4>(r[2 * m], r[2 * m + 1]);
  for (int m = 0; m < 2; ++m) t[m] = fold<2>(s[2 * m], s[2 * m + 1]);
  return fold<1>(t[0], t[1]);
}

// e^x lane by lane (Cephes' expf: 2^n times a degree-6 polynomial of the remainder, within
// 2 ulp of expf; x below -87.3 gives about 1e-38 rather than 0).
inline vec16 exp16(vec16 x) {
  const vec16 lo = vec16{} - 87.3365447f, hi = vec16{} + 88.3762626f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vec16 magic = vec16{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const vec16 n = (x * 1.44269504f + magic) - magic;
  const vec16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vec16 p = vec16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vec16 y = p * r * r + r + 1.f;
  const ivec16 bits = (__builtin_convertvector(n, ivec16) + 127) << 23;
  vec16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// out[t, c0 + 16u ...] = sum over the n value rows of p[t, i] * V_i[c0 + 16u ...] for 4
// heads t (the first `live` written) and U column blocks: 4U sums in registers.
template <int U>
inline void values_tile(const float* p, int64_t stride, const float* vp, const int64_t* rows,
                        int64_t n, int64_t c0, int64_t live, float* out, int64_t dim) {
  vec16 a[4][U] = {};
  for (int64_t i = 0; i < n; ++i) {
    const float* value = vp + rows[i] + c0;
    if (i + 8 < n) __builtin_prefetch(vp + rows[i + 8] + c0);
    vec16 v[U];
    for (int u = 0; u < U; ++u) v[u] = load16(value + 16 * u);
    for (int t = 0; t < 4; ++t) {
      const float pt = p[t * stride + i];
      for (int u = 0; u < U; ++u) a[t][u] += pt * v[u];
    }
  }
  for (int t = 0; t < 4 && t < live; ++t)
    for (int u = 0; u < U; ++u) std::memcpy(out + t * dim + c0 + 16 * u, &a[t][u], sizeof(vec16));
}

// One (sequence, KV head) pair: the `group` query heads q [group, D] against the n visible
// keys' K and V rows (`rows[i]` floats into the caches) -> out [group, D], lse [group].
// Each key and value row is read once for the whole group, and every sum runs in several
// registers at once (one FMA chain would wait out its latency at every step).
void attend_group(const float* q, const float* kp, const float* vp, const int64_t* rows,
                  int64_t n, int64_t group, int64_t dim, float scale, float* out,
                  float* lse) {
  const int64_t stride = (n + 15) / 16 * 16, heads = (group + 3) / 4 * 4;
  std::vector<float> p(heads * stride, 0.f);  // scores, then probabilities [heads, n]
  std::vector<vec16> acc(group * 16);  // [group, 16 keys]: each key's products to sum
  for (int64_t i0 = 0; i0 < n; i0 += 16) {  // 16 keys' scores at a time
    const int64_t keys = std::min<int64_t>(16, n - i0);
    for (int64_t m = i0 + 16; m < std::min<int64_t>(n, i0 + 32); ++m)  // the next 16 keys
      for (int64_t c = 0; c < dim; c += 16) __builtin_prefetch(kp + rows[m] + c);
    std::fill(acc.begin(), acc.end(), vec16{});
    for (int64_t m = 0; m < keys; ++m) {
      const float* key = kp + rows[i0 + m];
      for (int64_t j = 0; j < group; ++j) {
        vec16 a = {};
        for (int64_t c = 0; c < dim; c += 16) a += load16(q + j * dim + c) * load16(key + c);
        acc[j * 16 + m] = a;
      }
    }
    for (int64_t j = 0; j < group; ++j) {
      const vec16 scores = sum_lanes16(acc.data() + j * 16) * scale;
      std::memcpy(p.data() + j * stride + i0, &scores, sizeof scores);
    }
  }
  for (int64_t j = 0; j < group; ++j) {
    float* row = p.data() + j * stride;
    const float top = *std::max_element(row, row + n);
    float total = 0.f;
    for (int64_t i = 0; i < stride; i += 16) {  // lanes past n are computed, then zeroed
      const vec16 e = exp16(load16(row + i) - top);
      std::memcpy(row + i, &e, sizeof e);
    }
    std::fill(row + n, row + stride, 0.f);
    for (int64_t i = 0; i < n; ++i) total += row[i];
    lse[j] = top + std::log(total);
    const float inv = 1.f / total;
    for (int64_t i = 0; i < n; ++i) row[i] *= inv;
  }
  for (int64_t c0 = 0; c0 < dim; c0 += 64)  // a tile of 4 heads x 64 columns in 16
    for (int64_t j = 0; j < heads; j += 4) {  // registers, over every value row once
      const float* pj = p.data() + j * stride;
      switch ((dim - c0) / 16) {
        case 1: values_tile<1>(pj, stride, vp, rows, n, c0, group - j, out + j * dim, dim); break;
        case 2: values_tile<2>(pj, stride, vp, rows, n, c0, group - j, out + j * dim, dim); break;
        case 3: values_tile<3>(pj, stride, vp, rows, n, c0, group - j, out + j * dim, dim); break;
        default: values_tile<4>(pj, stride, vp, rows, n, c0, group - j, out + j * dim, dim);
      }
    }
}

}  // namespace

// q [B, H, D] float32 (D a multiple of 16); k_cache, v_cache [S, KVH, D] float32
// (slot-major, contiguous); slots [B, L] int64 (into S); mask [B, L] bool, True where the
// query sees that key; scale: the softmax scale -> (out [B, H, D] float32, normalised over
// the visible keys, 0 where none; lse [B, H] float32, the visible scores' log-sum-exp,
// -inf where none).
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
  TORCH_CHECK(q.size(2) % 16 == 0, "head_dim must be a multiple of 16");
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
  const float s = static_cast<float>(scale);
#pragma omp parallel for schedule(static)
  for (int64_t task = 0; task < batch * kv_heads; ++task) {
    const int64_t b = task / kv_heads, kvh = task % kv_heads;
    std::vector<int64_t> rows;  // the visible keys' rows of this KV head, in floats
    rows.reserve(length);
    for (int64_t l = 0; l < length; ++l)
      if (mp[b * length + l]) rows.push_back((sp[b * length + l] * kv_heads + kvh) * dim);
    const int64_t first = b * heads + kvh * group;  // head h reads KV head h / group
    if (rows.empty()) {  // no visible key: out stays 0
      std::fill(lp + first, lp + first + group, -std::numeric_limits<float>::infinity());
      continue;
    }
    attend_group(qp + first * dim, kp, vp, rows.data(), static_cast<int64_t>(rows.size()),
                 group, dim, s, op + first * dim, lp + first);
  }
  return {out, lse};
}
