// See prefill_attention.h.  The unit of work is one (batch row, key head) and
// a block of about kRows query rows: the Hq / Hkv query heads sharing that key
// head at consecutive positions (row i: position l0 + i / rep, head
// kh * rep + i % rep), so each tile of keys and values is unpacked once for
// all of them and stays in the L1/L2 cache while they use it.  Per tile:
//
//   Sc = Qs . Kt           (the scaled queries against the tile's keys)
//   mask; per row: m' = max(m, max Sc), c = e^(m - m'), P = e^(Sc - m'),
//   l = l c + sum P, O = O c + P . Vt
//
// and at the end out = O / l.  The blocks of a causal call get less work
// the earlier they are: they are handed out last positions first, so the
// threads finish together.  The per-tile arithmetic (the two products, the
// exponentials) has a SIMD version per instruction set
// (prefill_attention_simd.inc) and a portable one; the tiling, masks and
// unpacking are shared.
#include "prefill_attention.h"

#include "half.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include "cpu_task.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

#if defined(__x86_64__) || defined(_M_X64)
#define PATTN_X86 1
#include <immintrin.h>
#else
#define PATTN_X86 0
#endif

namespace afm_pattn {
namespace {

namespace mx = mlx::core;

constexpr int kKT = 64;    // keys per tile
constexpr int kRows = 64;  // query rows per block, about (whole positions of rep heads)
constexpr int kMR = 6;     // rows per register tile of the SIMD products
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Below this many multiply-adds a job stays on the calling thread.
constexpr double kMinWork = 1.0e6;

enum class Kind : int { f32 = 0, f16 = 1, quant = 2 };
enum class MaskKind : int { none = 0, boolean = 1, additive = 2 };

// Keys or values of the cache: data (B, Hkv, S, *) and, quantized, the scales
// and biases (B, Hkv, S, n / group), strides in elements.
struct Src {
  Kind kind = Kind::f32;
  const void* p = nullptr;
  int64_t s[4] = {};
  const float* sc = nullptr;
  const float* bi = nullptr;
  int64_t ss[4] = {}, bs[4] = {};
};

struct Args {
  const float* q = nullptr;
  int64_t qs[4] = {};
  Src k, v;
  MaskKind mask_kind = MaskKind::none;
  const void* mask = nullptr;  // broadcast to (B, Hq, L, S)
  int64_t ms[4] = {};
  int B = 0, Hq = 0, Hkv = 0, L = 0, S = 0, D = 0, Dv = 0, bits = 0, group = 0;
  bool causal = false;
  int window = 0;
  float scale = 1.0f;
  float* out = nullptr;  // (B, Hq, L, Dv), contiguous
};

// The per-tile arithmetic of one instruction set.
struct Kernels {
  void (*qk)(const float* qs, int D, const float* kt, float* sc, int R);
  void (*pv)(const float* p, const float* vt, int Dv, float* o, int R, int n);
  float (*exp_tile)(float* p, float m);
  float (*max_tile)(const float* p, float m);
  // kt[d * kKT + j] = k[j * ks + d] for the n <= kKT keys j and d < D
  void (*pack_keys)(const float* k, int64_t ks, int D, int n, float* kt);
  // dst[0..n) = src[0..n), float16 widened to float32 (exactly)
  void (*widen)(const uint16_t* src, int n, float* dst);
  void (*scale_row)(float* o, int Dv, float c);
};

#include "fast_exp.inc"

using afm_qmm::half_to_float;

// ---------------------------------------------------------------- portable
// Plain loops, the innermost over contiguous columns (a compiler vectorizes
// them); the oracle the SIMD versions are tested against, and the path of
// CPUs without one.
namespace portable {

void qk(const float* qs, int D, const float* kt, float* sc, int R) {
  for (int i = 0; i < R; ++i) {
    float* row = sc + i * kKT;
    for (int j = 0; j < kKT; ++j) row[j] = 0.0f;
    for (int d = 0; d < D; ++d) {
      const float x = qs[i * D + d];
      const float* k = kt + d * kKT;
      for (int j = 0; j < kKT; ++j) row[j] += x * k[j];
    }
  }
}

void pv(const float* p, const float* vt, int Dv, float* o, int R, int n) {
  for (int i = 0; i < R; ++i) {
    float* out = o + i * Dv;
    for (int j = 0; j < n; ++j) {
      const float w = p[i * kKT + j];
      const float* v = vt + j * Dv;
      for (int c = 0; c < Dv; ++c) out[c] += w * v[c];
    }
  }
}

float exp_tile(float* p, float m) {
  float total = 0.0f;
  for (int j = 0; j < kKT; ++j) total += (p[j] = exp_nonpositive(p[j] - m));
  return total;
}

float max_tile(const float* p, float m) {
  for (int j = 0; j < kKT; ++j) m = p[j] > m ? p[j] : m;
  return m;
}

void pack_keys(const float* k, int64_t ks, int D, int n, float* kt) {
  for (int j = 0; j < n; ++j) {
    for (int d = 0; d < D; ++d) kt[d * kKT + j] = k[j * ks + d];
  }
}

void widen(const uint16_t* src, int n, float* dst) {
  for (int i = 0; i < n; ++i) dst[i] = half_to_float(src[i]);
}

void scale_row(float* o, int Dv, float c) {
  for (int j = 0; j < Dv; ++j) o[j] *= c;
}

constexpr Kernels kKernels = {qk, pv, exp_tile, max_tile, pack_keys, widen, scale_row};

}  // namespace portable

// ---------------------------------------------------------------- AVX2 + FMA
#if PATTN_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace avx2 {

#include "fast_exp_avx2.inc"

struct V {
  using T = __m256;
  static constexpr int W = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T x) { _mm256_storeu_ps(p, x); }
  static T bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static float hmax(T x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
  }
  static T exp(T x) { return exp8(x); }
  static float hsum(T x) { return hsum8(x); }
};

#include "prefill_attention_simd.inc"

}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// ---------------------------------------------------------------- AVX-512
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
// (GCC 12's AVX-512 headers trip -Wuninitialized on their own _mm512_undefined_*)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
namespace avx512 {

// fast_exp.inc's exponential on 16 lanes (-inf and anything below -87 give 0).
inline __m512 exp16(__m512 x) {
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP[i]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
  p = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), p);
}

