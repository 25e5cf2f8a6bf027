// Decode-time attention over a quantized KV cache on the CPU
// (afm_core._mlx.qmm_ext.quantized_decode_attention): the computation of
// mlx-lm's quantized_scaled_dot_product_attention (two mx.quantized_matmul
// calls around a mask and a softmax) for one query position per (batch,
// head), as one MLX primitive that reads the cache's packed keys and values
// in place.
//
//   K[b, kh, s, d] = k_scales[b, kh, s, d / G] * k_int[b, kh, s, d] + k_biases[b, kh, s, d / G]
//   (V likewise), G the group size, k_int the `bits`-bit integers packed
//   little-endian in uint32 words (mx.quantize's affine layout);
//   out[b, h, :] = softmax(scale * q[b, h] . K[b, h / rep, s] + mask[b, h, s])_s
//                  . V[b, h / rep, s, :]          rep = Hq / Hkv (grouped queries)
//
// Masks as mlx-lm applies them: a boolean mask puts float32's lowest value
// where it is false (so a row with every position masked averages them all,
// as mlx-lm's does), a float mask is added.  float32 queries, scales and
// biases; 4 or 8 bits; group sizes 32, 64 or 128.
#pragma once

#include <functional>
#include <optional>
#include <vector>

#include "mlx/array.h"

namespace afm_qattn {

// How the primitive spreads a job over threads: the extension's pool
// (qmm_ext.cpp), passed in so this file needs none of it.
struct Runner {
  // threads for `work` multiply-adds (1 below `min_work`)
  int (*threads)(double work, double min_work) = nullptr;
  // fn(c) for every chunk c in [0, chunks) on up to `threads` threads
  void (*run)(int threads, int chunks, const std::function<void(int)>& fn) = nullptr;
};

// q (B, Hq, 1, D) float32; keys and values (data, scales, biases), data
// (B, Hkv, S, D * bits / 32) uint32, scales and biases (B, Hkv, S, D / group)
// float32, any strides; mask bool or float32, broadcastable to (B, Hq, 1, S).
mlx::core::array quantized_decode_attention(const mlx::core::array& q,
                                            const std::vector<mlx::core::array>& keys,
                                            const std::vector<mlx::core::array>& values,
                                            float scale,
                                            const std::optional<mlx::core::array>& mask,
                                            int group_size, int bits, Runner runner);

}  // namespace afm_qattn
