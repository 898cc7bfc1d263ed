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
  // Names are written only for an error: this runs for every batch and micro-batch.
  struct Seen {
    const char* name;        // inputs or targets
    const std::string* key;  // or a named field
    const torch::Tensor* tensor;
    std::string text() const { return key != nullptr ? "'" + *key + "'" : std::string(name); }
  };
  c10::optional<Seen> first;
  auto check = [&](const Seen& seen) {
    const auto& t = *seen.tensor;
    if (!t.defined()) {
      return;
    }
    FRUGAL_CHECK(t.dim() >= 1, "frugal: batch ", seen.text(),
                 " must have a sample dimension, got a 0-d tensor");
    if (!first) {
      first = seen;
      return;
    }
    const auto& f = *first->tensor;
    FRUGAL_CHECK(t.size(0) == f.size(0), "frugal: ", first->text(), " hold ", f.size(0),
                 " samples but ", seen.text(), " hold ", t.size(0), " (shapes ", f.sizes(), " and ",
                 t.sizes(), ")");
  };
  check({"inputs", nullptr, &inputs});
  check({"targets", nullptr, &targets});
  for (const auto& [key, t] : fields) {
    check({nullptr, &key, &t});
  }
  FRUGAL_CHECK(first.has_value(), "frugal: the batch has no inputs (and no named tensors)");
  return first->tensor->size(0);
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

Batch Batch::pinned_for(torch::Device device) const {
  if (!device.is_cuda()) {
    return *this;
  }
  return map(*this, [](const torch::Tensor& t) {
    return t.is_cpu() && !t.is_pinned() ? t.pin_memory() : t;
  });
}

}  // namespace frugal
