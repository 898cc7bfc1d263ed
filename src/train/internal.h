// Small helpers shared by the trainer's source files.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <utility>

#include "../engine/clock.h"
#include "frugal/error.h"

namespace frugal::detail {

inline void check_positive(const c10::optional<std::int64_t>& value, const char* name) {
  FRUGAL_CHECK(!value.has_value() || *value >= 1, "frugal: ", name, " must be >= 1, got ", *value);
}

/// Argmax hits and scored targets of class outputs (classes in dimension 1 or last; targets
/// equal to `ignore_index` not scored), or nothing when the output is not one of classes.
c10::optional<std::pair<std::int64_t, std::int64_t>> class_hits(const at::Tensor& output,
                                                                const at::Tensor& targets,
                                                                std::int64_t ignore_index);

}  // namespace frugal::detail
