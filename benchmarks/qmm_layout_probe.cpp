// Would fewer bytes a weight make afm's AVX2 one-row products faster?  A
// probe for issue 29's single-stream decode of Qwen2.5-Coder-1.5B, whose Q6_K
// tensors (the head and the down projections) afm holds in MLX's layout as
// 8-bit codes with a float16 scale per 32 (8.5 bits a weight, the bias
// plane not read), where llama.cpp reads them at 6.56 bits.  The smallest
// exact layout afm's kernels could read instead keeps Q6_K's 6-bit codes and
// a scale per 16 (7 bits a weight, float16 scales): MLX cannot hold it
// (group sizes 32, 64, 128), so it would be afm's kernels' own.
//
// This file times, on the same shapes and interleaved, afm's `avx2` kernel
// set on the 8-bit layout against a prototype of that 6-bit kernel: the
// same 16-bit activations and block loop as qmm_x86.inc's row_dot (its
// load_w16<6> unpacking, its dot16), the per-16 scales applied as one
// vector per block (the lanes of dot16's sum hold elements 0-15 in 0-3 and
// 16-31 in 4-7, so [s0 x4, s1 x4] times d), the bias term from exact sums
// of x per 16.  Both are checked against a float64 reference before they
// are timed.  The weights are several copies (or one tensor of hundreds of
// MB), so they come from memory, as in a decode step; 1 and 2 threads,
// each thread a share of the output rows, as afm's pool splits them.
//
//     g++ -O3 -std=c++20 -fwrapv -Iext/qmm -Ibenchmarks -o /tmp/qmm_layout_probe benchmarks/qmm_layout_probe.cpp ext/qmm/kquant_kernels.cpp -lpthread
//     /tmp/qmm_layout_probe
//
// Needs an x86-64 CPU with AVX2, FMA and F16C.  Prints, per shape and thread
// count, the median microseconds and GB/s of each layout and their ratio.
#include "qmm_kernels.cpp"
#include "qmm_bench.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace afm_qmm {
namespace {
namespace avx2 {

// One activation row (16-bit, from this set's quantize with bits = 6: load_w16<6>'s order) times
// rows [n0, n1) of 6-bit codes with float16 scales per 16, every bias -32 x its scale.
// xsum16: the exact sums of x per 16.
#define AVX2_FMA_F16C __attribute__((target("avx2,fma,f16c")))

// Block blk of a row: acc[blk & 1] += (w . x) * d * sv (sv: the block's two scales, 4 lanes each).
AVX2_FMA_F16C static inline void block_6bit_g16(const uint8_t* wp, const int16_t* x, const float* d8, int blk,
                                                __m256 sv, __m256* acc) {
  __m256i w0, w1;
  load_w16<6>(wp + 24 * static_cast<ptrdiff_t>(blk), w0, w1);
  const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(dot16(w0, w1, x + 32 * static_cast<ptrdiff_t>(blk))),
                                 _mm256_load_ps(d8 + 8 * blk));
  acc[blk & 1] = _mm256_fmadd_ps(t, sv, acc[blk & 1]);
}

AVX2_FMA_F16C static void range_6bit_g16(const QActs& a, const float* xsum16, const QWeights& wt, float* out,
                                         int n0, int n1) {
  const int K = wt.K, nb = K / 32, ng = K / 16;
  const int ngp = (ng + 15) & ~15;
  const size_t row_bytes = static_cast<size_t>(K) * 6 / 8;
  float* s = thread_scratch(static_cast<size_t>(2) * ngp + 8 * static_cast<size_t>(nb));
  float* x16 = s + ngp;
  float* d8 = x16 + ngp;  // the activation's block scale in 8 lanes, per block
  for (int g = 0; g < ngp; ++g) x16[g] = g < ng ? xsum16[g] : 0.0f;
  for (int blk = 0; blk < nb; ++blk) _mm256_store_ps(d8 + 8 * blk, _mm256_set1_ps(a.d[blk]));
  const __m256i pick[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                           _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
  for (int n = n0; n < n1; ++n) {
    to_float(wt.scales, wt.scale_type, static_cast<size_t>(n) * ng, ng, static_cast<size_t>(wt.N) * ng, s);
    for (int g = ng; g < ngp; ++g) s[g] = 0.0f;
    __m256 bias = _mm256_setzero_ps();
    for (int g = 0; g < ngp; g += 8) bias = _mm256_fmadd_ps(_mm256_load_ps(s + g), _mm256_load_ps(x16 + g), bias);
    bias = _mm256_mul_ps(bias, _mm256_set1_ps(-32.0f));
    const uint8_t* wp = wt.w + n * row_bytes;
    const int16_t* x = reinterpret_cast<const int16_t*>(a.q);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    int blk = 0;
    for (; blk + 4 <= nb; blk += 4) {
      _mm_prefetch(reinterpret_cast<const char*>(wp + 24 * blk + kPrefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wp + 24 * blk + kPrefetch + 64), _MM_HINT_T0);
      const __m256 s8 = _mm256_load_ps(s + 2 * blk);
      for (int j = 0; j < 4; ++j) block_6bit_g16(wp, x, d8, blk + j, _mm256_permutevar8x32_ps(s8, pick[j]), acc);
    }
    for (; blk < nb; ++blk) {
      const __m256 sv = _mm256_setr_ps(s[2 * blk], s[2 * blk], s[2 * blk], s[2 * blk], s[2 * blk + 1],
                                       s[2 * blk + 1], s[2 * blk + 1], s[2 * blk + 1]);
      block_6bit_g16(wp, x, d8, blk, sv, acc);
    }
    out[n] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), bias));
  }
}

}  // namespace avx2
}  // namespace
}  // namespace afm_qmm

