// Would kernels that read GGUF's K-quant blocks as they are make afm's AVX2
// one-row products faster?  A probe for issue 29's single-stream decode of
// Qwen2.5-Coder-1.5B (Q4_K_M): its Q4_K tensors afm holds in MLX's layout
// as 4-bit codes with a float16 scale and bias per 32 (5 bits a weight),
// its Q6_K ones (the head, half the down projections) as 8-bit codes with a
// float16 scale per 32 (8.5 bits).  llama.cpp reads them as they are, 4.5
// and 6.56 bits a weight, and its dot products apply the integer sub-block
// scales inside the integer pipeline, converting to float once per 256
// weights, with activations quantized to int8 per 256 (Q8_K).  afm's
// kernels convert to float and scale per block of 32, with 16-bit
// activations (two int8 passes) by default.
//
// This file has two such kernels for AVX2 (written here from the formats'
// definitions, GGUF's block layouts byte for byte):
//   Q6_K . Q8_K: a block of 256 is 128 bytes of low nibbles, 64 of high
//     bit pairs, 16 int8 scales (one per 16), a float16 d; w = d * sc * (q - 32).
//   Q4_K . Q8_K: float16 d and dmin, 12 bytes of 6-bit scales and mins (one
//     pair per 32), 128 bytes of nibbles; w = d * sc * q - dmin * m.
// Each is checked against a float64 dot of the dequantized block with the
// dequantized int8 activations (what the kernel computes, up to float
// rounding), and timed, interleaved, against afm's `avx2` set on the layout
// afm holds the same tensor in (8 bits per 32 for Q6_K, 4 bits per 32 with
// biases for Q4_K), with afm's 16-bit activations (its default) and with
// 8-bit ones (AFM_QMM_ACT_BITS=8).  The weights are copies adding up to
// ~400 MB, so they come from memory as in a decode step; 1 and 2 threads,
// each a share of the output rows as afm's pool splits them.  It also
// prints each path's error against the float64 product with the float
// activations: the price of int8 activations per 256.
//
//     g++ -O3 -std=c++20 -fwrapv -Iext/qmm -Ibenchmarks -o /tmp/qmm_kquant_probe benchmarks/qmm_kquant_probe.cpp ext/qmm/kquant_kernels.cpp -lpthread
//     /tmp/qmm_kquant_probe [reps]
//
// Needs an x86-64 CPU with AVX2, FMA and F16C.
#include "qmm_kernels.cpp"
#include "qmm_bench.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

namespace {

using namespace afm_qmm;

#define KQ_AVX2 __attribute__((target("avx2,fma,f16c")))

constexpr int QK = 256;

// GGUF's blocks, in file order.
struct BlockQ6K {
  uint8_t ql[QK / 2];      // low 4 bits
  uint8_t qh[QK / 4];      // high 2 bits
  int8_t scales[QK / 16];  // one per 16
  uint16_t d;              // float16
};
static_assert(sizeof(BlockQ6K) == 210);

struct BlockQ4K {
  uint16_t d, dmin;  // float16
  uint8_t scales[12];  // 8 scales and 8 mins, 6 bits each
  uint8_t qs[QK / 2];
};
static_assert(sizeof(BlockQ4K) == 144);

// Activations: int8 per 256 with one float scale, and the sums of the codes per 16.
struct BlockQ8K {
  float d;
  int8_t qs[QK];
  int16_t bsums[QK / 16];
};

// ---------------------------------------------------------------- formats (scalar)

// Q6_K element i of a block: within each half of 128, positions l < 32 of the
// nibble rows ql[l] (low), ql[l + 32] (low), ql[l] (high), ql[l + 32] (high)
// are elements l, l + 32, l + 64, l + 96, their high bits 2 apart in qh[l].
int q6k_code(const BlockQ6K& b, int i) {
  const int h = i / 128, r = i % 128, quarter = r / 32, l = r % 32;
  const uint8_t lo = b.ql[64 * h + l + 32 * (quarter & 1)];
  const int low = quarter < 2 ? (lo & 0xF) : (lo >> 4);
  const int high = (b.qh[32 * h + l] >> (2 * quarter)) & 3;
  return low | (high << 4);
}

double q6k_value(const BlockQ6K& b, int i) {
  return static_cast<double>(half_to_float(b.d)) * b.scales[i / 16] * (q6k_code(b, i) - 32);
}

// Q4_K's 6-bit scale and min of sub-block j (of 32).
void q4k_scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Element i: within each 64, the low nibbles of 32 bytes, then their high nibbles.
double q4k_value(const BlockQ4K& b, int i) {
  const int j = i / 32, byte = 32 * (i / 64) + i % 32;
  const int q = (j & 1) ? (b.qs[byte] >> 4) : (b.qs[byte] & 0xF);
  int sc, m;
  q4k_scale_min(b.scales, j, sc, m);
  return static_cast<double>(half_to_float(b.d)) * sc * q - static_cast<double>(half_to_float(b.dmin)) * m;
}

// x as Q8_K blocks; with passes == 2, followed by the remainder x - d q's (~16-bit activations).
std::vector<BlockQ8K> quantize_q8k(const std::vector<float>& x, int passes) {
  const size_t nb = x.size() / QK;
  std::vector<BlockQ8K> out(passes * nb);
  std::vector<float> rest(x);
  for (size_t b = 0; b < out.size(); ++b) {
    const float* xb = rest.data() + QK * (b % nb);
    float amax = 0.0f;
    for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
    BlockQ8K& q = out[b];
    q.d = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int g = 0; g < QK / 16; ++g) {
      int sum = 0;
      for (int i = 16 * g; i < 16 * g + 16; ++i) {
        q.qs[i] = static_cast<int8_t>(std::clamp(static_cast<int>(std::lrintf(xb[i] * inv)), -127, 127));
        sum += q.qs[i];
      }
      q.bsums[g] = static_cast<int16_t>(sum);
    }
    if (b + 1 == nb) {
      for (size_t i = 0; i < x.size(); ++i) rest[i] -= out[i / QK].d * out[i / QK].qs[i % QK];
    }
  }
  return out;
}

