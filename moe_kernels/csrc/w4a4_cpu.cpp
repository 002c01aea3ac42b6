// The W4A4 grouped SwiGLU of `moe_kernels.grouped_gemm.grouped_swiglu_w4a4` for the CPU, in
// one call per layer over every local expert, reading the MXFP4 bytes as they are stored
// (4.25 bits per weight) and never writing a float copy of the weights.
//
// The products are exact integers. An E2M1 value doubled is one of 0, 1, 2, 3, 4, 6, 8, 12
// (with its sign), so the dot product of two 32-value blocks is an integer sum of at most
// 32 * 144 in magnitude, exact in int32 and in float32, which then takes both blocks' scales:
// 2^(x scale - 127) * 2^(w scale - 127) / 4. Only the float sum over the blocks of a row
// rounds, which is the summation order of the torch path's float32 matmul.
//
// With AVX512-VNNI four blocks at a time (`block_quad`: `vpdpbusd`, the activations
// decoded in their own order), with AVX-512 (BW, DQ) two (`block_wide`). On AVX2: one
// 16-byte load gives a block's 32 codes (low nibbles, then high nibbles: the
// activations are decoded in the same order, and a dot product does not care), `vpshufb`
// maps them to magnitudes and signs, and `vpmaddubsw` + `vpmaddwd` multiply and add them
// in 16 and 32 bits (llama.cpp's Q4 kernels do the same). Elsewhere, a scalar loop.
#include <cmath>
#include <cstring>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "kernels.h"

