// Trains a CNN or an MLP on Fashion-MNIST with frugal's step engine and memory probe.
//
//   fashion_mnist --data-dir /usr/share/datasets/fashion-mnist --model cnn --epochs 1
#include <fmt/format.h>
#include <frugal/distributed.h>
#include <frugal/frugal.h>
#include <frugal/memory/memory_names.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <future>
#include <optional>

#include "cli_checks.h"
#include "device.h"
#include "main_flags.h"
#include "models.h"
#include "progress.h"
#include "run_args.h"

namespace {

using fashion::Args;
using fashion::lr_schedule;
using fashion::make_optimizer;

int run(Args args) {
  // Under torchrun every rank trains its share of each --batch; rank 0 speaks for the run.
  std::shared_ptr<frugal::distributed::Group> group;
  int local_rank = -1;
  if (args.distributed) {
    const auto env = frugal::distributed::LaunchEnv::from_environment();
    local_rank = env.local_rank;
    group = frugal::distributed::Group::join(env);
    if (group->rank() != 0) {
      args.quiet = true;
      args.report.clear();
    }
  }
  torch::manual_seed(args.seed);
  const auto device = examples::pick_device(args.device, local_rank);
  // The images stay bytes (55 MiB, not 219 MiB as floats) and each batch becomes floats in
  // the forward. They are read on a thread of their own, as a data loader's workers would:
  // the trainer's figures count its own thread's bytes (the model's and the step's), and
  // the ledger's `other` and `process_allocated` still count the images.
  auto load = [&args](frugal::data::Split split) {
    return std::async(std::launch::async, [&args, split] {
      return frugal::data::load_mnist_dir(args.data_dir, split, frugal::data::Pixels::Bytes);
    });
  };
  auto train_loading = load(frugal::data::Split::Train);
  auto test_loading = load(frugal::data::Split::Test);
  auto train = train_loading.get();
  auto test = test_loading.get();
  // A memory timeline names their bytes instead of counting them as "alive before".
  for (const auto& t : {train.inputs, train.targets, test.inputs, test.targets}) {
    frugal::name_memory(t, "data set");
  }
  if (args.eval_samples > 0 && args.eval_samples < test.inputs.size(0)) {
    test = test.slice(0, args.eval_samples);  // a quick run's evaluation: the first samples
  }
  if (args.batch > train.inputs.size(0)) {
    throw std::invalid_argument(
        fmt::format("--batch {} is larger than the training set ({} "
                    "samples)",
                    args.batch, train.inputs.size(0)));
  }
  // Counted from here: the model and training, not the data set held in memory.
  frugal::CountingAllocator::install();

  auto model =
      args.model == "cnn" ? fashion::make_cnn(args.dropout) : fashion::make_mlp(args.dropout);
  // With --weights int8: the codes, as the model's buffers.
  frugal::nn::Int8Weights int8(frugal::nn::Int8WeightsOptions().dtype(
      args.materialise == "float32" ? torch::kFloat32 : torch::kBFloat16));
  if (args.weights == "bf16") {
    model = fashion::with_bf16_weights(model);
  } else if (args.weights == "int8") {
    model = fashion::with_int8_weights(model, int8);
  }
  model->to(device);
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (args.zero > 0) {  // each rank steps its 1/N of the parameters with the chosen optimizer
    optimizer = std::make_unique<frugal::distributed::ZeroOptimizer>(
        model->parameters(), group,
        [&args](std::vector<torch::Tensor> shard) {
          return make_optimizer(args, std::move(shard));
        },
        frugal::distributed::ZeroOptimizerOptions().stage(args.zero).step_in_backward(
            args.zero == 3 && args.step_in_backward));
  } else {
    optimizer = make_optimizer(args, model->parameters());
  }

  auto options = frugal::TrainerOptions()
                     .device(device)
                     .set_to_none(args.set_to_none == "on")
                     .eval_batch(args.eval_batch);
  if (args.micro_batch > 0) {
    options.micro_batch(args.micro_batch);
  }
  std::optional<frugal::ScopedMemoryCap> cap;  // the device's: a smaller card on CUDA
  if (args.memory_cap > 0) {
    cap.emplace(device, args.memory_cap);
  }
  frugal::Trainer trainer(
      model.ptr(), *optimizer,
      [&model](const frugal::Batch& b) {
        return model->forward(frugal::data::to_unit_floats(b.inputs));
      },
      [](const torch::Tensor& out, const frugal::Batch& b) {
        return torch::nn::functional::cross_entropy(out, b.targets);
      },
      options);
  if (group) {
    trainer.add_policy(std::make_shared<frugal::distributed::DataParallel>(group));
  }
  trainer.add_policy(std::make_shared<frugal::OomRecovery>());
  if (args.checkpoint) {  // every block but the output layer
    trainer.add_policy(std::make_shared<frugal::CheckpointPolicy>(
        frugal::CheckpointSelect().types({"fashion::Block"})));
  }
  if (args.autocast != "off") {
    frugal::use_mixed_precision(trainer, args.autocast == "bf16" ? torch::kBFloat16 : torch::kHalf);
  }
  std::shared_ptr<frugal::MemoryTimeline> timeline;
  if (!args.timeline.file.empty()) {
    timeline = std::make_shared<frugal::MemoryTimeline>(args.timeline.file, args.timeline.step);
    trainer.add_policy(timeline);
  }
  if (args.step_in_backward && args.zero != 3) {  // ZeRO-3 steps its range in backward itself
    trainer.add_policy(std::make_shared<frugal::StepInBackward>());
  }
  std::shared_ptr<frugal::JsonLinesSink> jsonl;
  if (!args.report.empty()) {
    jsonl = std::make_shared<frugal::JsonLinesSink>(args.report);
    trainer.add_sink(jsonl);
  }

  const std::int64_t n = train.inputs.size(0);  // > 0: the loader refuses empty sets
  const std::int64_t per_epoch = (n - 1) / args.batch + 1;
  const bool terminal = !args.quiet && isatty(fileno(stderr));
  if (!args.quiet) {
    fmt::print(
        "fashion_mnist: {} on {}, {} train / {} test samples, batch {}, micro-batch {}, "
        "{} weights, autocast {}, checkpoint {}, {} {}{}, {} threads{}, LibTorch {}.{}\n",
        args.model, device.str(), n, test.inputs.size(0), args.batch,
        args.micro_batch > 0 ? std::to_string(args.micro_batch) : "off",
        args.weights == "bf16" ? "bf16 (" + args.rounding + " rounding)"
        : args.weights == "int8"
            ? "int8 (" + args.rounding + " rounding, " + args.materialise + " while a layer runs)"
            : args.weights,
        args.autocast, args.checkpoint ? "on" : "off",
        args.torch_optimizer ? "LibTorch's" : "frugal's", args.optimizer,
        args.step_in_backward ? " stepped in backward" : "", torch::get_num_threads(),
        group ? fmt::format(" x {} ranks{}", group->size(),
                            args.zero > 0 ? fmt::format(", ZeRO-{}", args.zero) : "")
              : std::string(),
        TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR);
  }

  const auto start = std::chrono::steady_clock::now();
  auto seconds = [&start] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  auto fit_options =
      frugal::FitOptions()
          .epochs(args.epochs)
          .batch_size(args.batch)
          .max_steps(args.max_steps)
          .seed(args.seed)
          .save_dir(args.save_dir)
          .save_every(args.save_every)
          .resume(args.resume)
          .ranks(group ? std::make_shared<frugal::distributed::GroupRanks>(group) : nullptr);
  if (args.lr_schedule != "constant" || args.warmup_steps > 0) {
    const std::int64_t total = args.max_steps > 0 ? args.max_steps : per_epoch * args.epochs;
    trainer.add_policy(std::make_shared<frugal::LrSchedule>(lr_schedule(args, per_epoch, total)));
  }

  std::int64_t peak = 0;
  frugal::EvalReport eval;
  frugal::RunningMean loss;  // of the epoch, carried over a resume
  std::optional<fashion::Progress> progress;
  auto epoch_start = std::chrono::steady_clock::now();
  std::int64_t epoch_begin_batch = 0;  // not 0 when a resumed run goes on inside an epoch
  fit_options.on_epoch_begin([&](const frugal::FitPosition& at) {
    if (jsonl) {
      jsonl->set("epoch", at.epoch);
    }
    if (at.batch == 0) {
      loss.reset();
    }
    const std::int64_t left = args.max_steps > 0 ? args.max_steps - at.step : per_epoch;
    progress.emplace(terminal, at.batch + std::min(per_epoch - at.batch, left));
    epoch_start = std::chrono::steady_clock::now();
    epoch_begin_batch = at.batch;
  });
  fit_options.on_step([&](const frugal::StepReport& report, const frugal::FitPosition& at) {
    if (!std::isfinite(report.loss)) {
      throw std::runtime_error(
          fmt::format("the training loss is {} at step {}; lower --lr "
                      "(now {})",
                      report.loss, at.step, args.lr));
    }
    peak = std::max(peak, report.peak);
    if (timeline && !timeline->written().empty() && at.step == args.timeline.step && !args.quiet) {
      fmt::print("step {}: {}\nstep {}: ledger {}\n", at.step, report.memory.summary(), at.step,
                 report.ledger.summary());
      examples::print_timeline("fashion_mnist", *timeline->recorder(), timeline->written(),
                               at.step);
    }
    // The loss is the global batch's (DataParallel), weighted by the global batch's samples.
    const auto global_samples = std::min(args.batch, n - (at.batch - 1) * args.batch);
    loss.add(report.loss, static_cast<double>(group ? global_samples : report.samples));
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch_start).count();
    progress->update(at.batch, static_cast<double>(at.batch - epoch_begin_batch) / secs,
                     loss.mean(), report.memory.allocated, report.peak);
    if (!terminal && !args.quiet && at.batch % 100 == 0) {
      fmt::print("epoch {} step {}/{} loss {:.4f} | {}\n", at.epoch, at.batch, per_epoch,
                 loss.mean(), report.memory.summary());
    }
  });
  fit_options.on_eval([&](const frugal::EvalReport& report, const frugal::FitPosition& at) {
    eval = report;
    peak = std::max(peak, eval.peak);
    if (!args.quiet) {
      fmt::print("epoch {}: train loss {:.4f} | test loss {:.4f} accuracy {:.4f}\n", at.epoch,
                 loss.mean(), eval.loss, eval.accuracy);
    }
  });
  fit_options.on_save([&](frugal::UserState& user) {
    user.numbers["train_loss_sum"] = loss.sum();
    user.numbers["train_loss_weight"] = loss.weight();
    user.values["train_loss_count"] = loss.count();
    user.values["max_peak_bytes"] = peak;
  });
  fit_options.on_resume([&](const frugal::UserState& user) {
    loss.restore(user.numbers.at("train_loss_sum"), user.numbers.at("train_loss_weight"),
                 user.values.at("train_loss_count"));
    peak = user.values.at("max_peak_bytes");
  });
  fit_options.log([](const std::string& line) { fmt::print(stderr, "fashion_mnist: {}\n", line); });

