// The float32 kernels: the grouped SwiGLU of `moe_kernels.grouped_gemm.grouped_swiglu` in one
// call per layer over every local expert, and a linear for the dense projections, router
// gates and lm_head, both over weights in the panel layout of `moe_kernels.panels`.
//
// A weight w [N, K] is stored as panels [N/16, K, 16]: panel p holds columns 16p..16p+15 of
// y = x @ w^T, k-major. A tile of up to kRows rows of x and kPanels panels then runs as
// outer products: per k one vector load per panel, one broadcast per row of x, and
// kRows x kPanels FMAs into accumulators that never leave the registers (the BLAS
// micro-kernel's shape). Each task reads its panels as one sequential stream, which the
// prefetchers follow at the memory's bandwidth for the 1 to 16 rows of a decode step, and
// reuses them from L1/L2 across row tiles where there are more rows (compute-bound).
//
// Vectors are GCC's vector extension: a panel row is one AVX-512 register, two AVX2 or four
// NEON ones; the extension is built with -march=native on the machine that runs it.
#include <omp.h>

#include <cmath>
#include <cstring>

#include "kernels.h"

namespace {

constexpr int64_t kPanel = 16;  // columns per panel: the layout, on any machine
typedef float pvec __attribute__((vector_size(kPanel * sizeof(float))));
#ifdef __AVX512F__
constexpr int kRows = 6, kPanels = 4;  // 24 accumulators + 4 panels + 1 broadcast of 32
#else
constexpr int kRows = 2, kPanels = 2;  // a panel row is 2 AVX2 registers: 12 of 16
#endif
constexpr int64_t kChunk = 48;  // rows a task takes at once (a multiple of kRows)

inline pvec load(const float* p) {
  pvec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, pvec v) { std::memcpy(p, &v, sizeof v); }

// y[i, 16j + l] = sum_k x[i, k] * w[j][k][l] for i < MR, j < NP: one register tile.
template <int MR, int NP>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t k_len, float* y,
                 int64_t ldy) {
  pvec acc[MR][NP] = {};
  for (int64_t k = 0; k < k_len; ++k) {
    pvec wv[NP];
    for (int j = 0; j < NP; ++j) wv[j] = load(w + (j * k_len + k) * kPanel);
    for (int i = 0; i < MR; ++i) {
      const float xi = x[i * ldx + k];
      for (int j = 0; j < NP; ++j) acc[i][j] += xi * wv[j];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NP; ++j) store(y + i * ldy + j * kPanel, acc[i][j]);
}

// Rows [0, m_len) of x against NP panels starting at w, kRows at a time.
template <int NP>
void rows(const float* x, int64_t ldx, int64_t m_len, const float* w, int64_t k_len, float* y,
          int64_t ldy) {
  for (int64_t m0 = 0; m0 < m_len; m0 += kRows) {
    const float* xm = x + m0 * ldx;
    float* ym = y + m0 * ldy;
    switch (std::min<int64_t>(kRows, m_len - m0)) {
#ifdef __AVX512F__
      case 6: tile<6, NP>(xm, ldx, w, k_len, ym, ldy); break;
      case 5: tile<5, NP>(xm, ldx, w, k_len, ym, ldy); break;
      case 4: tile<4, NP>(xm, ldx, w, k_len, ym, ldy); break;
      case 3: tile<3, NP>(xm, ldx, w, k_len, ym, ldy); break;
#endif
      case 2: tile<2, NP>(xm, ldx, w, k_len, ym, ldy); break;
      default: tile<1, NP>(xm, ldx, w, k_len, ym, ldy);
    }
  }
}

// y [m_len, 16 np] = x [m_len, K] @ np panels from w (np <= kPanels).
void panels(const float* x, int64_t ldx, int64_t m_len, const float* w, int64_t np,
            int64_t k_len, float* y, int64_t ldy) {
  switch (np) {
#ifdef __AVX512F__
    case 4: rows<4>(x, ldx, m_len, w, k_len, y, ldy); break;
    case 3: rows<3>(x, ldx, m_len, w, k_len, y, ldy); break;
#endif
    case 2: rows<2>(x, ldx, m_len, w, k_len, y, ldy); break;
    default: rows<1>(x, ldx, m_len, w, k_len, y, ldy);
  }
}

// y [M, N] = x [M, K] @ w^T, w as panels [N/16, K, 16]: the threads of the enclosing
// parallel region share the (panel group, row chunk) tasks, panel-major so that a
// thread's consecutive tasks reuse its panels from cache. Ends in the loop's barrier.
void gemm(const float* x, int64_t ldx, int64_t m_len, const float* w, int64_t n_len,
          int64_t k_len, float* y, int64_t ldy) {
  const int64_t groups = (n_len / kPanel + kPanels - 1) / kPanels;
  const int64_t chunks = (m_len + kChunk - 1) / kChunk;
#pragma omp for schedule(static)
  for (int64_t task = 0; task < groups * chunks; ++task) {
    const int64_t p0 = task / chunks * kPanels, m0 = task % chunks * kChunk;
    panels(x + m0 * ldx, ldx, std::min(kChunk, m_len - m0), w + p0 * k_len * kPanel,
           std::min<int64_t>(kPanels, n_len / kPanel - p0), k_len, y + m0 * ldy + p0 * kPanel,
           ldy);
  }
}

// act [mm, 16 np] = silu(x @ gate^T) * (x @ up^T) for np panels of gate from g and the
// same columns of up from u: one task computes both and multiplies them at once, so the
// [mm, 2I] product is never written. act's rows are I apart.
void gate_up_swiglu(const float* x, int64_t ldx, int64_t mm, const float* g, const float* u,
                    int64_t np, int64_t k_len, float* act, int64_t inter) {
  constexpr int64_t width = kPanels * kPanel;
  float gv[kChunk * width], uv[kChunk * width];
  panels(x, ldx, mm, g, np, k_len, gv, width);
  panels(x, ldx, mm, u, np, k_len, uv, width);
  for (int64_t i = 0; i < mm; ++i) {
    float* a = act + i * inter;
    const float *gi = gv + i * width, *ui = uv + i * width;
#pragma omp simd
    for (int64_t c = 0; c < np * kPanel; ++c) a[c] = gi[c] / (1.f + std::exp(-gi[c])) * ui[c];
  }
}

void check_panels(const torch::Tensor& w, int64_t dims) {
  TORCH_CHECK(w.dtype() == torch::kFloat32 && w.is_contiguous() && w.dim() == dims &&
                  w.size(-1) == kPanel,
              "weights must be contiguous float32 panels [..., N/16, K, 16]");
}

}  // namespace

