// A bounded, seeded mutation fuzzer for the IDX reader: every input either loads, with a
// tensor of the shape its header declares, or is refused with a c10::Error naming the file.
// Anything else (another exception, a crash, a sanitizer report) fails the run.
//
//   fuzz_idx <corpus dir> <inputs> [seed]
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <unistd.h>
#include <zlib.h>

#include "frugal/data/idx.h"
#include "fuzz_common.h"

namespace fs = std::filesystem;
using fuzz::Bytes;

namespace {

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
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits; ++e) {
    switch (rng() % 7) {
      case 0:  // a header dimension (bytes 4..19) set to an extreme
        if (b.size() >= 8) {
          const std::size_t at =
              4 + 4 * fuzz::pick(rng, std::min<std::size_t>(4, (b.size() - 4) / 4));
          const std::uint32_t v = rng() % 2 ? 0xffffffffu : static_cast<std::uint32_t>(rng());
          for (int k = 0; k < 4 && at + k < b.size(); ++k) {
            b[at + k] = static_cast<unsigned char>(v >> (24 - 8 * k));
          }
        }
        break;
      case 1:
        if (b.size() > 3) b[3] = static_cast<unsigned char>(rng() % 6);  // dimension count
        break;
      default:
        fuzz::edit_bytes(b, rng);
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
  const auto corpus = fuzz::read_corpus(corpus_dir);
  if (corpus.empty()) {
    fmt::print(stderr, "fuzz_idx: no corpus in {}\n", corpus_dir.string());
    return 2;
  }
  const fs::path work = fs::temp_directory_path() / fmt::format("frugal_fuzz_idx_{}", ::getpid());
  fs::create_directories(work);
  const auto file = work / "input";
  fuzz::Reasons refused;
  long loaded = 0;
  for (long i = 0; i < inputs; ++i) {
    const auto& [name, seed_bytes] = corpus[static_cast<std::size_t>(rng() % corpus.size())];
    // Mutate the stored bytes (gzip or plain), or mutate a plain file and compress it, so
    // both the gzip layer and the IDX layer see broken input.
    // `raw` is the IDX the reader sees unless a stored gzip file was mutated as it is.
    const bool plain_seed = name.find(".gz") == std::string::npos;
    const bool recompress = rng() % 3 == 0 && plain_seed;
    const Bytes raw = mutate(seed_bytes, rng);
    fuzz::write_file(file, recompress ? gzip(raw) : raw);
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
      refused.add(what, "' ");
    }
  }
  fs::remove_all(work);
  fmt::print("fuzz_idx: {} inputs (seed corpus {} files): {} loaded, {} refused\n", inputs,
             corpus.size(), loaded, inputs - loaded);
  refused.print();
  return 0;
}
