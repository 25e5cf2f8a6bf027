// Kernels for afm_core._mlx.qmm_ext: activation quantization, and one integer
// gemv/gemm per instruction set (portable scalar; on x86-64, chosen at run
// time: AVX2, AVX2 with AVX-VNNI (VEX, "avx-vnni"), AVX2 with AVX-512 VNNI's
// 256-bit forms ("avx2-vnni"), and 512-bit AVX-512 VNNI; NEON on arm64).  See
// qmm_kernels.h.
#include "qmm_kernels.h"

#include "half.h"
#include "kquant_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define QMM_X86 1
#include <immintrin.h>
#else
#define QMM_X86 0
#endif
#if defined(__aarch64__)
#define QMM_NEON 1
#include <arm_neon.h>
#else
#define QMM_NEON 0
#endif

namespace afm_qmm {

int prefetch_bytes() {
  static const int bytes = [] {
    const char* e = std::getenv("AFM_QMM_PREFETCH");
    return e != nullptr && *e ? std::atoi(e) : 2048;
  }();
  return bytes;
}

namespace {

float* thread_scratch(size_t n) {
  thread_local std::vector<float> buf;
  thread_local float* start = nullptr;
  thread_local size_t have = 0;
  if (have < n || start == nullptr) {
    start = aligned64(buf, n);
    have = n;
  }
  return start;
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Element e of a block in MLX's packing: a little-endian bit stream, element
// e at bits [bits * e, bits * (e + 1)) (so a block of 32 is 4 * bits bytes).
inline int weight_value(const uint8_t* blk, int bits, int e) {
  const int bit = bits * e, byte = bit >> 3, s = bit & 7;
  unsigned v = static_cast<unsigned>(blk[byte]) >> s;
  if (s + bits > 8) v |= static_cast<unsigned>(blk[byte + 1]) << (8 - s);
  return static_cast<int>(v & ((1u << bits) - 1));
}

template <int BITS>
constexpr int kBlockBytes = 4 * BITS;

void convert_row(const void* src, ScaleType t, size_t start, int n, float* dst) {
  if (t == ScaleType::f32) {
    std::memcpy(dst, static_cast<const float*>(src) + start, sizeof(float) * n);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(src) + start;
    if (t == ScaleType::f16) {
      for (int i = 0; i < n; ++i) dst[i] = half_to_float(p[i]);
    } else {
      for (int i = 0; i < n; ++i) dst[i] = bf16_to_float(p[i]);
    }
  }
}

inline void load_row_scales(const QWeights& wt, int n, int ng, float* s, float* b) {
  const size_t start = static_cast<size_t>(n) * ng;
  convert_row(wt.scales, wt.scale_type, start, ng, s);
  if (wt.bias_factor != 0.0f) {
    for (int g = 0; g < ng; ++g) b[g] = wt.bias_factor * s[g];  // (QWeights::bias_factor)
  } else {
    convert_row(wt.biases, wt.scale_type, start, ng, b);
  }
}

// ---------------------------------------------------------------- unpacking
// 3, 5 and 6 bits: an element spans at most two bytes.  A byte shuffle puts
// the two bytes holding each of 8 elements into a 16-bit word, a multiply
// moves the element to the word's top `bits` bits, a shift brings it down,
// and a saturating pack makes bytes of two such registers: 16 elements per
// 128-bit lane, in natural order (block_element).

// For a 128-bit lane holding a block's bytes from byte `base` on: shuffle
// indices and multipliers that unpack elements [first, first + 8).
struct LaneUnpack {
  uint8_t idx[16];
  uint16_t mul[8];
};

constexpr LaneUnpack lane_unpack(int bits, int first, int base) {
  LaneUnpack u{};
  for (int k = 0; k < 8; ++k) {
    const int bit = bits * (first + k) - 8 * base;
    const int byte = bit >> 3, s = bit & 7;
    // (an element whose second byte would lie past the lane needs none)
    if (bit < 0 || byte > 15 || (byte == 15 && s + bits > 8)) throw "element outside the lane";
    u.idx[2 * k] = static_cast<uint8_t>(byte);
    u.idx[2 * k + 1] = static_cast<uint8_t>(byte < 15 ? byte + 1 : 0x80);
    u.mul[k] = static_cast<uint16_t>(1u << (16 - bits - s));
  }
  return u;
}

// Lanes of `n` x 128 bits, lane l holding the elements [first[l], first[l] + 8)
// from the bytes at base[l]: one register's shuffle and multipliers.
template <int LANES>
struct Unpack {
  alignas(64) uint8_t idx[16 * LANES];
  alignas(64) uint16_t mul[8 * LANES];
};

template <int LANES>
constexpr Unpack<LANES> make_unpack(int bits, const int* first, const int* base) {
  Unpack<LANES> u{};
  for (int l = 0; l < LANES; ++l) {
    const LaneUnpack lane = lane_unpack(bits, first[l], base[l]);
    for (int i = 0; i < 16; ++i) u.idx[16 * l + i] = lane.idx[i];
    for (int i = 0; i < 8; ++i) u.mul[8 * l + i] = lane.mul[i];
  }
  return u;
}

// 256 bits (AVX2): one block, lane 0 its elements 0-15 from its first 16
// bytes, lane 1 its elements 16-31 from the 16 bytes ending at its end (3
// bits: its 12 bytes in both lanes).  A: the first 8 elements of each lane, B: the next 8.
template <int BITS>
constexpr int kLane1Base = BITS == 3 ? 0 : 4 * BITS - 16;

template <int BITS>
struct Unpack256 {
  static constexpr int first_a[2] = {0, 16}, first_b[2] = {8, 24};
  static constexpr int base[2] = {0, kLane1Base<BITS>};
  static constexpr Unpack<2> a = make_unpack<2>(BITS, first_a, base);
  static constexpr Unpack<2> b = make_unpack<2>(BITS, first_b, base);
};

// 128 or 512 bits (NEON, AVX-512): every lane holds one half of a block from
// the half's first byte (elements 0-15 of the half).
template <int BITS, int LANES>
struct UnpackHalf {
  static constexpr int first_a[4] = {0, 0, 0, 0}, first_b[4] = {8, 8, 8, 8};
  static constexpr int base[4] = {0, 0, 0, 0};
  static constexpr Unpack<LANES> a = make_unpack<LANES>(BITS, first_a, base);
  static constexpr Unpack<LANES> b = make_unpack<LANES>(BITS, first_b, base);
};

// ---------------------------------------------------------------- scalar
namespace scalar {

static constexpr float kOffset8 = 0.0f;

// The oracle: each weight extracted from MLX's bit stream on its own.
template <int BITS, int R>
static inline void row_dot(const uint8_t* w, const float* s, int nb, int shift,
                           const int8_t* const* xq, const float* const* xd, float* res) {
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  for (int blk = 0; blk < nb; ++blk) {
    const uint8_t* p = w + blk * kBlockBytes<BITS>;
    int32_t sum[R];
    for (int r = 0; r < R; ++r) sum[r] = 0;
    for (int i = 0; i < 32; ++i) {
      const int v = weight_value(p, BITS, block_element(BITS, i));
      for (int r = 0; r < R; ++r) sum[r] += v * xq[r][blk * 32 + i];
    }
    const float sc = s[blk >> shift];
    for (int r = 0; r < R; ++r) acc[r] += static_cast<float>(sum[r]) * (xd[r][blk] * sc);
  }
  for (int r = 0; r < R; ++r) res[r] = acc[r];
}

#include "qmm_range.inc"

}  // namespace scalar

// ---------------------------------------------------------------- NEON
#if QMM_NEON
namespace neon {

static constexpr float kOffset8 = 128.0f;

static inline int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, a, b);
#else
  const int16x8_t lo = vmull_s8(vget_low_s8(a), vget_low_s8(b));
  const int16x8_t hi = vmull_high_s8(a, b);
  return vpadalq_s16(vpadalq_s16(acc, lo), hi);
#endif
}

// One half of a block (its 16 elements, 3, 5 or 6 bits), from the half's first byte.
template <int BITS>
static inline uint8x16_t unpack_half(const uint8_t* p) {
  using U = UnpackHalf<BITS, 1>;
  const uint8x16_t src = vld1q_u8(p);
  uint16x8_t lo = vreinterpretq_u16_u8(vqtbl1q_u8(src, vld1q_u8(U::a.idx)));
  uint16x8_t hi = vreinterpretq_u16_u8(vqtbl1q_u8(src, vld1q_u8(U::b.idx)));
  lo = vshrq_n_u16(vmulq_u16(lo, vld1q_u16(U::a.mul)), 16 - BITS);
  hi = vshrq_n_u16(vmulq_u16(hi, vld1q_u16(U::b.mul)), 16 - BITS);
  return vcombine_u8(vmovn_u16(lo), vmovn_u16(hi));
}

// The 32 weights of a block in the activations' order (block_element), as
// signed bytes (8 bits: q - 128).
template <int BITS>
static inline void load_w(const uint8_t* p, int8x16_t& w0, int8x16_t& w1) {
  if constexpr (BITS == 4) {
    const uint8x16_t raw = vld1q_u8(p);
    w0 = vreinterpretq_s8_u8(vandq_u8(raw, vdupq_n_u8(0x0F)));
    w1 = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));
  } else if constexpr (BITS == 8) {
    const uint8x16_t off = vdupq_n_u8(0x80);
    w0 = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(p), off));
    w1 = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(p + 16), off));
  } else if constexpr (BITS == 2) {
    const uint8x8_t raw = vld1_u8(p), m = vdup_n_u8(3);
    w0 = vreinterpretq_s8_u8(vcombine_u8(vand_u8(raw, m), vand_u8(vshr_n_u8(raw, 2), m)));
    w1 = vreinterpretq_s8_u8(vcombine_u8(vand_u8(vshr_n_u8(raw, 4), m), vshr_n_u8(raw, 6)));
  } else {  // the block's 4 * BITS bytes, then 16 from each half's start
    uint8_t tmp[32] = {};
    std::memcpy(tmp, p, 4 * BITS);
    w0 = vreinterpretq_s8_u8(unpack_half<BITS>(tmp));
    w1 = vreinterpretq_s8_u8(unpack_half<BITS>(tmp + 2 * BITS));
  }
}

