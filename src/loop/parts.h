// What frugal::Loop keeps of each model, shared by the Loop's sources.
#pragma once

#include <memory>
#include <vector>

#include "../engine/grad_ready.h"
#include "../engine/gradient_window.h"
#include "../memory/module_tensors.h"
#include "frugal/error.h"
#include "frugal/loop/loop.h"
#include "frugal/optim/in_place.h"

namespace frugal {

// A model's own pieces: the parameters its backward reaches, its gradient window (the
// weights of micro-batch losses, releasing gradients), the tensors the ledger counts, and
// what happened to it since its last step and in this iteration.
struct LoopModel::Parts {
  Parts(torch::nn::Module& module, torch::optim::Optimizer& optimizer, bool set_to_none)
      : window(optimizer, /*accumulate=*/1, set_to_none), tensors(module) {
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& p : group.params()) {
        if (p.requires_grad()) {
          trainable.push_back(p);
        }
      }
    }
  }
  std::vector<torch::Tensor> trainable;
  detail::GradientWindow window;
  detail::ModuleTensors tensors;
  bool pending = false;     // a backward reached it since its last step
  bool non_finite = false;  // a loss of those was NaN or infinite
  LoopModelReport iteration;
  // Loop::backward_step's: the optimizer as one that updates a parameter at a time and the
  // hooks that update each parameter as its gradient is ready, both set at the first call
  // the options allow, and the parameters updated in the current one.
  optim::InPlaceOptimizer* in_place = nullptr;
  std::unique_ptr<detail::GradReady> ready;
  std::vector<torch::Tensor> updated;
};

}  // namespace frugal
