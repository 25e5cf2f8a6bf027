// See quantized_attention.h.  The unit of work is one (batch, key head) and a
// range of its positions: the Hq / Hkv query heads that share its keys and
// values go together, so each packed key and value row is unpacked once for
// all of them.  A unit's positions are split into parts when the job goes to
// the thread pool (a decode step has few units: one batch row of the default
// model has 3 key heads for 2 cores), each part keeping its own softmax
// maximum, sum and weighted values, combined at the end as in
// flash-decoding.  An AVX2 + FMA version for x86-64 (chosen at run time, rows
// read contiguously, head sizes a multiple of 8) and a portable one.
#include "quantized_attention.h"

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
#define QATTN_X86 1
#include <immintrin.h>
#else
#define QATTN_X86 0
#endif

namespace afm_qattn {
namespace {

namespace mx = mlx::core;

constexpr int kMaxRep = 16;  // query heads per key head on the AVX2 path
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLowest = std::numeric_limits<float>::lowest();  // mlx-lm's masked score
// Below this many multiply-adds (B * Hq * S * D) a job stays on one thread:
// a hand-off costs tens of microseconds, about what one thread takes for a
// layer of the default model (9 query heads of 64) at 512 positions
// (2 cores: 52 us alone, 57 us on both; at 2048, 177 us and 125 us).
constexpr double kMinWork = 500000.0;
constexpr int kMinPart = 128;  // positions per part, at least

// One quantized array of the cache: packed words, scales, biases (B, Hkv, S, *).
struct QView {
  const uint32_t* w = nullptr;
  const float* sc = nullptr;
  const float* bi = nullptr;
  int64_t ws[4] = {}, ss[4] = {}, bs[4] = {};
};

enum class MaskKind : int { none = 0, boolean = 1, additive = 2 };

struct Args {
  const float* q = nullptr;
  int64_t qs[4] = {};
  QView k, v;
  MaskKind mask_kind = MaskKind::none;
  const void* mask = nullptr;  // bool (1 byte) or float32, broadcast to (B, Hq, 1, S)
  int64_t ms[3] = {};          // its strides over b, h, s
  int B = 0, Hq = 0, Hkv = 0, S = 0, D = 0, Dv = 0, group = 64, bits = 8;
  float scale = 1.0f;
};

// A part's result for one query head: m (largest score), l (sum of
// e^(score - m)), then Dv sums of e^(score - m) V[s].  Floats per record:
inline int record_size(const Args& a) { return a.Dv + 2; }

#include "fast_exp.inc"

float* scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// The score of query head h at position s after the mask.
inline float masked(const Args& a, int b, int h, int s, float x) {
  const int64_t at = b * a.ms[0] + h * a.ms[1] + s * a.ms[2];
  if (a.mask_kind == MaskKind::boolean) {
    return static_cast<const uint8_t*>(a.mask)[at] ? x : kLowest;
  }
  return x + static_cast<const float*>(a.mask)[at];
}

// Turn row[0..n) into e^(row - max) and write m and l of the record; false
// when every score is -inf (an additive mask hid them all: l = 0).
template <typename ExpRow>
inline bool softmax_part(float* row, int n, float* rec, ExpRow exp_row) {
  float m = kNegInf;
  for (int i = 0; i < n; ++i) m = row[i] > m ? row[i] : m;
  rec[0] = m;
  if (m == kNegInf) {
    rec[1] = 0.0f;
    return false;
  }
  rec[1] = exp_row(row, n, m);
  return true;
}

// ---------------------------------------------------------------- portable
// Element d of row (b, kh, s) of x, unpacked and scaled.
inline float element(const QView& x, int64_t w0, int64_t s0, int64_t b0, int d, int bits,
                     int group) {
  const int per = 32 / bits;
  const uint32_t word = x.w[w0 + (d / per) * x.ws[3]];
  const uint32_t qv = (word >> ((d % per) * bits)) & ((1u << bits) - 1u);
  const int g = d / group;
  return x.sc[s0 + g * x.ss[3]] * static_cast<float>(qv) + x.bi[b0 + g * x.bs[3]];
}

void unpack_row(const QView& x, int b, int kh, int s, int D, int bits, int group, float* out) {
  const int64_t w0 = b * x.ws[0] + kh * x.ws[1] + s * x.ws[2];
  const int64_t s0 = b * x.ss[0] + kh * x.ss[1] + s * x.ss[2];
  const int64_t b0 = b * x.bs[0] + kh * x.bs[1] + s * x.bs[2];
  for (int d = 0; d < D; ++d) out[d] = element(x, w0, s0, b0, d, bits, group);
}

void part_portable(const Args& a, int b, int kh, int p0, int p1, float* rec) {
  const int D = a.D, Dv = a.Dv, n = p1 - p0, rep = a.Hq / a.Hkv, rs = record_size(a);
  float* sc = scratch(static_cast<size_t>(rep) * n + static_cast<size_t>(rep) * D + D + Dv);
  float* qs = sc + static_cast<size_t>(rep) * n;
  float* row = qs + static_cast<size_t>(rep) * D;
  for (int r = 0; r < rep; ++r) {
    const float* q = a.q + b * a.qs[0] + (kh * rep + r) * a.qs[1];
    for (int d = 0; d < D; ++d) qs[r * D + d] = q[d * a.qs[3]] * a.scale;
  }
  for (int i = 0; i < n; ++i) {
    unpack_row(a.k, b, kh, p0 + i, D, a.bits, a.group, row);
    for (int r = 0; r < rep; ++r) {
      float x = 0.0f;
      for (int d = 0; d < D; ++d) x += qs[r * D + d] * row[d];
      sc[static_cast<size_t>(r) * n + i] =
          a.mask_kind == MaskKind::none ? x : masked(a, b, kh * rep + r, p0 + i, x);
    }
  }
  bool any = false;
  for (int r = 0; r < rep; ++r) {
    float* out = rec + r * rs;
    any |= softmax_part(sc + static_cast<size_t>(r) * n, n, out, [](float* p, int k, float m) {
      float total = 0.0f;
      for (int i = 0; i < k; ++i) total += (p[i] = exp_nonpositive(p[i] - m));
      return total;
    });
    for (int d = 0; d < Dv; ++d) out[2 + d] = 0.0f;
  }
  if (!any) return;
  for (int i = 0; i < n; ++i) {
    unpack_row(a.v, b, kh, p0 + i, Dv, a.bits, a.group, row);
    for (int r = 0; r < rep; ++r) {
      if (rec[r * rs + 1] == 0.0f) continue;  // (its scores are all -inf: never read)
      const float p = sc[static_cast<size_t>(r) * n + i];
      float* o = rec + r * rs + 2;
      for (int d = 0; d < Dv; ++d) o[d] += p * row[d];
    }
  }
}

// ---------------------------------------------------------------- AVX2
#if QATTN_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

#include "fast_exp_avx2.inc"

// Elements 8j .. 8j + 7 of a packed row (contiguous words) as integers.
template <int Bits>
inline __m256 ints8(const uint32_t* w, int j) {
  if constexpr (Bits == 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 2 * j));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
  } else {
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i lanes = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w[j])), shifts);
    return _mm256_cvtepi32_ps(_mm256_and_si256(lanes, _mm256_set1_epi32(0xF)));
  }
}

