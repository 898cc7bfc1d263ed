// Fine-tunes a GPT-2 that Python trained: the checkpoint transformers' save_pretrained writes
// (safetensors) loaded into a C++ GPT-2, LoRA adapters on chosen layers, the base frozen, on
// Debian's fortunes; adapters saved in PEFT's layout, so PEFT loads them (and frugal PEFT's).
//
//   fine_tune --base gpt2-folder [--lora-rank 8] [--lora-alpha 16] [--lora-dropout 0.05]
//             [--targets c_attn]
//             [--base-format float32|bf16|int8|nf4] [--checkpoint] [--save-adapters out]
//   fine_tune --write-base tiny-gpt2 [--embd 64 --layers 2 --heads 4] [as above]
//
// --write-base makes a GPT-2 of random weights (transformers' initialisation), writes it as
// save_pretrained does (config.json, model.safetensors with Conv1D's layout) and fine-tunes
// it as --base would: a base to try on a machine with no checkpoint at hand.
//
// nf4 is QLoRA: the frozen blocks' Linear weights in 4-bit NormalFloat, made whole in bf16
// one block at a time; int8 keeps them as 8-bit codes.
//
// --full fine-tunes every parameter instead, with frugal's leanest full training: AdamW8bit
// with a factored 4-bit second moment and no first moment, stepped in backward; with
// --base-format int8 the blocks' weights train as 8-bit codes (Int8Weights).
#include <fmt/format.h>
#include <frugal/frugal.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <stdexcept>

#include "gpt2.h"
#include "main_flags.h"
#include "text.h"

