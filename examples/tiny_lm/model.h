// A small causal Transformer language model: embeddings, blocks that wrap LibTorch's
// TransformerEncoderLayer (held in a ModuleList, called through frugal::nn::call so that
// CheckpointPolicy can checkpoint them), a final norm and the head.
#pragma once

#include <frugal/frugal.h>
#include <torch/torch.h>

#include <limits>

namespace tiny_lm {

struct ModelOptions {
  std::int64_t vocab = 0;
  std::int64_t max_len = 128;
  std::int64_t dim = 128;
  std::int64_t heads = 4;
  std::int64_t layers = 4;
  double dropout = 0.1;
  // Given, each block is stored in 8 bits as soon as it is made (frugal::nn::Int8Weights),
  // so that the model never exists whole in float32: its attention and feed-forward layers
  // as three units, its norms in the store's dtype. The other parameters stay float32.
  frugal::nn::Int8Weights* int8 = nullptr;
};

// One Transformer layer (post-norm, as LibTorch builds it) over [batch, time, dim], with an
// additive attention mask of [time, time].
struct BlockImpl : torch::nn::Module {
  BlockImpl(std::int64_t dim, std::int64_t heads, double dropout)
      : layer(register_module("layer", torch::nn::TransformerEncoderLayer(
                                           torch::nn::TransformerEncoderLayerOptions(dim, heads)
                                               .dim_feedforward(4 * dim)
                                               .dropout(dropout)
                                               .activation(torch::kGELU)))) {}

  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& mask) {
    // LibTorch's layer takes [time, batch, dim]. Made contiguous: under bf16 autocast and
    // no_grad (a checkpointed block's forward) a Linear over the transposed view runs as a
    // batched matmul against one copy of the weight per time step (576 MiB for a 768 x 3072
    // weight and 128 steps); the contiguous copy is the activation's size.
    const auto src = x.transpose(0, 1).contiguous();
    if (!units) {
      return layer->forward(src, mask).transpose(0, 1);
    }
    // The layer's own forward, step for step, with the attention and the two feed-forward
    // layers called through frugal::nn::call: each may then be a unit of its own.
    const auto attended = std::get<0>(frugal::nn::call(
        layer->self_attn, src, src, src, torch::Tensor(), /*need_weights=*/true, mask));
    const auto mid = layer->norm1(src + layer->dropout1(attended));
    const auto fed = frugal::nn::call(
        layer->linear2, layer->dropout(torch::gelu(frugal::nn::call(layer->linear1, mid))));
    return layer->norm2(mid + layer->dropout2(fed)).transpose(0, 1);
  }

  // The attention and the two feed-forward layers, each a unit of `int8` (the norms keep
  // the dtype the block was made in). Its forward stays the layer's.
  void store_in(frugal::nn::Int8Weights& int8) {
    int8.add(layer->self_attn);
    int8.add(layer->linear1);
    int8.add(layer->linear2);
    units = true;
  }

  torch::nn::TransformerEncoderLayer layer;
  bool units = false;  // the sublayers are reached through frugal::nn::call
};
TORCH_MODULE(Block);

struct TinyLMImpl : torch::nn::Module {
  explicit TinyLMImpl(const ModelOptions& o)
      : tokens(register_module("tokens", torch::nn::Embedding(o.vocab, o.dim))),
        positions(register_module("positions", torch::nn::Embedding(o.max_len, o.dim))),
        drop(register_module("drop", torch::nn::Dropout(o.dropout))),
        blocks(register_module("blocks", torch::nn::ModuleList())),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.dim})))),
        head(register_module("head", torch::nn::Linear(o.dim, o.vocab))) {
    for (std::int64_t i = 0; i < o.layers; ++i) {
      if (o.int8 == nullptr) {
        blocks->push_back(Block(o.dim, o.heads, o.dropout));
        continue;
      }
      // Made in the dtype it is stored from: one block exists in 16 bits for a moment.
      // Its attention and feed-forward layers are three units, so that in a step at most
      // one of them (a third of the block) is whole in 16 bits.
      frugal::nn::DefaultDtypeGuard made_in(o.int8->options().dtype().value_or(torch::kFloat));
      Block block(o.dim, o.heads, o.dropout);
      block->store_in(*o.int8);
      blocks->push_back(block);
    }
  }

  // Logits [batch, time, vocab] of the next token at every position.
  torch::Tensor forward(const torch::Tensor& input, const torch::Tensor& padding) {
    return head(features(input, padding));
  }

  // What the head reads: the final norm's output, [batch, time, dim].
  torch::Tensor features(const torch::Tensor& input, const torch::Tensor& padding) {
    const auto len = input.size(1);
    const auto where = torch::arange(len, torch::TensorOptions().device(input.device()));
    // Padded positions start from zeros. Sequences are padded on the right and attention
    // is causal, so a real position never sees a padded one: no key padding mask is needed
    // (LibTorch C++'s would not run under bf16 autocast either).
    auto x = drop((tokens(input) + positions(where)).masked_fill(padding.unsqueeze(-1), 0.0));
    // -inf above the diagonal: a position sees itself and what came before. Added to the
    // attention scores, so that it works under bf16 autocast too.
    // In the embeddings' dtype: float32 under autocast, bfloat16 for bfloat16 weights.
    const auto mask = torch::full({len, len}, -std::numeric_limits<float>::infinity(),
                                  torch::TensorOptions().device(input.device()).dtype(x.dtype()))
                          .triu(1);
    for (std::size_t i = 0; i < blocks->size(); ++i) {
      x = frugal::nn::call(blocks->ptr<BlockImpl>(i), x, mask);
    }
    return norm(x);
  }

  torch::nn::Embedding tokens, positions;
  torch::nn::Dropout drop;
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm norm;
  torch::nn::Linear head;
};
TORCH_MODULE(TinyLM);

}  // namespace tiny_lm
