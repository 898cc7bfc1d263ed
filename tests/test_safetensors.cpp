#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "frugal/io/safetensors.h"
#include "frugal/memory/counting_allocator.h"
#include "helpers.h"

namespace fs = std::filesystem;
using frugal::testing::expect_error_contains;

namespace {

fs::path scratch_dir(const std::string& name) {
  return frugal::testing::fresh_temp_dir("safetensors_" + name);
}

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

struct TwoLayers : torch::nn::Module {
  TwoLayers() {
    torch::manual_seed(3);
    a = register_module("a", torch::nn::Linear(6, 4));
    b = register_module("b", torch::nn::Linear(4, 3));
    steps = register_buffer("steps", torch::tensor({7}, torch::kLong));
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
  torch::Tensor steps;
};

std::map<std::string, torch::Tensor> snapshot(const torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : m.named_parameters()) {
    out[p.key()] = p.value().detach().clone();
  }
  for (const auto& b : m.named_buffers()) {
    out[b.key()] = b.value().clone();
  }
  return out;
}

void expect_unchanged(const torch::nn::Module& m,
                      const std::map<std::string, torch::Tensor>& before) {
  for (const auto& [name, value] : snapshot(m)) {
    EXPECT_TRUE(torch::equal(value, before.at(name))) << name;
  }
}

// A file of the module's tensors after `edit` changed them: saved from a second module.
fs::path saved_with(
    const fs::path& dir, const std::string& name,
    const std::function<void(std::vector<std::pair<std::string, torch::Tensor>>&)>& edit) {
  TwoLayers source;
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const auto& p : source.named_parameters()) {
    tensors.emplace_back(p.key(), p.value() * 2);
  }
  tensors.emplace_back("steps", source.steps + 1);
  edit(tensors);
  const auto path = dir / name;
  frugal::io::save(path.string(), tensors);
  return path;
}

}  // namespace

TEST(Safetensors, EveryDtypeRoundTripsBitForBitAndKeepsTheMetadata) {
  const auto dir = scratch_dir("dtypes");
  torch::manual_seed(1);
  const auto f = torch::randn({3, 5});
  std::vector<std::pair<std::string, torch::Tensor>> tensors = {
      {"f32", f},
      {"f16", f.to(torch::kHalf)},
      {"bf16", f.to(torch::kBFloat16)},
      {"f64", f.to(torch::kDouble)},
      {"i8", torch::randint(-128, 127, {7}, torch::kChar)},
      {"u8", torch::randint(0, 255, {2, 2, 2}, torch::kByte)},
      {"i16", torch::randint(-999, 999, {3}, torch::kShort)},
      {"i32", torch::randint(-999, 999, {3}, torch::kInt)},
      {"i64", torch::randint(-999, 999, {1}, torch::kLong)},
      {"bool", torch::rand({5}) > 0.5},
      {"scalar", torch::tensor(2.5)},
      {"empty", torch::empty({0, 4})},
      {"strided", f.t()},  // not contiguous: written in its logical order
  };
  const auto path = (dir / "all.safetensors").string();
  frugal::io::save(path, tensors, {{"format", "pt"}, {"note", "x\"y"}});
  const frugal::io::SafetensorsFile file(path);
  EXPECT_EQ(file.names().size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    const auto back = file.tensor(name);
    EXPECT_EQ(back.scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(back.sizes(), t.sizes()) << name;
    EXPECT_TRUE(torch::equal(back, t)) << name;
  }
  EXPECT_EQ(file.info("bf16").dtype, "BF16");
  EXPECT_EQ(file.metadata().at("note"), "x\"y");
  // The layout the safetensors package writes: header padded to 8, widest dtypes first.
  const auto bytes = read_bytes(path);
  std::uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0U);
  const auto header = bytes.substr(8, n);
  EXPECT_LT(header.find("\"f64\""), header.find("\"f32\""));
  EXPECT_LT(header.find("\"f32\""), header.find("\"bf16\""));
  EXPECT_LT(header.find("\"bf16\""), header.find("\"u8\""));
}

TEST(Safetensors, ATensorIsAViewOfTheMappedFileNotACopy) {
  const auto dir = scratch_dir("view");
  const auto big = torch::arange(1 << 20, torch::kFloat);  // 4 MiB
  const auto path = (dir / "big.safetensors").string();
  frugal::io::save(path, {{"big", big}});
  frugal::CountingAllocator::install();
  const auto before = frugal::CountingAllocator::stats().allocated;
  torch::Tensor view;
  {
    const frugal::io::SafetensorsFile file(path);
    view = file.tensor("big");
  }
  // The file object is gone; the view keeps the mapping and takes no allocator bytes.
  EXPECT_LT(frugal::CountingAllocator::stats().allocated - before, 4096);
  EXPECT_EQ(view[12345].item<float>(), 12345.0F);
  view[0] = -1.0F;  // changes this process's page only
  EXPECT_EQ(frugal::io::SafetensorsFile(path).tensor("big")[0].item<float>(), 0.0F);
}

