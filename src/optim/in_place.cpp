#include "frugal/optim/in_place.h"

#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <numeric>
#include <tuple>

#include "chunk_size.h"
#include "compat.h"
#include "frugal/error.h"
#include "rounding.h"
#include "weight_codes.h"

namespace frugal::optim {

torch::Tensor ParamUpdate::part(const torch::Tensor& t, std::int64_t offset,
                                std::int64_t length) const {
  if (!flat) {
    return t;
  }
  FRUGAL_CHECK(t.is_contiguous(),
               "frugal: an optimizer state tensor is not contiguous while "
               "its parameter is; it cannot be updated in place chunk by chunk");
  return t.view(-1).narrow(0, offset, length);
}

torch::Tensor ParamUpdate::scratch_part(std::size_t i, std::int64_t length) const {
  const auto buffer = scratch.at(i).narrow(0, 0, length);
  return flat ? buffer : buffer.view(param.sizes());
}

namespace {

bool low_precision(const torch::Tensor& t) {
  return t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kHalf;
}

// The chunk-sized float32 buffers a parameter's update goes through besides its own
// (ParamUpdate::LowPrecision::buffers): the weights of a bfloat16, float16 or 8-bit parameter,
// and off the CPU the random bits of stochastic rounding (8-bit: the random fractions and each
// group's statistics as well).
std::size_t weight_buffers(const torch::Tensor& param, Rounding rounding) {
  const bool cpu = param.device().is_cpu();
  if (detail::stored_weights(param) != nullptr) {
    return cpu ? 1 : 3;
  }
  if (!low_precision(param)) {
    return 0;
  }
  const bool stochastic =
      rounding == Rounding::Stochastic && param.scalar_type() == torch::kBFloat16;
  return stochastic && !cpu ? 2 : 1;
}

}  // namespace

torch::Tensor ParamUpdate::weights(std::int64_t offset, std::int64_t length) {
  if (low == nullptr) {
    return part(param, offset, length);
  }
  auto w = low->buffers.at(0).narrow(0, 0, length);
  w = flat ? w : w.view(param.sizes());
  if (low->stored != nullptr) {
    detail::decode_range(*low->stored, offset, length, w);
    return w;
  }
  w.copy_(part(param, offset, length));
  if (low->rounding == Rounding::Compensated) {
    w.add_(part(low->compensation, offset, length));
  }
  return w;
}

void ParamUpdate::store_weights(torch::Tensor& w, std::int64_t offset, std::int64_t length) {
  if (low == nullptr) {
    return;
  }
  if (low->stored != nullptr) {
    const auto no_buffer = torch::Tensor();  // the CPU needs none
    detail::encode_range(*low->stored, w, offset, low->rounding == Rounding::Stochastic, low->key,
                         low->buffers.size() > 1 ? low->buffers[1] : no_buffer,
                         low->buffers.size() > 2 ? low->buffers[2] : no_buffer);
    return;
  }
  auto p = part(param, offset, length);
  if (low->rounding == Rounding::Stochastic) {
    const auto bits = low->buffers.size() > 1
                          ? low->buffers[1].narrow(0, 0, length).view(torch::kInt32)
                          : torch::Tensor();  // the CPU draws its own
    detail::round_stochastic(w, bits, low->key, offset);
  }
  p.copy_(w);  // exact after stochastic rounding: w holds bfloat16 values
  if (low->rounding == Rounding::Compensated) {
    part(low->compensation, offset, length).copy_(w.sub_(p));
  }
}

struct InPlaceOptimizer::Planned {
  Planned(torch::Tensor p, torch::optim::OptimizerParamGroup* g)
      : param(std::move(p)),
        group(g),
        key(compat::optimizer_state_key(param)),
        stored(detail::stored_weights(param)),
        target(stored != nullptr ? stored->whole : param) {}
  torch::Tensor param;
  torch::optim::OptimizerParamGroup* group = nullptr;
  compat::OptimizerStateKey key;  // computed once: text formatting on LibTorch 1.13
  // Weights stored in 8 bits: the codes, and `target` the tensor of the parameter's shape
  // and dtype (without bytes between uses) that the update is given; else the parameter.
  std::shared_ptr<detail::StoredWeights> stored;
  torch::Tensor target;
  std::uint64_t place = 0;  // among all the groups' parameters, in order
  std::unique_ptr<torch::optim::OptimizerParamState> new_state;
  bool has_state = false;
  bool flat = true;
  std::int64_t chunk = 0;
  int buffers = 0;
  // A bfloat16 or float16 parameter (low_precision.buffers not empty): its float32 weights'
  // buffers (from `weights_from` in the float32 buffers of its device) and a compensation
  // buffer the step makes.
  bool low() const { return !low_precision.buffers.empty(); }
  std::size_t weights_from = 0;
  torch::Tensor new_compensation;
  ParamUpdate::LowPrecision low_precision;
};

InPlaceOptimizer::InPlaceOptimizer(InPlaceOptions options) : in_place_(options) {
  FRUGAL_CHECK(in_place_.chunk() >= 1, "frugal: InPlaceOptions chunk must be >= 1 element, got ",
               in_place_.chunk());
  FRUGAL_CHECK(in_place_.device_scratch() >= 0,
               "frugal: InPlaceOptions device_scratch must be >= 0 bytes, got ",
               in_place_.device_scratch());
}

torch::Tensor InPlaceOptimizer::run_step(const torch::optim::Optimizer::LossClosure& closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  std::vector<Planned> work;
  std::uint64_t place = 0;
  for (auto& group : optimizer().param_groups()) {
    for (auto& p : group.params()) {
      if (p.grad().defined()) {
        work.emplace_back(p, &group).place = place;
      }
      ++place;
    }
  }
  apply(work);
  return loss;
}

void InPlaceOptimizer::step_parameter(const torch::Tensor& param) {
  const auto [group, place] = group_of(param);
  if (!param.grad().defined()) {
    return;
  }
  torch::NoGradGuard no_grad;
  std::vector<Planned> work;
  work.emplace_back(param, group).place = place;
  apply(work);
}

void InPlaceOptimizer::apply(std::vector<Planned>& work) {
  auto& state = optimizer().state();
  // Everything that can fail comes first: checks, new state and scratch.
  using Kind = std::tuple<c10::DeviceType, c10::DeviceIndex, c10::ScalarType>;
  std::map<Kind, std::pair<std::int64_t, int>> sizes;  // elements, buffers
  const auto kind_of = [](const torch::Tensor& p, c10::ScalarType type) {
    return Kind{p.device().type(), p.device().index(), type};
  };
  const torch::optim::OptimizerParamGroup* checked = nullptr;
  for (auto& w : work) {
    const auto& p = w.target;
    const auto& g = w.param.grad();
    if (w.group != checked) {  // a group's parameters come together: its rate once a step
      // A learning rate set after construction (a schedule, a user) is checked here too.
      const double lr = w.group->options().get_lr();
      FRUGAL_CHECK(std::isfinite(lr) && lr >= 0,
                   "frugal: ", c10::demangle(typeid(optimizer()).name()),
                   " needs a finite learning rate >= 0, got ", lr,
                   " in a parameter group; nothing was stepped");
      checked = w.group;
    }
    FRUGAL_CHECK(!g.is_sparse(), "frugal: ", c10::demangle(typeid(optimizer()).name()),
                 " does not support sparse gradients");
    FRUGAL_CHECK(g.sizes() == p.sizes() && g.dtype() == p.dtype() && g.device() == p.device(),
                 "frugal: a gradient of shape ", g.sizes(), ", ", g.dtype(), " on ", g.device(),
                 " does not match its parameter (", p.sizes(), ", ", p.dtype(), " on ", p.device(),
                 ")");
    w.has_state = state.count(w.key) != 0;
    if (!w.has_state) {
      w.new_state = make_state(p, w.group->options());
    }
    w.flat = p.is_contiguous() && g.is_contiguous();
    const auto* param_state = w.has_state ? state.find(w.key)->second.get() : w.new_state.get();
    w.chunk = chunk_of(p, w.flat, param_state, w.group->options());
    w.buffers = scratch_buffers(p, w.flat, param_state, w.group->options());
    auto& size = sizes[kind_of(p, scratch_type(p))];
    size.first = std::max(size.first, w.chunk);
    size.second = std::max(size.second, w.buffers);
    if (low_precision(p) || w.stored != nullptr) {
      plan_low_precision(w);
      // The float32 weights (and random bits off the CPU) follow the update's own buffers
      // where those are float32 too.
      w.weights_from = scratch_type(p) == torch::kFloat32 ? static_cast<std::size_t>(w.buffers) : 0;
      auto& weights = sizes[kind_of(p, torch::kFloat32)];
      // An 8-bit group's three statistics fit even a parameter of one or two elements.
      weights.first = std::max(weights.first,
                               w.stored != nullptr ? std::max<std::int64_t>(w.chunk, 3) : w.chunk);
      weights.second = std::max(weights.second,
                                static_cast<int>(w.weights_from + w.low_precision.buffers.size()));
    }
  }
  std::map<Kind, std::vector<torch::Tensor>> scratch;
  for (const auto& [kind, size] : sizes) {
    auto& buffers = scratch[kind];
    const auto options = torch::TensorOptions()
                             .device(c10::Device(std::get<0>(kind), std::get<1>(kind)))
                             .dtype(std::get<2>(kind));
    for (int i = 0; i < size.second; ++i) {
      buffers.push_back(torch::empty({size.first}, options));
    }
  }
  // Nothing below allocates a tensor: the step goes through.
  for (auto& w : work) {
    if (w.new_state) {
      state[w.key] = std::move(w.new_state);
    }
    if (w.new_compensation.defined()) {
      compensation_[w.param.unsafeGetTensorImpl()] = w.new_compensation;
    }
  }
  for (auto& w : work) {
    const auto& p = w.target;
    const auto found = state.find(w.key);
    ParamUpdate u{p,
                  w.param.grad(),
                  w.group->options(),
                  found == state.end() ? nullptr : found->second.get(),
                  !w.has_state,
                  w.flat,
                  w.chunk,
                  scratch[kind_of(p, scratch_type(p))]};
    u.stream = detail::rounding_key(~in_place_.seed(), w.place);
    if (w.low()) {
      auto& low = w.low_precision;
      const auto& f32 = scratch[kind_of(p, torch::kFloat32)];
      for (std::size_t i = 0; i < low.buffers.size(); ++i) {
        low.buffers[i] = f32.at(w.weights_from + i);
      }
      if (low.rounding == Rounding::Stochastic) {
        low.key = detail::rounding_key(in_place_.seed(), updates_++);
      }
      u.low = &low;
    }
    update(u);
  }
}

void InPlaceOptimizer::plan_low_precision(Planned& w) {
  auto& low = w.low_precision;
  low.rounding = in_place_.rounding();
  if (w.stored != nullptr) {
    FRUGAL_CHECK(low.rounding != Rounding::Compensated, "frugal: a parameter of shape ",
                 w.target.sizes(),
                 " is stored in 8 bits; its update rounds Stochastic or Nearest, not Compensated");
    detail::check_codes(*w.stored, w.target.numel());  // before any parameter is written
    low.stored = w.stored.get();
    low.buffers.resize(weight_buffers(w.param, low.rounding));
    return;
  }
  if (low.rounding == Rounding::Stochastic && w.param.scalar_type() != torch::kBFloat16) {
    low.rounding = Rounding::Nearest;  // float16: see Rounding::Stochastic
  }
  if (low.rounding == Rounding::Compensated) {
    const auto it = compensation_.find(w.param.unsafeGetTensorImpl());
    if (it != compensation_.end() && it->second.sizes() == w.param.sizes() &&
        it->second.dtype() == w.param.dtype() && it->second.device() == w.param.device()) {
      low.compensation = it->second;
    } else {  // none yet, or the parameter was replaced: nothing lost to carry over
      w.new_compensation = torch::zeros_like(w.param, torch::MemoryFormat::Preserve);
      low.compensation = w.new_compensation;
    }
  }
  low.buffers.resize(weight_buffers(w.param, low.rounding));
}

std::pair<torch::optim::OptimizerParamGroup*, std::uint64_t> InPlaceOptimizer::group_of(
    const torch::Tensor& param) {
  auto& groups = optimizer().param_groups();
  auto it = group_index_.find(param.unsafeGetTensorImpl());
  if (it == group_index_.end() || it->second.first >= groups.size()) {
    group_index_.clear();  // groups were added since: index them again
    std::uint64_t place = 0;
    for (std::size_t g = 0; g < groups.size(); ++g) {
      for (const auto& p : groups[g].params()) {
        group_index_[p.unsafeGetTensorImpl()] = {g, place++};
      }
    }
    it = group_index_.find(param.unsafeGetTensorImpl());
  }
  FRUGAL_CHECK(it != group_index_.end(), "frugal: step_parameter got a tensor of shape ",
               param.sizes(), " that is not a parameter of this optimizer");
  return {&groups[it->second.first], it->second.second};
}

std::int64_t InPlaceOptimizer::chunk_of(const torch::Tensor& param, bool flat,
                                        const torch::optim::OptimizerParamState* state,
                                        const torch::optim::OptimizerOptions& options) const {
  frugal::detail::ChunkRequest request;
  request.device = param.device().type();
  request.chunk = in_place_.chunk();
  request.device_scratch = in_place_.device_scratch();
  request.bytes_per_element = scratch_per_element(param, flat, state, options);
  request.multiple = chunk_multiple(param, state, options);
  if (const auto stored = detail::stored_weights(param)) {  // whole groups of 8-bit weights
    request.multiple = std::lcm(request.multiple, stored->group);
  }
  request.numel = param.numel();
  request.flat = flat;
  return frugal::detail::chunk_elements(request);
}

std::int64_t InPlaceOptimizer::scratch_per_element(
    const torch::Tensor& param, bool flat, const torch::optim::OptimizerParamState* state,
    const torch::optim::OptimizerOptions& options) const {
  const auto own =
      static_cast<std::int64_t>(std::max(1, scratch_buffers(param, flat, state, options)) *
                                c10::elementSize(scratch_type(param)));
  return own + static_cast<std::int64_t>(weight_buffers(param, in_place_.rounding()) * 4);
}

std::int64_t InPlaceOptimizer::scratch_bytes() {
  std::int64_t most = 0;
  for (auto& group : optimizer().param_groups()) {
    for (const auto& param : group.params()) {
      const auto stored = detail::stored_weights(param);
      const auto& p = stored != nullptr ? stored->whole : param;
      const auto it = optimizer().state().find(compat::optimizer_state_key(param));
      const auto* param_state = it == optimizer().state().end() ? nullptr : it->second.get();
      const auto elements = chunk_of(p, p.is_contiguous(), param_state, group.options());
      const auto buffers =
          elements * (scratch_buffers(p, p.is_contiguous(), param_state, group.options()) *
                          c10::elementSize(scratch_type(p)) +
                      weight_buffers(p, in_place_.rounding()) * 4);
      most = std::max(most, static_cast<std::int64_t>(buffers));
    }
  }
  return most;
}

std::vector<torch::Tensor> InPlaceOptimizer::all_params() {
  std::vector<torch::Tensor> out;
  for (const auto& group : optimizer().param_groups()) {
    out.insert(out.end(), group.params().begin(), group.params().end());
  }
  return out;
}

std::vector<torch::Tensor> InPlaceOptimizer::ledger_optimizer_state() const {
  std::vector<torch::Tensor> out;
  out.reserve(compensation_.size());
  for (const auto& [impl, buffer] : compensation_) {
    out.push_back(buffer);
  }
  return out;
}

void InPlaceOptimizer::save_rounding(torch::serialize::OutputArchive& archive) const {
  torch::serialize::OutputArchive rounding;
  rounding.write("updates", torch::tensor(static_cast<std::int64_t>(updates_), torch::kLong));
  const auto params = const_cast<InPlaceOptimizer*>(this)->all_params();
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto it = compensation_.find(params[i].unsafeGetTensorImpl());
    if (it != compensation_.end()) {
      rounding.write("compensation_" + std::to_string(i), it->second);
    }
  }
  archive.write("frugal_rounding", rounding);
}

