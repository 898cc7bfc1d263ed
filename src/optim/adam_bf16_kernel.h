// Adam's step on the CPU for bfloat16 weights with bfloat16 moments, fused: each block is
// widened to float32 once, updated, and rounded back once, where tensor operations on
// bfloat16 round after every operation and pass over the parameter several times.
#pragma once

#include <cstdint>

#include "adam8bit_kernel.h"

namespace frugal::optim::detail {

/// Elements the step widens at a time.
constexpr std::int64_t kAdamBf16Block = 2048;

/// Adam's (or AdamW's) step for `n` bfloat16 weights `w` (FusedWeights::p16 and g16, or
/// 8-bit codes and g16) and
/// their moments `m`, `v` (bfloat16 bits, shaped like the weights): in float32, in
/// LibTorch's order of operations; the moments are written back rounded to nearest, the
/// weights as `w` says (stochastically or to nearest). Blocks are shared out among
/// at::get_num_threads() threads; nothing is allocated but a few blocks a thread, once.
void adam_bf16_cpu(const FusedWeights& w, std::uint16_t* m, std::uint16_t* v, std::int64_t n,
                   const AdamScalars& a);

}  // namespace frugal::optim::detail