TEST(Safetensors, LoadsIntoTheModuleInPlaceWithRenameAndTranspose) {
  const auto dir = scratch_dir("load");
  TwoLayers source;
  {
    torch::NoGradGuard no_grad;
    for (auto& p : source.parameters()) {
      p.mul_(3);
    }
  }
  // Named with a prefix, and a's weight stored (in, out) as GPT-2's Conv1D keeps it.
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const auto& p : source.named_parameters()) {
    const bool t = p.key() == "a.weight";
    tensors.emplace_back("model." + p.key(), t ? p.value().t() : p.value());
  }
  tensors.emplace_back("model.steps", source.steps);
  tensors.emplace_back("other.thing", torch::zeros({2}));
  const auto path = (dir / "prefixed.safetensors").string();
  frugal::io::save(path, tensors);

  TwoLayers target;
  const auto a_weight = target.a->weight;
  const auto result = frugal::io::load(
      target, frugal::io::SafetensorsFile(path),
      frugal::io::LoadOptions()
          .rename([](const std::string& n) { return n.rfind("model.", 0) == 0 ? n.substr(6) : ""; })
          .transposed([](const std::string& n) { return n == "a.weight"; }));
  EXPECT_EQ(result.loaded.size(), 5U);
  EXPECT_TRUE(result.missing.empty());
  EXPECT_TRUE(target.a->weight.is_same(a_weight));  // in place
  for (const auto& [name, value] : snapshot(source)) {
    EXPECT_TRUE(torch::equal(snapshot(target).at(name), value)) << name;
  }
}

TEST(Safetensors, AFloatCheckpointIsCastUnlessRefusedAndIntegersMustMatch) {
  const auto dir = scratch_dir("cast");
  const auto half = saved_with(dir, "half.safetensors", [](auto& tensors) {
    for (auto& [name, t] : tensors) {
      if (t.is_floating_point()) {
        t = t.to(torch::kBFloat16);
      }
    }
  });
  TwoLayers target;
  frugal::io::load(target, frugal::io::SafetensorsFile(half.string()));
  TwoLayers source;
  EXPECT_TRUE(
      torch::equal(target.b->bias, (source.b->bias * 2).to(torch::kBFloat16).to(torch::kFloat)));
  TwoLayers strict;
  const auto before = snapshot(strict);
  expect_error_contains(
      [&] {
        frugal::io::load(strict, frugal::io::SafetensorsFile(half.string()),
                         frugal::io::LoadOptions().cast_floats(false));
      },
      "'a.bias': dtype BF16 in the file, Float in the module");
  expect_unchanged(strict, before);
}

