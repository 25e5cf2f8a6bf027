// Prompt-time (prefill) attention on the CPU (afm_core._mlx.qmm_ext.prefill_attention):
// softmax(scale q k^T + mask) v for many query positions per (batch, head),
// flash-attention style: the scores are made, masked, exponentiated and
// folded into the output one tile of keys at a time (an online softmax), so
// no (L x S) score matrix is ever materialised, and the tiles a causal or
// sliding-window mask hides entirely are never computed.
//
//   out[b, h, l, :] = softmax_s(scale * q[b, h, l] . k[b, h / rep, s] + mask)
//                       . v[b, h / rep, s, :]         rep = Hq / Hkv
//
// Query l is the key at position S - L + l.  `causal`: it sees the keys up to
// it; `window` w > 0: only the w keys ending at it (mlx-lm's sliding-window
// layers); a boolean mask keeps the positions where it is true, a float32
// mask is added (both broadcast to (B, Hq, L, S)).  A row that sees no key
// comes out as zeros.
//
// Keys and values are read in place from the KV cache's buffers: float32,
// float16, or mx.quantize'd (data, scales, biases) triples of 4 or 8 bits
// (mlx-lm's QuantizedKVCache), unpacked one tile at a time.  Three kernel
// paths share the tiling: portable C++, AVX2 + FMA and AVX-512, chosen by the
// extension's instruction-set setting (AFM_QMM_ISA / qmm_ext.set_isa).
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"

namespace afm_pattn {

// How the primitive spreads its work and which instruction set it uses: the
// extension's pool and kernel setting (qmm_ext.cpp), passed in.
struct Runner {
  // threads for `work` multiply-adds (1 below `min_work`)
  int (*threads)(double work, double min_work) = nullptr;
  // fn(c) for every chunk c in [0, chunks) on up to `threads` threads
  void (*run)(int threads, int chunks, const std::function<void(int)>& fn) = nullptr;
  // the name of the kernel set in use ("scalar", "avx2", "avx2-vnni", "avx512-vnni", ...)
  const char* (*isa)() = nullptr;
};

// q (B, Hq, L, D) float32, any strides.  keys and values: one float32 or
// float16 array (B, Hkv, S, D) / (B, Hkv, S, Dv), or (data, scales, biases)
// with `bits` 4 or 8 and `group_size` 32, 64 or 128 (float32 scales), any
// strides.  mask: bool or float32, broadcastable to (B, Hq, L, S).
mlx::core::array prefill_attention(const mlx::core::array& q,
                                   const std::vector<mlx::core::array>& keys,
                                   const std::vector<mlx::core::array>& values, float scale,
                                   const std::optional<mlx::core::array>& mask, bool causal,
                                   int window, int group_size, int bits, Runner runner);

// The path a call takes now: "portable", "avx2" or "avx512".
std::string prefill_attention_path(Runner runner, int head_dim_v);

}  // namespace afm_pattn
