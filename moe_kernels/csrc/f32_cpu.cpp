// The float32 kernels: the grouped SwiGLU of `moe_kernels.grouped_gemm.grouped_swiglu` in one
// call per layer over every local expert, and a linear for the dense projections and
// lm_head. Decode gives a matmul 1 to 64 rows, where a BLAS call reads the weights at a
// fraction of the memory's bandwidth: these kernels stream each weight row from memory
// once (4 rows of x at a time in registers, the rest from L1), both cores splitting the
// output columns. An expert with more rows (a prefill) goes to torch's matmul, which is
// compute-bound there anyway.
//
// Vectors are GCC's vector extension at the machine's width (AVX-512, AVX2, NEON); the
// extension is built with -march=native on the machine that runs it.
#include <cmath>
#include <cstring>

#include "kernels.h"

namespace {

#ifdef __AVX512F__
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;  // AVX2's 256 bits, or two NEON registers
#endif
constexpr int64_t kSmallRows = 64;  // rows per expert up to which the streaming kernel runs
constexpr int64_t kLinearRows = 64;  // rows up to which `linear_f32` streams
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

// y[m, n] = sum_k x[m, k] * w[n, k] for m < MM, n < nn <= NN: one register block of MM x NN
// accumulators (MM * NN + NN + 1 vectors: within AVX2's 16 registers).
template <int64_t MM, int64_t NN>
inline void block(const float* x, const float* w, float* y, int64_t nn, int64_t ldy,
                  int64_t k_len) {
  vec acc[MM][NN] = {};
  const float* wr[NN];
  for (int64_t j = 0; j < NN; ++j) wr[j] = w + std::min(j, nn - 1) * k_len;  // repeat the last
  for (int64_t k = 0; k < k_len; k += kLanes) {
    vec wv[NN];
    for (int64_t j = 0; j < NN; ++j) {
      __builtin_prefetch(wr[j] + k + 16 * kLanes);
      wv[j] = load(wr[j] + k);
    }
    for (int64_t i = 0; i < MM; ++i) {
      const vec xv = load(x + i * k_len + k);
      for (int64_t j = 0; j < NN; ++j) acc[i][j] += wv[j] * xv;
    }
  }
  for (int64_t i = 0; i < MM; ++i)
    for (int64_t j = 0; j < nn; ++j) y[i * ldy + j] = total(acc[i][j]);
}

constexpr int64_t kCols = 4;  // columns per task: 4 x 1 and 2 x 2 register blocks

// Columns [n0, n0 + nn) of every row: the weight rows stream in once, then stay in L1
// while the rest of x's rows pass them.
inline void columns(const float* x, const float* w, float* y, int64_t m_len, int64_t nn,
                    int64_t ldy, int64_t k_len) {
  for (int64_t m0 = 0; m0 < m_len; m0 += 4) {
    const int64_t mm = std::min<int64_t>(4, m_len - m0);
    const float* xm = x + m0 * k_len;
    float* ym = y + m0 * ldy;
    switch (mm) {
      case 1: block<1, 4>(xm, w, ym, nn, ldy, k_len); break;
      case 2:
        block<2, 2>(xm, w, ym, std::min<int64_t>(nn, 2), ldy, k_len);
        if (nn > 2) block<2, 2>(xm, w + 2 * k_len, ym + 2, nn - 2, ldy, k_len);
        break;
      default:
        for (int64_t j = 0; j < nn; j += 2) {
          const int64_t n2 = std::min<int64_t>(2, nn - j);
          if (mm == 3) block<3, 2>(xm, w + j * k_len, ym + j, n2, ldy, k_len);
          else block<4, 2>(xm, w + j * k_len, ym + j, n2, ldy, k_len);
        }
    }
  }
}

// y [M, N] = x [M, K] @ w [N, K]^T, all contiguous; K a multiple of kLanes.
void linear_small(const float* x, const float* w, float* y, int64_t m_len, int64_t n_len,
                  int64_t k_len) {
#pragma omp parallel for schedule(static)
  for (int64_t n0 = 0; n0 < n_len; n0 += kCols)
    columns(x, w + n0 * k_len, y + n0, m_len, std::min<int64_t>(kCols, n_len - n0), n_len,
            k_len);
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

// x [N, H] float32 rows grouped by local expert; counts: E_local ints summing to N;
// w_gate_up [E_local, 2I, H] (gate first); w_down [E_local, H, I] -> ([N, H] float32, not
// weighted by the router; each local expert's start and end, monotonic ns, 0 0 if empty).
std::tuple<torch::Tensor, std::vector<int64_t>> grouped_swiglu_f32(
    const torch::Tensor& x, const std::vector<int64_t>& counts, const torch::Tensor& w_gate_up,
    const torch::Tensor& w_down) {
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
  TORCH_CHECK(hidden % 16 == 0 && inter % 16 == 0, "H and I must be multiples of 16");
  check_counts(counts, experts, x.size(0));
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

// x [M, K] float32 @ w [N, K]^T float32 -> [M, N] float32: streamed for M up to 64 rows,
// torch's matmul beyond (and for K not a multiple of 16).
torch::Tensor linear_f32(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32,
              "float32 tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], w [N, K]");
  const int64_t m_len = x.size(0), n_len = w.size(0), k_len = x.size(1);
  if (m_len > kLinearRows || k_len % 16 || !w.is_contiguous()) return torch::linear(x, w);
  const torch::Tensor xc = x.contiguous();
  torch::Tensor y = torch::empty({m_len, n_len}, x.options());
  if (m_len) linear_small(xc.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), m_len,
                          n_len, k_len);
  return y;
}