// x [N, H] float32 rows grouped by local expert; counts: E_local ints summing to N;
// w_gate_up [E_local, 2I/16, H, 16] and w_down [E_local, H/16, I, 16] in panels (gate's
// panels first) -> ([N, H] float32, not weighted by the router; each local expert's start
// and end, monotonic ns, 0 0 if empty: its share of the call, `ExpertTimes`).
//
// Two parallel loops over every expert at once, with no barrier per expert (a decode step
// gives most experts 1 to 4 rows): tasks of kPanels gate and up panels by kChunk rows,
// then of kPanels down panels by kChunk rows.
std::tuple<torch::Tensor, std::vector<int64_t>> grouped_swiglu_f32(
    const torch::Tensor& x, const std::vector<int64_t>& counts, const torch::Tensor& w_gate_up,
    const torch::Tensor& w_down) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2,
              "x must be contiguous float32 [N, H]");
  check_panels(w_gate_up, 4);
  check_panels(w_down, 4);
  const int64_t n = x.size(0), hidden = x.size(1), experts = w_gate_up.size(0);
  const int64_t inter = w_down.size(2);
  TORCH_CHECK(w_gate_up.size(1) * kPanel == 2 * inter && w_gate_up.size(2) == hidden &&
                  w_down.size(1) * kPanel == hidden && w_down.size(0) == experts,
              "weights do not match the rows");
  TORCH_CHECK(inter % kPanel == 0, "I must be a multiple of 16");
  check_counts(counts, experts, n);
  ExpertTimes times(experts, omp_get_max_threads());
  torch::Tensor out = torch::empty_like(x);
  std::vector<int64_t> first(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) first[e + 1] = first[e] + counts[e];
  constexpr int64_t width = kPanels * kPanel;
  const std::vector<Tile> up = expert_tiles(counts, inter, width, kChunk);
  const std::vector<Tile> down = expert_tiles(counts, hidden, width, kChunk);
  std::vector<float> act(n * inter);  // [N, I]
  const float *xp = x.data_ptr<float>(), *gu = w_gate_up.data_ptr<float>();
  const float* dw = w_down.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  int64_t team = 1;
