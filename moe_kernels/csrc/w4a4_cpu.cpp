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
#include <omp.h>

#include <algorithm>
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
// How far ahead the VNNI kernel prefetches, in weight rows (4 per panel): a decode step's
// experts are cold in cache (16 rows against 512 bytes ahead: 0.84x the time of a layer
// at 1 to 16 tokens, measured over 8 layers' weights in turn, before panels).
constexpr int64_t kPrefetchRows = 16;


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

// Activation rows, decoded once per call: per row, K int8 doubled values and their scales.
// In block order (each block's 16 even elements, then its 16 odd ones: the low and high
// nibbles of its bytes) with one float scale per block; or where the VNNI kernel runs (K a
// multiple of 128) in quad order: per 4 blocks, their even elements (4 x 16), then their
// odd ones. `block_quad`'s int32 lane l of a quad holds 4 even and 4 odd elements of block
// l / 4, so a quad row also keeps, per lane, the block's scale and -12 x the lane's sum of
// values: `vpdpbusd` multiplies unsigned by signed bytes, the weights are decoded as
// w + 12 (unsigned), and sum (w + 12) x - 12 sum x = sum w x, exactly.
struct Decoded {
  std::vector<int8_t> values;   // [rows, K]
  std::vector<float> scales;    // [rows, K / 32], or in quad order [rows, K / 32 * 4]
  std::vector<int32_t> starts;  // quad order only: [rows, K / 32 * 4]
  int64_t k = 0;
  int64_t lanes = 1;  // per block, in `scales` and `starts`: 4 in quad order
  bool quads = false;
  void resize(int64_t rows, int64_t k_len) {
    k = k_len;
    quads = kQuads && k_len % (4 * kBlock) == 0;
    lanes = quads ? 4 : 1;
    values.resize(rows * k_len);
    scales.resize(rows * (k_len / kBlock) * lanes);
    if (quads) starts.resize(rows * (k_len / kBlock) * lanes);
  }
  const int8_t* row(int64_t m) const { return values.data() + m * k; }
  const float* row_scales(int64_t m) const { return scales.data() + m * (k / kBlock) * lanes; }
  const int32_t* row_starts(int64_t m) const { return starts.data() + m * (k / kBlock) * lanes; }
  // Row m's 32 values of block b from its 16 packed bytes, and the block's scale byte.
  void put(int64_t m, int64_t b, const uint8_t* bytes, uint8_t scale) {
    int8_t* v = values.data() + m * k;
    if (!quads) {
      for (int64_t i = 0; i < kBlock / 2; ++i) {
        v[b * kBlock + i] = kDoubled[bytes[i] & 0xF];
        v[b * kBlock + kBlock / 2 + i] = kDoubled[bytes[i] >> 4];
      }
      scales[m * (k / kBlock) + b] = kScales.v[scale];
      return;
    }
    int8_t* q = v + b / 4 * 4 * kBlock + b % 4 * (kBlock / 2);
    const int64_t lane0 = m * (k / kBlock) * 4 + b * 4;  // the block's 4 lanes of its quad
    for (int64_t l = 0; l < 4; ++l) {
      int32_t sum = 0;
      for (int64_t i = 4 * l; i < 4 * l + 4; ++i) {
        const int8_t even = kDoubled[bytes[i] & 0xF], odd = kDoubled[bytes[i] >> 4];
        q[i] = even;
        q[2 * kBlock + i] = odd;
        sum += even + odd;
      }
      starts[lane0 + l] = -12 * sum;
      scales[lane0 + l] = kScales.v[scale];
    }
  }
};

// MXFP4 row m (packed [.., K/2], scales [.., K/32]) -> row m of d.
void decode_row(const uint8_t* packed, const uint8_t* scales, int64_t m, Decoded& d) {
  const int64_t blocks = d.k / kBlock;
  for (int64_t b = 0; b < blocks; ++b)
    d.put(m, b, packed + m * d.k / 2 + b * kBlock / 2, scales[m * blocks + b]);
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
// 16 floats, lane 4t + j the scale 2^(byte - 128) of column j's block t of a quad (NaN for
// 0xFF), from a panel's 16 scale bytes (block-major: `as_panels`): widened, then
// `vscalefps` (exact, denormals included).
inline __m512 quad_weight_scales(const uint8_t* e8) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(e8));
  const __m512i bytes = _mm512_cvtepu8_epi32(raw);
  const __m512 s = _mm512_scalef_ps(_mm512_set1_ps(1.f), _mm512_cvtepi32_ps(
      _mm512_sub_epi32(bytes, _mm512_set1_epi32(128))));
  const __mmask16 nan = _mm_cmpeq_epi8_mask(raw, _mm_set1_epi8(char(kNanScale)));
  return nan ? _mm512_mask_mov_ps(s, nan, _mm512_set1_ps(NAN)) : s;
}

