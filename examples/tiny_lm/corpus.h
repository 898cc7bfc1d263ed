// English text from Debian's `fortunes` package, as characters or words: reading, the
// vocabulary, and padded batches of variable-length sequences.
#pragma once

#include <frugal/frugal.h>
#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fortunes.h"

namespace tiny_lm {

constexpr std::int64_t kPad = 0;        // padding: no loss, masked as a key
constexpr std::int64_t kStart = 1;      // begins every sequence
constexpr std::int64_t kIgnore = -100;  // targets at padding (cross_entropy's default)

// How text becomes tokens: characters (printable ASCII and '\n'; others are dropped) or
// words (the most frequent lower-cased words, punctuation marks and '\n' of the texts, one
// token for all other words).
class Tokenizer {
 public:
  static Tokenizer characters() { return Tokenizer(); }

  // The `size` - 3 most frequent pieces of `texts` (ties in alphabetical order), after
  // padding, start and the unknown word.
  static Tokenizer words(const std::vector<std::string>& texts, std::int64_t size) {
    if (size < 4) {
      throw std::invalid_argument(
          "--vocab must be at least 4 (padding, start, unknown and "
          "one word), got " +
          std::to_string(size));
    }
    std::unordered_map<std::string, std::int64_t> counts;
    for (const auto& text : texts) {
      for_each_word(text, [&](const std::string& w) { ++counts[w]; });
    }
    std::vector<std::pair<std::string, std::int64_t>> ranked(counts.begin(), counts.end());
    std::sort(ranked.begin(), ranked.end(), [](const auto& x, const auto& y) {
      return x.second != y.second ? x.second > y.second : x.first < y.first;
    });
    if (static_cast<std::int64_t>(ranked.size()) + 3 < size) {
      throw std::invalid_argument("--vocab " + std::to_string(size) + " is more than the " +
                                  std::to_string(ranked.size() + 3) + " tokens the texts have");
    }
    Tokenizer t;
    t.size_ = size;
    for (std::int64_t i = 0; i + 3 < size; ++i) {
      t.ids_.emplace(ranked[static_cast<std::size_t>(i)].first, i + 3);
    }
    return t;
  }

  std::int64_t size() const { return size_; }
  bool of_words() const { return !ids_.empty(); }

  std::vector<std::int64_t> encode(const std::string& text) const {
    std::vector<std::int64_t> out;
    if (of_words()) {
      for_each_word(text, [&](const std::string& w) {
        const auto it = ids_.find(w);
        out.push_back(it == ids_.end() ? kUnknown : it->second);
      });
    } else {
      for (const char c : text) {
        if (c == '\n') {
          out.push_back(2 + 95);
        } else if (c >= 32 && c < 127) {
          out.push_back(2 + (c - 32));
        }
      }
    }
    return out;
  }

 private:
  static constexpr std::int64_t kUnknown = 2;

  // Runs of letters, digits and apostrophes, lower-cased; every other printable
  // character but the space, and '\n', on its own.
  template <typename F>
  static void for_each_word(const std::string& text, F&& f) {
    std::string word;
    for (const char c : text) {
      const auto u = static_cast<unsigned char>(c);
      if (std::isalnum(u) || c == '\'') {
        word.push_back(static_cast<char>(std::tolower(u)));
        continue;
      }
      if (!word.empty()) {
        f(word);
        word.clear();
      }
      if (c == '\n' || (std::isgraph(u) && u < 128)) {
        f(std::string(1, c));
      }
    }
    if (!word.empty()) {
      f(word);
    }
  }

  std::int64_t size_ = 2 + 96;
  std::unordered_map<std::string, std::int64_t> ids_;
};

// The fortunes of every text file in `dir` (not the .dat indexes, not the ASCII-art
// collections), split at "%" lines, each with its line ends.
inline std::vector<std::string> read_fortune_texts(const std::string& dir) {
  const auto files = examples::fortune_files(dir);
  std::vector<std::string> out;
  for (const auto& file : files) {
    std::ifstream in(file);
    std::string line, text;
    while (std::getline(in, line)) {
      if (line == "%") {
        out.push_back(std::move(text));
        text.clear();
      } else {
        text += line + "\n";
      }
    }
    out.push_back(std::move(text));
  }
  return out;
}

// The texts encoded and cut into pieces of at most `max_len` tokens; pieces under 8
// tokens are dropped.
inline std::vector<std::vector<std::int64_t>> encode_fortunes(const std::vector<std::string>& texts,
                                                              const Tokenizer& tokenizer,
                                                              std::int64_t max_len) {
  std::vector<std::vector<std::int64_t>> out;
  for (const auto& text : texts) {
    const auto tokens = tokenizer.encode(text);
    for (std::size_t at = 0; at < tokens.size(); at += static_cast<std::size_t>(max_len)) {
      const auto end = std::min(tokens.size(), at + static_cast<std::size_t>(max_len));
      if (end - at >= 8) {
        out.emplace_back(tokens.begin() + static_cast<std::ptrdiff_t>(at),
                         tokens.begin() + static_cast<std::ptrdiff_t>(end));
      }
    }
  }
  if (out.empty()) {
    throw std::runtime_error("no text found in the fortunes");
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
