// A causal Transformer language model on English text (Debian's `fortunes`), of characters
// or of words, trained with frugal: padded variable-length batches whose loss is averaged
// over non-padding tokens, micro-batches, checkpointed blocks, bf16 autocast, a chunked loss
// head for large vocabularies, out-of-memory recovery, and the held-out perplexity.
//
//   tiny_lm [--batch 32] [--micro-batch 8] [--checkpoint] [--autocast bf16] [--max-steps 600]
//   tiny_lm --tokens words --vocab 16384 --loss-head chunked
#include <fmt/format.h>
#include <frugal/frugal.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>

#include "corpus.h"
#include "device.h"
#include "main_flags.h"
#include "memory_timeline_flags.h"
#include "model.h"

namespace {

struct Args {
  std::string data_dir = "/usr/share/games/fortunes";
  std::int64_t batch = 32;
  std::int64_t micro_batch = 0;
  double lr = 2e-3;
  double dropout = 0.1;
  bool checkpoint = false;
  std::string autocast = "off";
  std::uint64_t seed = 1;
  int threads = 0;
  std::int64_t max_steps = 600;
  std::int64_t max_len = 128;
  std::int64_t dim = 128;
  std::int64_t heads = 4;
  std::int64_t layers = 4;
  std::int64_t eval_every = 200;
  std::int64_t eval_samples = 1000;
  std::int64_t memory_cap = 0;
  std::string device = "cpu";
  std::string tokens = "chars";
  std::int64_t vocab = 16384;
  std::string loss_head = "plain";
  std::int64_t loss_chunk = 1024;
  std::string report;
  bool quiet = false;
  std::string optimizer = "adamw";
  double beta1 = 0.9;
  bool factored = false;
  std::string weights = "float32";
  std::string rounding = "stochastic";
  std::string materialise = "bf16";
  examples::TimelineFlags timeline;
};

// frugal's AdamW, on float32 states or 8-bit ones (factored or not); bfloat16 and 8-bit
// weights take its updates rounded as --rounding says (stochastically: seeded by --seed).
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const Args& a,
                                                        std::vector<torch::Tensor> params) {
  const auto options = torch::optim::AdamWOptions(a.lr).weight_decay(0.01).betas({a.beta1, 0.999});
  const auto in_place = frugal::optim::InPlaceOptions().seed(a.seed).rounding(
      a.rounding == "nearest" ? frugal::optim::Rounding::Nearest
                              : frugal::optim::Rounding::Stochastic);
  if (a.optimizer == "adamw8bit" || a.optimizer == "adamw4bit") {
    auto states = a.optimizer == "adamw4bit" ? frugal::optim::four_bit_states()
                                             : frugal::optim::QuantizedStateOptions();
    return std::make_unique<frugal::optim::AdamW8bit>(std::move(params), options,
                                                      states.factored(a.factored), in_place);
  }
  return std::make_unique<frugal::optim::AdamW>(std::move(params), options, in_place);
}

// Held-out: every 10th sequence, the first `limit` of them, in one padded batch.
frugal::Batch held_out(const std::vector<std::vector<std::int64_t>>& seqs, std::int64_t limit,
                       std::vector<std::int64_t>* train) {
  std::vector<std::int64_t> test;
  for (std::int64_t i = 0; i < static_cast<std::int64_t>(seqs.size()); ++i) {
    if (i % 10 == 9) {
      if (static_cast<std::int64_t>(test.size()) < limit) {
        test.push_back(i);
      }
    } else {
      train->push_back(i);
    }
  }
  return tiny_lm::make_batch(seqs, test);
}

