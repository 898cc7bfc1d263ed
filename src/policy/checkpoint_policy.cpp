#include "frugal/policy/checkpoint_policy.h"

#include <torch/nn/modules/container/sequential.h>

#include "frugal/error.h"
#include "module_select.h"
#include "nn/call_choice.h"

namespace frugal {

struct CheckpointPolicy::Chosen {
  std::string name;
  std::string type;
  const torch::nn::Module* module;
  std::shared_ptr<nn::detail::CallChoice> choice;
};

CheckpointPolicy::CheckpointPolicy(CheckpointSelect select, CheckpointOptions options)
    : select_(std::move(select)), options_(std::move(options)) {
  detail::check_at_least(select_.every(), 0, "CheckpointSelect every");
  FRUGAL_CHECK(!select_.names().empty() || !select_.types().empty() || select_.every() > 0,
               "frugal: CheckpointPolicy chooses nothing: give names, types or every");
}

CheckpointPolicy::~CheckpointPolicy() {
  for (const auto& c : by_call_) {
    nn::detail::remove_call_choice(c->module);
  }
}

void CheckpointPolicy::on_add(PolicyPort& port) { apply(port.module()); }

void CheckpointPolicy::on_step_begin(StepContext& ctx) {
  if (!applied_) {
    apply(ctx.module);
  }
}

void CheckpointPolicy::after_forward(StepContext&) {
  if (checked_ || !torch::GradMode::is_enabled() || std::uncaught_exceptions() > 0) {
    return;
  }
  checked_ = true;
  for (const auto& c : by_call_) {
    FRUGAL_CHECK(c->choice->calls.load() > 0, "frugal: CheckpointPolicy chose '", c->name, "' (",
                 c->type,
                 "), but the forward did not call it through "
                 "frugal::nn::call: its parent calls its forward directly, which C++ gives no "
                 "way to intercept. Call it as frugal::nn::call(block, args...) in the "
                 "parent's forward, or hold the blocks in a torch::nn::Sequential");
  }
}

void CheckpointPolicy::choose(const std::string& qualified,
                              const std::shared_ptr<torch::nn::Module>& module,
                              torch::nn::Module* parent, std::size_t index) {
  chosen_names_.push_back(qualified);
  if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(parent)) {
    // The Sequential calls its children through its slots: the slot goes through a
    // checkpoint, while the child stays registered under its name (nothing renamed).
    auto slot = seq->begin() + static_cast<std::ptrdiff_t>(index);
    nn::Checkpoint wrapper(*slot, CheckpointOptions(options_).name(qualified));
    *slot = torch::nn::AnyModule(wrapper);
    wrappers_.emplace_back(qualified, wrapper);
    return;
  }
  auto c = std::make_shared<Chosen>();
  c->name = qualified;
  c->type = module->name();
  c->module = module.get();
  c->choice = std::make_shared<nn::detail::CallChoice>();
  c->choice->options = CheckpointOptions(options_).name(qualified);
  nn::detail::add_call_choice(c->module, c->choice);
  by_call_.push_back(std::move(c));
}

const std::vector<std::string>& CheckpointPolicy::apply(torch::nn::Module& root) {
  if (applied_) {
    return chosen_names_;
  }
  applied_ = true;
  for (const auto& node : detail::select_modules(root, select_, "CheckpointPolicy")) {
    choose(node.name, node.module, node.parent, node.index);
  }
  return chosen_names_;
}

void CheckpointPolicy::set_enabled(bool enabled) {
  for (auto& w : wrappers_) {
    w.second->set_enabled(enabled);
  }
  for (auto& c : by_call_) {
    c->choice->enabled.store(enabled);
  }
}

bool CheckpointPolicy::enabled(const std::string& block) const {
  for (const auto& w : wrappers_) {
    if (w.first == block) {
      return w.second->enabled();
    }
  }
  for (const auto& c : by_call_) {
    if (c->name == block) {
      return c->choice->enabled.load();
    }
  }
  FRUGAL_CHECK(false, "frugal: CheckpointPolicy did not choose a block named '", block,
               "'; it chose ", chosen_names_.size(), " (wrapped() lists them)");
}

void CheckpointPolicy::set_enabled(const std::string& block, bool enabled) {
  for (auto& w : wrappers_) {
    if (w.first == block) {
      w.second->set_enabled(enabled);
      return;
    }
  }
  for (auto& c : by_call_) {
    if (c->name == block) {
      c->choice->enabled.store(enabled);
      return;
    }
  }
  FRUGAL_CHECK(false, "frugal: CheckpointPolicy did not choose a block named '", block,
               "'; it chose ", chosen_names_.size(), " (wrapped() lists them)");
}

}  // namespace frugal
