// See attention_kernels.h.  The unit of work is one (batch, key head): the
// Hq / Hkv query heads that share its keys and values go together, so each
// key and value row is read once for all of them.  An AVX2 + FMA version for
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

constexpr int kMaxRep = 16;  // query heads per key head handled in one pass

// e^x for x <= 0 (scores minus their maximum), to about 2 ulp: x = n ln2 + r,
// |r| <= ln2 / 2, a degree-6 polynomial for e^r, 2^n put in the exponent.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_nonpositive(float x) {
  if (x < -87.0f) return 0.0f;
  const float n = std::nearbyint(x * kLog2e);
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = kP[0];
  for (int i = 1; i < 6; ++i) p = p * r + kP[i];
  p = p * r * r + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, 4);
  return p;
}

float* scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// The mask's effect on score (row r of this unit, position s).
inline float masked(const Args& a, int b, int h, int s, float x) {
  const int64_t at = b * a.ms[0] + h * a.ms[1] + s * a.ms[2];
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
void unit_portable(const Args& a, int b, int kh, float* sc, float* qs, float* acc) {
  const int D = a.D, S = a.S, rep = a.Hq / a.Hkv;
  const float* k = a.k.p + b * a.k.s[0] + kh * a.k.s[1];
  const float* v = a.v.p + b * a.v.s[0] + kh * a.v.s[1];
  const int64_t ks = a.k.s[2], kd = a.k.s[3], vs = a.v.s[2], vd = a.v.s[3];
  for (int r = 0; r < rep; ++r) {
    const int h = kh * rep + r;
    const float* q = a.q.p + b * a.q.s[0] + h * a.q.s[1];
    for (int d = 0; d < D; ++d) qs[r * D + d] = q[d * a.q.s[3]] * a.scale;
  }
  for (int r = 0; r < rep; ++r) {
    const int h = kh * rep + r;
    float* row = sc + static_cast<size_t>(r) * S;
    for (int s = 0; s < S; ++s) {
      float x = 0.0f;
      for (int d = 0; d < D; ++d) x += qs[r * D + d] * k[s * ks + d * kd];
      row[s] = a.mask_kind == MaskKind::none ? x : masked(a, b, h, s, x);
    }
    const float inv = softmax_row(row, S, [](float* p, int n, float m) {
      float total = 0.0f;
      for (int s = 0; s < n; ++s) total += (p[s] = exp_nonpositive(p[s] - m));
      return total;
    });
    float* o = acc + r * D;
    for (int d = 0; d < D; ++d) o[d] = 0.0f;
    for (int s = 0; s < S; ++s) {
      const float p = row[s] * inv;
      for (int d = 0; d < D; ++d) o[d] += p * v[s * vs + d * vd];
    }
  }
}

// ---------------------------------------------------------------- AVX2
#if ATTN_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

inline float hsum8(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

inline __m256 exp8(__m256 x) {  // exp_nonpositive on 8 lanes
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP[i]));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  p = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
  return _mm256_andnot_ps(under, p);
}

float exp_row_avx2(float* p, int n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 tot = _mm256_setzero_ps();
  int s = 0;
  for (; s + 8 <= n; s += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + s), mv));
    _mm256_storeu_ps(p + s, e);
    tot = _mm256_add_ps(tot, e);
  }
  float total = hsum8(tot);
  for (; s < n; ++s) total += (p[s] = exp_nonpositive(p[s] - m));
  return total;
}

// D % 8 == 0, k, v and q rows contiguous.
void unit_avx2(const Args& a, int b, int kh, float* sc, float* qs, float* acc) {
  const int D = a.D, S = a.S, rep = a.Hq / a.Hkv, nv = D / 8;
  const float* k = a.k.p + b * a.k.s[0] + kh * a.k.s[1];
  const float* v = a.v.p + b * a.v.s[0] + kh * a.v.s[1];
  const int64_t ks = a.k.s[2], vs = a.v.s[2];
  const __m256 scale = _mm256_set1_ps(a.scale);
  for (int r = 0; r < rep; ++r) {
    const float* q = a.q.p + b * a.q.s[0] + (kh * rep + r) * a.q.s[1];
    for (int j = 0; j < nv; ++j) {
      _mm256_storeu_ps(qs + r * D + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(q + 8 * j), scale));
    }
  }
  // scores: each key row once for every query head of this key head
  for (int s = 0; s < S; ++s) {
    const float* kr = k + s * ks;
    __m256 dots[kMaxRep];
    for (int r = 0; r < rep; ++r) dots[r] = _mm256_setzero_ps();
    for (int j = 0; j < nv; ++j) {
      const __m256 kv = _mm256_loadu_ps(kr + 8 * j);
      for (int r = 0; r < rep; ++r) {
        dots[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + r * D + 8 * j), kv, dots[r]);
      }
    }
    for (int r = 0; r < rep; ++r) sc[static_cast<size_t>(r) * S + s] = hsum8(dots[r]);
  }
  float inv[kMaxRep];
  for (int r = 0; r < rep; ++r) {
    float* row = sc + static_cast<size_t>(r) * S;
    if (a.mask_kind != MaskKind::none) {
      for (int s = 0; s < S; ++s) row[s] = masked(a, b, kh * rep + r, s, row[s]);
    }
    inv[r] = softmax_row(row, S, exp_row_avx2);
  }
  // outputs: each value row once for every query head
  for (int i = 0; i < rep * D; ++i) acc[i] = 0.0f;
  for (int s = 0; s < S; ++s) {
    const float* vr = v + s * vs;
    for (int j = 0; j < nv; ++j) {
      const __m256 vv = _mm256_loadu_ps(vr + 8 * j);
      for (int r = 0; r < rep; ++r) {
        float* o = acc + r * D + 8 * j;
        _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_set1_ps(sc[static_cast<size_t>(r) * S + s]),
                                            vv, _mm256_loadu_ps(o)));
      }
    }
  }
  for (int r = 0; r < rep; ++r) {
    const __m256 f = _mm256_set1_ps(inv[r]);
    for (int j = 0; j < nv; ++j) {
      float* o = acc + r * D + 8 * j;
      _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_loadu_ps(o), f));
    }
  }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

bool has_avx2() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return yes;
}
#endif

}  // namespace

void decode_attention_units(const Args& a, int u0, int u1) {
  const int D = a.D, S = a.S, rep = a.Hq / a.Hkv;
  float* buf = scratch(static_cast<size_t>(rep) * S + 2 * static_cast<size_t>(rep) * D);
  float* sc = buf;
  float* qs = sc + static_cast<size_t>(rep) * S;
  float* acc = qs + static_cast<size_t>(rep) * D;
#if ATTN_X86
  const bool fast = has_avx2() && D % 8 == 0 && rep <= kMaxRep && a.k.s[3] == 1 &&
                    a.v.s[3] == 1 && a.q.s[3] == 1;
#else
  const bool fast = false;
#endif
  for (int u = u0; u < u1; ++u) {
    const int b = u / a.Hkv, kh = u % a.Hkv;
#if ATTN_X86
    if (fast) {
      unit_avx2(a, b, kh, sc, qs, acc);
    } else {
      unit_portable(a, b, kh, sc, qs, acc);
    }
#else
    (void)fast;
    unit_portable(a, b, kh, sc, qs, acc);
#endif
    float* o = a.out + (static_cast<size_t>(b) * a.Hq + static_cast<size_t>(kh) * rep) * D;
    std::memcpy(o, acc, sizeof(float) * rep * D);
  }
}

}  // namespace afm_attn