namespace {

using namespace afm_qmm;

AVX2_FMA_F16C uint16_t to_half(float f) { return _cvtss_sh(f, 0); }

struct Layout {
  int bits, group;
  std::vector<uint8_t> w;
  std::vector<uint16_t> scales;
};

Layout make_layout(int K, int N, int bits, int group) {
  Layout l{bits, group, std::vector<uint8_t>(static_cast<size_t>(N) * K * bits / 8),
           std::vector<uint16_t>(static_cast<size_t>(N) * K / group)};
  for (auto& b : l.w) b = static_cast<uint8_t>(next_u32());
  for (auto& s : l.scales) s = to_half(0.002f + 0.002f * static_cast<float>(next_u32() % 1000) / 1000.0f);
  return l;
}

double reference_row(const Layout& l, int K, int n, const std::vector<float>& x) {
  const uint8_t* row = l.w.data() + static_cast<size_t>(n) * K * l.bits / 8;
  const int offset = 1 << (l.bits - 1);
  double sum = 0.0;
  for (int i = 0; i < K; ++i) {
    const double s = half_to_float(l.scales[static_cast<size_t>(n) * (K / l.group) + i / l.group]);
    sum += s * (weight_value(row, l.bits, i) - offset) * x[i];
  }
  return sum;
}

// The activation row for the 6-bit kernel: quantize_one_row's, and x's exact sums per 16.
struct Acts {
  OneRow row;
  std::vector<float> xsum16;
};

Acts quantize_for(const KernelSet& set, const std::vector<float>& x, int bits) {
  Acts a{quantize_one_row(set, x, bits), std::vector<float>(x.size() / 16)};
  for (size_t g = 0; g < a.xsum16.size(); ++g) {
    double s = 0.0;
    for (int i = 0; i < 16; ++i) s += x[16 * g + i];
    a.xsum16[g] = static_cast<float>(s);
  }
  return a;
}

QWeights weights_of(const Layout& l, int K, int N) {
  QWeights wt;
  wt.w = l.w.data();
  wt.scales = wt.biases = l.scales.data();
  wt.scale_type = ScaleType::f16;
  wt.N = N;
  wt.K = K;
  wt.group = l.group;
  wt.bits = l.bits;
  wt.bias_factor = -static_cast<float>(1 << (l.bits - 1));
  return wt;
}

bool check(const char* what, const std::vector<float>& out, const Layout& l, int K, const std::vector<float>& x) {
  for (int n = 0; n < 64; ++n) {
    const double want = reference_row(l, K, n, x);
    double scale = 0.0;  // the products' magnitude, which the activations' int16 rounding scales with
    const uint8_t* row = l.w.data() + static_cast<size_t>(n) * K * l.bits / 8;
    for (int i = 0; i < K; ++i) {
      scale += std::fabs(half_to_float(l.scales[static_cast<size_t>(n) * (K / l.group) + i / l.group]) *
                         (weight_value(row, l.bits, i) - (1 << (l.bits - 1))) * x[i]);
    }
    if (std::fabs(out[n] - want) > 1e-4 * scale + 1e-6) {
      std::printf("%s: row %d is %.7g, the reference %.7g\n", what, n, out[n], want);
      return false;
    }
  }
  return true;
}

}  // namespace

