// The float32 grouped SwiGLU of `moe_kernels.grouped_gemm.grouped_swiglu`, for the CPU, in
// one call per layer over every local expert. Decode gives an expert 1 to 16 rows, where a
// BLAS matmul reads the weights at a fraction of the memory's bandwidth: this kernel streams
// each weight row once per 4 rows of x, both cores splitting the output columns. An expert
// with more rows (a prefill) goes to torch's matmul, which is compute-bound there anyway.
//
// Vectors are GCC's vector extension, lowered to whatever the build machine has (AVX-512,
// AVX2, NEON); the extension is built with -march=native on the machine that runs it.
#include <torch/extension.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kSmallRows = 16;  // rows per expert up to which the streaming kernel runs
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float total(vec v) {
  float s = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// y[m, n] = sum_k x[m, k] * w[n, k] for m < MM <= 4, n < nn <= 4 (one register block; the
// row counts are template arguments so that the compiler unrolls the block fully).
template <int64_t MM>
inline void block(const float* x, const float* w, float* y, int64_t nn, int64_t ldy,
                  int64_t k_len) {
  vec acc[MM][4] = {};
  const float* wr[4];
  for (int64_t j = 0; j < 4; ++j) wr[j] = w + std::min(j, nn - 1) * k_len;  // repeat the last
  for (int64_t k = 0; k < k_len; k += kLanes) {
    vec wv[4];
    for (int64_t j = 0; j < 4; ++j) {
      __builtin_prefetch(wr[j] + k + 8 * kLanes);
      wv[j] = load(wr[j] + k);
    }
    for (int64_t i = 0; i < MM; ++i) {
      const vec xv = load(x + i * k_len + k);
      for (int64_t j = 0; j < 4; ++j) acc[i][j] += wv[j] * xv;
    }
  }
  for (int64_t i = 0; i < MM; ++i)
    for (int64_t j = 0; j < nn; ++j) y[i * ldy + j] = total(acc[i][j]);
}

inline void block(const float* x, const float* w, float* y, int64_t mm, int64_t nn,
                  int64_t ldy, int64_t k_len) {
  switch (mm) {
    case 1: return block<1>(x, w, y, nn, ldy, k_len);
    case 2: return block<2>(x, w, y, nn, ldy, k_len);
    case 3: return block<3>(x, w, y, nn, ldy, k_len);
    default: return block<4>(x, w, y, nn, ldy, k_len);
  }
}

// y [M, N] = x [M, K] @ w [N, K]^T, all contiguous; K a multiple of kLanes.
void linear_small(const float* x, const float* w, float* y, int64_t m_len, int64_t n_len,
                  int64_t k_len) {
#pragma omp parallel for schedule(static)
  for (int64_t n0 = 0; n0 < n_len; n0 += 4) {
    const int64_t nn = std::min<int64_t>(4, n_len - n0);
    for (int64_t m0 = 0; m0 < m_len; m0 += 4)
      block(x + m0 * k_len, w + n0 * k_len, y + m0 * n_len + n0,
            std::min<int64_t>(4, m_len - m0), nn, n_len, k_len);
  }
}

// act [M, I] = silu(gate_up[:, :I]) * gate_up[:, I:]
void swiglu(const float* gate_up, float* act, int64_t m_len, int64_t inter) {
  for (int64_t m = 0; m < m_len; ++m) {
    const float* g = gate_up + m * 2 * inter;
    float* a = act + m * inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) a[i] = g[i] / (1.f + std::exp(-g[i])) * g[inter + i];
  }
}

}  // namespace

int64_t monotonic_ns() {  // CLOCK_MONOTONIC, as Python's time.perf_counter_ns on Linux
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

// x [N, H] float32 rows grouped by local expert; counts: E_local ints summing to N;
// w_gate_up [E_local, 2I, H] (gate first); w_down [E_local, H, I] -> ([N, H] float32, not
// weighted by the router; each local expert's start and end, monotonic ns, 0 0 if empty).
std::tuple<torch::Tensor, std::vector<int64_t>> grouped_swiglu_f32(const torch::Tensor& x, const std::vector<int64_t>& counts,
                                 const torch::Tensor& w_gate_up, const torch::Tensor& w_down) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w_gate_up.dtype() == torch::kFloat32 &&
                  w_down.dtype() == torch::kFloat32, "float32 tensors only");
  TORCH_CHECK(x.is_contiguous() && w_gate_up.is_contiguous() && w_down.is_contiguous(),
              "contiguous tensors only");
  TORCH_CHECK(x.dim() == 2 && w_gate_up.dim() == 3 && w_down.dim() == 3, "bad ranks");
  const int64_t hidden = x.size(1), experts = w_gate_up.size(0);
  const int64_t inter = w_gate_up.size(1) / 2;
  TORCH_CHECK(w_gate_up.size(2) == hidden && w_down.size(1) == hidden &&
                  w_down.size(2) == inter && w_down.size(0) == experts,
              "weights do not match the rows");
  TORCH_CHECK(hidden % kLanes == 0 && inter % kLanes == 0, "H and I must be multiples of 16");
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == experts, "one count per local expert");
  int64_t rows = 0;
  for (int64_t c : counts) {
    TORCH_CHECK(c >= 0, "negative count");
    rows += c;
  }
  TORCH_CHECK(rows == x.size(0), "the counts do not sum to the rows");
  torch::Tensor out = torch::empty_like(x);
  std::vector<float> gate_up(kSmallRows * 2 * inter), act(kSmallRows * inter);
  std::vector<int64_t> marks(2 * experts, 0);
  int64_t start = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t c = counts[e];
    if (c == 0) continue;
    marks[2 * e] = monotonic_ns();
    if (c > kSmallRows) {  // a prefill's rows: torch's matmul
      const auto xs = x.narrow(0, start, c);
      const auto gu = torch::linear(xs, w_gate_up[e]).chunk(2, -1);
      out.narrow(0, start, c).copy_(torch::linear(torch::silu(gu[0]) * gu[1], w_down[e]));
    } else {
      const float* wg = w_gate_up.data_ptr<float>() + e * 2 * inter * hidden;
      const float* wd = w_down.data_ptr<float>() + e * hidden * inter;
      linear_small(x.data_ptr<float>() + start * hidden, wg, gate_up.data(), c, 2 * inter,
                   hidden);
      swiglu(gate_up.data(), act.data(), c, inter);
      linear_small(act.data(), wd, out.data_ptr<float>() + start * hidden, c, hidden, inter);
    }
    start += c;
    marks[2 * e + 1] = monotonic_ns();
  }
  return {out, marks};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("grouped_swiglu_f32", &grouped_swiglu_f32,
        "float32 grouped SwiGLU over every local expert of one layer");
}
