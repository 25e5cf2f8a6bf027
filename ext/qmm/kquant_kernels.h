// Products with GGUF's K-quant blocks as they are in the file (Q4_K, Q6_K).
//
// A weight row of K values (K a multiple of 256) is K / 256 blocks, byte for
// byte GGUF's (llama.cpp's block_q4_K and block_q6_K):
//
//   Q4_K, 144 bytes: float16 d, float16 dmin, 12 bytes of eight 6-bit scales
//     sc_j and eight 6-bit mins m_j (one pair per 32), 128 bytes of nibbles
//     (each 32 bytes: the low nibbles are values 64i..64i+31, the high ones
//     the next 32); w = d * sc_j * q - dmin * m_j.
//   Q6_K, 210 bytes: 128 bytes of low nibbles, 64 bytes of high bit pairs, 16
//     int8 scales (one per 16), float16 d; w = d * sc * (q - 32), q in 0..63.
//
// Activations are quantized per 256 to int8 with one float scale and the
// codes' sums per 16 (llama.cpp's Q8_K): the products run on 8-bit integers,
// the sub-block scales multiply inside the integer pipeline, and the float
// stage comes once per 256 values, which is what makes these products
// cheaper per weight than the affine kernels' float stage per 32
// (benchmarks/qmm_kquant_probe.cpp).  With two passes the second row is the
// first's remainder, as the affine kernels' 16-bit default.
#pragma once

#include <cstddef>
#include <cstdint>

#include "qmm_kernels.h"

namespace afm_qmm {

constexpr int kKQuantBlock = 256;

// Bytes of one block of 256 values of the K-quant type `kquant` (4: Q4_K,
// 6: Q6_K), or 0 for a type these kernels do not have.
constexpr int kquant_block_bytes(int kquant) { return kquant == 4 ? 144 : kquant == 6 ? 210 : 0; }

// Quantize rows [m0, m1) of x (dense, rows of K) into Q8_K rows: row m's
// `passes` rows are m * passes ..., each K int8 codes in q, K / 256 scales in
// d, K / 16 sums of codes in bsums.  Rounds half away from zero, |code| <= 127.
void kquant_quantize_rows(const float* x, int K, int passes, int8_t* q, float* d, int16_t* bsums,
                          int m0, int m1);

// Rows [n0, n1) of a K-quant weight (wt.kquant, wt.w the blocks) as float32
// into dst ((n1 - n0) x K): llama.cpp's dequantization, value for value.
void kquant_dequantize_rows(const QWeights& wt, int n0, int n1, float* dst);

// out[m * N + n] for rows [n0, n1) and every output row m (a.M / a.passes),
// a from kquant_quantize_rows (a.q, a.d per 256, a.bsums); the passes summed.
void kquant_range_scalar(const QActs& a, const QWeights& wt, float* out, int n0, int n1);
#if defined(__x86_64__) || defined(_M_X64)
void kquant_range_avx2(const QActs& a, const QWeights& wt, float* out, int n0, int n1);
void kquant_dequantize_rows_avx2(const QWeights& wt, int n0, int n1, float* dst);
#endif

}  // namespace afm_qmm
