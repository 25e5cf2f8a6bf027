// Two builds of afm's kernels side by side: one-row products of each build
// interleaved in one process, so this machine's drift (±20% minutes apart)
// falls on both alike.  For kernel changes whose gain is smaller than the
// noise between runs.  Each build is ext/qmm/qmm_kernels.cpp as a shared
// library (from two checkouts, or a copy with the change; with its
// kquant_kernels.cpp where the checkout has one):
//
//     git show HEAD~1:ext/qmm/qmm_x86.inc > /tmp/a/qmm_x86.inc   # ... the files that differ
//     g++ -O3 -std=c++20 -fwrapv -fPIC -shared -o /tmp/a.so /tmp/a/qmm_kernels.cpp /tmp/a/kquant_kernels.cpp
//     g++ -O3 -std=c++20 -fwrapv -fPIC -shared -o /tmp/b.so ext/qmm/qmm_kernels.cpp ext/qmm/kquant_kernels.cpp
//     g++ -O3 -std=c++20 -Iext/qmm -Ibenchmarks -o /tmp/qmm_ab benchmarks/qmm_ab.cpp -ldl -lpthread
//     /tmp/qmm_ab K N BITS THREADS SYMMETRIC [REPS [MB [ISA]]] /tmp/a.so /tmp/b.so [more.so ...]
//
// (One library alone: that build's speed.)
//
// K x N weights of BITS bits in groups of 32 with float16 scales (and
// biases unless SYMMETRIC), one activation row quantized by each build's
// own `quantize` (16-bit), THREADS threads each a contiguous share of the
// rows as afm's pool splits them, REPS products per build (default 60),
// the weights in copies adding up to MB megabytes (default 400: from
// memory; 1: one copy, whatever the caches hold), kernel set ISA (default
// avx2).  Prints each build's median and its speed-up over the first; and
// how many output rows differ from the first build's (0: the same bits).
#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "qmm_bench.h"
#include "qmm_kernels.h"

using namespace afm_qmm;

namespace {

const KernelSet* load(const char* path, const char* isa) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    std::fprintf(stderr, "%s\n", dlerror());
    std::exit(2);
  }
  using Available = int (*)(const KernelSet**, int);
  // afm_qmm::available_kernels(const KernelSet**, int)
  auto available = reinterpret_cast<Available>(dlsym(lib, "_ZN7afm_qmm17available_kernelsEPPKNS_9KernelSetEi"));
  if (available == nullptr) {
    std::fprintf(stderr, "%s: no afm_qmm::available_kernels\n", path);
    std::exit(2);
  }
  const KernelSet* sets[8];
  const int count = available(sets, 8);
  for (int i = 0; i < count; ++i) {
    if (std::strcmp(sets[i]->name, isa) == 0) return sets[i];
  }
  std::fprintf(stderr, "%s: this CPU does not run the %s kernel set\n", path, isa);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  int first = 6;  // the first library's argument
  while (first < argc && std::strstr(argv[first], ".so") == nullptr) ++first;
  if (argc < 7 || first >= argc) {
    std::fprintf(stderr, "usage: %s K N BITS THREADS SYMMETRIC [REPS [MB [ISA]]] a.so [b.so ...]\n", argv[0]);
    return 2;
  }
  const int K = std::atoi(argv[1]), N = std::atoi(argv[2]), bits = std::atoi(argv[3]);
  const int threads = std::atoi(argv[4]);
  const bool symmetric = std::atoi(argv[5]) != 0;
  const int reps = first > 6 ? std::atoi(argv[6]) : 60;
  const double mb = first > 7 ? std::atof(argv[7]) : 400.0;
  const char* isa = first > 8 ? argv[8] : "avx2";
  if (K % 32 != 0 || N < threads || threads < 1 || reps < 1 ||
      (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8)) {
    std::fprintf(stderr, "K a multiple of 32, N >= THREADS >= 1, BITS 2-6 or 8\n");
    return 2;
  }
  const int builds = argc - first;
  std::vector<const KernelSet*> sets;
  for (int i = 0; i < builds; ++i) sets.push_back(load(argv[first + i], isa));

  std::mt19937 rng(42);
  const size_t wbytes = static_cast<size_t>(N) * K * bits / 8, ng = static_cast<size_t>(N) * K / 32;
  const int copies = std::max(1, static_cast<int>(mb * 1e6 / static_cast<double>(wbytes + 4 * ng)));
  std::vector<std::vector<uint8_t>> w(copies, std::vector<uint8_t>(wbytes));
  std::vector<std::vector<uint16_t>> scales(copies, std::vector<uint16_t>(ng)), biases(copies, std::vector<uint16_t>(ng));
  for (int c = 0; c < copies; ++c) {
    for (auto& v : w[c]) v = static_cast<uint8_t>(rng());
    for (auto& v : scales[c]) v = static_cast<uint16_t>(0x2000 + rng() % 256);  // float16 ~0.008
    for (auto& v : biases[c]) v = static_cast<uint16_t>(0xA000 + rng() % 256);  // ~ -0.008
  }
  std::vector<float> x(K);
  for (auto& v : x) v = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 1000.0f;

  std::vector<OneRow> acts;
  acts.reserve(builds);
  for (int i = 0; i < builds; ++i) acts.push_back(quantize_one_row(*sets[i], x, bits));
  std::vector<std::vector<float>> out(builds, std::vector<float>(N));
  auto run = [&](int i, int c) {
    QWeights wt;
    wt.w = w[c].data();
    wt.scales = scales[c].data();
    wt.biases = symmetric ? scales[c].data() : biases[c].data();
    wt.scale_type = ScaleType::f16;
    wt.N = N;
    wt.K = K;
    wt.group = 32;
    wt.bits = bits;
    wt.bias_factor = symmetric ? -static_cast<float>(1 << (bits - 1)) : 0.0f;
    return timed_rows(N, threads, [&, wt](int n0, int n1) { sets[i]->range(acts[i].view, wt, out[i].data(), n0, n1); });
  };
  std::vector<std::vector<double>> times(builds);
  for (int r = 0; r < reps; ++r) {
    for (int i = 0; i < builds; ++i) times[i].push_back(run(i, r % copies));
  }
  const double bytes = static_cast<double>(wbytes) + 2.0 * ng * (symmetric ? 1 : 2);
  std::printf("K %d x N %d, %d bits%s, %d thread%s, %d copies, %s:\n", K, N, bits, symmetric ? " symmetric" : "",
              threads, threads > 1 ? "s" : "", copies, isa);
  double base = 0.0;
  for (int i = 0; i < builds; ++i) {
    std::sort(times[i].begin(), times[i].end());
    const double median = times[i][reps / 2];
    if (i == 0) base = median;
    int differ = 0;
    for (int n = 0; n < N; ++n) differ += out[i][n] != out[0][n];
    std::printf("  %-32s %9.1f us %6.1f GB/s  %.3fx  (%d rows differ from the first)\n", argv[first + i],
                median * 1e6, bytes / median / 1e9, base / median, differ);
  }
  return 0;
}
