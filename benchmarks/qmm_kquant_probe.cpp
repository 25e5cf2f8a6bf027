// afm's K-quant products (ext/qmm/kquant_kernels.cpp: GGUF's Q4_K and Q6_K
// blocks as they are, activations int8 per 256, the integer sub-scales
// inside the integer pipeline, one float stage per block) against its
// `avx2` kernels on the MLX layout afm converts the same tensors to (Q4_K:
// 4 bits with a float16 scale and bias per 32, 5 bits a weight; Q6_K: 8-bit
// codes with a float16 scale per 32, 8.5 bits), one activation row, on the
// shapes of Qwen2.5-Coder-1.5B's decode step (issue 29).
//
// Each K-quant product is first checked against a float64 dot of
// kquant_dequantize_rows's values with the quantized activations.  Then, in
// each round, four products back to back: the MLX layout with 16-bit
// activations (afm's default) and with 8-bit ones, the blocks with two
// passes (16-bit) and with one (8-bit, their default), each on a copy of
// the weights not read since several rounds: the copies add up to ~400 MB
// a layout, so every product reads its weights from memory, as a decode step
// does (this machine's L3 is 32 MB; a 15 MB weight read twice in a row would
// come from it the second time).  1 and 2 threads, each a share of the
// output rows as afm's pool splits them; each ratio is the median of the
// rounds' own.  It also prints each path's error against the float64 product
// with the float activations: the price of int8 activations per 256.
//
//     g++ -O3 -std=c++20 -fwrapv -Iext/qmm -Ibenchmarks -o /tmp/qmm_kquant_probe benchmarks/qmm_kquant_probe.cpp ext/qmm/kquant_kernels.cpp -lpthread
//     /tmp/qmm_kquant_probe [rounds]
//
// Needs an x86-64 CPU with AVX2, FMA and F16C.
#include "qmm_kernels.cpp"
#include "qmm_bench.h"
#include "kquant_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

