#include "frugal/train/batch.h"

#include "frugal/error.h"

namespace frugal {
namespace {

// Applies `fn` to every defined tensor of `in`, building the same-shaped batch.
template <typename Fn>
Batch map(const Batch& in, Fn fn) {
  Batch out;
  if (in.inputs.defined()) {
    out.inputs = fn(in.inputs);
  }
  if (in.targets.defined()) {
    out.targets = fn(in.targets);
  }
  out.fields.reserve(in.fields.size());
  for (const auto& [name, t] : in.fields) {
    out.fields.emplace_back(name, t.defined() ? fn(t) : t);
  }
  return out;
}

}  // namespace

Batch& Batch::set(const std::string& name, torch::Tensor tensor) {
  if (name == "inputs") {
    inputs = std::move(tensor);
  } else if (name == "targets") {
    targets = std::move(tensor);
  } else {
    for (auto& [key, t] : fields) {
      if (key == name) {
        t = std::move(tensor);
        return *this;
      }
    }
    fields.emplace_back(name, std::move(tensor));
  }
  return *this;
}

bool Batch::has(const std::string& name) const {
  if (name == "inputs") {
    return inputs.defined();
  }
  if (name == "targets") {
    return targets.defined();
  }
  for (const auto& item : fields) {
    if (item.first == name) {
      return item.second.defined();
    }
  }
  return false;
}

const torch::Tensor& Batch::get(const std::string& name) const {
  if (name == "inputs" && inputs.defined()) {
    return inputs;
  }
  if (name == "targets" && targets.defined()) {
    return targets;
  }
  std::string held;
  for (const auto& [key, t] : fields) {
    if (key == name && t.defined()) {
      return t;
    }
    held += (held.empty() ? "'" : ", '") + key + "'";
  }
  FRUGAL_CHECK(false, "frugal: the batch has no tensor '", name, "' (it holds ",
               inputs.defined() ? "inputs, " : "", targets.defined() ? "targets, " : "",
               held.empty() ? "no named tensors" : "named tensors " + held, ")");
  return inputs;  // not reached
}

std::int64_t Batch::size() const {
  std::int64_t n = -1;
  std::string first;
  torch::Tensor first_tensor;
  auto check = [&](const std::string& name, const torch::Tensor& t) {
    if (!t.defined()) {
      return;
    }
    FRUGAL_CHECK(t.dim() >= 1, "frugal: batch ", name,
                 " must have a sample dimension, got a 0-d tensor");
    if (n < 0) {
      n = t.size(0);
      first = name;
      first_tensor = t;
      return;
    }
    FRUGAL_CHECK(t.size(0) == n, "frugal: ", first, " hold ", n, " samples but ", name, " hold ",
                 t.size(0), " (shapes ", first_tensor.sizes(), " and ", t.sizes(), ")");
  };
  check("inputs", inputs);
  check("targets", targets);
  for (const auto& [key, t] : fields) {
    check("'" + key + "'", t);
  }
  FRUGAL_CHECK(n >= 0, "frugal: the batch has no inputs (and no named tensors)");
  return n;
}

Batch Batch::slice(std::int64_t start, std::int64_t length) const {
  return map(*this, [&](const torch::Tensor& t) { return t.narrow(0, start, length); });
}

Batch Batch::to(torch::Device device) const {
  return map(*this, [&](const torch::Tensor& t) {
    if (t.device() == device) {
      return t;
    }
    if (device.is_cuda() && t.is_cpu()) {
      // Through page-locked memory, the copy is queued on the stream and the host goes on
      // (the pinned block is reused only once the copy is done); from pageable memory
      // the host would wait for it.
      return (t.is_pinned() ? t : t.pin_memory()).to(device, /*non_blocking=*/true);
    }
    return t.to(device);
  });
}

}  // namespace frugal