int main() {
  const KernelSet* set = kernel_set("avx2");
  if (set == nullptr) {
    std::printf("this CPU does not run the avx2 kernel set\n");
    return 1;
  }
  struct Shape {
    const char* name;
    int K, N;
  };
  const Shape shapes[] = {{"down (K 8960 x N 1536)", 8960, 1536}, {"head (K 1536 x N 151936)", 1536, 151936}};
  std::printf("one-row products, weights from memory; median of 30, interleaved\n");
  for (const Shape& sh : shapes) {
    const int K = sh.K, N = sh.N;
    const int copies = std::max(1, static_cast<int>(400e6 / (static_cast<double>(K) * N)));
    std::vector<Layout> eight, six;
    for (int c = 0; c < copies; ++c) {
      eight.push_back(make_layout(K, N, 8, 32));
      six.push_back(make_layout(K, N, 6, 16));
    }
    std::vector<float> x(K);
    for (auto& v : x) v = static_cast<float>(static_cast<int>(next_u32() % 2001) - 1000) / 1000.0f;
    const Acts a8 = quantize_for(*set, x, 8), a6 = quantize_for(*set, x, 6);
    std::vector<float> out(N);
    auto run8 = [&](const Layout& l) {
      const QWeights wt = weights_of(l, K, N);
      return [&, wt](int n0, int n1) { set->range(a8.row.view, wt, out.data(), n0, n1); };
    };
    auto run6 = [&](const Layout& l) {
      const QWeights wt = weights_of(l, K, N);
      return [&, wt](int n0, int n1) { avx2::range_6bit_g16(a6.row.view, a6.xsum16.data(), wt, out.data(), n0, n1); };
    };
    timed_rows(N, 1, run8(eight[0]));
    if (!check("8 bits, groups of 32", out, eight[0], K, x)) return 1;
    timed_rows(N, 1, run6(six[0]));
    if (!check("6 bits, groups of 16", out, six[0], K, x)) return 1;
    const double bytes8 = static_cast<double>(K) * N * (1.0 + 2.0 / 32);
    const double bytes6 = static_cast<double>(K) * N * (0.75 + 2.0 / 16);
    for (int threads = 1; threads <= 2; ++threads) {
      std::vector<double> t8, t6;
      for (int r = 0; r < 30; ++r) {
        t8.push_back(timed_rows(N, threads, run8(eight[r % copies])));
        t6.push_back(timed_rows(N, threads, run6(six[r % copies])));
      }
      std::sort(t8.begin(), t8.end());
      std::sort(t6.begin(), t6.end());
      const double m8 = t8[15], m6 = t6[15];
      std::printf("%-26s %d thread%s: 8 bits/32 (8.5 bits a weight) %8.1f us %5.1f GB/s | "
                  "6 bits/16 (7 bits) %8.1f us %5.1f GB/s | 6-bit time / 8-bit %.2f (bytes %.2f)\n",
                  sh.name, threads, threads > 1 ? "s" : " ", m8 * 1e6, bytes8 / m8 / 1e9, m6 * 1e6,
                  bytes6 / m6 / 1e9, m6 / m8, bytes6 / bytes8);
    }
  }
  return 0;
}
