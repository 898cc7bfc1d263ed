#include "frugal/optim/blockwise.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "codebook.h"
#include "frugal/error.h"
#include "rounding.h"

namespace frugal::optim {
namespace {

// Calls fn(offset, rows, columns) for the whole blocks of n elements (as one rows x block
// matrix) and then for the shorter last block, if any.
template <typename Fn>
void for_block_rows(std::int64_t n, std::int64_t block, Fn fn) {
  const std::int64_t full = n / block;
  if (full > 0) {
    fn(0, full, block);
  }
  if (n % block != 0) {
    fn(full * block, 1, n % block);
  }
}

torch::Tensor rows(const torch::Tensor& flat, std::int64_t offset, std::int64_t rows,
                   std::int64_t columns) {
  return flat.narrow(0, offset, rows * columns).view({rows, columns});
}

void check_block(std::int64_t block) {
  FRUGAL_CHECK(block >= 1, "frugal: the quantization block must be >= 1 element, got ", block);
}

// The bits of a code of `map`: 8 for 256 values, 4 for 16.
int map_bits(const torch::Tensor& map) {
  FRUGAL_CHECK(map.dim() == 1 && (map.numel() == 256 || map.numel() == 16),
               "frugal: a quantization map has 256 values (8-bit codes) or 16 (4-bit), got shape ",
               map.sizes());
  return map.numel() == 256 ? 8 : 4;
}

// The even and odd elements of `x` (n elements): those in the low and high halves of a
// byte of 4-bit codes.
torch::Tensor evens(const torch::Tensor& x, std::int64_t n) { return x.slice(0, 0, n, 2); }
torch::Tensor odds(const torch::Tensor& x, std::int64_t n) { return x.slice(0, 1, n, 2); }

// The codes of `w` (values in the book's range; overwritten) into `idx`, rounded
// stochastically as the fused step's round_codes_stochastically rounds them.
void round_stochastically(torch::Tensor& w, torch::Tensor& idx, const CodeBook& book,
                          const StochasticCodes& s) {
  const std::int64_t n = w.numel();
  auto low = s.scratch_a.narrow(0, 0, n);  // the code below; then the random fractions
  auto gap = s.scratch_b.narrow(0, 0, n);
  const auto last = book.values.numel() - 1;
  // The code at or below each value (the count of values at or below it, less one), kept
  // one below the highest code so that the one above exists.
  at::bucketize_out(idx, w, book.values, /*out_int32=*/true, /*right=*/true);
  idx.sub_(1).clamp_(0, last - 1);
  at::index_select_out(low, book.values, 0, idx);
  w.sub_(low);  // value - below
  idx.add_(1);
  at::index_select_out(gap, book.values, 0, idx);
  idx.sub_(1);
  gap.sub_(low);  // above - below
  detail::uniform16(low, s.key, s.first);
  low.mul_(gap);
  w.gt_(low);  // 1 where the code goes up
  low.copy_(idx).add_(w);
  idx.copy_(low);
}

}  // namespace

torch::Tensor dynamic_map(bool is_signed, bool with_zero, int bits) {
  FRUGAL_CHECK(bits == 8 || bits == 4, "frugal: dynamic maps have 8 or 4 bits, got ", bits);
  // Exponents 10^-(levels - 1) .. 10^0, levels = bits - 1; at exponent i the fraction has
  // 2^i (signed) or 2^(i+1) (unsigned) linear steps between 0.1 and 1, each value the
  // middle of its step: 2^bits - 2 values, with 0 and 1.
  const int levels = bits - 1;
  const auto size = static_cast<std::size_t>(1) << bits;
  std::vector<float> values;
  for (int i = 0; i < levels; ++i) {
    const int steps = is_signed ? (1 << i) : (1 << (i + 1));
    const double scale = std::pow(10.0, i - (levels - 1));
    for (int k = 0; k < steps; ++k) {
      const double lo = 0.1 + 0.9 * k / steps;
      const double hi = 0.1 + 0.9 * (k + 1) / steps;
      values.push_back(static_cast<float>(scale * (lo + hi) / 2));
      if (is_signed) {
        values.push_back(static_cast<float>(-scale * (lo + hi) / 2));
      }
    }
  }
  values.push_back(0.0F);
  values.push_back(1.0F);
  std::sort(values.begin(), values.end());
  TORCH_INTERNAL_ASSERT(values.size() == size);
  if (!with_zero) {
    FRUGAL_CHECK(!is_signed, "frugal: only the unsigned dynamic map can leave out zero");
    values[0] = values[1] / 2;
  }
  return torch::tensor(values, torch::kFloat32);
}

BlockwiseCodes quantize_blockwise(const torch::Tensor& x, const torch::Tensor& map,
                                  std::int64_t block) {
  check_block(block);
  FRUGAL_CHECK(x.is_floating_point(), "frugal: quantize_blockwise takes a floating-point "
               "tensor, got ", x.scalar_type());
  const auto flat = x.detach().to(torch::kFloat32).contiguous().view(-1);
  const std::int64_t n = flat.numel();
  const auto options = flat.options();
  const CodeBook book(map.to(x.device()));
  FRUGAL_CHECK(book.bits == 8 || block % 2 == 0,
               "frugal: 4-bit codes need an even block (two codes a byte), got ", block);
  const auto u8 = options.dtype(torch::kUInt8);
  BlockwiseCodes q{
      book.bits == 8 ? torch::empty(x.sizes(), u8) : torch::empty({code_bytes(n, 4)}, u8),
      torch::empty({(n + block - 1) / block}, options), block, x.sizes().vec()};
  quantize_into(flat, q.codes.view(-1), q.scales, book, block, torch::empty({n}, options),
                torch::empty({n}, options.dtype(torch::kInt32)));
  return q;
}

torch::Tensor dequantize_blockwise(const BlockwiseCodes& q, const torch::Tensor& map) {
  check_block(q.block);
  const CodeBook book(map.to(q.codes.device()));
  const auto sizes = q.sizes.empty() ? q.codes.sizes().vec() : q.sizes;
  std::int64_t n = 1;
  for (const auto d : sizes) {
    n *= d;
  }
  FRUGAL_CHECK(q.codes.numel() == code_bytes(n, book.bits), "frugal: ", n, " elements of ",
               book.bits, "-bit codes take ", code_bytes(n, book.bits), " bytes, got ",
               q.codes.numel());
  FRUGAL_CHECK(q.scales.numel() == (n + q.block - 1) / q.block, "frugal: ", n,
               " codes in blocks of ", q.block, " need ", (n + q.block - 1) / q.block,
               " scales, got ", q.scales.numel());
  auto out = torch::empty(sizes, q.scales.options());
  dequantize_into(out.view(-1), q.codes.contiguous().view(-1), q.scales, book, q.block,
                  torch::empty({n}, q.scales.options().dtype(torch::kInt32)));
  return out;
}

CodeBook::CodeBook(const torch::Tensor& map) : bits(map_bits(map)) {
  const std::int64_t size = map.numel();
  const auto table = torch::empty({2 * size - 1}, map.options().dtype(torch::kFloat32));
  values = table.narrow(0, 0, size);
  values.copy_(map);
  boundaries = table.narrow(0, size, size - 1);
  at::add_out(boundaries, values.narrow(0, 0, size - 1), values.narrow(0, 1, size - 1));
  boundaries.div_(2);
}

void dequantize_into(const torch::Tensor& out, const torch::Tensor& codes,
                     const torch::Tensor& scales, const CodeBook& book, std::int64_t block,
                     const torch::Tensor& index) {
  const std::int64_t n = out.numel();
  auto idx = index.narrow(0, 0, n);
  if (book.bits == 4) {  // each byte's low half to the even element, its high half to the odd
    evens(idx, n).copy_(codes.narrow(0, 0, code_bytes(n, 4)));
    odds(idx, n).copy_(codes.narrow(0, 0, n / 2));
    evens(idx, n).bitwise_and_(15);
    odds(idx, n).bitwise_right_shift_(4);
  } else {
    idx.copy_(codes);
  }
  at::index_select_out(const_cast<torch::Tensor&>(out), book.values, 0, idx);
  std::int64_t b = 0;
  for_block_rows(n, block, [&](std::int64_t offset, std::int64_t r, std::int64_t c) {
    rows(out, offset, r, c).mul_(scales.narrow(0, b, r).unsqueeze(1));
    b += r;
  });
}

void quantize_into(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                   const CodeBook& book, std::int64_t block, const torch::Tensor& work,
                   const torch::Tensor& index, const StochasticCodes* stochastic) {
  const std::int64_t n = x.numel();
  auto w = work.narrow(0, 0, n);
  auto idx = index.narrow(0, 0, n);
  at::abs_out(w, x);
  std::int64_t b = 0;
  for_block_rows(n, block, [&](std::int64_t offset, std::int64_t r, std::int64_t c) {
    auto scale = scales.narrow(0, b, r);
    at::amax_out(scale, rows(w, offset, r, c), {1});
    auto normalized = rows(w, offset, r, c);
    at::div_out(normalized, rows(x, offset, r, c), scale.unsqueeze(1));
    b += r;
  });
  w.nan_to_num_(0.0);  // 0 / 0 in an all-zero block
  if (stochastic != nullptr) {
    round_stochastically(w, idx, book, *stochastic);
  } else {
    at::bucketize_out(idx, w, book.boundaries, /*out_int32=*/true, /*right=*/false);
  }
  if (book.bits == 4) {  // the odd element's code into the high half of its even one's byte
    odds(idx, n).mul_(16);
    evens(idx, n).narrow(0, 0, n / 2).add_(odds(idx, n));
    codes.narrow(0, 0, code_bytes(n, 4)).copy_(evens(idx, n));
  } else {
    codes.copy_(idx);
  }
}

NearestCode::NearestCode(const torch::Tensor& map) {
  const auto host = map.to(torch::kCPU, torch::kFloat32).contiguous();
  map_bits(host);
  values_.assign(host.data_ptr<float>(), host.data_ptr<float>() + host.numel());
  std::vector<float> boundaries;  // as CodeBook computes them, in float32
  for (std::size_t i = 0; i + 1 < values_.size(); ++i) {
    gaps_.push_back(values_[i + 1] - values_[i]);
    boundaries.push_back((values_[i] + values_[i + 1]) / 2);
  }
  const auto key_value = [](std::int64_t key) {
    const auto bits = static_cast<std::uint32_t>(key << kShift);
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  };
  bound_.resize(2 * kBuckets);
  base_.resize(2 * kBuckets);
  for (int negative = 0; negative < 2; ++negative) {
    for (std::int64_t k = 0; k < kBuckets; ++k) {
      const float lo = k == 0 ? 0.0F : key_value(kFirstKey + k);
      const float hi = k == kBuckets - 1 ? std::numeric_limits<float>::infinity()
                                         : key_value(kFirstKey + k + 1);
      // The bucket holds y in [lo, hi), or (-hi, -lo] for negatives; its code is the count
      // of boundaries below y: those below the bucket, plus the one inside if y is above.
      std::int64_t below = 0, inside = 0;
      float bound = std::numeric_limits<float>::infinity();
      for (const float b : boundaries) {
        const bool under = negative ? b <= -hi : b < lo;
        const bool in = negative ? (b > -hi && b <= -lo) : (b >= lo && b < hi);
        below += under ? 1 : 0;
        if (in) {
          ++inside;
          bound = b;
        }
      }
      TORCH_INTERNAL_ASSERT(inside <= 1, "two rounding boundaries in one bucket");
      const auto i = static_cast<std::size_t>(k + negative * kBuckets);
      base_[i] = static_cast<std::int32_t>(below);
      bound_[i] = inside == 1 ? bound : std::numeric_limits<float>::infinity();
    }
  }
}

torch::Tensor moment_map(bool is_signed, int bits) {
  auto map = dynamic_map(is_signed, is_signed, bits);
  if (is_signed && bits == 4) {
    // The dynamic map reaches 1 but only -0.8875: a block whose largest moment is negative
    // would shrink it by a ninth at every step. Its lowest value becomes -1.
    map[0] = -1.0F;
  }
  if (!is_signed && bits == 4) {
    // The zero-free map's lowest value, half the next (0.0016 of the block's largest), held
    // every smaller second moment up to it, and those elements' steps shrank (up to 4x for
    // a gradient at 1% of the block's largest). A 32nd of the next (0.0001) reaches a decade
    // lower; stochastic codes keep the values between unbiased.
    map[0] = map[1] / 32;
  }
  return map;
}

const NearestCode& nearest_code(bool is_signed, int bits) {
  static const NearestCode signed8(moment_map(true)), unsigned8(moment_map(false)),
      signed4(moment_map(true, 4)), unsigned4(moment_map(false, 4));
  if (bits == 4) {
    return is_signed ? signed4 : unsigned4;
  }
  return is_signed ? signed8 : unsigned8;
}

}  // namespace frugal::optim
