// Adam and AdamW with 8-bit or 4-bit optimizer states: block-wise quantized moments, about
// 2 bytes a parameter (1 with 4 bits) instead of 8.
#pragma once

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/serialize.h>

#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "frugal/memory/ledger.h"
#include "frugal/optim/blockwise.h"
#include "frugal/optim/in_place.h"
#include "frugal/optim/state_format.h"

namespace frugal::optim {

/// How frugal's 8-bit (and 4-bit) optimizers store their states.
///
/// Example:
///   frugal::optim::Adam8bit adam(model->parameters(), torch::optim::AdamOptions(1e-3),
///                                frugal::optim::QuantizedStateOptions().block(2048));
struct QuantizedStateOptions {
  /// The codes' width: 8, or 4 (16 values of dynamic_map(..., 4), two codes a byte; the
  /// block must then be even, and 128 follows the moments more closely: Li et al., "Memory
  /// Efficient Optimizers with 4-bit States", 2023). See Adam4bit.
  TORCH_ARG(int, bits) = 8;
  /// Elements that share one float32 scale: smaller blocks follow outliers more closely
  /// and cost 4 bytes each (256: 1.6% of the codes' bytes).
  TORCH_ARG(std::int64_t, block) = 256;
  /// Parameters with fewer elements keep float32 states (biases, norms: little memory, and
  /// the most sensitive to quantization).
  TORCH_ARG(std::int64_t, min_elements) = 4096;
  /// Adam's second moment of a matrix (a parameter of 2+ dimensions, seen as its first
  /// dimension's rows by the rest) kept as Adafactor keeps it (Shazeer and Stern, 2018):
  /// moving averages of the squared gradient's row and column means, whose product over
  /// their mean stands for each element's. 4 bytes a row and a column instead of about 1 a
  /// parameter; taken wherever that is fewer bytes than the codes.
  TORCH_ARG(bool, factored) = false;
  /// Each step's new codes rounded up or down at random (to the code at or below the value or
  /// the one above, up with probability (value - below) / (above - below)), so that a code
  /// stands for its moment in expectation: a moment's changes smaller than half the gap
  /// between two codes add up instead of being lost (with 16 codes, most of the second
  /// moment's are). The random bits come from InPlaceOptions::seed, the parameter's place
  /// among the optimizer's parameters and its state's step count, so a resumed run rounds
  /// as the uninterrupted one. On in four_bit_states().
  TORCH_ARG(bool, stochastic_codes) = false;
};

/// One parameter's state in Adam8bit and AdamW8bit (and the 4-bit ones). Quantized (`block`
/// > 0): `exp_avg` and `exp_avg_sq` are uint8 codes shaped like the parameter (`bits` 8), or
/// ceil(numel / 2) bytes of two 4-bit codes each (`bits` 4: element 2k in the low half of
/// byte k, as quantize_blockwise packs them), into the signed dynamic map and
/// the unsigned one without zero (`signed_map`, `unsigned_map`: the 8-bit moment maps, shared
/// by every state on a device), with
/// one float32 scale per block of `block` elements. Factored (QuantizedStateOptions::factored):
/// `exp_avg_sq_row` and `exp_avg_sq_col` (float32, one per row and one per column) stand for
/// `exp_avg_sq`, which is undefined. Without a first moment (beta1 0 when the state was made)
/// `exp_avg` is undefined. Not quantized (`block` 0): float32 tensors shaped like the
/// parameter, as torch's Adam keeps them.
struct Adam8bitParamState : public torch::optim::OptimizerCloneableParamState<Adam8bitParamState>,
                            public StateTensorList {
  TORCH_ARG(std::int64_t, step) = 0;
  TORCH_ARG(std::int64_t, block) = 0;
  TORCH_ARG(std::int64_t, bits) = 8;  ///< the codes' width (a file without it: 8)
  TORCH_ARG(torch::Tensor, exp_avg);
  TORCH_ARG(torch::Tensor, exp_avg_scales);
  TORCH_ARG(torch::Tensor, exp_avg_sq);
  TORCH_ARG(torch::Tensor, exp_avg_sq_scales);
  TORCH_ARG(torch::Tensor, exp_avg_sq_row);
  TORCH_ARG(torch::Tensor, exp_avg_sq_col);
  TORCH_ARG(torch::Tensor, signed_map);    ///< not saved: the optimizer's, attached on load
  TORCH_ARG(torch::Tensor, unsigned_map);  ///< not saved: likewise

 public:
  bool quantized() const { return block() > 0; }
  bool factored() const { return exp_avg_sq_row().defined(); }
  std::vector<torch::Tensor> state_tensors() const override;
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

/// What the planner (frugal::MemoryPlanner) sees of a low-bit optimizer: the format of the
/// states it will make, and what they will cost.
class QuantizedStateOptimizer {
 public:
  virtual ~QuantizedStateOptimizer() = default;
  /// The format of states made from now on (parameters under
  /// QuantizedStateOptions::min_elements keep float32 states whatever it is).
  virtual StateFormat state_format() const = 0;
  /// Chooses it: refused, naming the call, once any state exists, and for bits other than
  /// 32, 8 or 4, or 4 with an odd block. Float32 keeps the width quantized states would take.
  virtual void set_state_format(const StateFormat& format) = 0;
  /// Bytes of state the first step would allocate for every parameter in `format`: codes
  /// (1 byte an element a moment, half a byte with 4 bits), scales (4 bytes a block a
  /// moment), a factored moment's rows and columns (4 bytes each) and the two code books
  /// (2 x 511 float32 per device; 2 x 31 with 4 bits); 8 bytes an element for float32 states.
  virtual std::int64_t pending_state_bytes(const StateFormat& format) const = 0;
};

/// Adam (coupled L2 weight decay, with AdamOptions) or AdamW (decoupled, with
/// AdamWOptions) on 8-bit states; see Adam8bit.
template <typename Options>
class Adam8bitBase : public torch::optim::Optimizer,
                     public InPlaceOptimizer,
                     public QuantizedStateOptimizer {
 public:
  explicit Adam8bitBase(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                        Options defaults = {}, QuantizedStateOptions quantized = {},
                        InPlaceOptions in_place = {});
  explicit Adam8bitBase(std::vector<torch::Tensor> params, Options defaults = {},
                        QuantizedStateOptions quantized = {}, InPlaceOptions in_place = {});

  torch::Tensor step(LossClosure closure = nullptr) override { return run_step(closure); }
  torch::optim::Optimizer& optimizer() override { return *this; }
  /// torch::save / torch::load: options as torch's Adam(W) saves them, states with their
  /// codes and scales. A load that does not fit these parameters (shapes, block size)
  /// fails naming the parameter and changes nothing.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  const QuantizedStateOptions& quantized_options() const { return quantized_; }
  StateFormat state_format() const override;
  void set_state_format(const StateFormat& format) override;
  std::int64_t pending_state_bytes(const StateFormat& format) const override;

 protected:
  std::unique_ptr<torch::optim::OptimizerParamState> make_state(
      const torch::Tensor& param, const torch::optim::OptimizerOptions& options) const override;
  int scratch_buffers(const torch::optim::OptimizerOptions& options) const override;
  int scratch_buffers(const torch::Tensor& param, bool flat,
                      const torch::optim::OptimizerParamState* state,
                      const torch::optim::OptimizerOptions& options) const override;
  void update(ParamUpdate& u) const override;
  c10::ScalarType scratch_type(const torch::Tensor&) const override { return torch::kFloat32; }
  std::int64_t chunk_multiple(const torch::Tensor& param,
                              const torch::optim::OptimizerParamState* state,
                              const torch::optim::OptimizerOptions& options) const override;

 private:
  // Refuses a change of the states' format (`call`, e.g. "set_state_format(4-bit)") once states
  // exist.
  void check_format_change(bool unchanged, const std::string& call) const;
  // These options with `format`'s width, factoring and rounding, checked.
  QuantizedStateOptions options_for(const StateFormat& format) const;
  struct Books;  // the two moments' code books on one device, for one width of codes
  const Books& books(torch::Device device, int bits) const;
  // Gives `s` the maps of its width of codes on `device`.
  void attach_books(Adam8bitParamState& s, torch::Device device) const;
  // What a parameter's state holds: its own, or the one make_state would give it (`state`
  // null) under `options`.
  struct Format;
  Format format_of(const torch::Tensor& param, const torch::optim::OptimizerParamState* state,
                   const torch::optim::OptimizerOptions& options) const;
  void update_factored(ParamUpdate& u, const Books& b) const;
  // Checks that loaded states fit these parameters, then moves them to their devices.
  void adopt_loaded();

  QuantizedStateOptions quantized_;
  bool enabled_ = true;
  // The books of each device and width of codes.
  mutable std::map<std::tuple<c10::DeviceType, c10::DeviceIndex, int>, std::shared_ptr<const Books>>
      books_;
};

extern template class Adam8bitBase<torch::optim::AdamOptions>;
extern template class Adam8bitBase<torch::optim::AdamWOptions>;

/// Adam whose moments are stored in 8 bits, block-wise quantized with the dynamic map of
/// Dettmers et al. (2021): 2 bytes a parameter (plus 8 bytes a block of 256) instead of 8.
/// With QuantizedStateOptions::factored, a matrix's second moment costs about nothing (1 byte
/// a parameter in all); with betas' beta1 0, the first moment is the gradient itself and is
/// stored in quantized states (a state made so refuses a later beta1 above 0).
/// The second moment's map has no zero (see dynamic_map): without that, training the
/// Fashion-MNIST CNN lost 3 to 5 points of accuracy against float32 Adam.
/// Each step dequantizes a chunk of the moments into float32 scratch, updates them and the
/// parameter exactly as Adam does, and quantizes them back; the scratch is 4 buffers of
/// InPlaceOptions::chunk elements, never a whole state. Options are torch's AdamOptions
/// (AMSGrad is not offered); the step is frugal's (in place, all or nothing, usable by
/// StepInBackward); torch::save/load round-trips the codes bit for bit.
///
/// Example:
///   frugal::optim::Adam8bit adam(model->parameters(), torch::optim::AdamOptions(1e-3));
class Adam8bit : public Adam8bitBase<torch::optim::AdamOptions> {
 public:
  using Adam8bitBase::Adam8bitBase;  // (params or groups, AdamOptions, QuantizedStateOptions,
                                     //  InPlaceOptions)
};

/// AdamW (decoupled weight decay) on 8-bit states; see Adam8bit.
///
/// Example:
///   frugal::optim::AdamW8bit adamw(model->parameters(),
///                                  torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
class AdamW8bit : public Adam8bitBase<torch::optim::AdamWOptions> {
 public:
  using Adam8bitBase::Adam8bitBase;
};

/// The states of Adam4bit and AdamW4bit when none are given: 4-bit codes in blocks of 128.
inline QuantizedStateOptions four_bit_states() {
  return QuantizedStateOptions().bits(4).block(128).stochastic_codes(true);
}

/// Adam8bitBase with 4-bit codes: QuantizedStateOptions::bits is 4 whatever the options
/// given say, and their default is four_bit_states(); see Adam4bit.
template <typename Options>
class Adam4bitBase : public Adam8bitBase<Options> {
 public:
  explicit Adam4bitBase(std::vector<torch::Tensor> params, Options defaults = {},
                        QuantizedStateOptions quantized = four_bit_states(),
                        InPlaceOptions in_place = {})
      : Adam8bitBase<Options>(std::move(params), defaults, quantized.bits(4), in_place) {}
  explicit Adam4bitBase(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                        Options defaults = {}, QuantizedStateOptions quantized = four_bit_states(),
                        InPlaceOptions in_place = {})
      : Adam8bitBase<Options>(groups, defaults, quantized.bits(4), in_place) {}
};

/// Adam on 4-bit states (half a byte an element a moment, plus 8 bytes a block of 128: about
/// 1.06 bytes a parameter), with the arithmetic of Adam8bit. With
/// QuantizedStateOptions::factored a matrix keeps only the 4-bit first moment (about half a
/// byte a parameter).
///
/// Example:
///   frugal::optim::Adam4bit adam(model->parameters(), torch::optim::AdamOptions(1e-3));
class Adam4bit : public Adam4bitBase<torch::optim::AdamOptions> {
 public:
  using Adam4bitBase::Adam4bitBase;  // (params or groups, AdamOptions, QuantizedStateOptions,
                                     //  InPlaceOptions)
};

/// AdamW on 4-bit states; see Adam4bit.
///
/// Example:
///   frugal::optim::AdamW4bit adamw(model->parameters(),
///                                  torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
class AdamW4bit : public Adam4bitBase<torch::optim::AdamWOptions> {
 public:
  using Adam4bitBase::Adam4bitBase;
};

}  // namespace frugal::optim