namespace {

struct Args {
  std::string base;
  std::string fortunes = "/usr/share/games/fortunes";
  std::string base_format = "float32";
  std::int64_t rank = 8;
  double alpha = 16;
  double dropout = 0;
  std::vector<std::string> targets = {"c_attn"};
  std::int64_t steps = 50;
  std::int64_t batch = 8;
  std::int64_t seq = 64;
  double lr = 1e-3;
  bool checkpoint = false;
  std::int64_t memory_cap = 0;
  std::string init_adapters;
  std::string save_adapters;
  std::string dump_logits;
  std::string save_base;
  std::string write_base;
  bool random_base = false;
  bool full = false;  // every parameter trains; no adapters
  std::string compute = "bf16";
  fine_tune::Gpt2Config shape;  // of a random base
  std::string report;
  std::uint64_t seed = 1;
  int threads = 0;
};

torch::Tensor logits_of(fine_tune::Gpt2& model, const torch::Tensor& inputs) {
  torch::NoGradGuard no_grad;
  return model->forward(inputs).to(torch::kFloat).contiguous();
}

// transformers' GPT-2 initialisation: matrices and embeddings N(0, 0.02), biases 0, norms 1.
void init_like_gpt2(torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  for (auto& p : module.named_parameters()) {
    if (p.value().dim() >= 2) {
      p.value().normal_(0, 0.02);
    } else {
      p.value().fill_(p.key().find("ln_") != std::string::npos && p.key().size() > 6 &&
                              p.key().compare(p.key().size() - 6, 6, "weight") == 0
                          ? 1
                          : 0);
    }
  }
}

// A random GPT-2 written as transformers' save_pretrained writes one: config.json and
// model.safetensors, the Conv1D weights stored (in, out) and the tied head left out.
void write_random_base(const std::string& dir, const fine_tune::Gpt2Config& c) {
  c.check("--embd, --layers, --heads");
  fine_tune::Gpt2 model(c);
  for (std::int64_t i = 0; i < c.layers; ++i) {
    model->add_block();
  }
  init_like_gpt2(*model);
  std::filesystem::create_directories(dir);
  frugal::io::save(dir + "/model.safetensors", *model,
                   frugal::io::SaveOptions().transposed(frugal::io::gpt2_conv1d));
  const nlohmann::json config = {{"model_type", "gpt2"},
                                 {"architectures", {"GPT2LMHeadModel"}},
                                 {"vocab_size", c.vocab},
                                 {"n_positions", c.positions},
                                 {"n_embd", c.embd},
                                 {"n_layer", c.layers},
                                 {"n_head", c.heads},
                                 {"n_inner", nullptr},
                                 {"layer_norm_epsilon", c.eps},
                                 {"activation_function", "gelu_new"},
                                 {"tie_word_embeddings", true},
                                 {"resid_pdrop", 0.0},
                                 {"embd_pdrop", 0.0},
                                 {"attn_pdrop", 0.0}};
  std::ofstream out(dir + "/config.json");
  out << config.dump(2) << "\n";
  if (!out.flush()) {
    throw std::runtime_error("could not write " + dir + "/config.json");
  }
  fmt::print("fine_tune: wrote a random GPT-2 ({} blocks of width {}) to {}\n", c.layers, c.embd,
             dir);
}

int run(Args a) {
  torch::manual_seed(a.seed);
  if (!a.write_base.empty()) {  // then fine-tuned as --base would
    write_random_base(a.write_base, a.shape);
    a.base = a.write_base;
    torch::manual_seed(a.seed);
  }
  if (a.memory_cap > 0) {
    frugal::CountingAllocator::install();
    frugal::CountingAllocator::set_cap(a.memory_cap);
  }
  const auto config = a.random_base ? a.shape : fine_tune::Gpt2Config::read(a.base);
  if (a.full && (!a.init_adapters.empty() || !a.save_adapters.empty() || a.dropout > 0)) {
    throw std::invalid_argument("--full trains every parameter and has no adapters: leave out " +
                                std::string(!a.init_adapters.empty() ? "--init-adapters"
                                            : a.dropout > 0          ? "--lora-dropout"
                                                                     : "--save-adapters"));
  }
  if (a.full && a.base_format == "nf4") {
    throw std::invalid_argument(
        "--full trains the weights: give --base-format float32, bf16 or "
        "int8, not nf4");
  }
  const bool stored = a.base_format == "nf4" || a.base_format == "int8";
  // The dtype the model computes in: the base's, or (nf4, int8) the one its codes are made
  // whole in, --compute.
  const auto dtype = a.base_format == "float32" || (stored && a.compute == "float32")
                         ? torch::kFloat
                         : torch::kBFloat16;
  if (a.random_base) {
    config.check("--embd, --layers, --heads");
  }
  std::optional<frugal::io::SafetensorsFile> checkpoint;
  if (!a.random_base) {
    checkpoint.emplace(a.base);
    // Blocks the config leaves out would be skipped silently by the block-wise load.
    for (const auto& name : checkpoint->names()) {
      const std::string blocks = "transformer.h.";
      const auto index =
          name.rfind(blocks, 0) == 0
              ? name.substr(blocks.size(), name.find('.', blocks.size()) - blocks.size())
              : std::string();
      const bool beyond = !index.empty() && index.size() < 10 &&
                          index.find_first_not_of("0123456789") == std::string::npos &&
                          std::stoll(index) >= config.layers;
      if (beyond) {
        throw std::runtime_error(
            fmt::format("{} holds '{}', beyond the {} blocks its config.json gives (n_layer)",
                        a.base, name, config.layers));
      }
    }
  }
  // The frozen base, block by block: each block's tensors loaded and (nf4, int8) stored at
  // once, so the model never exists whole in 16 bits.
  frugal::nn::FrozenWeights store(frugal::nn::FrozenWeightsOptions()
                                      .format(a.base_format == "int8"
                                                  ? frugal::nn::FrozenFormat::Int8
                                                  : frugal::nn::FrozenFormat::NF4)
                                      .dtype(dtype));
  // --full with int8: the blocks' weights as trainable 8-bit codes instead.
  frugal::nn::Int8Weights codes(frugal::nn::Int8WeightsOptions().dtype(dtype));
  const auto conv1d = frugal::io::LoadOptions().transposed(frugal::io::gpt2_conv1d);
  fine_tune::Gpt2 model(nullptr);
  {
    frugal::nn::DefaultDtypeGuard as(dtype);  // the base is made in its own dtype
    model = fine_tune::Gpt2(config);
    if (!checkpoint) {
      init_like_gpt2(*model);
    } else {
      frugal::io::load(*model, *checkpoint,
                       frugal::io::LoadOptions(conv1d).rename([](const std::string& n) {
                         return n.rfind("transformer.h.", 0) == 0 ? "" : n;
                       }));
    }
    for (std::int64_t i = 0; i < config.layers; ++i) {
      auto block = model->add_block();
      const auto prefix = "transformer.h." + std::to_string(i) + ".";
      if (!checkpoint) {
        init_like_gpt2(*block);
      } else {
        frugal::io::load(*block, *checkpoint,
                         frugal::io::LoadOptions(conv1d).rename([&prefix](const std::string& n) {
                           return n.rfind(prefix, 0) == 0 ? n.substr(prefix.size()) : "";
                         }));
      }
      if (stored && a.full) {
        codes.add(block);
      } else if (stored) {
        store.add(block);
      }
    }
  }
  if (!a.save_base.empty()) {  // the stored codes, for comparing with bitsandbytes
    frugal::io::save(a.save_base, *model);
  }
  std::optional<frugal::nn::Lora> lora;
  if (!a.full) {
    lora.emplace(*model, model->blocks(),
                 frugal::nn::LoraOptions()
                     .rank(a.rank)
                     .alpha(a.alpha)
                     .dropout(a.dropout)
                     .target_modules(a.targets)
                     .fan_in_fan_out(true));
    if (!a.init_adapters.empty()) {
      lora->load(a.init_adapters);
    }
  }
  const auto sequences = fine_tune::read_sequences(a.fortunes, a.seq);
  // With --dump-logits: the first batch's logits before training.
  const auto probe = fine_tune::batch_of(sequences, 0, a.batch).narrow(1, 0, a.seq);
  const auto before = a.dump_logits.empty() ? torch::Tensor() : logits_of(model, probe);

  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (lora) {
    optimizer = std::make_unique<frugal::optim::AdamW>(
        lora->parameters(), torch::optim::AdamWOptions(a.lr).weight_decay(0));
  } else {
    optimizer = std::make_unique<frugal::optim::AdamW8bit>(
        model->parameters(), torch::optim::AdamWOptions(a.lr).weight_decay(0).betas({0.0, 0.999}),
        frugal::optim::four_bit_states().factored(true));
  }
  auto trainer = std::make_shared<frugal::Trainer>(
      model, *optimizer, [vocab = config.vocab](const torch::Tensor& out, const torch::Tensor& y) {
        return torch::cross_entropy_loss(out.reshape({-1, vocab}).to(torch::kFloat), y.reshape(-1));
      });
  if (a.full) {
    trainer->add_policy(std::make_shared<frugal::StepInBackward>());
  }
  if (a.checkpoint) {
    trainer->add_policy(
        std::make_shared<frugal::CheckpointPolicy>(frugal::CheckpointSelect().every(1)));
  }
  if (!a.report.empty()) {
    trainer->add_sink(std::make_shared<frugal::JsonLinesSink>(a.report));
  }
  torch::manual_seed(a.seed);  // dropout's masks: the same for any base and its format
  double loss = 0;
  for (std::int64_t k = 0; k < a.steps; ++k) {
    const auto rows = fine_tune::batch_of(sequences, k, a.batch);
    loss = trainer->step(frugal::Batch(rows.narrow(1, 0, a.seq), rows.narrow(1, 1, a.seq))).loss;
  }
  if (!a.save_adapters.empty()) {
    lora->save(a.save_adapters);
  }
  if (!a.dump_logits.empty()) {
    frugal::io::save(a.dump_logits,
                     {{"before", before}, {"after", logits_of(model, probe)}, {"inputs", probe}});
  }
  // The base's bytes: stored codes and statistics, and the parameters it keeps as they are
  // (embeddings, norms, biases); the adapters are not the base.
  std::int64_t base_params = store.stored_elements() + codes.stored_elements();
  std::int64_t base_bytes = store.stored_bytes() + codes.stored_bytes();
  std::int64_t adapters = 0;
  for (const auto& p : lora ? lora->parameters() : std::vector<torch::Tensor>{}) {
    adapters += p.numel();
  }
  for (const auto& p : model->parameters()) {
    base_params += p.numel();
    base_bytes += static_cast<std::int64_t>(p.nbytes());
  }
  base_params -= adapters;
  base_bytes -= adapters * 4;
  const auto name = a.random_base ? std::string("a random base") : a.base;
  if (lora) {
    fmt::print("fine_tune: {} steps of LoRA r={} on {} ({} adapted layers, {} base), loss {:.4f}\n",
               a.steps, a.rank, name, lora->adapted().size(), a.base_format, loss);
  } else {
    fmt::print("fine_tune: {} steps of full fine-tuning on {} ({} weights), loss {:.4f}\n", a.steps,
               name, a.base_format, loss);
  }
  fmt::print("base: {} parameters in {} bytes ({:.3f} bytes a parameter); adapters: {}{}\n",
             base_params, base_bytes,
             static_cast<double>(base_bytes) / static_cast<double>(base_params), adapters,
             a.memory_cap > 0 ? fmt::format("; peak {} bytes under a cap of {}",
                                            frugal::CountingAllocator::stats().peak, a.memory_cap)
                              : std::string());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Fine-tune a transformers GPT-2 checkpoint with LoRA on Debian's fortunes"};
  Args a;
  auto* base = app.add_option("--base", a.base,
                              "save_pretrained folder of a GPT-2 (config.json, safetensors)")
                   ->check(CLI::ExistingDirectory);
  auto* random = app.add_flag("--random-base", a.random_base,
                              "A base of random weights shaped by --embd, --layers, --heads (for "
                              "measuring what fits under --memory-cap)");
  auto* write =
      app.add_option("--write-base", a.write_base,
                     "Write a GPT-2 of random weights shaped by --embd, --layers, --heads "
                     "here, as transformers saves one, then fine-tune it as --base");
  base->excludes(random);
  write->excludes(base);
  write->excludes(random);
  app.add_option("--embd", a.shape.embd, "A random base's width")->capture_default_str();
  app.add_option("--layers", a.shape.layers, "A random base's blocks")->capture_default_str();
  app.add_option("--heads", a.shape.heads, "A random base's attention heads")
      ->capture_default_str();
  app.add_option("--fortunes", a.fortunes, "Folder of Debian's fortunes")->capture_default_str();
  app.add_option("--base-format", a.base_format, "The frozen base's dtype")
      ->check(CLI::IsMember({"float32", "bf16", "int8", "nf4"}))
      ->capture_default_str();
  app.add_option("--compute", a.compute,
                 "What nf4 and int8 codes are made whole in (LibTorch's CPU bf16 matrix products "
                 "are slow; float32 is exact and quick there)")
      ->check(CLI::IsMember({"bf16", "float32"}))
      ->capture_default_str();
  app.add_option("--lora-rank", a.rank, "Adapters' rank r")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--lora-alpha", a.alpha, "Adapters' alpha (scale alpha / r)")
      ->capture_default_str();
  app.add_option("--lora-dropout", a.dropout,
                 "Dropout on the adapters' input, as PEFT's lora_dropout (in [0, 1))")
      ->capture_default_str();
  app.add_option("--targets", a.targets, "Layers to adapt, as PEFT's target_modules")
      ->capture_default_str();
  app.add_option("--steps", a.steps, "Training steps")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--batch", a.batch, "Sequences a step")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--seq", a.seq, "Tokens a sequence")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--lr", a.lr, "AdamW's learning rate")->capture_default_str();
  app.add_flag("--checkpoint", a.checkpoint, "Checkpoint every block");
  app.add_flag("--full", a.full,
               "Train every parameter (AdamW8bit: factored 4-bit second moment, no first "
               "moment, stepped in backward; int8: the weights as 8-bit codes) instead of "
               "adapters");
  app.add_option("--memory-cap", a.memory_cap, "CPU bytes frugal may allocate (0: no cap)");
  app.add_option("--init-adapters", a.init_adapters, "Start from these adapters (PEFT's folder)")
      ->check(CLI::ExistingDirectory);
  app.add_option("--save-adapters", a.save_adapters, "Write the adapters here, in PEFT's layout");
  app.add_option("--dump-logits", a.dump_logits,
                 "Write the first batch's logits before and after training (safetensors)");
  app.add_option("--report", a.report, "Write a JSON-lines report here");
  app.add_option("--save-base", a.save_base, "Write the loaded (and stored) base's tensors here");
  examples::seed_flag(app, a.seed,
                      "Seed of the adapters' initialisation and, again before the first step, "
                      "of dropout's masks");
  examples::threads_flag(app, a.threads);
  return examples::parse_and_run(app, argc, argv, [&] {
    if (a.base.empty() && !a.random_base && a.write_base.empty()) {
      throw std::invalid_argument("give --base FOLDER, --write-base FOLDER or --random-base");
    }
    return run(a);
  });
}
