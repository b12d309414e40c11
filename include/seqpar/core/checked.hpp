#pragma once
/// \file
/// Checked integer arithmetic on user input: the one way plans, masks, decode and workspace
/// sizing add and multiply the integers a user gives them, so that a value that would wrap
/// becomes a ConfigError naming the field, by construction, instead of a silently wrong size,
/// length or key index.
///
/// Two forms of each operation: `checked_add(a, b)` returns std::nullopt on overflow (for the
/// shape checks that return a reason, as `can_implement` needs), and `add_or_throw(a, b,
/// field)` throws ConfigError naming `field` (for the checks that throw directly).
///
/// Which values are legal, decided once:
///  - lengths, counts, sizes: 0..INT64_MAX, and every sum or product the library forms from
///    them must fit in 64 bits (the plan also bounds each tensor at 2^58 bytes, so the sizes
///    it derives later cannot wrap);
///  - the softmax scale: 0 (1/sqrt(head_dim)) or finite with |scale| <= scale_limit (2^32);
///  - window sides: -1 (unbounded) or any value >= 0 up to INT64_MAX; a side at least as
///    large as the sequence is the same as unbounded, and `clamp_window_side` folds every such
///    side to `window_side_cap` so that `diagonal - side` and `diagonal + side` never wrap;
///  - time-outs: 0 (none) or any positive number of milliseconds; one too large for the
///    clock's deadline arithmetic means "never" (`saturating_deadline`).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string_view>

#include "seqpar/core/error.hpp"
#include "seqpar/core/host_device.hpp"

namespace seqpar {

/// a + b, or std::nullopt when the sum leaves int64.
[[nodiscard]] constexpr std::optional<std::int64_t> checked_add(std::int64_t a, std::int64_t b) noexcept {
  std::int64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}

/// a * b, or std::nullopt when the product leaves int64.
[[nodiscard]] constexpr std::optional<std::int64_t> checked_mul(std::int64_t a, std::int64_t b) noexcept {
  std::int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

namespace detail {
/// `values` folded from `init` with `op` (checked_add or checked_mul), or std::nullopt as soon
/// as one step leaves int64.
template <class Op>
constexpr std::optional<std::int64_t> checked_fold(std::span<const std::int64_t> values, std::int64_t init, Op op) noexcept {
  std::optional<std::int64_t> total = init;
  for (std::size_t i = 0; i < values.size() && total; ++i) total = op(*total, values[i]);
  return total;
}
}  // namespace detail

/// The sum of `values`, or std::nullopt when a partial sum leaves int64.
[[nodiscard]] constexpr std::optional<std::int64_t> checked_sum(std::span<const std::int64_t> values) noexcept {
  return detail::checked_fold(values, 0, checked_add);
}

/// The product of `values`, or std::nullopt when a partial product leaves int64.
[[nodiscard]] constexpr std::optional<std::int64_t> checked_product(std::span<const std::int64_t> values) noexcept {
  return detail::checked_fold(values, 1, checked_mul);
}

/// a + b; throws ConfigError naming `field` when the sum leaves int64.
inline std::int64_t add_or_throw(std::int64_t a, std::int64_t b, std::string_view field) {
  const std::optional<std::int64_t> sum = checked_add(a, b);
  SEQPAR_CHECK(sum.has_value(), ConfigError, field, ": integer overflow: ", a, " + ", b, " does not fit in 64 bits");
  return *sum;
}

/// a * b; throws ConfigError naming `field` when the product leaves int64.
inline std::int64_t mul_or_throw(std::int64_t a, std::int64_t b, std::string_view field) {
  const std::optional<std::int64_t> product = checked_mul(a, b);
  SEQPAR_CHECK(product.has_value(), ConfigError, field, ": integer overflow: ", a, " x ", b,
               " does not fit in 64 bits");
  return *product;
}

/// The largest softmax scale a plan takes: 2^32. Real scales are near 1/sqrt(head_dim) (times a
/// long-context factor); a scale past this makes scores of ordinary inputs overflow the
/// float accumulation, which no kernel can turn into a finite answer, so it is refused.
inline constexpr double scale_limit = 4294967296.0;

/// The largest window side that keeps its meaning: 2^60. Positions are below 2^58 (a plan
/// bounds every tensor at 2^58 bytes), so `diagonal +- side` stays far inside int64, and a
/// side this large already reaches past every key.
inline constexpr std::int64_t window_side_cap = std::int64_t{1} << 60;

/// A window side as the mask computes with it: -1 (unbounded) and values up to
/// window_side_cap are kept, larger ones become window_side_cap (the same keys are visible).
SEQPAR_HOST_DEVICE constexpr std::int64_t clamp_window_side(std::int64_t side) noexcept {
  return side > window_side_cap ? window_side_cap : side;
}

/// `now + timeout`, or the clock's last time point when that sum would wrap: a time-out too
/// large for the clock (milliseconds::max(), or INT64_MAX ms as nanoseconds) means "never",
/// not "already expired". A negative or zero time-out gives `now`.
template <class Clock, class Rep, class Period>
typename Clock::time_point saturating_deadline(typename Clock::time_point now,
                                               std::chrono::duration<Rep, Period> timeout) noexcept {
  using D = typename Clock::duration;
  if (timeout <= timeout.zero()) return now;
  const auto room = Clock::time_point::max() - now;  // D: how far the clock can still go
  // Compare in the time-out's own units first: converting a huge count to D would overflow.
  if (timeout >= std::chrono::duration_cast<std::chrono::duration<Rep, Period>>(room)) return Clock::time_point::max();
  const D step = std::chrono::duration_cast<D>(timeout);
  return step >= room ? Clock::time_point::max() : now + step;
}

}  // namespace seqpar
