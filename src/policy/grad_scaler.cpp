#include "frugal/policy/grad_scaler.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <cmath>
#include <map>

#include "frugal/error.h"
#include "frugal/state/archive.h"

namespace frugal {
namespace {

// Whether this LibTorch has the fused AMP kernels for the CPU (1.13 has them for CUDA only).
// Asked once, with throwaway tensors.
bool cpu_has_fused_kernels() {
  static const bool available = [] {
    try {
      auto grad = torch::ones({1});
      auto found = torch::zeros({});
      auto inv = torch::ones({});
      at::_amp_foreach_non_finite_check_and_unscale_({grad}, found, inv);
      auto scale = torch::ones({});
      auto tracker = torch::zeros({}, torch::kInt);
      at::_amp_update_scale_(scale, tracker, found, 2.0, 0.5, 10);
      return true;
    } catch (const c10::Error&) {
      return false;
    }
  }();
  return available;
}

bool fused(torch::Device device) { return device.is_cuda() || cpu_has_fused_kernels(); }

// Divides each gradient by the scale and sets found_inf to 1 if any value is inf or NaN.
void unscale_grads(std::vector<torch::Tensor>& grads, torch::Tensor& found_inf,
                   const torch::Tensor& inv_scale) {
  if (fused(found_inf.device())) {
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale);
    return;
  }
  for (auto& g : grads) {
    const auto bad = torch::isfinite(g).logical_not().any().to(torch::kFloat);
    found_inf.copy_(torch::maximum(found_inf, bad));
    g.mul_(inv_scale);
  }
}

void update_scale(torch::Tensor& scale, torch::Tensor& tracker, const torch::Tensor& found_inf,
                  const GradScalerOptions& o) {
  if (fused(scale.device())) {
    at::_amp_update_scale_(scale, tracker, found_inf, o.growth_factor(), o.backoff_factor(),
                           o.growth_interval());
    return;
  }
  if (found_inf.item<float>() > 0) {
    scale.mul_(o.backoff_factor());
    tracker.fill_(0);
    return;
  }
  const std::int64_t successful = tracker.item<std::int64_t>() + 1;
  if (successful == o.growth_interval()) {
    const double grown = scale.item<double>() * o.growth_factor();
    if (std::isfinite(static_cast<float>(grown))) {
      scale.fill_(grown);
    }
    tracker.fill_(0);
  } else {
    tracker.fill_(successful);
  }
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options) : options_(options) {
  FRUGAL_CHECK(options_.init_scale() > 0, "frugal: GradScaler init_scale must be > 0, got ",
               options_.init_scale());
  FRUGAL_CHECK(options_.growth_factor() > 1.0, "frugal: GradScaler growth_factor must be > 1, got ",
               options_.growth_factor());
  FRUGAL_CHECK(options_.backoff_factor() > 0.0 && options_.backoff_factor() < 1.0,
               "frugal: GradScaler backoff_factor must be in (0, 1), got ",
               options_.backoff_factor());
  detail::check_at_least(options_.growth_interval(), 1, "GradScaler growth_interval");
}

void GradScaler::lazy_init(torch::Device device) {
  scale_ = torch::full({}, options_.init_scale(),
                       torch::TensorOptions().dtype(torch::kFloat).device(device));
  growth_tracker_ =
      torch::full({}, init_tracker_, torch::TensorOptions().dtype(torch::kInt).device(device));
}

torch::Tensor GradScaler::scale(const torch::Tensor& loss) {
  if (!options_.enabled()) {
    return loss;
  }
  if (!scale_.defined()) {
    lazy_init(loss.device());
  }
  return loss * scale_.to(loss.device(), /*non_blocking=*/true);
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) {
    return;
  }
  auto& state = per_optimizer_[&optimizer];
  FRUGAL_CHECK(state.stage != Stage::Unscaled,
               "frugal: unscale_() has already been called on this optimizer since the last "
               "update()");
  FRUGAL_CHECK(state.stage != Stage::Stepped, "frugal: unscale_() is being called after step()");
  FRUGAL_CHECK(scale_.defined(),
               "frugal: unscale_() before any scale(): scale the loss before backward");
  torch::NoGradGuard no_grad;
  const auto inv_scale = scale_.to(torch::kDouble).reciprocal().to(torch::kFloat);
  std::map<std::string, std::vector<torch::Tensor>> by_device;
  std::int64_t index = 0;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      const auto& g = p.grad();
      if (g.defined()) {
        FRUGAL_CHECK(g.scalar_type() != torch::kHalf,
                     "frugal: GradScaler cannot unscale FP16 "
                     "gradients (parameter ",
                     index,
                     "); keep parameters in float32 and let "
                     "autocast lower the activations");
        FRUGAL_CHECK(!g.is_sparse(),
                     "frugal: GradScaler does not support sparse gradients "
                     "(parameter ",
                     index, ")");
        by_device[g.device().str()].push_back(g);
      }
      ++index;
    }
  }
  state.found_inf.clear();
  for (auto& [device, grads] : by_device) {
    auto found = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat).device(device));
    unscale_grads(grads, found, inv_scale.to(found.device()));
    state.found_inf.push_back(found);
  }
  state.stage = Stage::Unscaled;
}

bool GradScaler::found_inf(const PerOptimizer& state) const {
  double total = 0;
  for (const auto& f : state.found_inf) {
    total += f.item<double>();
  }
  return total > 0;
}

