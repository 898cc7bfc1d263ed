// Knowledge distillation on Fashion-MNIST: a teacher MLP trained first with frugal::Trainer,
// then frozen and run under no_grad, and a small student trained on the teacher's softened
// outputs and the labels in one frugal::Loop, with exact accumulation over micro-batches.
//
//   distill --teacher-steps 300 --steps 300 --batch 128 --micro-batch 32
#include <fmt/format.h>
#include <frugal/frugal.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <string>

#include "device.h"
#include "main_flags.h"
#include "memory_timeline_flags.h"
#include "models.h"

namespace {

namespace F = torch::nn::functional;

struct Args {
  std::string data_dir = examples::kFashionMnistDir;
  std::int64_t teacher_steps = 300;
  std::int64_t steps = 300;
  std::int64_t batch = 128;
  std::int64_t micro_batch = 0;
  double temperature = 2.0;
  double alpha = 0.5;
  std::uint64_t seed = 0;
  std::int64_t log_every = 50;
  int threads = 0;
  std::string device = "cpu";
  examples::TimelineFlags timeline;
};

// 784 -> 64 -> 10: an eighth of the teacher's first layer.
torch::nn::Sequential make_student() {
  return torch::nn::Sequential(torch::nn::Flatten(), torch::nn::Linear(784, 64), torch::nn::ReLU(),
                               torch::nn::Linear(64, 10));
}

double checksum(torch::nn::Module& m) {
  double sum = 0;
  for (const auto& p : m.parameters()) {
    sum += p.detach().to(torch::kDouble).sum().item<double>();
  }
  return sum;
}

int run(const Args& args) {
  torch::manual_seed(args.seed);
  const auto device = examples::pick_device(args.device);
  const auto train = frugal::data::load_mnist_dir(args.data_dir, frugal::data::Split::Train);
  const auto test = frugal::data::load_mnist_dir(args.data_dir, frugal::data::Split::Test);
  const auto n = train.size() / args.batch;
  auto batch_at = [&](std::int64_t i) { return train.slice((i % n) * args.batch, args.batch); };

  // The teacher, trained plainly first.
  auto teacher = fashion::make_mlp(0.0);
  teacher->to(device);
  torch::optim::Adam teacher_adam(teacher->parameters(), 1e-3);
  const auto on_device = frugal::TrainerOptions().device(device);  // batches go there
  frugal::Trainer teacher_trainer(teacher, teacher_adam, F::cross_entropy, on_device);
  for (std::int64_t i = 0; i < args.teacher_steps; ++i) {
    teacher_trainer.step(batch_at(i));
  }
  const auto teacher_eval = teacher_trainer.evaluate(test, 1000);
  fmt::print("teacher accuracy {:.4f} after {} steps\n", teacher_eval.accuracy, args.teacher_steps);
  teacher->eval();
  for (auto& p : teacher->parameters()) {
    p.requires_grad_(false);  // frozen: no gradients, no optimizer
  }
  const double teacher_sum = checksum(*teacher);

  // The student, distilled in one Loop: soft targets at a temperature, mixed with the labels.
  auto student = make_student();
  student->to(device);
  torch::optim::Adam student_adam(student->parameters(), 2e-3);
  frugal::Loop loop(frugal::LoopOptions()
                        .device(device)
                        .micro_batch(args.micro_batch > 0
                                         ? c10::optional<std::int64_t>(args.micro_batch)
                                         : c10::nullopt)
                        .memory_timeline(examples::timeline_span(args.timeline)));
  auto& s = loop.prepare(student, student_adam, "student");
  const double t = args.temperature;
  auto distill_loss = [&](const frugal::Batch& micro) {
    torch::Tensor soft;
    {
      torch::NoGradGuard no_grad;  // the teacher keeps no activations
      soft = torch::softmax(teacher->forward(micro.inputs) / t, 1);
    }
    const auto logits = student->forward(micro.inputs);
    const auto kd = F::kl_div(torch::log_softmax(logits / t, 1), soft,
                              F::KLDivFuncOptions().reduction(torch::kBatchMean)) *
                    (t * t);
    return args.alpha * kd + (1 - args.alpha) * F::cross_entropy(logits, micro.targets);
  };
  for (std::int64_t i = 1; i <= args.steps; ++i) {
    const double loss = loop.accumulate(batch_at(i - 1).to(device), s, distill_loss);
    loop.step(s);
    const auto report = loop.end();
    if (const auto* timeline = loop.memory_timeline(); timeline && i == timeline->span().last) {
      examples::print_timeline("distill", *timeline->recorder(), timeline->written(), i);
    }
    if (i % args.log_every == 0 || i == args.steps) {
      fmt::print("step {} loss {:.17g} allocated {} peak {}\n", i, loss, report.memory.allocated,
                 report.peak);
    }
  }
  frugal::Trainer student_eval(student, student_adam, F::cross_entropy, on_device);
  const auto eval = student_eval.evaluate(test, 1000);
  fmt::print("student accuracy {:.4f} after {} steps; teacher unchanged {}\n", eval.accuracy,
             args.steps, checksum(*teacher) == teacher_sum ? "yes" : "no");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Distillation on Fashion-MNIST: a frozen teacher, a student in one frugal::Loop"};
  Args args;
  examples::fashion_mnist_flag(app, args.data_dir);
  app.add_option("--teacher-steps", args.teacher_steps, "steps of the teacher's training")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--steps", args.steps, "steps of the student's distillation")
      ->check(CLI::PositiveNumber);
  app.add_option("--batch", args.batch, "samples per step")->check(CLI::PositiveNumber);
  app.add_option("--micro-batch", args.micro_batch, "samples per forward/backward (0: the batch)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--temperature", args.temperature, "softening of the teacher's outputs")
      ->check(CLI::PositiveNumber);
  app.add_option("--alpha", args.alpha, "weight of the teacher's term (the labels': 1 - alpha)")
      ->check(CLI::Range(0.0, 1.0));
  examples::seed_flag(app, args.seed, "random seed");
  app.add_option("--log-every", args.log_every, "print every N steps")->check(CLI::PositiveNumber);
  examples::memory_timeline_flags(app, args.timeline);
  examples::threads_flag(app, args.threads);
  app.add_option("--device", args.device, "cpu, cuda or cuda:N")->capture_default_str();
  return examples::parse_and_run(app, argc, argv, [&args] { return run(args); });
}