template <int BITS, int R>
static inline void row_dot(const uint8_t* w, const float* s, int nb, int shift,
                           const int8_t* const* xq, const float* const* xd, float* res) {
  float32x4_t acc[R];
  for (int r = 0; r < R; ++r) acc[r] = vdupq_n_f32(0.0f);
  for (int blk = 0; blk < nb; ++blk) {
    int8x16_t w0, w1;
    load_w<BITS>(w + blk * 4 * BITS, w0, w1);
    const float sc = s[blk >> shift];
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq[r] + blk * 32;
      int32x4_t i = dot16(vdupq_n_s32(0), w0, vld1q_s8(x));
      i = dot16(i, w1, vld1q_s8(x + 16));
      acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(i), xd[r][blk] * sc);
    }
  }
  for (int r = 0; r < R; ++r) res[r] = vaddvq_f32(acc[r]);
}

#include "qmm_range.inc"

}  // namespace neon
#endif

// ---------------------------------------------------------------- x86-64
#if QMM_X86
// Bytes ahead of the weights in use that the x86 kernels ask the memory for
// (_mm_prefetch): the weight rows follow each other, so this runs into the
// next rows.  The hardware prefetchers alone left one core at 5-6 GB/s on a
// 146 MB output head (1 row) where a plain read loop reaches 17.
const int kPrefetch = prefetch_bytes();

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace avx2 {
#define QMM_VNNI 0
#include "qmm_x86.inc"
#undef QMM_VNNI
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
#endif
namespace vnni {
#define QMM_VNNI 1
#include "qmm_x86.inc"
#undef QMM_VNNI
}  // namespace vnni
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avxvnni"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#endif
namespace avxvnni {
#define QMM_VNNI 2
#include "qmm_x86.inc"
#undef QMM_VNNI
}  // namespace avxvnni
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
#endif
// GCC's own 512-bit intrinsics start from _mm512_undefined_*(), which its
// -Wmaybe-uninitialized reports at every inlined use: not our code's warning.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
namespace avx512 {
#include "qmm_avx512.inc"
}  // namespace avx512
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

struct Available {
  KernelSet sets[6];
  int count = 0;
  Available() {
    sets[count++] = {scalar::range, "scalar", quantize_rows, dequantize_rows, kquant_range_scalar,
                     kquant_dequantize_rows};
#if QMM_NEON
    sets[count++] = {neon::range, "neon", quantize_rows, dequantize_rows, kquant_range_scalar,
                     kquant_dequantize_rows};
#endif
#if QMM_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      // (the K-quant products have an AVX2 kernel, which every set here runs)
      sets[count++] = {avx2::range, "avx2", avx2::quantize, avx2::dequantize, kquant_range_avx2,
                       kquant_dequantize_rows_avx2};
      if (__builtin_cpu_supports("avxvnni")) {
        sets[count++] = {avxvnni::range, "avx-vnni", avxvnni::quantize, avxvnni::dequantize,
                         kquant_range_avx2, kquant_dequantize_rows_avx2};
      }
      if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni")) {
        sets[count++] = {vnni::range, "avx2-vnni", vnni::quantize, vnni::dequantize, kquant_range_avx2,
                         kquant_dequantize_rows_avx2};
        sets[count++] = {avx512::range, "avx512-vnni", avx512::quantize, avx2::dequantize,
                         kquant_range_avx2, kquant_dequantize_rows_avx2};
      }
    }
#endif
  }
};