struct V {
  using T = __m512;
  static constexpr int W = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T x) { _mm512_storeu_ps(p, x); }
  static T bcast(const float* p) { return _mm512_set1_ps(*p); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static float hmax(T x) { return _mm512_reduce_max_ps(x); }
  static T exp(T x) { return exp16(x); }
  static float hsum(T x) { return _mm512_reduce_add_ps(x); }
};

#include "prefill_attention_simd.inc"

}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

bool has_avx512() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && has_avx2();
  }();
  return yes;
}
#endif  // PATTN_X86

// The path for the kernel set named `isa` (the extension's setting) and this
// CPU: "scalar" (and any set without a SIMD version here) runs the portable
// loops; a SIMD path needs value rows of whole vectors.
const Kernels& kernels_for(const char* isa, int Dv, const char** name) {
  const std::string want = isa != nullptr ? isa : "";
#if PATTN_X86
  if (want == "avx512-vnni" && has_avx512() && Dv % 16 == 0) {
    *name = "avx512";
    return avx512::kKernels;
  }
  if ((want == "avx2" || want == "avx2-vnni" || want == "avx512-vnni") && has_avx2() &&
      Dv % 8 == 0) {
    *name = "avx2";
    return avx2::kKernels;
  }
#endif
  (void)want;
  (void)Dv;
  *name = "portable";
  return portable::kKernels;
}

// ---------------------------------------------------------------- tiles
float* scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}


