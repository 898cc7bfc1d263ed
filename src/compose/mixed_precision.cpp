#include "frugal/compose/mixed_precision.h"

#include "frugal/policy/autocast.h"

namespace frugal {

std::shared_ptr<GradScaler> use_mixed_precision(Trainer& trainer, torch::Dtype dtype,
                                                c10::optional<bool> scaler,
                                                GradScalerOptions scaler_options) {
  trainer.add_policy(std::make_shared<AutocastPolicy>(trainer.options().device().type(), dtype));
  if (!scaler.value_or(dtype == torch::kHalf)) {
    return nullptr;
  }
  auto shared = std::make_shared<GradScaler>(scaler_options);
  trainer.add_policy(std::make_shared<GradScalerPolicy>(shared));
  return shared;
}

}  // namespace frugal
