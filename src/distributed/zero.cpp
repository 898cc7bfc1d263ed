#include "frugal/distributed/zero.h"

#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>
#include <torch/torch.h>

#include <unordered_map>

#include "compat.h"
#include "frugal/error.h"
#include "frugal/state/archive.h"
#include "state/state_parts.h"

namespace frugal::distributed {

struct ZeroOptimizer::Layout {
  std::vector<torch::Tensor> params;
  std::vector<std::int64_t> offsets;  // where each parameter starts in the flat order
  std::vector<std::vector<std::int64_t>> shapes;
  std::unordered_map<const void*, std::size_t> index;
  std::int64_t total = 0;
  torch::Tensor flat;  // every parameter's storage: N ranges, padded (stage 3: while whole)

  /// Each parameter becomes a view of its place in `flat` (the same tensor object).
  void view_flat() {
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto numel = c10::multiply_integers(shapes[i]);
      params[i].set_data(flat.narrow(0, offsets[i], numel).view(shapes[i]));
      compat::refresh_grad_accumulator(params[i]);
    }
  }
};

struct ZeroOptimizer::Parts {
  std::shared_ptr<Layout> layout;
  std::int64_t shard_size = 0;
  torch::Tensor shard;
  std::unique_ptr<torch::optim::Optimizer> inner;
};

ZeroOptimizer::Parts ZeroOptimizer::build(std::vector<torch::Tensor> params, Group& group,
                                          const Factory& make, int stage) {
  FRUGAL_CHECK(!params.empty(), "frugal: ZeroOptimizer got no parameters");
  FRUGAL_CHECK(make != nullptr, "frugal: ZeroOptimizer needs a function that makes the optimizer");
  Parts parts;
  parts.layout = std::make_shared<Layout>();
  auto& layout = *parts.layout;
  const auto& first = params.front();
  for (auto& p : params) {
    FRUGAL_CHECK(p.scalar_type() == first.scalar_type() && p.device() == first.device(),
                 "frugal: ZeroOptimizer needs one dtype and device for all parameters; got ",
                 p.scalar_type(), " on ", p.device(), " beside ", first.scalar_type(), " on ",
                 first.device());
    FRUGAL_CHECK(layout.index.emplace(p.unsafeGetTensorImpl(), layout.params.size()).second,
                 "frugal: ZeroOptimizer got a parameter twice");
    layout.params.push_back(p);
    layout.offsets.push_back(layout.total);
    layout.shapes.push_back(p.sizes().vec());
    layout.total += p.numel();
  }
  const std::int64_t n = group.size();
  parts.shard_size = (layout.total + n - 1) / n;
  // The parameters move into one flat buffer (same tensors, new storage), so that this
  // rank's range is a view of it: the range's optimizer updates the parameters in place
  // and no second copy of the weights exists.
  torch::NoGradGuard no_grad;
  layout.flat = torch::zeros({n * parts.shard_size}, first.options().requires_grad(false));
  for (std::size_t i = 0; i < layout.params.size(); ++i) {
    const auto& p = layout.params[i];
    layout.flat.narrow(0, layout.offsets[i], p.numel()).copy_(p.detach().reshape({-1}));
  }
  layout.view_flat();
  auto range = layout.flat.narrow(0, group.rank() * parts.shard_size, parts.shard_size);
  if (stage == 3) {
    // The range outlives the flat buffer: a copy of rank 0's weights' range of its own.
    if (group.size() > 1) {
      group.broadcast(layout.flat, 0);
    }
    range = range.clone();
  }
  parts.shard = range.detach().requires_grad_(true);
  parts.inner = make({parts.shard});
  FRUGAL_CHECK(parts.inner != nullptr && parts.inner->param_groups().size() == 1 &&
                   parts.inner->param_groups()[0].params().size() == 1,
               "frugal: ZeroOptimizer's function must return an optimizer over the one tensor "
               "it is given");
  return parts;
}

