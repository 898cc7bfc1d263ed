#include "frugal/optim/in_place.h"

#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/torch.h>

#include <map>
#include <tuple>

#include "compat.h"
#include "frugal/error.h"

namespace frugal::optim {

torch::Tensor ParamUpdate::part(const torch::Tensor& t, std::int64_t offset,
                                std::int64_t length) const {
  if (!flat) {
    return t;
  }
  FRUGAL_CHECK(t.is_contiguous(), "frugal: an optimizer state tensor is not contiguous while "
               "its parameter is; it cannot be updated in place chunk by chunk");
  return t.view(-1).narrow(0, offset, length);
}

torch::Tensor ParamUpdate::scratch_part(std::size_t i, std::int64_t length) const {
  const auto buffer = scratch.at(i).narrow(0, 0, length);
  return flat ? buffer : buffer.view(param.sizes());
}

struct InPlaceOptimizer::Planned {
  Planned(torch::Tensor p, torch::optim::OptimizerParamGroup* g)
      : param(std::move(p)), group(g), key(compat::optimizer_state_key(param)) {}
  torch::Tensor param;
  torch::optim::OptimizerParamGroup* group = nullptr;
  compat::OptimizerStateKey key;  // computed once: text formatting on LibTorch 1.13
  std::unique_ptr<torch::optim::OptimizerParamState> new_state;
  bool has_state = false;
  bool flat = true;
  std::int64_t chunk = 0;
  int buffers = 0;
};

InPlaceOptimizer::InPlaceOptimizer(InPlaceOptions options) : in_place_(options) {
  FRUGAL_CHECK(in_place_.chunk() >= 1, "frugal: InPlaceOptions chunk must be >= 1 element, got ",
               in_place_.chunk());
}

torch::Tensor InPlaceOptimizer::run_step(const torch::optim::Optimizer::LossClosure& closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  std::vector<Planned> work;
  for (auto& group : optimizer().param_groups()) {
    for (auto& p : group.params()) {
      if (p.grad().defined()) {
        work.emplace_back(p, &group);
      }
    }
  }
  apply(work);
  return loss;
}

void InPlaceOptimizer::step_parameter(const torch::Tensor& param) {
  auto& group = group_of(param);
  if (!param.grad().defined()) {
    return;
  }
  torch::NoGradGuard no_grad;
  std::vector<Planned> work;
  work.emplace_back(param, &group);
  apply(work);
}

void InPlaceOptimizer::apply(std::vector<Planned>& work) {
  auto& state = optimizer().state();
  // Everything that can fail comes first: checks, new state and scratch.
  using Kind = std::tuple<c10::DeviceType, c10::DeviceIndex, c10::ScalarType>;
  std::map<Kind, std::pair<std::int64_t, int>> sizes;  // elements, buffers
  for (auto& w : work) {
    const auto& p = w.param;
    const auto& g = p.grad();
    FRUGAL_CHECK(!g.is_sparse(), "frugal: ", c10::demangle(typeid(optimizer()).name()),
                 " does not support sparse gradients");
    FRUGAL_CHECK(g.sizes() == p.sizes() && g.dtype() == p.dtype() && g.device() == p.device(),
                 "frugal: a gradient of shape ", g.sizes(), ", ", g.dtype(), " on ", g.device(),
                 " does not match its parameter (", p.sizes(), ", ", p.dtype(), " on ",
                 p.device(), ")");
    w.has_state = state.count(w.key) != 0;
    if (!w.has_state) {
      w.new_state = make_state(p, w.group->options());
    }
    w.flat = p.is_contiguous() && g.is_contiguous();
    w.chunk = chunk_of(p, w.flat);
    const auto* param_state = w.has_state ? state.find(w.key)->second.get() : w.new_state.get();
    w.buffers = scratch_buffers(p, w.flat, param_state, w.group->options());
    auto& size = sizes[Kind{p.device().type(), p.device().index(), scratch_type(p)}];
    size.first = std::max(size.first, w.chunk);
    size.second = std::max(size.second, w.buffers);
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
  }
  for (auto& w : work) {
    const auto& p = w.param;
    const auto found = state.find(w.key);
    ParamUpdate u{p,
                  p.grad(),
                  w.group->options(),
                  found == state.end() ? nullptr : found->second.get(),
                  !w.has_state,
                  w.flat,
                  w.chunk,
                  scratch[Kind{p.device().type(), p.device().index(), scratch_type(p)}]};
    update(u);
  }
}

torch::optim::OptimizerParamGroup& InPlaceOptimizer::group_of(const torch::Tensor& param) {
  auto& groups = optimizer().param_groups();
  auto it = group_index_.find(param.unsafeGetTensorImpl());
  if (it == group_index_.end() || it->second >= groups.size()) {
    group_index_.clear();  // groups were added since: index them again
    for (std::size_t g = 0; g < groups.size(); ++g) {
      for (const auto& p : groups[g].params()) {
        group_index_[p.unsafeGetTensorImpl()] = g;
      }
    }
    it = group_index_.find(param.unsafeGetTensorImpl());
  }
  FRUGAL_CHECK(it != group_index_.end(), "frugal: step_parameter got a tensor of shape ",
               param.sizes(), " that is not a parameter of this optimizer");
  return groups[it->second];
}

std::int64_t InPlaceOptimizer::chunk_of(const torch::Tensor& param, bool flat) const {
  const std::int64_t multiple = chunk_multiple();
  const std::int64_t chunk = std::max(multiple, in_place_.chunk() / multiple * multiple);
  return flat ? std::min(chunk, param.numel()) : param.numel();
}

std::int64_t InPlaceOptimizer::scratch_bytes() {
  std::int64_t most = 0;
  for (auto& group : optimizer().param_groups()) {
    for (const auto& p : group.params()) {
      const auto it = optimizer().state().find(compat::optimizer_state_key(p));
      const auto* param_state = it == optimizer().state().end() ? nullptr : it->second.get();
      const int buffers = scratch_buffers(p, p.is_contiguous(), param_state, group.options());
      const auto elements = chunk_of(p, p.is_contiguous());
      const auto element = static_cast<std::int64_t>(c10::elementSize(scratch_type(p)));
      most = std::max(most, elements * element * buffers);
    }
  }
  return most;
}

}  // namespace frugal::optim
