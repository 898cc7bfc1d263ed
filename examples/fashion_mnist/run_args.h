// The example's settings, as its command line gives them, and what they choose: the
// optimizer and the LR schedule.
#pragma once

#include <fmt/format.h>
#include <frugal/frugal.h>
#include <torch/torch.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "main_flags.h"
#include "memory_timeline_flags.h"

namespace fashion {

struct Args {
  std::string data_dir = examples::kFashionMnistDir;
  std::string model = "cnn";
  int epochs = 1;
  std::int64_t batch = 64;
  std::int64_t micro_batch = 0;
  std::int64_t eval_batch = 1000;
  std::int64_t eval_samples = 0;
  double lr = 1e-3;
  double dropout = 0.4;
  std::string set_to_none = "on";
  std::string device = "cpu";
  std::int64_t memory_cap = 0;
  int threads = 0;
  std::uint64_t seed = 1;
  std::int64_t max_steps = 0;
  std::string report;
  std::string autocast = "off";
  std::string weights = "float32";
  std::string rounding = "stochastic";
  std::string materialise = "bf16";  // --weights int8: the dtype a layer runs in
  bool checkpoint = false;
  std::string optimizer = "adam";
  double beta1 = 0.9;
  bool factored = false;
  bool torch_optimizer = false;
  bool step_in_backward = false;
  bool quiet = false;
  std::string save_dir;
  std::int64_t save_every = 0;
  bool resume = false;
  std::string lr_schedule = "constant";
  std::int64_t warmup_steps = 0;
  bool distributed = false;
  int zero = 0;
  examples::TimelineFlags timeline;
};

// frugal's optimizer (in place), or LibTorch's own of the same name for comparison.
inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(const Args& args,
                                                               std::vector<torch::Tensor> params) {
  namespace to = torch::optim;
  // How bfloat16 weights (--weights bf16) take their updates.
  const auto in_place = frugal::optim::InPlaceOptions().seed(args.seed).rounding(
      args.rounding == "nearest"       ? frugal::optim::Rounding::Nearest
      : args.rounding == "compensated" ? frugal::optim::Rounding::Compensated
                                       : frugal::optim::Rounding::Stochastic);
  const bool adamw = args.optimizer.rfind("adamw", 0) == 0;  // adamw, adamw8bit, adamw4bit
  const bool four_bit = args.optimizer == "adam4bit" || args.optimizer == "adamw4bit";
  const bool low_bit = four_bit || args.optimizer == "adam8bit" || args.optimizer == "adamw8bit";
  if (args.factored && !low_bit) {
    throw std::invalid_argument(
        "--factored needs a low-bit optimizer (adam8bit, adamw8bit, "
        "adam4bit, adamw4bit), not " +
        args.optimizer);
  }
  const std::tuple<double, double> betas{args.beta1, 0.999};
  if (low_bit) {
    if (args.torch_optimizer) {
      throw std::invalid_argument("--torch-optimizer: LibTorch has no " + args.optimizer);
    }
    const auto states =
        (four_bit ? frugal::optim::four_bit_states() : frugal::optim::QuantizedStateOptions())
            .factored(args.factored);
    if (adamw) {
      return std::make_unique<frugal::optim::AdamW8bit>(
          std::move(params), to::AdamWOptions(args.lr).betas(betas), states, in_place);
    }
    return std::make_unique<frugal::optim::Adam8bit>(
        std::move(params), to::AdamOptions(args.lr).betas(betas), states, in_place);
  }
  if (args.optimizer == "sgd") {
    const auto options = to::SGDOptions(args.lr).momentum(0.9);
    if (args.torch_optimizer) {
      return std::make_unique<to::SGD>(std::move(params), options);
    }
    return std::make_unique<frugal::optim::SGD>(std::move(params), options, in_place);
  }
  if (adamw) {
    const auto options = to::AdamWOptions(args.lr).betas(betas);
    if (args.torch_optimizer) {
      return std::make_unique<to::AdamW>(std::move(params), options);
    }
    return std::make_unique<frugal::optim::AdamW>(std::move(params), options, in_place);
  }
  const auto options = to::AdamOptions(args.lr).betas(betas);
  if (args.torch_optimizer) {
    return std::make_unique<to::Adam>(std::move(params), options);
  }
  return std::make_unique<frugal::optim::Adam>(std::move(params), options, in_place);
}

// The schedule --lr-schedule names: linear and cosine decay to 0 at the run's last step,
// step halves the rate every epoch; all after --warmup-steps.
inline frugal::LrScheduleOptions lr_schedule(const Args& args, std::int64_t per_epoch,
                                             std::int64_t total) {
  auto options = frugal::LrScheduleOptions().warmup_steps(args.warmup_steps).total_steps(total);
  if (args.lr_schedule == "linear") {
    options.decay(frugal::LrDecay::Linear);
  } else if (args.lr_schedule == "cosine") {
    options.decay(frugal::LrDecay::Cosine);
  } else if (args.lr_schedule == "step") {
    options.decay(frugal::LrDecay::Step).step_size(per_epoch).gamma(0.5);
  }
  return options;
}

}  // namespace fashion
