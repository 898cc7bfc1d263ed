// The factored second moment of Adam8bit/AdamW8bit (QuantizedStateOptions::factored) and
// the step without a first moment (beta1 0): Adafactor's row and column statistics
// followed exactly, Adam's update on them, the bytes the format says (probe-checked), a
// round trip through torch::save, no full-size scratch, and a changed beta1 refused.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>
#include <sstream>

#include "compat.h"
#include "frugal/memory/counting_allocator.h"
#include "frugal/memory/ledger.h"
#include "frugal/memory/probe.h"
#include "frugal/optim/adam.h"
#include "frugal/optim/adam8bit.h"
#include "helpers.h"
#include "optim/codebook.h"
#include "optim8bit_setup.h"

namespace {

using namespace frugal::testing::optim8bit;

// Matrices of several layouts: several chunks of whole rows with a short last one (100 x
// 80 under chunks of 768: 1280 elements, 16 rows), a convolution's weight (rows: output
// channels), one not contiguous (stepped whole).
std::vector<torch::Tensor> make_matrices() {
  torch::manual_seed(21);
  return {torch::randn({100, 80}).requires_grad_(), torch::randn({8, 4, 3, 3}).requires_grad_(),
          torch::randn({64, 100}).t().detach().requires_grad_()};
}

const fo::InPlaceOptions kRowChunks = fo::InPlaceOptions().chunk(768);

// Adam with Adafactor's factored second moment, on whole tensors in float64: what the
// optimizer's chunked float32 step must equal up to rounding.
struct FactoredReference {
  explicit FactoredReference(const torch::Tensor& param)
      : p(param.detach().to(torch::kFloat64).clone()),
        rows(torch::zeros({param.size(0)}, torch::kFloat64)),
        cols(torch::zeros({param.numel() / param.size(0)}, torch::kFloat64)),
        m(torch::zeros_like(p)) {}
  void step(const torch::Tensor& grad, double lr, double beta1, double beta2, double eps,
            double decay, bool decoupled) {
    ++count;
    auto g = grad.to(torch::kFloat64);
    if (decoupled) {
      p.mul_(1 - lr * decay);
    } else {
      g = g + decay * p;
    }
    const auto sq = (g * g).reshape({rows.size(0), cols.size(0)});
    rows = beta2 * rows + (1 - beta2) * sq.mean(1);
    cols = beta2 * cols + (1 - beta2) * sq.mean(0);
    const auto v = torch::outer(rows, cols) / rows.mean();
    m = beta1 * m + (1 - beta1) * g;
    const auto bias1 = 1 - std::pow(beta1, count), bias2 = 1 - std::pow(beta2, count);
    const auto denom = (v / bias2).sqrt().reshape(p.sizes()) + eps;
    p = p - lr / bias1 * m / denom;
  }
  torch::Tensor p, rows, cols, m;
  int count = 0;
};

TEST(FactoredMoment, WithoutAFirstMomentTheStepIsTheReferences) {
  // beta1 0 keeps no first moment, so nothing is quantized: the step is the reference's up
  // to float32 rounding, with either weight decay, over chunks of rows and whole tensors.
  for (const bool decoupled : {false, true}) {
    auto params = make_matrices();
    std::vector<FactoredReference> reference(params.begin(), params.end());
    const double lr = 1e-2, decay = 0.05;
    std::unique_ptr<to::Optimizer> opt;
    if (decoupled) {
      opt = std::make_unique<fo::AdamW8bit>(
          params, to::AdamWOptions(lr).betas({0, 0.999}).weight_decay(decay), kFactored,
          kRowChunks);
    } else {
      opt = std::make_unique<fo::Adam8bit>(
          params, to::AdamOptions(lr).betas({0, 0.999}).weight_decay(decay), kFactored, kRowChunks);
    }
    for (int step = 0; step < 10; ++step) {
      set_grads(params, step, 1 + step % 3);
      opt->step();
      for (std::size_t i = 0; i < params.size(); ++i) {
        reference[i].step(params[i].grad(), lr, 0, 0.999, 1e-8, decay, decoupled);
      }
    }
    for (std::size_t i = 0; i < params.size(); ++i) {
      auto& s = state_of(*opt, params[i]);
      ASSERT_TRUE(s.factored()) << "parameter " << i;
      EXPECT_FALSE(s.exp_avg().defined());
      EXPECT_FALSE(s.exp_avg_sq().defined());
      const auto& ref = reference[i];
      const auto off = (ref.p - params[i].detach().to(torch::kFloat64)).abs().max();
      const auto travel = (ref.p - make_matrices()[i].detach().to(torch::kFloat64)).abs().max();
      // float32 weights round at each of 10 steps (2^-24 of their size, a few times each).
      const auto rounding = 4 * 10 * std::ldexp(1.0, -24) * ref.p.abs().max() / travel;
      EXPECT_LE((off / travel).item<double>(), (rounding + 1e-6).item<double>())
          << (decoupled ? "AdamW" : "Adam") << ", parameter " << i;
      EXPECT_TRUE(torch::allclose(s.exp_avg_sq_row().to(torch::kFloat64), ref.rows, 1e-5, 0));
      EXPECT_TRUE(torch::allclose(s.exp_avg_sq_col().to(torch::kFloat64), ref.cols, 1e-5, 0));
    }
  }
}

TEST(FactoredMoment, WithAnEightBitFirstMomentTheStatisticsAreTheReferences) {
  // The first moment is 8-bit, so parameters drift from the reference by its codes; the
  // row and column statistics depend on the gradients alone (AdamW: the decay does not
  // join them) and follow the reference's, and the update stays within the codes' error.
  auto params = make_matrices();
  std::vector<FactoredReference> reference(params.begin(), params.end());
  const auto start = clone_params(params);
  fo::AdamW8bit adamw(params, to::AdamWOptions(1e-2).weight_decay(0.01), kFactored, kRowChunks);
  for (int step = 0; step < 10; ++step) {
    set_grads(params, step, 1 + step % 3);
    adamw.step();
    for (std::size_t i = 0; i < params.size(); ++i) {
      reference[i].step(params[i].grad(), 1e-2, 0.9, 0.999, 1e-8, 0.01, true);
    }
  }
  for (std::size_t i = 0; i < params.size(); ++i) {
    auto& s = state_of(adamw, params[i]);
    ASSERT_TRUE(s.exp_avg().defined());
    EXPECT_EQ(s.exp_avg().scalar_type(), torch::kUInt8);
    EXPECT_TRUE(
        torch::allclose(s.exp_avg_sq_row().to(torch::kFloat64), reference[i].rows, 1e-5, 0));
    EXPECT_TRUE(
        torch::allclose(s.exp_avg_sq_col().to(torch::kFloat64), reference[i].cols, 1e-5, 0));
    const auto ours =
        params[i].detach().to(torch::kFloat64) - start[i].detach().to(torch::kFloat64);
    const auto theirs = reference[i].p - start[i].detach().to(torch::kFloat64);
    const auto off = ((ours - theirs).norm() / theirs.norm()).item<double>();
    EXPECT_LE(off, 0.05) << "parameter " << i;
  }
}

TEST(FactoredMoment, WithoutAFirstMomentAVectorUsesTheGradient) {
  // A vector keeps 8-bit codes of its second moment. With beta1 0 they are the codes a
  // first moment does not change (same gradients), and each update is the gradient over
  // the root of the moment the last codes stand for, updated by the new gradient.
  std::vector<torch::Tensor> a{torch::randn({9000}).requires_grad_()};
  auto b = clone_params(a);
  fo::Adam8bit none(a, to::AdamOptions(1e-2).betas({0, 0.99}), {}, kRowChunks);
  fo::Adam8bit kept(b, to::AdamOptions(1e-2).betas({0.9, 0.99}), {}, kRowChunks);
  const auto map = fo::moment_map(false);
  auto last = torch::zeros({9000});  // the second moment the codes stand for
  for (int step = 1; step <= 6; ++step) {
    set_grads(a, step);
    set_grads(b, step);
    const auto before = a[0].detach().clone();
    none.step();
    kept.step();
    auto& s = state_of(none, a[0]);
    EXPECT_FALSE(s.exp_avg().defined());
    ASSERT_TRUE(torch::equal(s.exp_avg_sq(), state_of(kept, b[0]).exp_avg_sq())) << step;
    const auto g = a[0].grad();
    const auto v = 0.99 * last + 0.01 * g * g;
    const auto denom = v.sqrt() / std::sqrt(1 - std::pow(0.99, step)) + 1e-8;
    const auto expected = before - 1e-2 * g / denom;
    EXPECT_LE(((a[0].detach() - expected).abs().max() / 1e-2).item<double>(), 1e-4) << step;
    last = fo::dequantize_blockwise({s.exp_avg_sq(), s.exp_avg_sq_scales(), 256}, map);
  }
}

// Bytes of the factored format: per matrix its rows and columns (float32) and, with a first
// moment, its codes and scales; the two code books.
std::int64_t factored_bytes(const std::vector<torch::Tensor>& params, bool first_moment) {
  std::int64_t bytes = 2 * 511 * 4;
  for (const auto& p : params) {
    const auto n = p.numel();
    bytes += 4 * (p.size(0) + n / p.size(0));
    bytes += first_moment ? n + 4 * ((n + 255) / 256) : 0;
  }
  return bytes;
}

TEST(FactoredMoment, TheLedgerCountsTheFormatsBytes) {
  frugal::CountingAllocator::install();
  frugal::MemoryProbe probe(torch::kCPU);
  for (const bool first_moment : {true, false}) {
    auto params = make_matrices();
    frugal::testing::optim8bit::ParamsModule holder(params);
    fo::AdamW8bit adamw(params, to::AdamWOptions(1e-3).betas({first_moment ? 0.9 : 0, 0.999}),
                        kFactored, kRowChunks);
    const auto expected = factored_bytes(params, first_moment);
    EXPECT_EQ(adamw.pending_state_bytes(adamw.state_format()), expected);
    set_grads(params, 0);
    const auto before = probe.allocated();
    adamw.step();
    EXPECT_EQ(probe.allocated() - before, expected);  // the step keeps nothing else
    EXPECT_EQ(frugal::measure_ledger(probe, holder, &adamw).optimizer, expected);
    std::int64_t numel = 0;
    for (const auto& p : params) {
      numel += p.numel();
    }
    std::cout << "[ factored ] " << numel << " parameters, state " << expected << " B ("
              << (first_moment ? "8-bit first moment" : "no first moment") << ")\n";
  }
  // A matrix whose rows and columns would take more than its codes keeps the codes.
  std::vector<torch::Tensor> thin{torch::randn({2, 5000}).requires_grad_()};
  fo::Adam8bit adam(thin, to::AdamOptions(1e-3), kFactored);
  set_grads(thin, 0);
  adam.step();
  EXPECT_FALSE(state_of(adam, thin[0]).factored());
  EXPECT_EQ(state_of(adam, thin[0]).exp_avg_sq().numel(), 10000);
}

TEST(FactoredMoment, StateRoundTripsThroughTorchSaveBitForBit) {
  for (const double beta1 : {0.9, 0.0}) {
    auto a = make_matrices();
    const auto options = to::AdamWOptions(1e-2).betas({beta1, 0.999}).weight_decay(0.01);
    fo::AdamW8bit ours(a, options, kFactored, kRowChunks);
    for (int step = 0; step < 3; ++step) {
      set_grads(a, step);
      ours.step();
    }
    std::stringstream file;
    torch::save(ours, file);
    auto b = clone_params(a);
    fo::AdamW8bit loaded(b, options, kFactored, kRowChunks);
    torch::load(loaded, file);
    for (std::size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(torch::equal(state_of(ours, a[i]).exp_avg_sq_row(),
                               state_of(loaded, b[i]).exp_avg_sq_row()));
      EXPECT_TRUE(torch::equal(state_of(ours, a[i]).exp_avg_sq_col(),
                               state_of(loaded, b[i]).exp_avg_sq_col()));
      EXPECT_EQ(state_of(loaded, b[i]).exp_avg().defined(), beta1 != 0);
    }
    for (int step = 3; step < 8; ++step) {
      set_grads(a, step);
      set_grads(b, step);
      ours.step();
      loaded.step();
    }
    EXPECT_EQ(max_abs_diff(a, b), 0) << "beta1 " << beta1;
  }
}

TEST(FactoredMoment, AFileWithRowsOfAnotherShapeIsRefused) {
  auto a = make_matrices();
  const auto options = to::AdamWOptions(1e-2).betas({0, 0.999});  // the rows decide
  fo::AdamW8bit ours(a, options, kFactored, kRowChunks);
  set_grads(a, 0);
  ours.step();
  std::stringstream file;
  torch::save(ours, file);
  // The same numbers of elements, other rows: 80 x 100 for 100 x 80.
  std::vector<torch::Tensor> other{torch::randn({80, 100}).requires_grad_(),
                                   torch::randn({8, 4, 3, 3}).requires_grad_(),
                                   torch::randn({100, 64}).requires_grad_()};
  fo::AdamW8bit loaded(other, options, kFactored, kRowChunks);
  try {
    torch::load(loaded, file);
    ADD_FAILURE() << "a file of 100 x 80 rows loaded into 80 x 100";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("second-moment rows of [100] Float where [80] Float"),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(loaded.state().empty());
}

TEST(FactoredMoment, StepParameterEqualsTheWholeStep) {
  auto a = make_matrices();
  auto b = clone_params(a);
  fo::AdamW8bit whole(a, to::AdamWOptions(1e-2), kFactored, kRowChunks);
  fo::AdamW8bit each(b, to::AdamWOptions(1e-2), kFactored, kRowChunks);
  for (int step = 0; step < 4; ++step) {
    set_grads(a, step);
    set_grads(b, step);
    whole.step();
    for (const auto& p : b) {
      each.step_parameter(p);
    }
  }
  EXPECT_EQ(max_abs_diff(a, b), 0);
}

TEST(FactoredMoment, TheFusedCpuStepAgreesWithTheTensorOpsStep) {
  // float32 contiguous parameters on the CPU take the fused loop for the update; the same
  // values in another layout take the tensor-ops step of other devices and dtypes. A
  // factored matrix with and without a first moment, and a vector of 8-bit codes without
  // one (with one, it is Adam8bit's step, which test_optim8bit compares).
  for (const double beta1 : {0.9, 0.0}) {
    torch::manual_seed(12);
    std::vector<torch::Tensor> fused{torch::randn({150, 60}).requires_grad_(),
                                     torch::randn({9000}).requires_grad_()};
    std::vector<torch::Tensor> other{
        fused[0].detach().t().contiguous().t().requires_grad_(),
        torch::empty({18000}).slice(0, 0, 18000, 2).copy_(fused[1].detach()).requires_grad_()};
    ASSERT_FALSE(other[0].is_contiguous() || other[1].is_contiguous());
    const auto options = to::AdamWOptions(1e-2).betas({beta1, 0.999}).weight_decay(0.01);
    fo::AdamW8bit a(fused, options, kFactored, kRowChunks);
    fo::AdamW8bit b(other, options, kFactored, kRowChunks);
    for (int step = 0; step < 20; ++step) {
      set_grads(fused, step, 1 + step % 3);
      for (std::size_t i = 0; i < fused.size(); ++i) {
        other[i].mutable_grad() = torch::empty_like(other[i]).copy_(fused[i].grad());
      }
      a.step();
      b.step();
    }
    EXPECT_TRUE(state_of(a, fused[0]).factored());
    EXPECT_FALSE(state_of(a, fused[1]).factored());
    for (std::size_t i = 0; i < (beta1 == 0 ? fused.size() : 1); ++i) {
      const double diff = ((fused[i] - other[i]).abs().max() / fused[i].abs().max()).item<double>();
      std::cout << "[ factored ] beta1 " << beta1 << ", parameter " << i
                << ": fused vs tensor ops after 20 steps " << diff << " apart (of the largest)\n";
      EXPECT_LE(diff, 1e-5) << "beta1 " << beta1 << ", parameter " << i;
    }
  }
}

TEST(FactoredMoment, TheStepNeedsNoFullSizeScratch) {
  frugal::CountingAllocator::install();
  frugal::MemoryProbe probe(torch::kCPU);
  // 1024 x 1024 in chunks of whole rows: five float32 buffers of one chunk.
  std::vector<torch::Tensor> params{torch::randn({1024, 1024}).requires_grad_()};
  const auto chunk = fo::InPlaceOptions().chunk(1 << 16);
  fo::AdamW8bit adamw(params, to::AdamWOptions(1e-3), kFactored, chunk);
  EXPECT_EQ(adamw.scratch_bytes(), 5 * chunk.chunk() * 4);
  const auto overhead = step_overhead(adamw, params, probe);
  EXPECT_GE(overhead, adamw.scratch_bytes());
  EXPECT_LE(overhead, adamw.scratch_bytes() + 1024);  // the 0-d tensors of scalars
  std::cout << "[ factored ] step of a 1 M-element matrix: " << overhead
            << " B above its start (a float32 copy: " << (4 << 20) << " B)\n";
}

TEST(FactoredMoment, ABeta1AboveZeroForAStateWithoutFirstMomentIsRefused) {
  auto params = make_matrices();
  fo::AdamW8bit adamw(params, to::AdamWOptions(1e-2).betas({0, 0.999}), kFactored, kRowChunks);
  set_grads(params, 0);
  adamw.step();
  static_cast<to::AdamWOptions&>(adamw.param_groups()[0].options()).betas({0.9, 0.999});
  set_grads(params, 1);
  const auto before = clone_params(params);
  try {
    adamw.step();
    ADD_FAILURE() << "beta1 0.9 accepted for a state without a first moment";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("beta1 is now 0.9"), std::string::npos) << e.what();
  }
  EXPECT_EQ(max_abs_diff(params, before), 0);
  EXPECT_EQ(state_of(adamw, params[0]).step(), 1);
}

TEST(FactoredMoment, TrainsALeastSquaresProblemAsAdamDoes) {
  // A linear model fitted to noisy targets: factored AdamW (8-bit first moment, or none)
  // reaches a loss near float32 AdamW's, both far below the start.
  const auto options = to::AdamWOptions(3e-2);
  const auto fit = [&](auto make) { return least_squares(make, 32, 300); };
  const auto adamw = fit([&](auto& w) { return std::make_unique<fo::AdamW>(w, options); });
  const float factored =
      fit([&](auto& w) { return std::make_unique<fo::AdamW8bit>(w, options, kFactored); }).loss;
  const float no_first = fit([&](auto& w) {
                           return std::make_unique<fo::AdamW8bit>(
                               w, to::AdamWOptions(3e-2).betas({0, 0.999}), kFactored);
                         }).loss;
  std::cout << "[ factored ] least squares after 300 steps: start " << adamw.start << ", AdamW "
            << adamw.loss << ", factored " << factored << ", factored without first moment "
            << no_first << "\n";
  EXPECT_LE(adamw.loss, adamw.start / 50);
  EXPECT_LE(factored, 2 * adamw.loss + 0.01);
  EXPECT_LE(no_first, 2 * adamw.loss + 0.01);
}

}  // namespace
