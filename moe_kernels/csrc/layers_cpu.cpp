// The small per-layer operations of the decode step, for the CPU in float32: RMSNorm, and
// the attention's q/k RMSNorm with rotary embedding in one pass. In torch they are 6 to 12
// tensor operations each, which at a decode step's few rows cost more in dispatch and
// allocation (about 5 us each, some 300 a step) than in arithmetic.
#include <cmath>
#include <limits>

#include "kernels.h"

namespace {

// out [H] = w * x * rsqrt(mean(x^2) + eps), as transformers' RMSNorm in float32.
inline void norm_row(const float* x, const float* w, float eps, int64_t h, float* out) {
  float sq = 0.f;
#pragma omp simd reduction(+ : sq)
  for (int64_t i = 0; i < h; ++i) sq += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sq / static_cast<float>(h) + eps);
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) out[i] = w[i] * (x[i] * inv);
}

// One head [D] of x: RMSNorm by w (if any), then rotated by cos/sin [D] (the halves
// rotated as transformers' rotate_half), into out.
inline void norm_rope_head(const float* x, const float* w, float eps, const float* cos,
                           const float* sin, int64_t d, float* out) {
  float buf[512];
  const float* v = x;
  if (w != nullptr) {
    norm_row(x, w, eps, d, buf);
    v = buf;
  }
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = v[i] * cos[i] - v[i + half] * sin[i];
  for (int64_t i = half; i < d; ++i) out[i] = v[i] * cos[i] + v[i - half] * sin[i];
}

void check_rows(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1, what,
              " must be float32 [rows, H] with contiguous rows");
}

}  // namespace

// x [R, H] float32 (rows may be strided), w [H] -> [R, H] RMSNorm'd.
torch::Tensor rms_norm_f32(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(w.dtype() == torch::kFloat32 && w.is_contiguous() && w.numel() == x.size(1),
              "w must be float32 [H]");
  const int64_t rows = x.size(0), h = x.size(1), ld = x.stride(0);
  torch::Tensor out = torch::empty({rows, h}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
#pragma omp parallel for schedule(static) if (rows >= 16)
  for (int64_t r = 0; r < rows; ++r)
    norm_row(xp + r * ld, wp, static_cast<float>(eps), h, op + r * h);
  return out;
}

// qkv [T, (heads + 2 kv_heads) D] float32 (q, k, v stacked, rows may be strided); q_norm,
// k_norm [D] or undefined (no q/k norm); cos, sin [T, D] -> (q [T, heads, D], k [T,
// kv_heads, D]): each head RMSNorm'd, then rotated.
std::tuple<torch::Tensor, torch::Tensor> qk_norm_rope_f32(
    const torch::Tensor& qkv, const c10::optional<torch::Tensor>& q_norm,
    const c10::optional<torch::Tensor>& k_norm, const torch::Tensor& cos,
    const torch::Tensor& sin, int64_t heads, int64_t kv_heads, double eps) {
  check_rows(qkv, "qkv");
  const int64_t t = qkv.size(0), d = cos.size(1);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * d, "qkv is not (heads + 2 kv) x D");
  TORCH_CHECK(d % 2 == 0 && d <= 512, "head_dim must be even and at most 512");
  for (const auto* table : {&cos, &sin})
    TORCH_CHECK(table->dtype() == torch::kFloat32 && table->is_contiguous() &&
                    table->size(0) == t, "cos and sin must be float32 [T, D]");
  const bool normed = q_norm.has_value() && q_norm->defined();
  TORCH_CHECK(normed == (k_norm.has_value() && k_norm->defined()), "both norms or neither");
  const float* qw = normed ? q_norm->contiguous().data_ptr<float>() : nullptr;
  const float* kw = normed ? k_norm->contiguous().data_ptr<float>() : nullptr;
  torch::Tensor q = torch::empty({t, heads, d}, qkv.options());
  torch::Tensor k = torch::empty({t, kv_heads, d}, qkv.options());
  const float *xp = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
  const int64_t ld = qkv.stride(0), per_token = heads + kv_heads;
  const float e = static_cast<float>(eps);
#pragma omp parallel for schedule(static) if (t >= 16)
  for (int64_t i = 0; i < t * per_token; ++i) {
    const int64_t tok = i / per_token, head = i % per_token;
    const float* x = xp + tok * ld + head * d;
    float* out = head < heads ? qp + (tok * heads + head) * d
                              : kp + (tok * kv_heads + head - heads) * d;
    norm_rope_head(x, head < heads ? qw : kw, e, cp + tok * d, sp + tok * d, d, out);
  }
  return {q, k};
}

