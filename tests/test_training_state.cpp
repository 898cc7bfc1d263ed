// Saved training states: all or nothing on bad files, other models, other optimizers.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "compat.h"
#include "helpers.h"
#include "resume_setup.h"
#include "state/state_file.h"
#include "state/state_parts.h"

namespace {

namespace fs = std::filesystem;
using frugal::testing::flat_state;
using frugal::testing::make_resume_setup;
using frugal::testing::ResumeSetup;
using frugal::testing::train;

// The tensors of one parameter's optimizer state (none where it has no state).
std::vector<torch::Tensor> state_tensors_of(torch::optim::Optimizer& optimizer,
                                            const torch::Tensor& p) {
  const auto it = optimizer.state().find(frugal::compat::optimizer_state_key(p));
  return it == optimizer.state().end() ? std::vector<torch::Tensor>{}
                                       : frugal::optimizer_state_tensors(*it->second);
}

// Everything a load could change, to check that a refused one changed nothing.
struct Fingerprint {
  torch::Tensor weights, rng;
  std::string optimizer;
  std::int64_t steps, micro_batch;

  explicit Fingerprint(ResumeSetup& s)
      : weights(flat_state(*s.model)),
        rng(torch::globalContext().defaultGenerator(torch::kCPU).get_state()),
        optimizer(optimizer_bytes(*s.optimizer)),
        steps(s.trainer->steps()),
        micro_batch(s.trainer->micro_batch()) {}
  static std::string optimizer_bytes(torch::optim::Optimizer& optimizer) {
    torch::serialize::OutputArchive archive;
    optimizer.save(archive);
    std::ostringstream out;
    archive.save_to(out);
    return out.str();
  }
  void expect_same(ResumeSetup& s) const {
    const Fingerprint now(s);
    EXPECT_TRUE(torch::equal(now.weights, weights)) << "the weights changed";
    EXPECT_TRUE(torch::equal(now.rng, rng)) << "the CPU generator changed";
    EXPECT_EQ(now.optimizer, optimizer) << "the optimizer's state changed";
    EXPECT_EQ(now.steps, steps);
    EXPECT_EQ(now.micro_batch, micro_batch);
  }
};

void expect_refused(ResumeSetup& s, const std::string& path, const std::string& expected) {
  const Fingerprint before(s);
  try {
    frugal::load_training_state(*s.trainer, path);
    ADD_FAILURE() << "loading " << path << " did not fail (expected: " << expected << ")";
  } catch (const c10::Error& e) {
    const auto message = frugal::error_message(e);
    EXPECT_NE(message.find(expected), std::string::npos) << message;
    EXPECT_NE(message.find(path), std::string::npos)
        << "the error does not name the file: " << message;
  }
  before.expect_same(s);
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

TEST(TrainingState, LoadPutsBackWeightsOptimizerGeneratorCountersAndUserState) {
  const auto dir = frugal::testing::fresh_temp_dir("state_roundtrip");
  auto a = make_resume_setup("checkpoint");
  train(*a, 4);
  const auto path = (dir / "state.frugal").string();
  frugal::UserState user{{{"epoch", 3}, {"position", -7}}, {{"running", 0.1 + 0.2}}, {}};
  for (int byte = 0; byte < 256; ++byte) {  // any bytes, not only text
    user.blob.push_back(static_cast<char>(byte));
  }
  frugal::save_training_state(*a->trainer, path, user);
  train(*a, 5);  // what the loaded trainer must repeat exactly
  const auto expected = flat_state(*a->model);

  auto b = make_resume_setup("checkpoint");
  const auto loaded = frugal::load_training_state(*b->trainer, path);
  EXPECT_EQ(loaded.values, user.values);
  EXPECT_EQ(loaded.numbers, user.numbers);  // bit for bit: 0.1 + 0.2 is not 0.3
  EXPECT_EQ(loaded.blob, user.blob);
  EXPECT_EQ(b->trainer->steps(), 4);
  train(*b, 5);
  EXPECT_TRUE(torch::equal(flat_state(*b->model), expected));
  EXPECT_EQ(b->optimizer->param_groups()[0].options().get_lr(),
            a->optimizer->param_groups()[0].options().get_lr());
  fs::remove_all(dir);
}

TEST(TrainingState, DamagedFilesAreRefusedAndChangeNothing) {
  const auto dir = frugal::testing::fresh_temp_dir("state_damaged");
  auto s = make_resume_setup("adam8bit");
  train(*s, 3);
  const auto good = (dir / "good.frugal").string();
  frugal::save_training_state(*s->trainer, good);
  train(*s, 2);  // the trainer now differs from the file
  const auto bytes = read_bytes(good);
  const auto bad = (dir / "bad.frugal").string();
  for (int tenth = 0; tenth < 10; ++tenth) {
    const auto length = bytes.size() * tenth / 10;
    write_bytes(bad, bytes.substr(0, length));
    SCOPED_TRACE("truncated to " + std::to_string(length) + " bytes");
    expect_refused(*s, bad, length < 8 ? "not a frugal training state" : "truncated");
  }
  for (const auto at : {bytes.size() / 3, bytes.size() / 2, bytes.size() - 1}) {
    auto flipped = bytes;
    flipped[at] = static_cast<char>(flipped[at] ^ 0x10);
    write_bytes(bad, flipped);
    SCOPED_TRACE("byte " + std::to_string(at) + " flipped");
    expect_refused(*s, bad, "is damaged: its CRC-32");
  }
  auto newer = bytes;
  newer[8] = 2;  // the format version
  write_bytes(bad, newer);
  expect_refused(*s, bad, "has format version 2; this frugal reads version 1");
  write_bytes(bad, bytes + "x");
  expect_refused(*s, bad, "1 bytes after its end");
  expect_refused(*s, (dir / "missing.frugal").string(), "No such file");
  // The good file still loads, and then the trainer is where it was at step 3.
  frugal::load_training_state(*s->trainer, good);
  EXPECT_EQ(s->trainer->steps(), 3);
  fs::remove_all(dir);
}

TEST(TrainingState, ForgedFilesAndFilesThatAreNotFilesAreRefusedByName) {
  const auto dir = frugal::testing::fresh_temp_dir("state_forged");
  auto s = make_resume_setup("plain");
  train(*s, 2);
  // Header and checksum right, contents not: LibTorch's own errors, with the file's name.
  const auto garbage = (dir / "garbage.frugal").string();
  frugal::detail::write_state_file(garbage, [](const frugal::detail::ByteWriter& write) {
    const std::string bytes = "not an archive at all";
    write(bytes.data(), bytes.size());
  });
  expect_refused(*s, garbage, "cannot be read as a saved state");
  const auto keyless = (dir / "keyless.frugal").string();
  auto archive = frugal::detail::new_state_archive();  // the layout and nothing else
  frugal::detail::write_state_file(
      keyless, [&](const frugal::detail::ByteWriter& write) { archive.save_to(write); });
  expect_refused(*s, keyless, "'" + keyless + "'");
  // Opening a FIFO for reading waits for a writer: it is refused before that.
  const auto fifo = (dir / "fifo.frugal").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_refused(*s, fifo, "is a FIFO, not a saved state");
  const auto folder = dir / "folder.frugal";
  fs::create_directory(folder);
  expect_refused(*s, folder.string(), "is a folder, not a saved state");
  fs::remove_all(dir);
}

TEST(TrainingState, AnotherModelOptimizerOrPolicyListIsRefusedByName) {
  const auto dir = frugal::testing::fresh_temp_dir("state_other");
  const auto path = (dir / "state.frugal").string();
  auto wide = make_resume_setup("bf16", /*hidden=*/48);
  train(*wide, 1);
  frugal::save_training_state(*wide->trainer, path);

  auto s = make_resume_setup("bf16");
  train(*s, 2);
  expect_refused(*s, path,
                 "parameter '0.linear.weight' has shape [48, 16] in the file, [32, 16] here");

  auto plain = make_resume_setup("plain");  // LibTorch's Adam, no policies
  train(*plain, 1);
  frugal::save_training_state(*plain->trainer, path);
  expect_refused(*s, path,
                 "the optimizer is torch::optim::Adam in the file, "
                 "frugal::optim::Adam here");

  auto in_backward = make_resume_setup("in-backward");  // frugal's Adam, another policy
  train(*in_backward, 1);
  frugal::save_training_state(*in_backward->trainer, path);
  expect_refused(*s, path, "the list of policies is [step-in-backward] in the file");
  fs::remove_all(dir);
}

TEST(TrainingState, AnotherLrScheduleIsRefused) {
  const auto dir = frugal::testing::fresh_temp_dir("state_schedule");
  const auto path = (dir / "state.frugal").string();
  auto saved = make_resume_setup("checkpoint");  // cosine over 100 steps
  train(*saved, 2);
  frugal::save_training_state(*saved->trainer, path);

  auto s = make_resume_setup("plain");
  frugal::testing::replace_optimizer(
      *s, std::make_unique<frugal::optim::AdamW>(s->model->parameters(),
                                                 torch::optim::AdamWOptions(1e-2)));
  s->trainer->add_policy(
      std::make_shared<frugal::CheckpointPolicy>(frugal::CheckpointSelect().names({"0", "1"})));
  s->trainer->add_policy(std::make_shared<frugal::LrSchedule>(frugal::LrScheduleOptions()
                                                                  .decay(frugal::LrDecay::Cosine)
                                                                  .warmup_steps(10)
                                                                  .total_steps(200)));
  train(*s, 1);
  expect_refused(*s, path, "the saved LrSchedule has total_steps 100, this one 200");
  fs::remove_all(dir);
}

TEST(TrainingState, AnOptimizerThatRefusesTheFileIsPutBack) {
  const auto dir = frugal::testing::fresh_temp_dir("state_rollback");
  const auto path = (dir / "state.frugal").string();
  auto other = make_resume_setup("adam8bit");
  train(*other, 2);
  frugal::save_training_state(*other->trainer, path);

  // Same model and optimizer type, but 8-bit states in blocks of 128: the optimizer's own
  // load refuses, after the file's model and counters were found to fit.
  auto s = make_resume_setup("adam8bit");
  frugal::testing::replace_optimizer(
      *s, std::make_unique<frugal::optim::Adam8bit>(
              s->model->parameters(), torch::optim::AdamOptions(1e-2),
              frugal::optim::QuantizedStateOptions().block(128).min_elements(64)));
  s->trainer->add_policy(std::make_shared<frugal::LrSchedule>(
      frugal::LrScheduleOptions().decay(frugal::LrDecay::Step).step_size(30).gamma(0.5)));
  train(*s, 3);
  expect_refused(*s, path, "nothing was changed");
  fs::remove_all(dir);
}

TEST(TrainingState, SavingInsideAnAccumulationWindowIsRefused) {
  const auto dir = frugal::testing::fresh_temp_dir("state_window");
  auto s = make_resume_setup("micro");  // accumulate(2)
  train(*s, 1);
  ASSERT_TRUE(s->trainer->window_open());
  const auto path = dir / "state.frugal";
  try {
    frugal::save_training_state(*s->trainer, path.string());
    ADD_FAILURE() << "saved inside an accumulation window";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("inside an accumulation window"), std::string::npos);
  }
  EXPECT_FALSE(fs::exists(path));
  train(*s, 1);  // ends the window
  frugal::save_training_state(*s->trainer, path.string());
  EXPECT_TRUE(fs::exists(path));
  fs::remove_all(dir);
}

// A loaded optimizer state lies where it was saved; each parameter's state must follow its
// parameter (saved on the CPU, resumed on CUDA). The meta device stands in for another one.
TEST(TrainingState, ALoadedOptimizerStateGoesToItsParametersDevice) {
  for (const bool quantized : {false, true}) {
    auto optimizer_of = [&](const torch::Tensor& w) -> std::unique_ptr<torch::optim::Optimizer> {
      if (quantized) {
        return std::make_unique<frugal::optim::Adam8bit>(
            std::vector<torch::Tensor>{w}, torch::optim::AdamOptions(1e-2),
            frugal::optim::QuantizedStateOptions().min_elements(64));
      }
      return std::make_unique<torch::optim::Adam>(std::vector<torch::Tensor>{w});
    };
    torch::manual_seed(4);
    auto w = torch::randn({300}, torch::requires_grad());
    auto saved = optimizer_of(w);
    w.square().sum().backward();
    saved->step();
    const auto bytes = frugal::detail::optimizer_bytes(*saved);

    auto elsewhere =
        torch::empty({300}, torch::TensorOptions().device(torch::kMeta)).requires_grad_();
    auto loaded = optimizer_of(elsewhere);
    frugal::detail::load_optimizer_bytes(*loaded, bytes);
    std::int64_t placed = 0;
    for (const auto& t : state_tensors_of(*loaded, elsewhere)) {
      if (t.defined()) {  // (Adam's max_exp_avg_sq is not, without amsgrad)
        EXPECT_EQ(t.device().type(), torch::kMeta) << (quantized ? "8-bit" : "Adam");
        ++placed;
      }
    }
    EXPECT_GE(placed, 2) << (quantized ? "8-bit" : "Adam");
  }
}

// A generator's saved state of another size is refused before anything is put back; the
// same check guards each CUDA generator's state.
TEST(TrainingState, AGeneratorStateOfAnotherSizeIsNamed) {
  torch::serialize::OutputArchive archive;
  archive.write("rng/cpu", torch::zeros({7}, torch::kByte));
  archive.write("rng/cuda_devices", c10::IValue(static_cast<std::int64_t>(0)));
  std::ostringstream out;
  archive.save_to(out);
  torch::serialize::InputArchive in;
  std::istringstream bytes(out.str());
  in.load_from(bytes);
  frugal::testing::expect_error_contains([&] { (void)frugal::detail::read_rng(in, "x.frugal"); },
                                         "'x.frugal' holds a CPU generator state of Byte[7]");
}

TEST(CudaTrainingState, AStateSavedOnTheCpuResumesOnTheGpu) {
  FRUGAL_SKIP_WITHOUT_CUDA();
  const auto dir = frugal::testing::fresh_temp_dir("state_cpu_to_cuda");
  const auto path = (dir / "state.frugal").string();
  for (const std::string config : {"plain", "adam8bit"}) {
    auto a = make_resume_setup(config);
    train(*a, 3);
    frugal::save_training_state(*a->trainer, path);
    auto b = make_resume_setup(config, 32, torch::kCUDA);
    frugal::load_training_state(*b->trainer, path);
    EXPECT_TRUE(torch::equal(flat_state(*b->model).cpu(), flat_state(*a->model))) << config;
    for (const auto& p : b->model->parameters()) {
      for (const auto& t : state_tensors_of(*b->optimizer, p)) {
        EXPECT_TRUE(t.is_cuda()) << config;
      }
    }
    const auto before = flat_state(*b->model);
    train(*b, 2);  // a state left on the CPU fails here, mixing devices
    EXPECT_FALSE(torch::equal(flat_state(*b->model), before)) << config;
  }
  fs::remove_all(dir);
}

TEST(CudaTrainingState, ResumesDropoutAndTheGpuGeneratorBitForBit) {
  FRUGAL_SKIP_WITHOUT_CUDA();
  const auto dir = frugal::testing::fresh_temp_dir("state_cuda");
  const auto path = (dir / "state.frugal").string();
  auto a = make_resume_setup("checkpoint", 32, torch::kCUDA);
  train(*a, 3);
  frugal::save_training_state(*a->trainer, path);
  train(*a, 4);  // dropout draws from the GPU's generator
  auto b = make_resume_setup("checkpoint", 32, torch::kCUDA);
  frugal::load_training_state(*b->trainer, path);
  train(*b, 4);
  EXPECT_TRUE(torch::equal(flat_state(*b->model), flat_state(*a->model)));
  fs::remove_all(dir);
}

// Fails in backward at the second gradient, after the step in backward updated the first.
struct FailAtSecondGradient : frugal::Policy {
  std::string name() const override { return "fail-at-second-gradient"; }
  frugal::Traits traits() const override { return frugal::Trait::GradReady; }
  void on_grad_ready(frugal::StepContext&, const torch::Tensor&) override {
    TORCH_CHECK(!armed || ++calls < 2, "injected failure in backward");
  }
  bool armed = false;
  int calls = 0;
};

TEST(TrainingState, LoadingASaveLiftsTheHaltOfAPartialUpdate) {
  const auto dir = frugal::testing::fresh_temp_dir("state_halt");
  const auto path = (dir / "state.frugal").string();
  auto s = make_resume_setup("in-backward");
  auto fail = std::make_shared<FailAtSecondGradient>();
  s->trainer->add_policy(fail);
  train(*s, 2);
  frugal::save_training_state(*s->trainer, path);
  const auto saved = flat_state(*s->model);
  fail->armed = true;
  EXPECT_THROW(train(*s, 1), frugal::PartialStepError);
  ASSERT_FALSE(s->trainer->halted().empty());
  EXPECT_FALSE(torch::equal(flat_state(*s->model), saved));
  EXPECT_THROW(frugal::save_training_state(*s->trainer, path), c10::Error);  // half-updated

  frugal::load_training_state(*s->trainer, path);
  EXPECT_TRUE(s->trainer->halted().empty());
  EXPECT_TRUE(torch::equal(flat_state(*s->model), saved));
  fail->armed = false;
  train(*s, 1);
  EXPECT_EQ(s->trainer->steps(), 3);
  fs::remove_all(dir);
}

}  // namespace
