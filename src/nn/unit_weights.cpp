#include "nn/unit_weights.h"

#include <torch/torch.h>

#include "frugal/error.h"
#include "memory/storage_bytes.h"

namespace frugal::nn::detail {

torch::Tensor UnitWeightsHook::value(const LinearSlot& slot) const {
  const auto base = slot.stored ? slot.stored() : slot.param;
  return slot.adapt ? slot.adapt(base) : base;
}

void UnitWeightsHook::before_forward() {
  made_.clear();  // a call that threw left its weights
  in_call_ = true;
}

void UnitWeightsHook::enter_run() {
  for (const auto& slot : slots_) {
    auto w = value(*slot);
    if (slot->own_call) {
      slot->current = w;
    } else {
      slot->linear->weight = w;
    }
    if (in_call_ && !w.is_same(slot->param)) {  // a recompute's weights go with its graph
      made_.emplace_back(slot.get(), std::move(w));
    }
  }
}

void UnitWeightsHook::leave_run() {
  for (const auto& slot : slots_) {
    slot->current = torch::Tensor();
    const bool plain = !slot->stored && !slot->adapt;
    slot->linear->weight = plain || slot->stored ? slot->param : slot->no_weight();
  }
}

void UnitWeightsHook::after_forward(const std::vector<torch::Tensor>& outputs) {
  in_call_ = false;
  auto kept = std::make_shared<std::vector<std::pair<const LinearSlot*, torch::Tensor>>>();
  for (auto& item : made_) {
    if (item.second.storage().use_count() > 1) {  // autograd saved it (or a view of it)
      kept->push_back(std::move(item));
    }
  }
  made_.clear();
  std::vector<torch::Tensor> reach;
  for (const auto& out : outputs) {
    if (out.defined() && out.requires_grad()) {
      reach.push_back(out);
    }
  }
  if (kept->empty() || reach.empty()) {
    return;  // nothing kept, or kept by a graph this call's outputs do not lead back to
  }
  for (const auto& item : *kept) {
    frugal::detail::drop_bytes(item.second);
  }
  for (auto& out : reach) {
    out.register_hook([weak = weak_from_this(), kept](const torch::Tensor&) {
      const auto self = weak.lock();
      if (self == nullptr || kept->empty()) {
        return;
      }
      torch::NoGradGuard no_grad;
      for (auto& [slot, w] : *kept) {
        frugal::detail::take_bytes(w);
        // Through an alias with its own version counter: autograd saved `w` at its
        // version and checks it when it reads it.
        auto alias = torch::empty({0}, w.options());
        alias.set_(w.storage(), w.storage_offset(), w.sizes(), w.strides());
        alias.copy_(self->value(*slot));
      }
      kept->clear();  // the graph holds them now; they go with its nodes
    });
  }
}

LinearSlot& UnitWeightsHook::slot(torch::nn::LinearImpl* linear) {
  for (auto& s : slots_) {
    if (s->linear == linear) {
      return *s;
    }
  }
  slots_.push_back(std::make_unique<LinearSlot>());
  slots_.back()->linear = linear;
  slots_.back()->param = linear->named_parameters(false)["weight"];
  return *slots_.back();
}

bool UnitWeightsHook::prune() {
  for (auto it = slots_.begin(); it != slots_.end();) {
    if (!(*it)->stored && !(*it)->adapt) {
      (*it)->linear->weight = (*it)->param;
      it = slots_.erase(it);
    } else {
      ++it;
    }
  }
  return !slots_.empty();
}

void check_weights_unit(const torch::nn::Module& unit) {
  const auto hook = unit_hook(unit);
  FRUGAL_CHECK(hook == nullptr || std::dynamic_pointer_cast<UnitWeightsHook>(hook) != nullptr,
               "frugal: module '", unit.name(),
               "' is a unit already (of an Int8Weights or a ZeroOptimizer)");
}

WeightsUnit unit_weights(const std::shared_ptr<torch::nn::Module>& unit) {
  check_weights_unit(*unit);
  auto hook = std::dynamic_pointer_cast<UnitWeightsHook>(unit_hook(*unit));
  if (hook == nullptr) {
    hook = std::make_shared<UnitWeightsHook>();
    nn::detail::add_unit_hook(unit.get(), hook);
  }
  return {unit, hook};
}

void release_unit_weights(const WeightsUnit& unit) {
  if (!unit.hook->prune()) {
    nn::detail::remove_unit_hook(unit.module.get());
  }
}

}  // namespace frugal::nn::detail
