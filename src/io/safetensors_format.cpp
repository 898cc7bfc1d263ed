#include "io/safetensors_format.h"

#include <utility>

#include "compat.h"
#include "frugal/error.h"

namespace frugal::io::detail {
namespace {

struct Entry {
  const char* name;
  std::int64_t bytes;
  std::optional<c10::ScalarType> type;
};

// The format's dtypes (those of the safetensors package), and LibTorch's type where it has one.
const Entry kEntries[] = {
    {"BOOL", 1, c10::ScalarType::Bool},
    {"U8", 1, c10::ScalarType::Byte},
    {"I8", 1, c10::ScalarType::Char},
    {"I16", 2, c10::ScalarType::Short},
    {"I32", 4, c10::ScalarType::Int},
    {"I64", 8, c10::ScalarType::Long},
    {"F16", 2, c10::ScalarType::Half},
    {"BF16", 2, c10::ScalarType::BFloat16},
    {"F32", 4, c10::ScalarType::Float},
    {"F64", 8, c10::ScalarType::Double},
    {"F8_E4M3", 1, compat::float8_e4m3()},
    {"F8_E5M2", 1, compat::float8_e5m2()},
    {"U16", 2, std::nullopt},
    {"U32", 4, std::nullopt},
    {"U64", 8, std::nullopt},
};

const Entry* find(const std::string& name) {
  for (const auto& e : kEntries) {
    if (name == e.name) {
      return &e;
    }
  }
  return nullptr;
}

}  // namespace

std::int64_t dtype_bytes(const std::string& name) {
  const auto* e = find(name);
  return e == nullptr ? 0 : e->bytes;
}

std::optional<c10::ScalarType> scalar_type(const std::string& name) {
  const auto* e = find(name);
  return e == nullptr ? std::nullopt : e->type;
}

std::string dtype_name(c10::ScalarType type) {
  for (const auto& e : kEntries) {
    if (e.type == type) {
      return e.name;
    }
  }
  throw Error(c10::str("frugal: safetensors has no dtype for ", type));
}

}  // namespace frugal::io::detail