namespace {

constexpr int64_t kBlock = 32;
constexpr uint8_t kNanScale = 0xFF;
constexpr int8_t kDoubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
constexpr int64_t kTileRows = 64;  // rows of x per pass over an expert's weights

// 2^(byte - 128) per E8M0 byte, the scale of a doubled value (NaN for 0xFF).
struct ScaleTable {
  float v[256];
  ScaleTable() {
    for (int b = 0; b < 256; ++b) v[b] = std::ldexp(1.f, b - 128);
    v[kNanScale] = NAN;
  }
};
const ScaleTable kScales;

#if defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
constexpr bool kQuads = true;
#else
constexpr bool kQuads = false;
#endif

// Activation rows, decoded once per call: per row, K int8 doubled values and K / 32 float
// scales. In block order (each block's 16 even elements, then its 16 odd ones: the low and
// high nibbles of its bytes), or where the VNNI kernel runs (K a multiple of 128) in quad
// order: per 4 blocks, their even elements (4 x 16), then their odd ones, each value + 12
// so that it is an unsigned byte (`vpdpbusd` multiplies unsigned by signed bytes).
struct Decoded {
  std::vector<int8_t> values;
  std::vector<float> scales;
  int64_t k = 0;
  bool quads = false;
  void resize(int64_t rows, int64_t k_len) {
    k = k_len;
    quads = kQuads && k_len % (4 * kBlock) == 0;
    values.resize(rows * k_len);
    scales.resize(rows * (k_len / kBlock));
  }
  const int8_t* row(int64_t m) const { return values.data() + m * k; }
  const float* row_scales(int64_t m) const { return scales.data() + m * (k / kBlock); }
  // Row m's 32 values of block b from its 16 packed bytes, and the block's scale byte.
  void put(int64_t m, int64_t b, const uint8_t* bytes, uint8_t scale) {
    int8_t* v = values.data() + m * k;
    for (int64_t i = 0; i < kBlock / 2; ++i) {
      const int8_t even = kDoubled[bytes[i] & 0xF], odd = kDoubled[bytes[i] >> 4];
      if (quads) {
        int8_t* q = v + b / 4 * 4 * kBlock + b % 4 * (kBlock / 2) + i;
        q[0] = static_cast<int8_t>(even + 12);
        q[2 * kBlock] = static_cast<int8_t>(odd + 12);
      } else {
        v[b * kBlock + i] = even;
        v[b * kBlock + kBlock / 2 + i] = odd;
      }
    }
    scales[m * (k / kBlock) + b] = kScales.v[scale];
  }
};

// MXFP4 rows (packed [M, K/2], scales [M, K/32]) -> d's first M rows.
void decode(const uint8_t* packed, const uint8_t* scales, int64_t m_len, int64_t k_len,
            Decoded& d) {
  const int64_t blocks = k_len / kBlock;
  for (int64_t m = 0; m < m_len; ++m)
    for (int64_t b = 0; b < blocks; ++b)
      d.put(m, b, packed + m * k_len / 2 + b * kBlock / 2, scales[m * blocks + b]);
}

// One float32 row [K] -> MXFP4 by the rules of `moe_kernels.mxfp4.quantize` (OCP MX v1.0:
// X = floor(log2(amax)) - 2 clamped to [-127, 127], round to nearest E2M1 with ties to even,
// saturate at 6, NaN scale for a block with NaN or inf, the sign of zero kept).
void quantize_row(const float* x, int64_t k_len, uint8_t* packed, uint8_t* scales) {
  for (int64_t b = 0; b < k_len / kBlock; ++b) {
    const float* v = x + b * kBlock;
    float amax = 0.f;
    bool special = false;
    for (int64_t i = 0; i < kBlock; ++i) {
      special |= !std::isfinite(v[i]);
      amax = std::max(amax, std::fabs(v[i]));
    }
    int exp = -127;
    if (!special && amax > 0.f) {
      int e;
      std::frexp(amax, &e);  // amax = m 2^e, m in [0.5, 1): floor(log2(amax)) = e - 1
      exp = std::min(127, std::max(-127, e - 1 - 2));
    }
    scales[b] = special ? kNanScale : static_cast<uint8_t>(exp + 127);
    const float inv = std::ldexp(1.f, -exp);  // exact: a power of two
    uint8_t codes[kBlock];
    for (int64_t i = 0; i < kBlock; ++i) {
      const float s = v[i] * inv, mag = std::fabs(s);
      uint8_t c = (mag > 0.25f) + (mag >= 0.75f) + (mag > 1.25f) + (mag >= 1.75f) +
                  (mag > 2.5f) + (mag >= 3.5f) + (mag > 5.f);
      c |= std::signbit(s) << 3;
      codes[i] = special ? 0 : c;
    }
    for (int64_t i = 0; i < kBlock / 2; ++i)
      packed[b * kBlock / 2 + i] = codes[2 * i] | (codes[2 * i + 1] << 4);
  }
}

// One float row -> row m of d (quantize, then decode: what the down GEMM reads).
void quantize_decoded(const float* x, int64_t k_len, Decoded& d, int64_t m) {
  uint8_t packed[kBlock / 2], scale;
  for (int64_t b = 0; b < k_len / kBlock; ++b) {
    quantize_row(x + b * kBlock, kBlock, packed, &scale);
    d.put(m, b, packed, scale);
  }
}

// The codes (wr) and scale bytes (sr) of a register block's NN weight rows, of which nn
// are real: the last real row repeated in the others (computed, never stored).
template <int NN>
inline void weight_rows(const uint8_t* wp, const uint8_t* ws, int64_t nn, int64_t k_len,
                        const uint8_t** wr, const uint8_t** sr) {
  for (int j = 0; j < NN; ++j) {
    const int64_t n = std::min<int64_t>(j, nn - 1);
    wr[j] = wp + n * k_len / 2;
    sr[j] = ws + n * (k_len / kBlock);
  }
}

#ifdef __AVX2__
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// y[m, n] for m < MM, n < nn <= NN over x's decoded rows and NN weight rows of packed codes.
template <int MM, int NN>
inline void block(const Decoded& x, int64_t m0, const uint8_t* wp, const uint8_t* ws,
                  int64_t nn, float* y, int64_t ldy) {
  const int64_t k_len = x.k, blocks = k_len / kBlock;
  const __m256i mags = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12,
                                        0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12);
  const __m256i signs = _mm256_setr_epi8(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1,
                                         1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[MM][NN];
  for (int i = 0; i < MM; ++i)
    for (int j = 0; j < NN; ++j) acc[i][j] = _mm256_setzero_ps();
  const uint8_t* wr[NN];
  const uint8_t* sr[NN];
  weight_rows<NN>(wp, ws, nn, k_len, wr, sr);
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i wmag[NN], wsign[NN];
    float wscale[NN];
    for (int j = 0; j < NN; ++j) {
      __builtin_prefetch(wr[j] + b * 16 + 512);
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr[j] + b * 16));
      const __m256i codes = _mm256_and_si256(
          _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
      wmag[j] = _mm256_shuffle_epi8(mags, codes);
      wsign[j] = _mm256_shuffle_epi8(signs, codes);
      wscale[j] = kScales.v[sr[j][b]];
    }
    for (int i = 0; i < MM; ++i) {
      const __m256i xv = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(x.row(m0 + i) + b * kBlock));
      const float xscale = x.row_scales(m0 + i)[b];
      for (int j = 0; j < NN; ++j) {
        const __m256i prod = _mm256_madd_epi16(
            _mm256_maddubs_epi16(wmag[j], _mm256_sign_epi8(xv, wsign[j])), ones);  // 8 x int32
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(prod), _mm256_set1_ps(xscale * wscale[j]),
                                    acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MM; ++i)
    for (int j = 0; j < nn; ++j) y[i * ldy + j] = hsum(acc[i][j]);
}

