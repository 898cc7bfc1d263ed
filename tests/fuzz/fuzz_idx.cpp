// A bounded, seeded mutation fuzzer for the IDX reader: every input either loads, with a
// tensor of the shape its header declares, or is refused with a c10::Error naming the file.
// Anything else (another exception, a crash, a sanitizer report) fails the run.
//
//   fuzz_idx <corpus dir> <inputs> [seed]
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <unistd.h>
#include <random>
#include <string>
#include <vector>

#include "frugal/data/idx.h"

namespace fs = std::filesystem;
using Bytes = std::vector<unsigned char>;

namespace {

Bytes read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_file(const fs::path& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

Bytes gzip(const Bytes& raw) {
  z_stream z{};
  deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);
  Bytes out(deflateBound(&z, raw.size()) + 32);
  z.next_in = const_cast<unsigned char*>(raw.data());
  z.avail_in = static_cast<uInt>(raw.size());
  z.next_out = out.data();
  z.avail_out = static_cast<uInt>(out.size());
  deflate(&z, Z_FINISH);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

// One to four edits of the kinds that break parsers: bit flips, boundary values, header
// dimensions, truncation, growth.
Bytes mutate(Bytes b, std::mt19937_64& rng) {
  auto pick = [&](std::size_t n) { return n == 0 ? 0 : static_cast<std::size_t>(rng() % n); };
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits; ++e) {
    switch (rng() % 7) {
      case 0:
        if (!b.empty()) b[pick(b.size())] ^= static_cast<unsigned char>(1u << (rng() % 8));
        break;
      case 1: {
        static constexpr unsigned char kValues[] = {0x00, 0x01, 0x04, 0x05, 0x08, 0x7f, 0x80, 0xff};
        if (!b.empty()) b[pick(b.size())] = kValues[rng() % sizeof(kValues)];
        break;
      }
      case 2:  // a header dimension (bytes 4..19) set to an extreme
        if (b.size() >= 8) {
          const std::size_t at = 4 + 4 * pick(std::min<std::size_t>(4, (b.size() - 4) / 4));
          const std::uint32_t v = rng() % 2 ? 0xffffffffu : static_cast<std::uint32_t>(rng());
          for (int k = 0; k < 4 && at + k < b.size(); ++k) {
            b[at + k] = static_cast<unsigned char>(v >> (24 - 8 * k));
          }
        }
        break;
      case 3:
        b.resize(pick(b.size() + 1));
        break;
      case 4: {
        const std::size_t n = 1 + pick(64);
        for (std::size_t k = 0; k < n; ++k) b.push_back(static_cast<unsigned char>(rng()));
        break;
      }
      case 5:
        if (!b.empty()) b.erase(b.begin() + static_cast<std::ptrdiff_t>(pick(b.size())));
        break;
      default:
        if (b.size() > 3) b[3] = static_cast<unsigned char>(rng() % 6);  // dimension count
        break;
    }
  }
  return b;
}

std::int64_t declared_numel(const Bytes& raw) {
  std::int64_t n = 1;
  for (int d = 0; d < raw[3]; ++d) {
    std::int64_t s = 0;
    for (int k = 0; k < 4; ++k) s = (s << 8) | raw[4 + 4 * d + k];
    n *= s;
  }
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    fmt::print(stderr, "usage: fuzz_idx <corpus dir> <inputs> [seed]\n");
    return 2;
  }
  const fs::path corpus_dir = argv[1];
  const long inputs = std::stol(argv[2]);
  std::mt19937_64 rng(argc > 3 ? std::stoull(argv[3]) : 1);
  std::vector<std::pair<std::string, Bytes>> corpus;
  for (const auto& entry : fs::directory_iterator(corpus_dir)) {
    corpus.emplace_back(entry.path().filename().string(), read_file(entry.path()));
  }
  std::sort(corpus.begin(), corpus.end());
  if (corpus.empty()) {
    fmt::print(stderr, "fuzz_idx: no corpus in {}\n", corpus_dir.string());
    return 2;
  }
  const fs::path work = fs::temp_directory_path() / fmt::format("frugal_fuzz_idx_{}", ::getpid());
  fs::create_directories(work);
  const auto file = work / "input";
  std::map<std::string, long> refused;  // by the first words of the reason
  long loaded = 0;
  for (long i = 0; i < inputs; ++i) {
    const auto& [name, seed_bytes] = corpus[static_cast<std::size_t>(rng() % corpus.size())];
    // Mutate the stored bytes (gzip or plain), or mutate a plain file and compress it, so
    // both the gzip layer and the IDX layer see broken input.
    // `raw` is the IDX the reader sees unless a stored gzip file was mutated as it is.
    const bool plain_seed = name.find(".gz") == std::string::npos;
    const bool recompress = rng() % 3 == 0 && plain_seed;
    const Bytes raw = mutate(seed_bytes, rng);
    write_file(file, recompress ? gzip(raw) : raw);
    try {
      const auto t = frugal::data::read_idx(file.string());
      ++loaded;
      if (plain_seed && t.numel() != declared_numel(raw)) {
        fmt::print(stderr, "fuzz_idx: input {} loaded {} elements, its header declares {}\n", i,
                   t.numel(), declared_numel(raw));
        return 1;
      }
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      if (what.find(file.string()) == std::string::npos) {
        fmt::print(stderr, "fuzz_idx: input {}: the error does not name the file: {}\n", i, what);
        return 1;
      }
      // Grouped by the reason's first words, numbers left out.
      std::string reason;
      for (std::size_t k = what.find("' ") + 2; k < what.size() && reason.size() < 24; ++k) {
        if (std::isdigit(static_cast<unsigned char>(what[k])) == 0) {
          reason += what[k];
        } else if (reason.empty() || reason.back() != '#') {
          reason += '#';
        }
      }
      ++refused[reason];
    }
  }
  fs::remove_all(work);
  fmt::print("fuzz_idx: {} inputs (seed corpus {} files): {} loaded, {} refused\n", inputs,
             corpus.size(), loaded, inputs - loaded);
  for (const auto& [reason, n] : refused) {
    fmt::print("  {:>7}  '{}...'\n", n, reason);
  }
  return 0;
}