// Row (b, kh, s) of x, n elements, as floats into out.
void load_row(const Src& x, int n, int b, int kh, int s, int bits, int group, float* out) {
  const int64_t at = b * x.s[0] + kh * x.s[1] + s * x.s[2];
  switch (x.kind) {
    case Kind::f32: {
      const float* p = static_cast<const float*>(x.p) + at;
      if (x.s[3] == 1) {
        std::memcpy(out, p, sizeof(float) * n);
      } else {
        for (int d = 0; d < n; ++d) out[d] = p[d * x.s[3]];
      }
      return;
    }
    case Kind::f16: {
      const uint16_t* p = static_cast<const uint16_t*>(x.p) + at;
      for (int d = 0; d < n; ++d) out[d] = half_to_float(p[d * x.s[3]]);
      return;
    }
    case Kind::quant: {
      const uint32_t* w = static_cast<const uint32_t*>(x.p) + at;
      const float* sc = x.sc + b * x.ss[0] + kh * x.ss[1] + s * x.ss[2];
      const float* bi = x.bi + b * x.bs[0] + kh * x.bs[1] + s * x.bs[2];
      const int per = 32 / bits;
      const uint32_t lim = (1u << bits) - 1u;
      for (int d = 0; d < n; ++d) {
        const uint32_t word = w[(d / per) * x.s[3]];
        const uint32_t qv = (word >> ((d % per) * bits)) & lim;
        const int g = d / group;
        out[d] = sc[g * x.ss[3]] * static_cast<float>(qv) + bi[g * x.bs[3]];
      }
      return;
    }
  }
}

// The keys (transposed: kt[d * kKT + j] is key t0 + j) and values (vt[j * Dv +
// c]) of the tile t0 .. t0 + n - 1; the keys' missing columns are zeros.
void pack_tile(const Args& a, const Kernels& K, int b, int kh, int t0, int n, float* kt,
               float* vt, float* row) {
  const int D = a.D, Dv = a.Dv;
  if (a.k.kind == Kind::f32 && a.k.s[3] == 1 && a.v.s[3] == 1) {  // (the cache's own layout)
    const int64_t ks = a.k.s[2], vs = a.v.s[2];
    const float* k = static_cast<const float*>(a.k.p) + b * a.k.s[0] + kh * a.k.s[1] + t0 * ks;
    const float* v = static_cast<const float*>(a.v.p) + b * a.v.s[0] + kh * a.v.s[1] + t0 * vs;
    K.pack_keys(k, ks, D, n, kt);
    for (int j = 0; j < n; ++j) std::memcpy(vt + static_cast<size_t>(j) * Dv, v + j * vs, sizeof(float) * Dv);
  } else if (a.k.kind == Kind::f16 && a.k.s[3] == 1 && a.v.s[3] == 1) {  // a float16 cache
    const int64_t ks = a.k.s[2], vs = a.v.s[2];
    const uint16_t* k = static_cast<const uint16_t*>(a.k.p) + b * a.k.s[0] + kh * a.k.s[1] + t0 * ks;
    const uint16_t* v = static_cast<const uint16_t*>(a.v.p) + b * a.v.s[0] + kh * a.v.s[1] + t0 * vs;
    for (int j = 0; j < n; ++j) {
      K.widen(k + j * ks, D, row + static_cast<size_t>(j) * D);
      K.widen(v + j * vs, Dv, vt + static_cast<size_t>(j) * Dv);
    }
    K.pack_keys(row, D, D, n, kt);
  } else {
    for (int j = 0; j < n; ++j) {
      load_row(a.k, D, b, kh, t0 + j, a.bits, a.group, row);
      for (int d = 0; d < D; ++d) kt[d * kKT + j] = row[d];
      load_row(a.v, Dv, b, kh, t0 + j, a.bits, a.group, vt + static_cast<size_t>(j) * Dv);
    }
  }
  if (n < kKT) {
    for (int d = 0; d < D; ++d) std::fill(kt + d * kKT + n, kt + (d + 1) * kKT, 0.0f);
  }
}

// Whether the mask shows key s to row (b, h, l).
inline bool mask_shows(const Args& a, int64_t at) {
  if (a.mask_kind == MaskKind::boolean) return static_cast<const uint8_t*>(a.mask)[at] != 0;
  return static_cast<const float*>(a.mask)[at] != kNegInf;
}

