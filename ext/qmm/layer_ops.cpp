// Two small per-layer operations as single MLX primitives for the CPU
// (afm_core._mlx.qmm_ext.rms_norm / rope_decode), replacing graphs that MLX's
// CPU backend runs as several tasks each:
//
// * rms_norm(x, w, eps) = (x * rsqrt(mean(x^2) + eps)) * w over the last axis,
//   as mx.fast.rms_norm's CPU fallback computes it (a cast, a square, a sum,
//   and a compiled element-wise kernel);
// * rope_decode(x, offset, freqs, dims, traditional): the rotary embedding of
//   L positions per batch row (one when decoding, a few when a speculative
//   step verifies its guesses), x (B, H, L, D), offset a scalar or (B,)
//   array, position l of row b at t = offset[b] + l, freqs (D,) the
//   per-dimension frequencies; the first `dims` dimensions rotate (the rest
//   pass through), in pairs (2i, 2i+1) when traditional, else (i, i + dims/2):
//   out[a] = x[a] cos(t f[a]) - x[b] sin(t f[a]), out[b] = x[b] cos + x[a] sin.
//   Position l gives the bits of a one-position call at offset + l (t is
//   formed exactly for integer offsets).
//
// * swiglu(gate, up) = gate * sigmoid(gate) * up (mlx-lm's activations.swiglu,
//   silu(gate) * up): mlx-lm compiles it, and MLX's CPU backend runs the
//   compiled kernel element by element with a library call per exponential
//   (a prompt chunk of the default model: 2048 x 1536 elements per layer,
//   as long as a third of the layer's products).  Here sigmoid(g) comes from
//   e^-|g| (attention's exponential, about 2 ulp): 1 / (1 + e^-g) for g >= 0,
//   e^g / (1 + e^g) below, so neither side overflows; with AVX2 + FMA eight
//   at a time.
//   The grouped gate/up product's SwiGLU epilogue (qmm_ext.cpp,
//   quantized_matmul_swiglu) runs the same row code (swiglu_row): same bits.
//
// * kv_write(buffer, x, at): buffer[:, :, at:at + L] = x for a float16 KV
//   cache buffer (B, H, S, D) and x (B, H, L, D) float32, rounded to float16
//   as astype rounds: what a float16 cache's update makes of a cast and a
//   slice update, and like Python's item assignment it changes the array
//   object itself.  Like MLX's slice update, the operation takes the old
//   buffer over when nothing else holds it, and copies it otherwise.
//
// The quantized product's rotary epilogue (qmm_ext.cpp, quantized_matmul_split's
// rope_*) runs rope_decode's code on the product's outputs in place: same bits.
//
// Float32 only (the cache write: float16 buffers); the Python side (afm_core._mlx.fusion, afm_core._mlx.activations)
// calls them where they apply and keeps MLX's graph elsewhere.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define LAYER_X86 1
#include <immintrin.h>
#else
#define LAYER_X86 0
#endif

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "cpu_task.h"
#include "mlx/array.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace afm_layer {
// rope_decode's checks of its arguments for an x of `shape` (below; also qmm_ext's rotary epilogue)
void check_rope_shape(const mx::Shape& shape, const mx::array& offset, const mx::array& freqs, int dims);

namespace {

// Element offset of row r (all axes but the last) of a.
int64_t row_offset(const mx::array& a, int64_t r) {
  int64_t off = 0;
  for (int ax = a.ndim() - 2; ax >= 0; --ax) {
    const int64_t dim = a.shape(ax);
    off += (r % dim) * a.strides(ax);
    r /= dim;
  }
  return off;
}

void rms_norm_compute(const mx::array& x, const mx::array& w, float* op, float eps) {
  const int D = x.shape(-1);
  const int64_t rows = D > 0 ? static_cast<int64_t>(x.size() / D) : 0;
  const int64_t xs = x.strides(-1), ws = w.strides(0);
  const float* xp = x.data<float>();
  const float* wp = w.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + row_offset(x, r);
    float* o = op + r * D;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int d = 0;
    if (xs == 1) {
      for (; d + 8 <= D; d += 8) {
        for (int j = 0; j < 8; ++j) acc[j] += xr[d + j] * xr[d + j];
      }
    }
    float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; d < D; ++d) sum += xr[d * xs] * xr[d * xs];
    const float scale = 1.0f / std::sqrt(sum / static_cast<float>(D) + eps);
    if (xs == 1 && ws == 1) {
      for (int i = 0; i < D; ++i) o[i] = (xr[i] * scale) * wp[i];
    } else {
      for (int i = 0; i < D; ++i) o[i] = (xr[i * xs] * scale) * wp[i * ws];
    }
  }
}

