#include "module_select.h"

#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

#include <algorithm>
#include <functional>
#include <set>
#include <typeinfo>

#include "frugal/error.h"
#include "frugal/nn/checkpoint.h"

namespace frugal::detail {
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

std::vector<SelectedModule> select_modules(torch::nn::Module& root, const CheckpointSelect& select,
                                           const std::string& who) {
  // Every module with its parent and its index among the parent's children.
  std::vector<SelectedModule> nodes;
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

  std::set<std::string> names_left(select.names().begin(), select.names().end());
  std::set<std::string> types_left(select.types().begin(), select.types().end());
  bool every_matched = false;
  std::vector<SelectedModule> picked;
  std::vector<std::string> inside;  // prefixes of chosen modules: not chosen again
  for (const auto& node : nodes) {
    const bool names_hit = names_left.erase(node.name) > 0;
    bool types_hit = false;
    for (const auto& type : select.types()) {
      if (type_matches(node.module->name(), type)) {
        types_left.erase(type);
        types_hit = true;
      }
    }
    const bool every_hit = select.every() > 0 && indexed_container(node.parent) &&
                           (node.index + 1) % static_cast<std::size_t>(select.every()) == 0;
    every_matched = every_matched || every_hit;
    const bool below = std::any_of(inside.begin(), inside.end(), [&](const std::string& p) {
      return node.name.compare(0, p.size() + 1, p + ".") == 0;
    });
    // A checkpoint wrapper (a CheckpointPolicy's, around a Sequential's child) is no block.
    const bool wrapper = typeid(*node.module) == typeid(nn::CheckpointImpl);
    if ((names_hit || types_hit || every_hit) && !below && !wrapper) {
      picked.push_back(node);
      inside.push_back(node.name);
    }
  }
  std::set<std::string> types_present;
  for (const auto& node : nodes) {
    types_present.insert(node.module->name());
  }
  FRUGAL_CHECK(names_left.empty(), "frugal: ", who, ": no module is named ", joined(names_left),
               " (names are as in named_modules(), e.g. 'blocks.0')");
  FRUGAL_CHECK(types_left.empty(), "frugal: ", who, ": no module has the type ", joined(types_left),
               "; the model's types are ", joined(types_present));
  FRUGAL_CHECK(select.every() == 0 || every_matched, "frugal: ", who, ": every(", select.every(),
               ") matches no child of a Sequential or ModuleList");
  return picked;
}

}  // namespace frugal::detail
