// Decode-time attention on the CPU (afm_core._mlx.qmm_ext.decode_attention):
// one query row per (batch, head) against that head's keys and values, as
// mx.fast.scaled_dot_product_attention computes it for a single query
// position, without the dozen-odd graph operations (matmuls, broadcasts,
// softmax, select) its CPU fallback builds for every layer of every step.
//
//   out[b, h, :] = softmax(scale * q[b, h] . k[b, h / rep, s] + mask[b, h, s])_s
//                  . v[b, h / rep, s, :]          rep = Hq / Hkv (grouped queries)
//
// A boolean mask keeps the positions where it is true (the others get -inf);
// a float mask is added to the scores.  A row whose every position is masked
// comes out as zeros.
#pragma once

#include <cstdint>

namespace afm_attn {

// A float32 array of 4 dimensions: its data and the strides (in elements).
struct View4 {
  const float* p = nullptr;
  int64_t s[4] = {0, 0, 0, 0};
};

enum class MaskKind : int { none = 0, boolean = 1, additive = 2 };

struct Args {
  View4 q, k, v;                 // q (B, Hq, 1, D); k, v (B, Hkv, S, D)
  MaskKind mask_kind = MaskKind::none;
  const void* mask = nullptr;    // bool (1 byte) or float32 values
  int64_t ms[3] = {0, 0, 0};     // mask strides over b, h, s (0 where broadcast)
  int B = 0, Hq = 0, Hkv = 0, S = 0, D = 0;
  float scale = 1.0f;
  float* out = nullptr;          // (B, Hq, 1, D), contiguous
};

// Units u0 .. u1 - 1, unit u being batch row b = u / Hkv and key head
// kh = u % Hkv, with the query heads kh * rep .. (kh + 1) * rep - 1 that read it.
void decode_attention_units(const Args& a, int u0, int u1);

}  // namespace afm_attn