namespace {

using namespace afm_qmm;

__attribute__((target("f16c"))) uint16_t to_half(float f) { return _cvtss_sh(f, 0); }

float small_scale() { return 0.0005f + 0.0005f * static_cast<float>(next_u32() % 1000) / 1000.0f; }

// Random blocks of `kquant` (4: Q4_K, 6: Q6_K): any bytes, float16 fields of a trained weight's size.
std::vector<uint8_t> random_blocks(int kquant, int K, int N) {
  const int size = kquant_block_bytes(kquant), nb = K / kKQuantBlock;
  std::vector<uint8_t> w(static_cast<size_t>(N) * nb * size);
  for (auto& b : w) b = static_cast<uint8_t>(next_u32());
  for (size_t blk = 0; blk < static_cast<size_t>(N) * nb; ++blk) {
    uint8_t* p = w.data() + blk * size;
    const uint16_t d = to_half(small_scale() / (kquant == 4 ? 4 : 8)), dmin = to_half(small_scale() / 4);
    std::memcpy(p + (kquant == 4 ? 0 : 208), &d, 2);
    if (kquant == 4) std::memcpy(p + 2, &dmin, 2);
  }
  return w;
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

QWeights kquant_weights(const std::vector<uint8_t>& w, int kquant, int K, int N) {
  QWeights wt;
  wt.w = w.data();
  wt.N = N;
  wt.K = K;
  wt.kquant = kquant;
  return wt;
}

double mlx_value(const Mlx& l, int K, int n, int i) {
  const size_t g = static_cast<size_t>(n) * (K / 32) + i / 32;
  const double s = half_to_float(l.scales[g]);
  const double bias = l.bits == 8 ? -128.0 * s : half_to_float(l.biases[g]);
  return s * weight_value(l.w.data() + static_cast<size_t>(n) * K * l.bits / 8, l.bits, i) + bias;
}

// One activation row as kquant_quantize_rows makes it, and its values (the passes summed).
struct KQRow {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> bsums;
  QActs view;
  std::vector<double> values;
};

KQRow quantize_kquant(const std::vector<float>& x, int passes) {
  const int K = static_cast<int>(x.size()), nb = K / kKQuantBlock;
  KQRow a{std::vector<int8_t>(static_cast<size_t>(passes) * K), std::vector<float>(passes * nb),
          std::vector<int16_t>(static_cast<size_t>(passes) * K / 16), {}, std::vector<double>(K, 0.0)};
  kquant_quantize_rows(x.data(), K, passes, a.q.data(), a.d.data(), a.bsums.data(), 0, 1);
  a.view.q = a.q.data();
  a.view.d = a.d.data();
  a.view.bsums = a.bsums.data();
  a.view.M = passes;
  a.view.K = K;
  a.view.passes = passes;
  for (int p = 0; p < passes; ++p) {
    for (int i = 0; i < K; ++i) a.values[i] += static_cast<double>(a.d[p * nb + i / kKQuantBlock]) * a.q[p * K + i];
  }
  return a;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 21;
  const KernelSet* set = kernel_set("avx2");
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
  std::printf("one-row products, weights from memory; %d rounds of the four paths back to back, each on a copy "
              "not read for several rounds; ratios: medians of the rounds' own\n", rounds);
  for (const Shape& sh : shapes) {
    const int K = sh.K, N = sh.N;
    const int mlx_bits = sh.kquant == 6 ? 8 : 4;
    const int copies = std::max(1, static_cast<int>(400e6 / (static_cast<double>(K) * N)));
    std::vector<Mlx> mlx;
    std::vector<std::vector<uint8_t>> kq;
    for (int c = 0; c < copies; ++c) {
      mlx.push_back(random_mlx(K, N, mlx_bits));
      kq.push_back(random_blocks(sh.kquant, K, N));
    }
    std::vector<float> x(K);
    for (auto& v : x) v = static_cast<float>(static_cast<int>(next_u32() % 2001) - 1000) / 1000.0f;
    const OneRow a16 = quantize_one_row(*set, x, mlx_bits, 2), a8 = quantize_one_row(*set, x, mlx_bits, 1);
    const KQRow k16 = quantize_kquant(x, 2), k8 = quantize_kquant(x, 1);
    std::vector<float> out(N);

    auto run_mlx = [&](int c, const OneRow& a) {
      const QWeights wt = weights_of(mlx[c], K, N);
      return [&, wt](int n0, int n1) { set->range(a.view, wt, out.data(), n0, n1); };
    };
    auto run_kq = [&](int c, const KQRow& a) {
      const QWeights wt = kquant_weights(kq[c], sh.kquant, K, N);
      return [&, wt](int n0, int n1) { kquant_range_avx2(a.view, wt, out.data(), n0, n1); };
    };
    // the first 64 rows' worst error against the float64 product, relative to its terms' magnitude
    std::vector<float> w0(static_cast<size_t>(64) * K);
    kquant_dequantize_rows(kquant_weights(kq[0], sh.kquant, K, N), 0, 64, w0.data());
    auto error = [&](auto value, const std::vector<double>& act) {
      double worst = 0.0;
      for (int n = 0; n < 64; ++n) {
        double want = 0.0, magnitude = 0.0;
        for (int i = 0; i < K; ++i) {
          want += value(n, i) * act[i];
          magnitude += std::fabs(value(n, i) * x[i]);
        }
        worst = std::max(worst, std::fabs(out[n] - want) / magnitude);
      }
      return worst;
    };
    auto kv = [&](int n, int i) { return static_cast<double>(w0[static_cast<size_t>(n) * K + i]); };
    auto mv = [&](int n, int i) { return mlx_value(mlx[0], K, n, i); };
    const std::vector<double> xd(x.begin(), x.end());
    double e_kq[2];
    for (int passes = 1; passes <= 2; ++passes) {
      const KQRow& a = passes == 1 ? k8 : k16;
      timed_rows(N, 1, run_kq(0, a));
      const double own = error(kv, a.values);  // with its own activations: float rounding only
      if (own > 1e-5) {
        std::printf("%s: the K-quant kernel (%d pass%s) is %.3g off its float64 reference\n", sh.name, passes,
                    passes > 1 ? "es" : "", own);
        return 1;
      }
      e_kq[passes - 1] = error(kv, xd);
    }
    timed_rows(N, 1, run_mlx(0, a16));
    const double e16 = error(mv, xd);
    timed_rows(N, 1, run_mlx(0, a8));
    const double e8 = error(mv, xd);
    const double bytes_mlx = static_cast<double>(K) * N * (mlx_bits / 8.0 + (mlx_bits == 8 ? 2.0 : 4.0) / 32);
    const double bytes_kq = static_cast<double>(kq[0].size());
    std::printf("%s; bytes afm / Q%d_K %.2f\n  worst error over |products| against the float activations: "
                "afm 16-bit %.1e, 8-bit %.1e; Q%d_K 16-bit %.1e, 8-bit %.1e\n",
                sh.name, sh.kquant, bytes_mlx / bytes_kq, e16, e8, sh.kquant, e_kq[1], e_kq[0]);
    for (int threads = 1; threads <= 2; ++threads) {
      std::vector<double> t16, t8, tk16, tk8;
      for (int r = 0; r < rounds; ++r) {
        const int c0 = (2 * r) % copies, c1 = (2 * r + 1) % copies;
        t16.push_back(timed_rows(N, threads, run_mlx(c0, a16)));
        tk16.push_back(timed_rows(N, threads, run_kq(c0, k16)));
        t8.push_back(timed_rows(N, threads, run_mlx(c1, a8)));
        tk8.push_back(timed_rows(N, threads, run_kq(c1, k8)));
      }
      std::vector<double> r16, r8, rx;
      for (int r = 0; r < rounds; ++r) {
        r16.push_back(t16[r] / tk16[r]);
        r8.push_back(t8[r] / tk8[r]);
        rx.push_back(t16[r] / tk8[r]);
      }
      const double m16 = median(t16), m8 = median(t8), mk16 = median(tk16), mk8 = median(tk8);
      std::printf("  %d thread%s, us (GB/s): afm %d-bit/32 %7.1f (%4.1f), 8-bit acts %7.1f (%4.1f) | Q%d_K 16-bit "
                  "acts %7.1f (%4.1f), 8-bit %7.1f (%4.1f) | afm time / Q%d_K: 16-bit acts %.2f, 8-bit %.2f; "
                  "afm 16-bit / Q%d_K 8-bit %.2f\n",
                  threads, threads > 1 ? "s" : " ", mlx_bits, m16 * 1e6, bytes_mlx / m16 / 1e9, m8 * 1e6,
                  bytes_mlx / m8 / 1e9, sh.kquant, mk16 * 1e6, bytes_kq / mk16 / 1e9, mk8 * 1e6, bytes_kq / mk8 / 1e9,
                  sh.kquant, median(r16), median(r8), sh.kquant, median(rx));
    }
  }
  return 0;
}
