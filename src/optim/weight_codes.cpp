#include "weight_codes.h"

#include <torch/torch.h>

#include <algorithm>
#include <limits>
#include <mutex>
#include <unordered_map>

#include "frugal/error.h"
#include "rounding.h"

namespace frugal::optim::detail {
namespace {

struct Registry {
  std::mutex mutex;
  std::unordered_map<const void*, std::shared_ptr<StoredWeights>> map;
};

Registry& registry() {
  // Never destroyed: optimizers may outlive static teardown.
  static auto* r = new Registry();
  return *r;
}

// The float32 bits of `t` (float32, contiguous) rounded to bfloat16 values: toward minus
// infinity (`up` false), or a positive t toward plus infinity, in place, through `carry`
// (an int32 buffer of t's elements).
void round_to_bfloat16(const at::Tensor& t, const at::Tensor& carry, bool up) {
  auto b = t.view(at::kInt);
  if (up) {
    carry.fill_(0xFFFF);
  } else {  // a negative value's magnitude rounds up: its int32 view is negative
    carry.copy_(b).__irshift__(31).bitwise_and_(0xFFFF);
  }
  b.add_(carry).bitwise_and_(static_cast<std::int64_t>(static_cast<std::int32_t>(0xFFFF0000U)));
}

// quantize_weights_ops over `x` holding whole groups of `group` elements (or one shorter).
void quantize_groups(const at::Tensor& x, std::int64_t group, bool stochastic,
                     const at::Tensor& noise, const at::Tensor& stats, const at::Tensor& codes,
                     const at::Tensor& qparams) {
  const auto n = x.numel();
  const auto groups = weight_groups(n, group);
  const auto rows = x.view({groups, group});
  auto zero = stats.narrow(0, 0, groups);
  auto scale = stats.narrow(0, groups, groups);
  const auto carry = stats.narrow(0, 2 * groups, groups).view(at::kInt);
  at::amin_out(zero, rows, {1});
  zero.add_(0.0);  // a least -0 as +0, as the CPU kernel takes it
  at::amax_out(scale, rows, {1});
  round_to_bfloat16(zero, carry, false);
  scale.sub_(zero)
      .mul_(static_cast<double>(kInverse255))
      .clamp_min_(std::numeric_limits<float>::min());
  round_to_bfloat16(scale, carry, true);
  rows.sub_(zero.unsqueeze(1)).div_(scale.unsqueeze(1));
  if (stochastic) {
    x.add_(noise.narrow(0, 0, n)).floor_();
  } else {
    x.round_();
  }
  x.nan_to_num_(0.0, 255.0, 0.0).clamp_(0.0, 255.0);
  codes.copy_(x);
  qparams.select(1, 0).copy_(zero);
  qparams.select(1, 1).copy_(scale);
}

}  // namespace

void add_stored_weights(const at::Tensor& param, std::shared_ptr<StoredWeights> stored) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto* impl : {static_cast<const void*>(param.unsafeGetTensorImpl()),
                           static_cast<const void*>(stored->whole.unsafeGetTensorImpl())}) {
    FRUGAL_CHECK(r.map.count(impl) == 0, "frugal: a parameter of shape ", stored->whole.sizes(),
                 " is stored in 8 bits already (by another Int8Weights)");
  }
  r.map.emplace(param.unsafeGetTensorImpl(), stored);
  r.map.emplace(stored->whole.unsafeGetTensorImpl(), std::move(stored));
}

void remove_stored_weights(const at::Tensor& param, const StoredWeights& stored) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.map.erase(param.unsafeGetTensorImpl());
  r.map.erase(stored.whole.unsafeGetTensorImpl());
}

std::shared_ptr<StoredWeights> stored_weights(const at::Tensor& t) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.map.empty() || !t.defined()) {
    return nullptr;
  }
  const auto found = r.map.find(t.unsafeGetTensorImpl());
  return found == r.map.end() ? nullptr : found->second;
}

bool holds_stored_weights(const at::Tensor& buffer) {
  if (!buffer.defined() || !buffer.has_storage()) {
    return false;
  }
  const auto* storage = buffer.storage().unsafeGetStorageImpl();
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& [impl, stored] : r.map) {
    if (stored->codes.storage().unsafeGetStorageImpl() == storage ||
        stored->qparams.storage().unsafeGetStorageImpl() == storage) {
      return true;
    }
  }
  return false;
}

void check_codes(const StoredWeights& stored, std::int64_t numel) {
  const auto& c = stored.codes;
  const auto& q = stored.qparams;
  const auto groups = weight_groups(numel, stored.group);
  auto refuse = [&](const char* buffer, const at::Tensor& t, const std::string& need) {
    throw Error(c10::str("frugal: the 8-bit weights '", stored.name, "' (", numel,
                         " elements in groups of ", stored.group, ") cannot use their buffer '",
                         stored.name, buffer, "': it is ",
                         t.defined() ? c10::str(t.scalar_type(), " ", t.sizes(),
                                                t.is_contiguous() ? "" : " (not contiguous)")
                                     : std::string("undefined"),
                         " where they need ", need,
                         "; were they loaded from a model saved with other groups or shapes?"));
  };
  if (!c.defined() || c.scalar_type() != at::kByte || c.numel() != numel || !c.is_contiguous()) {
    refuse("_codes", c, c10::str("Byte [", numel, "], contiguous"));
  }
  if (!q.defined() || q.scalar_type() != at::kBFloat16 || q.dim() != 2 || q.size(0) != groups ||
      q.size(1) != 2 || !q.is_contiguous() || q.device() != c.device()) {
    refuse("_qparams", q, c10::str("BFloat16 [", groups, ", 2], contiguous, on ", c.device()));
  }
}