const Available& available() {
  static const Available a;
  return a;
}

}  // namespace

static void quantize_block(const float* t, int bits, int8_t* qb, float* d, float* rest) {
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(t[i]));
  const float inv = amax > 1e-30f ? 127.0f / amax : 0.0f;
  const float scale = amax > 1e-30f ? amax / 127.0f : 0.0f;
  *d = scale;
  int8_t v[32];
  for (int i = 0; i < 32; ++i) {
    const float u = t[i] * inv;
    v[i] = static_cast<int8_t>(static_cast<int>(u + (u >= 0.0f ? 0.5f : -0.5f)));
    if (rest != nullptr) rest[i] = t[i] - scale * static_cast<float>(v[i]);
  }
  for (int p = 0; p < 32; ++p) qb[p] = v[block_element(bits, p)];  // the weights' order
}

void quantize_rows(const float* x, const int64_t* row_offsets, int64_t kstride,
                   int K, int group, int bits, int passes, int8_t* q, float* d, float* xsum,
                   int m0, int m1) {
  const int nb = K / 32, ng = K / group, bpg = group / 32;
  for (int m = m0; m < m1; ++m) {
    const float* xr = x + row_offsets[m];
    const size_t row = static_cast<size_t>(m) * passes;
    int8_t* qr = q + row * K;
    float* dr = d + row * nb;
    float* sr = xsum + row * ng;
    for (int g = 0; g < ng * passes; ++g) sr[g] = 0.0f;  // the remainder's sums stay 0
    for (int blk = 0; blk < nb; ++blk) {
      float t[32], rest[32];
      if (kstride == 1) {
        std::memcpy(t, xr + blk * 32, sizeof t);
      } else {
        for (int i = 0; i < 32; ++i) t[i] = xr[(static_cast<int64_t>(blk) * 32 + i) * kstride];
      }
      float sum = 0.0f;
      for (int i = 0; i < 32; ++i) sum += t[i];
      sr[blk / bpg] += sum;
      quantize_block(t, bits, qr + blk * 32, dr + blk, passes == 2 ? rest : nullptr);
      if (passes == 2) quantize_block(rest, bits, qr + K + blk * 32, dr + nb + blk, nullptr);
    }
  }
}

