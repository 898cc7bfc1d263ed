#include "frugal/distributed/zero.h"

#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>
#include <torch/torch.h>

#include "compat.h"
#include "frugal/error.h"
#include "frugal/optim/in_place.h"
#include "frugal/state/archive.h"
#include "memory/storage_bytes.h"
#include "optim/weight_codes.h"
#include "state/state_parts.h"
#include "zero_layout.h"
#include "zero_units.h"

namespace frugal::distributed {

struct ZeroOptimizer::Parts {
  std::shared_ptr<detail::ZeroLayout> layout;
  torch::Tensor shard;
  std::vector<torch::Tensor> targets;
  std::unique_ptr<torch::optim::Optimizer> inner;
};

namespace {

// int8_ranges: `range` (this rank's range of a unit, float32 or the parameters' dtype) as
// codes, and the parameter the optimizer updates them through: no bytes of its own, its
// update target a range-long tensor without bytes either.
std::pair<torch::Tensor, std::shared_ptr<optim::detail::StoredWeights>> coded_range(
    const torch::Tensor& range, std::int64_t group) {
  auto stored = std::make_shared<optim::detail::StoredWeights>();
  stored->group = group;
  std::tie(stored->codes, stored->qparams) = optim::detail::quantize_weights(range, group);
  stored->whole = torch::empty(range.sizes(), range.options());
  frugal::detail::drop_bytes(stored->whole);
  auto target = torch::empty({0}, range.options()).requires_grad_(true);
  optim::detail::add_stored_weights(target, stored);
  return {target, stored};
}

}  // namespace

ZeroOptimizer::Parts ZeroOptimizer::build(std::vector<torch::Tensor> params,
                                          const std::shared_ptr<Group>& group, const Factory& make,
                                          const ZeroOptimizerOptions& options) {
  FRUGAL_CHECK(!params.empty(), "frugal: ZeroOptimizer got no parameters");
  FRUGAL_CHECK(make != nullptr, "frugal: ZeroOptimizer needs a function that makes the optimizer");
  const int stage = options.stage();
  FRUGAL_CHECK(options.units().empty() || stage == 3, "frugal: ZeRO units need stage 3; got ",
               options.units().size(), " units at stage ", stage);
  FRUGAL_CHECK(!options.step_in_backward() || stage == 3,
               "frugal: ZeRO's step in backward needs stage 3; got stage ", stage);
  const auto& first = params.front();
  for (auto& p : params) {
    FRUGAL_CHECK(p.scalar_type() == first.scalar_type() && p.device() == first.device(),
                 "frugal: ZeroOptimizer needs one dtype and device for all parameters; got ",
                 p.scalar_type(), " on ", p.device(), " beside ", first.scalar_type(), " on ",
                 first.device());
  }
  const auto compute = options.param_dtype().value_or(first.scalar_type());
  FRUGAL_CHECK(compute == first.scalar_type() || stage == 3,
               "frugal: ZeRO's param_dtype needs stage 3; got ", compute, " at stage ", stage);
  FRUGAL_CHECK(c10::isFloatingType(compute),
               "frugal: ZeRO's param_dtype must be a floating-point dtype; got ", compute);
  FRUGAL_CHECK(!options.int8_ranges() || stage == 3,
               "frugal: ZeRO's int8_ranges needs stage 3; got stage ", stage);
  FRUGAL_CHECK(options.int8_group() > 0, "frugal: ZeRO's int8_group must be > 0 elements, got ",
               options.int8_group());
  const auto members = detail::unit_members(params, options.units());
  Parts parts;
  parts.layout = std::make_shared<detail::ZeroLayout>(std::move(params), members, group->size());
  auto& layout = *parts.layout;
  layout.group = group;
  layout.gather_bytes = options.gather_bytes();
  layout.prefetch = options.prefetch();
  // Each unit's parameters move into its flat buffer (same tensors, new storage). Stages 1
  // and 2: this rank's range is a view of it, so the range's optimizer updates the
  // parameters in place and no second copy of the weights exists.
  torch::NoGradGuard no_grad;
  const std::int64_t n = group->size();
  std::vector<torch::Tensor> shares;
  for (std::size_t u = 0; u < layout.units.size(); ++u) {
    auto& unit = layout.units[u];
    unit.flat = torch::zeros({n * unit.range}, first.options().requires_grad(false));
    for (const auto i : unit.members) {
      unit.flat.narrow(0, layout.offsets[i], layout.numels[i])
          .copy_(layout.params[i].detach().reshape({-1}));
    }
    layout.view_flat(u);
    unit.viewed = true;
    if (stage == 3 && n > 1) {
      group->broadcast(unit.flat, 0);  // every rank starts from rank 0's weights
    }
    shares.push_back(unit.flat.narrow(0, group->rank() * unit.range, unit.range));
  }
  // Stage 3: the ranges outlive the flat buffers, a tensor of their own (or their codes).
  if (options.int8_ranges()) {
    for (const auto& share : shares) {
      auto [target, stored] = coded_range(share, options.int8_group());
      parts.targets.push_back(target);
      layout.coded.push_back(stored);
    }
  } else {
    auto shard = stage == 3 ? torch::cat(shares) : shares.front();
    parts.shard = shard.detach().requires_grad_(true);
    layout.shard = parts.shard;
  }
  if (compute != first.scalar_type()) {
    // The parameters take the dtype they are gathered in now, before anything hooks them.
    for (std::size_t u = 0; u < layout.units.size(); ++u) {
      layout.units[u].flat = layout.units[u].flat.to(compute);
      layout.view_flat(u);
    }
  }
  if (options.int8_ranges()) {  // the targets are the ranges' codes, made above
  } else if (options.step_in_backward()) {
    for (const auto& unit : layout.units) {  // a unit's range is updated on its own
      parts.targets.push_back(
          parts.shard.detach().narrow(0, unit.shard_offset, unit.range).requires_grad_(true));
    }
  } else {
    parts.targets = {parts.shard};
  }
  try {  // should the optimizer be refused, the codes go unregistered
    parts.inner = make(parts.targets);
    FRUGAL_CHECK(parts.inner != nullptr && parts.inner->param_groups().size() == 1 &&
                     parts.inner->param_groups()[0].params().size() == parts.targets.size(),
                 "frugal: ZeroOptimizer's function must return an optimizer over the ",
                 parts.targets.size(), " tensor(s) it is given, in one parameter group");
    // Both update one unit's range at a time, in place (int8_ranges: in its codes).
    FRUGAL_CHECK(!(options.int8_ranges() || options.step_in_backward()) ||
                     dynamic_cast<optim::InPlaceOptimizer*>(parts.inner.get()) != nullptr,
                 "frugal: ZeRO's ",
                 options.int8_ranges() ? "int8_ranges (updated in their codes)"
                                       : "step in backward (one unit's range at a time)",
                 " needs one of frugal's optimizers (frugal::optim::SGD, Adam, AdamW, Adam8bit, "
                 "AdamW8bit); the function returned ",
                 frugal::detail::optimizer_type(*parts.inner));
  } catch (...) {
    for (std::size_t u = 0; u < layout.coded.size(); ++u) {
      optim::detail::remove_stored_weights(parts.targets[u], *layout.coded[u]);
    }
    throw;
  }
  return parts;
}

ZeroOptimizer::ZeroOptimizer(std::vector<torch::Tensor> params, std::shared_ptr<Group> group,
                             Factory make, ZeroOptimizerOptions options)
    : ZeroOptimizer(build(std::move(params), group, make, options), group, options) {
  if (layout_->units.size() > 1) {
    hooks_ = std::make_unique<detail::ZeroUnitHooks>(layout_, options_.units());
  }
  release_parameters();
}

ZeroOptimizer::ZeroOptimizer(Parts parts, std::shared_ptr<Group> group,
                             ZeroOptimizerOptions options)
    : torch::optim::Optimizer(
          {torch::optim::OptimizerParamGroup(parts.layout->params,
                                             parts.inner->param_groups()[0].options().clone())},
          parts.inner->defaults().clone()),
      layout_(std::move(parts.layout)),
      group_(std::move(group)),
      options_(std::move(options)),
      shard_size_(layout_->shard_size()),
      shard_(std::move(parts.shard)),
      targets_(std::move(parts.targets)),
      inner_(std::move(parts.inner)) {
  FRUGAL_CHECK(options_.stage() >= 1 && options_.stage() <= 3,
               "frugal: ZeRO stage must be 1, 2 or 3, got ", options_.stage());
  if (options_.step_in_backward()) {
    in_place_ = dynamic_cast<optim::InPlaceOptimizer*>(inner_.get());
  }
  if (apart()) {
    for (const auto& unit : layout_->units) {
      std::size_t needed = 0;
      for (const auto i : unit.members) {
        needed += layout_->params[i].requires_grad() ? 1 : 0;
      }
      progress_.needed.push_back(needed);
    }
    begin_gradients(false);
  }
}

ZeroOptimizer::~ZeroOptimizer() {
  for (std::size_t u = 0; u < layout_->coded.size(); ++u) {
    optim::detail::remove_stored_weights(targets_[u], *layout_->coded[u]);
  }
}

bool ZeroOptimizer::apart() const { return options_.step_in_backward() || !layout_->coded.empty(); }

Traits ZeroOptimizer::traits() const {
  switch (options_.stage()) {
    case 3: {
      Traits traits = Trait::KeepsGradients | Trait::ShardsParameters;
      if (options_.step_in_backward()) {
        traits |= Trait::UpdatesSharesInBackward;
      }
      return traits;
    }
    case 2:
      return Trait::KeepsGradients;
    default:
      return {};
  }
}

bool ZeroOptimizer::parameters_whole() const { return layout_->all_whole(); }

std::int64_t ZeroOptimizer::whole_numel(const torch::Tensor& param) const {
  const auto it = layout_->index.find(param.unsafeGetTensorImpl());
  return it == layout_->index.end() ? param.numel() : layout_->numels[it->second];
}

void ZeroOptimizer::gather_parameters() {
  if (parameters_whole()) {
    return;
  }
  layout_->pinned = true;  // units stay whole after their calls until released
  for (std::size_t u = 0; u < layout_->units.size(); ++u) {
    layout_->gather(u);
  }
}

void ZeroOptimizer::gather_for_forward() {
  layout_->begin_pass();
  if (layout_->units.size() == 1) {
    gather_parameters();
  } else {
    layout_->gather(0);
  }
}

void ZeroOptimizer::release_parameters() {
  if (options_.stage() != 3) {
    return;
  }
  layout_->pinned = false;
  for (auto& p : layout_->params) {
    p.mutable_grad().reset();
  }
  for (std::size_t u = 0; u < layout_->units.size(); ++u) {
    layout_->release(u);
  }
}

void ZeroOptimizer::keep_gradient(const torch::Tensor& param, const torch::Tensor& grad) {
  const auto& layout = *layout_;
  const auto it = layout.index.find(param.unsafeGetTensorImpl());
  FRUGAL_CHECK(it != layout.index.end(),
               "frugal: ZeroOptimizer got the gradient of a "
               "parameter it does not hold");
  torch::NoGradGuard no_grad;
  const auto u = layout.unit_of[it->second];
  const auto& unit = layout.units[u];
  // The unit's range is the shard's part, or with step_in_backward or int8_ranges a
  // parameter of its own (whose update target has the range's shape).
  auto& target = targets_[apart() ? u : 0];
  const auto at = apart() ? 0 : unit.shard_offset;
  auto& owned = target.mutable_grad();
  if (!owned.defined()) {
    owned = torch::zeros_like(optim::detail::update_target(target));
  }
  // The parameter's place in its unit, against this rank's range of that unit.
  const auto begin = group_->rank() * unit.range;
  const auto offset = layout.offsets[it->second];
  const auto lo = std::max(offset, begin);
  const auto hi = std::min(offset + layout.numels[it->second], begin + unit.range);
  if (lo < hi) {
    owned.narrow(0, at + lo - begin, hi - lo)
        .copy_(grad.reshape({-1}).narrow(0, lo - offset, hi - lo));
  }
  progress_.any = true;
  if (in_place_ != nullptr && progress_.may_update && !progress_.stepped[u] &&
      ++progress_.kept[u] == progress_.needed[u]) {
    step_unit(u);
  }
}

void ZeroOptimizer::begin_gradients(bool will_step) {
  for (auto& t : targets_) {
    t.mutable_grad().reset();  // a skipped step's
  }
  progress_.kept.assign(layout_->units.size(), 0);
  progress_.stepped.assign(layout_->units.size(), false);
  progress_.may_update = will_step && in_place_ != nullptr;
  progress_.any = false;
  if (progress_.may_update) {
    sync_inner_options();  // once for the units this backward updates
  }
}

void ZeroOptimizer::sync_inner_options() {
  // The range's optimizer follows this one's options (an LR schedule sets them here).
  inner_->param_groups()[0].set_options(param_groups()[0].options().clone());
}

void ZeroOptimizer::step_unit(std::size_t u) {
  torch::NoGradGuard no_grad;
  in_place_->step_parameter(targets_[u]);
  targets_[u].mutable_grad().reset();
  progress_.stepped[u] = true;
}

void ZeroOptimizer::gather_owned_gradient() {
  for (const auto& p : layout_->params) {
    if (p.grad().defined()) {
      keep_gradient(p, p.grad());
    }
  }
}

torch::Tensor ZeroOptimizer::step(LossClosure closure) {
  FRUGAL_CHECK(closure == nullptr, "frugal: ZeroOptimizer's step takes no closure");
  torch::NoGradGuard no_grad;
  sync_inner_options();
  if (apart()) {
    return step_rest();
  }
  if (!shard_.grad().defined()) {
    gather_owned_gradient();  // stage 1: every gradient is here, averaged
  }
  release_parameters();  // stage 3: no whole weights at the update's peak
  if (!shard_.grad().defined()) {
    return {};  // no gradient on any rank (the ranks hold the same ones)
  }
  inner_->step();  // this rank's range of the parameters, in place
  shard_.mutable_grad().reset();
  if (options_.stage() < 3) {
    layout_->all_gather(0, /*own_too=*/false);
  }
  return {};
}

torch::Tensor ZeroOptimizer::step_rest() {
  // Gradients still on the parameters (one process: those of earlier micro-batches only).
  gather_owned_gradient();
  release_parameters();
  if (progress_.any) {
    // Units not updated in backward; a unit no rank had a gradient for steps with zeros,
    // as the whole range would.
    for (std::size_t u = 0; u < targets_.size(); ++u) {
      if (!progress_.stepped[u] && !targets_[u].grad().defined()) {
        targets_[u].mutable_grad() = torch::zeros_like(optim::detail::update_target(targets_[u]));
      }
    }
    inner_->step();  // frugal's optimizers pass over parameters without a gradient
  }
  begin_gradients(false);
  return {};
}

std::vector<torch::Tensor> ZeroOptimizer::ledger_weights() const {
  if (options_.stage() != 3) {
    return {};
  }
  // The range (or its codes), and the flat buffers of units whole or arriving (a buffer the
  // parameters view is counted once).
  std::vector<torch::Tensor> out;
  if (layout_->coded.empty()) {
    out.push_back(shard_);
  }
  for (const auto& stored : layout_->coded) {
    out.push_back(stored->codes);
    out.push_back(stored->qparams);
  }
  for (std::size_t u = 0; u < layout_->units.size(); ++u) {
    if (layout_->held(u)) {
      out.push_back(layout_->units[u].flat);
    }
  }
  return out;
}

std::vector<torch::Tensor> ZeroOptimizer::ledger_gradients() const {
  std::vector<torch::Tensor> out;
  for (const auto& t : targets_) {
    out.push_back(t.grad());
  }
  return out;
}

std::vector<torch::Tensor> ZeroOptimizer::ledger_optimizer_state() const {
  std::vector<torch::Tensor> out;
  for (const auto& entry : inner_->state()) {
    for (auto& t : optimizer_state_tensors(*entry.second)) {
      out.push_back(std::move(t));
    }
  }
  return out;
}

void ZeroOptimizer::save(torch::serialize::OutputArchive& archive) const {
  state::write_int(archive, "zero/rank", group_->rank());
  state::write_int(archive, "zero/ranks", group_->size());
  state::write_int(archive, "zero/elements", layout_->total);
  if (!layout_->coded.empty()) {
    std::vector<torch::Tensor> codes, qparams;
    for (const auto& stored : layout_->coded) {
      codes.push_back(stored->codes);
      qparams.push_back(stored->qparams);
    }
    archive.write("zero/codes", torch::cat(codes));
    archive.write("zero/qparams", torch::cat(qparams));
  } else if (options_.stage() == 3) {
    archive.write("zero/weights", shard_.detach());
  }
  archive.write("zero/inner_type", c10::IValue(frugal::detail::optimizer_type(*inner_)));
  torch::serialize::OutputArchive inner;
  inner_->save(inner);
  archive.write("zero/inner", inner);
}

void ZeroOptimizer::load(torch::serialize::InputArchive& archive) {
  const auto rank = state::read_int(archive, "zero/rank");
  const auto ranks = state::read_int(archive, "zero/ranks");
  const auto elements = state::read_int(archive, "zero/elements");
  FRUGAL_CHECK(ranks == group_->size() && rank == group_->rank() && elements == layout_->total,
               "frugal: the saved ZeRO state is rank ", rank, " of ", ranks, "'s shard of ",
               elements, " elements; this is rank ", group_->rank(), " of ", group_->size(),
               " with ", layout_->total, " elements");
  torch::Tensor weights, codes, qparams;
  if (!layout_->coded.empty()) {
    std::int64_t code_count = 0, groups = 0;
    for (const auto& stored : layout_->coded) {
      code_count += stored->codes.numel();
      groups += stored->qparams.size(0);
    }
    codes = state::read_tensor(archive, "zero/codes");
    qparams = state::read_tensor(archive, "zero/qparams");
    FRUGAL_CHECK(codes.numel() == code_count && codes.scalar_type() == torch::kByte &&
                     qparams.dim() == 2 && qparams.size(0) == groups &&
                     qparams.scalar_type() == torch::kBFloat16,
                 "frugal: the saved ZeRO-3 codes are ", codes.numel(), " of ", codes.scalar_type(),
                 " with ", qparams.sizes(),
                 " statistics; this rank's "
                 "ranges are ",
                 code_count, " codes in ", groups,
                 " groups (int8_ranges with "
                 "int8_group ",
                 options_.int8_group(), ")");
  } else if (options_.stage() == 3) {
    weights = state::read_tensor(archive, "zero/weights");
    FRUGAL_CHECK(weights.numel() == shard_size_ && weights.scalar_type() == shard_.scalar_type(),
                 "frugal: the saved ZeRO-3 weights are ", weights.numel(), " elements of ",
                 weights.scalar_type(), "; this rank's range is ", shard_size_, " of ",
                 shard_.scalar_type());
  }
  // Another optimizer's state would fail inside LibTorch's load with an internal assertion.
  c10::IValue saved_type;  // absent from the files of earlier releases
  const auto inner_type = frugal::detail::optimizer_type(*inner_);
  FRUGAL_CHECK(!archive.try_read("zero/inner_type", saved_type) || !saved_type.isString() ||
                   saved_type.toStringRef() == inner_type,
               "frugal: the saved ZeRO state is of the optimizer ",
               saved_type.isString() ? saved_type.toStringRef() : std::string(),
               " over each shard; this ZeroOptimizer's function makes ", inner_type,
               ": build it with the optimizer that saved the state");
  auto inner = state::read_archive(archive, "zero/inner");
  inner_->load(inner);
  if (weights.defined()) {
    torch::NoGradGuard no_grad;
    shard_.detach().copy_(weights);
    release_parameters();  // whole ones would be stale; the next step gathers the loaded ones
  }
  if (codes.defined()) {
    torch::NoGradGuard no_grad;
    std::int64_t at = 0, group_at = 0;
    for (const auto& stored : layout_->coded) {
      stored->codes.copy_(codes.narrow(0, at, stored->codes.numel()));
      stored->qparams.copy_(qparams.narrow(0, group_at, stored->qparams.size(0)));
      at += stored->codes.numel();
      group_at += stored->qparams.size(0);
    }
    release_parameters();
  }
  frugal::detail::place_state_with_parameters(*inner_);  // the shard's state beside the shard
}

}  // namespace frugal::distributed