#if defined(__AVX512BW__) && defined(__AVX512DQ__)
constexpr bool kWide = true;

// `block` two 32-blocks at a time in AVX-512 registers (K a multiple of 64): each weight
// pair's 64 codes are decoded once (magnitudes by `vpshufb`, signs as a mask that negates
// x's values), then per row one `vpmaddubsw` + `vpmaddwd` gives 16 int32 partial sums,
// lanes 0-7 the first block's and 8-15 the second's, scaled by their blocks' powers of two.
template <int MM, int NN>
inline void block_wide(const Decoded& x, int64_t m0, const uint8_t* wp, const uint8_t* ws,
                       int64_t nn, float* y, int64_t ldy) {
  const int64_t k_len = x.k, blocks = k_len / kBlock;
  const __m512i mags = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12));
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m512i sign = _mm512_set1_epi8(8), ones = _mm512_set1_epi16(1);
  const __m512i zero = _mm512_setzero_si512();
  __m512 acc[MM][NN];
  for (int i = 0; i < MM; ++i)
    for (int j = 0; j < NN; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint8_t* wr[NN];
  const uint8_t* sr[NN];
  weight_rows<NN>(wp, ws, nn, k_len, wr, sr);
  for (int64_t b = 0; b < blocks; b += 2) {
    __m512i wmag[NN];
    __mmask64 wneg[NN];
    __m512 wscale[NN];
    for (int j = 0; j < NN; ++j) {
      __builtin_prefetch(wr[j] + b * 16 + 512);
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[j] + b * 16));
      const __m256i lo = _mm256_and_si256(raw, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
      // [lo b, lo b+1, hi b, hi b+1] -> [lo b, hi b, lo b+1, hi b+1]: x's decoded order
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      const __m512i codes = _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));
      wmag[j] = _mm512_shuffle_epi8(mags, codes);
      wneg[j] = _mm512_test_epi8_mask(codes, sign);
      wscale[j] = _mm512_insertf32x8(_mm512_set1_ps(kScales.v[sr[j][b]]),
                                     _mm256_set1_ps(kScales.v[sr[j][b + 1]]), 1);
    }
    for (int i = 0; i < MM; ++i) {
      const __m512i xv = _mm512_loadu_si512(x.row(m0 + i) + b * kBlock);
      const float* xs = x.row_scales(m0 + i) + b;
      const __m512 xscale = _mm512_insertf32x8(_mm512_set1_ps(xs[0]), _mm256_set1_ps(xs[1]), 1);
      for (int j = 0; j < NN; ++j) {
        const __m512i signed_x = _mm512_mask_sub_epi8(xv, wneg[j], zero, xv);
        const __m512i prod = _mm512_madd_epi16(_mm512_maddubs_epi16(wmag[j], signed_x), ones);
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(prod), _mm512_mul_ps(xscale, wscale[j]),
                                    acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MM; ++i)
    for (int j = 0; j < nn; ++j) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i][j]);
}
#else
constexpr bool kWide = false;
template <int MM, int NN>
inline void block_wide(const Decoded& x, int64_t m0, const uint8_t* wp, const uint8_t* ws,
                       int64_t nn, float* y, int64_t ldy) {
  block<MM, NN>(x, m0, wp, ws, nn, y, ldy);
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
// 16 floats: lanes 4t..4t+3 the scale of block b + t, from the 4 blocks' scales.
inline __m512 quad_scales(__m128 four) {
  const __m512i lanes = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  return _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(four));
}