// ---------------------------------------------------------------- AVX2 kernels

KQ_AVX2 inline float hsum_ps(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

KQ_AVX2 inline float f16(uint16_t h) { return _cvtsh_ss(h); }

// Byte shuffles that copy one 16-bit word of a lane over the whole lane: word
// 2k in the low lane and 2k + 1 in the high one (Q6_K: the two scales of a
// chunk of 32), or word k in both (Q4_K: one scale per 32).
KQ_AVX2 inline __m256i word_pair_shuffle(int k) {
  const int lo = 4 * k, hi = 4 * k + 2;
  return _mm256_setr_epi8(lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo,
                          lo + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1,
                          hi, hi + 1);
}

KQ_AVX2 inline __m256i word_shuffle(int k) {
  const int b = 2 * k;
  return _mm256_setr_epi8(b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b,
                          b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1);
}

int prefetch_ahead = 1024;  // bytes past the block in use

// Rows [n0, n1) of a Q6_K weight (K / 256 blocks a row) times one activation
// row as PASSES Q8_K rows of K / 256 blocks each (2: the row and its
// remainder, ~16-bit activations; the products of the passes summed).
template <int PASSES>
KQ_AVX2 void range_q6k(const BlockQ8K* x, const BlockQ6K* w, int K, float* out, int n0, int n1) {
  const int nb = K / QK;
  const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(3);
  __m256i shuf[4];
  for (int k = 0; k < 4; ++k) shuf[k] = word_pair_shuffle(k);
  for (int n = n0; n < n1; ++n) {
    const BlockQ6K* row = w + static_cast<ptrdiff_t>(n) * nb;
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      const BlockQ6K& blk = row[b];
      _mm_prefetch(reinterpret_cast<const char*>(&blk) + prefetch_ahead, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(&blk) + prefetch_ahead + 64, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(&blk) + prefetch_ahead + 128, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(&blk) + prefetch_ahead + 192, _MM_HINT_T0);
      // The 16 scales as int16: sc[0..7] in the low lane's words, sc[8..15] in the high lane's.
      const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.scales)));
      // The -32 of every code: 32 * sum over the 16 groups of sc * (sum of the activations' codes).
      __m256i sumi[PASSES];
      for (int p = 0; p < PASSES; ++p) {
        const BlockQ8K& xb = x[static_cast<ptrdiff_t>(p) * nb + b];
        const __m256i offs = _mm256_madd_epi16(sc16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.bsums)));
        sumi[p] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offs, 5));
      }
      for (int h = 0; h < 2; ++h) {
        const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.ql + 64 * h));
        const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.ql + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qh + 32 * h));
        const __m256i q[4] = {
            _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4)),
            _mm256_or_si256(_mm256_and_si256(ql1, m4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                            _mm256_and_si256(qh, _mm256_set1_epi8(0x30))),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 2), _mm256_set1_epi8(0x30))),
        };
        // This half's 8 scales in both lanes, then each chunk's pair.
        const __m256i sch = _mm256_permute4x64_epi64(sc16, h == 0 ? 0x44 : 0xEE);
        for (int k = 0; k < 4; ++k) {
          const __m256i s = _mm256_shuffle_epi8(sch, shuf[k]);
          for (int p = 0; p < PASSES; ++p) {
            const int8_t* a = x[static_cast<ptrdiff_t>(p) * nb + b].qs + 128 * h + 32 * k;
            const __m256i prod = _mm256_maddubs_epi16(q[k], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
            sumi[p] = _mm256_add_epi32(sumi[p], _mm256_madd_epi16(prod, s));  // prod: |.| <= 2 * 63 * 127
          }
        }
      }
      const float d = f16(blk.d);
      for (int p = 0; p < PASSES; ++p) {
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[p]), _mm256_set1_ps(d * x[static_cast<ptrdiff_t>(p) * nb + b].d),
                              acc);
      }
    }
    out[n] = hsum_ps(acc);
  }
}

