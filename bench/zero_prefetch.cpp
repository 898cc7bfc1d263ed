// ZeRO-3 units with and without prefetch, side by side in one run: ms a step and the step's
// peak of the same residual MLP, each block a unit reached through frugal::nn::call, Adam,
// data parallel over the ranks. Both runs live in each rank and take turns round by round,
// so that a slow spell of the machine falls on both alike. Start it under torchrun (one
// process a rank); started alone it runs as a group of one, where nothing can overlap.
//   torchrun --standalone --nproc-per-node 2 --no-python bench/bench_zero_prefetch
#include <fmt/format.h>
#include <frugal/distributed.h>
#include <frugal/frugal.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench_util.h"

namespace {

struct Args {
  std::int64_t blocks = 8;
  std::int64_t width = 1024;
  std::int64_t batch = 16;  // a rank's samples a step
  int steps = 10;           // a round's steps of each run
  int rounds = 5;
  int threads = 1;
};

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(std::int64_t width)
      : fc(register_module("fc", torch::nn::Linear(width, width))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + torch::relu(fc(x)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl(std::int64_t blocks_n, std::int64_t width)
      : blocks(register_module("blocks", torch::nn::ModuleList())),
        head(register_module("head", torch::nn::Linear(width, 10))) {
    for (std::int64_t b = 0; b < blocks_n; ++b) {
      blocks->push_back(Block(width));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (std::size_t b = 0; b < blocks->size(); ++b) {
      x = frugal::nn::call(blocks->ptr<BlockImpl>(b), x);
    }
    return head(x);
  }
  torch::nn::ModuleList blocks;
  torch::nn::Linear head;
};
TORCH_MODULE(Net);

// One run: the model, its sharded optimizer and its trainer.
struct Run {
  Net net{nullptr};
  std::unique_ptr<frugal::distributed::ZeroOptimizer> zero;
  std::unique_ptr<frugal::Trainer> trainer;
  frugal::MemoryProbe probe;
  std::int64_t peak = 0;  // the highest step peak above the step's start, after round one
  int rounds_done = 0;
};

std::unique_ptr<Run> make_run(const Args& args, bool prefetch,
                              const std::shared_ptr<frugal::distributed::Group>& group) {
  auto run = std::make_unique<Run>();
  torch::manual_seed(1);
  run->net = Net(args.blocks, args.width);
  auto adam = [](std::vector<torch::Tensor> p) {
    return std::make_unique<torch::optim::Adam>(std::move(p), torch::optim::AdamOptions(1e-4));
  };
  run->zero = std::make_unique<frugal::distributed::ZeroOptimizer>(
      run->net->parameters(), group, adam,
      frugal::distributed::ZeroOptimizerOptions()
          .stage(3)
          .units(run->net->blocks->children())
          .prefetch(prefetch));
  run->trainer = std::make_unique<frugal::Trainer>(
      run->net, *run->zero, [](const torch::Tensor& out, const torch::Tensor& y) {
        return torch::nn::functional::cross_entropy(out, y);
      });
  run->trainer->add_policy(std::make_shared<frugal::distributed::DataParallel>(group));
  return run;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  CLI::App app{"ZeRO-3 units: ms a step and the step's peak with and without prefetch"};
  app.add_option("--blocks", args.blocks, "residual blocks, one unit each")
      ->check(CLI::PositiveNumber);
  app.add_option("--width", args.width, "features of each block")->check(CLI::PositiveNumber);
  app.add_option("--batch", args.batch, "a rank's samples a step")->check(CLI::PositiveNumber);
  app.add_option("--steps", args.steps, "steps of each run a round")->check(CLI::PositiveNumber);
  app.add_option("--rounds", args.rounds, "rounds; the first is a warm-up left out")
      ->check(CLI::PositiveNumber);
  bench::threads_flag(app, args.threads, "LibTorch intra-op threads a rank (0: its choice)");
  CLI11_PARSE(app, argc, argv);
  const auto group =
      frugal::distributed::LaunchEnv::launched()
          ? frugal::distributed::Group::join(frugal::distributed::LaunchEnv::from_environment())
          : frugal::distributed::Group::single();
  torch::manual_seed(100 + group->rank());
  const auto x = torch::randn({args.batch, args.width});
  const auto y = torch::randint(0, 10, {args.batch});

  std::vector<std::pair<std::string, std::unique_ptr<Run>>> runs;
  runs.emplace_back("prefetch", make_run(args, true, group));
  runs.emplace_back("no prefetch", make_run(args, false, group));
  std::vector<std::pair<std::string, std::function<double()>>> variants;
  for (auto& [name, run] : runs) {
    auto* r = run.get();
    variants.emplace_back(name, [r, &x, &y, &args] {
      const double ms = bench::ms_per_call(
          [&] {
            const auto before = r->probe.allocated();  // the other run's bytes too
            const auto peak = r->trainer->step({x, y}).peak - before;
            if (r->rounds_done > 0) {  // not the first step's new optimizer state
              r->peak = std::max(r->peak, peak);
            }
          },
          args.steps);
      ++r->rounds_done;
      return ms;
    });
  }
  auto times = bench::interleave(variants, args.rounds, /*rotate=*/true);
  if (group->rank() != 0) {
    return 0;
  }
  nlohmann::json out{{"ranks", group->size()},  {"blocks", args.blocks},
                     {"width", args.width},     {"batch", args.batch},
                     {"threads", args.threads}, {"rows", nlohmann::json::array()}};
  fmt::print(
      "| run | ms a step (median of {} rounds × {} steps) | step peak above its start, rank 0 |\n",
      std::max(1, args.rounds - 1), args.steps);
  fmt::print("|---|---:|---:|\n");
  std::map<std::string, double> ms;
  for (const auto& [name, run] : runs) {
    auto& t = times[name];
    if (t.size() > 1) {
      t.erase(t.begin());  // the warm-up round
    }
    ms[name] = bench::median(t);
    fmt::print("| {} | {:.2f} | {:.1f} kB |\n", name, ms[name], run->peak / 1000.0);
    out["rows"].push_back({{"run", name}, {"ms", ms[name]}, {"peak_bytes", run->peak}});
  }
  out["ratio"] = ms["prefetch"] / ms["no prefetch"];
  fmt::print("\nprefetch / no prefetch: {:.3f} ms a step, {} ranks\n", out["ratio"].get<double>(),
             group->size());
  fmt::print("{}\n", out.dump());
  return 0;
}
