// Autocast and, where it is needed, a GradScaler, added to a trainer in one call.
#pragma once

#include <torch/types.h>

#include <memory>

#include "frugal/policy/grad_scaler.h"
#include "frugal/train/trainer.h"

namespace frugal {

/// Adds an AutocastPolicy for the trainer's device and, unless `scaler` says otherwise, a
/// GradScalerPolicy when `dtype` is float16 (bfloat16 has float32's range and needs none).
/// Returns the scaler, or nullptr when none was added.
///
/// Example:
///   auto scaler = frugal::use_mixed_precision(trainer, torch::kHalf);  // fp16 + scaler
std::shared_ptr<GradScaler> use_mixed_precision(Trainer& trainer, torch::Dtype dtype,
                                                c10::optional<bool> scaler = c10::nullopt,
                                                GradScalerOptions scaler_options = {});

}  // namespace frugal
