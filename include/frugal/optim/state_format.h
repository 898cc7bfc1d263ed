// One value for how an optimizer keeps its moments, as LibTorch's reduction_t is one value.
#pragma once

#include <string>

namespace frugal::optim {

/// How frugal's low-bit optimizers keep their states: float32 (`bits` 32), or block-wise
/// quantized codes of 8 or 4 bits, with a matrix's second moment factored (row and column
/// statistics, QuantizedStateOptions::factored) and new codes rounded stochastically
/// (QuantizedStateOptions::stochastic_codes). The optimizers take and report it
/// (QuantizedStateOptimizer::state_format), and the planner chooses among them
/// (PlanOption::states).
///
/// Example:
///   adam.set_state_format(frugal::optim::StateFormat{4, /*factored=*/true});
struct StateFormat {
  int bits = 32;            ///< 32: float32 states; 8 or 4: quantized codes
  bool factored = false;    ///< quantized states only: a matrix's second moment factored
  bool stochastic = false;  ///< quantized states only: new codes rounded stochastically

  bool quantized() const { return bits != 32; }
  /// "float32", "8-bit", "factored 4-bit", with " (stochastic codes)" where that is so.
  std::string describe() const;
  friend bool operator==(const StateFormat& a, const StateFormat& b) {
    return a.bits == b.bits && a.factored == b.factored && a.stochastic == b.stochastic;
  }
  friend bool operator!=(const StateFormat& a, const StateFormat& b) { return !(a == b); }
};

}  // namespace frugal::optim
