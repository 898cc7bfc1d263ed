// Adam8bit's and AdamW8bit's states in torch::save / torch::load: what a state writes, and
// the checks that a loaded file fits the optimizer's parameters before anything changes.
#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <type_traits>
#include <vector>

#include "codebook.h"
#include "compat.h"
#include "factored.h"
#include "frugal/error.h"
#include "frugal/optim/adam8bit.h"
#include "weight_codes.h"

namespace frugal::optim {
namespace {

using torch::optim::AdamOptions;
using torch::optim::AdamWOptions;

// Reads what `tensors` may hold: a missing key leaves the tensor undefined.
void read_tensor(torch::serialize::InputArchive& archive, const char* key, torch::Tensor& t) {
  c10::IValue value;
  if (archive.try_read(key, value)) {
    FRUGAL_CHECK(value.isTensor(), "frugal: 8-bit optimizer state '", key, "' is not a tensor");
    t = value.toTensor();
  }
}

std::int64_t read_int(torch::serialize::InputArchive& archive, const char* key) {
  c10::IValue value;
  FRUGAL_CHECK(archive.try_read(key, value) && value.isInt(),
               "frugal: the optimizer state has "
               "no '",
               key, "': it was not saved by frugal's Adam8bit or AdamW8bit");
  return value.toInt();
}

}  // namespace

std::vector<torch::Tensor> Adam8bitParamState::state_tensors() const {
  return {exp_avg(),        exp_avg_scales(), exp_avg_sq(), exp_avg_sq_scales(),
          exp_avg_sq_row(), exp_avg_sq_col(), signed_map(), unsigned_map()};
}

void Adam8bitParamState::serialize(torch::serialize::OutputArchive& archive) const {
  archive.write("step", c10::IValue(step()));
  archive.write("block", c10::IValue(block()));
  archive.write("bits", c10::IValue(bits()));
  for (const auto& [key, t] : {std::pair<const char*, torch::Tensor>{"exp_avg", exp_avg()},
                               {"exp_avg_scales", exp_avg_scales()},
                               {"exp_avg_sq", exp_avg_sq()},
                               {"exp_avg_sq_scales", exp_avg_sq_scales()},
                               {"exp_avg_sq_row", exp_avg_sq_row()},
                               {"exp_avg_sq_col", exp_avg_sq_col()}}) {
    if (t.defined()) {
      archive.write(key, c10::IValue(t));
    }
  }
}

void Adam8bitParamState::serialize(torch::serialize::InputArchive& archive) {
  step(read_int(archive, "step"));
  block(read_int(archive, "block"));
  c10::IValue width;  // absent from files of 8-bit states only
  bits(archive.try_read("bits", width) && width.isInt() ? width.toInt() : 8);
  read_tensor(archive, "exp_avg", exp_avg_);
  read_tensor(archive, "exp_avg_scales", exp_avg_scales_);
  read_tensor(archive, "exp_avg_sq", exp_avg_sq_);
  read_tensor(archive, "exp_avg_sq_scales", exp_avg_sq_scales_);
  read_tensor(archive, "exp_avg_sq_row", exp_avg_sq_row_);
  read_tensor(archive, "exp_avg_sq_col", exp_avg_sq_col_);
}

template <typename Options>
void Adam8bitBase<Options>::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<Adam8bitParamState, Options>(archive, *this);
  save_rounding(archive);
}

template <typename Options>
void Adam8bitBase<Options>::load(torch::serialize::InputArchive& archive) {
  // What is here now, to put back if the file does not fit.
  using Key = std::decay_t<decltype(state().begin()->first)>;
  std::vector<std::pair<Key, std::unique_ptr<torch::optim::OptimizerParamState>>> kept_state;
  for (const auto& [key, s] : state()) {
    kept_state.emplace_back(key, s->clone());
  }
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> kept_options;
  for (auto& group : param_groups()) {
    kept_options.push_back(group.options().clone());
  }
  auto commit_rounding = load_rounding(archive);
  try {
    torch::optim::serialize<Adam8bitParamState, Options>(archive, *this);
    adopt_loaded();
    commit_rounding();
  } catch (...) {
    state().clear();
    for (auto& [key, s] : kept_state) {
      state()[key] = std::move(s);
    }
    for (std::size_t g = 0; g < kept_options.size(); ++g) {
      param_groups()[g].set_options(std::move(kept_options[g]));
    }
    throw;
  }
}

