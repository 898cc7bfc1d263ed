// What frugal's optimizers share: an all-or-nothing step that updates each parameter in
// place, chunk by chunk, and a step for one parameter at a time.
#pragma once

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

#include "frugal/memory/ledger.h"

namespace frugal::optim {
namespace detail {
struct StoredWeights;
}  // namespace detail

/// How the update of a bfloat16 (or float16) parameter, computed in float32, is written back.
/// An update smaller than half the gap between two bfloat16 values around the weight (2^-9
/// of it) is lost when rounded to nearest: after the first steps of training, most are.
enum class Rounding {
  /// To the nearest value: what a cast does, and what LibTorch's optimizers do on bfloat16
  /// parameters. Small updates are lost.
  Nearest,
  /// Up or down at random, up with probability (x - down) / (up - down): the weight equals
  /// the float32 result in expectation, so small updates add up. The random bits come from
  /// InPlaceOptions::seed and a count of updates that the optimizer saves, so a resumed run
  /// rounds as the uninterrupted one would. bfloat16 parameters only; float16 ones round to
  /// nearest.
  Stochastic,
  /// To nearest, keeping what rounding lost in a compensation buffer of the parameter's
  /// dtype that joins the weight at the next update (Kahan summation): deterministic, and
  /// about 16 bits of precision, at 2 bytes a parameter more (optimizer state in the ledger).
  Compensated,
};

/// Options of the in-place update, beside the optimizer's own (torch's) options.
///
/// Example:
///   frugal::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-3),
///                            frugal::optim::InPlaceOptions().chunk(1 << 18));
struct InPlaceOptions {
  /// Elements updated at a time on the CPU. The step's scratch is a few buffers of this many
  /// elements (at most the largest parameter's), instead of whole-parameter temporaries.
  TORCH_ARG(std::int64_t, chunk) = 1 << 16;
  /// Bytes of scratch a step may use on a GPU, where a chunk costs a kernel launch per pass
  /// whatever its size: chunks there grow until their buffers hold this many bytes (never
  /// fewer elements than `chunk`), so a 4096 x 4096 float32 matrix is one chunk under Adam,
  /// not 256. 0: `chunk` on every device.
  TORCH_ARG(std::int64_t, device_scratch) = std::int64_t{64} << 20;
  /// How bfloat16 and float16 parameters take their update (computed in float32); float32
  /// and float64 parameters are updated exactly as LibTorch's optimizer would.
  TORCH_ARG(Rounding, rounding) = Rounding::Stochastic;
  /// The seed of stochastic rounding's random bits (of the weights, and of 4-bit optimizer
  /// states' codes).
  TORCH_ARG(std::uint64_t, seed) = 0;
};

/// One parameter's update, as an optimizer's `update` receives it: the tensors, the
/// group's options and the state, and chunk views that cover the parameter.
struct ParamUpdate {
  torch::Tensor param;
  torch::Tensor grad;
  torch::optim::OptimizerOptions& options;
  torch::optim::OptimizerParamState* state = nullptr;  ///< null where the update keeps none
  bool fresh = false;                  ///< the state was just made: its buffers hold no values yet
  bool flat = true;                    ///< contiguous: chunks are ranges of the flattened tensors
  std::int64_t chunk = 0;              ///< elements per chunk (the whole parameter if not flat)
  std::vector<torch::Tensor> scratch;  ///< buffers of at least `chunk` elements
  /// The parameter's own stream of random bits, from InPlaceOptions::seed and its place among
  /// the optimizer's parameters: an update that rounds its state stochastically keys each
  /// step's bits from this and a count of the state's (saved) steps.
  std::uint64_t stream = 0;

  std::int64_t numel() const { return param.numel(); }
  /// The parameter's elements [offset, offset + length) to compute the update on: `part` of
  /// the parameter itself for float32 and float64 ones; for bfloat16 and float16 ones a
  /// float32 copy (with the compensation added, under Rounding::Compensated), which
  /// store_weights writes back. An update reads the weights through this and nothing else.
  torch::Tensor weights(std::int64_t offset, std::int64_t length);
  /// Writes `w`, what weights(offset, length) returned, updated, back into the parameter
  /// with the optimizer's Rounding; nothing to do for a parameter updated in place. May
  /// overwrite `w`.
  void store_weights(torch::Tensor& w, std::int64_t offset, std::int64_t length);
  /// Elements [offset, offset + length) of `t`, a tensor shaped like the parameter.
  torch::Tensor part(const torch::Tensor& t, std::int64_t offset, std::int64_t length) const;
  /// The first `length` elements of scratch buffer `i`, shaped like `part` returns.
  torch::Tensor scratch_part(std::size_t i, std::int64_t length) const;

