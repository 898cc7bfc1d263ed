// Saving and resuming the whole training state: one file, checked, written atomically.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace frugal {

class Trainer;

/// What the caller keeps beside the trainer's state: the data position, the epoch, any
/// bytes. Saved and loaded with it, verbatim.
struct UserState {
  std::map<std::string, std::int64_t> values;
  std::map<std::string, double> numbers;  ///< bit for bit
  std::string blob;
};

/// Writes everything a resumed run needs to go on bit for bit as if never stopped: the
/// module's parameters and buffers by name, the optimizer's state and param-group options
/// (LibTorch's or frugal's optimizers), every policy's state (GradScaler, OomRecovery,
/// LrSchedule), the trainer's counters and micro-batch, the CPU and CUDA random number
/// generators, and `user`. One file with a format version and a CRC-32 of its contents,
/// written to a temporary file in the same folder, flushed to disk, renamed over `path`
/// and the folder flushed: a crash leaves the old file or the new one, never a torn one.
///
/// Refused inside an accumulation window (save after the step that ends it: the window's
/// gradients are not saved) and while the trainer is halted by a PartialStepError.
///
/// Example:
///   frugal::save_training_state(trainer, "run/state.frugal", {{{"epoch", epoch}}, {}});
void save_training_state(Trainer& trainer, const std::string& path, const UserState& user = {});

/// Loads a file written by save_training_state into `trainer`, whose module, optimizer and
/// policies must be built as they were when it was saved; returns the saved UserState.
/// All or nothing: a missing, truncated or damaged file, another format version, another
/// model (names, shapes, dtypes), another optimizer (type, param groups) or other policies
/// is an error that names what differs, and the trainer, module, optimizer and generators
/// are then as before. Loading also lifts a halt left by a PartialStepError.
UserState load_training_state(Trainer& trainer, const std::string& path);

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
  /// newest `keep` files (and temporary files a crash left). Returns the file's path.
  std::string save(Trainer& trainer, const UserState& user = {});
  /// The saved files, newest (highest step) first.
  std::vector<std::string> files() const;
  /// Loads the newest file that loads. Each newer one that fails is passed to `warn` with
  /// the reason; when none loads, the trainer is unchanged and the result empty (no files)
  /// or an error naming every file and why (files, none loadable).
  std::optional<UserState> resume(Trainer& trainer,
                                  const std::function<void(const std::string&)>& warn = {});
  /// The file the last resume() loaded, or empty.
  const std::string& resumed_from() const { return resumed_from_; }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::int64_t keep_;
  std::string resumed_from_;
};

}  // namespace frugal
