// A bounded, seeded mutation fuzzer for the files frugal reads from other programs: a
// safetensors file (header and data), a sharded checkpoint's index, and PEFT's
// adapter_config.json. Each mutated input either opens, every tensor then readable whole
// with the bytes its dtype and shape need (a config with values in range), or is refused
// with a frugal::Error naming the file. Another exception, a crash or a sanitizer report
// fails the run.
//
//   fuzz_safetensors <corpus dir> <inputs> [seed] [seconds]
//
// With `seconds`, the run also stops once that long has passed (for long runs by hand).
//
// The corpus: *.safetensors files, files named *index.json (an index; the corpus's
// safetensors files lie beside it as its shards) and *config.json (adapter configs).
#include <fmt/format.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cmath>

#include "frugal/error.h"
#include "frugal/io/safetensors.h"
#include "frugal/nn/lora.h"
#include "fuzz_common.h"

namespace fs = std::filesystem;
using fuzz::Bytes;

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Edits that keep the text JSON-like: deep nesting, extreme numbers, a value of another type.
void edit_json(std::string& text, std::mt19937_64& rng) {
  static const char* kNumbers[] = {"18446744073709551615",
                                   "9223372036854775807",
                                   "4611686018427387904",
                                   "-1",
                                   "1e308",
                                   "2.9",
                                   "0",
                                   "-0.0"};
  static const char* kValues[] = {"null",
                                  "true",
                                  "[]",
                                  "{}",
                                  "\"\"",
                                  "[1, [2]]",
                                  "{\"a\": {}}",
                                  "\"F32\"",
                                  "\"../x.safetensors\"",
                                  "\"/etc/passwd\""};
  const auto at = fuzz::pick(rng, text.size() + 1);
  switch (rng() % 4) {
    case 0: {  // nesting deep enough to overflow a recursive printer
      const std::size_t depth = 1 + fuzz::pick(rng, rng() % 4 == 0 ? 200000 : 64);
      std::string deep(depth, '[');
      deep += '0';
      deep.append(depth, ']');
      text.insert(at, deep);
      break;
    }
    case 1: {  // a number made extreme
      const auto digit = text.find_first_of("0123456789", at);
      if (digit != std::string::npos) {
        const auto end = text.find_first_not_of("0123456789", digit);
        text.replace(digit, (end == std::string::npos ? text.size() : end) - digit,
                     kNumbers[rng() % std::size(kNumbers)]);
      }
      break;
    }
    case 2: {  // a value, after a colon, replaced by one of another type
      const auto colon = text.find(':', at);
      if (colon != std::string::npos) {
        const auto end = text.find_first_of(",}", colon);
        text.replace(colon + 1, (end == std::string::npos ? text.size() : end) - colon - 1,
                     kValues[rng() % std::size(kValues)]);
      }
      break;
    }
    default: {  // a long string
      std::string quoted(1 + fuzz::pick(rng, 100000) + 2, 'x');
      quoted.front() = quoted.back() = '"';
      text.insert(at, quoted);
      break;
    }
  }
}

// A safetensors file mutated: its header as JSON (the length fixed up or not), or its bytes.
Bytes mutate_safetensors(Bytes b, std::mt19937_64& rng) {
  std::uint64_t n = 0;
  if (b.size() >= 8) std::memcpy(&n, b.data(), 8);
  if (rng() % 2 == 0 && b.size() >= 8 && n <= b.size() - 8) {
    std::string header(b.begin() + 8, b.begin() + 8 + static_cast<std::ptrdiff_t>(n));
    const Bytes data(b.begin() + 8 + static_cast<std::ptrdiff_t>(n), b.end());
    edit_json(header, rng);
    const std::uint64_t m = rng() % 4 == 0 ? n : header.size();
    b.assign(reinterpret_cast<const unsigned char*>(&m),
             reinterpret_cast<const unsigned char*>(&m) + 8);
    b.insert(b.end(), header.begin(), header.end());
    b.insert(b.end(), data.begin(), data.end());
    return b;
  }
  const int edits = 1 + static_cast<int>(rng() % 3);
  for (int e = 0; e < edits; ++e) fuzz::edit_bytes(b, rng);
  return b;
}

Bytes mutate_json(const Bytes& b, std::mt19937_64& rng) {
  if (rng() % 3 == 0) {
    Bytes out = b;
    fuzz::edit_bytes(out, rng);
    return out;
  }
  std::string text(b.begin(), b.end());
  const int edits = 1 + static_cast<int>(rng() % 2);
  for (int e = 0; e < edits; ++e) edit_json(text, rng);
  return Bytes(text.begin(), text.end());
}