// Row (b, kh, s) of x: pointers to its words, scales and biases.
struct Row {
  const uint32_t* w;
  const float* sc;
  const float* bi;
};
inline Row row_at(const QView& x, int b, int kh, int s) {
  return {x.w + b * x.ws[0] + kh * x.ws[1] + s * x.ws[2],
          x.sc + b * x.ss[0] + kh * x.ss[1] + s * x.ss[2],
          x.bi + b * x.bs[0] + kh * x.bs[1] + s * x.bs[2]};
}

// Chunks j0 .. j0 + JB - 1 (8 elements each) of the weighted values of
// Rep query heads: the sums kept in registers over the part's rows, so a
// head size of 64 at Rep = 3 takes four passes over the rows (each unpacking
// its own quarter of them) instead of a load and a store per multiply-add.
template <int Bits, int Rep, int JB>
inline void values_block(const Args& a, int b, int kh, int p0, int n, const float* sc, int j0,
                         float* rec) {
  const int per_group = a.group / 8, rs = record_size(a);
  const int64_t vgs = a.v.ss[3], vgb = a.v.bs[3];
  __m256 acc[Rep][JB];
  for (int r = 0; r < Rep; ++r) {
    for (int jj = 0; jj < JB; ++jj) acc[r][jj] = _mm256_setzero_ps();
  }
  for (int i = 0; i < n; ++i) {
    const Row v = row_at(a.v, b, kh, p0 + i);
    __m256 p[Rep];
    for (int r = 0; r < Rep; ++r) p[r] = _mm256_broadcast_ss(sc + static_cast<size_t>(r) * n + i);
    for (int jj = 0; jj < JB; ++jj) {
      const int j = j0 + jj, g = j / per_group;
      const __m256 vv = _mm256_fmadd_ps(ints8<Bits>(v.w, j), _mm256_broadcast_ss(v.sc + g * vgs),
                                        _mm256_broadcast_ss(v.bi + g * vgb));
      for (int r = 0; r < Rep; ++r) acc[r][jj] = _mm256_fmadd_ps(p[r], vv, acc[r][jj]);
    }
  }
  for (int r = 0; r < Rep; ++r) {
    for (int jj = 0; jj < JB; ++jj) _mm256_storeu_ps(rec + r * rs + 2 + 8 * (j0 + jj), acc[r][jj]);
  }
}

