#include "frugal/nn/frozen_weights.h"

#include <torch/torch.h>

#include <map>

#include "frugal/error.h"
#include "nn/nf4.h"
#include "nn/unit_weights.h"
#include "optim/weight_codes.h"

namespace frugal::nn {
namespace detail {

struct FrozenLayer {
  LinearSlot* slot = nullptr;
  std::vector<std::int64_t> shape;
  std::vector<torch::Tensor> buffers;  // the codes and statistics, as registered
  std::string name;                    // the weight's, as the unit names it
  torch::Dtype dtype = torch::kFloat;  // what it is made whole in
};

struct FrozenState {
  std::vector<WeightsUnit> units;
  std::vector<std::unique_ptr<FrozenLayer>> layers;
};

namespace {

// The weight made whole from the layer's buffers (read each time: a state dict loaded into
// them, or a move to another device, is what the next run sees).
torch::Tensor materialise(const FrozenLayer& layer, const FrozenWeightsOptions& o) {
  const auto& b = layer.buffers;
  if (o.format() == FrozenFormat::NF4) {
    Nf4Tensor q;
    q.shape = layer.shape;
    q.packed = b[0];
    q.qabsmax = b[1];
    q.absmax2 = b[2];
    q.offset = b[3];
    q.name = layer.name;
    return nf4_dequantize(q, layer.dtype);
  }
  optim::detail::StoredWeights stored;
  stored.codes = b[0];
  stored.qparams = b[1];
  stored.group = o.group();
  stored.name = layer.name;
  auto out = torch::empty(layer.shape, b[0].options().dtype(layer.dtype));
  optim::detail::dequantize_into(stored, out);
  return out;
}

std::vector<std::pair<std::string, torch::Tensor>> encode(const torch::Tensor& w,
                                                          const FrozenWeightsOptions& o) {
  if (o.format() == FrozenFormat::NF4) {
    auto q = nf4_quantize(w);
    return {{"weight_nf4", q.packed.to(w.device())},
            {"weight_nf4_absmax", q.qabsmax.to(w.device())},
            {"weight_nf4_absmax2", q.absmax2.to(w.device())},
            {"weight_nf4_offset", q.offset.to(w.device())}};
  }
  auto [codes, qparams] = optim::detail::quantize_weights(w, o.group());
  return {{"weight_codes", codes}, {"weight_qparams", qparams}};
}

}  // namespace
}  // namespace detail

FrozenWeights::FrozenWeights(FrozenWeightsOptions options)
    : options_(options), state_(std::make_shared<detail::FrozenState>()) {
  FRUGAL_CHECK(!options_.dtype() || *options_.dtype() == torch::kBFloat16 ||
                   *options_.dtype() == torch::kFloat,
               "frugal: FrozenWeightsOptions dtype must be bfloat16 or float32, got ",
               *options_.dtype());
  FRUGAL_CHECK(options_.group() >= 1 && options_.group() <= 4096,
               "frugal: FrozenWeightsOptions group must be 1 to 4096 elements, got ",
               options_.group());
}

FrozenWeights::~FrozenWeights() {
  torch::NoGradGuard no_grad;
  bool room = true;
  for (auto& layer : state_->layers) {
    if (room) {
      try {
        layer->slot->param.set_data(detail::materialise(*layer, options_));
        for (auto& b : layer->buffers) {
          b.set_data(torch::empty({0}, b.options()));
        }
      } catch (const std::exception&) {
        room = false;  // out of memory: this weight and the rest keep their codes, not bytes
      }
    }
    layer->slot->stored = nullptr;
  }
  for (const auto& unit : state_->units) {
    detail::release_unit_weights(unit);
  }
}

void FrozenWeights::add_module(const std::shared_ptr<torch::nn::Module>& unit) {
  FRUGAL_CHECK(unit != nullptr, "frugal: FrozenWeights::add got a null module");
  for (const auto& stored : state_->units) {
    FRUGAL_CHECK(stored.module != unit, "frugal: module '", unit->name(), "' is stored already");
  }
  std::vector<torch::nn::LinearImpl*> linears;
  std::map<const torch::nn::Module*, std::string> names;
  for (const auto& item : unit->named_modules()) {
    names[item.value().get()] = item.key();
  }
  for (const auto& m : unit->modules(/*include_self=*/true)) {
    auto* linear = dynamic_cast<torch::nn::LinearImpl*>(m.get());
    if (linear == nullptr) {
      continue;
    }
    FRUGAL_CHECK(!linear->named_buffers(false).contains("weight_nf4") &&
                     !linear->named_buffers(false).contains("weight_codes"),
                 "frugal: a Linear of module '", unit->name(), "' is stored already");
    if (linear->named_parameters(false)["weight"].numel() > 0) {
      linears.push_back(linear);
    }
  }
  // The unit's dtype: the options', or its first Linear weight's.
  const auto dtype = options_.dtype().value_or(
      linears.empty() ? torch::kFloat
                      : linears.front()->named_parameters(false)["weight"].scalar_type());
  FRUGAL_CHECK(dtype == torch::kBFloat16 || dtype == torch::kFloat, "frugal: module '",
               unit->name(), "' has ", dtype,
               " weights; FrozenWeights makes them whole in bfloat16 or float32: say which with "
               "FrozenWeightsOptions::dtype");
  auto weights = detail::unit_weights(unit);  // an error for another kind of unit
  auto& hook = weights.hook;
  // From here the unit changes.
  torch::NoGradGuard no_grad;
  for (auto* linear : linears) {
    auto layer = std::make_unique<detail::FrozenLayer>();
    layer->slot = &hook->slot(linear);
    auto weight = layer->slot->param;
    layer->shape = weight.sizes().vec();
    layer->name = names.count(linear) ? names[linear] + ".weight" : "weight";
    layer->dtype = dtype;
    for (auto& [name, tensor] : detail::encode(weight, options_)) {
      layer->buffers.push_back(linear->register_buffer(name, tensor));
    }
    weight.set_data(torch::empty({0}, weight.options().dtype(dtype)));
    const auto* raw = layer.get();
    const auto options = options_;
    layer->slot->stored = [raw, options] { return detail::materialise(*raw, options); };
    state_->layers.push_back(std::move(layer));
  }
  hook->leave_run();  // the members as between runs: the stored weights read only inside
  for (auto& p : unit->parameters()) {
    p.set_requires_grad(false);
    if (p.is_floating_point() && p.numel() > 0 && p.scalar_type() != dtype) {
      p.set_data(p.to(dtype));
    }
  }
  state_->units.push_back(std::move(weights));
}

std::int64_t FrozenWeights::stored_elements() const {
  std::int64_t n = 0;
  for (const auto& layer : state_->layers) {
    n += c10::multiply_integers(layer->shape);
  }
  return n;
}

std::int64_t FrozenWeights::stored_bytes() const {
  std::int64_t n = 0;
  for (const auto& layer : state_->layers) {
    for (const auto& b : layer->buffers) {
      n += static_cast<std::int64_t>(b.nbytes());
    }
  }
  return n;
}

}  // namespace frugal::nn
