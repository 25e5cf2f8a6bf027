// What the standalone kernel benchmarks (qmm_ab.cpp, qmm_layout_probe.cpp,
// qmm_kquant_probe.cpp) share: a kernel set by name, one activation row
// quantized by a kernel set, a fixed stream of random numbers, and a
// product's output rows split over threads as afm's pool splits them.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "qmm_kernels.h"

struct OneRow {
  std::vector<int8_t> q;
  std::vector<float> d, xsum;
  afm_qmm::QActs view;
};

// A fixed stream of pseudo-random numbers (xorshift64*), the same every run.
inline uint32_t next_u32() {
  static uint64_t state = 0x2545F4914F6CDD1Dull;
  state ^= state >> 12;
  state ^= state << 25;
  state ^= state >> 27;
  return static_cast<uint32_t>((state * 0x2545F4914F6CDD1Dull) >> 32);
}

// One activation row of K values quantized by `set` for BITS-bit weights in
// `passes` int8 passes (2, the default: 16-bit activations, the row and its
// remainder), `view` pointing into it.
inline OneRow quantize_one_row(const afm_qmm::KernelSet& set, const std::vector<float>& x, int bits,
                               int passes = 2) {
  const int K = static_cast<int>(x.size());
  OneRow a{std::vector<int8_t>(4 * static_cast<size_t>(K)), std::vector<float>(2 * K / 32 + 8),
           std::vector<float>(2 * K / 32 + 8), {}};
  const int64_t offset = 0;
  set.quantize(x.data(), &offset, 1, K, 32, bits, passes, a.q.data(), a.d.data(), a.xsum.data(), 0, 1);
  a.view.q = a.q.data();
  a.view.d = a.d.data();
  a.view.xsum = a.xsum.data();
  a.view.M = passes;
  a.view.K = K;
  a.view.passes = passes;
  return a;
}

// The kernel set of that name, if this CPU runs it (else null).
inline const afm_qmm::KernelSet* kernel_set(const char* name) {
  const afm_qmm::KernelSet* sets[8];
  const int count = afm_qmm::available_kernels(sets, 8);
  for (int i = 0; i < count; ++i) {
    if (std::strcmp(sets[i]->name, name) == 0) return sets[i];
  }
  return nullptr;
}

// Seconds for fn(n0, n1) over rows [0, N) on `threads` threads, each a contiguous share.
template <typename Fn>
double timed_rows(int N, int threads, Fn fn) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back([&fn, N, t, threads] { fn(N * t / threads, N * (t + 1) / threads); });
  fn(0, N / threads);
  for (auto& th : pool) th.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
