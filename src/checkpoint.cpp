#include "frugal/checkpoint.h"

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/torch.h>

#include <atomic>
#include <map>
#include <set>

#include "checkpoint_observer.h"
#include "compat.h"
#include "frugal/autocast_guard.h"
#include "frugal/error.h"
#include "frugal/memory/memory_context.h"
#include "optim/weight_codes.h"

namespace frugal {
namespace {

std::atomic<CheckpointObserver*> the_observer{nullptr};

void observe(CheckpointPhase phase, const std::string& block,
             const std::vector<torch::Tensor>& outputs = {}) {
  if (auto* o = the_observer.load()) {
    o->on(phase, block, outputs);
  }
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct AutocastState {
  bool enabled = false;
  torch::Dtype dtype = torch::kBFloat16;

  static AutocastState of(torch::DeviceType type) {
    return {compat::autocast_enabled(type), compat::autocast_dtype(type)};
  }
};

// RNG states of the CPU generator and of the CUDA generators of some devices.
struct RngStates {
  torch::Tensor cpu;
  std::map<int, torch::Tensor> cuda;

  static RngStates capture(const std::set<int>& cuda_devices) {
    RngStates s;
    auto gen = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      s.cpu = gen.get_state();
    }
#ifdef FRUGAL_WITH_CUDA
    for (int d : cuda_devices) {
      s.cuda[d] = compat::cuda_rng_state(d);
    }
#else
    (void)cuda_devices;
#endif
    return s;
  }

  void restore() const {
    auto gen = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(cpu);
    }
#ifdef FRUGAL_WITH_CUDA
    for (const auto& [d, state] : cuda) {
      compat::set_cuda_rng_state(d, state);
    }
#endif
  }
};

// The values of the buffers a recompute would change a second time (BatchNorm's running
// statistics), put back after it.
class KeptBuffers {
 public:
  explicit KeptBuffers(const std::vector<torch::Tensor>& buffers) : buffers_(buffers) {
    torch::NoGradGuard no_grad;
    for (const auto& b : buffers_) {
      values_.push_back(b.defined() ? b.clone() : torch::Tensor());
    }
  }
  void put_back() {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < buffers_.size(); ++i) {
      if (values_[i].defined()) {
        buffers_[i].copy_(values_[i]);
      }
    }
    values_.clear();
  }

 private:
  const std::vector<torch::Tensor>& buffers_;
  std::vector<torch::Tensor> values_;
};

// What the backward needs of the forward: the block, the RNG and autocast states it ran
// under, and how many of the saved tensors are inputs (the rest are parameters).
struct CheckpointState : torch::CustomClassHolder {
  TensorsFn run;
  bool preserve_rng = true;
  std::set<int> cuda_devices;
  RngStates rng;
  std::vector<torch::Tensor> buffers;
  AutocastState cpu_autocast;
  AutocastState cuda_autocast;
  std::size_t inputs = 0;
  std::string name;  // CheckpointOptions::name

  // " 'blocks.3'" for a named block, "" otherwise: for error messages.
  std::string quoted() const { return name.empty() ? "" : " '" + name + "'"; }
};

std::set<int> cuda_devices_of(at::TensorList a, at::TensorList b) {
  std::set<int> devices;
  for (const auto& list : {a, b}) {
    for (const auto& t : list) {
      if (t.defined() && t.is_cuda()) {
        devices.insert(t.get_device());
      }
    }
  }
  return devices;
}

