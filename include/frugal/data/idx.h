// The IDX format of (Fashion-)MNIST, plain or gzipped.
#pragma once

#include <torch/types.h>

#include <string>

#include "frugal/train/batch.h"

namespace frugal::data {

/// Reads an IDX file of unsigned bytes (gzipped or not) into a uint8 tensor of its shape.
/// A missing, truncated, corrupt or malformed file, data beyond what the header declares, or
/// a path that is not a regular file throws an error naming the path and the fault. Memory
/// follows the bytes actually read, never the header's claim alone.
torch::Tensor read_idx(const std::string& path);

enum class Split { Train, Test };

/// How images are held: floats scaled to [0, 1], or the file's bytes (a quarter of the
/// memory), made floats a batch at a time by to_unit_floats.
enum class Pixels { Floats, Bytes };

/// Fashion-MNIST (or MNIST) from `dir`: `train-images-idx3-ubyte.gz` and friends.
/// Inputs are images (N, 1, 28, 28), float in [0, 1] or uint8 as `pixels` says; targets
/// int64 labels. Checked at load time, naming the file: images (N, 28, 28) with N > 0, as
/// many labels, each 0-9.
///
/// Example:
///   auto train = frugal::data::load_mnist_dir("/usr/share/datasets/fashion-mnist",
///                                             frugal::data::Split::Train);
Batch load_mnist_dir(const std::string& dir, Split split, Pixels pixels = Pixels::Floats);

/// Images of bytes as floats in [0, 1] (x / 255, the values Pixels::Floats holds); float
/// images as they are.
torch::Tensor to_unit_floats(const torch::Tensor& images);

}  // namespace frugal::data
