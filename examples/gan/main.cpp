// A DCGAN on Fashion-MNIST: two models and two optimizers in one frugal::Loop, the
// generator run once per iteration, BatchNorm in both, the discriminator's blocks
// optionally checkpointed, bf16 autocast or fp16 with one loss scaler over both optimizers,
// 8-bit Adam states, and a memory report per iteration. --hand runs the same iterations as
// a plain LibTorch loop, for comparison; --distributed splits every batch over the ranks
// torchrun started (gradients averaged, BatchNorm synchronized), as one process would train.
//
//   gan --data-dir /usr/share/datasets/fashion-mnist --iterations 200 --checkpoint
#include <fmt/format.h>
#include <frugal/distributed.h>
#include <frugal/frugal.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include "device.h"
#include "main_flags.h"
#include "memory_timeline_flags.h"

namespace {

namespace F = torch::nn::functional;

struct Args {
  std::string data_dir = examples::kFashionMnistDir;
  std::int64_t iterations = 200;
  std::int64_t batch = 64;
  std::int64_t latent = 32;
  std::int64_t width = 32;
  std::uint64_t seed = 0;
  std::string precision = "fp32";
  std::string optimizer = "adam";
  bool checkpoint = false;
  bool hand = false;
  bool distributed = false;
  std::string report;
  std::string save;
  std::string resume;
  std::int64_t log_every = 20;
  int threads = 0;
  std::string device = "cpu";
  examples::TimelineFlags timeline;
};

// torch::nn::BatchNorm bit for bit in one process; under --distributed, given the group, it
// normalizes every rank's share by the whole batch's statistics (SyncBatchNorm).
using BatchNorm = frugal::distributed::SyncBatchNorm;

// Latent vector -> 1x28x28 image in [-1, 1].
struct GeneratorImpl : torch::nn::Module {
  GeneratorImpl(std::int64_t latent, std::int64_t w) : w(w) {
    fc = register_module("fc", torch::nn::Linear(latent, 2 * w * 7 * 7));
    bn0 = register_module("bn0", BatchNorm(2 * w * 7 * 7));
    up1 = register_module("up1",
                          torch::nn::ConvTranspose2d(
                              torch::nn::ConvTranspose2dOptions(2 * w, w, 4).stride(2).padding(1)));
    bn1 = register_module("bn1", BatchNorm(w));
    up2 = register_module("up2",
                          torch::nn::ConvTranspose2d(
                              torch::nn::ConvTranspose2dOptions(w, 1, 4).stride(2).padding(1)));
  }
  torch::Tensor forward(const torch::Tensor& z) {
    auto x = torch::relu(bn0(fc(z))).view({-1, 2 * w, 7, 7});
    return torch::tanh(up2(torch::relu(bn1(up1(x)))));
  }
  std::int64_t w;
  torch::nn::Linear fc{nullptr};
  BatchNorm bn0{nullptr};
  torch::nn::ConvTranspose2d up1{nullptr}, up2{nullptr};
  BatchNorm bn1{nullptr};
};
TORCH_MODULE(Generator);

// A strided convolution, BatchNorm and LeakyReLU: the discriminator's block.
struct DownImpl : torch::nn::Module {
  DownImpl(std::int64_t in, std::int64_t out) {
    conv = register_module(
        "conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 4).stride(2).padding(1)));
    bn = register_module("bn", BatchNorm(out));
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::leaky_relu(bn(conv(x)), 0.2); }
  torch::nn::Conv2d conv{nullptr};
  BatchNorm bn{nullptr};
};
TORCH_MODULE(Down);

// Image -> one logit (real or fake); its blocks go through frugal::nn::call, so a
// CheckpointPolicy can recompute them in backward.
struct DiscriminatorImpl : torch::nn::Module {
  explicit DiscriminatorImpl(std::int64_t w) {
    down1 = register_module("down1", Down(1, w));
    down2 = register_module("down2", Down(w, 2 * w));
    head = register_module("head", torch::nn::Linear(2 * w * 7 * 7, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = frugal::nn::call(down2, frugal::nn::call(down1, x));
    return head(h.flatten(1));
  }
  Down down1{nullptr}, down2{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Discriminator);

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind,
                                                        std::vector<torch::Tensor> params) {
  // DCGAN's Adam: lr 2e-4, betas (0.5, 0.999).
  if (kind == "adam8bit") {
    return std::make_unique<frugal::optim::Adam8bit>(
        std::move(params), torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}));
  }
  return std::make_unique<torch::optim::Adam>(std::move(params),
                                              torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}));
}

torch::Tensor bce(const torch::Tensor& logits, double target) {
  return F::binary_cross_entropy_with_logits(
      logits.to(torch::kFloat),
      torch::full({logits.size(0), 1}, target, logits.options().dtype(torch::kFloat)));
}

// What one iteration printed and wrote, in either loop.
struct Line {
  std::int64_t iteration;
  double d_loss, g_loss;
  std::int64_t allocated = 0, peak = 0;
  double scale = 1;
};

