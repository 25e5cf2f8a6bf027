// Products with GGUF's K-quant blocks as they are: see kquant_kernels.h.  A
// portable scalar kernel (the reference the others are tested against) and,
// on x86-64, an AVX2 one chosen at run time (every x86 kernel set uses it).
#include "kquant_kernels.h"

#include "half.h"

#include <cmath>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#define KQ_X86 1
#include <immintrin.h>
#else
#define KQ_X86 0
#endif

namespace afm_qmm {
namespace {

uint16_t load_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

// Byte offsets inside the blocks (kquant_kernels.h).
constexpr int kQ4Scales = 4, kQ4Codes = 16;
constexpr int kQ6High = 128, kQ6Scales = 192, kQ6D = 208;

// Q4_K's eight 6-bit scales (out[0..7]) and mins (out[8..15]) from its 12 bytes.
void q4k_scales_mins(const uint8_t* s, uint8_t out[16]) {
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      out[j] = s[j] & 63;
      out[8 + j] = s[j + 4] & 63;
    } else {
      out[j] = static_cast<uint8_t>((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
      out[8 + j] = static_cast<uint8_t>((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
  }
}

// A Q4_K block's 256 codes (0..15) in order.
void q4k_codes(const uint8_t* blk, uint8_t q[256]) {
  const uint8_t* qs = blk + kQ4Codes;
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) {
      q[64 * c + l] = qs[32 * c + l] & 0xF;
      q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
    }
  }
}

// A Q6_K block's 256 codes (0..63) in order: in each half of 128, byte l of
// the 64 low-nibble bytes and of the 32 high-pair bytes gives values l, l + 32,
// l + 64, l + 96.
void q6k_codes(const uint8_t* blk, uint8_t q[256]) {
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = blk + 64 * h;
    const uint8_t* qh = blk + kQ6High + 32 * h;
    uint8_t* o = q + 128 * h;
    for (int l = 0; l < 32; ++l) {
      o[l] = static_cast<uint8_t>((ql[l] & 0xF) | ((qh[l] & 3) << 4));
      o[l + 32] = static_cast<uint8_t>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4));
      o[l + 64] = static_cast<uint8_t>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
      o[l + 96] = static_cast<uint8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
    }
  }
}

size_t row_bytes(const QWeights& wt) {
  return static_cast<size_t>(wt.K / kKQuantBlock) * kquant_block_bytes(wt.kquant);
}

}  // namespace

void kquant_quantize_rows(const float* x, int K, int passes, int8_t* q, float* d, int16_t* bsums,
                          int m0, int m1) {
  const int nb = K / kKQuantBlock;
  float rest[kKQuantBlock];
  for (int m = m0; m < m1; ++m) {
    for (int b = 0; b < nb; ++b) {
      const float* src = x + static_cast<size_t>(m) * K + static_cast<size_t>(b) * kKQuantBlock;
      for (int p = 0; p < passes; ++p) {
        const float* t = p == 0 ? src : rest;
        const size_t row = static_cast<size_t>(m) * passes + p;
        int8_t* qb = q + row * K + static_cast<size_t>(b) * kKQuantBlock;
        int16_t* sb = bsums + row * (K / 16) + static_cast<size_t>(b) * 16;
        float amax = 0.0f;
        for (int i = 0; i < kKQuantBlock; ++i) amax = std::fmax(amax, std::fabs(t[i]));
        const float inv = amax > 1e-30f ? 127.0f / amax : 0.0f;
        const float scale = amax > 1e-30f ? amax / 127.0f : 0.0f;
        d[row * nb + b] = scale;
        for (int g = 0; g < 16; ++g) {
          int sum = 0;
          for (int i = 16 * g; i < 16 * g + 16; ++i) {
            const float u = t[i] * inv;
            const int v = static_cast<int>(u + (u >= 0.0f ? 0.5f : -0.5f));
            qb[i] = static_cast<int8_t>(v);
            sum += v;
          }
          sb[g] = static_cast<int16_t>(sum);
        }
        if (p + 1 < passes) {  // (rest is read above before it is written: t is src here)
          for (int i = 0; i < kKQuantBlock; ++i) rest[i] = t[i] - scale * static_cast<float>(qb[i]);
        }
      }
    }
  }
}

