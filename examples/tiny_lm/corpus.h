// English text from Debian's `fortunes` package, as characters: reading, a fixed
// vocabulary, a held-out share, and padded batches of variable-length sequences.
#pragma once

#include <frugal/frugal.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace tiny_lm {

constexpr std::int64_t kPad = 0;           // padding: no loss, masked as a key
constexpr std::int64_t kStart = 1;         // begins every sequence
constexpr std::int64_t kVocab = 2 + 96;    // printable ASCII and '\n'
constexpr std::int64_t kIgnore = -100;     // targets at padding (cross_entropy's default)

inline std::int64_t token_of(char c) {
  if (c == '\n') {
    return 2 + 95;
  }
  return c >= 32 && c < 127 ? 2 + (c - 32) : -1;  // other characters are dropped
}

inline char char_of(std::int64_t token) {
  return token == 2 + 95 ? '\n' : static_cast<char>(token - 2 + 32);
}

// The fortunes of every text file in `dir` (not the .dat indexes, not the ASCII-art
// collections), split at "%" lines, encoded, and cut into pieces of at most `max_len`
// characters; pieces under 8 characters are dropped.
inline std::vector<std::vector<std::int64_t>> read_fortunes(const std::string& dir,
                                                            std::int64_t max_len) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir)) {
    throw std::runtime_error("no fortunes in '" + dir +
                             "': install Debian's package with `apt-get install fortunes`");
  }
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const auto name = entry.path().filename().string();
    if (entry.is_regular_file() && !entry.path().has_extension() && name != "art" &&
        name != "ascii-art") {
      files.push_back(entry.path());
    }
  }
  std::sort(files.begin(), files.end());
  std::vector<std::vector<std::int64_t>> out;
  auto keep = [&](std::vector<std::int64_t>& text) {
    for (std::size_t at = 0; at < text.size(); at += static_cast<std::size_t>(max_len)) {
      const auto end = std::min(text.size(), at + static_cast<std::size_t>(max_len));
      if (end - at >= 8) {
        out.emplace_back(text.begin() + static_cast<std::ptrdiff_t>(at),
                         text.begin() + static_cast<std::ptrdiff_t>(end));
      }
    }
    text.clear();
  };
  for (const auto& file : files) {
    std::ifstream in(file);
    std::string line;
    std::vector<std::int64_t> text;
    while (std::getline(in, line)) {
      if (line == "%") {
        keep(text);
        continue;
      }
      for (const char c : line + "\n") {
        const auto t = token_of(c);
        if (t >= 0) {
          text.push_back(t);
        }
      }
    }
    keep(text);
  }
  if (out.empty()) {
    throw std::runtime_error("no text found in '" + dir + "'");
  }
  return out;
}

// Sequences `which` as one batch, padded to the longest of them: inputs are the start
// token and the text, targets the text and kIgnore where padded; the named tensor
// "padding" is true at padded positions.
inline frugal::Batch make_batch(const std::vector<std::vector<std::int64_t>>& seqs,
                                const std::vector<std::int64_t>& which) {
  std::size_t longest = 0;
  for (const auto i : which) {
    longest = std::max(longest, seqs[static_cast<std::size_t>(i)].size());
  }
  const auto n = static_cast<std::int64_t>(which.size());
  const auto len = static_cast<std::int64_t>(longest);
  auto inputs = torch::full({n, len}, kPad, torch::kLong);
  auto targets = torch::full({n, len}, kIgnore, torch::kLong);
  auto in = inputs.accessor<std::int64_t, 2>();
  auto tg = targets.accessor<std::int64_t, 2>();
  for (std::int64_t r = 0; r < n; ++r) {
    const auto& s = seqs[static_cast<std::size_t>(which[static_cast<std::size_t>(r)])];
    for (std::int64_t j = 0; j < static_cast<std::int64_t>(s.size()); ++j) {
      in[r][j] = j == 0 ? kStart : s[static_cast<std::size_t>(j - 1)];
      tg[r][j] = s[static_cast<std::size_t>(j)];
    }
  }
  frugal::Batch batch{inputs, targets};
  batch.set("padding", targets.eq(kIgnore));
  return batch;
}

// Non-padding target tokens: what the loss is averaged over.
inline std::int64_t tokens(const frugal::Batch& b) {
  return b.targets.ne(kIgnore).sum().item<std::int64_t>();
}

}  // namespace tiny_lm
