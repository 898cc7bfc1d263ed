#include <gtest/gtest.h>
#include <torch/torch.h>
#include <zlib.h>

#include <cstdio>
#include <filesystem>
#include <vector>

#include "frugal/data/idx.h"

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
    EXPECT_NE(std::string(e.what()).find("promises 20 bytes of data, found 15"),
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
}

}  // namespace
