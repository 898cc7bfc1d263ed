// SaveDir: the newest saves kept, a damaged newest one passed over for the one before it,
// and every file named when none loads.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <string>
#include <vector>

#include "resume_setup.h"

namespace {

namespace fs = std::filesystem;
using frugal::testing::make_resume_setup;
using frugal::testing::train;

TEST(SaveDir, KeepsTheNewestAndResumesPastADamagedOne) {
  const auto dir = frugal::testing::fresh_temp_dir("state_savedir");
  auto s = make_resume_setup("plain");
  frugal::SaveDir saves(dir.string(), /*keep=*/3);
  for (int i = 0; i < 5; ++i) {
    train(*s, 1);
    saves.save(*s->trainer);
  }
  const auto files = saves.files();
  ASSERT_EQ(files.size(), 3u);
  EXPECT_EQ(fs::path(files[0]).filename(), "step-000000000005.frugal");
  EXPECT_EQ(fs::path(files[2]).filename(), "step-000000000003.frugal");
  fs::resize_file(files[0], fs::file_size(files[0]) / 2);

  auto fresh = make_resume_setup("plain");
  std::vector<std::string> warnings;
  const auto user =
      saves.resume(*fresh->trainer, [&](const std::string& w) { warnings.push_back(w); });
  ASSERT_TRUE(user.has_value());
  EXPECT_EQ(saves.resumed_from(), files[1]);
  EXPECT_EQ(fresh->trainer->steps(), 4);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find(files[0] + "' is truncated"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("resuming from the previous save, " + files[1]), std::string::npos)
      << warnings[0];

  for (const auto& file : files) {
    fs::resize_file(file, 10);
  }
  auto none = make_resume_setup("plain");
  try {
    saves.resume(*none->trainer);
    ADD_FAILURE() << "resumed from damaged files";
  } catch (const c10::Error& e) {
    for (const auto& file : files) {
      EXPECT_NE(std::string(e.what()).find(file), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(none->trainer->steps(), 0);
  fs::remove_all(dir);
}

}  // namespace
