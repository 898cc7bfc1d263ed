#include "frugal/policy/checkpoint_policy.h"

#include <c10/util/Exception.h>
#include <torch/nn/modules/container/sequential.h>

#include <algorithm>

#include "frugal/train/trainer.h"

namespace frugal {
namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// "ResidualBlock" matches "ResidualBlockImpl", "ns::ResidualBlockImpl" and the exact name.
bool type_matches(const std::string& module_name, const std::string& wanted) {
  for (const auto& form : {wanted, wanted + "Impl"}) {
    if (module_name == form || ends_with(module_name, "::" + form)) {
      return true;
    }
  }
  return false;
}

}  // namespace

CheckpointPolicy::CheckpointPolicy(CheckpointSelect select, CheckpointOptions options)
    : select_(std::move(select)), options_(std::move(options)) {
  TORCH_CHECK(select_.every() >= 0, "frugal: CheckpointSelect every must be >= 0, got ",
              select_.every());
  TORCH_CHECK(!select_.names().empty() || !select_.types().empty() || select_.every() > 0,
              "frugal: CheckpointPolicy chooses nothing: give names, types or every");
}

void CheckpointPolicy::on_add(Trainer& trainer) { apply(trainer.module()); }

void CheckpointPolicy::on_step_begin(StepContext& ctx) {
  if (!applied_) {
    apply(ctx.module);
  }
}

bool CheckpointPolicy::chosen(const std::string& qualified, std::size_t index,
                              const torch::nn::Module& child) const {
  if (dynamic_cast<const nn::CheckpointImpl*>(&child) != nullptr) {
    return false;  // already checkpointed
  }
  const auto& names = select_.names();
  if (std::find(names.begin(), names.end(), qualified) != names.end()) {
    return true;
  }
  for (const auto& type : select_.types()) {
    if (type_matches(child.name(), type)) {
      return true;
    }
  }
  return select_.every() > 0 && (index + 1) % static_cast<std::size_t>(select_.every()) == 0;
}

const std::vector<std::string>& CheckpointPolicy::apply(torch::nn::Module& root) {
  if (applied_) {
    return wrapped_names_;
  }
  applied_ = true;
  std::vector<std::pair<std::string, torch::nn::SequentialImpl*>> sequentials;
  if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&root)) {
    sequentials.emplace_back("", seq);
  }
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(item.value().get())) {
      sequentials.emplace_back(item.key(), seq);
    }
  }
  for (auto& [prefix, seq] : sequentials) {
    for (std::size_t i = 0; i < seq->size(); ++i) {
      const std::string key = std::to_string(i);
      const std::string qualified = prefix.empty() ? key : prefix + "." + key;
      auto slot = seq->begin() + static_cast<std::ptrdiff_t>(i);
      if (!chosen(qualified, i, *slot->ptr())) {
        continue;
      }
      nn::Checkpoint wrapper(*slot, options_);
      *slot = torch::nn::AnyModule(wrapper);
      seq->replace_module(key, wrapper.ptr());
      wrappers_.push_back(wrapper);
      wrapped_names_.push_back(qualified);
    }
  }
  return wrapped_names_;
}

void CheckpointPolicy::set_enabled(bool enabled) {
  for (auto& w : wrappers_) {
    w->set_enabled(enabled);
  }
}

}  // namespace frugal