  /// Set by the optimizer for a bfloat16 or float16 parameter, and for one whose weights
  /// are stored in 8 bits (frugal::nn::Int8Weights): then weights() decodes them and
  /// store_weights encodes them again, and `param` only gives the shape and dtype.
  struct LowPrecision {
    Rounding rounding = Rounding::Nearest;
    std::uint64_t key = 0;                    ///< this update's stream of random bits (Stochastic)
    torch::Tensor compensation;               ///< shaped like the parameter (Compensated)
    std::vector<torch::Tensor> buffers;       ///< float32 weights; random bits off the CPU
    detail::StoredWeights* stored = nullptr;  ///< the 8-bit codes, or null
  };
  LowPrecision* low = nullptr;  ///< null: the parameter is updated in place
};

/// The base of frugal's optimizers (frugal::optim::SGD, Adam, AdamW). Each is a subclass
/// of LibTorch's optimizer of the same name, with its options, parameter groups, state and
/// serialization, so torch::save/load, LR changes and frugal's ledger see an ordinary
/// optimizer; only the step differs:
/// - it updates every parameter in place, chunk by chunk: the scratch is bounded by
///   InPlaceOptions::chunk, where LibTorch's step allocates whole-parameter temporaries;
/// - it is all-or-nothing: every allocation the step needs (new state, scratch) is made
///   before any parameter or state changes, so an error (out of memory, a bad gradient)
///   leaves parameters and optimizer state as they were;
/// - `step_parameter` updates one parameter as the step would: the optimizer step in
///   backward (frugal::StepInBackward) calls it as each gradient becomes ready.
class InPlaceOptimizer : public LedgerParts {
 public:
  virtual ~InPlaceOptimizer() = default;

  /// Updates `param` (one of this optimizer's parameters) from its gradient, exactly as
  /// step() would; does nothing when the gradient is undefined. All or nothing.
  void step_parameter(const torch::Tensor& param);

  const InPlaceOptions& in_place_options() const { return in_place_; }
  /// The optimizer itself, as LibTorch's interface.
  virtual torch::optim::Optimizer& optimizer() = 0;
  /// Bytes of scratch one step needs at most: the buffers of the largest parameter's chunks,
  /// with the float32 weights (and, off the CPU, random bits) that a bfloat16, float16 or
  /// 8-bit parameter is updated through.
  std::int64_t scratch_bytes();
  /// The compensation buffers of Rounding::Compensated: optimizer state to the ledger.
  std::vector<torch::Tensor> ledger_optimizer_state() const override;

 protected:
  explicit InPlaceOptimizer(InPlaceOptions options);

  /// The whole step: what step() overrides call.
  torch::Tensor run_step(const torch::optim::Optimizer::LossClosure& closure);
  /// What the rounding of low-precision parameters keeps (the count of updates that keys
  /// the random bits, the compensation buffers), beside the optimizer's own archive.
  void save_rounding(torch::serialize::OutputArchive& archive) const;
  /// Reads what save_rounding wrote (nothing, from an archive without it), checked against
  /// the parameters; throws naming what does not fit and changes nothing. `commit` then
  /// puts it in place, after the optimizer's own state loaded.
  std::function<void()> load_rounding(torch::serialize::InputArchive& archive);

  /// A new state for `param` whose buffers are allocated, not filled (`fresh`); null when
  /// these options keep no state (SGD without momentum).
  virtual std::unique_ptr<torch::optim::OptimizerParamState> make_state(
      const torch::Tensor& param, const torch::optim::OptimizerOptions& options) const = 0;
  /// Chunk-sized scratch buffers the update needs under these options.
  virtual int scratch_buffers(const torch::optim::OptimizerOptions& options) const = 0;
  /// The same for one parameter, updated flat (contiguous) or not, with its state (the one
  /// the step will make, if it has none yet; null if the optimizer keeps none): scratch_buffers
  /// unless an optimizer needs less for some parameters.
  virtual int scratch_buffers(const torch::Tensor& /*param*/, bool /*flat*/,
                              const torch::optim::OptimizerParamState* /*state*/,
                              const torch::optim::OptimizerOptions& options) const {
    return scratch_buffers(options);
  }
  /// Updates one parameter in place; must not allocate tensors (all-or-nothing).
  virtual void update(ParamUpdate& u) const = 0;
  /// The dtype of the scratch buffers for `param`: its own, unless the update computes in
  /// another (frugal's 8-bit optimizers compute in float32).
  virtual c10::ScalarType scratch_type(const torch::Tensor& param) const {
    return param.scalar_type();
  }
  /// Chunks of `param` are a multiple of this many elements (8-bit states: the quantization
  /// block; factored ones: whole rows too). `state` as for scratch_buffers.
  virtual std::int64_t chunk_multiple(const torch::Tensor& /*param*/,
                                      const torch::optim::OptimizerParamState* /*state*/,
                                      const torch::optim::OptimizerOptions& /*options*/) const {
    return 1;
  }

