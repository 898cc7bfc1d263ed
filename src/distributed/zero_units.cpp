#include "zero_units.h"

#include <torch/torch.h>

#include <unordered_map>

#include "frugal/error.h"
#include "frugal/nn/unit_hook.h"

namespace frugal::distributed::detail {
namespace {

// Backward has reached unit `u` (a gradient of one of its outputs is in): its parameters
// are needed whole again, until every one of them has its gradient.
void begin_backward(ZeroLayout& layout, std::size_t u) {
  layout.backward_reached(u);
  auto& unit = layout.units[u];
  if (unit.counting) {
    return;  // a second call of the unit: its parameters' gradients come once, summed
  }
  unit.counting = true;
  unit.awaiting = 0;
  for (const auto i : unit.members) {
    unit.awaiting += layout.params[i].requires_grad() ? 1 : 0;
  }
}

void on_accumulated(ZeroLayout& layout, std::size_t i) {
  const auto u = layout.unit_of[i];
  auto& unit = layout.units[u];
  if (!unit.counting || --unit.awaiting > 0) {
    return;
  }
  unit.counting = false;
  if (!layout.pinned) {
    layout.release(u);
  }
}

class GatherUnit : public nn::UnitHook {
 public:
  GatherUnit(std::weak_ptr<ZeroLayout> layout, std::size_t unit)
      : layout_(std::move(layout)), unit_(unit) {}

  void before_forward() override { layout_.lock()->forward_reached(unit_); }

  void after_forward(const std::vector<torch::Tensor>& outputs) override {
    auto layout = layout_.lock();
    if (torch::GradMode::is_enabled()) {
      if (outputs.empty()) {
        return;  // outputs it cannot see: the unit stays whole until the step's end
      }
      for (const auto& out : outputs) {
        if (out.defined() && out.requires_grad()) {
          auto weak = layout_;
          const auto u = unit_;
          // Runs when the output's gradient is in, before the unit's own backward (or its
          // checkpoint's recomputation).
          const_cast<torch::Tensor&>(out).register_hook([weak, u](const torch::Tensor&) {
            if (auto l = weak.lock()) {
              begin_backward(*l, u);
            }
          });
        }
      }
    }
    if (!layout->pinned) {
      layout->release(unit_);
    }
  }

 private:
  std::weak_ptr<ZeroLayout> layout_;
  std::size_t unit_;
};

}  // namespace

std::vector<std::vector<std::size_t>> unit_members(
    const std::vector<torch::Tensor>& params,
    const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  std::unordered_map<const void*, std::size_t> position;
  for (std::size_t i = 0; i < params.size(); ++i) {
    position.emplace(params[i].unsafeGetTensorImpl(), i);
  }
  std::unordered_map<std::size_t, std::size_t> owner;  // position -> unit
  std::vector<std::vector<std::size_t>> members(modules.size());
  for (std::size_t u = 0; u < modules.size(); ++u) {
    FRUGAL_CHECK(modules[u] != nullptr, "frugal: ZeRO unit ", u, " is a null module");
    for (const auto& p : modules[u]->parameters()) {
      const auto found = position.find(p.unsafeGetTensorImpl());
      if (found == position.end()) {
        continue;  // not the optimizer's (frozen, or another optimizer's)
      }
      const auto [it, fresh] = owner.emplace(found->second, u);
      FRUGAL_CHECK(fresh, "frugal: ZeRO units ", it->second, " ('", modules[it->second]->name(),
                   "') and ", u, " ('", modules[u]->name(),
                   "') share a parameter; units must not overlap");
      members[u].push_back(found->second);
    }
    FRUGAL_CHECK(!members[u].empty(), "frugal: ZeRO unit ", u, " ('", modules[u]->name(),
                 "') holds none of the optimizer's parameters");
  }
  return members;
}

ZeroUnitHooks::ZeroUnitHooks(const std::shared_ptr<ZeroLayout>& layout,
                             const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  for (std::size_t u = 1; u < layout->units.size(); ++u) {
    const auto* module = modules.at(u - 1).get();
    nn::detail::add_unit_hook(module, std::make_shared<GatherUnit>(layout, u));
    modules_.push_back(module);
    for (const auto i : layout->units[u].members) {
      if (layout->params[i].requires_grad()) {
        std::weak_ptr<ZeroLayout> weak = layout;
        accumulated_.push_back(
            compat::on_grad_accumulated(layout->params[i], [weak, i](const torch::Tensor&) {
              if (auto l = weak.lock()) {
                on_accumulated(*l, i);
              }
            }));
      }
    }
  }
}

ZeroUnitHooks::~ZeroUnitHooks() {
  for (const auto* module : modules_) {
    nn::detail::remove_unit_hook(module);
  }
}

}  // namespace frugal::distributed::detail
