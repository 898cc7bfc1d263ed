// Files other programs wrote (safetensors checkpoints, sharded indexes, PEFT adapter
// configs): whatever they hold, reading them ends in a frugal::Error that names the file and
// quotes no more than a bounded excerpt of it; nothing outside their folder is read, no
// special file is waited on, and a file shortened while mapped is an error, not a signal.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include "frugal/error.h"
#include "frugal/io/safetensors.h"
#include "frugal/nn/lora.h"
#include "helpers.h"

namespace {
namespace untrusted_files_test {  // helper names of its own in the unity build

namespace fs = std::filesystem;

fs::path scratch_dir(const std::string& name) {
  return frugal::testing::fresh_temp_dir("untrusted_" + name);
}

void write_text(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A safetensors file whose header is `header` (padded to 8 bytes) followed by `data`.
std::string safetensors_bytes(std::string header, const std::string& data = "") {
  header.append((8 - header.size() % 8) % 8, ' ');
  const std::uint64_t n = header.size();
  return std::string(reinterpret_cast<const char*>(&n), 8) + header + data;
}

// `fn` throws frugal::Error (not another type) whose message holds `part` and is short:
// a file is quoted, not reproduced.
template <typename Fn>
std::string expect_refused(Fn fn, const std::string& part) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one saying: " << part;
  } catch (const frugal::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(part), std::string::npos) << what;
    EXPECT_LT(what.size(), 1200U) << "the error quotes too much of the file";
    return what;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a frugal::Error: " << e.what();
  }
  return "";
}

std::string nested(std::size_t depth) {
  return std::string(depth, '[') + "1" + std::string(depth, ']');
}

struct Adapted : torch::nn::Module {
  Adapted() { fc = register_module("fc", torch::nn::Linear(4, 4)); }
  torch::nn::Linear fc{nullptr};
};

TEST(UntrustedFiles, DeeplyNestedJsonIsRefusedWithABoundedExcerpt) {
  const auto dir = scratch_dir("nested");
  const auto deep = nested(100000);  // 200 KB: printed whole, it would overflow the stack
  write_text(dir / "entry.safetensors", safetensors_bytes(R"({"w": )" + deep + "}"));
  auto what =
      expect_refused([&] { frugal::io::SafetensorsFile f((dir / "entry.safetensors").string()); },
                     "tensor 'w' has an entry without dtype and data_offsets: [[[[...]]]]");
  write_text(dir / "shape.safetensors", safetensors_bytes(R"({"w": {"dtype": "F32", "shape": )" +
                                                          deep + R"(, "data_offsets": [0, 0]}})"));
  expect_refused([&] { frugal::io::SafetensorsFile f((dir / "shape.safetensors").string()); },
                 "has a shape of [[[[...]]]]");
  write_text(dir / "model.safetensors.index.json", R"({"weight_map": {"w": )" + deep + "}}");
  expect_refused([&] { frugal::io::SafetensorsFile f(dir.string()); },
                 "maps 'w' to [[[[...]]]], not a file name");
  write_text(dir / "adapter_config.json",
             R"({"peft_type": "LORA", "target_modules": [)" + deep + "]}");
  expect_refused([&] { frugal::nn::read_lora_config(dir.string()); },
                 "lists a JSON array in target_modules");
  write_text(dir / "adapter_config.json",
             R"({"peft_type": "LORA", "rank_pattern": {"a": )" + deep + "}}");
  expect_refused([&] { frugal::nn::read_lora_config(dir.string()); },
                 "sets rank_pattern {\"a\": [[[...]]]}");
  // A long string is cut, not copied into the message.
  write_text(dir / "adapter_config.json",
             R"({"peft_type": ")" + std::string(100000, 'x') + R"("})");
  expect_refused([&] { frugal::nn::read_lora_config(dir.string()); }, "xxx\"..., not LORA");
}

TEST(UntrustedFiles, AnIndexNamesOnlyFilesInsideItsFolder) {
  const auto root = scratch_dir("confined");
  const auto dir = root / "model";
  fs::create_directories(dir / "sub");
  const auto w = torch::arange(4, torch::kFloat);
  frugal::io::save((root / "outside.safetensors").string(), {{"w", w}});
  frugal::io::save((dir / "sub" / "inside.safetensors").string(), {{"w", w * 2}});
  fs::create_symlink(root / "outside.safetensors", dir / "escape.safetensors");
  fs::create_symlink(dir / "sub" / "inside.safetensors", dir / "link.safetensors");
  auto index = [&](const std::string& shard) {
    write_text(dir / "model.safetensors.index.json",
               R"({"weight_map": {"w": ")" + shard + R"("}})");
  };
  for (const std::string& shard :
       {std::string("../outside.safetensors"), std::string("sub/../../outside.safetensors"),
        (root / "outside.safetensors").string()}) {
    index(shard);
    expect_refused([&] { frugal::io::SafetensorsFile f(dir.string()); },
                   "which is not a file inside its folder");
  }
  index("escape.safetensors");
  expect_refused([&] { frugal::io::SafetensorsFile f(dir.string()); }, "outside its folder");
  // Inside the folder, through a subfolder or a link that stays inside: read.
  for (const char* shard : {"sub/inside.safetensors", "link.safetensors"}) {
    index(shard);
    const frugal::io::SafetensorsFile file(dir.string());
    EXPECT_TRUE(torch::equal(file.tensor("w"), w * 2)) << shard;
  }
}

