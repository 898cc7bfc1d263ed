#include "frugal/nn/lora.h"

#include <torch/torch.h>

#include <cmath>
#include <map>
#include <unordered_map>
#include <unordered_set>

#include "frugal/error.h"
#include "frugal/nn/unit_hook.h"
#include "memory/storage_bytes.h"
#include "nn/lora_state.h"

namespace frugal::nn {
namespace detail {
namespace {

// W + s B A in the base's dtype: recorded by autograd when gradients are, so A and B get
// theirs. The same expression refills a folded weight in backward, bit for bit.
torch::Tensor folded_weight(const LoraLayer& layer, double scaling) {
  const auto delta = layer.b->weight.mm(layer.a->weight).mul(scaling);
  return layer.base.add(delta.to(layer.base.scalar_type()));
}

class LoraUnitHook : public UnitHook {
 public:
  LoraUnitHook(std::weak_ptr<LoraState> state, LoraUnit* unit)
      : state_(std::move(state)), unit_(unit) {}

  void before_forward() override {
    unit_->folded.clear();  // a call that threw left its weights
    unit_->in_call = true;
  }

  void enter_run() override {
    auto s = state_.lock();
    if (s == nullptr) {
      return;
    }
    for (auto* layer : unit_->layers) {
      if (s->merged) {
        layer->linear->weight = layer->base;
        continue;
      }
      auto w = folded_weight(*layer, s->scaling);
      layer->linear->weight = w;
      if (unit_->in_call) {  // a recompute's weights go with its graph
        unit_->folded.emplace_back(layer, std::move(w));
      }
    }
  }

  void leave_run() override {
    for (auto* layer : unit_->layers) {
      layer->linear->weight = torch::empty({0}, layer->base.options());
    }
  }

  void after_forward(const std::vector<torch::Tensor>& outputs) override {
    unit_->in_call = false;
    auto s = state_.lock();
    auto recorded = std::make_shared<std::vector<std::pair<LoraLayer*, torch::Tensor>>>();
    for (auto& item : unit_->folded) {
      if (item.second.requires_grad()) {  // autograd holds it for the layer's backward
        recorded->push_back(std::move(item));
      }
    }
    unit_->folded.clear();
    std::vector<torch::Tensor> reach;
    for (const auto& out : outputs) {
      if (out.defined() && out.requires_grad()) {
        reach.push_back(out);
      }
    }
    if (s == nullptr || recorded->empty() || reach.empty()) {
      return;  // no backward reads them through this call's outputs
    }
    // The folded weights give their bytes back until backward reaches the unit.
    for (const auto& item : *recorded) {
      frugal::detail::drop_bytes(item.second);
    }
    for (auto& out : reach) {
      out.register_hook([weak = state_, recorded](const torch::Tensor&) {
        auto st = weak.lock();
        if (st == nullptr || recorded->empty()) {
          return;
        }
        torch::NoGradGuard no_grad;
        for (auto& [layer, w] : *recorded) {
          frugal::detail::take_bytes(w);
          // Written through an alias of its own version counter: autograd saved `w` at
          // version 0 and reads it so.
          auto alias = torch::empty({0}, w.options());
          alias.set_(w.storage(), w.storage_offset(), w.sizes(), w.strides());
          alias.copy_(folded_weight(*layer, st->scaling));
        }
        recorded->clear();  // the graph holds them now; they go with its nodes
      });
    }
  }

