// Reading and writing values in LibTorch archives, with errors that name the key.
#pragma once

#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <cstdint>
#include <string>
#include "frugal/error.h"

namespace frugal::state {

inline void write_int(torch::serialize::OutputArchive& archive, const std::string& key,
                      std::int64_t value) {
  archive.write(key, c10::IValue(value));
}

inline void write_double(torch::serialize::OutputArchive& archive, const std::string& key,
                         double value) {
  archive.write(key, c10::IValue(value));
}

/// The value under `key`; throws naming the key when it is missing or of another kind.
inline c10::IValue read_value(torch::serialize::InputArchive& archive, const std::string& key) {
  c10::IValue value;
  FRUGAL_CHECK(archive.try_read(key, value), "frugal: the saved state has no '", key, "'");
  return value;
}

inline std::int64_t read_int(torch::serialize::InputArchive& archive, const std::string& key) {
  const auto value = read_value(archive, key);
  FRUGAL_CHECK(value.isInt(), "frugal: the saved '", key, "' is a ", value.tagKind(),
               ", not an integer");
  return value.toInt();
}

inline double read_double(torch::serialize::InputArchive& archive, const std::string& key) {
  const auto value = read_value(archive, key);
  FRUGAL_CHECK(value.isDouble(), "frugal: the saved '", key, "' is a ", value.tagKind(),
               ", not a number");
  return value.toDouble();
}

inline std::string read_string(torch::serialize::InputArchive& archive, const std::string& key) {
  const auto value = read_value(archive, key);
  FRUGAL_CHECK(value.isString(), "frugal: the saved '", key, "' is a ", value.tagKind(),
               ", not a string");
  return value.toStringRef();
}

inline torch::Tensor read_tensor(torch::serialize::InputArchive& archive, const std::string& key) {
  torch::Tensor tensor;
  FRUGAL_CHECK(archive.try_read(key, tensor), "frugal: the saved state has no tensor '", key, "'");
  return tensor;
}

inline torch::serialize::InputArchive read_archive(torch::serialize::InputArchive& archive,
                                                   const std::string& key) {
  torch::serialize::InputArchive nested;
  FRUGAL_CHECK(archive.try_read(key, nested), "frugal: the saved state has no '", key, "'");
  return nested;
}

}  // namespace frugal::state