// The mask over a head's scores row[0..n) (positions p0 ..).
inline void apply_mask(const Args& a, int b, int h, int p0, int n, float* row) {
  const int64_t base = b * a.ms[0] + h * a.ms[1] + p0 * a.ms[2], step = a.ms[2];
  if (a.mask_kind == MaskKind::boolean) {
    const uint8_t* m = static_cast<const uint8_t*>(a.mask) + base;
    for (int i = 0; i < n; ++i) row[i] = m[i * step] ? row[i] : kLowest;
  } else if (a.mask_kind == MaskKind::additive) {
    const float* m = static_cast<const float*>(a.mask) + base;
    for (int i = 0; i < n; ++i) row[i] += m[i * step];
  }
}

// Words contiguous in each row; D and Dv multiples of 8, as is the group.
// Rep: the query heads per key head, or 0 for any (Hq / Hkv, at most
// kMaxRep) with the weighted values summed in memory.
template <int Bits, int Rep>
void part_avx2(const Args& a, int b, int kh, int p0, int p1, float* rec) {
  const int D = a.D, Dv = a.Dv, n = p1 - p0, rs = record_size(a);
  const int rep = Rep > 0 ? Rep : a.Hq / a.Hkv;
  const int nk = D / 8, nv = Dv / 8, per_group = a.group / 8;
  const int64_t kgs = a.k.ss[3], kgb = a.k.bs[3];
  float* sc = scratch(static_cast<size_t>(rep) * n + static_cast<size_t>(rep) * D);
  float* qs = sc + static_cast<size_t>(rep) * n;
  const __m256 scale = _mm256_set1_ps(a.scale);
  for (int r = 0; r < rep; ++r) {
    const float* q = a.q + b * a.qs[0] + (kh * rep + r) * a.qs[1];
    for (int j = 0; j < nk; ++j) {
      _mm256_storeu_ps(qs + r * D + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(q + 8 * j), scale));
    }
  }
  // scores: each key row unpacked once for every query head of this key head
  for (int i = 0; i < n; ++i) {
    const Row k = row_at(a.k, b, kh, p0 + i);
    __m256 dots[Rep > 0 ? Rep : kMaxRep];
    for (int r = 0; r < rep; ++r) dots[r] = _mm256_setzero_ps();
    for (int g = 0, j = 0; j < nk; ++g) {
      const __m256 s = _mm256_broadcast_ss(k.sc + g * kgs), c = _mm256_broadcast_ss(k.bi + g * kgb);
      for (int e = j + per_group; j < e; ++j) {
        const __m256 kv = _mm256_fmadd_ps(ints8<Bits>(k.w, j), s, c);
        for (int r = 0; r < rep; ++r) {
          dots[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + r * D + 8 * j), kv, dots[r]);
        }
      }
    }
    for (int r = 0; r < rep; ++r) sc[static_cast<size_t>(r) * n + i] = hsum8(dots[r]);
  }
  bool any = false;
  for (int r = 0; r < rep; ++r) {
    float* row = sc + static_cast<size_t>(r) * n;
    apply_mask(a, b, kh * rep + r, p0, n, row);
    float* out = rec + r * rs;
    // (a head whose scores are all -inf keeps zeros: e^(-inf - -inf) is NaN)
    if (!softmax_part(row, n, out, exp_row_avx2)) std::memset(row, 0, sizeof(float) * n);
    any |= out[1] != 0.0f;
    std::memset(out + 2, 0, sizeof(float) * Dv);
  }
  if (!any) return;
  if constexpr (Rep > 0) {
    constexpr int JB = Rep >= 8 ? 1 : 8 / Rep;  // at most 8 sums in registers
    int j = 0;
    for (; j + JB <= nv; j += JB) values_block<Bits, Rep, JB>(a, b, kh, p0, n, sc, j, rec);
    for (; j < nv; ++j) values_block<Bits, Rep, 1>(a, b, kh, p0, n, sc, j, rec);
    return;
  }
  // weighted values: each value row unpacked once for every query head
  const int64_t vgs = a.v.ss[3], vgb = a.v.bs[3];
  for (int i = 0; i < n; ++i) {
    const Row v = row_at(a.v, b, kh, p0 + i);
    for (int g = 0, j = 0; j < nv; ++g) {
      const __m256 s = _mm256_broadcast_ss(v.sc + g * vgs), c = _mm256_broadcast_ss(v.bi + g * vgb);
      for (int e = j + per_group; j < e; ++j) {
        const __m256 vv = _mm256_fmadd_ps(ints8<Bits>(v.w, j), s, c);
        for (int r = 0; r < rep; ++r) {
          float* o = rec + r * rs + 2 + 8 * j;
          _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_set1_ps(sc[static_cast<size_t>(r) * n + i]),
                                              vv, _mm256_loadu_ps(o)));
        }
      }
    }
  }
}

