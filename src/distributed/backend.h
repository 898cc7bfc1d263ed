// What the process group's backends share: c10d's base class (Backend on LibTorch 2.x,
// ProcessGroup on 1.13), and the NCCL backend's maker, in a file of its own.
#pragma once

#include <torch/version.h>

#include <chrono>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "compat.h"

#if FRUGAL_TORCH_AT_LEAST(2, 0)
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

namespace frugal::distributed::detail {

#if FRUGAL_TORCH_AT_LEAST(2, 0)
using BackendBase = c10d::Backend;
#else
using BackendBase = c10d::ProcessGroup;
#endif

/// NCCL's process group on CUDA device `device` (made current); only in builds with NCCL.
c10::intrusive_ptr<BackendBase> make_nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                          int size, int device, std::chrono::milliseconds timeout);

}  // namespace frugal::distributed::detail