// The keys [lo, hi) row (b, h, l) may see: causal and window limits, then
// narrowed to the first and last the mask shows (lo == hi: none).
void row_range(const Args& a, int b, int h, int l, int* lo, int* hi) {
  const int p = a.S - a.L + l;  // the row's own position among the keys
  int l0 = 0, h0 = a.S;
  if (a.causal) h0 = std::min(a.S, p + 1);
  if (a.window > 0) l0 = std::max(0, p - a.window + 1);
  if (h0 < 0) h0 = 0;
  if (l0 > h0) l0 = h0;
  if (a.mask_kind != MaskKind::none) {
    const int64_t base = b * a.ms[0] + h * a.ms[1] + l * a.ms[2];
    while (l0 < h0 && !mask_shows(a, base + l0 * a.ms[3])) ++l0;
    while (h0 > l0 && !mask_shows(a, base + (h0 - 1) * a.ms[3])) --h0;
  }
  *lo = l0;
  *hi = h0;
}

// Row i's scores of tile t0 .. t0 + n - 1 after its limits and the mask.
void mask_row(const Args& a, int b, int h, int l, int lo, int hi, int t0, int n, float* row) {
  if (a.mask_kind == MaskKind::none && n == kKT && lo <= t0 && t0 + kKT <= hi) return;
  const int jlo = std::max(0, lo - t0), jhi = std::max(0, std::min(n, hi - t0));
  for (int j = 0; j < std::min(jlo, kKT); ++j) row[j] = kNegInf;
  for (int j = std::max(jhi, jlo); j < kKT; ++j) row[j] = kNegInf;
  if (a.mask_kind == MaskKind::none) return;
  const int64_t base = b * a.ms[0] + h * a.ms[1] + l * a.ms[2];
  if (a.mask_kind == MaskKind::boolean) {
    const uint8_t* m = static_cast<const uint8_t*>(a.mask) + base;
    for (int j = jlo; j < jhi; ++j) {
      if (m[(t0 + j) * a.ms[3]] == 0) row[j] = kNegInf;
    }
  } else {
    const float* m = static_cast<const float*>(a.mask) + base;
    for (int j = jlo; j < jhi; ++j) row[j] += m[(t0 + j) * a.ms[3]];
  }
}

struct Geometry {
  int rep = 1, positions = 1, blocks = 1, units = 0;  // positions per block
};

Geometry geometry(const Args& a) {
  Geometry g;
  g.rep = a.Hq / a.Hkv;
  g.positions = std::max(1, kRows / g.rep);
  g.blocks = (a.L + g.positions - 1) / g.positions;
  g.units = a.B * a.Hkv * g.blocks;
  return g;
}