 private:
  struct Planned;
  void apply(std::vector<Planned>& work);
  void plan_low_precision(Planned& w);
  // The group of `param` and its place among all the groups' parameters.
  std::pair<torch::optim::OptimizerParamGroup*, std::uint64_t> group_of(const torch::Tensor& param);
  std::int64_t chunk_of(const torch::Tensor& param, bool flat,
                        const torch::optim::OptimizerParamState* state,
                        const torch::optim::OptimizerOptions& options) const;
  // The scratch bytes an element of `param`'s chunk needs: the update's buffers and the
  // float32 weights (and random bits) a low-precision or 8-bit parameter goes through.
  std::int64_t scratch_per_element(const torch::Tensor& param, bool flat,
                                   const torch::optim::OptimizerParamState* state,
                                   const torch::optim::OptimizerOptions& options) const;

  std::vector<torch::Tensor> all_params();

  InPlaceOptions in_place_;
  // TensorImpl -> its group and its place among all the groups' parameters
  std::unordered_map<const void*, std::pair<std::size_t, std::uint64_t>> group_index_;
  std::uint64_t updates_ = 0;  // low-precision updates stochastically rounded so far
  std::unordered_map<const void*, torch::Tensor> compensation_;  // TensorImpl -> buffer
};

/// LibTorch's optimizer `Torch` with the in-place step, its update given by `Rule`: the base
/// of frugal's SGD, Adam and AdamW, and the one to build another from. `Rule` is a type with
/// three static functions of the group's `Options`:
///   std::unique_ptr<torch::optim::OptimizerParamState> make_state(const torch::Tensor& param,
///                                                                 const Options& options);
///   int scratch_buffers(const Options& options);
///   void update(ParamUpdate& u, const Options& options);
/// what InPlaceOptimizer's make_state, scratch_buffers and update say they do.
template <typename Torch, typename Options, typename Rule>
class InPlace : public Torch, public InPlaceOptimizer {
 public:
  explicit InPlace(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                   Options defaults = {}, InPlaceOptions in_place = {})
      : Torch(groups, std::move(defaults)), InPlaceOptimizer(in_place) {}
  explicit InPlace(std::vector<torch::Tensor> params, Options defaults = {},
                   InPlaceOptions in_place = {})
      : Torch(std::move(params), std::move(defaults)), InPlaceOptimizer(in_place) {}

  torch::Tensor step(typename Torch::LossClosure closure = nullptr) override {
    return run_step(closure);
  }
  torch::optim::Optimizer& optimizer() override { return *this; }
  void save(torch::serialize::OutputArchive& archive) const override {
    Torch::save(archive);
    save_rounding(archive);
  }
  void load(torch::serialize::InputArchive& archive) override {
    auto commit = load_rounding(archive);
    Torch::load(archive);
    commit();
  }

 protected:
  // Rule's functions, given the group's options as `Options` (defined below, out of the
  // class, so that frugal's own rules can stay in their .cpp files: see adam.h).
  std::unique_ptr<torch::optim::OptimizerParamState> make_state(
      const torch::Tensor& param, const torch::optim::OptimizerOptions& options) const override;
  int scratch_buffers(const torch::optim::OptimizerOptions& options) const override;
  void update(ParamUpdate& u) const override;
};

template <typename Torch, typename Options, typename Rule>
std::unique_ptr<torch::optim::OptimizerParamState> InPlace<Torch, Options, Rule>::make_state(
    const torch::Tensor& param, const torch::optim::OptimizerOptions& options) const {
  return Rule::make_state(param, static_cast<const Options&>(options));
}

template <typename Torch, typename Options, typename Rule>
int InPlace<Torch, Options, Rule>::scratch_buffers(
    const torch::optim::OptimizerOptions& options) const {
  return Rule::scratch_buffers(static_cast<const Options&>(options));
}

template <typename Torch, typename Options, typename Rule>
void InPlace<Torch, Options, Rule>::update(ParamUpdate& u) const {
  Rule::update(u, static_cast<const Options&>(u.options));
}

/// Calls `fn(offset, length)` for consecutive chunks covering `u`'s parameter.
template <typename Fn>
void for_each_chunk(const ParamUpdate& u, Fn fn) {
  for (std::int64_t offset = 0; offset < u.numel(); offset += u.chunk) {
    fn(offset, std::min(u.chunk, u.numel() - offset));
  }
}

}  // namespace frugal::optim
