// Trains a tiny model with an installed frugal, as the README shows (fmt::print included),
// and checks that the probe saw the step and that the fit loop ran.
#include <fmt/core.h>
#include <frugal/frugal.h>
#include <torch/torch.h>

int main() {
  torch::manual_seed(0);
  torch::nn::Linear model(8, 2);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  frugal::Trainer trainer(model, sgd, torch::nn::functional::mse_loss,
                          frugal::TrainerOptions().micro_batch(2));
  const auto report = trainer.step({torch::randn({4, 8}), torch::randn({4, 2})});
  fmt::print("{}\n", report.summary());
  // The fit loop too: one epoch of two batches after the step above.
  const auto fitted = frugal::fit(
      trainer, frugal::TensorData({torch::randn({8, 8}), torch::randn({8, 2})}),
      frugal::FitOptions().batch_size(4).handle_signals(false));
  const bool ok = report.micro_batches == 2 && report.ledger.weights == 4 * (8 * 2 + 2) &&
                  report.ledger.other >= 0 && report.peak > 0 && fitted.steps == 3;
  fmt::print("consumer: {}\n", ok ? "ok" : "unexpected report");
  return ok ? 0 : 1;
}