// Unit u: the last blocks (most keys under a causal mask) first.
void run_unit(const Args& a, const Kernels& K, const Geometry& g, int u) {
  const int heads = a.B * a.Hkv, blk = g.blocks - 1 - u / heads;
  const int b = (u % heads) / a.Hkv, kh = (u % heads) % a.Hkv, rep = g.rep;
  const int l0 = blk * g.positions, l1 = std::min(a.L, l0 + g.positions);
  const int R = (l1 - l0) * rep, D = a.D, Dv = a.Dv;
  float* qs = scratch(static_cast<size_t>(R) * (D + Dv + kKT + 4) + kKT * (2 * D + Dv) +
                      std::max(D, Dv));
  float* o = qs + static_cast<size_t>(R) * D;
  float* sc = o + static_cast<size_t>(R) * Dv;
  float* m = sc + static_cast<size_t>(R) * kKT;
  float* sum = m + R;
  int* lo = reinterpret_cast<int*>(sum + R);
  int* hi = lo + R;
  float* kt = reinterpret_cast<float*>(hi + R);
  float* vt = kt + kKT * D;
  float* row = vt + kKT * Dv;
  int klo = a.S, khi = 0;
  for (int i = 0; i < R; ++i) {
    const int l = l0 + i / rep, h = kh * rep + i % rep;
    const float* q = a.q + b * a.qs[0] + h * a.qs[1] + l * a.qs[2];
    for (int d = 0; d < D; ++d) qs[i * D + d] = q[d * a.qs[3]] * a.scale;
    if (i % rep == 0 || a.ms[1] != 0) {
      row_range(a, b, h, l, lo + i, hi + i);
    } else {  // (the mask, if any, is the same for every head)
      lo[i] = lo[i - 1];
      hi[i] = hi[i - 1];
    }
    if (lo[i] < hi[i]) {
      klo = std::min(klo, lo[i]);
      khi = std::max(khi, hi[i]);
    }
    m[i] = kNegInf;
    sum[i] = 0.0f;
  }
  std::fill(o, o + static_cast<size_t>(R) * Dv, 0.0f);
  for (int t0 = klo; t0 < khi; t0 += kKT) {
    const int n = std::min(kKT, khi - t0);
    pack_tile(a, K, b, kh, t0, n, kt, vt, row);
    K.qk(qs, D, kt, sc, R);
    for (int i = 0; i < R; ++i) {
      float* srow = sc + i * kKT;
      mask_row(a, b, kh * rep + i % rep, l0 + i / rep, lo[i], hi[i], t0, n, srow);
      const float top = K.max_tile(srow, m[i]);
      if (top == kNegInf) {  // nothing seen yet: the row adds nothing
        std::fill(srow, srow + kKT, 0.0f);
        continue;
      }
      const float c = m[i] == kNegInf ? 0.0f : exp_nonpositive(m[i] - top);
      const float part = K.exp_tile(srow, top);
      sum[i] = sum[i] * c + part;
      if (c != 1.0f) K.scale_row(o + i * Dv, Dv, c);
      m[i] = top;
    }
    K.pv(sc, vt, Dv, o, R, n);
  }
  for (int i = 0; i < R; ++i) {
    const int l = l0 + i / rep, h = kh * rep + i % rep;
    float* y = a.out + ((static_cast<size_t>(b) * a.Hq + h) * a.L + l) * Dv;
    const float inv = sum[i] > 0.0f ? 1.0f / sum[i] : 0.0f;
    for (int c = 0; c < Dv; ++c) y[c] = o[i * Dv + c] * inv;
  }
}

void compute(const Args& a, Runner runner) {
  const Geometry g = geometry(a);
  if (g.units == 0) return;
  const char* path = nullptr;
  const Kernels& K = kernels_for(runner.isa != nullptr ? runner.isa() : "scalar", a.Dv, &path);
  // the multiply-adds a causal call does, about
  const double work = static_cast<double>(a.B) * a.Hq * a.L * (a.causal ? (a.S - a.L / 2.0) : a.S) *
                      (a.D + a.Dv);
  int threads = runner.threads != nullptr ? runner.threads(work, kMinWork) : 1;
  const int chunks = std::min(g.units, 4096);
  if (threads <= 1 || chunks == 1) {
    for (int u = 0; u < g.units; ++u) run_unit(a, K, g, u);
    return;
  }
  const std::function<void(int)> job = [&a, &K, &g, chunks](int c) {
    const int u0 = static_cast<int>(static_cast<int64_t>(g.units) * c / chunks);
    const int u1 = static_cast<int>(static_cast<int64_t>(g.units) * (c + 1) / chunks);
    for (int u = u0; u < u1; ++u) run_unit(a, K, g, u);
  };
  runner.run(threads, chunks, job);
}

