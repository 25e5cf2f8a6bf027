// A standalone check of qmm_kernels.cpp (no MLX, no Python), for the kernel
// sets a test process cannot load: built with a cross compiler and run under
// an emulator (tests/mlx/test_qmm_native.py: NEON on aarch64 under
// qemu-aarch64), or natively.  For every kernel set this CPU runs, every bit
// width, group, scale type and activation precision, it checks what
// tests/mlx/test_qmatmul.py checks through MLX:
//
// * each output row of 1 to 17 rows within the bound the arithmetic gives
//   against a float64 reference (see that file's docstring);
// * activations on the int8 grid: exact up to the float32 rounding;
// * a row's output bit for bit the same alone and among any number of rows.
//
// Arguments: the kernel sets to check (default: all).  Prints one line per
// failure and a summary; exits 1 on any failure.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "qmm_kernels.h"

using namespace afm_qmm;

namespace {

struct Rng {  // splitmix64
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  int below(int n) { return static_cast<int>(next() % static_cast<uint64_t>(n)); }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  double normal() {
    const double u = uniform() + 1e-12, v = uniform();
    return std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v);
  }
};

// A scale or bias of about 2^exp, exactly representable in float16 and
// bfloat16 (8 significant bits), so its float value is exact.
float exact_value(Rng& rng, int exp) {
  return std::ldexp(static_cast<float>(rng.below(255) - 127), exp - 7);
}

uint16_t to_bits(float v, ScaleType t) {
  if (t == ScaleType::bf16) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return static_cast<uint16_t>(u >> 16);  // exact: v has at most 8 significant bits
  }
  // float16: v = m * 2^e with |m| < 2^11 (exact by construction), subnormal below 2^-14
  const uint16_t sign = v < 0 ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(v));
  if (a == 0) return sign;
  int e;
  std::frexp(a, &e);  // a in [2^(e-1), 2^e)
  if (e - 1 < -14) return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::ldexp(a, 24)));
  const int man = static_cast<int>(std::ldexp(a, 11 - e)) - 1024;  // 10 bits below the leading 1
  return static_cast<uint16_t>(sign | ((e - 1 + 15) << 10) | man);
}

struct Case {
  int bits, group, K, N;
  ScaleType st;
  std::vector<uint8_t> w;
  std::vector<float> s32, b32;  // the values
  std::vector<uint16_t> s16, b16;
  std::vector<int> q;  // [N][K] the integers
  QWeights wt() const {
    QWeights r;
    r.w = w.data();
    r.scale_type = st;
    r.scales = st == ScaleType::f32 ? static_cast<const void*>(s32.data()) : s16.data();
    r.biases = st == ScaleType::f32 ? static_cast<const void*>(b32.data()) : b16.data();
    r.N = N;
    r.K = K;
    r.group = group;
    r.bits = bits;
    return r;
  }
};

Case make_case(Rng& rng, int bits, int group, ScaleType st) {
  Case c;
  c.bits = bits;
  c.group = group;
  c.st = st;
  c.K = group == 32 ? 864 : group == 64 ? 832 : 640;
  c.N = 37;
  const int ng = c.K / group;
  c.q.resize(static_cast<size_t>(c.N) * c.K);
  c.w.assign(static_cast<size_t>(c.N) * c.K * bits / 8, 0);
  for (int n = 0; n < c.N; ++n) {
    uint8_t* row = c.w.data() + static_cast<size_t>(n) * c.K * bits / 8;
    for (int k = 0; k < c.K; ++k) {  // MLX's bit stream: element k at bits [bits k, bits (k + 1))
      const int v = rng.below(1 << bits);
      c.q[static_cast<size_t>(n) * c.K + k] = v;
      for (int j = 0; j < bits; ++j) {
        if ((v >> j) & 1) row[(bits * k + j) >> 3] |= static_cast<uint8_t>(1u << ((bits * k + j) & 7));
      }
    }
  }
  for (int i = 0; i < c.N * ng; ++i) {
    c.s32.push_back(exact_value(rng, -3 - bits));
    c.b32.push_back(exact_value(rng, -4));
    c.s16.push_back(to_bits(c.s32.back(), st));
    c.b16.push_back(to_bits(c.b32.back(), st));
  }
  return c;
}

// y[m][n] for rows [0, M) of x through kernel set `ks` (activations quantized by it).
std::vector<float> product(const KernelSet& ks, const Case& c, const float* x, int M, int passes) {
  const int K = c.K, nb = K / 32, ng = K / c.group, MQ = M * passes;
  std::vector<int8_t> q(static_cast<size_t>(MQ) * K);
  std::vector<float> d(static_cast<size_t>(MQ) * nb), xs(static_cast<size_t>(MQ) * ng);
  std::vector<int64_t> offs(M);
  for (int m = 0; m < M; ++m) offs[m] = static_cast<int64_t>(m) * K;
  ks.quantize(x, offs.data(), 1, K, c.group, c.bits, passes, q.data(), d.data(), xs.data(), 0, M);
  QActs a;
  a.q = q.data();
  a.d = d.data();
  a.xsum = xs.data();
  a.M = MQ;
  a.K = K;
  a.passes = passes;
  std::vector<float> y(static_cast<size_t>(M) * c.N);
  const QWeights wt = c.wt();
  ks.range(a, wt, y.data(), 0, 21);  // two ranges, as the thread pool splits the rows
  ks.range(a, wt, y.data(), 21, c.N);
  return y;
}

