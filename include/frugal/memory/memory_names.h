// Names for the memory no module or optimizer holds (a data set, a cache), so that a memory
// recording says whose bytes they are.
#pragma once

#include <torch/types.h>

#include <string>

namespace frugal {

/// Names the block that holds `tensor`'s storage: a MemoryRecorder's peak, its page and its
/// events then count the block's bytes under `name` (as part `other`) instead of as bytes
/// alive before the recording, or as activations. The name lives as long as the storage
/// (it is forgotten when the storage is freed) and holds no reference to it; naming a
/// storage again renames it. A recording picks names up when it starts and at each phase
/// boundary. At most 4 names draw their own area on the timeline page; more are counted in
/// `other` there, and named in the peak.
///
/// Example:
///   frugal::name_memory(train_images, "data set");
///   frugal::name_memory(train_labels, "data set");
void name_memory(const torch::Tensor& tensor, const std::string& name);

}  // namespace frugal