// The held-out accuracy, or "-" where the loss head leaves no logits to score.
std::string accuracy(const frugal::EvalReport& eval) {
  return eval.accuracy >= 0 ? fmt::format("{:.4f}", eval.accuracy) : "-";
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{
      "tiny_lm: a Transformer language model of characters or words on Debian's "
      "fortunes"};
  app.add_option("--data-dir", a.data_dir, "Folder of fortune files");
  app.add_option("--batch", a.batch, "Sequences per optimizer step")->check(CLI::PositiveNumber);
  app.add_option("--micro-batch", a.micro_batch, "Sequences per micro-batch (0: the whole batch)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--lr", a.lr, "AdamW learning rate");
  app.add_option("--optimizer", a.optimizer,
                 "adamw (float32 states), adamw8bit (8-bit states) or adamw4bit (4-bit states)")
      ->check(CLI::IsMember({"adamw", "adamw8bit", "adamw4bit"}));
  app.add_option("--beta1", a.beta1,
                 "AdamW's first-moment decay (0 with adamw8bit or adamw4bit: no first moment is "
                 "kept)")
      ->check(CLI::Range(0.0, 0.999999));
  app.add_flag("--factored", a.factored,
               "adamw8bit, adamw4bit: keep a matrix's second moment as row and column "
               "statistics");
  app.add_option("--weights", a.weights,
                 "The weights' dtype: float32, bf16 (gradients too) or int8 (the blocks' "
                 "matrices as 8-bit codes, materialised one layer at a time; the rest in "
                 "--materialise's dtype)")
      ->check(CLI::IsMember({"float32", "bf16", "int8"}));
  app.add_option("--rounding", a.rounding,
                 "How bf16 and int8 weights take the updates: stochastic or nearest")
      ->check(CLI::IsMember({"stochastic", "nearest"}));
  app.add_option("--materialise", a.materialise,
                 "With --weights int8, the dtype a layer runs in: bf16 or float32")
      ->check(CLI::IsMember({"bf16", "float32"}));
  app.add_option("--dropout", a.dropout, "Dropout in the embeddings and blocks")
      ->check(CLI::Range(0.0, 0.99));
  app.add_flag("--checkpoint", a.checkpoint, "Checkpoint every Transformer block");
  app.add_option("--autocast", a.autocast, "off or bf16")->check(CLI::IsMember({"off", "bf16"}));
  examples::seed_flag(app, a.seed, "Seed of the weights, the order and dropout");
  app.add_option("--threads", a.threads, "LibTorch threads (0: its default)")
      ->check(CLI::Range(0, 256));
  app.add_option("--max-steps", a.max_steps, "Optimizer steps")->check(CLI::PositiveNumber);
  app.add_option("--tokens", a.tokens, "chars or words")->check(CLI::IsMember({"chars", "words"}));
  app.add_option("--vocab", a.vocab, "Vocabulary of --tokens words: the most frequent words")
      ->check(CLI::Range(std::int64_t{4}, std::int64_t{1} << 20));
  app.add_option("--loss-head", a.loss_head,
                 "plain (the head's logits, then cross_entropy) or chunked "
                 "(frugal::nn::linear_cross_entropy)")
      ->check(CLI::IsMember({"plain", "chunked"}));
  app.add_option("--loss-chunk", a.loss_chunk, "Tokens per chunk of --loss-head chunked")
      ->check(CLI::PositiveNumber);
  app.add_option("--max-len", a.max_len, "Longest sequence, in tokens")->check(CLI::Range(8, 4096));
  app.add_option("--dim", a.dim, "Model width")->check(CLI::PositiveNumber);
  app.add_option("--heads", a.heads, "Attention heads")->check(CLI::PositiveNumber);
  app.add_option("--layers", a.layers, "Transformer blocks")->check(CLI::PositiveNumber);
  app.add_option("--eval-every", a.eval_every, "Steps between held-out evaluations (0: at the end)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--eval-samples", a.eval_samples, "Held-out sequences evaluated")
      ->check(CLI::PositiveNumber);
  app.add_option("--device", a.device, "cpu, cuda or cuda:N")->capture_default_str();
  app.add_option("--memory-cap", a.memory_cap,
                 "Cap on the device's tensor bytes, in MiB (0: none; on CUDA the caching "
                 "allocator's fraction)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--report", a.report, "Write a JSON-lines report here");
  examples::memory_timeline_flags(app, a.timeline);
  app.add_flag("--quiet", a.quiet, "Print only the result line");
  CLI11_PARSE(app, argc, argv);
  if (a.factored && a.optimizer == "adamw") {
    fmt::print(stderr, "tiny_lm: --factored needs --optimizer adamw8bit or adamw4bit, not {}\n",
               a.optimizer);
    return 2;
  }
  if (a.dim % a.heads != 0) {
    fmt::print(stderr, "tiny_lm: --dim {} is not a multiple of --heads {}\n", a.dim, a.heads);
    return 2;
  }

  try {
    if (a.threads > 0) {
      torch::set_num_threads(a.threads);
    }
    torch::manual_seed(a.seed);
    const auto device = examples::pick_device(a.device);
    const auto texts = tiny_lm::read_fortune_texts(a.data_dir);
    const auto tokenizer = a.tokens == "words" ? tiny_lm::Tokenizer::words(texts, a.vocab)
                                               : tiny_lm::Tokenizer::characters();
    const auto seqs = tiny_lm::encode_fortunes(texts, tokenizer, a.max_len);
    std::vector<std::int64_t> train;
    const auto test = held_out(seqs, a.eval_samples, &train);

    tiny_lm::ModelOptions model_options{tokenizer.size(), a.max_len, a.dim,
                                        a.heads,          a.layers,  a.dropout};
    const auto runs_in = a.materialise == "float32" ? torch::kFloat32 : torch::kBFloat16;
    std::unique_ptr<frugal::nn::Int8Weights> int8;  // with --weights int8
    if (a.weights == "int8") {
      int8 = std::make_unique<frugal::nn::Int8Weights>(
          frugal::nn::Int8WeightsOptions().dtype(runs_in));
      model_options.int8 = int8.get();
    }
    tiny_lm::TinyLM model(model_options);
    if (int8 != nullptr) {  // the blocks are stored; the rest runs in their dtype
      for (auto* m : std::initializer_list<torch::nn::Module*>{
               model->tokens.get(), model->positions.get(), model->norm.get(), model->head.get()}) {
        m->to(device, runs_in);
      }
      model->blocks->to(device);  // codes and statistics as they are
    } else {
      model->to(device, a.weights == "bf16" ? torch::kBFloat16 : torch::kFloat32);
    }
    const auto optimizer = make_optimizer(a, model->parameters());
    auto& adamw = *optimizer;
    auto options = frugal::TrainerOptions().device(device).count(tiny_lm::tokens).eval_batch(250);
    if (a.micro_batch > 0) {
      options.micro_batch(a.micro_batch);
    }
    // The chunked head never holds the [tokens, vocab] logits; evaluation then reports the
    // loss without the accuracy (there are no logits to take the argmax of).
    auto trainer = a.loss_head == "chunked"
                       ? std::make_unique<frugal::Trainer>(
                             model.ptr(), adamw,
                             [&](const frugal::Batch& b) {
                               return frugal::nn::linear_cross_entropy(
                                   model->features(b.inputs, b.get("padding")), model->head->weight,
                                   model->head->bias, b.targets,
                                   frugal::nn::LinearCrossEntropyOptions()
                                       .chunk(a.loss_chunk)
                                       .ignore_index(tiny_lm::kIgnore));
                             },
                             options)
                       : std::make_unique<frugal::Trainer>(
                             model.ptr(), adamw,
                             [&](const frugal::Batch& b) {
                               return model->forward(b.inputs, b.get("padding"));
                             },
                             [](const torch::Tensor& logits, const frugal::Batch& b) {
                               return torch::nn::functional::cross_entropy(
                                   logits.flatten(0, 1).to(torch::kFloat), b.targets.flatten(),
                                   torch::nn::functional::CrossEntropyFuncOptions().ignore_index(
                                       tiny_lm::kIgnore));
                             },
                             options);
    if (a.checkpoint) {
      trainer->add_policy(std::make_shared<frugal::CheckpointPolicy>(
          frugal::CheckpointSelect().types({"tiny_lm::Block"})));
    }
    if (a.autocast == "bf16") {
      frugal::use_mixed_precision(*trainer, torch::kBFloat16);
    }
    std::shared_ptr<frugal::MemoryTimeline> timeline;
    if (!a.timeline.file.empty()) {
      timeline = std::make_shared<frugal::MemoryTimeline>(a.timeline.file, a.timeline.step);
      trainer->add_policy(timeline);
    }
    trainer->add_policy(std::make_shared<frugal::OomRecovery>());
    trainer->add_policy(std::make_shared<frugal::LrSchedule>(
        frugal::LrScheduleOptions()
            .decay(frugal::LrDecay::Cosine)
            .warmup_steps(std::min<std::int64_t>(50, a.max_steps / 10))
            .total_steps(a.max_steps)
            .min_factor(0.1)));
    if (!a.quiet) {
      trainer->add_sink(std::make_shared<frugal::ConsoleSink>(stdout, 50));
    }
    if (!a.report.empty()) {
      trainer->add_sink(std::make_shared<frugal::JsonLinesSink>(a.report));
    }
    std::optional<frugal::ScopedMemoryCap> cap;
    if (a.memory_cap > 0) {
      cap.emplace(device, frugal::MiB(a.memory_cap));
    }
    if (!a.quiet) {
      fmt::print(
          "tiny_lm: {} training and {} held-out sequences of up to {} {}, a vocabulary "
          "of {}; {} parameters\n",
          train.size(), test.size(), a.max_len, a.tokens == "words" ? "words" : "characters",
          tokenizer.size(), [&] {
            std::int64_t n = 0;
            for (const auto& p : model->parameters()) n += p.numel();
            return n;
          }());
    }

    auto generator = torch::make_generator<torch::CPUGeneratorImpl>(a.seed);
    const auto start = std::chrono::steady_clock::now();
    frugal::EvalReport eval;
    double last_loss = 0;
    std::int64_t epoch = 0;
    std::int64_t at = static_cast<std::int64_t>(train.size());  // forces a first shuffle
    torch::Tensor order;
    while (trainer->steps() < a.max_steps) {
      if (at + a.batch > static_cast<std::int64_t>(train.size())) {
        order = torch::randperm(static_cast<std::int64_t>(train.size()), generator);
        at = 0;
        ++epoch;
      }
      std::vector<std::int64_t> which;
      const auto* o = order.data_ptr<std::int64_t>();
      for (std::int64_t i = 0; i < a.batch; ++i) {
        which.push_back(train[static_cast<std::size_t>(o[at + i])]);
      }
      at += a.batch;
      last_loss = trainer->step(tiny_lm::make_batch(seqs, which)).loss;
      if (timeline && trainer->steps() == a.timeline.step && !a.quiet) {
        examples::print_timeline("tiny_lm", *timeline->recorder(), a.timeline.file,
                                 a.timeline.step);
      }
      const bool last = trainer->steps() == a.max_steps;
      if (last || (a.eval_every > 0 && trainer->steps() % a.eval_every == 0)) {
        eval = trainer->evaluate(test);
        if (!a.quiet) {
          fmt::print("step {}: held-out loss {:.4f} perplexity {:.3f} accuracy {}\n",
                     trainer->steps(), eval.loss, std::exp(eval.loss), accuracy(eval));
        }
      }
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    fmt::print(
        "tiny_lm: {} steps ({} epochs) in {:.1f} s, train loss {:.4f}, held-out "
        "perplexity {:.3f}, accuracy {}, skipped {}\n",
        trainer->steps(), epoch, seconds, last_loss, std::exp(eval.loss), accuracy(eval),
        trainer->skipped_steps());
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "tiny_lm: {}\n", frugal::error_message(e));
    return 1;
  }
}