ZeroOptimizer::ZeroOptimizer(std::vector<torch::Tensor> params, std::shared_ptr<Group> group,
                             Factory make, ZeroOptimizerOptions options)
    : ZeroOptimizer(build(std::move(params), *group, make, options.stage()), group, options) {
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
      options_(options),
      shard_size_(parts.shard_size),
      shard_(std::move(parts.shard)),
      inner_(std::move(parts.inner)) {
  FRUGAL_CHECK(options_.stage() >= 1 && options_.stage() <= 3,
               "frugal: ZeRO stage must be 1, 2 or 3, got ", options_.stage());
}

Traits ZeroOptimizer::traits() const {
  switch (options_.stage()) {
    case 3:
      return Trait::KeepsGradients | Trait::ShardsParameters;
    case 2:
      return Trait::KeepsGradients;
    default:
      return {};
  }
}

bool ZeroOptimizer::parameters_whole() const { return layout_->flat.defined(); }

void ZeroOptimizer::gather_parameters() {
  if (parameters_whole()) {
    return;
  }
  torch::NoGradGuard no_grad;
  c10::InferenceMode training_tensors(false);  // an evaluation's gather feeds later training
  auto& layout = *layout_;
  layout.flat = torch::empty({group_->size() * shard_size_}, shard_.options().requires_grad(false));
  all_gather_ranges(/*own_too=*/true);
  layout.view_flat();
}

void ZeroOptimizer::release_parameters() {
  if (!parameters_whole() || options_.stage() != 3) {
    return;
  }
  torch::NoGradGuard no_grad;
  for (auto& p : layout_->params) {
    p.mutable_grad().reset();
    p.set_data(torch::empty({0}, shard_.options().requires_grad(false)));
    compat::refresh_grad_accumulator(p);
  }
  layout_->flat = torch::Tensor();
}

void ZeroOptimizer::keep_gradient(const torch::Tensor& param, const torch::Tensor& grad) {
  const auto it = layout_->index.find(param.unsafeGetTensorImpl());
  FRUGAL_CHECK(it != layout_->index.end(),
               "frugal: ZeroOptimizer got the gradient of a "
               "parameter it does not hold");
  torch::NoGradGuard no_grad;
  auto& owned = shard_.mutable_grad();
  if (!owned.defined()) {
    owned = torch::zeros_like(shard_);
  }
  const auto begin = shard_begin();
  const auto offset = layout_->offsets[it->second];
  const auto lo = std::max(offset, begin);
  const auto hi = std::min(offset + param.numel(), begin + shard_size_);
  if (lo < hi) {
    owned.narrow(0, lo - begin, hi - lo).copy_(grad.reshape({-1}).narrow(0, lo - offset, hi - lo));
  }
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
  // The range's optimizer follows this one's options (an LR schedule sets them here).
  inner_->param_groups()[0].set_options(param_groups()[0].options().clone());
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
    all_gather_ranges(/*own_too=*/false);
  }
  return {};
}

void ZeroOptimizer::all_gather_ranges(bool own_too) {
  // Every rank's range into every rank's flat buffer, a piece of each range at a time.
  const std::int64_t n = group_->size();
  auto& flat = layout_->flat;
  if (n == 1) {
    if (own_too) {
      flat.copy_(shard_.detach());
    }
    return;
  }
  const std::int64_t piece = std::max<std::int64_t>(
      1, std::min(shard_size_, options_.gather_bytes() /
                                   (n * static_cast<std::int64_t>(shard_.element_size()))));
  const auto mine = shard_.detach();
  for (std::int64_t start = 0; start < shard_size_; start += piece) {
    const auto length = std::min(piece, shard_size_ - start);
    auto gathered = torch::empty({n * length}, mine.options());
    std::vector<torch::Tensor> pieces;
    for (std::int64_t r = 0; r < n; ++r) {
      pieces.push_back(gathered.narrow(0, r * length, length));
    }
    group_->all_gather(pieces, mine.narrow(0, start, length));
    for (std::int64_t r = 0; r < n; ++r) {
      if (own_too || r != group_->rank()) {
        flat.narrow(0, r * shard_size_ + start, length).copy_(pieces[r]);
      }
    }
  }
}

std::vector<torch::Tensor> ZeroOptimizer::ledger_weights() const {
  return options_.stage() == 3 ? std::vector<torch::Tensor>{shard_} : std::vector<torch::Tensor>{};
}

std::vector<torch::Tensor> ZeroOptimizer::ledger_gradients() const { return {shard_.grad()}; }

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
  if (options_.stage() == 3) {
    archive.write("zero/weights", shard_.detach());
  }
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
  torch::Tensor weights;
  if (options_.stage() == 3) {
    weights = state::read_tensor(archive, "zero/weights");
    FRUGAL_CHECK(weights.numel() == shard_size_ && weights.scalar_type() == shard_.scalar_type(),
                 "frugal: the saved ZeRO-3 weights are ", weights.numel(), " elements of ",
                 weights.scalar_type(), "; this rank's range is ", shard_size_, " of ",
                 shard_.scalar_type());
  }
  auto inner = state::read_archive(archive, "zero/inner");
  inner_->load(inner);
  if (weights.defined()) {
    torch::NoGradGuard no_grad;
    shard_.detach().copy_(weights);
    release_parameters();  // whole ones would be stale; the next step gathers the loaded ones
  }
  detail::place_state_with_parameters(*inner_);  // the shard's state beside the shard
}

}  // namespace frugal::distributed