// Reads every tensor whole: its bytes are those its dtype and shape need.
void read_all(const frugal::io::SafetensorsFile& file) {
  for (const auto& name : file.names()) {
    const auto& info = file.info(name);
    torch::Tensor t;
    try {
      t = file.tensor(name);
    } catch (const frugal::Error& e) {
      if (std::string(e.what()).find("no type for") != std::string::npos) continue;  // U16..
      throw;
    }
    std::int64_t numel = 1;
    for (const auto d : info.shape) numel *= d;
    if (t.numel() != numel) {
      throw std::logic_error(
          fmt::format("tensor '{}' has {} elements, its shape {}", name, t.numel(), numel));
    }
    if (t.numel() > 0) {  // the first and the last byte: inside the mapping
      const auto bytes = t.reshape(-1).view(torch::kByte);
      volatile auto first = bytes[0].item<std::uint8_t>();
      volatile auto last = bytes[-1].item<std::uint8_t>();
      (void)first;
      (void)last;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    fmt::print(stderr, "usage: fuzz_safetensors <corpus dir> <inputs> [seed] [seconds]\n");
    return 2;
  }
  const auto corpus = fuzz::read_corpus(argv[1]);
  long inputs = std::stol(argv[2]);
  std::mt19937_64 rng(argc > 3 ? std::stoull(argv[3]) : 1);
  const auto until = std::chrono::steady_clock::now() +
                     std::chrono::seconds(argc > 4 ? std::stol(argv[4]) : 365L * 24 * 3600);
  if (corpus.empty()) {
    fmt::print(stderr, "fuzz_safetensors: no corpus in {}\n", argv[1]);
    return 2;
  }
  const fs::path work =
      fs::temp_directory_path() / fmt::format("frugal_fuzz_safetensors_{}", ::getpid());
  fs::remove_all(work);
  fs::create_directories(work);
  for (const auto& [name, bytes] : corpus) {  // the shards an index may name
    if (ends_with(name, ".safetensors")) fuzz::write_file(work / name, bytes);
  }
  fuzz::Reasons refused;
  long opened = 0;
  for (long i = 0; i < inputs; ++i) {
    if (i % 256 == 0 && std::chrono::steady_clock::now() > until) {
      inputs = i;
      break;
    }
    const auto& [name, seed_bytes] = corpus[fuzz::pick(rng, corpus.size())];
    std::string path;
    try {
      if (ends_with(name, ".safetensors")) {
        path = (work / "input.safetensors").string();
        fuzz::write_file(path, mutate_safetensors(seed_bytes, rng));
        read_all(frugal::io::SafetensorsFile(path));
      } else if (ends_with(name, "index.json")) {
        path = (work / "model.safetensors.index.json").string();
        fuzz::write_file(path, mutate_json(seed_bytes, rng));
        read_all(frugal::io::SafetensorsFile(path));
      } else {
        const auto dir = work / "adapter";
        fs::create_directories(dir);
        path = (dir / "adapter_config.json").string();
        fuzz::write_file(path, mutate_json(seed_bytes, rng));
        const auto o = frugal::nn::read_lora_config(dir.string());
        if (o.rank() < 1 || !std::isfinite(o.alpha()) || o.alpha() <= 0 || o.dropout() < 0 ||
            o.dropout() >= 1) {
          fmt::print(stderr, "fuzz_safetensors: input {} ({}) read out-of-range options\n", i,
                     name);
          return 1;
        }
      }
      ++opened;
    } catch (const frugal::Error& e) {
      const std::string what = e.what();
      // A shard's error names the shard, beside the input in the work folder.
      if (what.find(work.string()) == std::string::npos || what.size() > 4096) {
        fmt::print(stderr, "fuzz_safetensors: input {} ({}): the error {}: {}\n", i, name,
                   what.size() > 4096 ? "is too long" : "does not name the file",
                   what.substr(0, 600));
        return 1;
      }
      refused.add(what, fs::path(path).filename().string());
    } catch (const std::exception& e) {
      fmt::print(stderr, "fuzz_safetensors: input {} ({}) escaped as another error: {}\n", i, name,
                 std::string(e.what()).substr(0, 600));
      return 1;
    }
  }
  fs::remove_all(work);
  fmt::print("fuzz_safetensors: {} inputs (seed corpus {} files): {} opened, {} refused\n", inputs,
             corpus.size(), opened, inputs - opened);
  refused.print();
  return 0;
}