// x [T, n, D] float32 (rows and heads may be strided, D contiguous), rotated by cos, sin
// [T, D] -> [T, n, D]: halves (x_i, x_{i + D/2}) as rotate_half, or with `interleaved`
// pairs (x_{2i}, x_{2i+1}), written as the pairs' first parts then their second parts
// (transformers' apply_rotary_pos_emb_interleave): MLA's decoupled rotary key and queries.
torch::Tensor rope_f32(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                       bool interleaved) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 3 && x.stride(2) == 1,
              "x must be float32 [T, n, D] with contiguous D");
  const int64_t t = x.size(0), n = x.size(1), d = x.size(2), half = d / 2;
  for (const auto* table : {&cos, &sin})
    TORCH_CHECK(table->dtype() == torch::kFloat32 && table->is_contiguous() &&
                    table->size(0) == t && table->size(1) == d,
                "cos and sin must be float32 [T, D]");
  TORCH_CHECK(d % 2 == 0, "the rotary dims must be even");
  torch::Tensor out = torch::empty({t, n, d}, x.options());
  const float *xp = x.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ld = x.stride(0), hs = x.stride(1);
  for (int64_t i = 0; i < t * n; ++i) {
    const int64_t tok = i / n;
    const float *v = xp + tok * ld + (i % n) * hs, *c = cp + tok * d, *s = sp + tok * d;
    float* o = op + i * d;
    if (interleaved) {
      for (int64_t j = 0; j < half; ++j) {
        o[j] = v[2 * j] * c[j] - v[2 * j + 1] * s[j];
        o[half + j] = v[2 * j + 1] * c[j] + v[2 * j] * s[j];
      }
    } else {
      for (int64_t j = 0; j < half; ++j) o[j] = v[j] * c[j] - v[j + half] * s[j];
      for (int64_t j = half; j < d; ++j) o[j] = v[j] * c[j] + v[j - half] * s[j];
    }
  }
  return out;
}

// out [T, H] = sum over rows r of weights[r] * y[r] into row src_token[r]: the MoE combine,
// y [N, H] and weights [N] float32, src_token [N] int64 in [0, T); each token's rows summed
// in their order (as `index_add_`), once, in float32.
torch::Tensor combine_f32(const torch::Tensor& y, const torch::Tensor& src_token,
                          const torch::Tensor& weights, int64_t num_tokens) {
  check_rows(y, "y");
  const int64_t n = y.size(0), h = y.size(1), ld = y.stride(0);
  TORCH_CHECK(src_token.dtype() == torch::kInt64 && src_token.dim() == 1 &&
                  src_token.size(0) == n, "src_token must be int64 [N]");
  TORCH_CHECK(weights.dtype() == torch::kFloat32 && weights.dim() == 1 && weights.size(0) == n,
              "weights must be float32 [N]");
  const torch::Tensor src = src_token.contiguous(), w = weights.contiguous();
  const int64_t* sp = src.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(sp[r] >= 0 && sp[r] < num_tokens, "src_token out of range");
  torch::Tensor out = torch::zeros({num_tokens, h}, y.options());
  const float *yp = y.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    const float* row = yp + r * ld;
    float* dst = op + sp[r] * h;
    const float wr = wp[r];
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) dst[i] += wr * row[i];
  }
  return out;
}

// DeepSeek's group-limited routers, on x [T, H] float32 against gate panels [E'/16, H, 16]
// (the first `experts` columns real) -> (topk_ids [T, K] int64, topk_weights [T, K]
// float32), as `services.attention.router` spells them in torch, operation for operation
// (the same ATen calls, so the same experts on ties and the same bits), without the
// interpreter between them: `noaux_tc` (V3: sigmoid scores plus `bias` [E] choose, a group
// scores its top two, the other groups masked to -inf, the weights the unbiased scores)
// or else V2's `group_limited_greedy` (softmax, a group scores its best, the others
// masked to 0.0); renormalised with `normalize` (+1e-20 for sigmoid), times `scaling`.
std::tuple<torch::Tensor, torch::Tensor> route_grouped_f32(
    const torch::Tensor& x, const torch::Tensor& gate_panels, int64_t experts,
    const c10::optional<torch::Tensor>& bias, bool noaux_tc, int64_t n_group,
    int64_t topk_group, int64_t top_k, bool normalize, double scaling) {
  const torch::Tensor logits = linear_f32(x, gate_panels).narrow(1, 0, experts);  // [T, E]
  const int64_t t = logits.size(0);
  TORCH_CHECK(n_group > 0 && experts % n_group == 0 && topk_group > 0 &&
                  topk_group <= n_group && top_k > 0 && top_k <= experts,
              "bad group routing sizes");
  const torch::Tensor scores = noaux_tc ? logits.sigmoid() : logits.softmax(-1);
  torch::Tensor choice = noaux_tc && bias.has_value() && bias->defined()
                             ? scores + *bias : scores;  // [T, E]
  const torch::Tensor grouped = choice.view({t, n_group, -1});
  const torch::Tensor group_scores = noaux_tc
      ? std::get<0>(grouped.topk(2, -1)).sum(-1) : std::get<0>(grouped.max(-1));
  const torch::Tensor chosen = std::get<1>(group_scores.topk(topk_group, -1, true, false));
  const torch::Tensor mask = torch::zeros_like(group_scores).scatter_(1, chosen, 1)
      .to(torch::kBool).repeat_interleave(experts / n_group, 1);  // [T, E]
  torch::Tensor ids, weights;
  if (noaux_tc) {
    choice = choice.masked_fill(mask.logical_not(),
                                -std::numeric_limits<float>::infinity());
    ids = std::get<1>(choice.topk(top_k, -1, true, false));
    weights = scores.gather(1, ids);
  } else {
    std::tie(weights, ids) = scores.masked_fill(mask.logical_not(), 0.0)
        .topk(top_k, -1, true, false);
  }
  if (normalize) weights = weights / (weights.sum(-1, true) + (noaux_tc ? 1e-20 : 0.0));
  if (scaling != 1.0) weights = weights * scaling;
  return {ids, weights};
}