// Whether the backward running now will accumulate into each of `params` (an ordinary
// backward, or one whose `inputs` name them) rather than capture their gradients
// (torch::autograd::grad) or leave them alone.
bool accumulates_into(const std::vector<torch::Tensor>& params) {
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  if (exec_info == nullptr) {
    return false;
  }
  if (exec_info->empty()) {
    return true;
  }
  for (const auto& p : params) {
    const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(p);
    if (accumulator == nullptr) {
      return false;
    }
    const auto it = exec_info->find(accumulator.get());
    if (it == exec_info->end() || !it->second.needed_ || it->second.captures_) {
      return false;
    }
  }
  return true;
}

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<CheckpointState> state,
                               at::TensorList inputs, at::TensorList params) {
    state->inputs = inputs.size();
    state->cuda_devices = cuda_devices_of(inputs, params);
    if (state->preserve_rng) {
      state->rng = RngStates::capture(state->cuda_devices);
    }
    state->cpu_autocast = AutocastState::of(torch::kCPU);
    state->cuda_autocast = AutocastState::of(torch::kCUDA);
    variable_list saved(inputs.begin(), inputs.end());
    saved.insert(saved.end(), params.begin(), params.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    torch::NoGradGuard no_grad;
    observe(CheckpointPhase::ForwardBegin, state->name);
    auto outputs = state->run(std::vector<torch::Tensor>(inputs.begin(), inputs.end()));
    observe(CheckpointPhase::ForwardEnd, state->name, outputs);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    FRUGAL_CHECK(!torch::GradMode::is_enabled(),
                 "frugal: checkpoint does not support double backward (backward with "
                 "create_graph=true through a checkpointed block)");
    auto state = c10::static_intrusive_pointer_cast<CheckpointState>(
        ctx->saved_data.at("state").toCapsule());
    variable_list saved;
    try {
      saved = ctx->get_saved_variables();
    } catch (const c10::Error&) {
      FRUGAL_CHECK(false, "frugal: backward through the checkpointed block", state->quoted(),
                   " a second time: the "
                   "first backward freed its saved inputs (pass retain_graph=true to the first "
                   "backward to go through it again)");
    }
    // The block's buffers as the recompute finds them, put back after the gradients are
    // taken (BatchNorm's backward checks the running statistics it saved are unchanged).
    KeptBuffers buffers(state->buffers);
    try {
      auto result = recompute_gradients(state.get(), saved, grad_outputs);
      buffers.put_back();
      return result;
    } catch (...) {
      buffers.put_back();
      throw;
    }
  }

  // Recomputes the block under the forward's RNG and autocast state (leaving the caller's
  // RNG stream as it was) and returns the gradients of its inputs and parameters.
  static variable_list recompute_gradients(CheckpointState* state, const variable_list& saved,
                                           const variable_list& grad_outputs) {
    const std::vector<torch::Tensor> params(saved.begin() + state->inputs, saved.end());
    std::vector<torch::Tensor> detached;
    for (std::size_t i = 0; i < state->inputs; ++i) {
      const auto& x = saved[i];
      detached.push_back(x.detach().requires_grad_(x.requires_grad()));
    }
    variable_list outputs;
    {
      c10::optional<RngStates> caller;
      if (state->preserve_rng) {
        caller = RngStates::capture(state->cuda_devices);
        state->rng.restore();
      }
      try {
        AutocastGuard cpu(torch::kCPU, state->cpu_autocast.dtype, state->cpu_autocast.enabled);
        AutocastGuard cuda(torch::kCUDA, state->cuda_autocast.dtype, state->cuda_autocast.enabled);
        torch::AutoGradMode grad(true);
        const PhaseScope phase(MemoryPhase::Recompute);
        observe(CheckpointPhase::RecomputeBegin, state->name);
        outputs = state->run(detached);
        observe(CheckpointPhase::RecomputeEnd, state->name, outputs);
      } catch (...) {
        if (caller) {
          caller->restore();
        }
        throw;
      }
      if (caller) {
        caller->restore();
      }
    }

    std::vector<torch::Tensor> roots, root_grads, targets;
    std::vector<std::size_t> target_slots;
    for (std::size_t i = 0; i < outputs.size() && i < grad_outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && grad_outputs[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grad_outputs[i]);
      }
    }
    for (std::size_t i = 0; i < detached.size(); ++i) {
      if (detached[i].requires_grad()) {
        targets.push_back(detached[i]);
        target_slots.push_back(i);
      }
    }
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (params[i].defined() && params[i].requires_grad()) {
        targets.push_back(params[i]);
        target_slots.push_back(state->inputs + i);
      }
    }
    // Slot 0 is the state argument; then inputs, then parameters.
    variable_list result(1 + saved.size());
    if (targets.empty()) {
      observe(CheckpointPhase::BackwardEnd, state->name);
      return result;
    }
    FRUGAL_CHECK(!roots.empty(), "frugal: none of the checkpointed block", state->quoted(),
                 "'s outputs requires grad in the recompute, though ", targets.size(),
                 " of its inputs and "
                 "parameters do: the block detaches its outputs, or checkpointing it is "
                 "unnecessary");
    std::vector<torch::Tensor> trained;
    for (std::size_t k = 0; k < targets.size(); ++k) {
      if (target_slots[k] >= state->inputs) {
        trained.push_back(targets[k]);
      }
    }
    if (accumulates_into(trained)) {
      // Each parameter's gradient is accumulated into its .grad as
      // soon as the recompute's backward produces it (its hooks, the step in backward among
      // them, see it then), not all of the block's at its end. The parameters' slots stay
      // empty, and the outer accumulators, given nothing, add nothing.
      torch::autograd::backward(roots, root_grads, /*retain_graph=*/false,
                                /*create_graph=*/false, targets);
      for (std::size_t k = 0; k < targets.size() && target_slots[k] < state->inputs; ++k) {
        result[1 + target_slots[k]] = targets[k].grad();
      }
    } else {
      // torch::autograd::grad from outside, or a backward whose `inputs` leave some
      // parameter out: the gradients go back through the graph, which captures them or
      // accumulates them as it was asked.
      const auto grads = torch::autograd::grad(roots, targets, root_grads, /*retain_graph=*/false,
                                               /*create_graph=*/false, /*allow_unused=*/true);
      for (std::size_t k = 0; k < grads.size(); ++k) {
        result[1 + target_slots[k]] = grads[k];
      }
    }
    observe(CheckpointPhase::BackwardEnd, state->name);
    return result;
  }
};

}  // namespace