void kquant_dequantize_rows(const QWeights& wt, int n0, int n1, float* dst) {
  const int K = wt.K, nb = K / kKQuantBlock, bytes = kquant_block_bytes(wt.kquant);
  uint8_t q[kKQuantBlock];
  for (int n = n0; n < n1; ++n) {
    for (int b = 0; b < nb; ++b) {
      const uint8_t* blk = wt.w + static_cast<size_t>(n) * row_bytes(wt) + static_cast<size_t>(b) * bytes;
      float* out = dst + static_cast<size_t>(n - n0) * K + static_cast<size_t>(b) * kKQuantBlock;
      if (wt.kquant == 4) {
        const float dw = half_to_float(load_u16(blk)), dmin = half_to_float(load_u16(blk + 2));
        uint8_t sm[16];
        q4k_scales_mins(blk + kQ4Scales, sm);
        q4k_codes(blk, q);
        for (int j = 0; j < 8; ++j) {
          const float scale = dw * static_cast<float>(sm[j]), min = dmin * static_cast<float>(sm[8 + j]);
          for (int i = 32 * j; i < 32 * j + 32; ++i) out[i] = scale * static_cast<float>(q[i]) - min;
        }
      } else {
        const float dw = half_to_float(load_u16(blk + kQ6D));
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + kQ6Scales);
        q6k_codes(blk, q);
        for (int g = 0; g < 16; ++g) {
          const float scale = dw * static_cast<float>(sc[g]);
          for (int i = 16 * g; i < 16 * g + 16; ++i) out[i] = scale * static_cast<float>(q[i] - 32);
        }
      }
    }
  }
}

void kquant_range_scalar(const QActs& a, const QWeights& wt, float* out, int n0, int n1) {
  const int K = wt.K, N = wt.N, nb = K / kKQuantBlock, bytes = kquant_block_bytes(wt.kquant);
  const int P = a.passes, M = a.M / P;
  uint8_t q[kKQuantBlock];
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wrow = wt.w + static_cast<size_t>(n) * row_bytes(wt);
    for (int m = 0; m < M; ++m) {
      float total = 0.0f;
      for (int p = 0; p < P; ++p) {
        const size_t row = static_cast<size_t>(m) * P + p;
        const int8_t* xq = a.q + row * K;
        const float* xd = a.d + row * nb;
        const int16_t* xs = a.bsums + row * (K / 16);
        float acc = 0.0f;
        for (int b = 0; b < nb; ++b) {
          const uint8_t* blk = wrow + static_cast<size_t>(b) * bytes;
          const int8_t* x = xq + static_cast<size_t>(b) * kKQuantBlock;
          if (wt.kquant == 4) {
            uint8_t sm[16];
            q4k_scales_mins(blk + kQ4Scales, sm);
            q4k_codes(blk, q);
            int32_t sumi = 0, summ = 0;
            for (int j = 0; j < 8; ++j) {
              int32_t dot = 0;
              for (int i = 32 * j; i < 32 * j + 32; ++i) dot += q[i] * x[i];
              sumi += sm[j] * dot;
              summ += sm[8 + j] * (xs[16 * b + 2 * j] + xs[16 * b + 2 * j + 1]);
            }
            acc += half_to_float(load_u16(blk)) * xd[b] * static_cast<float>(sumi);
            acc -= half_to_float(load_u16(blk + 2)) * xd[b] * static_cast<float>(summ);
          } else {
            const int8_t* sc = reinterpret_cast<const int8_t*>(blk + kQ6Scales);
            q6k_codes(blk, q);
            int32_t sumi = 0;
            for (int g = 0; g < 16; ++g) {
              int32_t dot = 0;
              for (int i = 16 * g; i < 16 * g + 16; ++i) dot += (q[i] - 32) * x[i];
              sumi += sc[g] * dot;
            }
            acc += half_to_float(load_u16(blk + kQ6D)) * xd[b] * static_cast<float>(sumi);
          }
        }
        total += acc;
      }
      out[static_cast<size_t>(m) * N + n] = total;
    }
  }
}

