#include "frugal/distributed/reducer.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <map>
#include <string>
#include <utility>

#include "frugal/error.h"

namespace frugal::distributed {
namespace {

// Copies rank 0's tensors to every rank, one flat message per dtype and device.
void broadcast_all(Group& group, const std::vector<torch::Tensor>& tensors) {
  torch::NoGradGuard no_grad;
  std::map<std::pair<int, std::string>, std::vector<torch::Tensor>> kinds;
  for (const auto& t : tensors) {
    kinds[{static_cast<int>(t.scalar_type()), t.device().str()}].push_back(t.detach());
  }
  for (auto& [kind, same] : kinds) {
    std::vector<torch::Tensor> flat_views;
    for (const auto& t : same) {
      flat_views.push_back(t.reshape({-1}));
    }
    auto flat = torch::cat(flat_views);
    group.broadcast(flat, 0);
    std::int64_t offset = 0;
    for (auto& t : same) {
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

}  // namespace

BucketReducer::BucketReducer(std::shared_ptr<Group> group, ReducerOptions options,
                             torch::nn::Module& module, torch::optim::Optimizer& optimizer)
    : group_(std::move(group)), options_(options), module_(module) {
  FRUGAL_CHECK(group_ != nullptr,
               "frugal: a gradient reducer needs a process group, got a null one");
  FRUGAL_CHECK(options_.bucket_bytes() > 0,
               "frugal: a gradient reducer's bucket_bytes must be positive, got ",
               options_.bucket_bytes());
  auto* sharded = dynamic_cast<optim::ShardedOptimizer*>(&optimizer);
  keeper_ = sharded != nullptr && sharded->traits().has(Trait::KeepsGradients) ? sharded : nullptr;
  shards_ = keeper_ != nullptr && keeper_->traits().has(Trait::ShardsParameters);
  updates_ = keeper_ != nullptr && keeper_->traits().has(Trait::UpdatesSharesInBackward);
  for (auto& g : optimizer.param_groups()) {
    for (auto& p : g.params()) {
      if (p.requires_grad() && index_.emplace(p.unsafeGetTensorImpl(), params_.size()).second) {
        params_.push_back(p);
      }
    }
  }
  // Sizes of the whole parameters: under stage 3 they may be released (empty) now and when
  // their gradients travel, and gathering them here would hold the whole model at once.
  for (const auto& p : params_) {
    numel_.push_back(sharded != nullptr ? sharded->whole_numel(p) : p.numel());
  }
  // Buckets in reverse order: backward produces the last layers' gradients first.
  bucket_of_.assign(params_.size(), 0);
  std::int64_t bytes = 0;
  for (std::size_t k = params_.size(); k-- > 0;) {
    const auto& p = params_[k];
    // The bytes as sent: bfloat16 that the backend sums in float32 travels as float32.
    const std::int64_t size =
        numel_[k] *
        static_cast<std::int64_t>(c10::elementSize(group_->summed_dtype(p.scalar_type())));
    const bool fits = !buckets_.empty() && bytes + size <= options_.bucket_bytes() &&
                      params_[buckets_.back().front()].scalar_type() == p.scalar_type() &&
                      params_[buckets_.back().front()].device() == p.device();
    if (!fits) {
      buckets_.emplace_back();
      bytes = 0;
    }
    buckets_.back().push_back(k);
    bucket_of_[k] = buckets_.size() - 1;
    bytes += size;
  }
  for (const auto& members : buckets_) {
    std::int64_t numel = 0;
    for (const auto k : members) {
      numel += numel_[k];
    }
    bucket_numel_.push_back(numel);
  }
  // One flag a parameter, and a last one: this rank's loss was not finite.
  flags_ = torch::zeros({static_cast<std::int64_t>(params_.size()) + 1}, torch::kFloat);
  // Every rank starts from rank 0's weights and buffers (stage 3: the optimizer's own
  // parameters were made rank 0's when it was built, and are left as they are).
  std::vector<torch::Tensor> state;
  for (auto& p : module.parameters()) {
    if (!shards_ || index_.count(p.unsafeGetTensorImpl()) == 0) {
      state.push_back(p);
    }
  }
  for (auto& b : module.buffers()) {
    state.push_back(b);
  }
  if (group_->size() > 1 && !state.empty()) {
    broadcast_all(*group_, state);
  }
  reset();
}

void BucketReducer::reset() {
  missing_.assign(buckets_.size(), 0);
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    missing_[b] = buckets_[b].size();
  }
  next_ = 0;
  finished_ = 0;
  flags_.zero_();
  agreed_ = false;
  weight_ = 0;
  weight_on_device_ = torch::Tensor();
  agreement_ = torch::Tensor();
  flats_.clear();
  works_.clear();
}

void BucketReducer::gather_for_forward() {
  if (shards_) {
    keeper_->gather_for_forward();  // stage 3: units gather themselves when called
  }
}

void BucketReducer::begin() {
  gather_for_forward();
  begun_ = false;
  if (group_->size() == 1) {
    return;
  }
  reset();
  if (options_.broadcast_buffers()) {
    const auto buffers = module_.buffers();
    if (!buffers.empty()) {
      broadcast_all(*group_, buffers);
    }
  }
}

void BucketReducer::add(const torch::Tensor& param, const ReduceShare& share) {
  const auto it = index_.find(param.unsafeGetTensorImpl());
  if (it == index_.end()) {
    return;
  }
  if (group_->size() == 1) {
    // Nothing to average: a keeper that updates in backward gets each gradient as it is
    // final, and may update only when this step will not be skipped.
    if (updates_ && param.grad().defined()) {
      if (!begun_) {
        keeper_->begin_gradients(!share.non_finite);
        begun_ = true;
      }
      keeper_->keep_gradient(param, param.grad().reshape({-1}));
      param.mutable_grad().reset();
    }
    return;
  }
  auto& missing = missing_[bucket_of_[it->second]];
  TORCH_INTERNAL_ASSERT(missing > 0, "a gradient added twice in one step");
  --missing;
  launch_ready(share);
}

void BucketReducer::launch_ready(const ReduceShare& share) {
  // Buckets leave in one order on every rank, whatever order their gradients came in.
  while (next_ < buckets_.size() && missing_[next_] == 0) {
    launch(next_++, share);
  }
}

void BucketReducer::launch(std::size_t bucket, const ReduceShare& share) {
  if (!agreed_) {
    // The first bucket of the step: the ranks agree on the global count first, and whether
    // some rank's loss was not finite (a rank that skipped its backward for it sends its
    // buckets from finalize, so every rank learns it before any update).
    agreed_ = true;
    if (agrees_in_backward()) {
      // A keeper must know now whether this step's gradients will be used: the host waits.
      const auto sums =
          group_->sums({static_cast<double>(share.count), share.non_finite ? 1.0 : 0.0});
      global_count_ = static_cast<std::int64_t>(sums[0]);
      FRUGAL_CHECK(global_count_ > 0, "frugal: the global count over ", group_->size(),
                   " ranks is ", global_count_);
      weight_ = static_cast<double>(share.count) / static_cast<double>(global_count_);
      keeper_->begin_gradients(sums[1] == 0);
    } else {
      // The count is summed where the gradients are, and the buckets are weighted there: the
      // device waits for the sum, the host does not (it reads the count in finalize, after
      // the flags). Filled, not copied from the host: a copy would wait.
      const auto options = torch::TensorOptions(torch::kDouble).device(group_->device());
      agreement_ = torch::empty({1}, options).fill_(static_cast<double>(share.count));
      group_->all_reduce(agreement_).wait();
      weight_on_device_ =
          torch::empty({}, options).fill_(static_cast<double>(share.count)) / agreement_[0];
    }
  }
  torch::NoGradGuard no_grad;
  const auto& members = buckets_[bucket];
  const auto& first = params_[members.front()];
  // In the dtype the backend sums in, filled straight from the gradients: where that is
  // wider than theirs, no second copy of the bucket is made to send it.
  auto flat = torch::empty(
      {bucket_numel_[bucket]},
      first.options().dtype(group_->summed_dtype(first.scalar_type())).requires_grad(false));
  std::int64_t offset = 0;
  for (const auto k : members) {
    auto& grad = params_[k].mutable_grad();
    const auto n = numel_[k];
    if (grad.defined()) {
      flags_.data_ptr<float>()[k] = 1;
      flat.narrow(0, offset, n).copy_(grad.reshape({-1}));
      grad.reset();  // from now on the bucket holds it
    } else {
      flat.narrow(0, offset, n).zero_();
    }
    offset += n;
  }
  if (weight_on_device_.defined()) {
    flat.mul_(weight_on_device_);
  } else {
    flat.mul_(weight_);
  }
  works_.push_back(group_->all_reduce(flat));
  flats_.push_back(std::move(flat));
  // Under stage 2, buckets that have arrived shrink to this rank's part while backward goes on.
  // An optimizer that updates its shares in backward gets each bucket at once, waited for:
  // a unit's range is updated and its gradient freed before the next unit's backward
  // gathers that unit (at 2 ranks and width 1152 in bench_capacity, 32 MiB less at the
  // peak), at the cost of the reduction's overlap with backward's compute.
  while (keeper_ != nullptr && finished_ < works_.size() &&
         (updates_ || works_[finished_].done())) {
    finish(finished_);
  }
}

void BucketReducer::finish(std::size_t bucket) {
  works_[bucket].wait();
  torch::NoGradGuard no_grad;
  auto& flat = flats_[bucket];
  const float* any = keeper_ == nullptr ? flags_cpu_.data_ptr<float>() : nullptr;
  std::int64_t offset = 0;
  for (const auto k : buckets_[bucket]) {
    auto& p = params_[k];
    const auto n = numel_[k];
    // The averaged gradient: a view of the bucket (no second copy), or where the bucket was
    // summed in a wider dtype, the sum rounded once to the parameter's.
    auto averaged = flat.narrow(0, offset, n).to(p.scalar_type());
    if (keeper_ != nullptr) {
      keeper_->keep_gradient(p, averaged);
    } else if (any[k] > 0) {
      p.mutable_grad() = averaged.view(p.sizes());
    }
    offset += n;
  }
  flat = torch::Tensor();  // stage 2: the parts other ranks own go now
  ++finished_;
}

double BucketReducer::global_loss(double loss) {
  if (group_->size() == 1 || !options_.global_loss()) {
    return loss;
  }
  return group_->sum(loss) / static_cast<double>(group_->size());
}

ReduceResult BucketReducer::finalize(const ReduceShare& share) {
  if (group_->size() == 1) {
    return {share.count, share.non_finite};
  }
  // Gradients that were never added in this backward (earlier micro-batches only, or none on
  // this rank) leave now, in order.
  for (auto& missing : missing_) {
    missing = 0;
  }
  launch_ready(share);
  // Which parameters had a gradient on some rank: those get one (the others stay without,
  // as in one process; stage 2 steps the whole range anyway). And whether some rank's loss
  // was not finite: then every rank skips the step, as one process would.
  flags_.data_ptr<float>()[params_.size()] = share.non_finite ? 1 : 0;
  auto summed = flags_.to(group_->device());
  group_->all_reduce(summed).wait();
  flags_cpu_ = summed.to(torch::kCPU);
  if (agreement_.defined()) {  // summed on the device: read now, after the flags
    global_count_ = static_cast<std::int64_t>(agreement_.item<double>());
    agreement_ = torch::Tensor();  // every bucket has left: the weight is not needed again
    weight_on_device_ = torch::Tensor();
    FRUGAL_CHECK(global_count_ > 0, "frugal: the global count over ", group_->size(), " ranks is ",
                 global_count_);
  }
  const ReduceResult result{global_count_, flags_cpu_.data_ptr<float>()[params_.size()] > 0};
  while (finished_ < buckets_.size()) {
    finish(finished_);
  }
  reset();
  if (shards_) {
    keeper_->release_parameters();  // stage 3: each rank's share of the gradients is kept
  }
  return result;
}

Reducer::Reducer(std::shared_ptr<Group> group, ReducerOptions options)
    : group_(std::move(group)), options_(options) {
  FRUGAL_CHECK(group_ != nullptr, "frugal: distributed::Reducer needs a process group");
}

std::unique_ptr<ModelReducer> Reducer::attach(torch::nn::Module& module,
                                              torch::optim::Optimizer& optimizer) {
  return std::make_unique<BucketReducer>(group_, options_, module, optimizer);
}

}  // namespace frugal::distributed
