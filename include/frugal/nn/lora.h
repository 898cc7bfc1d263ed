// Low-rank adapters (LoRA) on a model's Linear layers, the base frozen, in PEFT's layout.
#pragma once

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace frugal::nn {

namespace detail {
struct LoraState;
}  // namespace detail

/// What LoRA adapts and how, as PEFT's LoraConfig says it.
struct LoraOptions {
  /// The adapters' rank r: A is (r, in), B is (out, r).
  TORCH_ARG(std::int64_t, rank) = 8;
  /// The update is scaled by alpha / r (alpha / sqrt(r) with use_rslora).
  TORCH_ARG(double, alpha) = 8;
  TORCH_ARG(bool, use_rslora) = false;
  /// Dropout on the adapters' input, in [0, 1), applied while the layer is training (as
  /// PEFT's lora_dropout). Above 0 the model calls each adapted layer through
  /// frugal::nn::call (see Lora).
  TORCH_ARG(double, dropout) = 0;
  /// The Linear layers to adapt, as PEFT matches target_modules: a module whose qualified
  /// name equals an entry or ends with "." + entry. Empty: every Linear.
  TORCH_ARG(std::vector<std::string>, target_modules) = {};
  /// Written to adapter_config.json as fan_in_fan_out: true where the base model stores
  /// these layers' weights (in, out), as transformers' GPT-2 Conv1D does.
  TORCH_ARG(bool, fan_in_fan_out) = false;
};

/// LoRA (Hu et al. 2021) as PEFT builds it: each chosen torch::nn::Linear gets two adapter
/// matrices, registered as its children `lora_A` and `lora_B` (Linear layers without bias,
/// as PEFT names them), A initialised Kaiming-uniform and B zero, so training starts from
/// the base model's outputs; the layer computes x (W + s B A)^T + b with s = alpha / r. Every
/// other parameter of the model is frozen (requires_grad false: no gradients, no optimizer
/// state); `parameters()` are the adapters, for the optimizer.
///
/// How the adapters reach the forward without a change to the model's code: LibTorch calls
/// a Linear's forward directly and it reads the layer's `weight` member, so each `unit` (a
/// block the model calls through frugal::nn::call) folds its adapted layers' adapters into
/// that member for the call: W + s B A, recorded by autograd, so A and B get gradients. The
/// folded weight exists one unit at a time: its bytes go when the unit's forward ends and
/// come back (computed again) when backward reaches the unit; a checkpointed unit folds again
/// in its recompute. Between calls the member is an empty tensor: an adapted layer called
/// outside its unit fails loudly instead of silently leaving the adapters out. The
/// registered parameter `weight` (what named_parameters, state dicts and optimizers see)
/// is always the base.
///
/// With dropout the adapters see a masked copy of the layer's input, which no weight can
/// hold, so they run beside the layer instead: the model calls each adapted layer as
/// `frugal::nn::call(layer, x)` (one line each, inside the unit's forward), and that call
/// returns base(x) + s B A dropout(x) as PEFT computes it. The unit still makes the base
/// weight (from a FrozenWeights store too); the layer's member holds it only inside that
/// call, so a layer called directly fails loudly. A checkpointed unit recomputes the same
/// mask. In eval mode (or merged) nothing is dropped.
///
/// Adapters are saved and loaded in PEFT's layout (adapter_model.safetensors and
/// adapter_config.json), so PEFT loads frugal's adapters and frugal loads PEFT's.
///
/// Example:
///   GPT2 model(config);
///   frugal::nn::Lora lora(*model, model->blocks(), frugal::nn::LoraOptions().rank(8).alpha(16)
///                                                       .target_modules({"c_attn"}));
///   frugal::optim::AdamW adamw(lora.parameters(), torch::optim::AdamWOptions(2e-4));
///   ... train; then lora.save("adapter");  // loads in PEFT: PeftModel.from_pretrained
class Lora {
 public:
  /// Adapts the Linear layers of `model` that `options` chooses; each must lie inside exactly
  /// one of `units`. Refused, changing nothing, naming the layer or value: a rank below 1,
  /// an alpha that is not a finite number above 0, a dropout outside [0, 1), target_modules that
  /// match no Linear, a chosen layer outside every unit (or, with dropout, a unit itself), a unit
  /// that is a unit already, a model adapted already.
  Lora(torch::nn::Module& model, const std::vector<std::shared_ptr<torch::nn::Module>>& units,
       LoraOptions options = {});
  /// The model as it was: adapters removed, its parameters trainable again, the base
  /// unmerged.
  ~Lora();
  Lora(const Lora&) = delete;
  Lora& operator=(const Lora&) = delete;

  const LoraOptions& options() const { return options_; }
  /// s: alpha / r, or alpha / sqrt(r).
  double scaling() const;
  /// The adapters, A and B of each layer in the model's order.
  std::vector<torch::Tensor> parameters() const;
  /// The adapted layers' qualified names, in the model's order.
  std::vector<std::string> adapted() const;

  /// Adds s B A into each adapted layer's base weight (the unmerged base is kept, so
  /// `unmerge` restores it bit for bit); the units then run the base alone. Gradients do
  /// not reach the adapters while merged.
  void merge();
  void unmerge();
  bool merged() const;

  /// Writes `dir`/adapter_model.safetensors (each layer's `<prefix><name>.lora_A.weight` and
  /// `.lora_B.weight`, PEFT's `base_model.model.` prefix by default) and
  /// `dir`/adapter_config.json.
  void save(const std::string& dir, const std::string& prefix = "base_model.model.") const;
  /// Reads adapters written by `save` or by PEFT's save_pretrained into this Lora's. Their
  /// config must agree (r, lora_alpha, use_rslora, target_modules; lora_dropout is how they
  /// trained, not what they are, and may differ) and the file must hold every adapter with
  /// its shape; otherwise an error names each difference and nothing changes.
  void load(const std::string& dir, const std::string& prefix = "base_model.model.");

 private:
  LoraOptions options_;
  std::shared_ptr<detail::LoraState> state_;
};

/// The options an adapter_config.json (PEFT's or frugal's) describes.
LoraOptions read_lora_config(const std::string& dir);

}  // namespace frugal::nn
