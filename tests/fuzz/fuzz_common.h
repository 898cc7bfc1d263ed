// What the seeded mutation fuzzers share: files as bytes, the byte-level edits that break
// parsers, and the tally of refusals by the first words of their reason.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace fuzz {

using Bytes = std::vector<unsigned char>;

inline Bytes read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

inline void write_file(const std::filesystem::path& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

/// Every file of `dir`, by name, sorted.
inline std::vector<std::pair<std::string, Bytes>> read_corpus(const std::filesystem::path& dir) {
  std::vector<std::pair<std::string, Bytes>> corpus;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    corpus.emplace_back(entry.path().filename().string(), read_file(entry.path()));
  }
  std::sort(corpus.begin(), corpus.end());
  return corpus;
}

inline std::size_t pick(std::mt19937_64& rng, std::size_t n) {
  return n == 0 ? 0 : static_cast<std::size_t>(rng() % n);
}

/// One byte-level edit: a bit flip, a boundary value, a truncation, growth or a removal.
inline void edit_bytes(Bytes& b, std::mt19937_64& rng) {
  switch (rng() % 5) {
    case 0:
      if (!b.empty()) b[pick(rng, b.size())] ^= static_cast<unsigned char>(1u << (rng() % 8));
      break;
    case 1: {
      static constexpr unsigned char kValues[] = {0x00, 0x01, 0x04, 0x05, 0x08, 0x7f, 0x80, 0xff};
      if (!b.empty()) b[pick(rng, b.size())] = kValues[rng() % sizeof(kValues)];
      break;
    }
    case 2:
      b.resize(pick(rng, b.size() + 1));
      break;
    case 3: {
      const std::size_t n = 1 + pick(rng, 64);
      for (std::size_t k = 0; k < n; ++k) b.push_back(static_cast<unsigned char>(rng()));
      break;
    }
    default:
      if (!b.empty()) b.erase(b.begin() + static_cast<std::ptrdiff_t>(pick(rng, b.size())));
      break;
  }
}

/// Refusals counted by their reason's first words (after `after`), digits folded to '#'.
class Reasons {
 public:
  void add(const std::string& what, const std::string& after) {
    const auto at = what.find(after);
    std::string reason;
    for (std::size_t k = at == std::string::npos ? 0 : at + after.size();
         k < what.size() && reason.size() < 32; ++k) {
      if (std::isdigit(static_cast<unsigned char>(what[k])) == 0) {
        reason += what[k];
      } else if (reason.empty() || reason.back() != '#') {
        reason += '#';
      }
    }
    ++counts_[reason];
  }
  void print() const {
    for (const auto& [reason, n] : counts_) {
      fmt::print("  {:>7}  '{}...'\n", n, reason);
    }
  }

 private:
  std::map<std::string, long> counts_;
};

}  // namespace fuzz