void dequantize_weights_ops(const at::Tensor& codes, const at::Tensor& qparams, std::int64_t group,
                            const at::Tensor& out) {
  const auto n = out.numel();
  const auto full = n / group * group;
  const auto decode = [&](std::int64_t begin, std::int64_t count, std::int64_t width) {
    if (count == 0) {
      return;
    }
    const auto rows = count / width;
    auto o = out.view(-1).narrow(0, begin, count).view({rows, width});
    const auto q = qparams.narrow(0, begin / group, rows);
    o.copy_(codes.view(-1).narrow(0, begin, count).view({rows, width}));
    o.mul_(q.select(1, 1).unsqueeze(1)).add_(q.select(1, 0).unsqueeze(1));
  };
  decode(0, full, group);
  decode(full, n - full, n - full);
}

void quantize_weights_ops(const at::Tensor& x, std::int64_t group, std::int64_t begin,
                          bool stochastic, std::uint64_t key, const at::Tensor& codes,
                          const at::Tensor& qparams, const at::Tensor& noise,
                          const at::Tensor& stats) {
  const auto n = x.numel();
  FRUGAL_CHECK(begin % group == 0, "frugal: 8-bit weights are requantized from element ", begin,
               ", not the start of a group of ", group);
  const auto flat = x.view(-1);
  if (stochastic) {
    uniform16(noise.narrow(0, 0, n), key, begin);
  }
  const auto full = n / group * group;
  const auto part = [&](std::int64_t at, std::int64_t count, std::int64_t width) {
    if (count == 0) {
      return;
    }
    // A pass's groups keep three statistics each in `stats` (as long as the range): groups
    // of one or two elements take several passes.
    const auto per_pass = std::max<std::int64_t>(1, stats.numel() / 3) * width;
    for (std::int64_t done = 0; done < count; done += per_pass) {
      const auto length = std::min(per_pass, count - done);
      const auto from = at + done;
      // Without stochastic rounding there is no noise: an undefined tensor cannot be narrowed.
      const auto part_noise = stochastic ? noise.narrow(0, from, length) : at::Tensor();
      quantize_groups(flat.narrow(0, from, length), width, stochastic, part_noise, stats,
                      codes.view(-1).narrow(0, begin + from, length),
                      qparams.narrow(0, (begin + from) / group, weight_groups(length, width)));
    }
  };
  part(0, full, group);
  part(full, n - full, n - full);
}

void decode_range(const StoredWeights& stored, std::int64_t offset, std::int64_t length,
                  const at::Tensor& out) {
  check_codes(stored, stored.whole.numel());
  FRUGAL_CHECK(offset >= 0 && length == out.numel() && offset + length <= stored.whole.numel(),
               "frugal: elements [", offset, ", ", offset + length, ") of the 8-bit weights '",
               stored.name, "' are not among their ", stored.whole.numel());
  if (out.device().is_cpu()) {
    dequantize_weights_cpu(
        stored.codes.data_ptr<std::uint8_t>(),
        reinterpret_cast<const std::uint16_t*>(stored.qparams.data_ptr<at::BFloat16>()),
        stored.group, offset, length, out.data_ptr<float>());
    return;
  }
  dequantize_weights_ops(
      stored.codes.narrow(0, offset, length),
      stored.qparams.narrow(0, offset / stored.group, weight_groups(length, stored.group)),
      stored.group, out);
}

void encode_range(StoredWeights& stored, const at::Tensor& w, std::int64_t offset, bool stochastic,
                  std::uint64_t key, const at::Tensor& noise, const at::Tensor& stats) {
  check_codes(stored, stored.whole.numel());
  FRUGAL_CHECK(offset >= 0 && offset + w.numel() <= stored.whole.numel(), "frugal: elements [",
               offset, ", ", offset + w.numel(), ") of the 8-bit weights '", stored.name,
               "' are not among their ", stored.whole.numel());
  if (w.device().is_cpu()) {
    quantize_weights_cpu(w.data_ptr<float>(), stored.group, offset, w.numel(), stochastic, key,
                         stored.codes.data_ptr<std::uint8_t>(),
                         reinterpret_cast<std::uint16_t*>(stored.qparams.data_ptr<at::BFloat16>()));
  } else {
    quantize_weights_ops(w, stored.group, offset, stochastic, key, stored.codes, stored.qparams,
                         noise, stats);
  }
  stored.written = true;
}

}  // namespace frugal::optim::detail