// The position of row b's l-th query: integers added before the conversion,
// so offset + l gives the float a one-position call at that offset gets.
float position(const mx::array& offset, int b, int l) {
  const int64_t at = offset.ndim() == 0 ? 0 : b * offset.strides(0);
  switch (offset.dtype()) {
    case mx::int32: return static_cast<float>(int64_t{offset.data<int32_t>()[at]} + l);
    case mx::int64: return static_cast<float>(offset.data<int64_t>()[at] + l);
    case mx::uint32: return static_cast<float>(int64_t{offset.data<uint32_t>()[at]} + l);
    default: return l == 0 ? offset.data<float>()[at] : offset.data<float>()[at] + static_cast<float>(l);
  }
}

void rope_compute(const mx::array& x, const mx::array& offset, const mx::array& freqs,
                  mx::array& out, int dims, bool traditional) {
  const int B = x.shape(0), H = x.shape(1), L = x.shape(2), D = x.shape(3), half = dims / 2;
  const float* f = freqs.data<float>();
  const int64_t fs = freqs.strides(0);
  std::vector<float> cs(static_cast<size_t>(D)), sn(static_cast<size_t>(D));
  const float* xp = x.data<float>();
  float* op = out.data<float>();
  const int64_t s0 = x.strides(0), s1 = x.strides(1), s2 = x.strides(2), s3 = x.strides(3);
  for (int b = 0; b < B; ++b) for (int l = 0; l < L; ++l) {
    const float t = position(offset, b, l);
    // the rotating dimensions only; a pair's two frequencies are usually one
    for (int i = 0; i < half; ++i) {
      const int a = traditional ? 2 * i : i, c = traditional ? 2 * i + 1 : i + half;
      const float angle = t * f[a * fs];
      cs[a] = std::cos(angle);
      sn[a] = std::sin(angle);
      if (f[c * fs] == f[a * fs]) {
        cs[c] = cs[a];
        sn[c] = sn[a];
      } else {
        cs[c] = std::cos(t * f[c * fs]);
        sn[c] = std::sin(t * f[c * fs]);
      }
    }
    for (int h = 0; h < H; ++h) {
      const float* xr = xp + b * s0 + h * s1 + l * s2;
      float* o = op + ((static_cast<int64_t>(b) * H + h) * L + l) * D;
      for (int i = 0; i < D; ++i) o[i] = xr[i * s3];  // the dims past the pairs pass through
      for (int i = 0; i < half; ++i) {
        const int a = traditional ? 2 * i : i, c = traditional ? 2 * i + 1 : i + half;
        const float xa = xr[a * s3], xc = xr[c * s3];
        o[a] = xa * cs[a] - xc * sn[a];
        o[c] = xc * cs[c] + xa * sn[c];
      }
    }
  }
}

#include "fast_exp.inc"

inline float silu_times(float g, float u) {
  const float t = exp_nonpositive(-std::fabs(g));  // e^-|g|
  const float sig = g >= 0.0f ? 1.0f / (1.0f + t) : t / (1.0f + t);
  return g * sig * u;
}

#if LAYER_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
#include "fast_exp_avx2.inc"

// n contiguous elements of gate and up into out, 8 at a time (then one by one).
void swiglu_row_avx2(const float* g, const float* u, float* o, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 t = exp8(_mm256_or_ps(gv, sign));  // e^-|g|
    const __m256 d = _mm256_add_ps(one, t);
    const __m256 pos = _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_GE_OQ);
    const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(t, one, pos), d);
    _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) o[i] = silu_times(g[i], u[i]);
}
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

// One row of n contiguous elements: the code both this operation and the
// quantized product's SwiGLU epilogue (qmm_ext.cpp, swiglu_row) run, so the two
// give the same bits for a row; a caller that cuts a row into pieces starts
// each at a multiple of 8 (the same elements then take the vector path).
void swiglu_contiguous(const float* g, const float* u, float* o, int64_t n) {
#if LAYER_X86
  if (has_avx2()) {
    swiglu_row_avx2(g, u, o, n);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) o[i] = silu_times(g[i], u[i]);
}

void swiglu_compute(const mx::array& g, const mx::array& u, mx::array& out) {
  const int D = g.shape(-1);
  const int64_t rows = D > 0 ? static_cast<int64_t>(g.size() / D) : 0;
  const float* gp = g.data<float>();
  const float* up = u.data<float>();
  float* op = out.data<float>();
  const int64_t gs = g.strides(-1), us = u.strides(-1);
  for (int64_t r = 0; r < rows; ++r) {
    const float* gr = gp + row_offset(g, r);
    const float* ur = up + row_offset(u, r);
    float* o = op + r * D;
    if (gs == 1 && us == 1) {
      swiglu_contiguous(gr, ur, o, D);
    } else {
      for (int i = 0; i < D; ++i) o[i] = silu_times(gr[i * gs], ur[i * us]);
    }
  }
}

