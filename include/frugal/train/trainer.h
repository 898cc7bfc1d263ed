// The step engine: one optimizer step per call, under composable policies.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "frugal/error.h"
#include "frugal/memory/probe.h"
#include "frugal/nn/module_pointer.h"
#include "frugal/train/batch.h"
#include "frugal/train/loss.h"
#include "frugal/train/options.h"
#include "frugal/train/policy.h"
#include "frugal/train/port.h"
#include "frugal/train/step_report.h"

namespace frugal {

class ReportSink;

/// The trainer's counters and sizes, as a saved training state carries them.
struct TrainerCounters {
  std::int64_t steps = 0;    ///< optimizer steps taken
  std::int64_t skipped = 0;  ///< optimizer steps skipped (inf/NaN gradients)
  std::int64_t batches = 0;  ///< batches run
  std::int64_t micro_batch = 0;
  std::int64_t eval_batch = 0;
};

/// Runs training steps: splits a batch into micro-batches, weights each loss by its share
/// of the global count so the accumulated gradient equals the full batch's, steps the
/// optimizer, releases gradients, and reports numbers (never tensors) with the probe's
/// memory figures. Policies hook the step's phases; sinks receive every report.
///
/// A step either completes or fails leaving parameters, optimizer state and the trainer's
/// counters as they were (a failure inside an accumulation window drops the window's
/// gradients unless a policy retries steps), with one exception: a failure after some
/// parameters changed raises PartialStepError and halts the trainer. frugal's optimizers
/// allocate what a step needs before they change anything, so that happens only with
/// LibTorch's optimizers (or StepInBackward). An error from a hook after the optimizer step
/// (AfterOptimizerStep, AfterZeroGrad, StepEnd) or from a sink comes with the step applied
/// and counted in steps().
///
/// Gradients already on the parameters when an accumulation window opens (left by a
/// backward the program ran itself) are released first: a window accumulates from nothing.
/// Several models or optimizers in one loop (a GAN) are frugal::Loop's.
///
/// Example:
///   torch::nn::Linear model(784, 10);
///   torch::optim::SGD sgd(model->parameters(), 0.1);
///   frugal::Trainer trainer(model, sgd, torch::nn::functional::cross_entropy,
///                           frugal::TrainerOptions().micro_batch(16));
///   auto report = trainer.step({images, labels});
///   fmt::print("loss {} peak {}\n", report.loss, report.peak);
class Trainer : public PolicyPort {
 public:
  using ForwardFn = std::function<torch::Tensor(const torch::Tensor& inputs)>;
  using LossFn = frugal::LossFn;
  using BatchLossFn = std::function<torch::Tensor(const Batch& batch)>;
  /// A forward of a whole (micro-)batch, for models that take several tensors.
  using BatchForwardFn = std::function<torch::Tensor(const Batch& batch)>;
  /// A loss of the forward's output and the (micro-)batch it came from.
  using OutputLossFn =
      std::function<torch::Tensor(const torch::Tensor& output, const Batch& batch)>;

