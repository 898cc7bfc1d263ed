#include "frugal/autocast_guard.h"

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>

#include "compat.h"
#include "frugal/error.h"

namespace frugal {

void AutocastGuard::check_supported(torch::DeviceType type, torch::Dtype dtype) {
  FRUGAL_CHECK(compat::autocast_supports(type, dtype), "frugal: autocast to ", c10::toString(dtype),
               " on ", c10::DeviceTypeName(type), " is not supported by LibTorch ",
               TORCH_VERSION_MAJOR, ".", TORCH_VERSION_MINOR,
               type == torch::kCPU ? " (the CPU takes BFloat16; Half needs LibTorch 2.4+)" : "");
}

AutocastGuard::AutocastGuard(torch::DeviceType device_type, torch::Dtype dtype, bool enabled)
    : type_(device_type),
      previous_enabled_(compat::autocast_enabled(device_type)),
      previous_dtype_(compat::autocast_dtype(device_type)) {
  if (enabled) {
    check_supported(device_type, dtype);
  }
  compat::set_autocast_enabled(type_, enabled);
  compat::set_autocast_dtype(type_, dtype);
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  if (at::autocast::decrement_nesting() == 0) {
    at::autocast::clear_cache();
  }
  compat::set_autocast_enabled(type_, previous_enabled_);
  compat::set_autocast_dtype(type_, previous_dtype_);
}

}  // namespace frugal
