// Saving and resuming the whole training state: one file, checked, written atomically.
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace frugal {

class Trainer;
class Loop;

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

/// The same for a frugal::Loop: every prepared model's parameters and buffers, its
/// optimizer's state and its step counters, the loss scaler's state, the loop's iteration
/// count, the generators and `user`, in one file written as above. Refused while a model has
/// gradients waiting for its step.
///
/// Example:
///   frugal::save_training_state(loop, "gan.frugal", {{{"iteration", i}}, {}});
void save_training_state(Loop& loop, const std::string& path, const UserState& user = {});
/// Loads a file written from a Loop whose models (by name, in order), optimizers and scaler
/// are built as they were; all or nothing, errors naming what differs.
UserState load_training_state(Loop& loop, const std::string& path);

}  // namespace frugal
