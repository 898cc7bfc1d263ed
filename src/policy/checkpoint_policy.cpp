#include "frugal/policy/checkpoint_policy.h"

#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

#include <algorithm>
#include <map>
#include <set>
#include <typeinfo>

#include "frugal/error.h"
#include "nn/call_choice.h"

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

bool indexed_container(const torch::nn::Module* m) {
  return dynamic_cast<const torch::nn::SequentialImpl*>(m) != nullptr ||
         dynamic_cast<const torch::nn::ModuleListImpl*>(m) != nullptr;
}

std::string joined(const std::set<std::string>& items) {
  std::string out;
  for (const auto& item : items) {
    out += (out.empty() ? "" : ", ") + item;
  }
  return out;
}

}  // namespace

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
  // Every module with its parent and its index among the parent's children.
  struct Node {
    std::string name;
    std::shared_ptr<torch::nn::Module> module;
    torch::nn::Module* parent;
    std::size_t index;
  };
  std::vector<Node> nodes;
  std::function<void(torch::nn::Module&, const std::string&)> walk =
      [&](torch::nn::Module& parent, const std::string& prefix) {
        std::size_t index = 0;
        for (const auto& item : parent.named_children()) {
          const auto name = prefix.empty() ? item.key() : prefix + "." + item.key();
          nodes.push_back({name, item.value(), &parent, index++});
          walk(*item.value(), name);
        }
      };
  walk(root, "");

  std::set<std::string> names_left(select_.names().begin(), select_.names().end());
  std::set<std::string> types_left(select_.types().begin(), select_.types().end());
  bool every_matched = false;
  std::vector<std::string> inside;  // prefixes of chosen modules: not chosen again
  for (const auto& node : nodes) {
    const bool names_hit = names_left.erase(node.name) > 0;
    bool types_hit = false;
    for (const auto& type : select_.types()) {
      if (type_matches(node.module->name(), type)) {
        types_left.erase(type);
        types_hit = true;
      }
    }
    const bool every_hit = select_.every() > 0 && indexed_container(node.parent) &&
                           (node.index + 1) % static_cast<std::size_t>(select_.every()) == 0;
    every_matched = every_matched || every_hit;
    const bool below = std::any_of(inside.begin(), inside.end(), [&](const std::string& p) {
      return node.name.compare(0, p.size() + 1, p + ".") == 0;
    });
    // A module that is a checkpoint wrapper already (this policy's own kind) is not wrapped again.
    const bool wrapper = typeid(*node.module) == typeid(nn::CheckpointImpl);
    if ((names_hit || types_hit || every_hit) && !below && !wrapper) {
      choose(node.name, node.module, node.parent, node.index);
      inside.push_back(node.name);
    }
  }
  std::set<std::string> types_present;
  for (const auto& node : nodes) {
    types_present.insert(node.module->name());
  }
  FRUGAL_CHECK(names_left.empty(), "frugal: CheckpointPolicy: no module is named ",
               joined(names_left), " (names are as in named_modules(), e.g. 'blocks.0')");
  FRUGAL_CHECK(types_left.empty(), "frugal: CheckpointPolicy: no module has the type ",
               joined(types_left), "; the model's types are ", joined(types_present));
  FRUGAL_CHECK(select_.every() == 0 || every_matched, "frugal: CheckpointPolicy: every(",
               select_.every(), ") matches no child of a Sequential or ModuleList");
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