// Per 128-bit lane t, [sum of p0's 4 int32, p1's, p2's, p3's]: lane 4t + j the sum of p_j's
// lanes 4t..4t+3 (a block's products), exact.
inline __m512i sum_lanes(const __m512i* p) {
  const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(p[0], p[1]),
                                       _mm512_unpackhi_epi32(p[0], p[1]));
  const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2], p[3]),
                                       _mm512_unpackhi_epi32(p[2], p[3]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
}

// `block` for MM rows and one panel of 4 columns (`as_panels`: per quad of 4 blocks, the 4
// columns' 64 bytes of codes one after another, so the panel is one sequential read),
// with AVX512-VNNI, over x in quad order (`Decoded`). The low nibbles of a column's 64
// bytes are its 4 blocks' even elements, the high ones their odd elements; `vpermb` maps
// each to its doubled value + 12 (0..24, unsigned). `vpdpbusd` multiplies them by x's
// signed values and sums 4 products per int32 lane (lanes 4t..4t+3 block t), starting
// from x's -12 x lane sums, so each lane ends exact: sum x * w. The 4 columns' lanes are
// then summed per block (`sum_lanes`, still exact), so one convert and one multiply by
// the blocks' powers of two (x's times the weights') serve all 4 columns.
template <int MM>
inline void block_quad(const Decoded& x, int64_t m0, const uint8_t* wp, const uint8_t* ws,
                       int64_t nn, float* y, int64_t ldy) {
  const int64_t k_len = x.k, blocks = k_len / kBlock;
  const __m512i table = _mm512_broadcast_i32x4(
      _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  [[maybe_unused]] const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[MM];  // lane 4t + j: column j, every quad's block t
  for (int i = 0; i < MM; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; b += 4) {
    const uint8_t* codes = wp + b * 64;  // the quad's 4 x 64 bytes
    __m512i even[4], odd[4];
    for (int j = 0; j < 4; ++j) {
      __builtin_prefetch(codes + j * 64 + kPrefetchRows * k_len / 2);
      const __m512i raw = _mm512_loadu_si512(codes + j * 64);
#ifdef __AVX512VBMI__  // vpermb reads 6 index bits: the table repeats every 16, no mask
      even[j] = _mm512_permutexvar_epi8(raw, table);
      odd[j] = _mm512_permutexvar_epi8(_mm512_srli_epi16(raw, 4), table);
#else
      even[j] = _mm512_shuffle_epi8(table, _mm512_and_si512(raw, low));
      odd[j] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
#endif
    }
    const __m512 wscale = quad_weight_scales(ws + b * 4);
    for (int i = 0; i < MM; ++i) {
      const int8_t* xr = x.row(m0 + i) + b * kBlock;
      const __m512i xe = _mm512_loadu_si512(xr), xo = _mm512_loadu_si512(xr + 2 * kBlock);
      const __m512i start = _mm512_loadu_si512(x.row_starts(m0 + i) + b * 4);
      const __m512 xscale = _mm512_loadu_ps(x.row_scales(m0 + i) + b * 4);
      __m512i prod[4];
      for (int j = 0; j < 4; ++j)
        prod[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, even[j], xe), odd[j], xo);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum_lanes(prod)),
                               _mm512_mul_ps(xscale, wscale), acc[i]);
    }
  }
  for (int i = 0; i < MM; ++i) {  // column j: the sum of lanes j, 4 + j, 8 + j, 12 + j
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(acc[i]),
                                      _mm512_extractf32x8_ps(acc[i], 1));
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
    alignas(16) float out[4];
    _mm_store_ps(out, four);
    for (int j = 0; j < nn; ++j) y[i * ldy + j] = out[j];
  }
}
#else
template <int MM>
inline void block_quad(const Decoded& x, int64_t m0, const uint8_t* wp, const uint8_t* ws,
                       int64_t nn, float* y, int64_t ldy) {
  block_wide<MM, 4>(x, m0, wp, ws, nn, y, ldy);  // never called: Decoded.quads is false
}
#endif

