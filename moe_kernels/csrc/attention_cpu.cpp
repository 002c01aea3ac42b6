// Decode attention over the paged KV cache, for the CPU: each sequence's one query token
// against its cached keys, read in place through the slot table. The torch path gathers
// every sequence's K and V into a padded copy first (`k_all[slots]`), which at 64
// sequences costs more than the attention itself. This reads each visible key and value
// row once for every query head (GQA), the cores splitting the sequences; it folds 16
// keys' scores at once (a transpose-sum, not a serial sum of 16 lanes per score), takes
// the exponentials 16 at a time, and returns the log-sum-exp as well, so that a DCP
// shard's partial attention is the same call (`dcp.merge`).
#include <omp.h>

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

constexpr int64_t kValueTile = 64;  // value rows a pass takes: 64 x 288 floats in L2

// out[h .. h + HN) [D] += sum over keys i in [i0, i1) of p[h][i] * V_i (the KV head's
// slice at `offset` of row `rows[i]`): per 16 floats of D, HN heads' sums stay in
// registers across the keys, so the output is read and written once a tile, not once a
// key: for 8 or more query heads a KV head (MLA's 16 or more share one latent row), 0.8x
// the time of one key at a time at 16 heads (`/tmp` A/B, 1 to 64 sequences), the same
// products in the same order (the same bits).
template <int HN>
inline void accumulate_values(const float* p, int64_t stride, const float* vp,
                              const int64_t* rows, int64_t i0, int64_t i1, int64_t offset,
                              int64_t dim, int64_t h, float* out) {
  for (int64_t c = 0; c < dim; c += 16) {
    vec16 acc[HN];
    for (int j = 0; j < HN; ++j) acc[j] = load16(out + (h + j) * dim + c);
    for (int64_t i = i0; i < i1; ++i) {
      const vec16 v = load16(vp + rows[i] + offset + c);
      for (int j = 0; j < HN; ++j) acc[j] += p[(h + j) * stride + i] * v;
    }
    for (int j = 0; j < HN; ++j) std::memcpy(out + (h + j) * dim + c, &acc[j], sizeof(vec16));
  }
}

// out [H, D] += sum over keys i of p[h][i] * V_i, one key at a time: each value row read
// whole and once, for every head.
// (Kept out of line, as `values_tiled`: inlined, either slowed the score loop by 1.1x.)
__attribute__((noinline)) void values_per_key(const float* p, int64_t stride, const float* vp,
                                              const int64_t* rows, int64_t n, int64_t heads,
                                              int64_t group, int64_t dim, float* out) {
  const int64_t width = heads / group * dim;
  for (int64_t i = 0; i < n; ++i) {
    const float* value = vp + rows[i];
    if (i + 2 < n)
      for (int64_t c = 0; c < width; c += 16) __builtin_prefetch(vp + rows[i + 2] + c);
    for (int64_t h = 0; h < heads; ++h) {
      const float ph = p[h * stride + i];
      const float* vh = value + h / group * dim;
      float* oh = out + h * dim;
      for (int64_t c = 0; c < dim; c += 16) {
        const vec16 r = load16(oh + c) + ph * load16(vh + c);
        std::memcpy(oh + c, &r, sizeof r);
      }
    }
  }
}

// out [H, D] += sum over keys i of p[h][i] * V_i, tiles of kValueTile keys at a time, the
// KV heads' query heads in register tiles (`accumulate_values`).
__attribute__((noinline)) void values_tiled(const float* p, int64_t stride, const float* vp,
                                            const int64_t* rows, int64_t n, int64_t kv_heads,
                                            int64_t group, int64_t dim, float* out) {
  for (int64_t i0 = 0; i0 < n; i0 += kValueTile) {  // a tile of value rows stays in cache
    const int64_t i1 = std::min(n, i0 + kValueTile);
    for (int64_t kv = 0; kv < kv_heads; ++kv) {
      for (int64_t h0 = 0; h0 < group;) {  // the KV head's query heads, 16, 8, ... at once
        const int64_t left = group - h0, h = kv * group + h0, at = kv * dim;
        const int tile = left >= 16 ? 16 : left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        switch (tile) {
          case 16: accumulate_values<16>(p, stride, vp, rows, i0, i1, at, dim, h, out); break;
          case 8: accumulate_values<8>(p, stride, vp, rows, i0, i1, at, dim, h, out); break;
          case 4: accumulate_values<4>(p, stride, vp, rows, i0, i1, at, dim, h, out); break;
          case 2: accumulate_values<2>(p, stride, vp, rows, i0, i1, at, dim, h, out); break;
          default: accumulate_values<1>(p, stride, vp, rows, i0, i1, at, dim, h, out);
        }
        h0 += tile;
      }
    }
  }
}

