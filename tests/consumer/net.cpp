// A program written the way LibTorch's MNIST example is: `struct Net : torch::nn::Module`
// held by std::make_shared, log-probabilities and torch::nll_loss, batches from a
// torch::data DataLoader; frugal takes it as it is.
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

int main() {
  torch::manual_seed(0);
  auto net = std::make_shared<Net>();
  torch::optim::SGD sgd(net->parameters(), 0.1);
  frugal::Trainer trainer(net, sgd, torch::nll_loss, frugal::TrainerOptions().micro_batch(4));
  auto loader = torch::data::make_data_loader(
      torch::data::datasets::TensorDataset(torch::randn({32, 8}))
          .map(torch::data::transforms::Stack<torch::data::TensorExample>()),
      torch::data::DataLoaderOptions().batch_size(8));
  std::int64_t steps = 0;
  double first = 0, last = 0;
  for (int epoch = 0; epoch < 3; ++epoch) {
    for (auto& batch : *loader) {
      const auto targets = batch.data.select(1, 0).gt(0).to(torch::kLong);  // learnable
      const auto report = trainer.step({batch.data, targets});
      first = steps == 0 ? report.loss : first;
      last = report.loss;
      ++steps;
    }
  }
  const bool ok = steps == 12 && trainer.steps() == 12 && last < first;
  fmt::print("consumer net: {} steps, loss {:.3f} -> {:.3f}: {}\n", steps, first, last,
             ok ? "ok" : "unexpected");
  return ok ? 0 : 1;
}