std::string format_line(const Line& l) {
  return fmt::format("iteration {} d_loss {:.17g} g_loss {:.17g} scale {} allocated {} peak {}",
                     l.iteration, l.d_loss, l.g_loss, l.scale, l.allocated, l.peak);
}

int run(const Args& args) {
  torch::manual_seed(args.seed);
  const auto train = frugal::data::load_mnist_dir(args.data_dir, frugal::data::Split::Train);
  // Under torchrun, --device cuda is each rank's GPU (LOCAL_RANK).
  const auto device = examples::pick_device(
      args.device,
      args.distributed ? frugal::distributed::LaunchEnv::from_environment().local_rank : -1);
  // [0, 1] -> [-1, 1], as tanh gives; on the device once (188 MB)
  const auto images = train.inputs.mul(2.0).sub(1.0).to(device);
  Generator g(args.latent, args.width);
  Discriminator d(args.width);
  g->to(device);
  d->to(device);
  auto g_opt = make_optimizer(args.optimizer, g->parameters());
  auto d_opt = make_optimizer(args.optimizer, d->parameters());
  frugal::CheckpointPolicy checkpoint(frugal::CheckpointSelect().names({"down1", "down2"}));
  if (args.checkpoint) {
    checkpoint.apply(*d);
  }
  FRUGAL_CHECK(args.precision == "fp32" || args.precision == "bf16" || args.precision == "fp16",
               "gan: --precision is fp32, bf16 or fp16, got '", args.precision, "'");
  const bool low = args.precision != "fp32";
  const auto dtype = args.precision == "fp16" ? torch::kHalf : torch::kBFloat16;
  auto scaler = args.precision == "fp16" ? std::make_shared<frugal::GradScaler>() : nullptr;
  // Under torchrun each rank trains on its share of every batch; both models' gradients are
  // averaged over the ranks before their steps, and BatchNorm normalizes by the statistics of
  // the whole batch: the ranks train as one process on the whole batch.
  std::shared_ptr<frugal::distributed::Group> group;
  std::shared_ptr<frugal::GradientReducer> reducer;
  if (args.distributed) {
    FRUGAL_CHECK(!args.hand, "gan: --distributed is frugal::Loop's; not with --hand");
    group = frugal::distributed::Group::join(frugal::distributed::LaunchEnv::from_environment());
    FRUGAL_CHECK(args.batch % group->size() == 0, "gan: --batch ", args.batch,
                 " does not split evenly over ", group->size(), " ranks");
    reducer = std::make_shared<frugal::distributed::Reducer>(group);
    frugal::distributed::synchronize_batch_norm(*g, group);
    frugal::distributed::synchronize_batch_norm(*d, group);
  }
  const int rank = group ? group->rank() : 0;
  const std::int64_t share = group ? args.batch / group->size() : args.batch;
  frugal::Loop loop(frugal::LoopOptions().device(device).scaler(scaler).reducer(reducer));
  auto& dm = loop.prepare(d, *d_opt, "discriminator");
  auto& gm = loop.prepare(g, *g_opt, "generator");
  std::unique_ptr<std::ofstream> report;
  if (!args.report.empty() && rank == 0) {
    report = std::make_unique<std::ofstream>(args.report);
    FRUGAL_CHECK(report->good(), "gan: cannot write the report to '", args.report, "'");
  }
  std::int64_t first = 1;
  if (!args.resume.empty()) {
    FRUGAL_CHECK(!args.hand, "gan: --resume is frugal::Loop's; not with --hand");
    frugal::load_training_state(loop, args.resume);
    first = loop.iterations() + 1;
    fmt::print("resumed from {} at iteration {}\n", args.resume, loop.iterations());
  }
  std::int64_t generator_forwards = 0;
  const auto n = images.size(0) / args.batch;
  examples::IterationTimeline timeline("gan", args.timeline);
  for (std::int64_t i = first; i <= args.iterations; ++i) {
    timeline.begin(
        {{d.ptr().get(), d_opt.get(), "discriminator"}, {g.ptr().get(), g_opt.get(), "generator"}},
        device);
    // Every rank draws the whole batch's noise (one random stream for all) and keeps its share.
    const auto real =
        images.narrow(0, ((i - 1) % n) * args.batch, args.batch).narrow(0, rank * share, share);
    // Forwards under autocast (bf16 or fp16 where it pays), backwards outside it.
    auto D = [&](const torch::Tensor& x) {
      frugal::AutocastGuard autocast(device.type(), dtype, low);
      return d->forward(x);
    };
    auto fake = [&] {
      frugal::AutocastGuard autocast(device.type(), dtype, low);
      // Drawn by the CPU's generator on every device: the same noise wherever it trains.
      return g->forward(
          torch::randn({args.batch, args.latent}).narrow(0, rank * share, share).to(device));
    }();
    ++generator_forwards;
    Line line{i, 0, 0};
    if (args.hand) {
      // The plain LibTorch loop: zero, backward, step, for each model in turn.
      d_opt->zero_grad();
      auto real_loss = bce(D(real), 1.0);
      real_loss.backward();
      auto fake_loss = bce(D(fake.detach()), 0.0);
      fake_loss.backward();
      d_opt->step();
      g_opt->zero_grad();
      auto g_loss = bce(D(fake), 1.0);
      g_loss.backward();
      g_opt->step();
      line.d_loss = real_loss.item<double>() + fake_loss.item<double>();
      line.g_loss = g_loss.item<double>();
    } else {
      {
        // The real half's gradients wait; both halves travel during the fake half's backward.
        frugal::Loop::NoSync quiet(loop, dm);
        loop.backward(bce(D(real), 1.0), dm);
      }
      loop.backward(bce(D(fake.detach()), 0.0), dm);
      loop.step(dm);
      loop.backward(bce(D(fake), 1.0), gm);
      loop.step(gm);
      const auto r = loop.end();
      line = {i,
              r.model("discriminator").loss,
              r.model("generator").loss,
              r.memory.allocated,
              r.peak,
              r.scale};
      if (group) {  // the whole batch's: the mean of the ranks' means over equal shares
        line.d_loss = group->sum(line.d_loss) / group->size();
        line.g_loss = group->sum(line.g_loss) / group->size();
      }
      if (report) {
        *report << r.to_json() << "\n";
      }
    }
    timeline.end();
    if (rank == 0 && (i % args.log_every == 0 || i == args.iterations)) {
      fmt::print("{}\n", format_line(line));
    }
  }
  if (!args.save.empty() && rank == 0) {  // the ranks hold the same state
    FRUGAL_CHECK(!args.hand, "gan: --save is frugal::Loop's; not with --hand");
    frugal::save_training_state(loop, args.save);  // both models, optimizers, scaler, RNG
    fmt::print("saved {} at iteration {}\n", args.save, loop.iterations());
  }
  auto tracked = [](torch::nn::Module& m) {
    std::int64_t total = 0;
    for (const auto& b : m.named_buffers()) {
      if (b.key().find("num_batches_tracked") != std::string::npos) {
        total += b.value().item<std::int64_t>();
      }
    }
    return total;
  };
  double checksum = 0;  // the same on every rank: the ranks hold the same weights
  for (const auto& p : g->parameters()) {
    checksum += p.detach().to(torch::kDouble).sum().item<double>();
  }
  for (const auto& p : d->parameters()) {
    checksum += p.detach().to(torch::kDouble).sum().item<double>();
  }
  fmt::print(
      "generator forwards {} generator batchnorm batches {} discriminator batchnorm "
      "batches {}\nrank {} parameters checksum {:.17g}\n",
      generator_forwards, tracked(*g), tracked(*d), rank, checksum);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"A DCGAN on Fashion-MNIST in one frugal::Loop"};
  Args args;
  examples::fashion_mnist_flag(app, args.data_dir);
  app.add_option("--iterations", args.iterations, "iterations (one step of each model)")
      ->check(CLI::PositiveNumber);
  app.add_option("--batch", args.batch, "images per iteration")->check(CLI::PositiveNumber);
  app.add_option("--latent", args.latent, "the generator's input size")->check(CLI::PositiveNumber);
  app.add_option("--width", args.width, "channels of the first convolution")
      ->check(CLI::PositiveNumber);
  examples::seed_flag(app, args.seed, "random seed");
  app.add_option("--precision", args.precision,
                 "fp32, bf16 (autocast) or fp16 (autocast and one "
                 "loss scaler over both optimizers)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_option("--optimizer", args.optimizer, "adam or adam8bit (8-bit states)")
      ->check(CLI::IsMember({"adam", "adam8bit"}));
  app.add_flag("--checkpoint", args.checkpoint, "recompute the discriminator's blocks in backward");
  app.add_flag("--hand", args.hand, "run the plain LibTorch loop instead of frugal::Loop");
  app.add_flag("--distributed", args.distributed,
               "data parallel over the ranks torchrun started (each its share of a batch)");
  app.add_option("--report", args.report, "write one JSON line per iteration here");
  examples::memory_timeline_flags(app, args.timeline);
  app.add_option("--save", args.save,
                 "save the whole state (both models, optimizers, scaler, "
                 "generators) here at the end");
  app.add_option("--resume", args.resume, "resume from a state --save wrote, up to --iterations");
  app.add_option("--log-every", args.log_every, "print every N iterations")
      ->check(CLI::PositiveNumber);
  examples::threads_flag(app, args.threads);
  app.add_option("--device", args.device,
                 "cpu, cuda or cuda:N (under --distributed, cuda is each rank's cuda:LOCAL_RANK)")
      ->capture_default_str();
  return examples::parse_and_run(app, argc, argv, [&args] { return run(args); });
}
