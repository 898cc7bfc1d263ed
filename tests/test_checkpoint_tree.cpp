// CheckpointPolicy anywhere in a model's tree: blocks held as members, in a ModuleList or a
// ModuleDict, with forwards of several arguments, and no parameter renamed.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "frugal/frugal.h"
#include "helpers.h"

namespace {

namespace F = torch::nn::functional;

// A block with a forward of two tensors and a number.
struct GatedImpl : torch::nn::Module {
  explicit GatedImpl(std::int64_t width)
      : fc1(register_module("fc1", torch::nn::Linear(width, 4 * width))),
        fc2(register_module("fc2", torch::nn::Linear(4 * width, width))) {}
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& gate, double scale) {
    return x + scale * fc2(F::dropout(torch::gelu(fc1(x)), F::DropoutFuncOptions().p(0.2).training(is_training()))) * gate;
  }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Gated);

// The usual Transformer-like layout: blocks in a ModuleList, one as a member, one in a
// ModuleDict; all called through frugal::nn::call (or directly, to test the error).
struct NetImpl : torch::nn::Module {
  NetImpl(std::int64_t width, bool via_frugal) : via_frugal(via_frugal) {
    layers = register_module("layers", torch::nn::ModuleList(Gated(width), Gated(width)));
    last = register_module("last", Gated(width));
    extra = register_module("extra", torch::nn::ModuleDict());
    extra->update({{"tail", Gated(width).ptr()}});
    head = register_module("head", torch::nn::Linear(width, 3));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& gate) {
    auto h = x;
    for (std::size_t i = 0; i < layers->size(); ++i) {
      h = via_frugal ? frugal::nn::call(layers->ptr<GatedImpl>(i), h, gate, 0.5)
                     : layers->ptr<GatedImpl>(i)->forward(h, gate, 0.5);
    }
    h = via_frugal ? frugal::nn::call(last, h, gate, 1.0) : last->forward(h, gate, 1.0);
    auto tail = std::dynamic_pointer_cast<GatedImpl>(extra["tail"]);
    h = via_frugal ? frugal::nn::call(tail, h, gate, 1.0) : tail->forward(h, gate, 1.0);
    return head(h);
  }
  bool via_frugal;
  torch::nn::ModuleList layers{nullptr};
  Gated last{nullptr};
  torch::nn::ModuleDict extra{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

struct Run {
  std::vector<double> losses;
  std::vector<std::string> names;
  std::vector<torch::Tensor> params;
  std::int64_t backward_peak = 0;
  std::vector<std::string> wrapped;
};

Run train(bool checkpointed, bool via_frugal = true, int steps = 4) {
  torch::manual_seed(11);
  Net net(64, via_frugal);
  torch::optim::Adam adam(net->parameters(), 1e-2);
  frugal::Trainer trainer(
      net.ptr(), adam, [&](const frugal::Batch& b) { return net->forward(b.inputs, b.get("gate")); },
      [](const torch::Tensor& out, const frugal::Batch& b) { return F::cross_entropy(out, b.targets); });
  Run run;
  if (checkpointed) {
    auto policy = std::make_shared<frugal::CheckpointPolicy>(frugal::CheckpointSelect().types({"Gated"}));
    trainer.add_policy(policy);
    run.wrapped = policy->wrapped();
  }
  torch::manual_seed(5);
  for (int i = 0; i < steps; ++i) {
    frugal::Batch batch{torch::randn({256, 64}), torch::randint(3, {256})};
    batch.set("gate", torch::rand({256, 64}));
    const auto r = trainer.step(batch);
    run.losses.push_back(r.loss);
    run.backward_peak = std::max(run.backward_peak, r.backward_peak);
  }
  for (const auto& item : net->named_parameters()) {
    run.names.push_back(item.key());
    run.params.push_back(item.value().clone());
  }
  return run;
}

TEST(CheckpointTree, BlocksInListsMembersAndDictsAreCheckpointedBitForBit) {
  // One intra-op thread: at two, LibTorch's CPU kernels here are not bit-reproducible from
  // one run to the next on a loaded machine (about one run in ten under CTest, with or
  // without checkpointing), and this compares checkpointing, not threads.
  const frugal::testing::ThreadCount one(1);
  const auto plain = train(false);
  const auto checkpointed = train(true);
  EXPECT_EQ(checkpointed.wrapped,
            (std::vector<std::string>{"layers.0", "layers.1", "last", "extra.tail"}));
  ASSERT_EQ(plain.losses.size(), checkpointed.losses.size());
  for (std::size_t i = 0; i < plain.losses.size(); ++i) {
    EXPECT_EQ(plain.losses[i], checkpointed.losses[i]) << "step " << i;  // dropout on
  }
  EXPECT_EQ(plain.names, checkpointed.names);  // no "module." anywhere
  for (std::size_t i = 0; i < plain.params.size(); ++i) {
    EXPECT_TRUE(torch::equal(plain.params[i], checkpointed.params[i])) << plain.names[i];
  }
  // The hidden activations of four blocks (256 x 256 floats each, several a block) are
  // not kept: backward's peak is lower by at least one block's.
  EXPECT_LT(checkpointed.backward_peak + 256 * 256 * 4, plain.backward_peak)
      << checkpointed.backward_peak << " vs " << plain.backward_peak;
}

TEST(CheckpointTree, StateDictsLoadAcrossWithAndWithoutThePolicy) {
  torch::manual_seed(2);
  Net a(16, true);
  Net b(16, true);
  frugal::CheckpointPolicy policy(frugal::CheckpointSelect().every(1).names({"last"}));
  policy.apply(*b);
  std::stringstream saved;
  torch::save(a, saved);
  torch::load(b, saved);  // names match: loads
  const auto pa = a->named_parameters();
  const auto pb = b->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& item : pa) {
    EXPECT_TRUE(torch::equal(item.value(), pb[item.key()])) << item.key();
  }
}

TEST(CheckpointTree, ARuleThatMatchesNothingIsAnError) {
  Net net(8, true);
  auto expect_error = [&](frugal::CheckpointSelect select, const std::string& needle) {
    frugal::CheckpointPolicy policy(std::move(select));
    try {
      policy.apply(*net);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const frugal::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error(frugal::CheckpointSelect().types({"Gatd"}), "no module has the type Gatd");
  expect_error(frugal::CheckpointSelect().names({"layers.7"}), "no module is named layers.7");
}

TEST(CheckpointTree, ABlockItsParentCallsDirectlyIsNamedAtTheFirstStep) {
  try {
    train(true, /*via_frugal=*/false, 1);
    ADD_FAILURE() << "no error";
  } catch (const frugal::Error& e) {
    EXPECT_NE(std::string(e.what()).find("chose 'layers.0'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("frugal::nn::call"), std::string::npos) << e.what();
  }
}

TEST(CheckpointTree, SequentialChildrenKeepTheirNames) {
  torch::nn::Sequential seq(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
  std::vector<std::string> before;
  for (const auto& item : seq->named_parameters()) {
    before.push_back(item.key());
  }
  frugal::CheckpointPolicy policy(frugal::CheckpointSelect().types({"torch::nn::Linear"}));
  EXPECT_EQ(policy.apply(*seq), (std::vector<std::string>{"0", "2"}));
  std::vector<std::string> after;
  for (const auto& item : seq->named_parameters()) {
    after.push_back(item.key());
  }
  EXPECT_EQ(before, after);
}

}  // namespace