class AfmSwiglu : public mx::Primitive {
 public:
  explicit AfmSwiglu(mx::Stream s) : mx::Primitive(s) {}
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outs) override {
    afm_cpu::allocate(outs[0]);
    afm_cpu::dispatch(stream(), in, outs[0],
                      [g = mx::array::unsafe_weak_copy(in[0]), u = mx::array::unsafe_weak_copy(in[1]),
                       o = mx::array::unsafe_weak_copy(outs[0])]() mutable { swiglu_compute(g, u, o); });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("afm swiglu: this primitive runs on the CPU only");
  }
  const char* name() const override { return "AfmSwiglu"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  // Gradients in MLX's own operations (a model whose module has the kernel can
  // still be trained in the same process: a LoRA adapter, say):
  // d/dg = u * s * (1 + g * (1 - s)), d/du = g * s, s = sigmoid(g).
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals,
                             const std::vector<mx::array>& cotangents, const std::vector<int>& argnums,
                             const std::vector<mx::array>&) override {
    const auto s = stream();
    const mx::array& g = primals[0];
    const mx::array& u = primals[1];
    const mx::array& c = cotangents[0];
    const mx::array sig = mx::sigmoid(g, s);
    std::vector<mx::array> grads;
    for (const int arg : argnums) {
      if (arg == 0) {
        const mx::array one = mx::array(1.0f, g.dtype());
        const mx::array slope =
            mx::multiply(sig, mx::add(one, mx::multiply(g, mx::subtract(one, sig, s), s), s), s);
        grads.push_back(mx::multiply(c, mx::multiply(u, slope, s), s));
      } else {
        grads.push_back(mx::multiply(c, mx::multiply(g, sig, s), s));
      }
    }
    return grads;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape()};
  }
};

class AfmRMSNorm : public mx::Primitive {
 public:
  AfmRMSNorm(mx::Stream s, float eps) : mx::Primitive(s), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outs) override {
    afm_cpu::allocate(outs[0]);
    afm_cpu::dispatch(stream(), in, outs[0],
             [x = mx::array::unsafe_weak_copy(in[0]), w = mx::array::unsafe_weak_copy(in[1]),
              o = mx::array::unsafe_weak_copy(outs[0]), eps = eps_]() mutable {
               rms_norm_compute(x, w, o.data<float>(), eps);
             });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("afm rms_norm: this primitive runs on the CPU only");
  }
  const char* name() const override { return "AfmRMSNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const AfmRMSNorm&>(other).eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape()};
  }

 private:
  float eps_;
};

// inputs x_0 .. x_{n-1}, offset, freqs; output i the embedding of x_i (a
// layer's queries and keys share one operation)
class AfmRopeDecode : public mx::Primitive {
 public:
  AfmRopeDecode(mx::Stream s, int dims, bool traditional)
      : mx::Primitive(s), dims_(dims), traditional_(traditional) {}
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outs) override {
    for (auto& o : outs) afm_cpu::allocate(o);
    std::vector<mx::array> w;
    for (const auto& a : in) w.push_back(mx::array::unsafe_weak_copy(a));
    for (const auto& a : outs) w.push_back(mx::array::unsafe_weak_copy(a));
    afm_cpu::dispatch(stream(), in, outs,
                      [w = std::move(w), n = outs.size(), dims = dims_, trad = traditional_]() mutable {
                        for (size_t i = 0; i < n; ++i) {
                          rope_compute(w[i], w[n], w[n + 1], w[n + 2 + i], dims, trad);
                        }
                      });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("afm rope: this primitive runs on the CPU only");
  }
  const char* name() const override { return "AfmRopeDecode"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const AfmRopeDecode&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    std::vector<mx::Shape> shapes;
    for (size_t i = 0; i + 2 < in.size(); ++i) shapes.push_back(in[i].shape());
    return shapes;
  }

 private:
  int dims_;
  bool traditional_;
};

