// The 8-bit dense linears (`moe_kernels.int8`): int8 weights with one float32 scale per
// output column, against activations quantized to int8 as they come, in blocks of 32
// along K with a float32 scale each (llama.cpp's Q8_0 activations: a block's scale
// follows its own magnitudes, so one outlier costs its block's precision, not its row's).
// Each block's products are exact int32 sums; a column's output is
//
//     y[m, n] = s_w[n] * sum over blocks b of  s_x[m, b] * (sum over k in b of qx * qw)
//
// the block sums accumulated in float32 by one FMA each, in block order.
//
// With AVX512-VNNI, `vpdpbusd` multiplies 64 bytes of weights by 4 bytes of x broadcast
// (unsigned x signed, 4 products summed into each of 16 int32 lanes): x is stored as
// qx + 128 (unsigned), and the block's sum of 128 * qw, found by the same instruction on
// a vector of 128s once per panel (shared by every row), is taken off. Elsewhere a plain
// loop computes the same int32 sums, so the same bits.
//
// Weights are panels [N/16, K'/4, 16, 4] (K' = K rounded up to 32, zeros beyond): per
// panel of 16 columns and group of 4 consecutive k, the 4 weights of each column side by
// side, 64 bytes, as one `vpdpbusd` reads them.
#include <omp.h>

#include <cmath>
#include <cstring>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define SWITCHYARD_VNNI 1
#endif

#include "kernels.h"

namespace {

constexpr int64_t kPanel = 16;  // columns per panel
constexpr int64_t kBlock = 32;  // k per activation scale
constexpr int64_t kGroup = 4;   // k per vpdpbusd lane
constexpr int kRows = 4, kPanels = 2;  // a register tile: 8 int32 + 8 float accumulators
constexpr int64_t kChunk = 48;  // rows a task takes at once (a multiple of kRows)

// x's rows quantized: xq [M, K'] unsigned (q + 128), xs [M, K'/32] float32.
struct Quantized {
  std::vector<uint8_t> q;
  std::vector<float> s;
  int64_t k_pad, blocks;
};

// Rows of x [M, K] (row r at x + r * ldx) in blocks of 32: s = max|block| / 127 (1 for a
// block of zeros), q = round(x / s) within [-127, 127]; K padded with zeros.
Quantized quantize_rows(const float* x, int64_t ldx, int64_t m_len, int64_t k_len) {
  Quantized out;
  out.k_pad = (k_len + kBlock - 1) / kBlock * kBlock;
  out.blocks = out.k_pad / kBlock;
  out.q.assign(m_len * out.k_pad, 128);
  out.s.assign(m_len * out.blocks, 1.f);
  for (int64_t r = 0; r < m_len; ++r) {
    const float* row = x + r * ldx;
    for (int64_t b = 0; b < out.blocks; ++b) {
      const int64_t k0 = b * kBlock, k1 = std::min(k_len, k0 + kBlock);
      float amax = 0.f;
      for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(row[k]));
      const float s = amax > 0.f ? amax / 127.f : 1.f;
      out.s[r * out.blocks + b] = s;
      uint8_t* q = out.q.data() + r * out.k_pad;
      for (int64_t k = k0; k < k1; ++k)
        q[k] = static_cast<uint8_t>(
            128 + static_cast<int>(std::max(-127.f, std::min(127.f, std::nearbyint(row[k] / s)))));
    }
  }
  return out;
}