bool GradScaler::prepare_step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) {
    return true;
  }
  auto& state = per_optimizer_[&optimizer];
  FRUGAL_CHECK(state.stage != Stage::Stepped,
               "frugal: step() has already been called since the last update()");
  if (state.stage == Stage::Ready) {
    unscale_(optimizer);
  }
  FRUGAL_CHECK(!state.found_inf.empty(),
               "frugal: no inf checks were recorded for this optimizer: no parameter has a "
               "gradient");
  state.stage = Stage::Stepped;
  return !found_inf(state);
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  const bool go = prepare_step(optimizer);
  if (go) {
    optimizer.step();
  }
  return go;
}

void GradScaler::discard_step(const torch::optim::Optimizer& optimizer) {
  per_optimizer_.erase(&optimizer);
}

bool GradScaler::unscaled(const torch::optim::Optimizer& optimizer) const {
  const auto it = per_optimizer_.find(&optimizer);
  return it != per_optimizer_.end() && it->second.stage != Stage::Ready;
}

void GradScaler::update(c10::optional<double> new_scale) {
  if (!options_.enabled()) {
    return;
  }
  FRUGAL_CHECK(scale_.defined(),
               "frugal: update() before any scale(): scale the loss before "
               "backward in every iteration");
  if (new_scale) {
    scale_.fill_(*new_scale);
  } else {
    std::vector<torch::Tensor> found;
    for (const auto& entry : per_optimizer_) {
      for (const auto& f : entry.second.found_inf) {
        found.push_back(f.to(scale_.device()));
      }
    }
    FRUGAL_CHECK(!found.empty(), "frugal: no inf checks were recorded prior to update()");
    const auto combined = torch::stack(found).sum();
    update_scale(scale_, growth_tracker_, combined, options_);
  }
  per_optimizer_.clear();
}

double GradScaler::get_scale() const {
  if (!options_.enabled()) {
    return 1.0;
  }
  return scale_.defined() ? scale_.item<double>() : options_.init_scale();
}

std::int64_t GradScaler::growth_tracker() const {
  if (!options_.enabled()) {
    return 0;
  }
  return growth_tracker_.defined() ? growth_tracker_.item<std::int64_t>() : init_tracker_;
}

std::map<std::string, double> GradScaler::state_dict() const {
  if (!options_.enabled()) {
    return {};
  }
  return {{"scale", get_scale()},
          {"growth_factor", options_.growth_factor()},
          {"backoff_factor", options_.backoff_factor()},
          {"growth_interval", static_cast<double>(options_.growth_interval())},
          {"_growth_tracker", static_cast<double>(growth_tracker())}};
}

void GradScaler::load_state_dict(const std::map<std::string, double>& state) {
  if (!options_.enabled()) {
    return;
  }
  FRUGAL_CHECK(!state.empty(),
               "frugal: the source state dict is empty, possibly because it "
               "was saved from a disabled GradScaler");
  for (const char* key :
       {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}) {
    FRUGAL_CHECK(state.count(key) == 1, "frugal: GradScaler state dict lacks '", key, "'");
  }
  options_.init_scale(state.at("scale"));
  options_.growth_factor(state.at("growth_factor"));
  options_.backoff_factor(state.at("backoff_factor"));
  options_.growth_interval(static_cast<std::int64_t>(state.at("growth_interval")));
  init_tracker_ = static_cast<std::int64_t>(state.at("_growth_tracker"));
  if (scale_.defined()) {
    scale_.fill_(state.at("scale"));
    growth_tracker_.fill_(init_tracker_);
  }
}

GradScalerPolicy::GradScalerPolicy(std::shared_ptr<GradScaler> scaler)
    : scaler_(std::move(scaler)) {
  FRUGAL_CHECK(scaler_ != nullptr, "frugal: GradScalerPolicy needs a scaler");
}

void GradScalerPolicy::before_backward(StepContext& ctx) { ctx.loss = scaler_->scale(ctx.loss); }

void GradScalerPolicy::before_optimizer_step(StepContext& ctx) {
  if (!scaler_->prepare_step(ctx.optimizer)) {
    ctx.skip_optimizer_step = true;
  }
}

void GradScalerPolicy::after_optimizer_step(StepContext&) { scaler_->update(); }

void GradScalerPolicy::on_add(PolicyPort& port) {
  port.set_unscale([scaler = scaler_](torch::optim::Optimizer& optimizer) {
    if (scaler->is_enabled() && !scaler->unscaled(optimizer)) {
      scaler->unscale_(optimizer);
    }
  });
}

void GradScalerPolicy::on_optimizer_error(StepContext& ctx, const std::exception&) {
  scaler_->discard_step(ctx.optimizer);  // the next step unscales and checks afresh
}

void GradScalerPolicy::on_step_end(StepContext& ctx) { ctx.report.scale = scaler_->get_scale(); }

void GradScalerPolicy::save_state(torch::serialize::OutputArchive& archive) const {
  state::write_int(archive, "enabled", scaler_->is_enabled() ? 1 : 0);
  for (const auto& [key, value] : scaler_->state_dict()) {
    state::write_double(archive, key, value);
  }
}

void GradScalerPolicy::load_state(torch::serialize::InputArchive& archive) {
  const bool enabled = state::read_int(archive, "enabled") != 0;
  FRUGAL_CHECK(enabled == scaler_->is_enabled(), "frugal: the saved GradScaler was ",
               enabled ? "enabled" : "disabled", ", this one is ",
               scaler_->is_enabled() ? "enabled" : "disabled");
  std::map<std::string, double> state;
  for (const auto& [key, value] : scaler_->state_dict()) {
    state[key] = state::read_double(archive, key);
  }
  scaler_->load_state_dict(state);
}

}  // namespace frugal