 private:
  std::weak_ptr<LoraState> state_;
  LoraUnit* unit_;
};

bool targeted(const std::string& name, const std::vector<std::string>& targets) {
  if (targets.empty()) {
    return true;
  }
  for (const auto& t : targets) {
    if (name == t || (name.size() > t.size() && name[name.size() - t.size() - 1] == '.' &&
                      name.compare(name.size() - t.size(), t.size(), t) == 0)) {
      return true;
    }
  }
  return false;
}

}  // namespace
}  // namespace detail

Lora::Lora(torch::nn::Module& model, const std::vector<std::shared_ptr<torch::nn::Module>>& units,
           LoraOptions options)
    : options_(std::move(options)), state_(std::make_shared<detail::LoraState>()) {
  FRUGAL_CHECK(options_.rank() >= 1, "frugal: LoraOptions rank must be >= 1, got ",
               options_.rank());
  FRUGAL_CHECK(options_.dropout() == 0, "frugal: LoraOptions dropout must be 0, got ",
               options_.dropout(),
               ": the adapters are folded into each layer's weight while its unit runs, which "
               "leaves no place for a mask on the adapters' input");
  state_->scaling = scaling();
  // Which unit holds each module.
  std::unordered_map<const torch::nn::Module*, std::size_t> unit_of;
  for (std::size_t u = 0; u < units.size(); ++u) {
    FRUGAL_CHECK(units[u] != nullptr, "frugal: Lora got a null unit (", u, ")");
    FRUGAL_CHECK(unit_hook(*units[u]) == nullptr, "frugal: module '", units[u]->name(),
                 "' is a unit already (of an Int8Weights, a ZeroOptimizer or a Lora)");
    for (const auto& m : units[u]->modules(/*include_self=*/true)) {
      FRUGAL_CHECK(unit_of.emplace(m.get(), u).second, "frugal: Lora units ", unit_of[m.get()],
                   " and ", u, " share module '", m->name(), "'");
    }
  }
  // The layers to adapt, checked before anything changes.
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> chosen;
  for (const auto& item : model.named_modules()) {
    auto* linear = dynamic_cast<torch::nn::LinearImpl*>(item.value().get());
    if (linear == nullptr) {
      continue;
    }
    FRUGAL_CHECK(!linear->named_children().contains("lora_A"), "frugal: layer '", item.key(),
                 "' has LoRA adapters already");
    if (!detail::targeted(item.key(), options_.target_modules())) {
      continue;
    }
    FRUGAL_CHECK(unit_of.count(linear) == 1, "frugal: layer '", item.key(),
                 "' is chosen for LoRA but lies in none of the units: the adapters reach a "
                 "layer through the frugal::nn::call of a unit that holds it");
    chosen.emplace_back(item.key(), item.value());
  }
  FRUGAL_CHECK(!chosen.empty(), "frugal: LoraOptions target_modules ",
               c10::Join(", ", options_.target_modules()), " match no Linear layer of the model");
  // From here the model changes.
  for (const auto& p : model.parameters()) {
    state_->trainable.emplace_back(p, p.requires_grad());
    p.set_requires_grad(false);
  }
  std::vector<detail::LoraUnit*> unit_states(units.size(), nullptr);
  for (const auto& [name, module] : chosen) {
    auto layer = std::make_unique<detail::LoraLayer>();
    layer->name = name;
    layer->linear = dynamic_cast<torch::nn::LinearImpl*>(module.get());
    layer->base = layer->linear->weight;
    const auto in = layer->base.size(1);
    const auto out = layer->base.size(0);
    const auto opts = torch::TensorOptions().dtype(torch::kFloat).device(layer->base.device());
    layer->a = torch::nn::Linear(torch::nn::LinearOptions(in, options_.rank()).bias(false));
    layer->b = torch::nn::Linear(torch::nn::LinearOptions(options_.rank(), out).bias(false));
    {
      torch::NoGradGuard no_grad;
      layer->a->weight.set_data(torch::empty({options_.rank(), in}, opts));
      torch::nn::init::kaiming_uniform_(layer->a->weight, std::sqrt(5.0));  // PEFT's init
      layer->b->weight.set_data(torch::zeros({out, options_.rank()}, opts));
    }
    module->register_module("lora_A", layer->a);
    module->register_module("lora_B", layer->b);
    layer->linear->weight = torch::empty({0}, layer->base.options());
    const auto u = unit_of.at(module.get());
    if (unit_states[u] == nullptr) {
      state_->units.push_back(std::make_unique<detail::LoraUnit>());
      unit_states[u] = state_->units.back().get();
      unit_states[u]->module = units[u].get();
    }
    unit_states[u]->layers.push_back(layer.get());
    state_->layers.push_back(std::move(layer));
  }
  for (auto& unit : state_->units) {
    nn::detail::add_unit_hook(unit->module,
                              std::make_shared<detail::LoraUnitHook>(state_, unit.get()));
  }
}

Lora::~Lora() {
  if (state_->merged) {
    unmerge();
  }
  for (auto& unit : state_->units) {
    nn::detail::remove_unit_hook(unit->module);
  }
  for (auto& layer : state_->layers) {
    layer->linear->weight = layer->base;
    layer->linear->unregister_module("lora_A");
    layer->linear->unregister_module("lora_B");
  }
  for (auto& [p, trainable] : state_->trainable) {
    p.set_requires_grad(trainable);
  }
}

double Lora::scaling() const {
  const auto r = static_cast<double>(options_.rank());
  return options_.alpha() / (options_.use_rslora() ? std::sqrt(r) : r);
}

std::vector<torch::Tensor> Lora::parameters() const {
  std::vector<torch::Tensor> out;
  for (const auto& layer : state_->layers) {
    out.push_back(layer->a->weight);
    out.push_back(layer->b->weight);
  }
  return out;
}

std::vector<std::string> Lora::adapted() const {
  std::vector<std::string> out;
  for (const auto& layer : state_->layers) {
    out.push_back(layer->name);
  }
  return out;
}

void Lora::merge() {
  if (state_->merged) {
    return;
  }
  torch::NoGradGuard no_grad;
  for (auto& layer : state_->layers) {
    auto merged = detail::folded_weight(*layer, state_->scaling);
    layer->unmerged = layer->base.data();  // the same bytes, kept
    layer->base.set_data(merged);
  }
  state_->merged = true;
}

void Lora::unmerge() {
  if (!state_->merged) {
    return;
  }
  torch::NoGradGuard no_grad;
  for (auto& layer : state_->layers) {
    layer->base.set_data(layer->unmerged);
    layer->unmerged = torch::Tensor();
  }
  state_->merged = false;
}

bool Lora::merged() const { return state_->merged; }

}  // namespace frugal::nn
