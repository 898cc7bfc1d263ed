// The fine-tune's data: the bytes of Debian's fortunes, cut into sequences, visited in an
// order the Python twin computes the same way.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "fortunes.h"

namespace fine_tune {

/// Byte tokens (vocabulary 256) of every fortune file in `dir` (no extension, not the
/// ASCII-art ones), in name order, as sequences of `len` + 1 tokens: a step's inputs are a
/// sequence's first `len`, its targets the last `len`.
inline torch::Tensor read_sequences(const std::string& dir, std::int64_t len) {
  const auto files = examples::fortune_files(dir);
  std::string bytes;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    bytes.append(std::istreambuf_iterator<char>(in), {});
  }
  const auto n = static_cast<std::int64_t>(bytes.size()) / (len + 1);
  if (n < 1) {
    throw std::runtime_error("the fortunes in '" + dir + "' are shorter than one sequence");
  }
  // A copy (of another dtype): the tensor outlives `bytes`.
  return torch::from_blob(bytes.data(), {n, len + 1}, torch::kUInt8).to(torch::kLong);
}

/// Sequence `j` of batch `k`: (k * batch + j) * 7919 modulo their number, a spread of the
/// whole text that the twin computes the same way.
inline torch::Tensor batch_of(const torch::Tensor& sequences, std::int64_t k, std::int64_t batch) {
  const auto n = sequences.size(0);
  std::vector<std::int64_t> rows;
  for (std::int64_t j = 0; j < batch; ++j) {
    rows.push_back(((k * batch + j) * 7919) % n);
  }
  return sequences.index_select(0, torch::tensor(rows));
}

}  // namespace fine_tune