// out (row-contiguous, float16, (B, H, S, D)) rows [at, at + L) = src (float32, any strides)
void kv_rows(const mx::array& src, mx::array& out, int at) {
  const int B = src.shape(0), H = src.shape(1), L = src.shape(2), D = src.shape(3);
  const int S = out.shape(2);
  const float* sp = src.data<float>();
  mx::float16_t* op = out.data<mx::float16_t>();
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      for (int l = 0; l < L; ++l) {
        const float* row = sp + b * src.strides(0) + h * src.strides(1) + l * src.strides(2);
        mx::float16_t* dst = op + ((static_cast<int64_t>(b) * H + h) * S + at + l) * D;
        for (int d = 0; d < D; ++d) dst[d] = static_cast<mx::float16_t>(row[d * src.strides(3)]);
      }
    }
  }
}

// A float16 buffer (B, H, S, D) with positions [at, at + L) set to x (B, H, L,
// D, float32) rounded to float16.  One output per operation: a primitive's
// outputs each hold its inputs, so a buffer given to an operation of two
// outputs could never be written in place.
class AfmKvWrite : public mx::Primitive {
 public:
  AfmKvWrite(mx::Stream s, int at) : mx::Primitive(s), at_(at) {}
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outs) override {
    // MLX's slice update's rule: the buffer is taken over when nothing else holds it
    const bool copy = !(in[0].is_donatable() && in[0].flags().row_contiguous);
    if (copy) {
      afm_cpu::allocate(outs[0]);
    } else {
      outs[0].copy_shared_buffer(in[0]);
    }
    afm_cpu::dispatch(stream(), in, outs[0],
                      [buf = mx::array::unsafe_weak_copy(in[0]), x = mx::array::unsafe_weak_copy(in[1]),
                       out = mx::array::unsafe_weak_copy(outs[0]), at = at_, copy]() mutable {
                        if (copy) copy_float16(buf, out);
                        kv_rows(x, out, at);
                      },
                      copy ? outs[0].nbytes() : 0);  // (written in place: nothing new held)
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("afm kv_write: this primitive runs on the CPU only");
  }
  const char* name() const override { return "AfmKvWrite"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return at_ == static_cast<const AfmKvWrite&>(other).at_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape()};
  }

 private:
  // out (row-contiguous) = buf (float16, any strides), element by element
  static void copy_float16(const mx::array& buf, mx::array& out) {
    const mx::float16_t* bp = buf.data<mx::float16_t>();
    mx::float16_t* op = out.data<mx::float16_t>();
    if (buf.flags().row_contiguous) {
      std::memcpy(op, bp, out.nbytes());
      return;
    }
    const int B = buf.shape(0), H = buf.shape(1), S = buf.shape(2), D = buf.shape(3);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h)
        for (int t = 0; t < S; ++t)
          for (int d = 0; d < D; ++d)
            *op++ = bp[b * buf.strides(0) + h * buf.strides(1) + t * buf.strides(2) + d * buf.strides(3)];
  }
  int at_;
};

mx::Stream cpu_stream(const char* what) {
  const mx::Stream stream = mx::default_stream(mx::default_device());
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument(std::string(what) + ": the default device must be the CPU");
  }
  return stream;
}

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps) {
  if (x.ndim() < 1 || x.dtype() != mx::float32 || w.dtype() != mx::float32 || w.ndim() != 1 ||
      w.shape(0) != x.shape(-1)) {
    throw std::invalid_argument(
        "afm rms_norm: x must be float32 (..., D) and w float32 (D,)");
  }
  const mx::Stream s = cpu_stream("afm rms_norm");
  return mx::array(x.shape(), mx::float32, std::make_shared<AfmRMSNorm>(s, eps), {x, w});
}

void check_rope(const mx::array& x, const mx::array& offset, const mx::array& freqs, int dims) {
  if (x.dtype() != mx::float32) throw std::invalid_argument("afm rope: x must be float32 (B, H, L, D)");
  check_rope_shape(x.shape(), offset, freqs, dims);
}

mx::array rope_decode(const mx::array& x, const mx::array& offset, const mx::array& freqs,
                      int dims, bool traditional) {
  check_rope(x, offset, freqs, dims);
  const mx::Stream s = cpu_stream("afm rope");
  return mx::array(x.shape(), mx::float32, std::make_shared<AfmRopeDecode>(s, dims, traditional),
                   {x, offset, freqs});
}

std::vector<mx::array> rope_decode_pair(const mx::array& q, const mx::array& k,
                                        const mx::array& offset, const mx::array& freqs, int dims,
                                        bool traditional) {
  check_rope(q, offset, freqs, dims);
  check_rope(k, offset, freqs, dims);
  const mx::Stream s = cpu_stream("afm rope");
  return mx::array::make_arrays({q.shape(), k.shape()}, {mx::float32, mx::float32},
                                std::make_shared<AfmRopeDecode>(s, dims, traditional),
                                {q, k, offset, freqs});
}

