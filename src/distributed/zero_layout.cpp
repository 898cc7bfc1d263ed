#include "zero_layout.h"

#include <c10/core/InferenceMode.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/accumulate.h>
#include <torch/torch.h>

#include <algorithm>

#include "compat.h"
#include "frugal/error.h"
#include "memory/storage_bytes.h"

namespace frugal::distributed::detail {
namespace {

// A unit's flat buffer gives its bytes back and takes new ones later as the same storage
// (frugal::detail::drop_bytes, take_bytes): the views autograd saved in forward (a Linear
// keeps its weight transposed) then see the bytes gathered again for backward, and hold
// none in between.
using frugal::detail::drop_bytes;
using frugal::detail::take_bytes;

c10::Stream current_stream(const c10::Device& device) {
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

}  // namespace

ZeroLayout::ZeroLayout(std::vector<torch::Tensor> params_in,
                       const std::vector<std::vector<std::size_t>>& unit_members,
                       std::int64_t ranks)
    : params(std::move(params_in)), unit_of(params.size(), 0), offsets(params.size(), 0) {
  for (std::size_t i = 0; i < params.size(); ++i) {
    FRUGAL_CHECK(index.emplace(params[i].unsafeGetTensorImpl(), i).second,
                 "frugal: ZeroOptimizer got a parameter twice");
    numels.push_back(params[i].numel());
    shapes.push_back(params[i].sizes().vec());
  }
  units.resize(1 + unit_members.size());
  for (std::size_t u = 0; u < unit_members.size(); ++u) {
    for (const auto i : unit_members[u]) {
      unit_of[i] = u + 1;
    }
  }
  for (std::size_t i = 0; i < params.size(); ++i) {
    auto& unit = units[unit_of[i]];
    unit.members.push_back(i);
    offsets[i] = unit.total;
    unit.total += numels[i];
    total += numels[i];
  }
  std::int64_t offset = 0;
  for (auto& unit : units) {
    unit.range = (unit.total + ranks - 1) / ranks;
    unit.shard_offset = offset;
    offset += unit.range;
  }
}

std::int64_t ZeroLayout::shard_size() const {
  return units.back().shard_offset + units.back().range;
}

bool ZeroLayout::all_whole() const {
  for (std::size_t u = 0; u < units.size(); ++u) {
    if (!whole(u)) {
      return false;
    }
  }
  return true;
}

void ZeroLayout::view_flat(std::size_t u) {
  const auto& unit = units[u];
  for (const auto i : unit.members) {
    params[i].set_data(unit.flat.narrow(0, offsets[i], numels[i]).view(shapes[i]));
    compat::refresh_grad_accumulator(params[i]);
  }
}

torch::Tensor ZeroLayout::share(std::size_t u) const {
  return shard.detach().narrow(0, units[u].shard_offset, units[u].range);
}

void ZeroLayout::start_gather(std::size_t u) {
  torch::NoGradGuard no_grad;
  c10::InferenceMode training_tensors(false);  // an evaluation's gather feeds later training
  auto& unit = units[u];
  const std::int64_t n = group->size();
  take_bytes(unit.flat);
  unit.stream = current_stream(unit.flat.device());
  // This rank's share goes into its own place first (rounded to the flat buffer's dtype,
  // FSDP's param_dtype, if it has another) and is sent from there: no copy of it is made.
  const auto mine = unit.flat.narrow(0, group->rank() * unit.range, unit.range);
  if (coded.empty()) {
    mine.copy_(share(u));
  } else {
    optim::detail::dequantize_into(*coded[u], mine);
  }
  if (n == 1) {
    return;
  }
  // Straight into the flat buffer. On a GPU in one all-gather: the buffer is its output as
  // it is (NCCL writes each rank's range in place, with no buffer of its own to bound). Else
  // a piece of every rank's share at a time, the list form's buffer at most gather_bytes.
  const std::int64_t piece = std::max<std::int64_t>(
      1, std::min(unit.range, gather_bytes / (n * static_cast<std::int64_t>(mine.element_size()))));
  if (piece == unit.range || unit.flat.is_cuda()) {
    unit.arriving.push_back(group->all_gather_flat_async(unit.flat, mine));
    return;
  }
  for (std::int64_t start = 0; start < unit.range; start += piece) {
    const auto length = std::min(piece, unit.range - start);
    std::vector<torch::Tensor> pieces;
    for (std::int64_t r = 0; r < n; ++r) {
      pieces.push_back(unit.flat.narrow(0, r * unit.range + start, length));
    }
    unit.arriving.push_back(group->all_gather_async(pieces, mine.narrow(0, start, length)));
  }
}

void ZeroLayout::gather(std::size_t u) {
  auto& unit = units[u];
  if (unit.viewed) {
    return;
  }
  if (!held(u)) {
    start_gather(u);
  }
  for (auto& work : unit.arriving) {
    work.wait();
  }
  unit.arriving.clear();
  view_flat(u);
  unit.viewed = true;
  if (prefetched == u) {
    prefetched = kNone;
  }
}

void ZeroLayout::prefetch_unit(std::size_t u) {
  if (!prefetch || u == kNone || prefetched != kNone || held(u)) {
    return;
  }
  start_gather(u);
  prefetched = u;
}

void ZeroLayout::forward_reached(std::size_t u) {
  gather(u);
  if (std::find(trace.begin(), trace.end(), u) == trace.end()) {
    trace.push_back(u);
  }
  const auto at = std::find(order.begin(), order.end(), u);
  if (at != order.end() && at + 1 != order.end()) {
    prefetch_unit(*(at + 1));
  }
}

void ZeroLayout::backward_reached(std::size_t u) {
  gather(u);
  const auto at = std::find(order.begin(), order.end(), u);
  if (at != order.end() && at != order.begin()) {
    prefetch_unit(*(at - 1));
  }
}

void ZeroLayout::begin_pass() {
  if (!trace.empty()) {
    order = std::move(trace);
    trace.clear();
  }
}

void ZeroLayout::release(std::size_t u) {
  auto& unit = units[u];
  if (!held(u)) {
    return;
  }
  for (auto& work : unit.arriving) {
    work.wait();  // the backend still writes into the buffer
  }
  unit.arriving.clear();
  // Freed on the stream that waited for the gathers and whose allocation it was: from
  // LibTorch 2.8 on, NCCL keeps a buffer alive only until wait(), so a free on another
  // stream could hand the bytes out while a kernel still reads them.
  FRUGAL_CHECK(!unit.stream || *unit.stream == current_stream(unit.flat.device()),
               "frugal: ZeroOptimizer releases a unit on stream ",
               current_stream(unit.flat.device()), ", not on stream ", *unit.stream,
               " that gathered it; run the forward and backward on the stream current when "
               "their units were gathered");
  unit.stream.reset();
  if (unit.viewed) {
    torch::NoGradGuard no_grad;
    for (const auto i : unit.members) {
      // The parameters keep their dtype: a new one would drop their gradient hooks.
      params[i].set_data(torch::empty({0}, unit.flat.options().requires_grad(false)));
      compat::refresh_grad_accumulator(params[i]);
    }
  }
  drop_bytes(unit.flat);
  unit.viewed = false;
  unit.counting = false;
  if (prefetched == u) {
    prefetched = kNone;
  }
}

void ZeroLayout::all_gather(std::size_t u, bool own_too) {
  const std::int64_t n = group->size();
  const auto& unit = units[u];
  const auto range = unit.range;
  const auto mine = share(u);
  if (n == 1) {
    if (own_too) {
      unit.flat.copy_(mine);
    }
    return;
  }
  // A piece of every rank's share at a time, so the message buffer stays small.
  const std::int64_t piece = std::max<std::int64_t>(
      1, std::min(range, gather_bytes / (n * static_cast<std::int64_t>(shard.element_size()))));
  for (std::int64_t start = 0; start < range; start += piece) {
    const auto length = std::min(piece, range - start);
    // Into one tensor (NCCL writes it in place; the list form would gather into a buffer of
    // its own and copy out of it), then each rank's piece to its place.
    auto gathered = torch::empty({n * length}, mine.options());
    group->all_gather_flat_async(gathered, mine.narrow(0, start, length)).wait();
    for (std::int64_t r = 0; r < n; ++r) {
      if (own_too || r != group->rank()) {
        unit.flat.narrow(0, r * range + start, length)
            .copy_(gathered.narrow(0, r * length, length));
      }
    }
  }
}

}  // namespace frugal::distributed::detail
