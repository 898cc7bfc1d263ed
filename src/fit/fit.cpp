#include "frugal/fit/fit.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <csignal>
#include <optional>

#include "frugal/error.h"
#include "frugal/train/trainer.h"

namespace frugal {
namespace {

volatile std::sig_atomic_t g_signal = 0;

extern "C" void remember_signal(int signal) { g_signal = signal; }

// SIGINT and SIGTERM only set a flag while a fit runs; the old handlers come back after.
class SignalWatch {
 public:
  explicit SignalWatch(bool enabled) : enabled_(enabled) {
    if (!enabled_) {
      return;
    }
    g_signal = 0;
    struct sigaction action {};
    action.sa_handler = remember_signal;
    sigemptyset(&action.sa_mask);
    sigaction(SIGINT, &action, &old_int_);
    sigaction(SIGTERM, &action, &old_term_);
  }
  ~SignalWatch() {
    if (enabled_) {
      sigaction(SIGINT, &old_int_, nullptr);
      sigaction(SIGTERM, &old_term_, nullptr);
    }
  }
  SignalWatch(const SignalWatch&) = delete;
  SignalWatch& operator=(const SignalWatch&) = delete;
  int caught() const { return enabled_ ? static_cast<int>(g_signal) : 0; }

 private:
  bool enabled_;
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
};

void check_options(const FitOptions& o, const DataSource& train) {
  FRUGAL_CHECK(o.epochs() >= 1, "frugal: fit epochs must be >= 1, got ", o.epochs());
  FRUGAL_CHECK(o.batch_size() >= 1, "frugal: fit batch_size must be >= 1, got ", o.batch_size());
  FRUGAL_CHECK(o.max_steps() >= 0, "frugal: fit max_steps must be >= 0, got ", o.max_steps());
  FRUGAL_CHECK(o.eval_every() >= 0, "frugal: fit eval_every must be >= 0, got ", o.eval_every());
  FRUGAL_CHECK(o.save_every() >= 0, "frugal: fit save_every must be >= 0, got ", o.save_every());
  FRUGAL_CHECK(!o.save_dir().empty() || (!o.resume() && o.save_every() == 0),
               "frugal: fit resume and save_every need a save_dir");
  FRUGAL_CHECK(train.size() >= 1, "frugal: fit needs training data, got 0 samples");
}

constexpr const char* kEpoch = "fit/epoch";
constexpr const char* kBatch = "fit/batch";

// Loads the newest loadable save, if any, and sets the position fit goes on from.
void resume(SaveDir& saves, Trainer& trainer, const FitOptions& options,
            const FitOptions::LogFn& log, FitResult& result) {
  auto user = saves.resume(trainer, log);
  if (!user) {
    return;
  }
  auto& pos = result.position;
  FRUGAL_CHECK(user->values.count(kEpoch) && user->values.count(kBatch), "frugal: '",
               saves.resumed_from(), "' was not saved by fit (no position in it)");
  pos.epoch = user->values.at(kEpoch);
  pos.batch = user->values.at(kBatch);
  FRUGAL_CHECK(pos.epoch >= 1 && pos.batch >= 0 && pos.batch <= pos.batches_per_epoch, "frugal: '",
               saves.resumed_from(), "' stopped at epoch ", pos.epoch, " batch ", pos.batch,
               ", which this data (", pos.batches_per_epoch, " batches an epoch) does not have");
  result.resumed_from = saves.resumed_from();
  if (options.on_resume()) {
    options.on_resume()(*user);
  }
  log(fmt::format("resumed from {} (step {}, epoch {}, batch {} of {})", result.resumed_from,
                  trainer.steps(), pos.epoch, pos.batch, pos.batches_per_epoch));
}

}  // namespace

EvalReport Ranks::evaluate(Trainer& trainer, const Batch& data) const {
  return trainer.evaluate(data);
}

FitResult fit(Trainer& trainer, const DataSource& train, const FitOptions& options,
              const Batch& eval) {
  check_options(options, train);
  const FitOptions::LogFn log = options.log() ? options.log() : [](const std::string& line) {
    fmt::print(stderr, "frugal: {}\n", line);
  };
  const std::int64_t n = train.size();
  const std::int64_t bs = options.batch_size();
  FitResult result;
  auto& pos = result.position;
  pos.batches_per_epoch = (n - 1) / bs + 1;

  static const Ranks one_process;
  const Ranks& ranks = options.ranks() ? *options.ranks() : one_process;
  const bool writes = ranks.writes_saves(trainer.optimizer());
  std::optional<SaveDir> saves;
  if (!options.save_dir().empty()) {
    saves.emplace(ranks.save_dir(options.save_dir(), trainer.optimizer()), options.keep());
  }
  if (options.resume()) {
    resume(*saves, trainer, options, log, result);
    ranks.check_resumed(trainer.steps());
  }
  std::int64_t saved_step = -1;  // the step of the newest save file
  if (!result.resumed_from.empty()) {
    saved_step = trainer.steps();
  }
  auto save = [&] {
    if (!writes) {  // the processes hold the same state: another's file is this one's
      saved_step = trainer.steps();
      return;
    }
    UserState user;
    if (options.on_save()) {
      options.on_save()(user);
    }
    user.values[kEpoch] = pos.epoch;
    user.values[kBatch] = pos.batch;
    result.saved = saves->save(trainer, user);
    saved_step = trainer.steps();
  };
  auto evaluate = [&] {
    result.eval = ranks.evaluate(trainer, eval);
    if (options.on_eval()) {
      options.on_eval()(result.eval, pos);
    }
  };
  auto reached_max = [&] {
    return options.max_steps() > 0 && trainer.steps() >= options.max_steps();
  };

  SignalWatch signals(options.handle_signals());
  auto generator = torch::make_generator<torch::CPUGeneratorImpl>(options.seed());
  for (std::int64_t e = 1; options.shuffle() && e < pos.epoch; ++e) {
    torch::randperm(n, generator);  // the orders of the epochs already done
  }
  bool stop = reached_max();
  for (; pos.epoch <= options.epochs() && !stop; ++pos.epoch, pos.batch = 0) {
    pos.end_of_epoch = false;
    pos.step = trainer.steps();
    if (options.on_epoch_begin()) {
      options.on_epoch_begin()(pos);
    }
    const auto order =
        options.shuffle() ? torch::randperm(n, generator) : torch::arange(n, torch::kLong);
    while (pos.batch < pos.batches_per_epoch) {
      const std::int64_t start = pos.batch * bs;
      const auto indices = ranks.share(order.narrow(0, start, std::min(bs, n - start)));
      if (!indices.defined()) {
        ++pos.batch;  // too small to give every process a sample
        continue;
      }
      const auto report = trainer.step(train.get(indices));
      ++pos.batch;
      pos.step = trainer.steps();
      if (options.on_step()) {
        options.on_step()(report, pos);
      }
      if (trainer.window_open()) {
        continue;  // saves, evaluations and stops wait for the step that ends the window
      }
      const bool every_eval = options.eval_every() > 0 && pos.step % options.eval_every() == 0;
      if (every_eval && eval.inputs.defined()) {
        evaluate();
      }
      const int caught = options.handle_signals() ? ranks.agree_on_stop(signals.caught()) : 0;
      if (caught != 0) {
        if (saves) {
          save();
          log(fmt::format("stopped by signal {} at step {}; saved {}", caught, pos.step,
                          result.saved));
        }
        result.signal = caught;
        result.steps = trainer.steps();
        return result;
      }
      if (options.save_every() > 0 && pos.step % options.save_every() == 0) {
        save();
      }
      if ((stop = reached_max())) {
        break;
      }
    }
    if (trainer.flush()) {
      pos.step = trainer.steps();
    }
    pos.end_of_epoch = pos.batch == pos.batches_per_epoch;
    if (options.eval_every() == 0 && eval.inputs.defined()) {
      evaluate();
    }
    if (stop) {
      break;
    }
  }
  if (pos.epoch > options.epochs()) {  // the position after the last epoch
    pos.epoch = options.epochs();
    pos.batch = pos.batches_per_epoch;
  }
  pos.step = trainer.steps();
  if (saves && saved_step != trainer.steps()) {
    save();
  }
  result.steps = trainer.steps();
  return result;
}

}  // namespace frugal