#pragma omp parallel
  {
    const int64_t me = omp_get_thread_num();
#pragma omp master
    team = omp_get_num_threads();
    int64_t last = monotonic_ns();
#pragma omp for schedule(static)
    for (size_t t = 0; t < up.size(); ++t) {
      const int64_t e = up[t].expert, p0 = up[t].column / kPanel, m0 = first[e] + up[t].row;
      const float* g = gu + (e * 2 * inter + p0 * kPanel) * hidden;
      gate_up_swiglu(xp + m0 * hidden, hidden, std::min(kChunk, first[e + 1] - m0), g,
                     g + inter * hidden, std::min<int64_t>(kPanels, inter / kPanel - p0),
                     hidden, act.data() + m0 * inter + p0 * kPanel, inter);
      times.spent(me, e, last);
    }
    last = monotonic_ns();  // not the barrier's wait
#pragma omp for schedule(static)
    for (size_t t = 0; t < down.size(); ++t) {
      const int64_t e = down[t].expert, p0 = down[t].column / kPanel;
      const int64_t m0 = first[e] + down[t].row;
      panels(act.data() + m0 * inter, inter, std::min(kChunk, first[e + 1] - m0),
             dw + (e * hidden + p0 * kPanel) * inter,
             std::min<int64_t>(kPanels, hidden / kPanel - p0), inter, yp + m0 * hidden + p0 * kPanel,
             hidden);
      times.spent(me, e, last);
    }
  }
  return {out, times.marks(counts, team)};
}

// x [M, K] float32 @ w^T, w as panels [N/16, K, 16] -> [M, N] float32.
torch::Tensor linear_f32(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x must be float32 [M, K]");
  check_panels(w, 3);
  TORCH_CHECK(x.size(1) == w.size(1), "x [M, K] and panels [N/16, K, 16] differ in K");
  const int64_t m_len = x.size(0), n_len = w.size(0) * kPanel, k_len = x.size(1);
  const torch::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();  // rows may be strided
  torch::Tensor y = torch::empty({m_len, n_len}, x.options());
  if (m_len == 0) return y;
  const float *xp = xc.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = xc.stride(0);
#pragma omp parallel
  gemm(xp, ldx, m_len, wp, n_len, k_len, yp, n_len);
  return y;
}

// x [T, heads, K] float32 (rows and heads may be strided) against one weight per head,
// w as panels [heads, N/16, K, 16] -> [T, heads, N]: MLA's absorbed projections, each
// head's rows through its own matrix, as one parallel loop over (head, panel group, row
// chunk) tasks.
torch::Tensor head_linear_f32(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 3 && x.stride(2) == 1,
              "x must be float32 [T, heads, K] with contiguous K");
  check_panels(w, 4);
  TORCH_CHECK(x.size(1) == w.size(0) && x.size(2) == w.size(2),
              "x [T, heads, K] and panels [heads, N/16, K, 16] differ in heads or K");
  const int64_t t = x.size(0), heads = x.size(1), k_len = x.size(2);
  const int64_t n_len = w.size(1) * kPanel;
  torch::Tensor y = torch::empty({t, heads, n_len}, x.options());
  if (t == 0) return y;
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0), hx = x.stride(1), ldy = heads * n_len;
  const int64_t groups = (n_len / kPanel + kPanels - 1) / kPanels;
  const int64_t chunks = (t + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
  for (int64_t task = 0; task < heads * groups * chunks; ++task) {
    const int64_t head = task / (groups * chunks), rest = task % (groups * chunks);
    const int64_t p0 = rest / chunks * kPanels, m0 = rest % chunks * kChunk;
    panels(xp + m0 * ldx + head * hx, ldx, std::min(kChunk, t - m0),
           wp + (head * n_len / kPanel + p0) * k_len * kPanel,
           std::min<int64_t>(kPanels, n_len / kPanel - p0), k_len,
           yp + m0 * ldy + head * n_len + p0 * kPanel, ldy);
  }
  return y;
}

// A dense weight of the compiled blocks: float32 panels (s undefined), or int8 ones with
// their column scales s (`int8_cpu.cpp`).
torch::Tensor dense_linear(const torch::Tensor& x, const torch::Tensor& w,
                           const c10::optional<torch::Tensor>& s) {
  return s ? linear_i8(x, w, *s) : linear_f32(x, w);
}

torch::Tensor dense_head_linear(const torch::Tensor& x, const torch::Tensor& w,
                                const c10::optional<torch::Tensor>& s) {
  return s ? head_linear_i8(x, w, *s) : head_linear_f32(x, w);
}
