// See attention_kernels.h.  The unit of work is one (batch, key head): the
// Hq / Hkv query heads that share its keys and values, at every query
// position, go together, so each key and value row is read once for all of
// them.  An AVX2 + FMA version for
// x86-64 (chosen at run time, head sizes a multiple of 8 read contiguously)
// and a portable one.
#include "attention_kernels.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define ATTN_X86 1
#include <immintrin.h>
#else
#define ATTN_X86 0
#endif

namespace afm_attn {
namespace {

#include "fast_exp.inc"

// Keys and values: float32, or float16 read through this widening.
struct Half {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(Half h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  uint32_t exp = (h.bits >> 10) & 0x1Fu, man = h.bits & 0x3FFu, out;
  if (exp == 0x1Fu) {
    out = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    out = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    out = sign;
  } else {  // subnormal
    int e = -1;
    do {
      ++e;
      man <<= 1;
    } while ((man & 0x400u) == 0);
    out = sign | ((112u - e) << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &out, 4);
  return f;
}

inline const float* qdata(const Args& a) { return static_cast<const float*>(a.q.p); }

float* scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// A unit's rows are its query heads at each position, position-major:
// row i is head kh * rep + i % rep at position i / rep, so the keys a row sees
// (keys(i)) never decrease with i.
inline int keys_seen(const Args& a, int l) {
  if (!a.causal) return a.S;
  const int n = a.S - a.L + 1 + l;
  return n < 0 ? 0 : n;
}

// The mask's effect on score x of row (b, h, l) at key s.
inline float masked(const Args& a, int b, int h, int l, int s, float x) {
  const int64_t at = b * a.ms[0] + h * a.ms[1] + l * a.ms[2] + s * a.ms[3];
  if (a.mask_kind == MaskKind::boolean) {
    return static_cast<const uint8_t*>(a.mask)[at] ? x : -std::numeric_limits<float>::infinity();
  }
  return x + static_cast<const float*>(a.mask)[at];
}

// Softmax of sc[0..S) in place (after the mask); returns 1 / sum, or 0 when
// every position is masked (the row is then all zeros).
template <typename ExpRow>
inline float softmax_row(float* sc, int S, ExpRow exp_row) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int s = 0; s < S; ++s) mx = sc[s] > mx ? sc[s] : mx;
  if (mx == -std::numeric_limits<float>::infinity()) {
    for (int s = 0; s < S; ++s) sc[s] = 0.0f;
    return 0.0f;
  }
  return 1.0f / exp_row(sc, S, mx);
}

// ---------------------------------------------------------------- portable
template <typename T>
void unit_portable(const Args& a, int b, int kh, float* sc, float* qs, float* acc) {
  const int D = a.D, S = a.S, rep = a.Hq / a.Hkv, R = rep * a.L;
  const T* k = static_cast<const T*>(a.k.p) + b * a.k.s[0] + kh * a.k.s[1];
  const T* v = static_cast<const T*>(a.v.p) + b * a.v.s[0] + kh * a.v.s[1];
  const int64_t ks = a.k.s[2], kd = a.k.s[3], vs = a.v.s[2], vd = a.v.s[3];
  for (int i = 0; i < R; ++i) {
    const float* q = qdata(a) + b * a.q.s[0] + (kh * rep + i % rep) * a.q.s[1] + (i / rep) * a.q.s[2];
    for (int d = 0; d < D; ++d) qs[i * D + d] = q[d * a.q.s[3]] * a.scale;
  }
  for (int i = 0; i < R; ++i) {
    const int h = kh * rep + i % rep, l = i / rep, n = keys_seen(a, l);
    float* row = sc + static_cast<size_t>(i) * S;
    for (int s = 0; s < n; ++s) {
      float x = 0.0f;
      for (int d = 0; d < D; ++d) x += qs[i * D + d] * to_float(k[s * ks + d * kd]);
      row[s] = a.mask_kind == MaskKind::none ? x : masked(a, b, h, l, s, x);
    }
    const float inv = softmax_row(row, n, [](float* p, int m, float top) {
      float total = 0.0f;
      for (int s = 0; s < m; ++s) total += (p[s] = exp_nonpositive(p[s] - top));
      return total;
    });
    float* o = acc + i * D;
    for (int d = 0; d < D; ++d) o[d] = 0.0f;
    for (int s = 0; s < n; ++s) {
      const float p = row[s] * inv;
      for (int d = 0; d < D; ++d) o[d] += p * to_float(v[s * vs + d * vd]);
    }
  }
}

// ---------------------------------------------------------------- AVX2
#if ATTN_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#include "fast_exp_avx2.inc"

// Eight keys' or values' elements as float32 (float16 widened exactly).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The horizontal sums of d[0..8) as one vector, lane t the sum of d[t]:
// ((d0 + d1) + (d2 + d3)) + ((d4 + d5) + (d6 + d7)) over d[t]'s lanes, the
// same order for every lane, whatever the other vectors hold.
inline __m256 hsum8x8(const __m256* d) {
  const __m256 t0 = _mm256_hadd_ps(d[0], d[1]), t1 = _mm256_hadd_ps(d[2], d[3]);
  const __m256 t2 = _mm256_hadd_ps(d[4], d[5]), t3 = _mm256_hadd_ps(d[6], d[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Scores of one row against keys s0 .. s0 + cnt - 1 (cnt <= 8), into out:
// each key's dot product is summed by lanes over the head, then hsum8x8.
// A key's score does not depend on cnt (missing keys are zero vectors).
template <int kFull, typename T>
inline void scores8(const float* q, const T* k, int64_t ks, int nv, int cnt, float* out) {
  __m256 d[8];
  for (int t = 0; t < 8; ++t) d[t] = _mm256_setzero_ps();
  const int n = kFull ? 8 : cnt;
  for (int j = 0; j < nv; ++j) {
    const __m256 qv = _mm256_loadu_ps(q + 8 * j);
    for (int t = 0; t < n; ++t) d[t] = _mm256_fmadd_ps(qv, load8(k + t * ks + 8 * j), d[t]);
  }
  const __m256 r = hsum8x8(d);
  if (kFull) {
    _mm256_storeu_ps(out, r);
  } else {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, r);
    for (int t = 0; t < cnt; ++t) out[t] = tmp[t];
  }
}

// Value sums of one row over keys s0 .. s1 - 1, for head columns
// 8 * j0 .. 8 * (j0 + NJ) - 1: o += p[s] v[s] in key order, the accumulators
// in registers for the stretch.
template <int NJ, typename T>
inline void value_sums(const float* p, const T* v, int64_t vs, int s0, int s1, float* o) {
  __m256 acc[NJ];
  for (int j = 0; j < NJ; ++j) acc[j] = _mm256_loadu_ps(o + 8 * j);
  for (int s = s0; s < s1; ++s) {
    const __m256 ps = _mm256_set1_ps(p[s]);
    const T* vr = v + s * vs;
    for (int j = 0; j < NJ; ++j) acc[j] = _mm256_fmadd_ps(ps, load8(vr + 8 * j), acc[j]);
  }
  for (int j = 0; j < NJ; ++j) _mm256_storeu_ps(o + 8 * j, acc[j]);
}

// D % 8 == 0, k, v and q rows contiguous.  Keys go 8 at a time through the
// scores and kStretch at a time through the value sums, every row that sees
// them taking its turn while they are in the L1 cache; per row, the same
// operations in the same order whatever L is and whatever keys other rows see.
constexpr int kStretch = 32;

template <typename T>
void unit_avx2(const Args& a, int b, int kh, float* sc, float* qs, float* acc) {
  const int D = a.D, S = a.S, rep = a.Hq / a.Hkv, R = rep * a.L, nv = D / 8;
  const T* k = static_cast<const T*>(a.k.p) + b * a.k.s[0] + kh * a.k.s[1];
  const T* v = static_cast<const T*>(a.v.p) + b * a.v.s[0] + kh * a.v.s[1];
  const int64_t ks = a.k.s[2], vs = a.v.s[2];
  const __m256 scale = _mm256_set1_ps(a.scale);
  for (int i = 0; i < R; ++i) {
    const float* q = qdata(a) + b * a.q.s[0] + (kh * rep + i % rep) * a.q.s[1] + (i / rep) * a.q.s[2];
    for (int j = 0; j < nv; ++j) {
      _mm256_storeu_ps(qs + i * D + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(q + 8 * j), scale));
    }
  }
  const int most = keys_seen(a, a.L - 1);  // the keys of the last row
  // scores: rows first .. R - 1 see key s0
  int first = 0;
  for (int s0 = 0; s0 < most; s0 += 8) {
    while (first < R && keys_seen(a, first / rep) <= s0) ++first;
    for (int i = first; i < R; ++i) {
      const int cnt = keys_seen(a, i / rep) - s0;
      float* out = sc + static_cast<size_t>(i) * S + s0;
      if (cnt >= 8) {
        scores8<1>(qs + i * D, k + s0 * ks, ks, nv, 8, out);
      } else {
        scores8<0>(qs + i * D, k + s0 * ks, ks, nv, cnt, out);
      }
    }
  }
  float* inv = qs;  // the scaled queries are no longer needed
  for (int i = 0; i < R; ++i) {
    const int l = i / rep, n = keys_seen(a, l);
    float* row = sc + static_cast<size_t>(i) * S;
    if (a.mask_kind != MaskKind::none) {
      for (int s = 0; s < n; ++s) row[s] = masked(a, b, kh * rep + i % rep, l, s, row[s]);
    }
    inv[i] = softmax_row(row, n, exp_row_avx2);
  }
  // outputs: o = sum over s of e^score[s] v[s], then times 1 / sum
  for (int i = 0; i < R * D; ++i) acc[i] = 0.0f;
  first = 0;
  for (int s0 = 0; s0 < most; s0 += kStretch) {
    while (first < R && keys_seen(a, first / rep) <= s0) ++first;
    for (int i = first; i < R; ++i) {
      const int n = keys_seen(a, i / rep), s1 = n < s0 + kStretch ? n : s0 + kStretch;
      const float* p = sc + static_cast<size_t>(i) * S;
      int j = 0;
      for (; j + 4 <= nv; j += 4) value_sums<4>(p, v + 8 * j, vs, s0, s1, acc + i * D + 8 * j);
      for (; j < nv; ++j) value_sums<1>(p, v + 8 * j, vs, s0, s1, acc + i * D + 8 * j);
    }
  }
  for (int i = 0; i < R; ++i) {
    const __m256 f = _mm256_set1_ps(inv[i]);
    for (int j = 0; j < nv; ++j) {
      float* o = acc + i * D + 8 * j;
      _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_loadu_ps(o), f));
    }
  }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif

}  // namespace

void decode_attention_units(const Args& a, int u0, int u1) {
  const int D = a.D, S = a.S, rep = a.Hq / a.Hkv;
  const size_t R = static_cast<size_t>(rep) * a.L;
  float* buf = scratch(R * S + 2 * R * D);
  float* sc = buf;
  float* qs = sc + R * S;
  float* acc = qs + R * D;
#if ATTN_X86
  const bool fast = !a.portable && has_avx2() && D % 8 == 0 && a.k.s[3] == 1 &&
                    a.v.s[3] == 1 && a.q.s[3] == 1;
#else
  const bool fast = false;
#endif
  for (int u = u0; u < u1; ++u) {
    const int b = u / a.Hkv, kh = u % a.Hkv;
#if ATTN_X86
    if (fast && a.half) {
      unit_avx2<Half>(a, b, kh, sc, qs, acc);
    } else if (fast) {
      unit_avx2<float>(a, b, kh, sc, qs, acc);
    } else if (a.half) {
      unit_portable<Half>(a, b, kh, sc, qs, acc);
    } else {
      unit_portable<float>(a, b, kh, sc, qs, acc);
    }
#else
    (void)fast;
    if (a.half) {
      unit_portable<Half>(a, b, kh, sc, qs, acc);
    } else {
      unit_portable<float>(a, b, kh, sc, qs, acc);
    }
#endif
    // row i (position i / rep, head kh * rep + i % rep) to out[b, h, l]
    for (size_t i = 0; i < R; ++i) {
      const size_t h = static_cast<size_t>(kh) * rep + i % rep, l = i / rep;
      float* o = a.out + ((static_cast<size_t>(b) * a.Hq + h) * a.L + l) * D;
      std::memcpy(o, acc + i * D, sizeof(float) * D);
    }
  }
}

}  // namespace afm_attn