TEST(Safetensors, EveryMismatchIsNamedInOneErrorAndTheModuleIsUnchanged) {
  const auto dir = scratch_dir("mismatch");
  const auto bad = saved_with(dir, "bad.safetensors", [](auto& tensors) {
    for (auto it = tensors.begin(); it != tensors.end();) {
      if (it->first == "a.bias") {
        it->second = torch::zeros({5});  // wrong shape
      } else if (it->first == "b.weight") {
        it->second = torch::zeros({3, 4}, torch::kLong);  // wrong dtype
      } else if (it->first == "b.bias") {
        it = tensors.erase(it);  // missing
        continue;
      }
      ++it;
    }
    tensors.emplace_back("c.weight", torch::zeros({1}));  // unexpected
  });
  TwoLayers target;
  const auto before = snapshot(target);
  try {
    frugal::io::load(target, frugal::io::SafetensorsFile(bad.string()));
    ADD_FAILURE() << "no error";
  } catch (const frugal::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'a.bias': shape [5] in the file, [4] in the module"), std::string::npos)
        << what;
    EXPECT_NE(what.find("'b.weight': dtype I64 in the file, Float in the module"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("missing from the file: 'b.bias'"), std::string::npos) << what;
    EXPECT_NE(what.find("not in the module: 'c.weight'"), std::string::npos) << what;
  }
  expect_unchanged(target, before);
  // Allowed: the missing tensor keeps its value, the unexpected one is skipped.
  const auto lenient = saved_with(dir, "lenient.safetensors", [](auto& tensors) {
    tensors.erase(tensors.begin());
    tensors.emplace_back("c.weight", torch::zeros({1}));
  });
  const auto result =
      frugal::io::load(target, frugal::io::SafetensorsFile(lenient.string()),
                       frugal::io::LoadOptions().require_all(false).allow_unexpected(true));
  EXPECT_EQ(result.missing.size(), 1U);
  EXPECT_EQ(result.unexpected, std::vector<std::string>{"c.weight"});
  EXPECT_TRUE(torch::equal(snapshot(target).at(result.missing[0]), before.at(result.missing[0])));
}

TEST(Safetensors, TruncatedOrCorruptedFilesAreRefusedNamingWhatIsWrong) {
  const auto dir = scratch_dir("corrupt");
  const auto good = saved_with(dir, "good.safetensors", [](auto&) {});
  const auto bytes = read_bytes(good);
  std::uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  const auto header = bytes.substr(8, n);
  struct Case {
    std::string name, bytes, expected;
  };
  std::string huge_length = bytes;
  const std::uint64_t too_long = bytes.size();
  std::memcpy(huge_length.data(), &too_long, 8);
  std::string bad_json = bytes;
  bad_json[8] = '[';
  std::string bad_dtype = bytes;
  bad_dtype.replace(bad_dtype.find("\"F32\""), 5, "\"F33\"");
  std::string overlap = bytes;
  const auto span = header.find("\"data_offsets\":[") + 16;  // the first tensor's range
  const auto begin_digit = overlap.find_first_of("0123456789", 8 + span);
  overlap[begin_digit] = '8';  // moved by 8 (or more) bytes: its size no longer matches
  const std::vector<Case> cases = {
      {"truncated", bytes.substr(0, bytes.size() - 4), "in the file's data; it needs"},
      {"trailing", bytes + "junk", "bytes of data and the file has"},
      {"header cut", bytes.substr(0, 8 + n / 2), "its first 8 bytes give a header of"},
      {"tiny", bytes.substr(0, 5), "fewer than the header's 8-byte length"},
      {"length", huge_length, "its first 8 bytes give a header of"},
      {"json", bad_json, "not a JSON object"},
      {"dtype", bad_dtype, "dtype 'F33', which safetensors lacks"},
      {"offsets", overlap, "has bytes ["},
  };
  for (const auto& c : cases) {
    const auto path = dir / ("bad_" + std::to_string(&c - cases.data()) + ".safetensors");
    write_bytes(path, c.bytes);
    expect_error_contains([&] { frugal::io::SafetensorsFile file(path.string()); }, c.expected);
    expect_error_contains([&] { frugal::io::SafetensorsFile file(path.string()); }, path.string());
  }
  expect_error_contains([&] { frugal::io::SafetensorsFile file((dir / "none").string()); },
                        "cannot open");
}

TEST(Safetensors, AShardedCheckpointReadsAsOneAndItsIndexIsChecked) {
  const auto dir = scratch_dir("sharded");
  TwoLayers source;
  frugal::io::save((dir / "model-00001-of-00002.safetensors").string(),
                   {{"a.weight", source.a->weight * 5}, {"a.bias", source.a->bias * 5}});
  frugal::io::save((dir / "model-00002-of-00002.safetensors").string(),
                   {{"b.weight", source.b->weight * 5},
                    {"b.bias", source.b->bias * 5},
                    {"steps", source.steps}});
  const std::string index = R"({"metadata": {"total_size": 156}, "weight_map": {
      "a.weight": "model-00001-of-00002.safetensors", "a.bias": "model-00001-of-00002.safetensors",
      "b.weight": "model-00002-of-00002.safetensors", "b.bias": "model-00002-of-00002.safetensors",
      "steps": "model-00002-of-00002.safetensors"}})";
  write_bytes(dir / "model.safetensors.index.json", index);
  const frugal::io::SafetensorsFile file(
      dir.string());  // the directory, as save_pretrained leaves it
  EXPECT_EQ(file.names().size(), 5U);
  EXPECT_EQ(file.metadata().at("total_size"), "156");
  TwoLayers target;
  frugal::io::load(target, file);
  EXPECT_TRUE(torch::allclose(target.b->weight, source.b->weight * 5));
  // An index that puts a tensor in the wrong shard is refused.
  auto wrong = index;
  wrong.replace(wrong.find("\"b.bias\": \"model-00002"), 22, "\"b.bias\": \"model-00001");
  write_bytes(dir / "model.safetensors.index.json", wrong);
  expect_error_contains([&] { frugal::io::SafetensorsFile f(dir.string()); },
                        "puts tensor 'b.bias' in");
}

TEST(Safetensors, SaveRefusesBadNamesAndDtypesAndLeavesTheOldFile) {
  const auto dir = scratch_dir("save");
  const auto path = (dir / "m.safetensors").string();
  TwoLayers m;
  frugal::io::save(path, m);
  const auto before = read_bytes(path);
  expect_error_contains(
      [&] {
        frugal::io::save(path, {{"x", torch::zeros(1)}, {"x", torch::zeros(1)}});
      },
      "tensor 'x' is given twice");
  expect_error_contains(
      [&] {
        frugal::io::save(path, {{"", torch::zeros(1)}});
      },
      "cannot be named ''");
  expect_error_contains(
      [&] {
        frugal::io::save(path, {{"c", torch::zeros(1, torch::kComplexFloat)}});
      },
      "safetensors has no dtype for ComplexFloat");
  EXPECT_EQ(read_bytes(path), before);
  // What a module writes it loads back: names as named_parameters and named_buffers give them.
  TwoLayers other;
  {
    torch::NoGradGuard no_grad;
    other.a->weight.zero_();
  }
  frugal::io::load(other, frugal::io::SafetensorsFile(path));
  EXPECT_TRUE(torch::equal(other.a->weight, m.a->weight));
}
