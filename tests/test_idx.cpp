#include <gtest/gtest.h>
#include <torch/torch.h>
#include <sys/stat.h>
#include <zlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <vector>

#include "frugal/data/idx.h"
#include "frugal/memory/probe.h"

namespace {

namespace fs = std::filesystem;

class Idx : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = fs::temp_directory_path() /
          ("frugal_idx_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir);
  }
  void TearDown() override { fs::remove_all(dir); }

  std::string write_gz(const std::string& name, const std::vector<unsigned char>& bytes) {
    const auto path = (dir / name).string();
    gzFile f = gzopen(path.c_str(), "wb");
    gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
    gzclose(f);
    return path;
  }
  fs::path dir;
};

std::vector<unsigned char> idx_bytes(std::vector<std::uint32_t> shape, int data_bytes) {
  std::vector<unsigned char> out = {0, 0, 0x08, static_cast<unsigned char>(shape.size())};
  for (auto s : shape) {
    for (int shift : {24, 16, 8, 0}) {
      out.push_back(static_cast<unsigned char>((s >> shift) & 0xff));
    }
  }
  for (int i = 0; i < data_bytes; ++i) {
    out.push_back(static_cast<unsigned char>(i % 251));
  }
  return out;
}

// The error `fn` throws: a c10::Error naming `path` and containing `needle`.
void expect_error(const std::function<void()>& fn, const std::string& path,
                  const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one saying '" << needle << "'";
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    EXPECT_NE(what.find(path), std::string::npos) << what;
    EXPECT_NE(what.find(needle), std::string::npos) << what;
  }
}

TEST_F(Idx, ReadsShapeAndBytes) {
  const auto t = frugal::data::read_idx(write_gz("a.gz", idx_bytes({2, 3, 4}, 24)));
  EXPECT_EQ(t.sizes(), (std::vector<std::int64_t>{2, 3, 4}));
  EXPECT_EQ(t.flatten()[23].item<int>(), 23);
}