// Like MLX's `a[...] = x` in Python: the array object itself then holds the
// written buffer, so every holder of it (a cache and the row it was merged
// from, say) sees the write, and the old buffer, held by nothing else, is
// taken over instead of copied.
void kv_write(mx::array& buffer, const mx::array& x, int at) {
  if (buffer.ndim() != 4 || buffer.dtype() != mx::float16) {
    throw std::invalid_argument("afm kv_write: the cache's buffer must be float16 (B, H, S, D)");
  }
  if (x.ndim() != 4 || x.dtype() != mx::float32 || x.shape(0) != buffer.shape(0) ||
      x.shape(1) != buffer.shape(1) || x.shape(3) != buffer.shape(3) || at < 0 ||
      at + x.shape(2) > buffer.shape(2)) {
    throw std::invalid_argument("afm kv_write: x must be float32 (B, H, L, D) fitting the buffer at `at`");
  }
  const mx::Stream s = cpu_stream("afm kv_write");
  buffer.overwrite_descriptor(
      mx::array(buffer.shape(), mx::float16, std::make_shared<AfmKvWrite>(s, at), {buffer, x}));
}

mx::array swiglu(const mx::array& gate, const mx::array& up) {
  if (gate.ndim() < 1 || gate.dtype() != mx::float32 || up.dtype() != mx::float32 ||
      gate.shape() != up.shape()) {
    throw std::invalid_argument("afm swiglu: gate and up must be float32 arrays of one shape");
  }
  const mx::Stream s = cpu_stream("afm swiglu");
  return mx::array(gate.shape(), mx::float32, std::make_shared<AfmSwiglu>(s), {gate, up});
}

}  // namespace

void rms_norm_rows(const mx::array& x, const mx::array& w, float* out, float eps) {
  rms_norm_compute(x, w, out, eps);
}

void rope_rows(const mx::array& x, const mx::array& offset, const mx::array& freqs, mx::array& out,
               int dims, bool traditional) {
  rope_compute(x, offset, freqs, out, dims, traditional);
}

void check_rope_shape(const mx::Shape& shape, const mx::array& offset, const mx::array& freqs, int dims) {
  if (shape.size() != 4) throw std::invalid_argument("afm rope: x must be float32 (B, H, L, D)");
  if (freqs.ndim() != 1 || freqs.shape(0) != shape[3] || freqs.dtype() != mx::float32) {
    throw std::invalid_argument("afm rope: freqs must be float32 (D,)");
  }
  if (dims < 0 || dims > shape[3] || dims % 2 != 0) {
    throw std::invalid_argument("afm rope: dims must be even and at most D");
  }
  const bool shape_ok = offset.ndim() == 0 || (offset.ndim() == 1 && offset.shape(0) == shape[0]);
  const mx::Dtype t = offset.dtype();
  if (!shape_ok || !(t == mx::int32 || t == mx::int64 || t == mx::uint32 || t == mx::float32)) {
    throw std::invalid_argument(
        "afm rope: offset must be a scalar or (B,) array of int32, int64, uint32 or float32");
  }
}

void swiglu_row(const float* gate, const float* up, float* out, int64_t n) {
  swiglu_contiguous(gate, up, out, n);
}

void register_layer_ops(nb::module_& m) {
  m.def("swiglu", &swiglu, "gate"_a, "up"_a,
        "gate * sigmoid(gate) * up (mlx-lm's swiglu), float32, as one operation.");
  m.def("rope_decode_pair", &rope_decode_pair, "q"_a, "k"_a, "offset"_a, "freqs"_a, "dims"_a,
        "traditional"_a,
        "rope_decode of a layer's queries and keys (same offset, freqs and dims) as one "
        "operation: the bits of two rope_decode calls.");
  m.def("kv_write", &kv_write, "buffer"_a, "x"_a, "at"_a,
        "buffer[:, :, at:at + L] = x as MLX's item assignment does it (the array object "
        "changes), for a float16 KV cache buffer (B, H, S, D) and x (B, H, L, D, float32) "
        "rounded to float16, as one operation; a buffer nothing else holds is written in place.");
  m.def("rms_norm", &rms_norm, "x"_a, "weight"_a, "eps"_a,
        "(x * rsqrt(mean(x^2, -1) + eps)) * weight, float32, as one operation.");
  m.def("rope_decode", &rope_decode, "x"_a, "offset"_a, "freqs"_a, "dims"_a, "traditional"_a,
        "The rotary embedding of L positions per batch row: x (B, H, L, D) float32, offset "
        "a scalar or (B,) array (position l of row b at offset[b] + l), freqs (D,); the first "
        "dims dimensions rotate.");
}

}  // namespace afm_layer