// `block` four 32-blocks (one 64-byte load of codes) at a time with AVX512-VNNI, over x in
// quad order (`Decoded`). The low nibbles of the 64 bytes are the 4 blocks' even elements,
// the high ones their odd elements; `vpshufb` maps each to its signed doubled value.
// `vpdpbusd` multiplies them by x + 12 (unsigned) and sums 4 products per int32 lane
// (lanes 4t..4t+3 block b + t), starting from -12 x the weights' own lane sums, so each
// lane ends exact: sum x * w. Then, as above, a convert and the blocks' powers of two.
template <int MM, int NN>
inline void block_quad(const Decoded& x, int64_t m0, const uint8_t* wp, const uint8_t* ws,
                       int64_t nn, float* y, int64_t ldy) {
  const int64_t k_len = x.k, blocks = k_len / kBlock;
  const __m512i table = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12));
  const __m512i low = _mm512_set1_epi8(0x0F), twelve = _mm512_set1_epi8(12);
  const __m512i zero = _mm512_setzero_si512();
  __m512 acc[MM][NN];
  for (int i = 0; i < MM; ++i)
    for (int j = 0; j < NN; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint8_t* wr[NN];
  const uint8_t* sr[NN];
  weight_rows<NN>(wp, ws, nn, k_len, wr, sr);
  for (int64_t b = 0; b < blocks; b += 4) {
    __m512i even[NN], odd[NN], start[NN];
    __m512 wscale[NN];
    for (int j = 0; j < NN; ++j) {
      __builtin_prefetch(wr[j] + b * 16 + 512);
      const __m512i raw = _mm512_loadu_si512(wr[j] + b * 16);
      even[j] = _mm512_shuffle_epi8(table, _mm512_and_si512(raw, low));
      odd[j] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
      const __m512i sums = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, twelve, even[j]),
                                               twelve, odd[j]);
      start[j] = _mm512_sub_epi32(zero, sums);
      const uint8_t* e8 = sr[j] + b;  // the 4 blocks' E8M0 bytes
      wscale[j] = quad_scales(_mm_setr_ps(kScales.v[e8[0]], kScales.v[e8[1]],
                                          kScales.v[e8[2]], kScales.v[e8[3]]));
    }
    for (int i = 0; i < MM; ++i) {
      const int8_t* xr = x.row(m0 + i) + b * kBlock;
      const __m512i xe = _mm512_loadu_si512(xr), xo = _mm512_loadu_si512(xr + 2 * kBlock);
      const __m512 xscale = quad_scales(_mm_loadu_ps(x.row_scales(m0 + i) + b));
      for (int j = 0; j < NN; ++j) {
        const __m512i prod = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start[j], xe, even[j]),
                                                 xo, odd[j]);
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(prod), _mm512_mul_ps(xscale, wscale[j]),
                                    acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MM; ++i)
    for (int j = 0; j < nn; ++j) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i][j]);
}
#else
template <int MM, int NN>
inline void block_quad(const Decoded& x, int64_t m0, const uint8_t* wp, const uint8_t* ws,
                       int64_t nn, float* y, int64_t ldy) {
  block_wide<MM, NN>(x, m0, wp, ws, nn, y, ldy);  // never called: Decoded.quads is false
}
#endif

// One register block of MM rows and up to NN columns: AVX512-VNNI's four blocks at a time
// where K allows, AVX-512's two, else AVX2's one.
template <int MM, int NN>
inline void tile(const Decoded& x, int64_t m0, const uint8_t* wp, const uint8_t* ws,
                 int64_t nn, float* y, int64_t ldy) {
  if (x.quads) block_quad<MM, NN>(x, m0, wp, ws, nn, y, ldy);
  else if (kWide && x.k % (2 * kBlock) == 0) block_wide<MM, NN>(x, m0, wp, ws, nn, y, ldy);
  else block<MM, NN>(x, m0, wp, ws, nn, y, ldy);
}
#endif

