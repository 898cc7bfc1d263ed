// A linear layer into cross-entropy that never holds the whole [tokens, classes] logits.
#pragma once

#include <torch/arg.h>
#include <torch/types.h>

#include <cstdint>

namespace frugal::nn {

/// How linear_cross_entropy reduces over the tokens.
enum class LinearCrossEntropyReduction {
  Mean,  ///< over the tokens whose target is not ignore_index (as cross_entropy's mean)
  Sum,   ///< summed: for TrainerOptions::loss_reduction(Sum), which divides by the global count
};

/// Options of linear_cross_entropy.
///
/// Example:
///   auto options = frugal::nn::LinearCrossEntropyOptions().chunk(512).ignore_index(0);
struct LinearCrossEntropyOptions {
  /// Tokens per chunk: the logits alive at a time are chunk × classes (>= 1).
  TORCH_ARG(std::int64_t, chunk) = 1024;
  /// Targets equal to this count for nothing (no loss, no gradient, not in the mean).
  TORCH_ARG(std::int64_t, ignore_index) = -100;
  /// cross_entropy's label smoothing: the target distribution is (1 - s) one-hot + s / classes.
  TORCH_ARG(double, label_smoothing) = 0.0;
  TORCH_ARG(LinearCrossEntropyReduction, reduction) = LinearCrossEntropyReduction::Mean;
  /// Compute the gradients in backward, the chunks' logits again, rather than in the
  /// forward: nothing is kept from forward to backward but the inputs (in the forward way
  /// the gradients of hidden and weight wait there), for one more matrix product a chunk.
  TORCH_ARG(bool, recompute) = false;
};

/// cross_entropy(linear(hidden, weight, bias), targets) computed chunk by chunk of tokens,
/// so the [tokens, classes] logits and their gradient never exist whole: a language model's
/// head over a large vocabulary (the logits of 8k tokens × 32k classes are 1 GiB in float32,
/// and their gradient as much again). While gradients are recorded, the gradients of
/// `hidden`, `weight` and `bias` are computed in the forward, chunk by chunk, and backward
/// only scales them by the incoming gradient (Liger-Kernel's fused linear cross-entropy,
/// as plain tensor operations); under no_grad only the loss is computed. The log-sum-exp and
/// the weight's gradient accumulate in float32 under autocast (bf16/fp16 matrix products).
///
/// `hidden` is [..., H], `weight` [C, H], `bias` [C] or undefined, `targets` [...] of class
/// indices (int64) with hidden's leading shape. Extra memory: the gradients of hidden and
/// weight (float32 for the weight's), and one chunk's logits a few times over.
///
/// Example:
///   auto h = decoder->forward(tokens);                     // [batch, time, 512]
///   auto loss = frugal::nn::linear_cross_entropy(h, head->weight, head->bias, next_tokens);
///   loss.backward();
torch::Tensor linear_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                   const torch::Tensor& bias, const torch::Tensor& targets,
                                   const LinearCrossEntropyOptions& options = {});

}  // namespace frugal::nn