template <int Bits>
void part_avx2_any(const Args& a, int b, int kh, int p0, int p1, float* rec) {
  switch (a.Hq / a.Hkv) {  // the common query heads per key head, unrolled
    case 1: return part_avx2<Bits, 1>(a, b, kh, p0, p1, rec);
    case 2: return part_avx2<Bits, 2>(a, b, kh, p0, p1, rec);
    case 3: return part_avx2<Bits, 3>(a, b, kh, p0, p1, rec);
    case 4: return part_avx2<Bits, 4>(a, b, kh, p0, p1, rec);
    case 5: return part_avx2<Bits, 5>(a, b, kh, p0, p1, rec);
    case 6: return part_avx2<Bits, 6>(a, b, kh, p0, p1, rec);
    case 7: return part_avx2<Bits, 7>(a, b, kh, p0, p1, rec);
    case 8: return part_avx2<Bits, 8>(a, b, kh, p0, p1, rec);
    default: return part_avx2<Bits, 0>(a, b, kh, p0, p1, rec);
  }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif

bool use_avx2(const Args& a) {
#if QATTN_X86
  return has_avx2() && a.D % 8 == 0 && a.Dv % 8 == 0 && a.Hq / a.Hkv <= kMaxRep &&
         a.qs[3] == 1 && a.k.ws[3] == 1 && a.v.ws[3] == 1;
#else
  (void)a;
  return false;
#endif
}

void run_part(const Args& a, bool fast, int b, int kh, int p0, int p1, float* rec) {
#if QATTN_X86
  if (fast) {
    if (a.bits == 8) {
      part_avx2_any<8>(a, b, kh, p0, p1, rec);
    } else {
      part_avx2_any<4>(a, b, kh, p0, p1, rec);
    }
    return;
  }
#else
  (void)fast;
#endif
  part_portable(a, b, kh, p0, p1, rec);
}

// out (rep rows of Dv) from a unit's `parts` records per query head.
void combine(const Args& a, const float* rec, int parts, float* out) {
  const int rep = a.Hq / a.Hkv, rs = record_size(a), Dv = a.Dv;
  for (int r = 0; r < rep; ++r) {
    float* o = out + static_cast<size_t>(r) * Dv;
    float top = kNegInf;
    for (int p = 0; p < parts; ++p) top = std::fmax(top, rec[(p * rep + r) * rs]);
    for (int d = 0; d < Dv; ++d) o[d] = 0.0f;
    if (top == kNegInf) continue;  // every score -inf: zeros
    float total = 0.0f;
    for (int p = 0; p < parts; ++p) {
      const float* x = rec + (p * rep + r) * rs;
      if (x[1] == 0.0f) continue;
      const float w = std::exp(x[0] - top);
      total += w * x[1];
      for (int d = 0; d < Dv; ++d) o[d] += w * x[2 + d];
    }
    const float inv = 1.0f / total;
    for (int d = 0; d < Dv; ++d) o[d] *= inv;
  }
}

QView qview(const mx::array& w, const mx::array& s, const mx::array& b) {
  QView v;
  v.w = w.data<uint32_t>();
  v.sc = s.data<float>();
  v.bi = b.data<float>();
  for (int i = 0; i < 4; ++i) {
    v.ws[i] = w.strides(i);
    v.ss[i] = s.strides(i);
    v.bs[i] = b.strides(i);
  }
  return v;
}

// inputs: q, k (3), v (3), [mask broadcast to (B, Hq, 1, S)]
void compute(const std::vector<mx::array>& in, mx::array& out, float scale, int group, int bits,
             Runner runner) {
  const mx::array& q = in[0];
  Args a;
  a.q = q.data<float>();
  for (int i = 0; i < 4; ++i) a.qs[i] = q.strides(i);
  a.k = qview(in[1], in[2], in[3]);
  a.v = qview(in[4], in[5], in[6]);
  a.B = q.shape(0);
  a.Hq = q.shape(1);
  a.D = q.shape(3);
  a.Hkv = in[1].shape(1);
  a.S = in[1].shape(2);
  a.Dv = out.shape(3);
  a.group = group;
  a.bits = bits;
  a.scale = scale;
  if (in.size() == 8) {
    const mx::array& m = in[7];
    a.mask_kind = m.dtype() == mx::bool_ ? MaskKind::boolean : MaskKind::additive;
    a.mask = m.data<void>();
    a.ms[0] = m.strides(0);
    a.ms[1] = m.strides(1);
    a.ms[2] = m.strides(3);
  }
  float* y = out.data<float>();
  const int units = a.B * a.Hkv, rep = a.Hq / a.Hkv, rs = record_size(a);
  if (units == 0) return;
  if (a.S == 0) {
    std::memset(y, 0, out.nbytes());
    return;
  }
  int threads = runner.threads(static_cast<double>(a.B) * a.Hq * a.S * a.D, kMinWork);
  int parts = 1;
  if (threads > 1) {  // about 4 chunks per thread, so a late worker costs little
    parts = (4 * threads + units - 1) / units;
    parts = std::max(1, std::min(parts, a.S / kMinPart));
  }
  const int chunks = units * parts;
  if (chunks == 1) threads = 1;
  std::vector<float> records(static_cast<size_t>(chunks) * rep * rs);
  float* recp = records.data();
  const bool fast = use_avx2(a);
  const std::function<void(int)> job = [&a, recp, parts, rep, rs, fast](int c) {
    const int u = c / parts, p = c % parts;
    const int p0 = static_cast<int>(static_cast<int64_t>(a.S) * p / parts);
    const int p1 = static_cast<int>(static_cast<int64_t>(a.S) * (p + 1) / parts);
    run_part(a, fast, u / a.Hkv, u % a.Hkv, p0, p1, recp + static_cast<size_t>(c) * rep * rs);
  };
  if (threads == 1) {
    for (int c = 0; c < chunks; ++c) job(c);
  } else {
    runner.run(threads, chunks, job);
  }
  for (int u = 0; u < units; ++u) {  // (B, Hq, 1, Dv): unit u's heads are rows u*rep ..
    combine(a, recp + static_cast<size_t>(u) * parts * rep * rs, parts,
            y + static_cast<size_t>(u) * rep * a.Dv);
  }
}

class AfmQuantizedDecodeAttention : public mx::Primitive {
 public:
  AfmQuantizedDecodeAttention(mx::Stream stream, float scale, int group, int bits, Runner runner)
      : mx::Primitive(stream), scale_(scale), group_(group), bits_(bits), runner_(runner) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    mx::array& out = outputs[0];
    afm_cpu::allocate(out);
    std::vector<mx::array> weak;
    weak.reserve(inputs.size());
    for (const auto& x : inputs) weak.push_back(mx::array::unsafe_weak_copy(x));
    afm_cpu::dispatch(stream(), inputs, out,
                      [in = std::move(weak), out = mx::array::unsafe_weak_copy(out),
                       scale = scale_, group = group_, bits = bits_,
                       runner = runner_]() mutable { compute(in, out, scale, group, bits, runner); });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("afm quantized attention: this primitive runs on the CPU only");
  }

  const char* name() const override { return "AfmQuantizedDecodeAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const AfmQuantizedDecodeAttention&>(other);
    return scale_ == o.scale_ && group_ == o.group_ && bits_ == o.bits_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = inputs[4].shape(3) * 32 / bits_;
    return {shape};
  }

 private:
  float scale_;
  int group_, bits_;
  Runner runner_;
};

