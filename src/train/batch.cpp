#include "frugal/train/batch.h"

#include <c10/util/Exception.h>

namespace frugal {

std::int64_t Batch::size() const {
  TORCH_CHECK(inputs.defined(), "frugal: the batch has no inputs");
  TORCH_CHECK(inputs.dim() >= 1, "frugal: batch inputs must have a sample dimension, got a ",
              inputs.dim(), "-d tensor");
  const std::int64_t n = inputs.size(0);
  if (targets.defined()) {
    TORCH_CHECK(targets.dim() >= 1 && targets.size(0) == n, "frugal: inputs hold ", n,
                " samples but targets hold ", targets.dim() >= 1 ? targets.size(0) : 0,
                " (shapes ", inputs.sizes(), " and ", targets.sizes(), ")");
  }
  return n;
}

Batch Batch::slice(std::int64_t start, std::int64_t length) const {
  Batch out;
  out.inputs = inputs.narrow(0, start, length);
  if (targets.defined()) {
    out.targets = targets.narrow(0, start, length);
  }
  return out;
}

Batch Batch::to(torch::Device device) const {
  if (inputs.device() == device && (!targets.defined() || targets.device() == device)) {
    return *this;
  }
  Batch out;
  out.inputs = inputs.to(device);
  if (targets.defined()) {
    out.targets = targets.to(device);
  }
  return out;
}

}  // namespace frugal