// ---------------------------------------------------------------- the primitive
Src source(const std::vector<mx::array>& in, size_t at, int bits) {
  Src x;
  const mx::array& d = in[at];
  for (int i = 0; i < 4; ++i) x.s[i] = d.strides(i);
  if (bits > 0) {
    x.kind = Kind::quant;
    x.p = d.data<uint32_t>();
    x.sc = in[at + 1].data<float>();
    x.bi = in[at + 2].data<float>();
    for (int i = 0; i < 4; ++i) {
      x.ss[i] = in[at + 1].strides(i);
      x.bs[i] = in[at + 2].strides(i);
    }
  } else if (d.dtype() == mx::float16) {
    x.kind = Kind::f16;
    x.p = d.data<mx::float16_t>();
  } else {
    x.kind = Kind::f32;
    x.p = d.data<float>();
  }
  return x;
}

void evaluate(const std::vector<mx::array>& in, mx::array& out, float scale, bool causal,
              int window, int group, int bits, bool masked, Runner runner) {
  const size_t per = bits > 0 ? 3 : 1;
  const mx::array& q = in[0];
  Args a;
  a.q = q.data<float>();
  for (int i = 0; i < 4; ++i) a.qs[i] = q.strides(i);
  a.k = source(in, 1, bits);
  a.v = source(in, 1 + per, bits);
  a.B = q.shape(0);
  a.Hq = q.shape(1);
  a.L = q.shape(2);
  a.D = q.shape(3);
  a.Hkv = in[1].shape(1);
  a.S = in[1].shape(2);
  a.Dv = out.shape(3);
  a.bits = bits;
  a.group = group;
  a.causal = causal;
  a.window = window;
  a.scale = scale;
  a.out = out.data<float>();
  if (masked) {
    const mx::array& mk = in[1 + 2 * per];
    a.mask_kind = mk.dtype() == mx::bool_ ? MaskKind::boolean : MaskKind::additive;
    a.mask = mk.dtype() == mx::bool_ ? static_cast<const void*>(mk.data<bool>())
                                     : static_cast<const void*>(mk.data<float>());
    for (int i = 0; i < 4; ++i) a.ms[i] = mk.strides(i);
  }
  compute(a, runner);
}

class AfmPrefillAttention : public mx::Primitive {
 public:
  AfmPrefillAttention(mx::Stream stream, float scale, bool causal, int window, int group,
                      int bits, bool masked, Runner runner)
      : mx::Primitive(stream), scale_(scale), causal_(causal), window_(window), group_(group),
        bits_(bits), masked_(masked), runner_(runner) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    mx::array& out = outputs[0];
    afm_cpu::allocate(out);
    std::vector<mx::array> weak;
    weak.reserve(inputs.size());
    for (const auto& x : inputs) weak.push_back(mx::array::unsafe_weak_copy(x));
    afm_cpu::dispatch(stream(), inputs, out,
                      [in = std::move(weak), out = mx::array::unsafe_weak_copy(out),
                       scale = scale_, causal = causal_, window = window_, group = group_,
                       bits = bits_, masked = masked_, runner = runner_]() mutable {
                        evaluate(in, out, scale, causal, window, group, bits, masked, runner);
                      });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("afm prefill attention: this primitive runs on the CPU only");
  }

  const char* name() const override { return "AfmPrefillAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const AfmPrefillAttention&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_ && window_ == o.window_ &&
           group_ == o.group_ && bits_ == o.bits_ && masked_ == o.masked_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const size_t per = bits_ > 0 ? 3 : 1;
    const mx::array& v = inputs[1 + per];
    const int Dv = bits_ > 0 ? v.shape(3) * 32 / bits_ : v.shape(3);
    return {{inputs[0].shape(0), inputs[0].shape(1), inputs[0].shape(2), Dv}};
  }

 private:
  float scale_;
  bool causal_;
  int window_, group_, bits_;
  bool masked_;
  Runner runner_;
};

[[noreturn]] void fail(const std::string& why) {
  throw std::invalid_argument("afm prefill attention: " + why);
}