[[noreturn]] void fail(const std::string& why) {
  throw std::invalid_argument("afm quantized attention: " + why);
}

// The element count per position of a (data, scales, biases) triple, after
// checking its shapes against (B, Hkv, S).
int check_triple(const std::vector<mx::array>& x, const char* what, int B, int Hkv, int S,
                 int group, int bits) {
  if (x.size() != 3) fail(std::string(what) + " must be (data, scales, biases)");
  const mx::array &w = x[0], &s = x[1], &b = x[2];
  if (w.ndim() != 4 || w.dtype() != mx::uint32) fail(std::string(what) + ": data must be 4-D uint32");
  if (w.shape(0) != B || w.shape(1) != Hkv || w.shape(2) != S) {
    fail(std::string(what) + " must be (B, Hkv, S, *) as the keys");
  }
  const int D = w.shape(3) * 32 / bits;
  const mx::Shape sshape = {B, Hkv, S, D / group};
  if (D % group != 0 || s.shape() != sshape || b.shape() != sshape) {
    fail(std::string(what) + ": scales and biases must be (B, Hkv, S, D / group_size)");
  }
  if (s.dtype() != mx::float32 || b.dtype() != mx::float32) {
    fail(std::string(what) + ": scales and biases must be float32");
  }
  return D;
}

}  // namespace