TEST(UntrustedFiles, SpecialFilesAreRefusedWithoutWaitingAndOtherFilesNamedForWhatTheyAre) {
  const auto dir = scratch_dir("special");
  ASSERT_EQ(::mkfifo((dir / "fifo.safetensors").c_str(), 0600), 0);
  ASSERT_EQ(::mkfifo((dir / "adapter_config.json").c_str(), 0600), 0);
  const auto start = std::chrono::steady_clock::now();
  expect_refused([&] { frugal::io::SafetensorsFile f((dir / "fifo.safetensors").string()); },
                 "a FIFO, not a regular file");
  write_text(dir / "model.safetensors.index.json", R"({"weight_map": {"w": "fifo.safetensors"}})");
  expect_refused([&] { frugal::io::SafetensorsFile f(dir.string()); }, "a FIFO");
  expect_refused([&] { frugal::nn::read_lora_config(dir.string()); }, "a FIFO");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  fs::create_directories(dir / "d.safetensors");
  write_text(dir / "model.safetensors.index.json", R"({"weight_map": {"w": "d.safetensors"}})");
  expect_refused([&] { frugal::io::SafetensorsFile f(dir.string()); },
                 "a directory, not a regular file");
  // A text file is not a safetensors file, and the error says so in words.
  write_text(dir / "notes.safetensors", "these are not tensors, just some words\n");
  expect_refused([&] { frugal::io::SafetensorsFile f((dir / "notes.safetensors").string()); },
                 "it is not a safetensors file, or it was cut short");
}

TEST(UntrustedFiles, ShapesWhoseBytesOverflowSixtyFourBitsAreRefused) {
  const auto dir = scratch_dir("overflow");
  struct Case {
    std::string shape, expected;
  };
  const std::vector<Case> cases = {
      // 2^62 x 4 elements of 4 bytes wrap to 0 in 64 bits: the empty data would pass.
      {"[4611686018427387904, 4]", "more bytes than 64 bits count"},
      {"[4294967296, 4294967296]", "more bytes than 64 bits count"},
      {"[18446744073709551615]", "has a shape of [18446744073709551615]"},
  };
  for (const auto& c : cases) {
    const auto path = dir / "x.safetensors";
    write_text(path, safetensors_bytes(R"({"w": {"dtype": "F32", "shape": )" + c.shape +
                                       R"(, "data_offsets": [0, 0]}})"));
    expect_refused([&] { frugal::io::SafetensorsFile f(path.string()); }, c.expected);
  }
  const auto path = dir / "offsets.safetensors";
  write_text(
      path,
      safetensors_bytes(
          R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": [18446744073709551615, 18446744073709551615]}})"));
  expect_refused([&] { frugal::io::SafetensorsFile f(path.string()); },
                 "has an entry without dtype and data_offsets");
}

TEST(UntrustedFiles, UnalignedTensorsAreCopiedAndAnEmptyOneIsEmpty) {
  const auto dir = scratch_dir("unaligned");
  // A header of 8k + 1 bytes (no padding): the data starts off 4-byte alignment.
  std::string header = R"({"e": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},)"
                       R"( "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})";
  while (header.size() % 8 != 1) {
    header += ' ';
  }
  const std::uint64_t n = header.size();
  const float values[2] = {1.5F, -2.0F};
  write_text(dir / "u.safetensors", std::string(reinterpret_cast<const char*>(&n), 8) + header +
                                        std::string(reinterpret_cast<const char*>(values), 8));
  const frugal::io::SafetensorsFile file((dir / "u.safetensors").string());
  EXPECT_EQ(file.tensor("e").numel(), 0);
  EXPECT_TRUE(torch::equal(file.tensor("w"), torch::tensor({1.5F, -2.0F})));
}

