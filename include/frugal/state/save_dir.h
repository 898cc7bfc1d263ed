// A folder of saved training states: the newest kept, resumed from the newest that loads.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "frugal/state/training_state.h"

namespace frugal {

/// A folder of saved states, `step-<optimizer step>.frugal`, of which the newest `keep`
/// are kept: what a long run saves every N steps and resumes from.
///
/// Example:
///   frugal::SaveDir saves("run", /*keep=*/3);
///   if (auto resumed = saves.resume(trainer)) { epoch = resumed->values.at("epoch"); }
///   ...
///   saves.save(trainer, {{{"epoch", epoch}}, {}});
class SaveDir {
 public:
  /// Creates the folder (and its parents) when missing. keep >= 1.
  explicit SaveDir(std::string dir, std::int64_t keep = 3);

  /// Saves the trainer's state as the file of its current step, then removes all but the
  /// newest `keep` files (and temporary files a crash left). Returns the file's path. The
  /// first save locks the folder for as long as this SaveDir (or a copy) lives: a save of
  /// another live run (or SaveDir) into the same folder is refused, naming the holder.
  std::string save(Trainer& trainer, const UserState& user = {});
  /// The saved files, newest (highest step) first.
  std::vector<std::string> files() const;
  /// The same in any folder (none when it does not exist), without making one.
  static std::vector<std::string> files_in(const std::string& dir);
  /// The steps of the saved files that are whole (header, length and checksum checked,
  /// without loading them), newest first; each other one is passed to `warn` with the reason.
  std::vector<std::int64_t> whole_steps(
      const std::function<void(const std::string&)>& warn = {}) const;
  /// The file of step `step`.
  std::string file_of(std::int64_t step) const;
  /// Loads the newest file that loads. Each newer one that fails is passed to `warn` with
  /// the reason; when none loads, the trainer is unchanged and the result empty (no files)
  /// or an error naming every file and why (files, none loadable).
  std::optional<UserState> resume(Trainer& trainer,
                                  const std::function<void(const std::string&)>& warn = {});
  /// Loads the file of step `step`, all or nothing (see load_training_state).
  UserState resume_at(Trainer& trainer, std::int64_t step);
  /// The file the last resume() or resume_at() loaded, or empty.
  const std::string& resumed_from() const { return resumed_from_; }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::int64_t keep_;
  std::string resumed_from_;
  std::shared_ptr<int> lock_;  // the folder's lock, from the first save on
};

}  // namespace frugal