#if KQ_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace {

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// Byte shuffles copying one 16-bit word over a 128-bit lane: for Q6_K, chunk
// k of 32 values takes word 2k in the low lane and 2k + 1 in the high one (its
// two scales of 16); for Q4_K, sub-block k takes word k in both (one scale
// per 32).  Tables, not vectors built per call: a row is only a few blocks.
struct Shuffles {
  alignas(32) int8_t q6k[4][32];
  alignas(32) int8_t q4k[8][32];
  Shuffles() {
    for (int k = 0; k < 4; ++k) {
      for (int i = 0; i < 32; ++i) q6k[k][i] = static_cast<int8_t>(4 * k + (i >= 16 ? 2 : 0) + (i & 1));
    }
    for (int k = 0; k < 8; ++k) {
      for (int i = 0; i < 32; ++i) q4k[k][i] = static_cast<int8_t>(2 * k + (i & 1));
    }
  }
};
const Shuffles kShuffles;

inline __m256i shuffle(const int8_t* table) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(table)); }

// A Q4_K block's 6-bit scales (bytes 0-7) and mins (8-15): four at a time in
// general registers, then one vector (not through memory: four 32-bit stores
// read back as one 128-bit load stall the store forwarding).
inline __m128i q4k_scales_mins(const uint8_t* blk) {
  uint32_t u0, u1, u2;
  std::memcpy(&u0, blk + kQ4Scales, 4);
  std::memcpy(&u1, blk + kQ4Scales + 4, 4);
  std::memcpy(&u2, blk + kQ4Scales + 8, 4);
  const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, two = 0x03030303;
  const uint64_t scales = (u0 & low6) | static_cast<uint64_t>((u2 & low4) | (((u0 >> 6) & two) << 4)) << 32;
  const uint64_t mins = (u1 & low6) | static_cast<uint64_t>(((u2 >> 4) & low4) | (((u1 >> 6) & two) << 4)) << 32;
  return _mm_set_epi64x(static_cast<int64_t>(mins), static_cast<int64_t>(scales));
}

// Half h of a Q6_K block as four vectors of 32 codes (0..63): values
// 128h + 32k .. + 31 in q[k].  Each code's two high bits move to bits 4-5
// (16-bit shifts: the masks drop what crosses bytes).
inline void q6k_half(const uint8_t* blk, int h, __m256i q[4]) {
  const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
  const __m256i ql0 = load256(blk + 64 * h), ql1 = load256(blk + 64 * h + 32);
  const __m256i qh = load256(blk + kQ6High + 32 * h);
  q[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
  q[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
  q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m30));
  q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                         _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
}

inline void prefetch_block(const uint8_t* p, int bytes) {
  for (int o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T0);
}

// R quantized activation rows (xq, xd, xb: their codes, scales per 256, sums
// per 16) times one Q6_K weight row of nb blocks: res[r].  Every row's
// arithmetic is the same whatever R is (a row's output never depends on the
// others'), and the float stage is once per block.
template <int R>
void q6k_row(const uint8_t* wrow, int nb, int pf, const int8_t* const* xq, const float* const* xd,
             const int16_t* const* xb, float* res) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = wrow + static_cast<size_t>(b) * 210;
    prefetch_block(blk + pf, 210);
    // the 16 scales as int16: 0-7 in the low lane, 8-15 in the high one
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kQ6Scales)));
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) {  // every code's -32: 32 * sum over the 16 groups of sc * (the codes' sum)
      const __m256i offs = _mm256_madd_epi16(sc16, load256(xb[r] + 16 * b));
      sumi[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offs, 5));
    }
    // each half's 8 scales in both lanes (the shuffles pick a chunk's two)
    const __m256i half_scales[2] = {_mm256_permute2x128_si256(sc16, sc16, 0x00),
                                    _mm256_permute2x128_si256(sc16, sc16, 0x11)};
    for (int h = 0; h < 2; ++h) {
      __m256i q[4];
      q6k_half(blk, h, q);
      const __m256i sch = half_scales[h];
      for (int k = 0; k < 4; ++k) {
        const __m256i s = _mm256_shuffle_epi8(sch, shuffle(kShuffles.q6k[k]));
        for (int r = 0; r < R; ++r) {
          // |q . x| per pair <= 2 * 63 * 127: no saturation
          const __m256i prod = _mm256_maddubs_epi16(q[k], load256(xq[r] + 256 * b + 128 * h + 32 * k));
          sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(prod, s));
        }
      }
    }
    const float dw = _cvtsh_ss(load_u16(blk + kQ6D));
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_set1_ps(dw * xd[r][b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) res[r] = hsum(acc[r]);
}

