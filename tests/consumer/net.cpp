// A program written the way LibTorch's MNIST example is: `struct Net : torch::nn::Module`
// held by std::make_shared, log-probabilities and torch::nll_loss, batches from a
// torch::data DataLoader; frugal takes it as it is, fit and evaluate included.
#include <fmt/core.h>
#include <frugal/frugal.h>
#include <torch/torch.h>

struct Net : torch::nn::Module {
  Net()
      : fc1(register_module("fc1", torch::nn::Linear(8, 16))),
        fc2(register_module("fc2", torch::nn::Linear(16, 3))) {}
  torch::Tensor forward(torch::Tensor x) {
    return torch::log_softmax(fc2(torch::relu(fc1(x))), /*dim=*/1);
  }
  torch::nn::Linear fc1, fc2;
};

// Samples whose class is learnable from the first feature.
struct Samples : torch::data::datasets::Dataset<Samples> {
  Samples() : x(torch::randn({32, 8})), y(x.select(1, 0).gt(0).to(torch::kLong)) {}
  torch::data::Example<> get(std::size_t i) override {
    return {x[static_cast<std::int64_t>(i)], y[static_cast<std::int64_t>(i)]};
  }
  c10::optional<std::size_t> size() const override { return 32; }
  torch::Tensor x, y;
};

int main() {
  torch::manual_seed(0);
  auto net = std::make_shared<Net>();
  torch::optim::SGD sgd(net->parameters(), 0.1);
  frugal::Trainer trainer(net, sgd, torch::nll_loss, frugal::TrainerOptions().micro_batch(4));
  auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      Samples().map(torch::data::transforms::Stack<>()), 8);
  const double before = trainer.evaluate(*loader).loss;
  const auto fitted =
      frugal::fit(trainer, *loader, frugal::FitOptions().epochs(3).handle_signals(false));
  const auto after = trainer.evaluate(*loader);
  const bool ok = fitted.steps == 12 && trainer.steps() == 12 && after.loss < before &&
                  after.samples == 32 && after.accuracy >= 0;
  fmt::print("consumer net: {} steps, loss {:.3f} -> {:.3f}, accuracy {:.2f}: {}\n", fitted.steps,
             before, after.loss, after.accuracy, ok ? "ok" : "unexpected");
  return ok ? 0 : 1;
}
