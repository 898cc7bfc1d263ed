#include "frugal/distributed/batch_norm.h"

#include <ATen/Context.h>
#include <ATen/core/ivalue.h>
#include <torch/autograd.h>
#include <torch/nn/init.h>
#include <torch/torch.h>

#include <vector>

#include "frugal/error.h"
#include "gather.h"

namespace frugal::distributed {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Keeps the group alive in the graph a forward recorded (an IValue capsule holds it).
struct GroupCapsule : torch::CustomClassHolder {
  explicit GroupCapsule(std::shared_ptr<Group> g) : group(std::move(g)) {}
  std::shared_ptr<Group> group;
};

// The dimensions a channel's statistics run over: all but the channel's (dim 1).
std::vector<std::int64_t> reduced_dims(const torch::Tensor& input) {
  std::vector<std::int64_t> dims{0};
  for (std::int64_t d = 2; d < input.dim(); ++d) {
    dims.push_back(d);
  }
  return dims;
}

// A per-channel vector shaped to broadcast over (N, C, ...).
torch::Tensor per_channel(const torch::Tensor& v, const torch::Tensor& input) {
  std::vector<std::int64_t> shape(static_cast<std::size_t>(input.dim()), 1);
  shape[1] = v.numel();
  return v.view(shape);
}

// Statistics in float at least (bf16 and fp16 inputs under autocast are summed in float).
torch::Tensor in_stats_type(const torch::Tensor& t) {
  return t.scalar_type() == torch::kDouble ? t : t.to(torch::kFloat);
}

struct Statistics {
  torch::Tensor mean, var;  // biased variance, as the normalization uses
  torch::Tensor count;      // values per channel over every rank (0-d, on the input's device)
};

// The whole batch's per-channel mean and variance: two passes, each one all-reduce.
Statistics global_statistics(const torch::Tensor& input, Group& group) {
  torch::NoGradGuard no_grad;
  const auto x = in_stats_type(input);
  const auto dims = reduced_dims(x);
  const auto channels = x.size(1);
  auto sums = torch::empty({channels + 1}, x.options().dtype(torch::kDouble));
  sums.narrow(0, 0, channels).copy_(x.sum(dims));
  sums[channels].fill_(static_cast<double>(x.numel() / channels));
  group.all_reduce(sums).wait();
  Statistics s;
  s.count = sums[channels];  // stays where it is: no host read a layer on a GPU
  if (x.numel() / channels <= 1) {
    // Only a rank with at most 1 value a channel can see a global count of 1 or less.
    const double count = s.count.item<double>();
    FRUGAL_CHECK(count > 1, "frugal: SyncBatchNorm needs more than 1 value per channel over the ",
                 group.size(), " ranks when training, got ", count, " (input size ", input.sizes(),
                 " on rank ", group.rank(), ")");
  }
  s.mean = (sums.narrow(0, 0, channels) / s.count).to(x.scalar_type());
  auto squares = (x - per_channel(s.mean, x)).pow(2).sum(dims).to(torch::kDouble);
  group.all_reduce(squares).wait();
  s.var = (squares / s.count).to(x.scalar_type());
  return s;
}

// An empty tensor for an undefined one: Function::apply takes defined tensors only.
torch::Tensor or_empty(const torch::Tensor& t) { return t.defined() ? t : torch::empty({0}); }
torch::Tensor undefined_if_empty(const torch::Tensor& t) {
  return t.numel() > 0 ? t : torch::Tensor();
}

// Normalizes by given statistics; backward all-reduces the gradient's two per-channel sums.
// `weight_in` and `bias_in` are empty without affine parameters.
struct SyncBatchNormFunction : torch::autograd::Function<SyncBatchNormFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input,
                               const torch::Tensor& weight_in, const torch::Tensor& bias_in,
                               const torch::Tensor& mean, const torch::Tensor& invstd,
                               const torch::Tensor& count, const std::shared_ptr<Group>& group) {
    const auto weight = undefined_if_empty(weight_in);
    const auto bias = undefined_if_empty(bias_in);
    const auto x = in_stats_type(input);
    auto scale = weight.defined() ? invstd * weight.to(invstd.scalar_type()) : invstd;
    auto shift = -mean * scale;
    if (bias.defined()) {
      shift = shift + bias.to(shift.scalar_type());
    }
    auto out = torch::addcmul(per_channel(shift, x), x, per_channel(scale, x));
    ctx->save_for_backward({input, weight_in, mean, invstd, count});
    ctx->saved_data["group"] = c10::IValue::make_capsule(c10::make_intrusive<GroupCapsule>(group));
    return out.to(input.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& input = saved[0];
    const auto weight = undefined_if_empty(saved[1]);
    const auto& mean = saved[2];
    const auto& invstd = saved[3];
    const auto& count = saved[4];
    auto capsule = ctx->saved_data["group"].toCapsule();
    auto& group = *static_cast<GroupCapsule*>(capsule.get())->group;
    const auto x = in_stats_type(input);
    const auto dims = reduced_dims(x);
    const auto dy = grads[0].to(x.scalar_type());
    const auto xmu = x - per_channel(mean, x);
    const auto channels = x.size(1);
    auto sums = torch::empty({2 * channels}, x.options());
    sums.narrow(0, 0, channels).copy_(dy.sum(dims));
    sums.narrow(0, channels, channels).copy_((dy * xmu).sum(dims));
    torch::Tensor grad_weight, grad_bias, grad_input;
    if (weight.defined() && ctx->needs_input_grad(1)) {
      grad_weight = (sums.narrow(0, channels, channels) * invstd).to(weight.scalar_type());
    }
    if (ctx->needs_input_grad(2)) {  // false for the empty placeholder of no bias
      grad_bias =
          sums.narrow(0, 0, channels).to(weight.defined() ? weight.scalar_type() : x.scalar_type());
    }
    if (ctx->needs_input_grad(0)) {  // the same on every rank: the same graph
      auto global = sums.clone();
      group.all_reduce(global).wait();
      const auto mean_dy = global.narrow(0, 0, channels) / count;
      const auto mean_dy_xmu = global.narrow(0, channels, channels) / count;
      auto scale = weight.defined() ? invstd * weight.to(invstd.scalar_type()) : invstd;
      grad_input =
          ((dy - per_channel(mean_dy, x) - xmu * per_channel(invstd * invstd * mean_dy_xmu, x)) *
           per_channel(scale, x))
              .to(input.scalar_type());
    }
    return {grad_input,      grad_weight,     grad_bias,      torch::Tensor(),
            torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

SyncBatchNormImpl::SyncBatchNormImpl(const torch::nn::BatchNormOptions& options_,
                                     std::shared_ptr<Group> group)
    : options(options_), group_(std::move(group)) {
  SyncBatchNormImpl::reset();
}

void SyncBatchNormImpl::reset() {
  const auto n = options.num_features();
  if (options.affine()) {
    weight = register_parameter("weight", torch::empty({n}));
    bias = register_parameter("bias", torch::empty({n}));
  } else {
    weight = register_parameter("weight", torch::Tensor(), /*requires_grad=*/false);
    bias = register_parameter("bias", torch::Tensor(), /*requires_grad=*/false);
  }
  if (options.track_running_stats()) {
    running_mean = register_buffer("running_mean", torch::zeros({n}));
    running_var = register_buffer("running_var", torch::ones({n}));
    num_batches_tracked =
        register_buffer("num_batches_tracked", torch::tensor(0, torch::dtype(torch::kLong)));
  } else {
    running_mean = register_buffer("running_mean", torch::Tensor());
    running_var = register_buffer("running_var", torch::Tensor());
    num_batches_tracked = register_buffer("num_batches_tracked", torch::Tensor());
  }
  reset_parameters();
}

void SyncBatchNormImpl::reset_running_stats() {
  if (options.track_running_stats()) {
    running_mean.zero_();
    running_var.fill_(1);
    num_batches_tracked.zero_();
  }
}

void SyncBatchNormImpl::reset_parameters() {
  reset_running_stats();
  if (options.affine()) {
    torch::nn::init::ones_(weight);
    torch::nn::init::zeros_(bias);
  }
}

void SyncBatchNormImpl::check_input(const torch::Tensor& input) const {
  FRUGAL_CHECK(input.dim() >= 2,
               "frugal: SyncBatchNorm expects an input of shape (N, C, ...), got ", input.dim(),
               " dimension(s) ", input.sizes());
  FRUGAL_CHECK(input.size(1) == options.num_features(), "frugal: SyncBatchNorm of ",
               options.num_features(), " features got an input of ", input.size(1),
               " channels (size ", input.sizes(), ")");
}

torch::Tensor SyncBatchNormImpl::forward(const torch::Tensor& input) {
  check_input(input);
  // What torch::nn::BatchNorm's forward does with its momentum and counter.
  double factor = options.momentum().value_or(0.0);
  if (is_training() && options.track_running_stats()) {
    num_batches_tracked += 1;
    if (!options.momentum().has_value()) {  // a cumulative average
      factor = 1.0 / num_batches_tracked.item<double>();
    }
  }
  const bool batch_stats = is_training() || !options.track_running_stats();
  if (!batch_stats || !group_ || group_->size() == 1) {
    // torch::nn::functional::batch_norm, as torch::nn::BatchNorm calls it.
    if (batch_stats) {
      FRUGAL_CHECK(input.numel() / input.size(1) != 1,
                   "Expected more than 1 value per channel when training, got input size ",
                   input.sizes());
    }
    return torch::batch_norm(input, weight, bias, running_mean, running_var, batch_stats, factor,
                             options.eps(), at::globalContext().userEnabledCuDNN());
  }
  agree_on_channels();
  const auto stats = global_statistics(input, *group_);
  if (is_training() && options.track_running_stats()) {
    torch::NoGradGuard no_grad;
    running_mean.mul_(1 - factor).add_(stats.mean.to(running_mean.scalar_type()), factor);
    const auto unbiased = stats.var * (stats.count / (stats.count - 1));
    running_var.mul_(1 - factor).add_(unbiased.to(running_var.scalar_type()), factor);
  }
  const auto invstd = (stats.var + options.eps()).rsqrt();
  return SyncBatchNormFunction::apply(input, or_empty(weight), or_empty(bias), stats.mean, invstd,
                                      stats.count, group_);
}

void SyncBatchNormImpl::agree_on_channels() {
  if (channels_agreed_) {
    return;
  }
  std::string counts;
  bool same = true;
  const auto all = detail::gather_numbers(*group_, {options.num_features()});
  for (std::size_t r = 0; r < all.size(); ++r) {
    const auto n = all[r].front();
    same = same && n == options.num_features();
    counts += (r ? ", rank " : "rank ") + std::to_string(r) + ": " + std::to_string(n);
  }
  FRUGAL_CHECK(same, "frugal: SyncBatchNorm of ", options.num_features(), " features on rank ",
               group_->rank(), " is synchronized with layers of other sizes on the other ranks (",
               counts, "); every rank must build the same model");
  channels_agreed_ = true;
}

void SyncBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "frugal::distributed::SyncBatchNorm(" << options.num_features()
         << ", eps=" << options.eps() << ", momentum=";
  if (options.momentum().has_value()) {
    stream << options.momentum().value();
  } else {
    stream << "None";
  }
  stream << ", affine=" << options.affine()
         << ", track_running_stats=" << options.track_running_stats()
         << ", ranks=" << (group_ ? group_->size() : 1) << ')';
}

std::size_t synchronize_batch_norm(torch::nn::Module& module, std::shared_ptr<Group> group) {
  std::size_t reached = 0;
  auto reach = [&](torch::nn::Module& m) {
    if (auto* bn = dynamic_cast<SyncBatchNormImpl*>(&m)) {
      bn->set_group(group);
      ++reached;
    }
  };
  reach(module);
  for (const auto& m : module.modules(/*include_self=*/false)) {
    reach(*m);
  }
  return reached;
}

}  // namespace frugal::distributed