mx::array quantized_decode_attention(const mx::array& q, const std::vector<mx::array>& keys,
                                     const std::vector<mx::array>& values, float scale,
                                     const std::optional<mx::array>& mask, int group_size,
                                     int bits, Runner runner) {
  if (bits != 4 && bits != 8) fail("bits must be 4 or 8");
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    fail("group_size must be 32, 64 or 128");
  }
  if (q.ndim() != 4) fail("q must be (B, Hq, 1, D)");
  if (q.shape(2) != 1) fail("one query position only");
  if (q.dtype() != mx::float32) fail("q must be float32");
  if (keys.size() != 3 || values.size() != 3) fail("keys and values must be (data, scales, biases)");
  const int B = q.shape(0), Hq = q.shape(1), D = q.shape(3);
  if (keys[0].ndim() != 4) fail("keys: data must be 4-D uint32");
  const int Hkv = keys[0].shape(1), S = keys[0].shape(2);
  if (check_triple(keys, "keys", B, Hkv, S, group_size, bits) != D) {
    fail("keys must have q's head size");
  }
  const int Dv = check_triple(values, "values", B, Hkv, S, group_size, bits);
  if (Hkv == 0 || Hq % Hkv != 0) fail("query heads must be a multiple of key heads");
  const mx::Stream stream = mx::default_stream(mx::default_device());
  if (stream.device != mx::Device::cpu) fail("the default device must be the CPU");
  std::vector<mx::array> inputs = {q, keys[0], keys[1], keys[2], values[0], values[1], values[2]};
  if (mask.has_value()) {
    if (mask->dtype() != mx::bool_ && mask->dtype() != mx::float32) {
      fail("the mask must be bool or float32");
    }
    // (raises for a mask that does not broadcast to the scores)
    inputs.push_back(mx::broadcast_to(*mask, {B, Hq, 1, S}, stream));
  }
  return mx::array({B, Hq, 1, Dv}, mx::float32,
                   std::make_shared<AfmQuantizedDecodeAttention>(stream, scale, group_size, bits,
                                                                 runner),
                   std::move(inputs));
}

}  // namespace afm_qattn
