// The one error of a step that changed some parameters before it failed, as the Trainer
// and the Loop both raise it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <stdexcept>
#include <string>

#include "engine/partial_step.h"

namespace {

TEST(PartialStep, NamesTheChangedParametersAndWhatTheOthersHold) {
  torch::nn::Sequential net(torch::nn::Linear(3, 4), torch::nn::Linear(4, 2));
  const auto params = net->named_parameters();
  const auto outside = torch::zeros({2});
  const auto error = frugal::detail::partial_step_error(
      *net, "the optimizer step of 'net'", {params["1.weight"], params["0.bias"], outside},
      std::runtime_error("the device went away"), "the others are as before");
  EXPECT_EQ(error.updated,
            (std::vector<std::string>{"1.weight", "0.bias", "(a parameter outside the module)"}));
  const std::string what = error.what();
  for (const char* part :
       {"frugal: the optimizer step of 'net' failed after changing 3 parameter(s): 1.weight, "
        "0.bias, (a parameter outside the module).",
        "hold new values; the others are as before.", "The error was: the device went away"}) {
    EXPECT_NE(what.find(part), std::string::npos) << part << " not in: " << what;
  }
}

TEST(PartialStep, CarriesTheMessageWithoutLibTorchsBacktrace) {
  torch::nn::Linear layer(2, 2);
  try {
    TORCH_CHECK(false, "kernel failed");
  } catch (const c10::Error& cause) {
    const auto error = frugal::detail::partial_step_error(*layer, "the step", {layer->weight},
                                                          cause, "the bias is as before");
    const std::string what = error.what();
    EXPECT_NE(what.find("The error was: kernel failed"), std::string::npos) << what;
    EXPECT_EQ(what.find("Exception raised from"), std::string::npos) << what;
  }
}

}  // namespace
