// Loop::backward_step: a model's last backward with its optimizer step fused into it.
#include <fmt/format.h>
#include <torch/torch.h>

#include <cmath>

#include "../engine/compatibility.h"
#include "../engine/in_backward.h"
#include "../engine/partial_step.h"
#include "frugal/policy/grad_scaler.h"
#include "parts.h"

namespace frugal {

bool Loop::backward_step(const torch::Tensor& loss, LoopModel& model) {
  check_own(model, "backward_step");
  auto& parts = *model.parts_;
  if (!parts.ready) {
    // The first call checks what the loop's options do not change, and hooks the model.
    const auto who = fmt::format("Loop::backward_step of '{}'", model.name());
    auto* in_place = &detail::in_place_optimizer(model.optimizer(), who);
    // What needs every gradient of a step before any update, in the one table of refusals.
    auto present = gradient_readers(options_);
    if (options_.reducer()) {
      present.push_back({"the loop's reducer", Trait::AllGradients});
    }
    detail::check_compatible(present, {who, Trait::GradReady | Trait::UpdatesInBackward});
    parts.in_place = in_place;
    parts.ready = std::make_unique<detail::GradReady>(
        model.optimizer(), [&parts, in_place](const torch::Tensor& param) {
          detail::step_in_backward(*in_place, param, parts.updated);
        });
  }
  FRUGAL_CHECK(loss.defined() && loss.numel() == 1, "frugal: Loop::backward_step of '",
               model.name(), "' needs a scalar loss");
  FRUGAL_CHECK(loss.requires_grad(), "frugal: Loop::backward_step of '", model.name(),
               "': the loss does not require grad (was the forward run under no_grad?)");
  // Whether to skip is known before the backward that updates: the one host read of the step
  // (none where non-finite losses are not skipped).
  if (options_.skip_non_finite() &&
      (parts.read_non_finite() || !std::isfinite(loss.detach().item<double>()))) {
    // Nothing is updated: the step is skipped as step() skips it.
    backward_logged(loss, loss, 1.0, model, /*retain_graph=*/false);
    return step(model);
  }
  parts.ready->clear();
  parts.updated.clear();
  try {
    {
      detail::ArmedScope arm(parts.ready.get(), nullptr, 1.0);
      backward_logged(loss, loss, 1.0, model, /*retain_graph=*/false);
    }
    // Parameters whose gradient came only from earlier backwards are stepped now.
    for (const auto& p : parts.trainable) {
      if (p.grad().defined() && !parts.ready->delivered(p)) {
        parts.in_place->step_parameter(p);
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
    parts.losses.step.clear();
    throw detail::partial_step_error(
        model.module(), fmt::format("the optimizer step in backward of '{}'", model.name()),
        changed, error,
        "the others are as before; the model's gradients are "
        "released");
  }
  parts.updated.clear();
  finish_step(model, /*stepped=*/true);
  return true;
}

}  // namespace frugal
