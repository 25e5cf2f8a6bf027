// Quantized matrix products for MLX's affine layout on the CPU (afm_core._qmm_ext).
//
// Weights: MLX's affine group quantization, row-major (N, K), 2, 3, 4, 5, 6 or
// 8 bits: each row is a little-endian bit stream, element k at bits
// [bits * k, bits * (k + 1)) (so a block of 32 elements is 4 * bits whole
// bytes); value w = scale * q + bias per group of `group` values along K.  Activations are float32 and get quantized per
// block of 32 values to int8 (x ~= d * qx, |qx| <= 127), as llama.cpp does, so
// the inner products run on 8-bit integers; the bias term uses the exact float
// sum of x over each group.
//
//   y[m, n] = sum_g s[n,g] * sum_{b in g} d[m,b] * (q[n,b] . qx[m,b])
//           + sum_g bias[n,g] * X[m,g]          X[m,g] = sum of x over group g
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace afm_qmm {

// v resized to hold n values from a 64-byte boundary, and that start: the
// kernels' 256- and 512-bit loads of a buffer so placed never straddle two
// cache lines (std::vector's 16-byte alignment left that to where the heap
// put it: the same binary ran 10-25% apart between processes).
template <typename T>
T* aligned64(std::vector<T>& v, size_t n) {
  v.resize(n + 64 / sizeof(T));
  const uintptr_t p = reinterpret_cast<uintptr_t>(v.data());
  return reinterpret_cast<T*>((p + 63) & ~static_cast<uintptr_t>(63));
}

enum class ScaleType : int { f32 = 0, f16 = 1, bf16 = 2 };

// Activations quantized by quantize_rows() (or by a kernel set's own
// `quantize`, in the same buffers: avx512-vnni stores 16-bit activations as
// one int16 row where quantize_rows stores two int8 passes).
// Element (in MLX's order) of a block of 32 that position p of its quantized
// activations holds: the order each bit width unpacks most cheaply in, the
// same for every kernel set.  8, 3, 5 and 6 bits: natural; 4 bits: the even
// elements, then the odd ones (the low and high nibbles of 16 bytes); 2 bits:
// position 8j + i holds element 4i + j (bits 2j.. of 8 bytes).
constexpr int block_element(int bits, int p) {
  return bits == 4 ? (p < 16 ? 2 * p : 2 * (p - 16) + 1)
         : bits == 2 ? 4 * (p & 7) + (p >> 3)
                     : p;
}

struct QActs {
  const int8_t* q = nullptr;  // [M][K], each block of 32 in block_element order
  const float* d = nullptr;   // [M][K/32] block scales
  const float* xsum = nullptr;  // [M][K/group] exact sums of x per group
  // K-quant weights (kquant_kernels.h): d is [M][K/256], bsums [M][K/16] the
  // sums of the codes per 16, and xsum is not used.
  const int16_t* bsums = nullptr;
  int M = 0, K = 0;  // M: quantized rows, `passes` per output row
  int passes = 1;    // 2: rows 2m, 2m + 1 are one row's int8 and its remainder
};

struct QWeights {
  const uint8_t* w = nullptr;  // [N][K*bits/8]
  const void* scales = nullptr;  // [N][K/group], of scale_type
  const void* biases = nullptr;
  ScaleType scale_type = ScaleType::f32;
  int N = 0, K = 0, group = 32, bits = 4;
  // Nonzero: a symmetric weight, every group's bias this times its scale
  // (-2^(bits-1) for GGUF's Q4_0, Q5_0, Q8_0, Q6_K...), and `biases` points
  // at the scales: the kernels make each row's biases from its scales (the
  // same float32 values where the stored biases are exactly factor * scale),
  // and the weight's bias plane is not read.
  float bias_factor = 0.0f;
  // Nonzero: w holds GGUF's K-quant blocks as they are (4: Q4_K, 6: Q6_K;
  // kquant_kernels.h), K / 256 blocks a row, and scales, biases, group and
  // bits are not read.
  int kquant = 0;
};

// Quantize rows [m0, m1) of x (row m at x + row_offset(m), elements `kstride`
// apart) into the buffers of `a` (which the caller owns and sized).  With
// passes == 2, row m becomes rows 2m (x ~= d q) and 2m + 1 (the remainder
// x - d q, quantized the same way, its group sums zero): summing the two
// products gives activations ~16-bit precise for twice the integer work.
void quantize_rows(const float* x, const int64_t* row_offsets, int64_t kstride,
                   int K, int group, int bits, int passes, int8_t* q, float* d, float* xsum,
                   int m0, int m1);

// Rows [n0, n1) of the weight as float32 into dst ((n1 - n0) x K): each
// value fma(scale, code, bias), rounded once.
void dequantize_rows(const QWeights& wt, int n0, int n1, float* dst);

// out[m * N + n] for n in [n0, n1), every output row m < M / passes (the
// passes of a row summed: the remainder's group sums are 0, so its bias term is).
using RangeKernel = void (*)(const QActs&, const QWeights&, float* out, int n0, int n1);

// quantize_rows()'s signature: a kernel set may lay out (or quantize) the
// activations its own way, in the same buffers.
using QuantizeFn = void (*)(const float* x, const int64_t* row_offsets, int64_t kstride, int K,
                            int group, int bits, int passes, int8_t* q, float* d, float* xsum,
                            int m0, int m1);

// dequantize_rows()'s signature: the set's own (vectorized) dequantization.
using DequantizeFn = void (*)(const QWeights& wt, int n0, int n1, float* dst);

struct KernelSet {
  RangeKernel range;
  const char* name;
  QuantizeFn quantize;  // the activations for `range`
  DequantizeFn dequantize;  // dequantize_rows's values (the sgemm path's tiles)
  RangeKernel kquant_range;  // `range` for K-quant weights (kquant_kernels.h)
  DequantizeFn kquant_dequantize;  // and `dequantize`
};

// Bytes ahead of the weights in use that the x86 kernels prefetch
// (AFM_QMM_PREFETCH, default 2048).
int prefetch_bytes();

// The best kernel set this CPU runs, or the one named by AFM_QMM_ISA
// (scalar, avx2, avx-vnni, avx2-vnni, avx512-vnni, neon) if this CPU runs it.
const KernelSet& select_kernels();
// Every kernel set this CPU can run (for tests), best last.
int available_kernels(const KernelSet** out, int max);

}  // namespace afm_qmm
