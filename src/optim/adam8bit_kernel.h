// The 8-bit Adam step on the CPU for float32 parameters, fused: each element's moments are
// decoded, updated, used and encoded again in one pass over a block, with no scratch.
#pragma once

#include <cstdint>

namespace frugal::optim::detail {

/// The step's scalars, as the tensor-ops step uses them (float32 arithmetic).
struct AdamScalars {
  float beta1 = 0, one_minus_beta1 = 0, beta2 = 0, one_minus_beta2 = 0;
  float eps = 0, weight_decay = 0, decay_factor = 1;  ///< AdamW: p *= decay_factor
  float neg_step_size = 0, bias_correction2_sqrt = 1;
  bool decoupled = false;  ///< AdamW's decay (else L2 added to the gradient)
  bool fresh = false;      ///< no moments yet: start from zeros
};

/// A parameter of `n` elements (`p`) with its gradient (`g`) and moments as codes
/// (`m_codes`, `v_codes`) with one scale per block of `block` elements; blocks are shared
/// out among at::get_num_threads() threads.
void adam8bit_cpu(float* p, const float* g, std::uint8_t* m_codes, float* m_scales,
                  std::uint8_t* v_codes, float* v_scales, std::int64_t n, std::int64_t block,
                  const AdamScalars& a);

}  // namespace frugal::optim::detail