void dequantize_rows(const QWeights& wt, int n0, int n1, float* dst) {
  const int K = wt.K, ng = K / wt.group, bits = wt.bits;
  const size_t row_bytes = static_cast<size_t>(K) * bits / 8;
  float* s = thread_scratch(2 * static_cast<size_t>(ng));
  float* b = s + ng;
  for (int n = n0; n < n1; ++n) {
    load_row_scales(wt, n, ng, s, b);
    const uint8_t* w = wt.w + static_cast<size_t>(n) * row_bytes;
    float* out = dst + static_cast<size_t>(n - n0) * K;
    for (int g = 0; g < ng; ++g) {
      const float sc = s[g], bi = b[g];
      const int k0 = g * wt.group;
      if (bits == 4) {
        const uint8_t* p = w + k0 / 2;
        for (int i = 0; i < wt.group / 2; ++i) {
          out[k0 + 2 * i] = std::fma(sc, static_cast<float>(p[i] & 0x0F), bi);
          out[k0 + 2 * i + 1] = std::fma(sc, static_cast<float>(p[i] >> 4), bi);
        }
      } else if (bits == 8) {
        const uint8_t* p = w + k0;
        for (int i = 0; i < wt.group; ++i) out[k0 + i] = std::fma(sc, static_cast<float>(p[i]), bi);
      } else {  // a block of 32 is 4 * bits whole bytes
        for (int k = k0; k < k0 + wt.group; k += 32) {
          const uint8_t* p = w + static_cast<size_t>(k / 32) * 4 * bits;
          for (int i = 0; i < 32; ++i) {
            out[k + i] = std::fma(sc, static_cast<float>(weight_value(p, bits, i)), bi);
          }
        }
      }
    }
  }
}

int available_kernels(const KernelSet** out, int max) {
  const Available& a = available();
  int n = 0;
  for (int i = 0; i < a.count && n < max; ++i) out[n++] = &a.sets[i];
  return n;
}

const KernelSet& select_kernels() {
  static const KernelSet* chosen = [] {
    const Available& a = available();
    const KernelSet* best = &a.sets[a.count - 1];
    if (const char* want = std::getenv("AFM_QMM_ISA"); want != nullptr && *want) {
      for (int i = 0; i < a.count; ++i) {
        if (std::strcmp(a.sets[i].name, want) == 0) best = &a.sets[i];
      }
    }
    return best;
  }();
  return *chosen;
}

}  // namespace afm_qmm
