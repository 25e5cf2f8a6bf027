// Decode-time attention on the CPU (afm_core._mlx.qmm_ext.decode_attention):
// the query rows of a few positions (one when decoding, 1 + k when a
// speculative step verifies k guessed tokens) per (batch, head) against that
// head's keys and values, as mx.fast.scaled_dot_product_attention computes
// them, without the dozen-odd graph operations (matmuls, broadcasts, softmax,
// select) its CPU fallback builds for every layer of every step.
//
//   out[b, h, l, :] = softmax(scale * q[b, h, l] . k[b, h / rep, s]
//                             + mask[b, h, l, s])_{s < n_l} . v[b, h / rep, s, :]
//   rep = Hq / Hkv (grouped queries); n_l = S - L + 1 + l when causal (query l
//   is the key at S - L + l and sees the keys up to it), else S.
//
// Keys and values may be float16 (a half-precision KV cache): each element is
// widened exactly to float32 as it is read, so the arithmetic is the same.
//
// A boolean mask keeps the positions where it is true (the others get -inf);
// a float mask is added to the scores.  A row whose every position is masked
// comes out as zeros.
//
// Row (b, h, l) is computed exactly as a one-position call on the keys
// [0, n_l) (and the mask row l over them) computes it, to the bit: each row's
// dot products, softmax sums and value sums run in the same order whatever L
// is, and positions a mask hides add exact zeros.  That is what lets one
// verify step stand for the decode steps it replaces.
#pragma once

#include <cstdint>

namespace afm_attn {

// An array of 4 dimensions: its data (float32, or float16 for keys and
// values: Args::half) and the strides (in elements).
struct View4 {
  const void* p = nullptr;
  int64_t s[4] = {0, 0, 0, 0};
};

enum class MaskKind : int { none = 0, boolean = 1, additive = 2 };

struct Args {
  View4 q, k, v;                 // q (B, Hq, L, D); k, v (B, Hkv, S, D)
  bool half = false;             // k and v are float16 (q is always float32)
  bool portable = false;         // the portable loops even where AVX2 runs (the "scalar" kernel set)
  MaskKind mask_kind = MaskKind::none;
  const void* mask = nullptr;    // bool (1 byte) or float32 values
  int64_t ms[4] = {0, 0, 0, 0};  // mask strides over b, h, l, s (0 where broadcast)
  int B = 0, Hq = 0, Hkv = 0, L = 1, S = 0, D = 0;
  bool causal = false;           // query l sees keys [0, S - L + 1 + l)
  float scale = 1.0f;
  float* out = nullptr;          // (B, Hq, L, D), contiguous
};

// Units u0 .. u1 - 1, unit u being batch row b = u / Hkv and key head
// kh = u % Hkv, with the query heads kh * rep .. (kh + 1) * rep - 1 that read
// it, at all L positions.
void decode_attention_units(const Args& a, int u0, int u1);

}  // namespace afm_attn
