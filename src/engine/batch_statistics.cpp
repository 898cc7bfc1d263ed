#include "batch_statistics.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include "frugal/error.h"

namespace frugal::detail {

std::vector<std::string> batch_statistics_layers(const torch::nn::Module& module) {
  std::vector<std::string> names;
  for (const auto& item : module.named_modules("", /*include_self=*/true)) {
    const auto& m = *item.value();
    if (m.is_training() && m.name().find("BatchNorm") != std::string::npos) {
      names.push_back(item.key().empty() ? m.name() : item.key());
    }
  }
  return names;
}

bool keeps_whole_batch(BatchStatistics choice, const torch::nn::Module& module) {
  return choice == BatchStatistics::WholeBatch && !batch_statistics_layers(module).empty();
}

void BatchStatisticsCheck::check(const torch::nn::Module& module, std::int64_t micro_batches,
                                 std::int64_t size) {
  const bool once = choice_ == BatchStatistics::Warn || choice_ == BatchStatistics::WholeBatch;
  if (micro_batches <= 1 || choice_ == BatchStatistics::Accept || (once && warned_)) {
    return;
  }
  const auto layers = batch_statistics_layers(module);
  if (layers.empty()) {
    // Nothing to warn of: under Warn the tree is not walked again at every step.
    warned_ = once;
    return;
  }
  std::string list;
  for (const auto& name : layers) {
    list += (list.empty() ? "" : "', '") + name;
  }
  const auto message = fmt::format(
      "frugal: micro-batches of {} samples change the batch statistics of {} layer(s): '{}': "
      "each micro-batch is normalized by its own mean and variance (and updates the running "
      "statistics once), so the gradient is not the whole batch's. Leave micro_batch unset "
      "to keep them exact (or choose TrainerOptions::batch_statistics(WholeBatch) to run whole "
      "batches where memory allows), use GroupNorm or LayerNorm, or choose "
      "TrainerOptions::batch_statistics(Accept) to go on without this message",
      size, layers.size(), list);
  FRUGAL_CHECK(choice_ != BatchStatistics::Refuse, message);
  warned_ = true;
  TORCH_WARN(message);
}

}  // namespace frugal::detail
