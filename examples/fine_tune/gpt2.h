// A GPT-2-shaped decoder whose parameters are named as transformers' GPT2LMHeadModel names
// its tensors, so that the safetensors checkpoint save_pretrained writes loads into it.
#pragma once

#include <frugal/io/safetensors.h>
#include <frugal/nn/checkpoint.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

namespace fine_tune {

/// The fields of transformers' GPT2Config that shape the model.
struct Gpt2Config {
  std::int64_t vocab = 256;
  std::int64_t positions = 128;
  std::int64_t embd = 64;
  std::int64_t layers = 2;
  std::int64_t heads = 4;
  double eps = 1e-5;

  /// Read from a save_pretrained folder's config.json; an error for a GPT-2 this model does
  /// not compute (another activation, untied embeddings, cross-attention, ...).
  static Gpt2Config read(const std::string& dir) {
    const auto path = dir + "/config.json";
    std::ifstream in(path);
    if (!in) {
      throw std::runtime_error("no config.json in '" + dir + "'");
    }
    const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    // Values are read in place (find): a copy of one is recursive, and a file may nest deep.
    const auto type = j.is_object() ? j.find("model_type") : j.end();
    if (type == j.end() || *type != "gpt2") {
      throw std::runtime_error(path + " is not a GPT-2 config");
    }
    for (const auto& [key, expected] : std::vector<std::pair<std::string, nlohmann::json>>{
             {"activation_function", "gelu_new"},
             {"tie_word_embeddings", true},
             {"add_cross_attention", false},
             {"scale_attn_weights", true},
             {"scale_attn_by_inverse_layer_idx", false},
             {"reorder_and_upcast_attn", false}}) {
      if (j.contains(key) && j[key] != expected) {
        throw std::runtime_error(path + " has " + key + " of type " + j[key].type_name() +
                                 " or another value; this model computes " + expected.dump());
      }
    }
    // A size: a whole number from 1 to 2^31 (the config is read, not trusted).
    auto size = [&](const char* key) {
      const auto it = j.find(key);
      if (it == j.end() || !it->is_number_integer() || it->get<std::int64_t>() < 1 ||
          it->get<std::int64_t>() > (std::int64_t{1} << 31)) {
        throw std::runtime_error(path + ": " + key +
                                 " must be a whole number from 1 to 2^31, got " +
                                 (it == j.end()     ? std::string("none")
                                  : it->is_number() ? it->dump()
                                                    : it->type_name()));
      }
      return it->get<std::int64_t>();
    };
    Gpt2Config c;
    c.vocab = size("vocab_size");
    c.positions = size("n_positions");
    c.embd = size("n_embd");
    c.layers = size("n_layer");
    c.heads = size("n_head");
    const auto eps = j.find("layer_norm_epsilon");
    c.eps = eps == j.end() ? 1e-5 : eps->is_number() ? eps->get<double>() : -1.0;
    if (!(c.eps > 0) || !std::isfinite(c.eps)) {
      throw std::runtime_error(path + ": layer_norm_epsilon must be a number > 0");
    }
    const auto inner = j.find("n_inner");
    if (inner != j.end() && !inner->is_null()) {
      throw std::runtime_error(path + " sets n_inner; this model's MLP is 4 n_embd wide");
    }
    c.check(path);
    return c;
  }

