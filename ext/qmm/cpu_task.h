// The CPU half of an afm MLX primitive: allocate its outputs, then
// queue the computation as a task on the primitive's stream, as MLX's own
// CPU primitives do.  The caller's task holds weak copies of its arrays (made
// after allocate(), so the output's copy sees its buffer).
#pragma once

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

template <typename Fn>
void dispatch(const mlx::core::Stream& stream, const std::vector<mlx::core::array>& inputs,
              mlx::core::array& out, Fn fn) {
  auto& enc = mlx::core::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  enc.dispatch(std::move(fn));
}

// The same for a primitive with several outputs.
template <typename Fn>
void dispatch(const mlx::core::Stream& stream, const std::vector<mlx::core::array>& inputs,
              std::vector<mlx::core::array>& outputs, Fn fn) {
  auto& enc = mlx::core::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) enc.set_input_array(a);
  for (auto& o : outputs) enc.set_output_array(o);
  enc.dispatch(std::move(fn));
}

}  // namespace afm_cpu
