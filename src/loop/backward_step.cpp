// Loop::backward_step: a model's last backward with its optimizer step fused into it.
#include <c10/util/Type.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <cmath>
#include <typeinfo>

#include "../train/step_guard.h"
#include "frugal/optim/in_place.h"
#include "frugal/policy/grad_scaler.h"
#include "parts.h"

namespace frugal {

namespace detail {

PartialStepError partial_step_error(LoopModel& model, const char* phase,
                                    const std::vector<torch::Tensor>& changed,
                                    const std::exception& error, const char* unchanged) {
  const auto names = parameter_names(model.module(), changed);
  std::string list;
  for (const auto& name : names) {
    list += (list.empty() ? "" : ", ") + name;
  }
  return PartialStepError(
      fmt::format("frugal: the {} of '{}' failed after changing {} parameter(s): {}. Those "
                  "hold new values, {}. The error was: {}",
                  phase, model.name(), names.size(), list, unchanged, error_message(error)),
      names);
}

}  // namespace detail

bool Loop::backward_step(const torch::Tensor& loss, LoopModel& model) {
  check_own(model, "backward_step");
  auto* in_place = dynamic_cast<optim::InPlaceOptimizer*>(&model.optimizer());
  FRUGAL_CHECK(in_place != nullptr, "frugal: Loop::backward_step of '", model.name(),
               "' updates one parameter at a time and needs one of frugal's optimizers "
               "(frugal::optim::SGD, Adam or AdamW); its optimizer is ",
               c10::demangle(typeid(model.optimizer()).name()));
  const auto& scaler = options_.scaler();
  FRUGAL_CHECK(
      !(scaler && scaler->is_enabled()) && !options_.reducer() && !options_.check_gradients(),
      "frugal: Loop::backward_step of '", model.name(), "': the loop's ",
      scaler && scaler->is_enabled() ? "loss scaler"
      : options_.reducer()           ? "reducer"
                                     : "check_gradients",
      " needs every gradient before any update; use backward and step");
  FRUGAL_CHECK(loss.defined() && loss.numel() == 1, "frugal: Loop::backward_step of '",
               model.name(), "' needs a scalar loss");
  FRUGAL_CHECK(loss.requires_grad(), "frugal: Loop::backward_step of '", model.name(),
               "': the loss does not require grad (was the forward run under no_grad?)");
  auto& parts = *model.parts_;
  const double value = loss.detach().item<double>();
  const bool poisoned = !std::isfinite(value) || parts.non_finite;
  if (poisoned && options_.skip_non_finite()) {
    // Nothing is updated: the step is skipped as step() skips it.
    backward_read(loss, value, model, /*retain_graph=*/false);
    return step(model);
  }
  if (!parts.ready) {
    parts.ready = std::make_unique<detail::GradReady>(
        model.optimizer(), [&parts, in_place](const torch::Tensor& param) {
          in_place->step_parameter(param);
          parts.updated.push_back(param);
          param.mutable_grad().reset();
        });
  }
  parts.ready->clear();
  parts.updated.clear();
  try {
    {
      detail::ArmedScope arm(parts.ready.get(), nullptr, 1.0);
      backward_read(loss, value, model, /*retain_graph=*/false);
    }
    // Parameters whose gradient came only from earlier backwards are stepped now.
    for (const auto& p : parts.trainable) {
      if (p.grad().defined() && !parts.ready->delivered(p)) {
        in_place->step_parameter(p);
        parts.updated.push_back(p);
      }
    }
  } catch (const std::exception& error) {
    if (parts.updated.empty()) {
      throw;  // nothing changed: the gradients of earlier backwards are as they were
    }
    const auto changed = std::move(parts.updated);
    parts.updated.clear();
    parts.window.zero();
    parts.pending = false;
    parts.non_finite = false;
    throw detail::partial_step_error(model, "optimizer step in backward", changed, error,
                                     "the others as before; the model's gradients are released");
  }
  parts.updated.clear();
  finish_step(model, /*stepped=*/true);
  return true;
}

}  // namespace frugal
