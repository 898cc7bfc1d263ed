// What an out-of-memory error in the forward and backward passes does to the micro-batch.
#pragma once

#include <cstdint>
#include <exception>
#include <string>

#include "frugal/memory/probe.h"

namespace frugal::detail {

/// Whether `error` is an out-of-memory error (c10::OutOfMemoryError: CUDA's, or the
/// counting allocator's under a cap).
bool is_out_of_memory(const std::exception& error);

/// The probe's figures for an error message: allocated, peak, reserved and the cap.
std::string memory_figures(const MemoryProbe& probe);

/// The micro-batch to run the batch again with after `error` (out of memory) at
/// `micro_batch`: half of it, not below `floor`, once the probe's cached blocks are given
/// back. At the floor it throws c10::OutOfMemoryError naming the floor, the memory figures
/// and `error`, with `unchanged` (a sentence: what the failure left as it was) between.
std::int64_t back_off(std::int64_t micro_batch, std::int64_t floor, const MemoryProbe& probe,
                      const std::exception& error, const char* unchanged);

}  // namespace frugal::detail