// Q4_K's 8 scales (bytes 0-7) and 8 mins (bytes 8-15) from its 12 bytes.
inline void q4k_unpack(const uint8_t* s, uint32_t u[4]) {
  std::memcpy(u, s, 12);
  const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, two = 0x03030303;
  u[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & two) << 4);  // mins 4-7
  const uint32_t mins_lo = u[1] & low6;                        // mins 0-3
  u[1] = (u[2] & low4) | (((u[0] >> 6) & two) << 4);          // scales 4-7
  u[2] = mins_lo;
  u[0] &= low6;  // scales 0-3
}

// range_q6k's for a Q4_K weight.
template <int PASSES>
KQ_AVX2 void range_q4k(const BlockQ8K* x, const BlockQ4K* w, int K, float* out, int n0, int n1) {
  const int nb = K / QK;
  const __m256i m4 = _mm256_set1_epi8(0xF);
  __m256i shuf[8];
  for (int k = 0; k < 8; ++k) shuf[k] = word_shuffle(k);
  for (int n = n0; n < n1; ++n) {
    const BlockQ4K* row = w + static_cast<ptrdiff_t>(n) * nb;
    __m256 acc = _mm256_setzero_ps();
    __m128 accm = _mm_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      const BlockQ4K& blk = row[b];
      _mm_prefetch(reinterpret_cast<const char*>(&blk) + prefetch_ahead, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(&blk) + prefetch_ahead + 64, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(&blk) + prefetch_ahead + 128, _MM_HINT_T0);
      uint32_t u[4];
      q4k_unpack(blk.scales, u);
      const __m128i sm = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
      const __m128i mins8 = _mm_cvtepu8_epi16(_mm_unpackhi_epi64(sm, sm));
      const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
      const float d = f16(blk.d), dmin = f16(blk.dmin);
      __m256i sumi[PASSES];
      for (int p = 0; p < PASSES; ++p) {
        // The mins' term: sum over the 8 sub-blocks of m * (the activations' codes' sum over its 32).
        const BlockQ8K& xb = x[static_cast<ptrdiff_t>(p) * nb + b];
        const __m128i bs = _mm_hadd_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xb.bsums)),
                                          _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb.bsums + 8)));
        accm = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mins8, bs)), _mm_set1_ps(dmin * xb.d), accm);
        sumi[p] = _mm256_setzero_si256();
      }
      for (int j = 0; j < 4; ++j) {
        const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qs + 32 * j));
        const __m256i lo = _mm256_and_si256(qs, m4), hi = _mm256_and_si256(_mm256_srli_epi16(qs, 4), m4);
        const __m256i slo = _mm256_shuffle_epi8(sc, shuf[2 * j]), shi = _mm256_shuffle_epi8(sc, shuf[2 * j + 1]);
        for (int p = 0; p < PASSES; ++p) {
          const int8_t* a = x[static_cast<ptrdiff_t>(p) * nb + b].qs + 64 * j;
          const __m256i plo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
          const __m256i phi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32)));
          sumi[p] = _mm256_add_epi32(sumi[p], _mm256_add_epi32(_mm256_madd_epi16(plo, slo), _mm256_madd_epi16(phi, shi)));
        }
      }
      for (int p = 0; p < PASSES; ++p) {
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[p]), _mm256_set1_ps(d * x[static_cast<ptrdiff_t>(p) * nb + b].d),
                              acc);
      }
    }
    __m128 m = _mm_add_ps(accm, _mm_movehl_ps(accm, accm));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    out[n] = hsum_ps(acc) - _mm_cvtss_f32(m);
  }
}

