#include "nn/nf4.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "frugal/error.h"

namespace frugal::nn::detail {
namespace {

// bitsandbytes' lookup table: [-1, 1] cut into 65536 points, each the index of the map
// value nearest to it (ties to the lower one); an element goes to the point nearest to it.
constexpr int kLutSize = 65536;

std::vector<std::uint8_t> build_lut(const torch::Tensor& map) {
  const auto* code = map.data_ptr<float>();
  const auto n = map.numel();
  std::vector<float> mid(static_cast<std::size_t>(n - 1));
  for (std::int64_t i = 0; i + 1 < n; ++i) {
    mid[static_cast<std::size_t>(i)] = 0.5F * (code[i] + code[i + 1]);
  }
  std::vector<std::uint8_t> lut(kLutSize);
  std::int64_t at = 0;
  for (int i = 0; i < kLutSize; ++i) {
    const float val = -1.0F + (2.0F * static_cast<float>(i)) / static_cast<float>(kLutSize - 1);
    while (at < n - 1 && mid[static_cast<std::size_t>(at)] < val) {
      ++at;
    }
    lut[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(at);
  }
  return lut;
}

std::uint16_t lut_index(float val) {
  val = std::clamp(val, -1.0F, 1.0F);
  const float scaled = (val + 1.0F) * 0.5F * static_cast<float>(kLutSize - 1);
  return static_cast<std::uint16_t>(scaled + 0.5F);
}

}  // namespace

namespace {

// A fixed table's copy on each device it is used on, made once (the CPU's is the table
// itself): decoding on a GPU then copies nothing from the host. Kept for the process's life.
const torch::Tensor& on_device(const torch::Tensor& table, const torch::Device& device) {
  if (device.is_cpu()) {
    return table;
  }
  static std::mutex mutex;
  static auto* copies = new std::map<std::pair<const void*, std::string>, torch::Tensor>();
  std::lock_guard<std::mutex> lock(mutex);
  const auto key =
      std::make_pair(static_cast<const void*>(table.unsafeGetTensorImpl()), device.str());
  auto it = copies->find(key);
  if (it == copies->end()) {
    it = copies->emplace(key, table.to(device)).first;
  }
  return it->second;
}

// The two NF4 values of each packed byte: [256, 2], the high half first.
const torch::Tensor& nf4_pairs() {
  static const torch::Tensor pairs = [] {
    const auto byte = torch::arange(256, torch::kLong);
    return torch::stack({nf4_values().index_select(0, byte.bitwise_right_shift(4)),
                         nf4_values().index_select(0, byte.bitwise_and(15))},
                        1)
        .contiguous();
  }();
  return pairs;
}

}  // namespace

std::int64_t Nf4Tensor::bytes() const {
  return packed.numel() + qabsmax.numel() + absmax2.numel() * 4 + offset.numel() * 4;
}

const torch::Tensor& nf4_values() {
  static const torch::Tensor values = torch::tensor(
      {-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
       0.7229568362236023, 1.0},
      torch::kFloat);
  return values;
}

const torch::Tensor& dynamic_map() {
  static const torch::Tensor map = [] {
    // Signed, 7 exponent bits: for each exponent i, 2^i means of a linspace over [0.1, 1]
    // scaled by 10^(i - 6), both signs; then 0 and 1.
    std::vector<torch::Tensor> parts;
    for (int i = 0; i < 7; ++i) {
      const auto bounds = torch::linspace(0.1, 1, (1 << i) + 1, torch::kFloat);
      const auto means = (bounds.slice(0, 0, -1) + bounds.slice(0, 1)) / 2.0;
      const double scale = std::pow(10.0, i - 6);
      parts.push_back(means * scale);
      parts.push_back(means * -scale);
    }
    parts.push_back(torch::tensor({0.0F, 1.0F}));
    return std::get<0>(torch::cat(parts).sort());
  }();
  return map;
}

std::pair<torch::Tensor, torch::Tensor> quantize_blockwise_lut(const torch::Tensor& x,
                                                               std::int64_t block) {
  static const auto lut = build_lut(dynamic_map());  // the map is fixed: built once
  const auto flat = x.to(torch::kFloat).contiguous().reshape(-1);
  const auto n = flat.numel();
  const auto blocks = (n + block - 1) / block;
  auto codes = torch::empty({n}, torch::kUInt8);
  auto absmax = torch::empty({blocks}, torch::kFloat);
  const auto* in = flat.data_ptr<float>();
  auto* out = codes.data_ptr<std::uint8_t>();
  auto* am = absmax.data_ptr<float>();
  for (std::int64_t b = 0; b < blocks; ++b) {
    const auto begin = b * block;
    const auto end = std::min(begin + block, n);
    float m = 0;
    for (auto i = begin; i < end; ++i) {
      m = std::max(m, std::fabs(in[i]));
    }
    am[b] = m;
    const float inv = m == 0 ? 0.0F : 1.0F / m;
    for (auto i = begin; i < end; ++i) {
      out[i] = m == 0 ? 0 : lut[lut_index(in[i] * inv)];
    }
  }
  return {codes, absmax};
}

Nf4Tensor nf4_quantize(const torch::Tensor& w) {
  torch::NoGradGuard no_grad;
  Nf4Tensor q;
  q.shape = w.sizes().vec();
  const auto flat = w.detach().to(torch::kCPU, torch::kFloat).reshape(-1);
  const auto n = flat.numel();
  const auto full = n - n % kNf4Block;
  // As bitsandbytes' quantize_4bit: scaled by the reciprocal of each block's absmax, a tail
  // block divided by its own; nearest NF4 value, ties to the lower.
  const auto body = flat.slice(0, 0, full).reshape({-1, kNf4Block});
  auto absmax = std::get<0>(body.abs().max(1));
  auto scaled =
      (body * absmax.clamp_min(1e-38).reciprocal().view({-1, 1})).clamp(-1, 1).reshape(-1);
  if (full < n) {
    const auto tail = flat.slice(0, full);
    const auto am = tail.abs().max().clamp_min(1e-38);
    absmax = torch::cat({absmax, am.view({1})});
    scaled = torch::cat({scaled, (tail / am).clamp(-1, 1)});
  }
  if (scaled.numel() % 2 != 0) {
    scaled = torch::cat({scaled, torch::zeros({1})});  // the pad is coded as 0.0 is
  }
  const auto& values = nf4_values();
  const auto bounds = (values.slice(0, 0, -1) + values.slice(0, 1)) / 2;
  const auto codes = torch::bucketize(scaled, bounds, /*out_int32=*/true).to(torch::kUInt8);
  q.packed = codes.slice(0, 0, c10::nullopt, 2)
                 .bitwise_left_shift(4)
                 .bitwise_or(codes.slice(0, 1, c10::nullopt, 2));
  // Double quantization of the absmaxes: less their mean, in 8 bits by blocks of 256.
  q.offset = absmax.mean().view({1});
  std::tie(q.qabsmax, q.absmax2) = quantize_blockwise_lut(absmax - q.offset, kNf4StatsBlock);
  return q;
}

void check_nf4(const Nf4Tensor& q) {
  std::int64_t n = 1;
  for (const auto d : q.shape) {
    n *= d;
  }
  const auto blocks = (n + kNf4Block - 1) / kNf4Block;
  const auto device = q.packed.defined() ? q.packed.device() : torch::Device(torch::kCPU);
  auto need = [&](const torch::Tensor& t, const char* buffer, torch::Dtype dtype,
                  std::int64_t numel) {
    if (t.defined() && t.scalar_type() == dtype && t.numel() == numel && t.is_contiguous() &&
        t.device() == device) {
      return;
    }
    throw Error(c10::str("frugal: the NF4 weights '", q.name, "' (shape ",
                         c10::IntArrayRef(q.shape), ") cannot use their buffer '", q.name, buffer,
                         "': it is ",
                         t.defined() ? c10::str(t.scalar_type(), " ", t.sizes(), " on ", t.device(),
                                                t.is_contiguous() ? "" : " (not contiguous)")
                                     : std::string("undefined"),
                         " where they need ", dtype, " [", numel, "] on ", device,
                         "; were they loaded from a model saved with other shapes?"));
  };
  need(q.packed, "_nf4", torch::kUInt8, (n + 1) / 2);
  need(q.qabsmax, "_nf4_absmax", torch::kUInt8, blocks);
  need(q.absmax2, "_nf4_absmax2", torch::kFloat, (blocks + kNf4StatsBlock - 1) / kNf4StatsBlock);
  need(q.offset, "_nf4_offset", torch::kFloat, 1);
}

torch::Tensor nf4_absmax(const Nf4Tensor& q) {
  const auto n = q.qabsmax.numel();
  auto values =
      on_device(dynamic_map(), q.qabsmax.device()).index_select(0, q.qabsmax.to(torch::kInt));
  const auto full = n - n % kNf4StatsBlock;
  auto scaled = (values.slice(0, 0, full).reshape({-1, kNf4StatsBlock}) *
                 q.absmax2.slice(0, 0, full / kNf4StatsBlock).view({-1, 1}))
                    .reshape(-1);
  if (full < n) {
    scaled = torch::cat({scaled, values.slice(0, full) * q.absmax2[full / kNf4StatsBlock]});
  }
  return scaled + q.offset.to(scaled.device());
}

namespace {

// Element by element on the CPU, into `out` of dtype T: no temporaries of the tensor's size.
template <typename T>
void dequantize_cpu(const Nf4Tensor& q, const torch::Tensor& absmax, torch::Tensor& out) {
  const auto* packed = q.packed.data_ptr<std::uint8_t>();
  const auto* values = nf4_values().data_ptr<float>();
  const auto* am = absmax.data_ptr<float>();
  auto* o = out.data_ptr<T>();
  const auto n = out.numel();
  at::parallel_for(0, (n + kNf4Block - 1) / kNf4Block, 16,
                   [&](std::int64_t begin, std::int64_t end) {
                     for (auto b = begin; b < end; ++b) {
                       const float scale = am[b];
                       const auto stop = std::min(n, (b + 1) * kNf4Block);
                       for (auto i = b * kNf4Block; i < stop; ++i) {
                         const auto byte = packed[i / 2];
                         const auto code = (i % 2 == 0) ? (byte >> 4) : (byte & 15);
                         o[i] = static_cast<T>(values[code] * scale);
                       }
                     }
                   });
}

}  // namespace

torch::Tensor nf4_dequantize(const Nf4Tensor& q, torch::Dtype dtype) {
  check_nf4(q);
  torch::NoGradGuard no_grad;
  auto out = torch::empty(q.shape, q.packed.options().dtype(dtype));
  const auto absmax = nf4_absmax(q).contiguous();
  if (q.packed.device().is_cpu() && (dtype == torch::kFloat || dtype == torch::kBFloat16)) {
    if (dtype == torch::kFloat) {
      dequantize_cpu<float>(q, absmax, out);
    } else {
      dequantize_cpu<c10::BFloat16>(q, absmax, out);
    }
    return out;
  }
  // Elsewhere (a GPU; other dtypes) in tensor operations: each packed byte looks up its two
  // values, scaled by its block's absmax into `out`, a stretch at a time so that the
  // temporaries (a 4-byte index a byte, a float a value: 6 bytes an element) stay within the
  // output's own size, and 24 MiB; a stretch is whole bytes of whole blocks.
  const auto n = out.numel();
  const auto& pairs = on_device(nf4_pairs(), q.packed.device());
  const auto packed = q.packed.view(-1);
  auto flat = out.view(-1);
  constexpr std::int64_t kStretch = 2 * kNf4Block;
  const auto fits = std::min<std::int64_t>(n * out.element_size() / 6, std::int64_t{1} << 22);
  const auto chunk = std::max(kStretch, fits / kStretch * kStretch);
  for (std::int64_t start = 0; start < n; start += chunk) {
    const auto length = std::min(chunk, n - start);
    // The values (float32, scaled in place), then one cast into the output: no operation
    // mixes dtypes, so no backend makes a temporary for it.
    auto values =
        pairs.index_select(0, packed.narrow(0, start / 2, (length + 1) / 2).to(torch::kInt))
            .view(-1)
            .narrow(0, 0, length);
    const auto full = length / kNf4Block * kNf4Block;
    if (full > 0) {
      values.narrow(0, 0, full)
          .view({-1, kNf4Block})
          .mul_(absmax.narrow(0, start / kNf4Block, full / kNf4Block).view({-1, 1}));
    }
    if (full < length) {
      values.narrow(0, full, length - full).mul_(absmax[(start + full) / kNf4Block]);
    }
    flat.narrow(0, start, length).copy_(values);
  }
  return out;
}

}  // namespace frugal::nn::detail