TEST(UntrustedFiles, AFileShortenedWhileMappedIsAnErrorNotASignal) {
  const auto dir = scratch_dir("shortened");
  const auto path = (dir / "m.safetensors").string();
  const auto w = torch::arange(1 << 16, torch::kFloat) + 1;  // 256 KiB: pages past the cut
  frugal::io::save(path, {{"w", w}});
  const frugal::io::SafetensorsFile file(path);
  const auto view = file.tensor("w");
  ASSERT_TRUE(torch::equal(view, w));
  // Another program re-saves the file in place: it is truncated while this one maps it.
  ASSERT_EQ(::truncate(path.c_str(), 4096), 0);
  // The vanished bytes read as zeros, never SIGBUS.
  const auto sum = view.sum().item<double>();
  EXPECT_LT(sum, w.sum().item<double>());
  EXPECT_GT(sum, 0);  // the first page is still the file's
  expect_refused([&] { file.check_unchanged(); }, "changed while it was read");
  expect_refused([&] { file.tensor("w"); }, path);
  torch::nn::Linear target(1, 1);
  auto holder = torch::nn::Module();
  holder.register_parameter("w", torch::zeros({1 << 16}));
  expect_refused([&] { frugal::io::load(holder, file); }, "load it again");
}

TEST(UntrustedFiles, AFailedSaveRemovesItsPartialFileAndSaysWhy) {
  const auto dir = scratch_dir("failed_save");
  const auto path = dir / "m.safetensors";
  frugal::io::save(path.string(), {{"w", torch::ones(4)}});
  const auto before = read_text(path);
  // A file-size limit stands in for a full disk: the write fails part-way.
  struct rlimit old {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old;
  small.rlim_cur = 64 * 1024;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string what;
  try {
    frugal::io::save(path.string(), {{"w", torch::ones(1 << 20)}});
  } catch (const frugal::Error& e) {
    what = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_NE(what.find("File too large"), std::string::npos) << what;
  EXPECT_NE(what.find(path.string()), std::string::npos) << what;
  EXPECT_FALSE(fs::exists(path.string() + ".partial"));
  EXPECT_EQ(read_text(path), before);
}

TEST(UntrustedFiles, AdapterConfigsAreCheckedByTypeAndRange) {
  const auto dir = scratch_dir("config");
  struct Case {
    std::string fields, expected;
  };
  const std::vector<Case> cases = {
      {R"("r": 2.9)", "gives r as a JSON number 2.9; it must be a whole number >= 1"},
      {R"("r": "8")", "gives r as a JSON string \"8\""},
      {R"("r": 0)", "gives r as 0; it must be a whole number >= 1"},
      {R"("r": -3)", "gives r as -3"},
      {R"("lora_alpha": "16")", "gives lora_alpha as a JSON string"},
      {R"("lora_alpha": -1)", "gives lora_alpha as -1; it must be a finite number > 0"},
      {R"("lora_alpha": 0)", "gives lora_alpha as 0"},
      {R"("lora_dropout": 1.5)", "gives lora_dropout as 1.5; it must be in [0, 1)"},
      {R"("lora_dropout": [0.1])", "gives lora_dropout as a JSON array"},
      {R"("use_rslora": "yes")",
       "gives use_rslora as a JSON string \"yes\"; it must be true or false"},
      {R"("fan_in_fan_out": 1)", "gives fan_in_fan_out as a JSON number 1"},
      {R"("target_modules": "fc")", "gives target_modules as a JSON string \"fc\""},
      {R"("target_modules": ["fc", 3])", "lists a JSON number 3 in target_modules"},
      {R"("use_dora": "no")", "gives use_dora as a JSON string"},
      {R"("rank_pattern": [])", "gives rank_pattern as a JSON array"},
  };
  for (const auto& c : cases) {
    write_text(dir / "adapter_config.json", R"({"peft_type": "LORA", )" + c.fields + "}");
    expect_refused([&] { frugal::nn::read_lora_config(dir.string()); }, c.expected);
  }
  write_text(dir / "adapter_config.json", R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8.5,
      "lora_dropout": 0.05, "target_modules": ["fc"], "task_type": null, "use_dora": false})");
  const auto o = frugal::nn::read_lora_config(dir.string());
  EXPECT_EQ(o.rank(), 4);
  EXPECT_EQ(o.alpha(), 8.5);
  EXPECT_EQ(o.dropout(), 0.05);
  write_text(dir / "adapter_config.json", "{\"peft_type\": \"LORA\", \"r\": ");
  expect_refused([&] { frugal::nn::read_lora_config(dir.string()); }, "is not JSON");
}

TEST(UntrustedFiles, LoraOptionsRefuseAnAlphaThatIsNotAPositiveNumber) {
  for (const double alpha : {std::nan(""), std::numeric_limits<double>::infinity(), -1.0, 0.0}) {
    auto model = std::make_shared<Adapted>();
    expect_refused(
        [&] {
          frugal::nn::Lora lora(*model, {model->fc.ptr()},
                                frugal::nn::LoraOptions().alpha(alpha).target_modules({"fc"}));
        },
        "LoraOptions alpha must be a finite number > 0");
  }
}

}  // namespace untrusted_files_test
}  // namespace
