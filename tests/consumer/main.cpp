// Trains a tiny model with an installed frugal and checks that the probe saw the step and
// that the fit loop ran.
#include <frugal/frugal.h>
#include <torch/torch.h>

#include <iostream>

int main() {
  torch::manual_seed(0);
  torch::nn::Linear model(8, 2);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  frugal::Trainer trainer(model, sgd, [](const torch::Tensor& out, const torch::Tensor& y) {
    return torch::mse_loss(out, y);
  }, frugal::TrainerOptions().micro_batch(2));
  const auto report = trainer.step({torch::randn({4, 8}), torch::randn({4, 2})});
  std::cout << report.summary() << "\n";
  // The fit loop too: one epoch of two batches after the step above.
  const auto fitted = frugal::fit(
      trainer, frugal::TensorData({torch::randn({8, 8}), torch::randn({8, 2})}),
      frugal::FitOptions().batch_size(4).handle_signals(false));
  const bool ok = report.micro_batches == 2 && report.ledger.weights == 4 * (8 * 2 + 2) &&
                  report.peak > 0 && fitted.steps == 3;
  std::cout << (ok ? "consumer: ok" : "consumer: unexpected report") << "\n";
  return ok ? 0 : 1;
}