// One sequence: its query heads q [H, D] against its n visible keys' K and V rows
// (`rows[i]` floats into the caches, [KVH, D] each) -> out [H, D], lse [H]. Each key and
// value row is read whole and once, for every head (a KV head's slice at a time would
// read each row in four strided pieces, at four times).
void attend_sequence(const float* q, const float* kp, const float* vp, const int64_t* rows,
                     int64_t n, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                     float* out, float* lse) {
  const int64_t group = heads / kv_heads, width = kv_heads * dim;
  const int64_t stride = (n + 15) / 16 * 16;
  std::vector<float> p(heads * stride);  // scores, then probabilities [H, n]
  std::vector<vec16> acc(heads * 16);  // [H, 16 keys]: each key's products, to sum
  for (int64_t i0 = 0; i0 < n; i0 += 16) {  // 16 keys' scores at a time
    const int64_t keys = std::min<int64_t>(16, n - i0);
    for (int64_t m = i0 + 16; m < std::min<int64_t>(n, i0 + 32); ++m)  // the next 16 keys
      for (int64_t c = 0; c < width; c += 16) __builtin_prefetch(kp + rows[m] + c);
    std::fill(acc.begin(), acc.end(), vec16{});
    for (int64_t m = 0; m < keys; ++m) {
      const float* key = kp + rows[i0 + m];
      for (int64_t h = 0; h < heads; ++h) {
        const float *kh = key + h / group * dim, *qh = q + h * dim;
        vec16 a = {}, b = {};  // two chains
        int64_t c = 0;
        for (; c + 32 <= dim; c += 32) {
          a += load16(qh + c) * load16(kh + c);
          b += load16(qh + c + 16) * load16(kh + c + 16);
        }
        if (c < dim) a += load16(qh + c) * load16(kh + c);
        acc[h * 16 + m] = a + b;
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      const vec16 scores = sum_lanes16(acc.data() + h * 16) * scale;
      std::memcpy(p.data() + h * stride + i0, &scores, sizeof scores);
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* row = p.data() + h * stride;
    const float top = *std::max_element(row, row + n);
    for (int64_t i = 0; i < stride; i += 16) {  // lanes past n are computed, not summed
      const vec16 e = exp16(load16(row + i) - top);
      std::memcpy(row + i, &e, sizeof e);
    }
    float total = 0.f;
    for (int64_t i = 0; i < n; ++i) total += row[i];
    lse[h] = top + std::log(total);
    const float inv = 1.f / total;
    for (int64_t i = 0; i < n; ++i) row[i] *= inv;
  }
  std::fill(out, out + heads * dim, 0.f);
  if (group < 8)  // each value row read whole, once (faster where few heads share it)
    values_per_key(p.data(), stride, vp, rows, n, heads, group, dim, out);
  else
    values_tiled(p.data(), stride, vp, rows, n, heads / group, group, dim, out);
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
  // Fewer sequences than threads (a decode step of one chat): each sequence's heads are
  // split too, on KV-head boundaries (with one KV head, MLA's, its query heads), so every
  // core works. Each head's sums are the same either way: the same bits.
  const int64_t unit_heads = kv_heads > 1 ? group : 1;  // query heads per unit of a split
  const int64_t units = heads / unit_heads;
  int64_t parts = std::min(units, (omp_get_max_threads() + batch - 1) / batch);
  while (units % parts) --parts;
  const int64_t part_heads = heads / parts;
#pragma omp parallel for schedule(static)
  for (int64_t task = 0; task < batch * parts; ++task) {
    const int64_t b = task / parts, h0 = task % parts * part_heads;
    std::vector<int64_t> rows;  // the visible keys' rows, in floats
    rows.reserve(length);
    for (int64_t l = 0; l < length; ++l)
      if (mp[b * length + l]) rows.push_back(sp[b * length + l] * kv_heads * dim);
    if (rows.empty()) {  // no visible key: out stays 0
      std::fill(lp + b * heads + h0, lp + b * heads + h0 + part_heads,
                -std::numeric_limits<float>::infinity());
      continue;
    }
    const int64_t kv0 = h0 / group * dim;  // this part's first KV head, in floats
    attend_sequence(qp + (b * heads + h0) * dim, kp + kv0, vp + kv0, rows.data(),
                    static_cast<int64_t>(rows.size()), part_heads,
                    std::max<int64_t>(1, part_heads / group), dim, s,
                    op + (b * heads + h0) * dim, lp + b * heads + h0);
  }
  return {out, lse};
}
