// The CPU half of an afm MLX primitive: allocate its outputs, then
// queue the computation as a task on the primitive's stream, as MLX's own
// CPU primitives do.  The caller's task holds weak copies of its arrays (made
// after allocate(), so the output's copy sees its buffer).
//
// How far ahead the encoder may run.  MLX allocates an operation's output
// when it encodes the operation, not when it runs it, and its encoder runs
// up to ~100 operations ahead of the thread computing them (MAX_ACTIVE_TASKS
// tasks of DISPATCHES_PER_TASK).  For a decode step that is what lets the
// next step's graph be built while this one computes; for a prompt's chunk,
// whose every output is megabytes, it means the outputs of several layers
// are allocated at once (the default model's 2,048-token chunk: 170 MiB,
// where one operation after another needs 30).  So an afm operation waits,
// before it is queued, while the outputs of afm operations queued and not
// yet computed exceed the in-flight limit (set_in_flight_limit; at least
// one always proceeds): a prompt's chunk runs a few operations ahead.
// Outputs under kCounted bytes neither wait nor count: a decode step's are
// (at 8 streams of a 1.5B model each layer's are a few hundred KiB, and a
// step's together 16 MiB, which made the next step wait about once a step),
// and only its vocabulary product's logits are larger.  MLX's own bound (its memory limit) cannot serve:
// its wait returns at once with one task active, and the encoder spins.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <limits>
#include <mutex>
#include <utility>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/stream.h"

namespace afm_cpu {

inline void allocate(mlx::core::array& out) {
  out.set_data(mlx::core::allocator::malloc(out.nbytes()));
}

// The bytes of afm outputs queued and not yet computed, and their limit.
struct InFlight {
  std::mutex mutex;
  std::condition_variable done;
  size_t bytes = 0;
  size_t limit = size_t{16} << 20;
  size_t waits = 0;  // (how often an operation waited: in_flight_stats)
};

inline InFlight& in_flight() {
  static InFlight state;
  return state;
}

// Outputs smaller than this are not held back (see the top of this file).
constexpr size_t kCounted = size_t{1} << 20;

// Wait until `bytes` more fit under the limit (or nothing is in flight), then count them.
inline void admit(size_t bytes) {
  if (bytes == 0) return;
  InFlight& f = in_flight();
  std::unique_lock<std::mutex> lock(f.mutex);
  if (f.bytes != 0 && f.bytes + bytes > f.limit) {
    ++f.waits;
    f.done.wait(lock, [&f, bytes] { return f.bytes == 0 || f.bytes + bytes <= f.limit; });
  }
  f.bytes += bytes;
}

inline void retire(size_t bytes) {
  if (bytes == 0) return;
  InFlight& f = in_flight();
  {
    std::lock_guard<std::mutex> lock(f.mutex);
    f.bytes -= bytes;
  }
  f.done.notify_all();
}

constexpr size_t kOutputBytes = std::numeric_limits<size_t>::max();

template <typename Fn>
void enqueue(const mlx::core::Stream& stream, size_t bytes, Fn fn) {
  if (bytes < kCounted) bytes = 0;
  admit(bytes);
  mlx::core::cpu::get_command_encoder(stream).dispatch([fn = std::move(fn), bytes]() mutable {
    struct Retire {
      size_t bytes;
      ~Retire() { retire(bytes); }
    } retire_after{bytes};
    fn();
  });
}

// `held`: the bytes the operation allocated (default: its output's).
template <typename Fn>
void dispatch(const mlx::core::Stream& stream, const std::vector<mlx::core::array>& inputs,
              mlx::core::array& out, Fn fn, size_t held = kOutputBytes) {
  auto& enc = mlx::core::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  enqueue(stream, held == kOutputBytes ? out.nbytes() : held, std::move(fn));
}

// The same for a primitive with several outputs.
template <typename Fn>
void dispatch(const mlx::core::Stream& stream, const std::vector<mlx::core::array>& inputs,
              std::vector<mlx::core::array>& outputs, Fn fn, size_t held = kOutputBytes) {
  auto& enc = mlx::core::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) enc.set_input_array(a);
  for (auto& o : outputs) enc.set_output_array(o);
  if (held == kOutputBytes) {
    held = 0;
    for (const auto& o : outputs) held += o.nbytes();
  }
  enqueue(stream, held, std::move(fn));
}

}  // namespace afm_cpu
