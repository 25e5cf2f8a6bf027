// What the standalone kernel benchmarks (qmm_ab.cpp, qmm_layout_probe.cpp)
// share: one activation row quantized by a kernel set, and a product's
// output rows split over threads as afm's pool splits them.
#pragma once

#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "qmm_kernels.h"

// One activation row of K values quantized by `set` for BITS-bit weights
// (16-bit activations: two int8 passes' buffers), `view` pointing into it.
struct OneRow {
  std::vector<int8_t> q;
  std::vector<float> d, xsum;
  afm_qmm::QActs view;
};

inline OneRow quantize_one_row(const afm_qmm::KernelSet& set, const std::vector<float>& x, int bits) {
  const int K = static_cast<int>(x.size());
  OneRow a{std::vector<int8_t>(4 * static_cast<size_t>(K)), std::vector<float>(2 * K / 32 + 8),
           std::vector<float>(2 * K / 32 + 8), {}};
  const int64_t offset = 0;
  set.quantize(x.data(), &offset, 1, K, 32, bits, 2, a.q.data(), a.d.data(), a.xsum.data(), 0, 1);
  a.view.q = a.q.data();
  a.view.d = a.d.data();
  a.view.xsum = a.xsum.data();
  a.view.M = 2;
  a.view.K = K;
  a.view.passes = 2;
  return a;
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