// y [c, N] (row stride ldy) = x's decoded rows [m0, m0 + c) @ w [N, K]^T, w as packed codes
// [N, K/2] and scale bytes [N, K/32]: the threads of the enclosing parallel region split
// the columns (ends in the loop's barrier).
void linear(const Decoded& x, int64_t m0, int64_t c, const uint8_t* wp, const uint8_t* ws,
            int64_t n_len, float* y, int64_t ldy) {
  const int64_t k_len = x.k, blocks = k_len / kBlock;
  for (int64_t t0 = 0; t0 < c; t0 += kTileRows) {  // x's tile stays in cache per pass
    const int64_t t_len = std::min(kTileRows, c - t0);
#pragma omp for schedule(static)
    for (int64_t n0 = 0; n0 < n_len; n0 += 4) {
      const int64_t nn = std::min<int64_t>(4, n_len - n0);
      const uint8_t* wpn = wp + n0 * k_len / 2;
      const uint8_t* wsn = ws + n0 * blocks;
#ifdef __AVX2__
      for (int64_t m = t0; m < t0 + t_len; m += 4) {
        const int64_t mm = std::min<int64_t>(4, t0 + t_len - m);
        float* ym = y + m * ldy + n0;
        const int64_t row = m0 + m;
        if (mm == 1) {
          tile<1, 4>(x, row, wpn, wsn, nn, ym, ldy);
        } else {
          for (int64_t j = 0; j < nn; j += 2) {
            const int64_t n2 = std::min<int64_t>(2, nn - j);
            const uint8_t* wpj = wpn + j * k_len / 2;
            const uint8_t* wsj = wsn + j * blocks;
            if (mm == 2) tile<2, 2>(x, row, wpj, wsj, n2, ym + j, ldy);
            else if (mm == 3) tile<3, 2>(x, row, wpj, wsj, n2, ym + j, ldy);
            else tile<4, 2>(x, row, wpj, wsj, n2, ym + j, ldy);
          }
        }
      }
#else
      for (int64_t m = t0; m < t0 + t_len; ++m)
        for (int64_t j = 0; j < nn; ++j) {
          const uint8_t* wrow = wpn + j * k_len / 2;
          const int8_t* xv = x.row(m0 + m);
          float acc = 0.f;
          for (int64_t b = 0; b < blocks; ++b) {
            int32_t sum = 0;
            for (int64_t i = 0; i < kBlock / 2; ++i) {
              const uint8_t byte = wrow[b * kBlock / 2 + i];
              sum += kDoubled[byte & 0xF] * xv[b * kBlock + i] +
                     kDoubled[byte >> 4] * xv[b * kBlock + kBlock / 2 + i];
            }
            acc += static_cast<float>(sum) * (x.row_scales(m0 + m)[b] * kScales.v[wsn[j * blocks + b]]);
          }
          y[m * ldy + n0 + j] = acc;
        }
#endif
    }
  }
}

void check_mxfp4(const torch::Tensor& packed, const torch::Tensor& scales, int64_t dims,
                 const char* what) {
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && scales.dtype() == torch::kUInt8, what,
              ": MXFP4 bytes are uint8");
  TORCH_CHECK(packed.dim() == dims && scales.dim() == dims, what, ": bad rank");
  TORCH_CHECK(packed.is_contiguous() && scales.is_contiguous(), what, ": contiguous only");
  TORCH_CHECK(packed.size(-1) % (kBlock / 2) == 0 &&
                  scales.size(-1) * kBlock == packed.size(-1) * 2, what,
              ": packed [..., K/2] and scales [..., K/32] disagree");
}

}  // namespace