// y[i, 16j + l] for i < MR rows (xq + i * ldq, xs + i * lds) and j < NP panels from w
// (each `panel` bytes apart), times the columns' scales sw.
template <int MR, int NP>
void tile(const uint8_t* xq, int64_t ldq, const float* xs, int64_t lds, const int8_t* w,
          int64_t panel, int64_t blocks, const float* sw, float* y, int64_t ldy) {
  float out[MR][NP][kPanel];
#ifdef SWITCHYARD_VNNI
  __m512 facc[MR][NP];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NP; ++j) facc[i][j] = _mm512_setzero_ps();
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i acc[MR][NP], corr[NP];
    for (int j = 0; j < NP; ++j) {
      corr[j] = _mm512_setzero_si512();
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_setzero_si512();
    }
    for (int64_t g = 0; g < kBlock / kGroup; ++g) {
      const int64_t k = b * kBlock + g * kGroup;
      __m512i wv[NP];
      for (int j = 0; j < NP; ++j) {
        wv[j] = _mm512_loadu_si512(w + j * panel + k * kPanel);
        corr[j] = _mm512_dpbusd_epi32(corr[j], bias, wv[j]);
      }
      for (int i = 0; i < MR; ++i) {
        int32_t four;
        std::memcpy(&four, xq + i * ldq + k, sizeof four);
        const __m512i xb = _mm512_set1_epi32(four);
        for (int j = 0; j < NP; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], xb, wv[j]);
      }
    }
    for (int i = 0; i < MR; ++i) {
      const __m512 s = _mm512_set1_ps(xs[i * lds + b]);
      for (int j = 0; j < NP; ++j)
        facc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][j], corr[j])),
                                     s, facc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NP; ++j) _mm512_storeu_ps(out[i][j], facc[i][j]);
#else
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NP; ++j)
      for (int l = 0; l < kPanel; ++l) out[i][j][l] = 0.f;
  for (int64_t b = 0; b < blocks; ++b)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NP; ++j) {
        int32_t acc[kPanel] = {};
        for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k) {
          const int32_t xk = static_cast<int32_t>(xq[i * ldq + k]) - 128;
          const int8_t* wk = w + j * panel + k / kGroup * kGroup * kPanel + k % kGroup;
          for (int l = 0; l < kPanel; ++l) acc[l] += xk * wk[l * kGroup];
        }
        const float s = xs[i * lds + b];
        for (int l = 0; l < kPanel; ++l)
          out[i][j][l] = std::fma(static_cast<float>(acc[l]), s, out[i][j][l]);
      }
#endif
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NP; ++j)
      for (int l = 0; l < kPanel; ++l)
        y[i * ldy + j * kPanel + l] = out[i][j][l] * sw[j * kPanel + l];
}

template <int NP>
void rows(const uint8_t* xq, int64_t ldq, const float* xs, int64_t lds, int64_t m_len,
          const int8_t* w, int64_t panel, int64_t blocks, const float* sw, float* y,
          int64_t ldy) {
  for (int64_t m0 = 0; m0 < m_len; m0 += kRows) {
    const uint8_t* q = xq + m0 * ldq;
    const float* s = xs + m0 * lds;
    float* ym = y + m0 * ldy;
    switch (std::min<int64_t>(kRows, m_len - m0)) {
      case 4: tile<4, NP>(q, ldq, s, lds, w, panel, blocks, sw, ym, ldy); break;
      case 3: tile<3, NP>(q, ldq, s, lds, w, panel, blocks, sw, ym, ldy); break;
      case 2: tile<2, NP>(q, ldq, s, lds, w, panel, blocks, sw, ym, ldy); break;
      default: tile<1, NP>(q, ldq, s, lds, w, panel, blocks, sw, ym, ldy);
    }
  }
}

// One matrix: y [M, N] (rows ldy apart) from the quantized rows (xq + m * ldq, xs + m *
// lds), w panels [N/16, K'/4, 16, 4], sw [N]; the enclosing parallel region's threads
// share its (panel pair, row chunk) tasks.
void gemm(const uint8_t* xq, int64_t ldq, const float* xs, int64_t lds, int64_t m_len,
          const int8_t* w, const float* sw, int64_t n_len, int64_t k_pad, float* y,
          int64_t ldy) {
  const int64_t panels = n_len / kPanel, panel = k_pad * kPanel, blocks = k_pad / kBlock;
  const int64_t groups = (panels + kPanels - 1) / kPanels;
  const int64_t chunks = (m_len + kChunk - 1) / kChunk;
#pragma omp for schedule(static)
  for (int64_t task = 0; task < groups * chunks; ++task) {
    const int64_t p0 = task / chunks * kPanels, m0 = task % chunks * kChunk;
    const int64_t mm = std::min(kChunk, m_len - m0);
    const int8_t* wp = w + p0 * panel;
    float* yp = y + m0 * ldy + p0 * kPanel;
    if (panels - p0 >= 2)
      rows<2>(xq + m0 * ldq, ldq, xs + m0 * lds, lds, mm, wp, panel, blocks, sw + p0 * kPanel,
              yp, ldy);
    else
      rows<1>(xq + m0 * ldq, ldq, xs + m0 * lds, lds, mm, wp, panel, blocks, sw + p0 * kPanel,
              yp, ldy);
  }
}