template <typename Options>
void Adam8bitBase<Options>::adopt_loaded() {
  std::int64_t index = 0;
  for (const auto& group : param_groups()) {
    for (const auto& param : group.params()) {
      const auto it = state().find(compat::optimizer_state_key(param));
      const auto p = detail::update_target(param);
      ++index;
      if (it == state().end()) {
        continue;
      }
      auto& s = static_cast<Adam8bitParamState&>(*it->second);
      const auto name = [&] {
        return c10::str("frugal: the loaded state of parameter ", index - 1, " (shape ", p.sizes(),
                        ")");
      };
      FRUGAL_CHECK(s.block() >= 0 && s.step() >= 0, name(), " has block ", s.block(), " and step ",
                   s.step());
      FRUGAL_CHECK(s.block() == 0 || s.block() == quantized_.block(), name(),
                   " is quantized in blocks of ", s.block(), " but this optimizer's block is ",
                   quantized_.block());
      FRUGAL_CHECK(s.block() == 0 || s.bits() == quantized_.bits(), name(), " holds ", s.bits(),
                   "-bit codes but this optimizer's are ", quantized_.bits(), "-bit");
      const auto expect = [&](const torch::Tensor& t, const char* what, at::IntArrayRef sizes,
                              c10::ScalarType type) {
        FRUGAL_CHECK(t.defined() && t.sizes() == sizes && t.scalar_type() == type, name(),
                     " holds ", what, " of ",
                     t.defined() ? c10::str(t.sizes(), " ", t.scalar_type()) : "nothing", " where ",
                     sizes, " ", type, " belongs");
      };
      if (!s.quantized()) {
        FRUGAL_CHECK(!s.factored(), name(), " is factored but not quantized");
        expect(s.exp_avg(), "a first moment", p.sizes(), torch::kFloat32);
        expect(s.exp_avg_sq(), "a second moment", p.sizes(), torch::kFloat32);
        continue;
      }
      const std::vector<std::int64_t> blocks{blocks_of(p.numel(), s.block())};
      // 8-bit codes are shaped like the parameter, 4-bit ones two to a byte.
      const std::vector<std::int64_t> codes =
          quantized_.bits() == 8 ? p.sizes().vec()
                                 : std::vector<std::int64_t>{code_bytes(p.numel(), 4)};
      if (s.exp_avg().defined()) {  // else no first moment: beta1 0
        expect(s.exp_avg(), "a first moment", codes, torch::kUInt8);
        expect(s.exp_avg_scales(), "first-moment scales", blocks, torch::kFloat32);
      }
      if (s.factored()) {
        const auto shape = detail::factored_shape(p);
        FRUGAL_CHECK(!s.exp_avg_sq().defined(), name(),
                     " holds both a factored and a whole "
                     "second moment");
        expect(s.exp_avg_sq_row(), "second-moment rows", {shape.rows}, torch::kFloat32);
        expect(s.exp_avg_sq_col(), "second-moment columns", {shape.cols}, torch::kFloat32);
      } else {
        expect(s.exp_avg_sq(), "a second moment", codes, torch::kUInt8);
        expect(s.exp_avg_sq_scales(), "second-moment scales", blocks, torch::kFloat32);
      }
    }
  }
  // Everything fits: move the states to their parameters' devices and attach the books.
  for (const auto& group : param_groups()) {
    for (const auto& p : group.params()) {
      const auto it = state().find(compat::optimizer_state_key(p));
      if (it == state().end()) {
        continue;
      }
      auto& s = static_cast<Adam8bitParamState&>(*it->second);
      const auto here = [&](const torch::Tensor& t) {
        return t.defined() ? t.to(p.device()).contiguous() : t;
      };
      s.exp_avg(here(s.exp_avg())).exp_avg_sq(here(s.exp_avg_sq()));
      s.exp_avg_scales(here(s.exp_avg_scales())).exp_avg_sq_scales(here(s.exp_avg_sq_scales()));
      s.exp_avg_sq_row(here(s.exp_avg_sq_row())).exp_avg_sq_col(here(s.exp_avg_sq_col()));
      if (s.quantized()) {
        attach_books(s, p.device());
      }
    }
  }
}

// The members defined here, for the two instantiations (adam8bit.cpp makes the rest).
#define FRUGAL_ADAM8BIT_STATE_MEMBERS(Options)                                       \
  template void Adam8bitBase<Options>::save(torch::serialize::OutputArchive&) const; \
  template void Adam8bitBase<Options>::load(torch::serialize::InputArchive&);        \
  template void Adam8bitBase<Options>::adopt_loaded();
FRUGAL_ADAM8BIT_STATE_MEMBERS(AdamOptions)
FRUGAL_ADAM8BIT_STATE_MEMBERS(AdamWOptions)
#undef FRUGAL_ADAM8BIT_STATE_MEMBERS

}  // namespace frugal::optim
