#include "frugal/nn/lora.h"

#include <torch/torch.h>

#include <cmath>
#include <unordered_map>

#include "frugal/error.h"
#include "nn/lora_state.h"

namespace frugal::nn {
namespace detail {
namespace {

// W + s B A in the base's dtype: recorded by autograd when gradients are, so A and B get
// theirs. The same expression refills a folded weight in backward, bit for bit.
torch::Tensor folded_weight(const LoraLayer& layer, const torch::Tensor& base, double scaling) {
  const auto delta = layer.b->weight.mm(layer.a->weight).mul(scaling);
  return base.add(delta.to(base.scalar_type()));
}

// A layer's adapters on its own input, as PEFT computes them when lora_dropout is set:
// out + s B A dropout(x), in the adapters' dtype, returned in the output's. The layer's
// frugal::nn::call runs it; the weight its unit made for the run is the member only then.
class LoraDropoutHook : public UnitHook {
 public:
  LoraDropoutHook(std::weak_ptr<LoraState> state, LoraLayer* layer)
      : state_(std::move(state)), layer_(layer) {}
  void before_forward() override {}
  void after_forward(const std::vector<torch::Tensor>& /*outputs*/) override {}
  void enter_run() override {
    // Outside its unit's run there is no weight: the call fails loudly.
    const auto& slot = *layer_->slot;
    slot.linear->weight = slot.current.defined() ? slot.current : slot.no_weight();
  }
  void leave_run() override { layer_->slot->linear->weight = layer_->slot->no_weight(); }
  torch::Tensor run_output(const torch::Tensor& in, const torch::Tensor& out) override {
    const auto s = state_.lock();
    if (s == nullptr || s->merged) {
      return out;
    }
    const auto x = torch::dropout(in.to(layer_->a->weight.scalar_type()), s->dropout,
                                  layer_->slot->linear->is_training());
    return out.add(layer_->b->forward(layer_->a->forward(x)).mul(s->scaling)).to(out.scalar_type());
  }