std::vector<torch::Tensor> checkpoint_tensors(TensorsFn fn,
                                              const std::vector<torch::Tensor>& inputs,
                                              const CheckpointOptions& options) {
  FRUGAL_CHECK(fn != nullptr, "frugal: checkpoint needs a function");
  // Undefined inputs cannot be autograd inputs: they are put back in their slots for the
  // block, which sees exactly what it was given.
  std::vector<torch::Tensor> present;
  std::vector<std::size_t> slots;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].defined()) {
      present.push_back(inputs[i]);
      slots.push_back(i);
    }
  }
  auto state = c10::make_intrusive<CheckpointState>();
  state->run = [fn = std::move(fn), slots,
                n = inputs.size()](const std::vector<torch::Tensor>& in) {
    std::vector<torch::Tensor> full(n);
    for (std::size_t k = 0; k < slots.size(); ++k) {
      full[slots[k]] = in[k];
    }
    return fn(full);
  };
  state->preserve_rng = options.preserve_rng_state();
  state->buffers = options.buffers();
  state->name = options.name();
  return CheckpointFunction::apply(state, at::TensorList(present),
                                   at::TensorList(options.params()));
}

CheckpointObserver* set_checkpoint_observer(CheckpointObserver* observer) {
  return the_observer.exchange(observer);
}

std::vector<torch::Tensor> training_buffers(const torch::nn::Module& module) {
  std::vector<torch::Tensor> buffers;
  auto add = [&buffers](const torch::nn::Module& m) {
    if (m.is_training()) {
      for (const auto& b : m.buffers(/*recurse=*/false)) {
        // Not 8-bit weights' codes: the recompute reads them, and the step in backward
        // writes them while the block's backward runs.
        if (!optim::detail::holds_stored_weights(b)) {
          buffers.push_back(b);
        }
      }
    }
  };
  add(module);
  for (const auto& child : module.modules(/*include_self=*/false)) {
    add(*child);
  }
  return buffers;
}

torch::Tensor checkpoint_sequential(torch::nn::Sequential& seq, std::int64_t segments,
                                    const torch::Tensor& input, CheckpointOptions options) {
  const auto n = static_cast<std::int64_t>(seq->size());
  FRUGAL_CHECK(segments >= 1, "frugal: checkpoint_sequential needs segments >= 1, got ", segments);
  FRUGAL_CHECK(n >= 1, "frugal: checkpoint_sequential of an empty Sequential");
  auto run_range = [&seq](std::int64_t from, std::int64_t to, torch::Tensor x) {
    for (std::int64_t i = from; i < to; ++i) {
      x = (seq->begin() + i)->forward(x);
    }
    return x;
  };
  if (!torch::GradMode::is_enabled()) {
    return run_range(0, n, input);
  }
  const std::int64_t size = n / segments;
  std::int64_t start = 0;
  torch::Tensor x = input;
  for (; size > 0 && start < size * (segments - 1); start += size) {
    std::vector<torch::Tensor> params;
    std::vector<torch::Tensor> buffers;
    for (std::int64_t i = start; i < start + size; ++i) {
      const auto& module = *seq->ptr(static_cast<std::size_t>(i));
      const auto p = module.parameters();
      params.insert(params.end(), p.begin(), p.end());
      const auto b = training_buffers(module);
      buffers.insert(buffers.end(), b.begin(), b.end());
    }
    const std::int64_t end = start + size;
    x = checkpoint_tensors(
            [run_range, start, end](const std::vector<torch::Tensor>& in) {
              return std::vector<torch::Tensor>{run_range(start, end, in.at(0))};
            },
            {x}, CheckpointOptions(options).params(params).buffers(buffers))
            .at(0);
  }
  return run_range(start, n, x);
}

}  // namespace frugal