int failures = 0;

void fail(const char* what, const KernelSet& ks, const Case& c, int passes, int m, int n, double err,
          double bound) {
  if (++failures <= 40) {
    std::printf("FAIL %s: %s bits %d group %d scales %d act %d row %d col %d: error %.3g > %.3g\n",
                what, ks.name, c.bits, c.group, static_cast<int>(c.st), passes == 2 ? 16 : 8, m, n,
                err, bound);
  }
}

void check(const KernelSet& ks, const Case& c, Rng& rng, bool on_grid) {
  const int M = 17, K = c.K, ng = K / c.group;
  std::vector<float> x(static_cast<size_t>(M) * K);
  for (int m = 0; m < M; ++m) {
    for (int b = 0; b < K / 32; ++b) {
      const double d = 0.01 + 0.09 * rng.uniform();
      for (int i = 0; i < 32; ++i) {
        float v = on_grid ? static_cast<float>(d * (i == 3 ? 127 : rng.below(255) - 127))
                          : static_cast<float>(rng.normal());
        x[static_cast<size_t>(m) * K + b * 32 + i] = v;
      }
    }
  }
  std::vector<double> amax(static_cast<size_t>(M) * (K / 32), 0.0);
  for (size_t i = 0; i < x.size(); ++i) amax[i / 32] = std::fmax(amax[i / 32], std::fabs(x[i]));
  for (int passes = 1; passes <= 2; ++passes) {
    std::vector<std::vector<float>> alone(M);
    for (int m = 0; m < M; ++m) alone[m] = product(ks, c, x.data() + static_cast<size_t>(m) * K, 1, passes);
    for (int m = 0; m < M; ++m) {
      const float* xr = x.data() + static_cast<size_t>(m) * K;
      for (int n = 0; n < c.N; ++n) {
        double ref = 0, act = 0, flt = 0;
        for (int k = 0; k < K; ++k) {
          const int g = n * ng + k / c.group;
          const double sq = static_cast<double>(c.s32[g]) * c.q[static_cast<size_t>(n) * K + k];
          ref += xr[k] * (sq + c.b32[g]);
          const double step = amax[(static_cast<size_t>(m) * K + k) / 32] / (passes == 1 ? 254.0 : 64516.0);
          act += std::fabs(sq) * step;
          flt += std::fabs(xr[k]) * (std::fabs(sq) + std::fabs(c.b32[g]));
        }
        const double bound = (on_grid ? 0.0 : 1.01 * act) + (K / 32 + 64) * 0x1.0p-24 * flt;
        const double err = std::fabs(alone[m][n] - ref);
        if (!(err <= bound)) fail(on_grid ? "grid" : "bound", ks, c, passes, m, n, err, bound);
      }
    }
    for (int rows = 2; rows <= M; rows += 3) {
      const std::vector<float> y = product(ks, c, x.data(), rows, passes);
      for (int m = 0; m < rows; ++m) {
        if (std::memcmp(y.data() + static_cast<size_t>(m) * c.N, alone[m].data(), sizeof(float) * c.N) != 0) {
          fail("rows", ks, c, passes, m, rows, 1, 0);
        }
      }
    }
  }
}

}  // namespace

// argv: the kernel sets to check (default: every one this CPU runs).
int main(int argc, char** argv) {
  const KernelSet* all[8];
  const KernelSet* sets[8];
  const int available = available_kernels(all, 8);
  int n = 0;
  for (int i = 0; i < available; ++i) {
    bool wanted = argc < 2;
    for (int j = 1; j < argc; ++j) wanted = wanted || std::strcmp(argv[j], all[i]->name) == 0;
    if (wanted) sets[n++] = all[i];
  }
  if (n < (argc < 2 ? 1 : argc - 1)) {
    std::printf("asked for a kernel set this CPU does not run\n");
    return 2;
  }
  Rng rng{12345};
  int cases = 0;
  for (int i = 0; i < n; ++i) {
    for (int bits : {2, 3, 4, 5, 6, 8}) {
      for (int group : {32, 64, 128}) {
        for (ScaleType st : {ScaleType::f32, ScaleType::f16, ScaleType::bf16}) {
          const Case c = make_case(rng, bits, group, st);
          check(*sets[i], c, rng, false);
          check(*sets[i], c, rng, true);
          ++cases;
        }
      }
    }
  }
  std::printf("kernel sets:");
  for (int i = 0; i < n; ++i) std::printf(" %s", sets[i]->name);
  std::printf("; %d cases, %d failures\n", cases, failures);
  return failures == 0 ? 0 : 1;
}
