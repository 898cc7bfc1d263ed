#include "frugal/fit/data_source.h"

namespace frugal {

TensorData::TensorData(Batch all) : all_(std::move(all)), size_(all_.size()) {}

Batch TensorData::get(const torch::Tensor& indices) const {
  Batch out;
  out.inputs = all_.inputs.index_select(0, indices);
  if (all_.targets.defined()) {
    out.targets = all_.targets.index_select(0, indices);
  }
  return out;
}

}  // namespace frugal