  /// An error unless the shape is one this model computes: heads dividing the width.
  void check(const std::string& where) const {
    for (const auto& [name, value] : {std::pair<const char*, std::int64_t>{"vocab", vocab},
                                      {"positions", positions},
                                      {"embd", embd},
                                      {"layers", layers},
                                      {"heads", heads}}) {
      if (value < 1) {
        throw std::runtime_error(where + ": " + name + " must be >= 1, got " +
                                 std::to_string(value));
      }
    }
    if (embd % heads != 0) {
      throw std::runtime_error(where + ": " + std::to_string(heads) + " heads do not divide " +
                               std::to_string(embd) + " embedding dimensions");
    }
  }
};

class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const Gpt2Config& c) : heads_(c.heads) {
    c_attn = register_module("c_attn", torch::nn::Linear(c.embd, 3 * c.embd));
    c_proj = register_module("c_proj", torch::nn::Linear(c.embd, c.embd));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto b = x.size(0), t = x.size(1), c = x.size(2);
    const auto qkv = frugal::nn::call(c_attn, x).split(c, 2);
    auto heads = [&](const torch::Tensor& z) {
      return z.view({b, t, heads_, c / heads_}).transpose(1, 2);
    };
    const auto q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
    auto scores = q.matmul(k.transpose(-2, -1)) / std::sqrt(static_cast<double>(c / heads_));
    const auto future = torch::ones({t, t}, x.options().dtype(torch::kBool)).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
    const auto y = scores.softmax(-1).matmul(v).transpose(1, 2).reshape({b, t, c});
    return frugal::nn::call(c_proj, y);
  }
  torch::nn::Linear c_attn{nullptr}, c_proj{nullptr};

 private:
  std::int64_t heads_;
};
TORCH_MODULE(Attention);

class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(const Gpt2Config& c) {
    c_fc = register_module("c_fc", torch::nn::Linear(c.embd, 4 * c.embd));
    c_proj = register_module("c_proj", torch::nn::Linear(4 * c.embd, c.embd));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return frugal::nn::call(c_proj, torch::gelu(frugal::nn::call(c_fc, x), "tanh"));  // gelu_new
  }
  torch::nn::Linear c_fc{nullptr}, c_proj{nullptr};
};
TORCH_MODULE(Mlp);

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const Gpt2Config& c) {
    ln_1 = register_module("ln_1",
                           torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.embd}).eps(c.eps)));
    attn = register_module("attn", Attention(c));
    ln_2 = register_module("ln_2",
                           torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.embd}).eps(c.eps)));
    mlp = register_module("mlp", Mlp(c));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x + attn(ln_1(x));
    return x + mlp(ln_2(x));
  }
  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  Attention attn{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(Block);

/// transformers' GPT2Model: `transformer.*` in the checkpoint.
class TransformerImpl : public torch::nn::Module {
 public:
  explicit TransformerImpl(const Gpt2Config& c) {
    wte = register_module("wte", torch::nn::Embedding(c.vocab, c.embd));
    wpe = register_module("wpe", torch::nn::Embedding(c.positions, c.embd));
    h = register_module("h", torch::nn::ModuleList());
    ln_f = register_module("ln_f",
                           torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.embd}).eps(c.eps)));
  }
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
};
TORCH_MODULE(Transformer);

/// GPT2LMHeadModel: the head is the token embedding, tied (as the checkpoint has no
/// lm_head.weight). Each block is a unit (frugal::nn::call): checkpointed, adapted by LoRA,
/// its frozen weights stored compact, all without a change here. The blocks call their
/// Linear layers through frugal::nn::call too, the one thing LoRA with dropout asks of a
/// model. `add_block` builds the blocks one at a time, so a caller can store each as it is
/// made.
class Gpt2Impl : public torch::nn::Module {
 public:
  explicit Gpt2Impl(const Gpt2Config& c) : config(c) {
    transformer = register_module("transformer", Transformer(c));
  }
  Block add_block() {
    Block block(config);
    transformer->h->push_back(block);
    return block;
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    const auto positions = torch::arange(ids.size(1), ids.options());
    auto x = transformer->wte(ids) + transformer->wpe(positions);
    for (std::size_t i = 0; i < transformer->h->size(); ++i) {
      x = frugal::nn::call(transformer->h->ptr<BlockImpl>(i), x);
    }
    x = transformer->ln_f(x);
    return x.matmul(transformer->wte->weight.t().to(x.scalar_type()));
  }
  std::vector<std::shared_ptr<torch::nn::Module>> blocks() const {
    return transformer->h->children();
  }

  Gpt2Config config;
  Transformer transformer{nullptr};
};
TORCH_MODULE(Gpt2);

}  // namespace fine_tune
