#include "frugal/nn/int8_weights.h"

#include <torch/torch.h>

#include <string>
#include <unordered_set>
#include <utility>

#include "compat.h"
#include "frugal/error.h"
#include "frugal/nn/unit_hook.h"
#include "memory/storage_bytes.h"
#include "optim/weight_codes.h"

namespace frugal::nn {
namespace detail {

using optim::detail::StoredWeights;

// One stored parameter of a unit.
struct StoredParam {
  torch::Tensor param;
  std::shared_ptr<StoredWeights> stored;
};

struct Int8Unit {
  const torch::nn::Module* module = nullptr;
  std::weak_ptr<torch::nn::Module> owner;
  std::vector<StoredParam> params;
  bool whole = false;
  bool counting = false;     // backward reached the unit: its gradients are awaited
  std::size_t awaiting = 0;  // ... this many of them
  std::vector<std::unique_ptr<compat::GradAccumulatedHook>> accumulated;
};

struct Int8State {
  std::vector<std::unique_ptr<Int8Unit>> units;
  int pinned = 0;  // Materialised scopes alive: units stay whole

  void materialise(Int8Unit& unit) {
    try {
      materialise_params(unit);
    } catch (...) {
      if (!unit.whole) {
        drop(unit);  // refused midway (out of memory): the parameters made whole give back
      }
      throw;
    }
    unit.whole = true;
  }

  void materialise_params(Int8Unit& unit) {
    torch::NoGradGuard no_grad;
    for (auto& [param, stored] : unit.params) {
      if (unit.whole && !stored->written) {
        continue;  // whole, and its codes unchanged since
      }
      FRUGAL_CHECK(stored->codes.scalar_type() == torch::kUInt8 &&
                       stored->qparams.scalar_type() == torch::kBFloat16,
                   "frugal: the 8-bit codes of a parameter of shape ", stored->whole.sizes(),
                   " were cast to ", stored->codes.scalar_type(),
                   " (Module::to(dtype) casts every buffer): cast the modules that are not "
                   "Int8Weights units, not the whole model");
      auto& whole = stored->whole;
      if (whole.device() != stored->codes.device()) {  // the model moved since
        whole.set_data(torch::empty(whole.sizes(), stored->codes.options().dtype(whole.dtype())));
        frugal::detail::drop_bytes(whole);
      }
      if (!frugal::detail::holds_bytes(whole)) {
        frugal::detail::take_bytes(whole);
      }
      optim::detail::dequantize_into(*stored, whole);
      stored->written = false;
      if (param.numel() != whole.numel()) {
        param.set_data(whole);
        compat::refresh_grad_accumulator(param);
      }
    }
  }

  void release(Int8Unit& unit) {
    if (!unit.whole || pinned > 0) {
      return;
    }
    drop(unit);
  }

  void drop(Int8Unit& unit) {
    torch::NoGradGuard no_grad;
    for (auto& [param, stored] : unit.params) {
      // The parameter keeps its dtype: a new one would drop its gradient hooks.
      param.set_data(torch::empty({0}, stored->whole.options()));
      compat::refresh_grad_accumulator(param);
      frugal::detail::drop_bytes(stored->whole);
    }
    unit.whole = false;
    unit.counting = false;
  }

  // Backward reached the unit (a gradient of one of its outputs is in).
  void begin_backward(Int8Unit& unit) {
    materialise(unit);
    if (unit.counting) {
      return;  // a second call of the unit: its gradients come once, summed
    }
    unit.counting = true;
    unit.awaiting = 0;
    for (const auto& p : unit.params) {
      unit.awaiting += p.param.requires_grad() ? 1 : 0;
    }
    if (unit.awaiting == 0) {
      unit.counting = false;  // nothing to wait for: whole until its next call ends
    }
  }

  void on_accumulated(Int8Unit& unit) {
    if (!unit.counting || --unit.awaiting > 0) {
      return;
    }
    unit.counting = false;
    release(unit);
  }
};

namespace {

class Int8UnitHook : public UnitHook {
 public:
  Int8UnitHook(std::weak_ptr<Int8State> state, Int8Unit* unit)
      : state_(std::move(state)), unit_(unit) {}

  void before_forward() override {
    if (auto s = state_.lock()) {
      s->materialise(*unit_);
    }
  }