// ---------------------------------------------------------------- test data

uint64_t rng_state = 0x2545F4914F6CDD1Dull;
uint32_t next_u32() {  // xorshift64*
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return static_cast<uint32_t>((rng_state * 0x2545F4914F6CDD1Dull) >> 32);
}

KQ_AVX2 uint16_t to_half(float f) { return _cvtss_sh(f, 0); }

float small_scale() { return 0.0005f + 0.0005f * static_cast<float>(next_u32() % 1000) / 1000.0f; }

std::vector<BlockQ6K> random_q6k(size_t blocks) {
  std::vector<BlockQ6K> v(blocks);
  for (auto& b : v) {
    for (auto& c : b.ql) c = static_cast<uint8_t>(next_u32());
    for (auto& c : b.qh) c = static_cast<uint8_t>(next_u32());
    for (auto& s : b.scales) s = static_cast<int8_t>(static_cast<int>(next_u32() % 255) - 127);
    b.d = to_half(small_scale() / 8);
  }
  return v;
}

std::vector<BlockQ4K> random_q4k(size_t blocks) {
  std::vector<BlockQ4K> v(blocks);
  for (auto& b : v) {
    for (auto& c : b.qs) c = static_cast<uint8_t>(next_u32());
    for (auto& c : b.scales) c = static_cast<uint8_t>(next_u32());
    b.d = to_half(small_scale() / 4);
    b.dmin = to_half(small_scale() / 4);
  }
  return v;
}

// afm's layout of a weight (MLX's affine, group 32, float16 scales and biases).
struct Mlx {
  int bits;
  std::vector<uint8_t> w;
  std::vector<uint16_t> scales, biases;
};

Mlx random_mlx(int K, int N, int bits) {
  const size_t groups = static_cast<size_t>(N) * K / 32;
  Mlx l{bits, std::vector<uint8_t>(static_cast<size_t>(N) * K * bits / 8), std::vector<uint16_t>(groups),
        std::vector<uint16_t>(groups)};
  for (auto& b : l.w) b = static_cast<uint8_t>(next_u32());
  for (auto& s : l.scales) s = to_half(small_scale());
  for (auto& s : l.biases) s = to_half(-small_scale() * 8);
  return l;
}

QWeights weights_of(const Mlx& l, int K, int N) {
  QWeights wt;
  wt.w = l.w.data();
  wt.scales = l.scales.data();
  wt.biases = l.bits == 8 ? l.scales.data() : l.biases.data();
  wt.scale_type = ScaleType::f16;
  wt.N = N;
  wt.K = K;
  wt.group = 32;
  wt.bits = l.bits;
  wt.bias_factor = l.bits == 8 ? -128.0f : 0.0f;  // Q6_K's tensors: symmetric, as afm converts them
  return wt;
}

double mlx_value(const Mlx& l, int K, int n, int i) {
  const size_t g = static_cast<size_t>(n) * (K / 32) + i / 32;
  const double s = half_to_float(l.scales[g]);
  const double bias = l.bits == 8 ? -128.0 * s : half_to_float(l.biases[g]);
  return s * weight_value(l.w.data() + static_cast<size_t>(n) * K * l.bits / 8, l.bits, i) + bias;
}

// One activation row quantized by `set` with `passes` int8 passes (2: afm's 16-bit default).
OneRow quantize_passes(const KernelSet& set, const std::vector<float>& x, int bits, int passes) {
  if (passes == 2) return quantize_one_row(set, x, bits);
  const int K = static_cast<int>(x.size());
  OneRow a{std::vector<int8_t>(2 * static_cast<size_t>(K)), std::vector<float>(K / 32 + 8),
           std::vector<float>(K / 32 + 8), {}};
  const int64_t offset = 0;
  set.quantize(x.data(), &offset, 1, K, 32, bits, 1, a.q.data(), a.d.data(), a.xsum.data(), 0, 1);
  a.view.q = a.q.data();
  a.view.d = a.d.data();
  a.view.xsum = a.xsum.data();
  a.view.M = 1;
  a.view.K = K;
  a.view.passes = 1;
  return a;
}