template <int R>
void q4k_row(const uint8_t* wrow, int nb, int pf, const int8_t* const* xq, const float* const* xd,
             const int16_t* const* xb, float* res) {
  const __m256i m4 = _mm256_set1_epi8(0xF);
  __m256 acc[R];
  __m128 accm[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    accm[r] = _mm_setzero_ps();
  }
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = wrow + static_cast<size_t>(b) * 144;
    prefetch_block(blk + pf, 144);
    const __m128i sm = q4k_scales_mins(blk);
    const __m128i mins = _mm_cvtepu8_epi16(_mm_unpackhi_epi64(sm, sm));
    const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
    const float dw = _cvtsh_ss(load_u16(blk)), dmin = _cvtsh_ss(load_u16(blk + 2));
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) {
      // the mins' term: sum over the 8 sub-blocks of m * (the codes' sum over its 32)
      const __m128i bs = _mm_hadd_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xb[r] + 16 * b)),
                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb[r] + 16 * b + 8)));
      accm[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mins, bs)), _mm_set1_ps(dmin * xd[r][b]), accm[r]);
      sumi[r] = _mm256_setzero_si256();
    }
    for (int j = 0; j < 4; ++j) {
      const __m256i qs = load256(blk + kQ4Codes + 32 * j);
      const __m256i lo = _mm256_and_si256(qs, m4), hi = _mm256_and_si256(_mm256_srli_epi16(qs, 4), m4);
      const __m256i slo = _mm256_shuffle_epi8(sc, shuffle(kShuffles.q4k[2 * j]));
      const __m256i shi = _mm256_shuffle_epi8(sc, shuffle(kShuffles.q4k[2 * j + 1]));
      for (int r = 0; r < R; ++r) {
        const int8_t* x = xq[r] + 256 * b + 64 * j;
        const __m256i plo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load256(x)), slo);
        const __m256i phi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load256(x + 32)), shi);
        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(plo, phi));
      }
    }
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_set1_ps(dw * xd[r][b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m128 m = _mm_add_ps(accm[r], _mm_movehl_ps(accm[r], accm[r]));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    res[r] = hsum(acc[r]) - _mm_cvtss_f32(m);
  }
}

template <int KQ>
void range_kq(const QActs& a, const QWeights& wt, float* out, int n0, int n1) {
  const int K = wt.K, N = wt.N, nb = K / kKQuantBlock;
  const size_t rb = row_bytes(wt);
  const int P = a.passes, M = a.M / P;
  const int per_call = 4 / P;  // output rows per row function (4 quantized rows)
  const int pf = prefetch_bytes();
  constexpr int kRowChunk = 64;  // activation rows that stay in cache per pass over the weights
  for (int mc = 0; mc < M; mc += kRowChunk) {
    const int me = M < mc + kRowChunk ? M : mc + kRowChunk;
    for (int n = n0; n < n1; ++n) {
      const uint8_t* wrow = wt.w + static_cast<size_t>(n) * rb;
      for (int m = mc; m < me; m += per_call) {
        const int R = me - m < per_call ? me - m : per_call;
        const int RQ = R * P;
        const int8_t* xq[4];
        const float* xd[4];
        const int16_t* xb[4];
        float res[4];
        for (int r = 0; r < RQ; ++r) {
          const size_t row = static_cast<size_t>(m) * P + r;
          xq[r] = a.q + row * K;
          xd[r] = a.d + row * nb;
          xb[r] = a.bsums + row * (K / 16);
        }
        auto call = [&](auto row_fn) { row_fn(wrow, nb, pf, xq, xd, xb, res); };
        if constexpr (KQ == 4) {
          switch (RQ) {
            case 4: call(q4k_row<4>); break;
            case 3: call(q4k_row<3>); break;
            case 2: call(q4k_row<2>); break;
            default: call(q4k_row<1>); break;
          }
        } else {
          switch (RQ) {
            case 4: call(q6k_row<4>); break;
            case 3: call(q6k_row<3>); break;
            case 2: call(q6k_row<2>); break;
            default: call(q6k_row<1>); break;
          }
        }
        for (int r = 0; r < R; ++r) {
          float total = res[r * P];
          if (P == 2) total += res[r * P + 1];  // the remainder's product
          out[static_cast<size_t>(m + r) * N + n] = total;
        }
      }
    }
  }
}