// One register block of MM rows and up to NN columns where the VNNI kernel does not run:
// AVX-512's two blocks at a time where K allows, else AVX2's one.
template <int MM, int NN>
inline void tile(const Decoded& x, int64_t m0, const uint8_t* wp, const uint8_t* ws,
                 int64_t nn, float* y, int64_t ldy) {
  if (kWide && x.k % (2 * kBlock) == 0) block_wide<MM, NN>(x, m0, wp, ws, nn, y, ldy);
  else block<MM, NN>(x, m0, wp, ws, nn, y, ldy);
}
#endif

// y [c, N] (row stride ldy) = x's decoded rows [m0, m0 + c) @ w [N, K]^T, w as packed codes
// [N, K/2] and scale bytes [N, K/32], on the calling thread: callers split the columns.
void columns(const Decoded& x, int64_t m0, int64_t c, const uint8_t* wp, const uint8_t* ws,
             int64_t n_len, float* y, int64_t ldy) {
  const int64_t k_len = x.k, blocks = k_len / kBlock;
  for (int64_t t0 = 0; t0 < c; t0 += kTileRows) {  // x's tile stays in cache per pass
    const int64_t t_len = std::min(kTileRows, c - t0);
    for (int64_t n0 = 0; n0 < n_len; n0 += 4) {
      const int64_t nn = std::min<int64_t>(4, n_len - n0);
      const uint8_t* wpn = wp + n0 * k_len / 2;
      const uint8_t* wsn = ws + n0 * blocks;
#ifdef __AVX2__
      for (int64_t m = t0; m < t0 + t_len; m += 4) {
        const int64_t mm = std::min<int64_t>(4, t0 + t_len - m);
        float* ym = y + m * ldy + n0;
        const int64_t row = m0 + m;
        if (x.quads) {
          if (mm == 1) block_quad<1>(x, row, wpn, wsn, nn, ym, ldy);
          else if (mm == 2) block_quad<2>(x, row, wpn, wsn, nn, ym, ldy);
          else if (mm == 3) block_quad<3>(x, row, wpn, wsn, nn, ym, ldy);
          else block_quad<4>(x, row, wpn, wsn, nn, ym, ldy);
        } else if (mm == 1) {
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

// MXFP4 weights as the kernel reads them: N columns of K, codes and scale bytes. As stored
// ([..., N, K/2], [..., N, K/32]), or where the VNNI kernel runs (K a multiple of 128) as
// panels of 4 columns: codes [..., N/4, K/128, 4, 64], per quad of 4 blocks the 4 columns'
// 64 bytes one after another, and scales [..., N/4, K/128, 4, 4], per quad its 4 blocks'
// bytes of the 4 columns (block-major). A panel is one sequential read (as stored, a
// register block's 4 columns are 4 interleaved reads 1 row apart, which the prefetchers
// follow poorly: 1.35-1.4x the time of a decode step's experts, measured cold).
struct Weights {
  torch::Tensor packed, scales;
  int64_t n, k;
};

// Plain weights [lead..., N, K/2] + [lead..., N, K/32] (lead: 0 or 1 dims) -> panels, N
// padded to a multiple of 4 with zero columns; as they are where the VNNI kernel does not
// run. Panels are taken as they are.
Weights as_panels(const torch::Tensor& packed, const torch::Tensor& scales, int64_t lead,
                  const char* what) {
  if (packed.dim() == lead + 4) {
    TORCH_CHECK(packed.dtype() == torch::kUInt8 && scales.dtype() == torch::kUInt8 &&
                    packed.is_contiguous() && scales.is_contiguous(),
                what, ": contiguous uint8 panels only");
    TORCH_CHECK(kQuads, what, ": MXFP4 panels are read by the AVX512-VNNI kernel only");
    TORCH_CHECK(scales.dim() == lead + 4 && packed.size(-2) == 4 && packed.size(-1) == 64 &&
                    scales.size(-2) == 4 && scales.size(-1) == 4 &&
                    packed.sizes().slice(0, lead + 2) == scales.sizes().slice(0, lead + 2),
                what, ": panels [..., N/4, K/128, 4, 64] and [..., N/4, K/128, 4, 4] disagree");
    return {packed, scales, 4 * packed.size(lead), 4 * kBlock * packed.size(lead + 1)};
  }
  check_mxfp4(packed, scales, lead + 2, what);
  const int64_t n = packed.size(-2), k = 2 * packed.size(-1);
  if (!kQuads || k % (4 * kBlock)) return {packed, scales, n, k};
  const int64_t n4 = (n + 3) / 4 * 4, quads = k / (4 * kBlock);
  const torch::Tensor p = torch::constant_pad_nd(packed, {0, 0, 0, n4 - n});
  const torch::Tensor s = torch::constant_pad_nd(scales, {0, 0, 0, n4 - n});
  std::vector<int64_t> pshape(packed.sizes().begin(), packed.sizes().begin() + lead);
  std::vector<int64_t> sshape = pshape, order;
  for (int64_t d = 0; d < lead; ++d) order.push_back(d);
  pshape.insert(pshape.end(), {n4 / 4, 4, quads, 4 * kBlock / 2});  // [.., N/4, j, q, 64]
  sshape.insert(sshape.end(), {n4 / 4, 4, quads, 4});               // [.., N/4, j, q, t]
  std::vector<int64_t> porder = order, sorder = order;
  porder.insert(porder.end(), {lead, lead + 2, lead + 1, lead + 3});  // -> [.., N/4, q, j, 64]
  sorder.insert(sorder.end(), {lead, lead + 2, lead + 3, lead + 1});  // -> [.., N/4, q, t, j]
  return {p.view(pshape).permute(porder).contiguous(),
          s.view(sshape).permute(sorder).contiguous(), n4, k};
}

}  // namespace

// x: MXFP4 rows grouped by local expert, packed [N, H/2], scales [N, H/32] uint8; counts:
// E_local ints summing to N; gate/up: packed [E_local, 2I, H/2], scales [E_local, 2I, H/32]
// (gate first); down: packed [E_local, H, I/2], scales [E_local, H, I/32] -> ([N, H]
// float32, not weighted by the router; each expert's start and end, monotonic ns, 0 0 if
// empty: its share of the call, `ExpertTimes`). The SwiGLU output is re-quantized to MXFP4
// per row, as in the torch path.
//
// Two parallel loops over every expert at once, with no barrier per expert (a decode step
// gives most experts 1 to 4 rows, too little work to split between threads on its own):
// tiles of 32 gate and 32 up columns, each ending in its SwiGLU and 32-block re-quantized;
// then tiles of `kDownColumns` down columns.
std::tuple<torch::Tensor, std::vector<int64_t>> grouped_swiglu_w4a4(
    const torch::Tensor& x_packed, const torch::Tensor& x_scales,
    const std::vector<int64_t>& counts, const torch::Tensor& gu_packed,
    const torch::Tensor& gu_scales, const torch::Tensor& down_packed,
    const torch::Tensor& down_scales) {
  constexpr int64_t kDownColumns = 64;
  check_mxfp4(x_packed, x_scales, 2, "x");
  const Weights gu_w = as_panels(gu_packed, gu_scales, 1, "w_gate_up");
  const Weights down_w = as_panels(down_packed, down_scales, 1, "w_down");
  const int64_t n = x_packed.size(0), hidden = 2 * x_packed.size(1);
  const int64_t experts = gu_w.packed.size(0), inter = gu_w.n / 2;
  TORCH_CHECK(gu_w.k == hidden && down_w.n == hidden && down_w.k == inter &&
                  down_w.packed.size(0) == experts && inter % kBlock == 0,
              "weights do not match the rows");
  check_counts(counts, experts, n);
  torch::Tensor out = torch::empty({n, hidden}, torch::kFloat32);
  std::vector<int64_t> first(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) first[e + 1] = first[e] + counts[e];
  const int64_t most = n ? *std::max_element(counts.begin(), counts.end()) : 0;
  const std::vector<Tile> up = expert_tiles(counts, inter, kBlock, n + 1);
  const std::vector<Tile> down = expert_tiles(counts, hidden, kDownColumns, n + 1);
  Decoded xd, act;
  xd.resize(n, hidden);
  act.resize(n, inter);
  const int64_t hb = hidden / kBlock, ib = inter / kBlock;  // blocks per row
  const uint8_t *xp = x_packed.data_ptr<uint8_t>(), *xs = x_scales.data_ptr<uint8_t>();
  const uint8_t *gp = gu_w.packed.data_ptr<uint8_t>(), *gs = gu_w.scales.data_ptr<uint8_t>();
  const uint8_t *dp = down_w.packed.data_ptr<uint8_t>(), *ds = down_w.scales.data_ptr<uint8_t>();
  float* yp = out.data_ptr<float>();
  ExpertTimes times(experts, omp_get_max_threads());
  int64_t team = 1;
#pragma omp parallel
  {
    const int64_t me = omp_get_thread_num();
#pragma omp master
    team = omp_get_num_threads();
    std::vector<float> gu(most * 2 * kBlock);  // [rows, 32 gate + 32 up]
    float swi[kBlock];
    uint8_t packed[kBlock / 2], scale;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < n; ++m) decode_row(xp, xs, m, xd);
    int64_t last = monotonic_ns();
#pragma omp for schedule(dynamic, 4)
    for (size_t t = 0; t < up.size(); ++t) {
      const int64_t e = up[t].expert, i0 = up[t].column, c = counts[e];
      const uint8_t* gpe = gp + e * 2 * inter * hidden / 2;
      const uint8_t* gse = gs + e * 2 * inter * hb;
      columns(xd, first[e], c, gpe + i0 * hidden / 2, gse + i0 * hb, kBlock, gu.data(),
              2 * kBlock);
      columns(xd, first[e], c, gpe + (inter + i0) * hidden / 2, gse + (inter + i0) * hb,
              kBlock, gu.data() + kBlock, 2 * kBlock);
      for (int64_t m = 0; m < c; ++m) {
        const float* g = gu.data() + m * 2 * kBlock;
        for (int64_t i = 0; i < kBlock; ++i) swi[i] = g[i] / (1.f + std::exp(-g[i])) * g[kBlock + i];
        quantize_row(swi, kBlock, packed, &scale);
        act.put(first[e] + m, i0 / kBlock, packed, scale);
      }
      times.spent(me, e, last);
    }
    last = monotonic_ns();  // not the barrier's wait
#pragma omp for schedule(dynamic, 4)
    for (size_t t = 0; t < down.size(); ++t) {
      const int64_t e = down[t].expert, n0 = down[t].column;
      columns(act, first[e], counts[e], dp + (e * hidden + n0) * inter / 2,
              ds + (e * hidden + n0) * ib, std::min(kDownColumns, hidden - n0),
              yp + first[e] * hidden + n0, hidden);
      times.spent(me, e, last);
    }
  }
  return {out, times.marks(counts, team)};
}

// MXFP4 x (packed [M, K/2], scales [M, K/32]) @ MXFP4 w (packed [N, K/2], scales [N, K/32])^T
// -> [M, N] float32: one GEMM of the grouped kernel, on its own (the tests' exact checks).
torch::Tensor mxfp4_linear(const torch::Tensor& x_packed, const torch::Tensor& x_scales,
                           const torch::Tensor& w_packed, const torch::Tensor& w_scales) {
  check_mxfp4(x_packed, x_scales, 2, "x");
  check_mxfp4(w_packed, w_scales, 2, "w");
  TORCH_CHECK(x_packed.size(1) == w_packed.size(1), "x and w disagree on K");
  const int64_t m_len = x_packed.size(0), n_len = w_packed.size(0), k_len = 2 * x_packed.size(1);
  const Weights w = as_panels(w_packed, w_scales, 0, "w");
  Decoded xd;
  xd.resize(m_len, k_len);
  for (int64_t m = 0; m < m_len; ++m)
    decode_row(x_packed.data_ptr<uint8_t>(), x_scales.data_ptr<uint8_t>(), m, xd);
  torch::Tensor y = torch::empty({m_len, n_len}, torch::kFloat32);
  const uint8_t *wp = w.packed.data_ptr<uint8_t>(), *ws = w.scales.data_ptr<uint8_t>();
#pragma omp parallel for schedule(static)
  for (int64_t n0 = 0; n0 < n_len; n0 += 16)
    columns(xd, 0, m_len, wp + n0 * k_len / 2, ws + n0 * (k_len / kBlock),
            std::min<int64_t>(16, n_len - n0), y.data_ptr<float>() + n0, n_len);
  return y;
}

// MXFP4 weights (packed [..., N, K/2], scales [..., N, K/32], uint8) -> the layout the
// kernels read: panels (`as_panels`) where the VNNI kernel runs and K is a multiple of
// 128 (N a multiple of 4), else the same tensors. Made once at load (`moe_kernels.panels`).
std::tuple<torch::Tensor, torch::Tensor> w4a4_panels(const torch::Tensor& packed,
                                                     const torch::Tensor& scales) {
  TORCH_CHECK(packed.dim() >= 2 && packed.dim() <= 3, "packed [N, K/2] or [E, N, K/2]");
  TORCH_CHECK(packed.size(-2) % 4 == 0, "panels need N a multiple of 4");
  const Weights w = as_panels(packed, scales, packed.dim() - 2, "w");
  return {w.packed, w.scales};
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