// Worst error of out's first rows against want(n) (float64), relative to the products' magnitude.
template <typename Want, typename Mag>
double worst_error(const std::vector<float>& out, int rows, Want want, Mag magnitude) {
  double worst = 0.0;
  for (int n = 0; n < rows; ++n) worst = std::max(worst, std::fabs(out[n] - want(n)) / magnitude(n));
  return worst;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 21;
  if (const char* e = std::getenv("KQ_PREFETCH")) prefetch_ahead = std::atoi(e);
  const KernelSet* sets[8];
  const int count = available_kernels(sets, 8);
  const KernelSet* set = nullptr;
  for (int i = 0; i < count; ++i) {
    if (std::strcmp(sets[i]->name, "avx2") == 0) set = sets[i];
  }
  if (set == nullptr) {
    std::printf("this CPU does not run the avx2 kernel set\n");
    return 1;
  }
  struct Shape {
    const char* name;
    int K, N, kquant;  // 6: Q6_K against afm's 8 bits; 4: Q4_K against afm's 4 bits
  };
  const Shape shapes[] = {{"down Q6_K (K 8960 x N 1536)", 8960, 1536, 6},
                          {"head Q6_K (K 1536 x N 151936)", 1536, 151936, 6},
                          {"gate+up Q4_K (K 1536 x N 17920)", 1536, 17920, 4},
                          {"down Q4_K (K 8960 x N 1536)", 8960, 1536, 4}};
  std::printf("one-row products, weights from memory; medians of %d rounds, each round the four paths back to back, ratios the median of the rounds' own; prefetch %d bytes ahead\n", reps,
              prefetch_ahead);
  for (const Shape& sh : shapes) {
    const int K = sh.K, N = sh.N, nb = K / QK;
    const int mlx_bits = sh.kquant == 6 ? 8 : 4;
    const int copies = std::max(1, static_cast<int>(400e6 / (static_cast<double>(K) * N)));
    std::vector<Mlx> mlx;
    std::vector<std::vector<BlockQ6K>> q6;
    std::vector<std::vector<BlockQ4K>> q4;
    for (int c = 0; c < copies; ++c) {
      mlx.push_back(random_mlx(K, N, mlx_bits));
      if (sh.kquant == 6) {
        q6.push_back(random_q6k(static_cast<size_t>(N) * nb));
      } else {
        q4.push_back(random_q4k(static_cast<size_t>(N) * nb));
      }
    }
    std::vector<float> x(K);
    for (auto& v : x) v = static_cast<float>(static_cast<int>(next_u32() % 2001) - 1000) / 1000.0f;
    const OneRow a16 = quantize_passes(*set, x, mlx_bits, 2), a8 = quantize_passes(*set, x, mlx_bits, 1);
    const std::vector<BlockQ8K> xq = quantize_q8k(x, 1), xq2 = quantize_q8k(x, 2);
    std::vector<double> xqd(K), xqd2(K);  // the int8 activations as values (one pass, two)
    for (int i = 0; i < K; ++i) {
      xqd[i] = static_cast<double>(xq[i / QK].d) * xq[i / QK].qs[i % QK];
      const BlockQ8K& r = xq2[nb + i / QK];
      xqd2[i] = xqd[i] + static_cast<double>(r.d) * r.qs[i % QK];
    }
    std::vector<float> out(N);

    auto run_mlx = [&](const Mlx& l, const OneRow& a) {
      const QWeights wt = weights_of(l, K, N);
      return [&, wt](int n0, int n1) { set->range(a.view, wt, out.data(), n0, n1); };
    };
    auto run_kq = [&](int c, int passes) {
      return [&, c, passes](int n0, int n1) {
        if (sh.kquant == 6) {
          (passes == 1 ? range_q6k<1> : range_q6k<2>)(passes == 1 ? xq.data() : xq2.data(), q6[c].data(), K,
                                                      out.data(), n0, n1);
        } else {
          (passes == 1 ? range_q4k<1> : range_q4k<2>)(passes == 1 ? xq.data() : xq2.data(), q4[c].data(), K,
                                                      out.data(), n0, n1);
        }
      };
    };
    auto kq_value = [&](int n, int i) {
      return sh.kquant == 6 ? q6k_value(q6[0][static_cast<size_t>(n) * nb + i / QK], i % QK)
                            : q4k_value(q4[0][static_cast<size_t>(n) * nb + i / QK], i % QK);
    };
    auto mv = [&](int n, int i) { return mlx_value(mlx[0], K, n, i); };
    auto dot = [&](auto value, const auto& act, int n) {
      double s = 0.0;
      for (int i = 0; i < K; ++i) s += value(n, i) * act[i];
      return s;
    };
    auto magnitude = [&](auto value, int n) {
      double s = 0.0;
      for (int i = 0; i < K; ++i) s += std::fabs(value(n, i) * x[i]);
      return s;
    };
    // out's worst error over its first 64 rows against value . act, relative to the products' magnitude.
    auto error = [&](auto value, const auto& act) {
      return worst_error(out, 64, [&](int n) { return dot(value, act, n); }, [&](int n) { return magnitude(value, n); });
    };
    // Correctness first: the K-quant kernels against float64 with their own (int8) activations.
    double e_kq[2];
    for (int passes = 1; passes <= 2; ++passes) {
      timed_rows(N, 1, run_kq(0, passes));
      const double own = error(kq_value, passes == 1 ? xqd : xqd2);
      if (own > 1e-5) {
        std::printf("%s: the K-quant kernel (%d pass%s) is %.3g off its float64 reference\n", sh.name, passes,
                    passes > 1 ? "es" : "", own);
        return 1;
      }
      e_kq[passes - 1] = error(kq_value, x);
    }
    timed_rows(N, 1, run_mlx(mlx[0], a16));
    const double e16 = error(mv, x);
    timed_rows(N, 1, run_mlx(mlx[0], a8));
    const double e8 = error(mv, x);
    const double bytes_mlx = static_cast<double>(K) * N * (mlx_bits / 8.0 + (mlx_bits == 8 ? 2.0 : 4.0) / 32);
    const double bytes_kq = static_cast<double>(N) * nb * (sh.kquant == 6 ? sizeof(BlockQ6K) : sizeof(BlockQ4K));
    std::printf("%s; bytes afm / Q%d_K %.2f\n  worst error over |products| against the float activations: "
                "afm 16-bit %.1e, 8-bit %.1e; Q%d_K 16-bit %.1e, 8-bit %.1e\n",
                sh.name, sh.kquant, bytes_mlx / bytes_kq, e16, e8, sh.kquant, e_kq[1], e_kq[0]);
    for (int threads = 1; threads <= 2; ++threads) {
      std::vector<double> t16, t8, tk16, tk8;
      for (int r = 0; r < reps; ++r) {
        t16.push_back(timed_rows(N, threads, run_mlx(mlx[r % copies], a16)));
        tk16.push_back(timed_rows(N, threads, run_kq(r % copies, 2)));
        t8.push_back(timed_rows(N, threads, run_mlx(mlx[r % copies], a8)));
        tk8.push_back(timed_rows(N, threads, run_kq(r % copies, 1)));
      }
      // each ratio the median of the rounds' own (the four run back to back: drift cancels)
      std::vector<double> r16, r8, rx;
      for (int r = 0; r < reps; ++r) {
        r16.push_back(t16[r] / tk16[r]);
        r8.push_back(t8[r] / tk8[r]);
        rx.push_back(t16[r] / tk8[r]);
      }
      const double m16 = median(t16), m8 = median(t8), mk16 = median(tk16), mk8 = median(tk8);
      std::printf("  %d thread%s, us (GB/s): afm %d-bit/32 %7.1f (%4.1f), 8-bit acts %7.1f (%4.1f) | Q%d_K %7.1f (%4.1f), "
                  "8-bit acts %7.1f (%4.1f) | afm time / Q%d_K: %.2f, 8-bit acts %.2f; afm 16-bit / Q%d_K 8-bit %.2f\n",
                  threads, threads > 1 ? "s" : " ", mlx_bits, m16 * 1e6, bytes_mlx / m16 / 1e9, m8 * 1e6,
                  bytes_mlx / m8 / 1e9, sh.kquant, mk16 * 1e6, bytes_kq / mk16 / 1e9, mk8 * 1e6, bytes_kq / mk8 / 1e9,
                  sh.kquant, median(r16), median(r8), sh.kquant, median(rx));
    }
  }
  return 0;
}