// The router: x [T, H] float32 against gate panels [E'/16, H, 16] (the first `experts`
// columns real) -> (topk_ids [T, K] int64, topk_weights [T, K] float32): a softmax over
// the experts in float32, the K largest (the lower expert first on a tie), renormalised
// to sum to 1 with `normalize`. In torch that is six operations a layer.
std::tuple<torch::Tensor, torch::Tensor> route_f32(const torch::Tensor& x,
                                                   const torch::Tensor& gate_panels,
                                                   int64_t experts, int64_t top_k,
                                                   bool normalize) {
  const torch::Tensor logits = linear_f32(x, gate_panels);  // [T, E' >= E]
  const int64_t t = logits.size(0), ld = logits.size(1);
  TORCH_CHECK(experts > 0 && experts <= ld && top_k > 0 && top_k <= experts,
              "need 0 < top_k <= experts <= the gate's columns");
  torch::Tensor ids = torch::empty({t, top_k}, x.options().dtype(torch::kInt64));
  torch::Tensor weights = torch::empty({t, top_k}, x.options());
  const float* lp = logits.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* wp = weights.data_ptr<float>();
  std::vector<float> probs(experts);
  std::vector<int64_t> order(experts);
  for (int64_t r = 0; r < t; ++r) {
    const float* row = lp + r * ld;
    const float top = *std::max_element(row, row + experts);
    float total = 0.f;
    for (int64_t e = 0; e < experts; ++e) total += probs[e] = std::exp(row[e] - top);
    for (int64_t e = 0; e < experts; ++e) {
      probs[e] /= total;
      order[e] = e;
    }
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int64_t a, int64_t b) {
                        return probs[a] > probs[b] || (probs[a] == probs[b] && a < b);
                      });
    float kept = 0.f;
    for (int64_t k = 0; k < top_k; ++k) kept += probs[order[k]];
    for (int64_t k = 0; k < top_k; ++k) {
      ip[r * top_k + k] = order[k];
      wp[r * top_k + k] = normalize ? probs[order[k]] / kept : probs[order[k]];
    }
  }
  return {ids, weights};
}

// The dispatch layout's sort (`ep_dispatch.layout.sort_rows`): the T*K rows of the router's
// top-k, with destination slots key [T*K] int64 in [0, slots) and weights [T, K] float32
// -> (each row's source token, rows in slot order [T*K] int64; their weights in that
// order [T*K]; rows per slot [slots] int64). A counting sort: the order of a stable
// argsort, in one pass.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> sort_rows_cpu(
    const torch::Tensor& key, const torch::Tensor& weights, int64_t slots) {
  TORCH_CHECK(key.dtype() == torch::kInt64 && key.dim() == 1, "key must be int64 [T*K]");
  TORCH_CHECK(weights.dtype() == torch::kFloat32 && weights.dim() == 2 &&
                  weights.numel() == key.numel(), "weights must be float32 [T, K]");
  const int64_t n = key.numel(), top_k = std::max<int64_t>(1, weights.size(1));
  const torch::Tensor kc = key.contiguous(), wc = weights.contiguous();
  const int64_t* kp = kc.data_ptr<int64_t>();
  const float* wp = wc.data_ptr<float>();
  torch::Tensor counts = torch::zeros({slots}, key.options());
  int64_t* cp = counts.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(kp[r] >= 0 && kp[r] < slots, "a row's slot is out of range");
    ++cp[kp[r]];
  }
  std::vector<int64_t> next(slots + 1, 0);
  for (int64_t s = 0; s < slots; ++s) next[s + 1] = next[s] + cp[s];
  torch::Tensor src = torch::empty({n}, key.options());
  torch::Tensor sorted = torch::empty({n}, weights.options());
  int64_t* op = src.data_ptr<int64_t>();
  float* sp = sorted.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    const int64_t at = next[kp[r]]++;
    op[at] = r / top_k;
    sp[at] = wp[r];
  }
  return {src, sorted, counts};
}