std::function<void()> InPlaceOptimizer::load_rounding(torch::serialize::InputArchive& archive) {
  torch::serialize::InputArchive rounding;
  std::uint64_t updates = 0;
  std::unordered_map<const void*, torch::Tensor> compensation;
  if (archive.try_read("frugal_rounding", rounding)) {
    torch::Tensor count;
    rounding.read("updates", count);
    FRUGAL_CHECK(count.numel() == 1 && count.scalar_type() == torch::kLong,
                 "frugal: the saved count of rounded updates is ", count.scalar_type(), " ",
                 count.sizes(), ", not one int64");
    updates = static_cast<std::uint64_t>(count.item<std::int64_t>());
    const auto params = all_params();
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto& p = params[i];
      torch::Tensor buffer;
      if (!rounding.try_read("compensation_" + std::to_string(i), buffer)) {
        continue;
      }
      FRUGAL_CHECK(buffer.sizes() == p.sizes() && buffer.scalar_type() == p.scalar_type(),
                   "frugal: the saved compensation of parameter ", i, " is ", buffer.scalar_type(),
                   " ", buffer.sizes(), " where its parameter is ", p.scalar_type(), " ",
                   p.sizes());
      compensation[p.unsafeGetTensorImpl()] = buffer.to(p.device()).contiguous();
    }
  }
  return [this, updates, compensation = std::move(compensation)]() mutable {
    updates_ = updates;
    compensation_ = std::move(compensation);
  };
}

}  // namespace frugal::optim
