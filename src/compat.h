// The one place that knows which LibTorch version frugal is built against.
//
// Everything that differs between LibTorch 1.13 and 2.x goes through here: the CPU
// allocator interface, the autocast API (device-generic from 2.4 on) and the CUDA caching
// allocator's statistics. No other file tests a version.
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>
#include <torch/version.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#define FRUGAL_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||         \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace frugal::compat {

/// A c10::Allocator whose subclasses implement `allocate_bytes` once for every version
/// (`allocate` is const before 2.3; `copy_data` must be defined from 2.3 on).
class AllocatorBase : public c10::Allocator {
 public:
  virtual c10::DataPtr allocate_bytes(std::size_t n) const = 0;

#if FRUGAL_TORCH_AT_LEAST(2, 3)
  c10::DataPtr allocate(std::size_t n) override { return allocate_bytes(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
#else
  c10::DataPtr allocate(std::size_t n) const override { return allocate_bytes(n); }
#endif
};

// Autocast state of one device type.
inline bool autocast_enabled(c10::DeviceType type) {
#if FRUGAL_TORCH_AT_LEAST(2, 4)
  return at::autocast::is_autocast_enabled(type);
#else
  return type == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
#endif
}

inline void set_autocast_enabled(c10::DeviceType type, bool enabled) {
#if FRUGAL_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(type, enabled);
#else
  if (type == c10::DeviceType::CPU) {
    at::autocast::set_cpu_enabled(enabled);
  } else {
    at::autocast::set_enabled(enabled);
  }
#endif
}

inline c10::ScalarType autocast_dtype(c10::DeviceType type) {
#if FRUGAL_TORCH_AT_LEAST(2, 4)
  return at::autocast::get_autocast_dtype(type);
#else
  return type == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype()
                                      : at::autocast::get_autocast_gpu_dtype();
#endif
}

inline void set_autocast_dtype(c10::DeviceType type, c10::ScalarType dtype) {
#if FRUGAL_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_dtype(type, dtype);
#else
  if (type == c10::DeviceType::CPU) {
    at::autocast::set_autocast_cpu_dtype(dtype);
  } else {
    at::autocast::set_autocast_gpu_dtype(dtype);
  }
#endif
}

/// Whether autocast on `type` can run in `dtype`: CPU autocast takes bfloat16, and
/// float16 too from LibTorch 2.4 on; CUDA takes both.
inline bool autocast_supports(c10::DeviceType type, c10::ScalarType dtype) {
  if (dtype == c10::ScalarType::BFloat16) {
    return type == c10::DeviceType::CPU || type == c10::DeviceType::CUDA;
  }
  if (dtype == c10::ScalarType::Half) {
    return type == c10::DeviceType::CUDA ||
           (type == c10::DeviceType::CPU && FRUGAL_TORCH_AT_LEAST(2, 4));
  }
  return false;
}

/// The key of a parameter's entry in torch::optim::Optimizer::state(): its TensorImpl, as
/// a pointer in 2.x and as the pointer's text in 1.13.
using OptimizerStateKey =
    std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;

template <typename Key = OptimizerStateKey>
Key optimizer_state_key(const at::Tensor& param) {
  if constexpr (std::is_same_v<Key, std::string>) {
    // The pointer as c10::guts::to_string writes it (an ostream's "0x" and lowercase hex),
    // without an ostringstream and its locale: the step guard asks for every parameter's
    // key every step. A TensorImpl pointer is never null.
    auto bits = reinterpret_cast<std::uintptr_t>(param.unsafeGetTensorImpl());
    char digits[2 * sizeof(bits)];
    std::size_t n = 0;
    do {
      digits[n++] = "0123456789abcdef"[bits & 0xf];
      bits >>= 4;
    } while (bits != 0);
    std::string key = "0x";
    while (n > 0) {
      key.push_back(digits[--n]);
    }
    return key;
  } else {
    return param.unsafeGetTensorImpl();
  }
}

/// A hook that runs each time autograd has accumulated a gradient into a leaf's `.grad`,
/// while the hook is alive: LibTorch 2.x's post-accumulate-grad hook on the tensor, or on
/// 1.13 a post hook on the leaf's gradient accumulator (kept alive by the hook, as c10d's
/// Reducer does). Several may be installed on one tensor; they run in the order installed.
class GradAccumulatedHook {
 public:
  using Fn = std::function<void(const at::Tensor& leaf)>;
  virtual ~GradAccumulatedHook() = default;
};

/// Installs `fn` on `leaf` (a tensor that requires grad and has no grad_fn).
std::unique_ptr<GradAccumulatedHook> on_grad_accumulated(const at::Tensor& leaf,
                                                         GradAccumulatedHook::Fn fn);

/// After `leaf.set_data` gave the leaf another shape: its gradient accumulator, if one is
/// alive, expects gradients of the new shape. An accumulator keeps the shape the leaf had
/// when it was made: before LibTorch 2.1 a gradient-ready hook holds it across steps, and
/// in any version a graph that reached the leaf while it was released (a checkpoint of a
/// block whose parts are units) holds it until its backward.
void refresh_grad_accumulator(const at::Tensor& leaf);

/// The CUDA caching allocator's figures for one device, aggregated over pool kinds.
struct CudaAllocatorStats {
  std::int64_t allocated = 0, allocated_peak = 0;  // blocks: requests rounded as it rounds them
  std::int64_t requested = 0, requested_peak = 0;  // the requests (LibTorch 2.1 or later)
  std::int64_t reserved = 0, reserved_peak = 0;
  std::int64_t active = 0, active_peak = 0;
  std::int64_t allocations = 0, alloc_retries = 0, ooms = 0;
};

#ifdef FRUGAL_WITH_CUDA
/// The state of a CUDA device's default generator, and setting it back.
at::Tensor cuda_rng_state(int device);
void set_cuda_rng_state(int device, const at::Tensor& state);

CudaAllocatorStats cuda_allocator_stats(int device);
void cuda_reset_peak(int device);
/// Makes CUDA's lazy initialisation happen (the caching allocator has no devices before it):
/// one small allocation on `device`.
void cuda_initialise(int device);
/// Caps the caching allocator of `device` at `fraction` of its memory (emulates a smaller
/// card), initialising CUDA first; and the fraction in force.
void cuda_set_memory_fraction(double fraction, int device);
double cuda_memory_fraction(int device);
std::int64_t cuda_total_memory(int device);
void cuda_empty_cache();
/// From now on the CUDA caching allocator's allocations, completed frees and refusals reach
/// the allocation observer, if any (detail::AllocationObserver::on_device), through the
/// allocator's trace hook (the one its memory history records from; LibTorch 2.1 and
/// later). Attached once a process; later calls do nothing.
void cuda_attach_trace();
/// The bytes the caching allocator holds for a request of `nbytes`: 512 at least, rounded up
/// to a multiple of 512 (the default rounding).
std::int64_t cuda_block_bytes(std::int64_t nbytes);
/// While it lives, an operation that makes the host wait for a CUDA device's work (item(), a
/// copy to the host, an operator's stream synchronisation) throws instead (CUDA's sync debug
/// mode set to error): a test's proof that a path reads nothing back from the device.
class CudaHostReadsForbidden {
 public:
  CudaHostReadsForbidden();
  ~CudaHostReadsForbidden();
  CudaHostReadsForbidden(const CudaHostReadsForbidden&) = delete;
  CudaHostReadsForbidden& operator=(const CudaHostReadsForbidden&) = delete;

 private:
  int previous_;
};
#endif

/// The "no backtrace" argument of c10::Error's base constructor (a lazy backtrace from 2.2
/// on, a string before).
#if FRUGAL_TORCH_AT_LEAST(2, 2)
inline std::nullptr_t no_backtrace() { return nullptr; }
#else
inline std::string no_backtrace() { return {}; }
#endif

/// Collects LibTorch warnings (TORCH_WARN) raised on this thread while it lives, instead of
/// printing them; the handler's signature changed in 2.0.
class WarningCapture : public c10::WarningHandler {
 public:
#if FRUGAL_TORCH_AT_LEAST(2, 0)
  WarningCapture() : previous_(c10::WarningUtils::get_warning_handler()) {
    c10::WarningUtils::set_warning_handler(this);
  }
  ~WarningCapture() override { c10::WarningUtils::set_warning_handler(previous_); }
#else
  WarningCapture() : previous_(c10::Warning::get_warning_handler()) {
    c10::Warning::set_warning_handler(this);
  }
  ~WarningCapture() override { c10::Warning::set_warning_handler(previous_); }
#endif
  WarningCapture(const WarningCapture&) = delete;
  WarningCapture& operator=(const WarningCapture&) = delete;
#if FRUGAL_TORCH_AT_LEAST(2, 0)
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
#else
  void process(const c10::SourceLocation&, const std::string& msg, const bool) override {
    messages.push_back(msg);
  }
#endif
  std::vector<std::string> messages;

 private:
  c10::WarningHandler* previous_;
};

/// LibTorch's float8 types (e4m3fn, e5m2), which exist from 2.1 on; none before.
inline std::optional<c10::ScalarType> float8_e4m3() {
#if FRUGAL_TORCH_AT_LEAST(2, 1)
  return c10::ScalarType::Float8_e4m3fn;
#else
  return std::nullopt;
#endif
}
inline std::optional<c10::ScalarType> float8_e5m2() {
#if FRUGAL_TORCH_AT_LEAST(2, 1)
  return c10::ScalarType::Float8_e5m2;
#else
  return std::nullopt;
#endif
}

}  // namespace frugal::compat