// The head size of keys or values (one float array or a quantized triple),
// after checking them against (B, Hkv, S).
int check_source(const std::vector<mx::array>& x, const char* what, int B, int Hkv, int S,
                 int group, int bits) {
  const std::string w = what;
  if (bits == 0) {
    if (x.size() != 1) fail(w + " must be one array (or pass bits for a quantized triple)");
    const mx::array& d = x[0];
    if (d.ndim() != 4) fail(w + " must have 4 dimensions");
    if (d.dtype() != mx::float32 && d.dtype() != mx::float16) fail(w + " must be float32 or float16");
    if (d.shape(0) != B || d.shape(1) != Hkv || d.shape(2) != S) {
      fail(w + " must be (B, Hkv, S, *) as the keys");
    }
    return d.shape(3);
  }
  if (x.size() != 3) fail(w + " must be (data, scales, biases)");
  const mx::array &d = x[0], &s = x[1], &b = x[2];
  if (d.ndim() != 4 || d.dtype() != mx::uint32) fail(w + ": data must be 4-D uint32");
  if (d.shape(0) != B || d.shape(1) != Hkv || d.shape(2) != S) {
    fail(w + " must be (B, Hkv, S, *) as the keys");
  }
  const int n = d.shape(3) * 32 / bits;
  const mx::Shape sshape = {B, Hkv, S, n / group};
  if (n % group != 0 || s.shape() != sshape || b.shape() != sshape) {
    fail(w + ": scales and biases must be (B, Hkv, S, D / group_size)");
  }
  if (s.dtype() != mx::float32 || b.dtype() != mx::float32) {
    fail(w + ": scales and biases must be float32");
  }
  return n;
}

}  // namespace

mx::array prefill_attention(const mx::array& q, const std::vector<mx::array>& keys,
                            const std::vector<mx::array>& values, float scale,
                            const std::optional<mx::array>& mask, bool causal, int window,
                            int group_size, int bits, Runner runner) {
  if (bits != 0 && bits != 4 && bits != 8) fail("bits must be 4 or 8 (0: float keys and values)");
  if (bits != 0 && group_size != 32 && group_size != 64 && group_size != 128) {
    fail("group_size must be 32, 64 or 128");
  }
  if (window < 0) fail("window must be >= 0");
  if (q.ndim() != 4) fail("q must be (B, Hq, L, D)");
  if (q.dtype() != mx::float32) fail("q must be float32");
  if (keys.empty() || values.empty() || keys[0].ndim() != 4) {
    fail("keys and values must be (B, Hkv, S, D) arrays or quantized triples");
  }
  const int B = q.shape(0), Hq = q.shape(1), L = q.shape(2), D = q.shape(3);
  const int Hkv = keys[0].shape(1), S = keys[0].shape(2);
  if (check_source(keys, "keys", B, Hkv, S, group_size, bits) != D) {
    fail("keys must have q's head size");
  }
  const int Dv = check_source(values, "values", B, Hkv, S, group_size, bits);
  if (Hkv == 0 || Hq % Hkv != 0) fail("query heads must be a multiple of key heads");
  if (bits == 0 && keys[0].dtype() != values[0].dtype()) fail("keys and values must share a dtype");
  const mx::Stream stream = mx::default_stream(mx::default_device());
  if (stream.device != mx::Device::cpu) fail("the default device must be the CPU");
  std::vector<mx::array> inputs = {q};
  inputs.insert(inputs.end(), keys.begin(), keys.end());
  inputs.insert(inputs.end(), values.begin(), values.end());
  if (mask.has_value()) {
    if (mask->dtype() != mx::bool_ && mask->dtype() != mx::float32) {
      fail("the mask must be bool or float32");
    }
    // (raises for a mask that does not broadcast to the scores)
    inputs.push_back(mx::broadcast_to(*mask, {B, Hq, L, S}, stream));
  }
  return mx::array({B, Hq, L, Dv}, mx::float32,
                   std::make_shared<AfmPrefillAttention>(stream, scale, causal, window,
                                                         group_size, bits, mask.has_value(),
                                                         runner),
                   std::move(inputs));
}

std::string prefill_attention_path(Runner runner, int head_dim_v) {
  const char* path = nullptr;
  kernels_for(runner.isa != nullptr ? runner.isa() : "scalar", head_dim_v, &path);
  return path;
}

}  // namespace afm_pattn