  /// Every constructor takes the model, its optimizer, then how a (micro-)batch becomes a
  /// loss, the options last.
  ///
  /// The model as a module holder (torch::nn::Linear, a TORCH_MODULE) or a std::shared_ptr
  /// to a torch::nn::Module subclass (`std::make_shared<Net>()`) with a forward(Tensor); its
  /// optimizer; any loss frugal::make_loss takes: a callable of (output, targets), a
  /// torch::nn::functional loss (cross_entropy, nll_loss) or an ATen one (torch::nll_loss),
  /// called with its defaults.
  template <typename Model, typename Loss,
            typename = std::enable_if_t<!std::is_invocable_v<Loss&, const Batch&> &&
                                        !std::is_convertible_v<Model, std::string>>>
  Trainer(Model model, torch::optim::Optimizer& optimizer, Loss&& loss, TrainerOptions options = {})
      : Trainer(nn::module_pointer(model), optimizer, nn::tensor_forward(model),
                make_loss(std::forward<Loss>(loss)), std::move(options)) {}
  /// A forward of the inputs other than the module's own, and a loss of (output, targets).
  Trainer(std::shared_ptr<torch::nn::Module> module, torch::optim::Optimizer& optimizer,
          ForwardFn forward, LossFn loss, TrainerOptions options = {});
  /// Several tensors a sample: `forward` receives each micro-batch (inputs, targets and its
  /// named tensors, Batch::get), `loss` its output and the same micro-batch. evaluate()
  /// reports loss and accuracy as with a plain forward.
  ///
  /// Example:
  ///   frugal::Trainer trainer(
  ///       model.ptr(), adam,
  ///       [&](const frugal::Batch& b) { return model->forward(b.inputs, b.get("mask")); },
  ///       [](const torch::Tensor& logits, const frugal::Batch& b) {
  ///         return torch::nn::functional::cross_entropy(logits.flatten(0, 1),
  ///         b.targets.flatten());
  ///       });
  Trainer(std::shared_ptr<torch::nn::Module> module, torch::optim::Optimizer& optimizer,
          BatchForwardFn forward, OutputLossFn loss, TrainerOptions options = {});
  /// A user callable computes the loss of a (micro-)batch; evaluate() reports its loss only.
  Trainer(std::shared_ptr<torch::nn::Module> module, torch::optim::Optimizer& optimizer,
          BatchLossFn batch_loss, TrainerOptions options = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  /// Runs one batch: forward and backward per micro-batch, and the optimizer step when the
  /// accumulation window is full.
  StepReport step(const Batch& batch);
  /// Runs forward and backward of a batch as step() would, under the same policies, but
  /// neither steps the optimizer nor keeps the gradients: parameters, gradients and the
  /// accumulation window are as before. The report gives peaks and phase times.
  StepReport trial(const Batch& batch);
  /// Steps a partial accumulation window, normalised by its own count. Returns whether
  /// there was one.
  bool flush();
  /// After a PartialStepError, lets the trainer go on from the model and optimizer state as
  /// they are (step(), trial() and flush() refuse until then, or until a new Trainer).
  void accept_partial_update();
  /// Why the trainer refuses to step, or empty.
  const std::string& halted() const;
  /// Loss (and accuracy, for class targets) under no_grad in eval mode, in batches of
  /// `batch_size` (default: the eval_batch option). The module's mode is restored after.
  /// The report goes to the sinks.
  EvalReport evaluate(const Batch& data, c10::optional<std::int64_t> batch_size = c10::nullopt);
  EvalReport evaluate(const Batch& data, const EvaluateOptions& options);
  /// The same over batches from an iterable: a torch::data DataLoader (`*loader`), a vector
  /// of Batch; one report, the mean over all their samples. Only one batch (and its chunks)
  /// is in memory at a time.
  ///
  /// Example:
  ///   auto report = trainer.evaluate(*test_loader);
  template <typename Batches,
            typename = std::enable_if_t<!std::is_convertible_v<Batches&, const Batch&>>,
            typename = decltype(std::begin(std::declval<Batches&>()))>
  EvalReport evaluate(Batches& batches, const EvaluateOptions& options = {}) {
    auto it = std::begin(batches);
    const auto end = std::end(batches);
    return evaluate_each(
        [&]() -> c10::optional<Batch> {
          if (it == end) {
            return c10::nullopt;
          }
          auto batch = to_batch(*it);
          ++it;
          return batch;
        },
        options);
  }
  /// evaluate() over the batches `next` returns until it returns none.
  EvalReport evaluate_each(const std::function<c10::optional<Batch>()>& next,
                           const EvaluateOptions& options = {});

  /// Adds a policy after the others. Refused (with an error naming both and the rule) where
  /// its traits cannot meet those of one already added or of the optimizer, e.g. a policy
  /// that needs all gradients at once beside one that updates parameters during backward.
  Trainer& add_policy(std::shared_ptr<Policy> policy);
  const std::vector<std::shared_ptr<Policy>>& policies() const;
  Trainer& add_hook(Phase phase, HookPolicy::Fn fn);
  Trainer& add_sink(std::shared_ptr<ReportSink> sink);

  /// The micro-batch size in use (0: the whole batch); policies may change it.
  std::int64_t micro_batch() const override;
  void set_micro_batch(std::int64_t size) override;
  /// The evaluation batch size in use (0: the micro-batch, else the whole set).
  std::int64_t eval_batch() const override;
  void set_eval_batch(std::int64_t size) override;

  const TrainerOptions& options() const;
  const MemoryProbe& probe() const override;
  torch::nn::Module& module() override;
  torch::optim::Optimizer& optimizer() override;
  std::int64_t steps() const override;
  std::int64_t skipped_steps() const override;
  /// The traits of the policies added so far, together.
  Traits traits() const;
  void set_unscale(Unscale unscale) override;
  void unscale_gradients() override;
  /// True between the first batch of an accumulation window and the step that ends it.
  bool window_open() const;
  TrainerCounters counters() const;
  /// Puts back counters read from a saved state (frugal::load_training_state, which puts
  /// back everything else first) and lifts a halt; refused inside an accumulation window.
  void restore_counters(const TrainerCounters& counters);

 private:
  Trainer(std::shared_ptr<torch::nn::Module> module, torch::optim::Optimizer& optimizer,
          BatchForwardFn forward, OutputLossFn loss, BatchLossFn batch_loss,
          TrainerOptions options);

  // The step runner, the optimizer phase, the policy set and the state they share
  // (src/train), each a class with its own test.
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace frugal