// 32 codes (uint8) as float32, 8 a vector.
inline void codes_as_floats(__m256i codes, __m256 v[4]) {
  const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int p = 0; p < 4; ++p) v[p] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[p]));
}

}  // namespace

// kquant_dequantize_rows's values (the same float32 operations: a product
// and a difference, never fused, as llama.cpp's and gguf's dequantization).
void kquant_dequantize_rows_avx2(const QWeights& wt, int n0, int n1, float* dst) {
  const int K = wt.K, nb = K / kKQuantBlock, bytes = kquant_block_bytes(wt.kquant);
  const __m256i m4 = _mm256_set1_epi8(0xF);
  const __m256 offset = _mm256_set1_ps(32.0f);
  for (int n = n0; n < n1; ++n) {
    for (int b = 0; b < nb; ++b) {
      const uint8_t* blk = wt.w + static_cast<size_t>(n) * row_bytes(wt) + static_cast<size_t>(b) * bytes;
      float* out = dst + static_cast<size_t>(n - n0) * K + static_cast<size_t>(b) * kKQuantBlock;
      __m256 v[4];
      if (wt.kquant == 4) {
        alignas(16) uint8_t sm[16];
        _mm_store_si128(reinterpret_cast<__m128i*>(sm), q4k_scales_mins(blk));
        const float dw = _cvtsh_ss(load_u16(blk)), dmin = _cvtsh_ss(load_u16(blk + 2));
        for (int s = 0; s < 8; ++s) {  // sub-block s: the low (even s) or high nibbles of 32 bytes
          const __m256i qs = load256(blk + kQ4Codes + 32 * (s / 2));
          codes_as_floats(_mm256_and_si256(s % 2 == 0 ? qs : _mm256_srli_epi16(qs, 4), m4), v);
          const __m256 scale = _mm256_set1_ps(dw * static_cast<float>(sm[s]));
          const __m256 min = _mm256_set1_ps(dmin * static_cast<float>(sm[8 + s]));
          for (int p = 0; p < 4; ++p) _mm256_storeu_ps(out + 32 * s + 8 * p, _mm256_sub_ps(_mm256_mul_ps(scale, v[p]), min));
        }
      } else {
        const float dw = _cvtsh_ss(load_u16(blk + kQ6D));
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + kQ6Scales);
        for (int h = 0; h < 2; ++h) {
          __m256i q[4];
          q6k_half(blk, h, q);
          for (int k = 0; k < 4; ++k) {
            const int v0 = 128 * h + 32 * k;  // this chunk's first value; its scales: sc[v0 / 16], the next
            codes_as_floats(q[k], v);
            for (int p = 0; p < 4; ++p) {
              const __m256 scale = _mm256_set1_ps(dw * static_cast<float>(sc[v0 / 16 + p / 2]));
              _mm256_storeu_ps(out + v0 + 8 * p, _mm256_mul_ps(scale, _mm256_sub_ps(v[p], offset)));
            }
          }
        }
      }
    }
  }
}

void kquant_range_avx2(const QActs& a, const QWeights& wt, float* out, int n0, int n1) {
  if (wt.kquant == 4) {
    range_kq<4>(a, wt, out, n0, n1);
  } else {
    range_kq<6>(a, wt, out, n0, n1);
  }
}
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

}  // namespace afm_qmm