// x: MXFP4 rows grouped by local expert, packed [N, H/2], scales [N, H/32] uint8; counts:
// E_local ints summing to N; gate/up: packed [E_local, 2I, H/2], scales [E_local, 2I, H/32]
// (gate first); down: packed [E_local, H, I/2], scales [E_local, H, I/32] -> ([N, H]
// float32, not weighted by the router; each expert's start and end, monotonic ns, 0 0 if
// empty). The SwiGLU output is re-quantized to MXFP4 per row, as in the torch path.
std::tuple<torch::Tensor, std::vector<int64_t>> grouped_swiglu_w4a4(
    const torch::Tensor& x_packed, const torch::Tensor& x_scales,
    const std::vector<int64_t>& counts, const torch::Tensor& gu_packed,
    const torch::Tensor& gu_scales, const torch::Tensor& down_packed,
    const torch::Tensor& down_scales) {
  check_mxfp4(x_packed, x_scales, 2, "x");
  check_mxfp4(gu_packed, gu_scales, 3, "w_gate_up");
  check_mxfp4(down_packed, down_scales, 3, "w_down");
  const int64_t n = x_packed.size(0), hidden = 2 * x_packed.size(1);
  const int64_t experts = gu_packed.size(0), inter = gu_packed.size(1) / 2;
  TORCH_CHECK(2 * gu_packed.size(2) == hidden && down_packed.size(1) == hidden &&
                  2 * down_packed.size(2) == inter && down_packed.size(0) == experts,
              "weights do not match the rows");
  check_counts(counts, experts, n);
  torch::Tensor out = torch::empty({n, hidden}, torch::kFloat32);
  std::vector<int64_t> marks(2 * experts, 0);
  const int64_t most = n ? *std::max_element(counts.begin(), counts.end()) : 0;
  Decoded xd, act;
  xd.resize(n, hidden);
  act.resize(most, inter);
  decode(x_packed.data_ptr<uint8_t>(), x_scales.data_ptr<uint8_t>(), n, hidden, xd);
  std::vector<float> gate_up(most * 2 * inter), swi(most * inter);
  const uint8_t *gp = gu_packed.data_ptr<uint8_t>(), *gs = gu_scales.data_ptr<uint8_t>();
  const uint8_t *dp = down_packed.data_ptr<uint8_t>(), *ds = down_scales.data_ptr<uint8_t>();
  float* yp = out.data_ptr<float>();
#pragma omp parallel  // one region per layer: each expert's steps end in a barrier
  each_expert(counts, marks, [&](int64_t e, int64_t start, int64_t c) {
    linear(xd, start, c, gp + e * 2 * inter * hidden / 2,
           gs + e * 2 * inter * (hidden / kBlock), 2 * inter, gate_up.data(), 2 * inter);
#pragma omp for schedule(static)
    for (int64_t m = 0; m < c; ++m) {
      const float* g = gate_up.data() + m * 2 * inter;
      float* a = swi.data() + m * inter;
      for (int64_t i = 0; i < inter; ++i) a[i] = g[i] / (1.f + std::exp(-g[i])) * g[inter + i];
      quantize_decoded(a, inter, act, m);
    }
    linear(act, 0, c, dp + e * hidden * inter / 2, ds + e * hidden * (inter / kBlock), hidden,
           yp + start * hidden, hidden);
  });
  return {out, marks};
}

// MXFP4 x (packed [M, K/2], scales [M, K/32]) @ MXFP4 w (packed [N, K/2], scales [N, K/32])^T
// -> [M, N] float32: one GEMM of the grouped kernel, on its own (the tests' exact checks).
torch::Tensor mxfp4_linear(const torch::Tensor& x_packed, const torch::Tensor& x_scales,
                           const torch::Tensor& w_packed, const torch::Tensor& w_scales) {
  check_mxfp4(x_packed, x_scales, 2, "x");
  check_mxfp4(w_packed, w_scales, 2, "w");
  TORCH_CHECK(x_packed.size(1) == w_packed.size(1), "x and w disagree on K");
  const int64_t m_len = x_packed.size(0), n_len = w_packed.size(0), k_len = 2 * x_packed.size(1);
  Decoded xd;
  xd.resize(m_len, k_len);
  decode(x_packed.data_ptr<uint8_t>(), x_scales.data_ptr<uint8_t>(), m_len, k_len, xd);
  torch::Tensor y = torch::empty({m_len, n_len}, torch::kFloat32);
#pragma omp parallel
  linear(xd, 0, m_len, w_packed.data_ptr<uint8_t>(), w_scales.data_ptr<uint8_t>(), n_len,
         y.data_ptr<float>(), n_len);
  return y;
}

// float32 x [M, K] -> MXFP4 (packed [M, K/2], scales [M, K/32] uint8), the kernel's quantizer
// on its own (checked bit for bit against `moe_kernels.mxfp4.quantize`).
std::tuple<torch::Tensor, torch::Tensor> quantize_mxfp4(const torch::Tensor& x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "float32 [M, K] only");
  TORCH_CHECK(x.size(1) % kBlock == 0, "K must be a multiple of 32");
  const torch::Tensor xc = x.contiguous();
  const int64_t m_len = x.size(0), k_len = x.size(1);
  torch::Tensor packed = torch::empty({m_len, k_len / 2}, torch::kUInt8);
  torch::Tensor scales = torch::empty({m_len, k_len / kBlock}, torch::kUInt8);
  for (int64_t m = 0; m < m_len; ++m)
    quantize_row(xc.data_ptr<float>() + m * k_len, k_len, packed.data_ptr<uint8_t>() + m * k_len / 2,
                 scales.data_ptr<uint8_t>() + m * (k_len / kBlock));
  return {packed, scales};
}