// w [..., N/16, K'/4, 16, 4] int8 and s [..., N]: `dims` the weight's.
void check_int8(const torch::Tensor& w, const torch::Tensor& s, int64_t dims) {
  TORCH_CHECK(w.dtype() == torch::kInt8 && w.is_contiguous() && w.dim() == dims &&
                  w.size(-2) == kPanel && w.size(-1) == kGroup &&
                  w.size(-3) * kGroup % kBlock == 0,
              "weights must be contiguous int8 panels [..., N/16, K'/4, 16, 4], K' a multiple "
              "of 32");
  TORCH_CHECK(s.dtype() == torch::kFloat32 && s.is_contiguous() && s.dim() == dims - 3 &&
                  s.size(-1) == w.size(-4) * kPanel && (dims == 4 || s.size(0) == w.size(0)),
              "scales must be contiguous float32 [..., N] (N the panels' columns)");
}

}  // namespace

// x [M, K] float32 (rows may be strided) @ (w * s)^T, w int8 panels [N/16, K'/4, 16, 4]
// and s [N] float32, each column's scale -> [M, N] float32.
torch::Tensor linear_i8(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& s) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "x must be float32 [M, K] with contiguous rows");
  check_int8(w, s, 4);
  const int64_t m_len = x.size(0), k_len = x.size(1), n_len = w.size(0) * kPanel;
  const int64_t k_pad = w.size(1) * kGroup;
  TORCH_CHECK(k_len <= k_pad && k_pad - k_len < kBlock,
              "x [M, K] and panels [N/16, K'/4, 16, 4] differ in K");
  torch::Tensor y = torch::empty({m_len, n_len}, x.options());
  if (m_len == 0) return y;
  const Quantized q = quantize_rows(x.data_ptr<float>(), x.stride(0), m_len, k_len);
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#pragma omp parallel
  gemm(q.q.data(), k_pad, q.s.data(), q.blocks, m_len, wp, sp, n_len, k_pad, yp, n_len);
  return y;
}

// x [T, heads, K] float32 through one int8 matrix per head: panels [heads, N/16, K'/4, 16,
// 4], scales [heads, N] -> [T, heads, N] (MLA's absorbed projections).
torch::Tensor head_linear_i8(const torch::Tensor& x, const torch::Tensor& w,
                             const torch::Tensor& s) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 3, "x must be float32 [T, heads, K]");
  check_int8(w, s, 5);
  TORCH_CHECK(x.size(1) == w.size(0), "x [T, heads, K] and the panels differ in heads");
  const int64_t t = x.size(0), heads = x.size(1), k_len = x.size(2);
  const int64_t n_len = w.size(1) * kPanel, k_pad = w.size(2) * kGroup;
  TORCH_CHECK(k_len <= k_pad && k_pad - k_len < kBlock,
              "x [T, heads, K] and the panels differ in K");
  torch::Tensor y = torch::empty({t, heads, n_len}, x.options());
  if (t == 0) return y;
  const torch::Tensor xc = x.contiguous();  // row (t, head) at t * heads + head
  const Quantized q = quantize_rows(xc.data_ptr<float>(), k_len, t * heads, k_len);
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t per_head = w[0].numel();
#pragma omp parallel
  for (int64_t h = 0; h < heads; ++h)  // (each head's loop ends in a barrier)
    gemm(q.q.data() + h * k_pad, heads * k_pad, q.s.data() + h * q.blocks, heads * q.blocks,
         t, wp + h * per_head, sp + h * n_len, n_len, k_pad, yp + h * n_len, heads * n_len);
  return y;
}