  void after_forward(const std::vector<torch::Tensor>& outputs) override {
    auto s = state_.lock();
    if (s == nullptr) {
      return;
    }
    if (torch::GradMode::is_enabled()) {
      bool hooked = false;
      for (const auto& out : outputs) {
        if (out.defined() && out.requires_grad()) {
          auto weak = state_;
          auto* unit = unit_;
          // Runs when the output's gradient is in, before the unit's own backward (or its
          // checkpoint's recompute).
          const_cast<torch::Tensor&>(out).register_hook([weak, unit](const torch::Tensor&) {
            if (auto st = weak.lock()) {
              st->begin_backward(*unit);
            }
          });
          hooked = true;
        }
      }
      if (!hooked && !outputs.empty()) {
        s->release(*unit_);  // no gradient will reach it through its outputs
        return;
      }
      if (!hooked) {  // outputs it cannot see: whole until its gradients are in
        s->begin_backward(*unit_);
        return;
      }
    }
    s->release(*unit_);
  }

 private:
  std::weak_ptr<Int8State> state_;
  Int8Unit* unit_;
};

// The module of `root` (itself or a descendant) that registered each of its parameters
// directly, and the parameter's name there.
std::vector<std::pair<torch::nn::Module*, std::string>> owners(torch::nn::Module& root) {
  std::vector<std::pair<torch::nn::Module*, std::string>> out;
  std::unordered_set<const void*> seen;
  for (const auto& module : root.modules(/*include_self=*/true)) {
    for (const auto& item : module->named_parameters(/*recurse=*/false)) {
      if (seen.insert(item.value().unsafeGetTensorImpl()).second) {
        out.emplace_back(module.get(), item.key());
      }
    }
  }
  return out;
}

bool stored_kind(const torch::Tensor& p, const Int8WeightsOptions& o) {
  return p.is_floating_point() && p.dim() >= 2 && p.numel() > 0 && p.numel() >= o.min_elements();
}

}  // namespace
}  // namespace detail

DefaultDtypeGuard::DefaultDtypeGuard(torch::Dtype dtype) : before_(torch::get_default_dtype()) {
  torch::set_default_dtype(c10::scalarTypeToTypeMeta(dtype));
}

DefaultDtypeGuard::~DefaultDtypeGuard() { torch::set_default_dtype(before_); }

Int8Weights::Int8Weights(Int8WeightsOptions options)
    : options_(options), state_(std::make_shared<detail::Int8State>()) {
  FRUGAL_CHECK(options_.group() >= 1 && options_.group() <= 4096,
               "frugal: Int8WeightsOptions group must be 1 to 4096 elements, got ",
               options_.group());
  FRUGAL_CHECK(!options_.dtype() || *options_.dtype() == torch::kBFloat16 ||
                   *options_.dtype() == torch::kFloat32,
               "frugal: Int8WeightsOptions dtype must be bfloat16 or float32, got ",
               *options_.dtype());
}

Int8Weights::~Int8Weights() {
  bool room = true;
  for (auto& unit : state_->units) {
    bool alive = !unit->owner.expired();
    if (alive && room) {
      try {
        state_->materialise(*unit);
      } catch (const std::exception& e) {
        // Out of memory (a cap, say): a destructor must not throw. This unit and the rest
        // keep their codes in their buffers, which a later Int8Weights::add can take again.
        room = false;
        TORCH_WARN("frugal: ~Int8Weights could not make the weights of module '",
                   unit->module->name(), "' whole (", frugal::error_message(e),
                   "); it and the later units keep their 8-bit codes in their _codes and "
                   "_qparams buffers, and their weights hold no bytes");
      }
    }
    alive = alive && room;
    unit->accumulated.clear();
    nn::detail::remove_unit_hook(unit->module);
    for (auto& p : unit->params) {
      optim::detail::remove_stored_weights(p.param, *p.stored);
      if (alive) {  // the buffers stay registered, without bytes
        torch::NoGradGuard no_grad;
        p.stored->codes.set_data(torch::empty({0}, p.stored->codes.options()));
        p.stored->qparams.set_data(torch::empty({0, 2}, p.stored->qparams.options()));
      }
    }
  }
}

void Int8Weights::add_module(const std::shared_ptr<torch::nn::Module>& module) {
  FRUGAL_CHECK(module != nullptr, "frugal: Int8Weights::add got a null module");
  FRUGAL_CHECK(unit_hook(*module) == nullptr, "frugal: module '", module->name(),
               "' is a unit already (of an Int8Weights or a ZeroOptimizer)");
  const auto found = detail::owners(*module);
  for (const auto& [owner, name] : found) {
    const auto p = owner->named_parameters(false)[name];  // a copy: the dict is a temporary
    FRUGAL_CHECK(optim::detail::stored_weights(p) == nullptr, "frugal: parameter '", name,
                 "' of module '", module->name(), "' is stored in 8 bits already");
  }
  // The unit's dtype: the options', or its first stored matrix's.
  std::optional<torch::Dtype> unit_dtype = options_.dtype();
  for (const auto& [owner, name] : found) {
    const auto p = owner->named_parameters(false)[name];
    if (!unit_dtype && detail::stored_kind(p, options_)) {
      unit_dtype = p.scalar_type();
    }
  }
  const auto dtype = unit_dtype.value_or(torch::kFloat32);
  FRUGAL_CHECK(dtype == torch::kBFloat16 || dtype == torch::kFloat32, "frugal: module '",
               module->name(), "' has ", dtype,
               " weights; Int8Weights makes them whole in bfloat16 or float32: say which with "
               "Int8WeightsOptions::dtype");
  // Everything is checked: from here the unit changes.
  auto unit = std::make_unique<detail::Int8Unit>();
  unit->module = module.get();
  unit->owner = module;
  torch::NoGradGuard no_grad;
  for (const auto& [owner, name] : found) {
    auto p = owner->named_parameters(false)[name];
    if (!detail::stored_kind(p, options_)) {
      if (p.is_floating_point() && p.scalar_type() != dtype) {
        p.set_data(p.to(dtype));
      }
      continue;
    }
    auto stored = std::make_shared<optim::detail::StoredWeights>();
    stored->group = options_.group();
    stored->name = name;
    std::tie(stored->codes, stored->qparams) = optim::detail::quantize_weights(p, options_.group());
    stored->whole = torch::empty(p.sizes(), p.options().dtype(dtype));
    frugal::detail::drop_bytes(stored->whole);
    owner->register_buffer(name + "_codes", stored->codes);
    owner->register_buffer(name + "_qparams", stored->qparams);
    // The gradient accumulator is made while the parameter has its shape (LibTorch before
    // 2.1 keeps the one a hook holds, with the shape it was made for).
    auto* raw = unit.get();
    std::weak_ptr<detail::Int8State> weak = state_;
    if (p.requires_grad()) {
      p.set_data(stored->whole);  // the shape, without bytes
      unit->accumulated.push_back(compat::on_grad_accumulated(p, [weak, raw](const torch::Tensor&) {
        if (auto s = weak.lock()) {
          s->on_accumulated(*raw);
        }
      }));
    }
    p.set_data(torch::empty({0}, p.options().dtype(dtype)));
    compat::refresh_grad_accumulator(p);
    optim::detail::add_stored_weights(p, stored);
    unit->params.push_back({p, std::move(stored)});
  }
  nn::detail::add_unit_hook(module.get(),
                            std::make_shared<detail::Int8UnitHook>(state_, unit.get()));
  state_->units.push_back(std::move(unit));
}

std::vector<torch::Tensor> Int8Weights::storable(torch::nn::Module& unit,
                                                 const Int8WeightsOptions& options) {
  std::vector<torch::Tensor> out;
  for (const auto& [owner, name] : detail::owners(unit)) {
    auto p = owner->named_parameters(false)[name];
    if (detail::stored_kind(p, options)) {
      out.push_back(p);
    }
  }
  return out;
}

std::int64_t Int8Weights::stored_bytes(std::int64_t elements, std::int64_t group) {
  // A byte an element, and a bfloat16 zero point and scale a group.
  return elements + 4 * optim::detail::weight_groups(elements, group);
}

std::int64_t Int8Weights::stored_elements() const {
  std::int64_t n = 0;
  for (const auto& unit : state_->units) {
    for (const auto& p : unit->params) {
      n += p.stored->codes.numel();
    }
  }
  return n;
}

std::int64_t Int8Weights::stored_bytes() const {
  std::int64_t n = 0;
  for (const auto& unit : state_->units) {
    for (const auto& p : unit->params) {
      n += p.stored->codes.nbytes() + p.stored->qparams.nbytes();
    }
  }
  return n;
}

std::int64_t Int8Weights::materialised_bytes() const {
  std::int64_t n = 0;
  for (const auto& unit : state_->units) {
    for (const auto& p : unit->params) {
      n += static_cast<std::int64_t>(p.stored->whole.storage().nbytes());
    }
  }
  return n;
}

Int8Weights::Materialised::Materialised(Int8Weights& weights) : state_(weights.state_) {
  ++state_->pinned;
  try {
    for (auto& unit : state_->units) {
      state_->materialise(*unit);
    }
  } catch (...) {
    unpin();  // refused (out of memory, say): no unit stays pinned whole
    throw;
  }
}

Int8Weights::Materialised::~Materialised() { unpin(); }

void Int8Weights::Materialised::unpin() {
  if (--state_->pinned > 0) {
    return;
  }
  for (auto& unit : state_->units) {
    if (!unit->counting) {
      state_->release(*unit);
    }
  }
}

}  // namespace frugal::nn