TEST_F(Idx, MissingFileNamesThePath) {
  const auto path = (dir / "nope.gz").string();
  try {
    frugal::data::read_idx(path);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

TEST_F(Idx, TruncatedFileSaysHowMuchWasFound) {
  const auto path = write_gz("t.gz", idx_bytes({10, 2}, 15));
  try {
    frugal::data::read_idx(path);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("promises 20 bytes of data for shape [10, 2], the "
                                         "file holds 15"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(Idx, WrongMagicIsRejected) {
  auto bytes = idx_bytes({4}, 4);
  bytes[2] = 0x0d;  // floats
  try {
    frugal::data::read_idx(write_gz("f.gz", bytes));
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("IDX type 0xd"), std::string::npos) << e.what();
  }
}

TEST_F(Idx, LoadsAnMnistDirectory) {
  write_gz("t10k-images-idx3-ubyte.gz", idx_bytes({3, 28, 28}, 3 * 28 * 28));
  write_gz("t10k-labels-idx1-ubyte.gz", idx_bytes({3}, 3));
  const auto batch = frugal::data::load_mnist_dir(dir.string(), frugal::data::Split::Test);
  EXPECT_EQ(batch.inputs.sizes(), (std::vector<std::int64_t>{3, 1, 28, 28}));
  EXPECT_EQ(batch.targets.dtype(), torch::kLong);
  EXPECT_FLOAT_EQ(batch.inputs.flatten()[250].item<float>(), 250.0f / 255.0f);
  EXPECT_EQ(batch.targets[2].item<std::int64_t>(), 2);
  // As bytes: a quarter of the memory, and the same floats once a batch is converted.
  const auto bytes = frugal::data::load_mnist_dir(dir.string(), frugal::data::Split::Test,
                                                  frugal::data::Pixels::Bytes);
  EXPECT_EQ(bytes.inputs.dtype(), torch::kByte);
  EXPECT_EQ(bytes.inputs.nbytes() * 4, batch.inputs.nbytes());
  EXPECT_TRUE(torch::equal(frugal::data::to_unit_floats(bytes.inputs), batch.inputs));
}

std::string write_plain(const fs::path& path, const std::vector<unsigned char>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  return path.string();
}

TEST_F(Idx, AHeaderClaimingGigabytesAllocatesOnlyWhatTheFileHolds) {
  frugal::MemoryProbe probe;
  // 4 GiB declared, 30 bytes of data: the reader must not allocate the claim.
  const auto path = write_gz("huge.gz", idx_bytes({1u << 16, 1u << 16}, 30));
  frugal::ScopedPeak peak(probe);
  const auto before = probe.allocated();
  expect_error([&] { frugal::data::read_idx(path); }, path, "the file holds 30");
  EXPECT_LE(peak.end() - before, std::int64_t{1} << 20) << "allocated the header's claim";
}

TEST_F(Idx, DimensionsWhoseProductOverflowsAreRefused) {
  const auto path = write_plain(dir / "overflow", idx_bytes({0xffffffffu, 0xffffffffu,
                                                              0xffffffffu, 0xffffffffu}, 8));
  expect_error([&] { frugal::data::read_idx(path); }, path, "more than the 2^40 bytes");
}

TEST_F(Idx, DataBeyondTheHeaderIsRefused) {
  const auto path = write_gz("long.gz", idx_bytes({4}, 5));
  expect_error([&] { frugal::data::read_idx(path); }, path, "more data than its header");
}

TEST_F(Idx, ACorruptGzipStreamIsCalledCorrupt) {
  std::vector<unsigned char> bytes = idx_bytes({64, 64}, 64 * 64);
  const auto good = write_gz("good.gz", bytes);
  std::ifstream in(good, std::ios::binary);
  std::vector<char> gz((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (std::size_t i = 12; i < gz.size() - 8; ++i) {
    gz[i] = static_cast<char>(gz[i] ^ 0x5a);  // the deflate stream, not the gzip header
  }
  const auto bad = write_plain(dir / "bad.gz", std::vector<unsigned char>(gz.begin(), gz.end()));
  expect_error([&] { frugal::data::read_idx(bad); }, bad, "is corrupt");
}

TEST_F(Idx, DirectoriesAndFifosAreRefusedWithoutReading) {
  const auto sub = (dir / "sub").string();
  fs::create_directories(sub);
  expect_error([&] { frugal::data::read_idx(sub); }, sub, "is a directory");
  const auto fifo = (dir / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_error([&] { frugal::data::read_idx(fifo); }, fifo, "not a regular file");  // no block
}

class MnistDir : public Idx {
 protected:
  std::string images = "t10k-images-idx3-ubyte.gz", labels = "t10k-labels-idx1-ubyte.gz";
  void load() { frugal::data::load_mnist_dir(dir.string(), frugal::data::Split::Test); }
};

TEST_F(MnistDir, LabelsOutOfRangeNameTheFileAndIndex) {
  write_gz(images, idx_bytes({3, 28, 28}, 3 * 28 * 28));
  auto bytes = idx_bytes({3}, 3);
  bytes.back() = 10;
  write_gz(labels, bytes);
  expect_error([&] { load(); }, labels, "label 10 at index 2");
}

TEST_F(MnistDir, EmptySetsAndOtherImageSizesAreRefusedAtLoad) {
  write_gz(images, idx_bytes({0, 28, 28}, 0));
  write_gz(labels, idx_bytes({0}, 0));
  expect_error([&] { load(); }, images, "holds no images");
  write_gz(images, idx_bytes({2, 32, 32}, 2 * 32 * 32));
  write_gz(labels, idx_bytes({2}, 2));
  expect_error([&] { load(); }, images, "(count, 28, 28) is expected");
  write_gz(images, idx_bytes({2, 28, 28}, 2 * 28 * 28));
  write_gz(labels, idx_bytes({3}, 3));
  expect_error([&] { load(); }, labels, "3 labels of shape [3] for 2 images");
}

}  // namespace