  // The report ends with one record of the run, whichever way it ends.
  auto end_record = [&](const std::string& status) {
    if (!jsonl) {
      return;
    }
    jsonl->set("status", status);
    jsonl->set("steps", trainer.steps());
    jsonl->set("test_accuracy", eval.accuracy);
    jsonl->set("test_loss", eval.loss);
    jsonl->set("max_peak_bytes", peak);
    jsonl->set("seconds", seconds());
    jsonl->write_event("end");
  };
  frugal::FitResult result;
  try {
    result = frugal::fit(trainer, frugal::TensorData(train), fit_options,
                         frugal::Batch{test.inputs, test.targets});
  } catch (const std::exception& e) {
    end_record("error: " + frugal::error_message(e));
    throw;
  }
  if (result.signal != 0) {
    end_record(fmt::format("stopped by signal {}", result.signal));
    if (group && group->rank() != 0) {
      return 128 + result.signal;
    }
    fmt::print("stopped by signal {} at step {}{}\n", result.signal, result.steps,
               result.saved.empty() ? std::string(" (no --save-dir: nothing saved)")
                                    : "; saved " + result.saved + ", go on with --resume");
    return 128 + result.signal;
  }
  end_record("ok");
  if (group && group->rank() != 0) {
    return 0;  // rank 0 speaks for the run
  }
  fmt::print("done: {} steps, test accuracy {:.4f}, peak memory {}, {:.1f} s\n", result.steps,
             eval.accuracy, frugal::format_bytes(peak), seconds());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using fashion::kMaxThreads, fashion::kNonNegative, fashion::kPositive, fashion::kSeed;
  Args args;
  CLI::App app{"Trains a CNN or an MLP on Fashion-MNIST with frugal"};
  examples::fashion_mnist_flag(app, args.data_dir);
  app.add_option("--model", args.model, "cnn or mlp")
      ->check(CLI::IsMember({"cnn", "mlp"}))
      ->capture_default_str();
  app.add_option("--epochs", args.epochs, "Epochs")->check(kPositive)->capture_default_str();
  app.add_option("--batch", args.batch, "Samples per optimizer step")
      ->check(kPositive)
      ->capture_default_str();
  app.add_option("--micro-batch", args.micro_batch, "Samples per forward/backward (0: the batch)")
      ->check(kNonNegative)
      ->capture_default_str();
  app.add_option("--eval-batch", args.eval_batch, "Samples per evaluation batch")
      ->check(kPositive)
      ->capture_default_str();
  app.add_option("--eval-samples", args.eval_samples,
                 "Evaluate on the first this many test samples (0: all 10000)")
      ->check(kNonNegative)
      ->capture_default_str();
  app.add_option("--lr", args.lr, "Learning rate")->check(kPositive)->capture_default_str();
  app.add_option("--optimizer", args.optimizer,
                 "sgd (momentum 0.9), adam, adamw, adam8bit, adamw8bit (8-bit states), or "
                 "adam4bit, adamw4bit (4-bit states): frugal's, in place")
      ->check(
          CLI::IsMember({"sgd", "adam", "adamw", "adam8bit", "adamw8bit", "adam4bit", "adamw4bit"}))
      ->capture_default_str();
  app.add_option("--beta1", args.beta1,
                 "Adam's first-moment decay (the Adam optimizers; 0 with the 8-bit and 4-bit "
                 "ones: no first moment kept)")
      ->check(CLI::Range(0.0, 0.999999))
      ->capture_default_str();
  app.add_flag("--factored", args.factored,
               "The 8-bit and 4-bit optimizers: keep a matrix's second moment as row and "
               "column statistics");
  app.add_flag("--torch-optimizer", args.torch_optimizer,
               "Use LibTorch's optimizer of that name instead of frugal's");
  app.add_flag("--step-in-backward", args.step_in_backward,
               "Update each parameter in backward as its gradient is ready (frugal's "
               "optimizers); with --zero 3, each rank's range once the ranks have averaged it");
  app.add_option("--dropout", args.dropout, "Dropout probability")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--set-to-none", args.set_to_none, "Release gradients after each step: on|off")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  app.add_option("--device", args.device,
                 "cpu, cuda or cuda:N (under --distributed, cuda is each rank's cuda:LOCAL_RANK)")
      ->capture_default_str();
  app.add_option(
         "--memory-cap", args.memory_cap,
         "Cap on the device's tensor bytes (0: none; on CUDA the caching allocator's fraction)")
      ->check(kNonNegative)
      ->capture_default_str();
  examples::memory_timeline_flags(app, args.timeline);
  examples::threads_flag(app, args.threads, "Intra-op threads (0: LibTorch's choice)")
      ->check(CLI::Range(0, kMaxThreads))
      ->capture_default_str();
  app.add_option("--seed", args.seed, "Seed of weights, shuffling and dropout")
      ->check(kSeed)
      ->capture_default_str();
  app.add_option("--max-steps", args.max_steps, "Stop after this many steps (0: no limit)")
      ->check(kNonNegative)
      ->capture_default_str();
  app.add_option("--autocast", args.autocast,
                 "Mixed precision: off|bf16|fp16 (fp16 adds a GradScaler)")
      ->check(CLI::IsMember({"off", "bf16", "fp16"}))
      ->capture_default_str();
  app.add_option("--weights", args.weights,
                 "The weights' dtype: float32|bf16|int8 (bf16: gradients and Adam's moments "
                 "too, inputs cast on the way in; int8: the matrices stored as 8-bit codes, "
                 "materialised in bf16 one layer at a time, the rest bf16)")
      ->check(CLI::IsMember({"float32", "bf16", "int8"}))
      ->capture_default_str();
  app.add_option("--rounding", args.rounding,
                 "How bf16 and int8 weights take frugal's optimizer updates: "
                 "stochastic|nearest|compensated")
      ->check(CLI::IsMember({"stochastic", "nearest", "compensated"}))
      ->capture_default_str();
  app.add_option("--materialise", args.materialise,
                 "The dtype --weights int8 gives a layer's weights while it runs, and keeps "
                 "the other parameters in: bf16|float32")
      ->check(CLI::IsMember({"bf16", "float32"}))
      ->capture_default_str();
  app.add_flag("--checkpoint", args.checkpoint, "Checkpoint the model's blocks");
  app.add_option("--report", args.report, "Write a JSON-lines report to this file");
  app.add_flag("--quiet", args.quiet, "Print the last line only (and errors)");
  app.add_option("--save-dir", args.save_dir,
                 "Save the training state in this folder (at the end, every --save-every "
                 "steps, and on SIGINT/SIGTERM; the newest 3 kept)");
  app.add_option("--save-every", args.save_every, "Save every this many steps (0: at the end)")
      ->check(kNonNegative)
      ->capture_default_str();
  app.add_flag("--resume", args.resume,
               "Go on from the newest loadable save in --save-dir (--epochs and --max-steps "
               "count from the start of the run)");
  app.add_option("--lr-schedule", args.lr_schedule,
                 "constant, linear or cosine (to 0 at the last step), step (halved every epoch)")
      ->check(CLI::IsMember({"constant", "linear", "cosine", "step"}))
      ->capture_default_str();
  app.add_option("--warmup-steps", args.warmup_steps, "Linear warm-up steps before the schedule")
      ->check(kNonNegative)
      ->capture_default_str();
  app.add_flag("--distributed", args.distributed,
               "Data-parallel over the ranks torchrun starts (torchrun --nproc-per-node N "
               "--no-python fashion_mnist --distributed ...); --batch stays the global batch");
  app.add_option("--zero", args.zero,
                 "With --distributed: shard the optimizer state (1), the gradients too (2) and "
                 "the weights between steps too (3) over the ranks (0: off)")
      ->check(CLI::IsMember({0, 1, 2, 3}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (args.zero > 0 && !args.distributed) {
    fmt::print(stderr, "fashion_mnist: --zero {} needs --distributed\n", args.zero);
    return 2;
  }
  if (args.weights == "int8" && (args.torch_optimizer || args.zero > 0)) {
    fmt::print(stderr,
               "fashion_mnist: --weights int8 takes frugal's optimizers without --zero, "
               "got {}\n",
               args.torch_optimizer ? "--torch-optimizer" : fmt::format("--zero {}", args.zero));
    return 2;
  }
  if ((args.resume || args.save_every > 0) && args.save_dir.empty()) {
    fmt::print(stderr, "fashion_mnist: --resume and --save-every need --save-dir\n");
    return 2;
  }
  try {
    return run(args);
  } catch (const std::exception& e) {
    fmt::print(stderr, "fashion_mnist: {}\n", frugal::error_message(e));
  }
  return 1;
}