 private:
  std::weak_ptr<LoraState> state_;
  LoraLayer* layer_;
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
  FRUGAL_CHECK(std::isfinite(options_.alpha()) && options_.alpha() > 0,
               "frugal: LoraOptions alpha must be a finite number > 0, got ", options_.alpha());
  FRUGAL_CHECK(options_.dropout() >= 0 && options_.dropout() < 1,
               "frugal: LoraOptions dropout must be in [0, 1), got ", options_.dropout());
  state_->scaling = scaling();
  state_->dropout = options_.dropout();
  const bool own_calls = options_.dropout() > 0;
  // Which unit holds each module.
  std::unordered_map<const torch::nn::Module*, std::size_t> unit_of;
  for (std::size_t u = 0; u < units.size(); ++u) {
    FRUGAL_CHECK(units[u] != nullptr, "frugal: Lora got a null unit (", u, ")");
    detail::check_weights_unit(*units[u]);
    for (const auto& m : units[u]->modules(/*include_self=*/true)) {
      FRUGAL_CHECK(unit_of.emplace(m.get(), u).second, "frugal: Lora units ", unit_of[m.get()],
                   " and ", u, " share module '", m->name(), "'");
    }
  }
  // The layers to adapt, checked before anything changes.
  std::vector<std::pair<std::string, torch::nn::LinearImpl*>> chosen;
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
    FRUGAL_CHECK(
        !own_calls || (unit_hook(*linear) == nullptr && units[unit_of.at(linear)].get() != linear),
        "frugal: layer '", item.key(),
        "' is a unit itself; with dropout its adapters run around its own "
        "frugal::nn::call, inside a unit that holds it: make that block the unit");
    chosen.emplace_back(item.key(), linear);
  }
  FRUGAL_CHECK(!chosen.empty(), "frugal: LoraOptions target_modules ",
               c10::Join(", ", options_.target_modules()), " match no Linear layer of the model");
  // From here the model changes.
  for (const auto& p : model.parameters()) {
    state_->trainable.emplace_back(p, p.requires_grad());
    p.set_requires_grad(false);
  }
  std::vector<std::shared_ptr<detail::UnitWeightsHook>> hooks(units.size());
  for (const auto& [name, linear] : chosen) {
    auto layer = std::make_unique<detail::LoraLayer>();
    layer->name = name;
    const auto in = linear->options.in_features();
    const auto out = linear->options.out_features();
    const auto opts = torch::TensorOptions().dtype(torch::kFloat).device(linear->weight.device());
    layer->a = torch::nn::Linear(torch::nn::LinearOptions(in, options_.rank()).bias(false));
    layer->b = torch::nn::Linear(torch::nn::LinearOptions(options_.rank(), out).bias(false));
    {
      torch::NoGradGuard no_grad;
      layer->a->weight.set_data(torch::empty({options_.rank(), in}, opts));
      torch::nn::init::kaiming_uniform_(layer->a->weight, std::sqrt(5.0));  // PEFT's init
      layer->b->weight.set_data(torch::zeros({out, options_.rank()}, opts));
    }
    linear->register_module("lora_A", layer->a);
    linear->register_module("lora_B", layer->b);
    const auto u = unit_of.at(linear);
    if (hooks[u] == nullptr) {
      state_->units.push_back(detail::unit_weights(units[u]));
      hooks[u] = state_->units.back().hook;
    }
    layer->slot = &hooks[u]->slot(linear);
    std::weak_ptr<detail::LoraState> weak = state_;
    auto* raw = layer.get();
    if (own_calls) {
      // The base alone in the unit; the adapters at the layer's own call.
      layer->slot->adapt = [](const torch::Tensor& base) { return base; };
      layer->slot->own_call = true;
      layer->own_hook = std::make_shared<detail::LoraDropoutHook>(weak, raw);
      detail::add_unit_hook(linear, layer->own_hook);
    } else {
      layer->slot->adapt = [weak, raw](const torch::Tensor& base) {
        const auto s = weak.lock();
        return s == nullptr || s->merged ? base : detail::folded_weight(*raw, base, s->scaling);
      };
    }
    state_->layers.push_back(std::move(layer));
  }
  for (auto& hook : hooks) {
    if (hook != nullptr) {
      hook->leave_run();  // the members as between runs: adapted layers read only inside
    }
  }
}

Lora::~Lora() {
  if (state_->merged) {
    unmerge();  // puts back the weights kept aside: nothing to allocate
  }
  for (auto& layer : state_->layers) {
    if (layer->own_hook != nullptr) {
      detail::remove_unit_hook(layer->slot->linear);
      layer->slot->own_call = false;
    }
    layer->slot->adapt = nullptr;
    layer->slot->linear->unregister_module("lora_A");
    layer->slot->linear->unregister_module("lora_B");
  }
  for (const auto& unit : state_->units) {
    detail::release_unit_weights(unit);
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
  for (const auto& layer : state_->layers) {
    FRUGAL_CHECK(!layer->slot->stored, "frugal: Lora::merge: layer '", layer->name,
                 "' has its base in a FrozenWeights store, where the sum would be rounded to its "
                 "codes; merge into a base kept in its own dtype");
  }
  torch::NoGradGuard no_grad;
  for (auto& layer : state_->layers) {
    auto& base = layer->slot->param;
    auto merged = detail::folded_weight(*layer, base, state_->scaling);
    layer->unmerged = base.data();  // the same bytes, kept
    base.set_data(merged);
  }
  state_->merged = true;
}

void Lora::unmerge() {
  if (!state_->merged) {
    return;
  }
  torch::NoGradGuard no_grad;
  for (auto& layer : state_->layers) {
    layer->slot->param.set_data(layer->unmerged);
    layer->unmerged = torch::Tensor();
  }
  state_->merged = false;
}

bool Lora::merged() const { return state_->merged; }

}  // namespace frugal::nn
