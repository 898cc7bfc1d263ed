#include "frugal/state/save_dir.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstring>
#include <fstream>
#include <cstdio>
#include <filesystem>

#include "frugal/error.h"
#include "frugal/train/trainer.h"
#include "state_file.h"

namespace frugal {
namespace {

namespace fs = std::filesystem;

// The step of a file named step-<digits>.frugal, or -1.
std::int64_t step_of(const std::string& name) {
  const std::string prefix = "step-", suffix = ".frugal";
  if (name.size() <= prefix.size() + suffix.size() || name.rfind(prefix, 0) != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return -1;
  }
  const auto digits = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (digits.size() > 18 || digits.find_first_not_of("0123456789") != std::string::npos) {
    return -1;
  }
  return std::stoll(digits);
}

// The folder's lock, held while this process saves into it: `.lock` locked with flock, which
// the system releases when the process ends however it ends. Its text names the holder.
std::shared_ptr<int> lock_folder(const std::string& dir) {
  const auto path = (fs::path(dir) / ".lock").string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  FRUGAL_CHECK(fd >= 0, "frugal: cannot open ", path, ": ", std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    ::close(fd);
    std::string holder;
    std::getline(std::ifstream(path), holder);
    throw Error(c10::str(
        "frugal: another run saves into '", dir, "'",
        error == EWOULDBLOCK ? " (" + (holder.empty() ? "a live process" : holder) + ")"
                             : ": " + std::string(std::strerror(error)),
        "; two runs in one folder would interleave their saves: give each its own. Nothing was "
        "saved"));
  }
  const auto text = "process " + std::to_string(::getpid()) + "\n";
  // Without its text the lock still holds: the text only names the holder to another run.
  const bool named = ::ftruncate(fd, 0) == 0 &&
                     ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  (void)named;
  return std::shared_ptr<int>(new int(fd), [](int* held) {
    ::close(*held);  // releases the lock
    delete held;
  });
}

}  // namespace

SaveDir::SaveDir(std::string dir, std::int64_t keep) : dir_(std::move(dir)), keep_(keep) {
  FRUGAL_CHECK(!dir_.empty(), "frugal: SaveDir needs a folder, got an empty path");
  detail::check_at_least(keep_, 1, "SaveDir keep");
  std::error_code error;
  fs::create_directories(dir_, error);
  FRUGAL_CHECK(!error && fs::is_directory(dir_), "frugal: cannot create the folder '", dir_,
               "': ", error ? error.message() : "a file of that name exists");
}

std::vector<std::string> SaveDir::files() const { return files_in(dir_); }

std::vector<std::string> SaveDir::files_in(const std::string& dir) {
  std::vector<std::pair<std::int64_t, std::string>> found;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    const auto step = step_of(entry.path().filename().string());
    if (step >= 0 && entry.is_regular_file()) {
      found.emplace_back(step, entry.path().string());
    }
  }
  std::sort(found.begin(), found.end(), std::greater<>());
  std::vector<std::string> out;
  for (auto& item : found) {
    out.push_back(std::move(item.second));
  }
  return out;
}

std::vector<std::int64_t> SaveDir::whole_steps(
    const std::function<void(const std::string&)>& warn) const {
  std::vector<std::int64_t> steps;
  for (const auto& file : files()) {
    try {
      detail::check_state_file(file);
      steps.push_back(step_of(fs::path(file).filename().string()));
    } catch (const std::exception& error) {
      if (warn) {
        warn(error_message(error) + "; passed over");
      }
    }
  }
  return steps;
}

std::string SaveDir::file_of(std::int64_t step) const {
  char name[40];
  std::snprintf(name, sizeof(name), "step-%012" PRId64 ".frugal", step);
  return (fs::path(dir_) / name).string();
}

UserState SaveDir::resume_at(Trainer& trainer, std::int64_t step) {
  resumed_from_.clear();
  const auto path = file_of(step);
  auto user = load_training_state(trainer, path);
  resumed_from_ = path;
  return user;
}

std::string SaveDir::save(Trainer& trainer, const UserState& user) {
  if (!lock_) {
    lock_ = lock_folder(dir_);
  }
  const auto path = file_of(trainer.steps());
  save_training_state(trainer, path, user);
  const auto saved = files();
  for (std::size_t i = static_cast<std::size_t>(keep_); i < saved.size(); ++i) {
    fs::remove(saved[i]);
  }
  // Temporary files of saves that a crash interrupted (not those another run is writing).
  for (const auto& entry : fs::directory_iterator(dir_)) {
    const auto file = entry.path().filename().string();
    if (file.rfind(".step-", 0) == 0 && file.find(".frugal.tmp-") != std::string::npos) {
      detail::remove_if_abandoned(entry.path().string());
    }
  }
  return path;
}

std::optional<UserState> SaveDir::resume(Trainer& trainer,
                                         const std::function<void(const std::string&)>& warn) {
  resumed_from_.clear();
  const auto saved = files();
  if (saved.empty()) {
    return std::nullopt;
  }
  std::string failures;
  for (std::size_t i = 0; i < saved.size(); ++i) {
    try {
      auto user = load_training_state(trainer, saved[i]);
      resumed_from_ = saved[i];
      return user;
    } catch (const std::exception& error) {
      const auto reason = error_message(error);
      failures += "\n  " + reason;
      if (warn && i + 1 < saved.size()) {
        warn(reason + "; resuming from the previous save, " + saved[i + 1]);
      }
    }
  }
  FRUGAL_CHECK(false, "frugal: no save file in '", dir_, "' could be loaded:", failures);
}

}  // namespace frugal
