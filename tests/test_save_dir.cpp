// SaveDir: the newest saves kept, a damaged newest one passed over for the one before it,
// every file named when none loads, and a save refused by a full disk.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <torch/torch.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "helpers.h"
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

// While alive, this process's writes past `bytes` of a file fail (EFBIG), as writes to a full
// disk do (ENOSPC), without the signal that would otherwise end it.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) : handler_(std::signal(SIGXFSZ, SIG_IGN)) {
    ::getrlimit(RLIMIT_FSIZE, &previous_);
    rlimit limit = previous_;
    limit.rlim_cur = bytes;
    EXPECT_EQ(::setrlimit(RLIMIT_FSIZE, &limit), 0);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &previous_);
    std::signal(SIGXFSZ, handler_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  rlimit previous_{};
  void (*handler_)(int);
};

TEST(SaveDir, SweepsAbandonedTemporaryFilesButNotOneAnotherSaveIsWriting) {
  const auto dir = frugal::testing::fresh_temp_dir("state_savedir_sweep");
  auto s = make_resume_setup("plain");
  frugal::SaveDir saves(dir.string());
  const auto abandoned = dir / ".step-000000000007.frugal.tmp-4000001";  // a crashed save's
  const auto in_use = dir / ".step-000000000008.frugal.tmp-4000002";     // a live run's
  for (const auto& path : {abandoned, in_use}) {
    std::ofstream(path) << "half a save";
  }
  // What a save writing it holds: a lock through its own open file.
  const int writer = ::open(in_use.c_str(), O_WRONLY | O_CLOEXEC);
  ASSERT_GE(writer, 0);
  ASSERT_EQ(::flock(writer, LOCK_EX), 0);
  train(*s, 1);
  saves.save(*s->trainer);
  EXPECT_FALSE(fs::exists(abandoned));
  EXPECT_TRUE(fs::exists(in_use)) << "a save removed the temporary file another one is writing";
  ::close(writer);  // that save ended without renaming it (its process died)
  train(*s, 1);
  saves.save(*s->trainer);
  EXPECT_FALSE(fs::exists(in_use));
  EXPECT_EQ(saves.files().size(), 2u);
  fs::remove_all(dir);
}

TEST(SaveDir, ASecondLiveRunSavingIntoTheFolderIsRefusedNamingTheFirst) {
  const auto dir = frugal::testing::fresh_temp_dir("state_savedir_two_runs");
  auto first = make_resume_setup("plain");
  auto second = make_resume_setup("plain");
  auto mine = std::make_unique<frugal::SaveDir>(dir.string());
  train(*first, 1);
  mine->save(*first->trainer);
  frugal::SaveDir theirs(dir.string());
  train(*second, 2);
  const auto before = theirs.files();
  try {
    theirs.save(*second->trainer);
    ADD_FAILURE() << "two runs saved into one folder";
  } catch (const frugal::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("another run saves into '" + dir.string() + "' (process " +
                        std::to_string(::getpid()) + ")"),
              std::string::npos)
        << what;
  }
  EXPECT_EQ(theirs.files(), before) << "nothing was saved";
  mine.reset();  // the first run ends: the folder is free
  theirs.save(*second->trainer);
  EXPECT_EQ(theirs.files().size(), 2u);
  fs::remove_all(dir);
}

TEST(SaveDir, AFullDiskRefusesTheSaveByNameAndKeepsTheLastGoodOne) {
  const auto dir = frugal::testing::fresh_temp_dir("state_full_disk");
  auto s = make_resume_setup("plain");
  frugal::SaveDir saves(dir.string(), /*keep=*/3);
  train(*s, 2);
  saves.save(*s->trainer);
  const auto good = saves.files().front();
  const auto saved = frugal::testing::clone_all(s->model->parameters());
  train(*s, 1);
  {
    const FileSizeLimit full(fs::file_size(good) / 2);
    try {
      saves.save(*s->trainer);
      ADD_FAILURE() << "saved past the limit";
    } catch (const frugal::Error& e) {
      const auto what = frugal::error_message(e);
      EXPECT_NE(what.find("cannot save '" + (dir / "step-000000000003.frugal").string() + "'"),
                std::string::npos)
          << what;
      EXPECT_NE(what.find("File too large; the save needs "), std::string::npos) << what;
      EXPECT_NE(what.find("The temporary file was removed"), std::string::npos) << what;
    }
  }
  std::vector<std::string> names;  // no temporary file left beside the good save
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().filename() != ".lock") {  // the folder's lock, held by `saves`
      names.push_back(entry.path().filename().string());
    }
  }
  EXPECT_EQ(names, std::vector<std::string>{"step-000000000002.frugal"});

  auto fresh = make_resume_setup("plain");
  ASSERT_TRUE(saves.resume(*fresh->trainer).has_value());
  EXPECT_EQ(fresh->trainer->steps(), 2);
  const auto loaded = fresh->model->parameters();
  for (std::size_t i = 0; i < saved.size(); ++i) {
    EXPECT_TRUE(torch::equal(loaded[i], saved[i])) << "parameter " << i;
  }
  fs::remove_all(dir);
}

}  // namespace
