#include "frugal/distributed/reducer.h"

#include <torch/torch.h>

#include <map>
#include <string>

#include "frugal/error.h"

namespace frugal::distributed {

GradientAverage::GradientAverage(std::shared_ptr<Group> group) : group_(std::move(group)) {
  FRUGAL_CHECK(group_ != nullptr, "frugal: GradientAverage needs a process group");
}

void GradientAverage::reduce(const std::vector<torch::Tensor>& gradients) {
  if (group_->size() == 1) {
    return;
  }
  torch::NoGradGuard no_grad;
  // One flat buffer per dtype and device, in the gradients' order on every process.
  std::map<std::string, std::vector<torch::Tensor>> buckets;
  for (const auto& g : gradients) {
    FRUGAL_CHECK(g.defined() && !g.is_sparse(),
                 "frugal: GradientAverage reduces dense gradients only");
    buckets[c10::str(g.scalar_type(), "@", g.device())].push_back(g);
  }
  const double inverse = 1.0 / static_cast<double>(group_->size());
  for (auto& [key, grads] : buckets) {
    std::vector<torch::Tensor> flat;
    for (const auto& g : grads) {
      flat.push_back(g.reshape(-1));
    }
    auto bucket = torch::cat(flat);
    group_->all_reduce(bucket).wait();  // the sum over the processes
    bucket.mul_(inverse);
    std::int64_t offset = 0;
    for (auto& g : grads) {
      g.copy_(bucket.narrow(0, offset, g.numel()).view_as(g));
      offset += g.numel();
    }
  }
}

bool GradientAverage::any(bool value) { return group_->sum(value ? 1.0 : 0.0) > 0; }

}  // namespace frugal::distributed
