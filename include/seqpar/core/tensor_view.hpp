#pragma once
/// \file
/// TensorView: a non-owning, strided view of a [batch, seq, heads, head_dim] tensor.

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "seqpar/core/error.hpp"
#include "seqpar/core/types.hpp"

namespace seqpar {

/// A strided view of a BSHD tensor in memory space `Space`. head_dim must be contiguous
/// (stride 1); the other three strides are free, in elements. The LSE is a view of the same
/// type with head_dim 1. A default-constructed view is "absent" (for an optional LSE).
template <class T, class Space = HostSpace>
struct TensorView {
  using value_type = T;        ///< element type (may be const)
  using memory_space = Space;  ///< where `data` lives

  T* data = nullptr;                   ///< first element
  std::array<std::int64_t, 4> extent{};  ///< batch, seq, heads, head_dim
  std::array<std::int64_t, 4> stride{};  ///< element strides of the four dimensions

  /// Batch size.
  constexpr std::int64_t batch() const { return extent[0]; }
  /// Sequence length (local).
  constexpr std::int64_t seq() const { return extent[1]; }
  /// Number of heads.
  constexpr std::int64_t heads() const { return extent[2]; }
  /// Head dimension.
  constexpr std::int64_t dim() const { return extent[3]; }
  /// Number of elements.
  constexpr std::int64_t numel() const { return extent[0] * extent[1] * extent[2] * extent[3]; }
  /// True for a default-constructed view (no tensor given).
  constexpr bool absent() const { return data == nullptr && numel() == 0; }

  /// Pointer to the head_dim row at (b, s, h).
  constexpr T* row(std::int64_t b, std::int64_t s, std::int64_t h) const {
    return data + b * stride[0] + s * stride[1] + h * stride[2];
  }
  /// Element (b, s, h, d).
  constexpr T& operator()(std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d = 0) const {
    return row(b, s, h)[d * stride[3]];
  }

  /// The sub-view of sequence positions [begin, begin + count).
  constexpr TensorView slice_seq(std::int64_t begin, std::int64_t count) const {
    TensorView v = *this;
    v.data = count > 0 ? data + begin * stride[1] : data;
    v.extent[1] = count;
    return v;
  }
  /// The sub-view of heads [begin, begin + count).
  constexpr TensorView slice_heads(std::int64_t begin, std::int64_t count) const {
    TensorView v = *this;
    v.data = count > 0 ? data + begin * stride[2] : data;
    v.extent[2] = count;
    return v;
  }

  /// Read-only view of the same tensor.
  constexpr operator TensorView<const T, Space>() const  // NOLINT: implicit by design
    requires(!std::is_const_v<T>)
  {
    return {data, extent, stride};
  }

  /// Contiguous [B, S, H, D] view (the usual layout of a framework tensor).
  static constexpr TensorView bshd(T* p, std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d) {
    return {p, {b, s, h, d}, {s * h * d, h * d, d, 1}};
  }
  /// Contiguous view stored [S, B, H, D]: the order seqpar packs for all-to-all, because
  /// pieces concatenated along the sequence then form one strided tensor.
  static constexpr TensorView sbhd(T* p, std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d) {
    return {p, {b, s, h, d}, {h * d, b * h * d, d, 1}};
  }
  /// LSE view stored [B, H, S] (the FlashAttention convention), seen as [B, S, H, 1].
  static constexpr TensorView lse_bhs(T* p, std::int64_t b, std::int64_t s, std::int64_t h) {
    return {p, {b, s, h, 1}, {h * s, 1, s, 1}};
  }
};

/// True when views `a` and `b` may share an element: the byte ranges from each one's first
/// element to its last intersect. Conservative: two strided views that interleave without
/// sharing an element count as overlapping too. A view without elements overlaps nothing.
template <class T, class U, class Space>
bool may_overlap(const TensorView<T, Space>& a, const TensorView<U, Space>& b) {
  auto range = [](const auto& v, std::uintptr_t& lo, std::uintptr_t& hi) {
    if (v.data == nullptr || v.numel() == 0) return false;
    std::int64_t last = 0;  // element offset of the last element
    for (int i = 0; i < 4; ++i) last += (v.extent[i] - 1) * v.stride[i];
    lo = reinterpret_cast<std::uintptr_t>(v.data);
    hi = lo + static_cast<std::uintptr_t>(last + 1) * sizeof(*v.data);
    return true;
  };
  std::uintptr_t alo = 0, ahi = 0, blo = 0, bhi = 0;
  return range(a, alo, ahi) && range(b, blo, bhi) && alo < bhi && blo < ahi;
}

/// What a call does with a tensor it is given, for check_view.
enum class ViewUse : std::uint8_t {
  read,   ///< an input
  write,  ///< an output: its elements must not overlap each other
};

/// Checks that `view` has the expected extents, a contiguous head_dim, non-negative strides and
/// a non-null pointer when it holds elements; throws ConfigError naming `name` otherwise.
/// Output views (ViewUse::write) must also not overlap themselves.
template <class T, class Space>
void check_view(const TensorView<T, Space>& view, std::string_view name, std::int64_t batch,
                std::int64_t seq, std::int64_t heads, std::int64_t dim, ViewUse use) {
  static constexpr const char* dims[4] = {"batch", "seq", "heads", "head_dim"};
  const std::array<std::int64_t, 4> want{batch, seq, heads, dim};
  for (int i = 0; i < 4; ++i)
    SEQPAR_CHECK(view.extent[i] == want[i], ConfigError, name, ".", dims[i], ": expected ", want[i],
                 ", got ", view.extent[i]);
  for (int i = 0; i < 4; ++i)
    SEQPAR_CHECK(view.stride[i] >= 0, ConfigError, name, ".stride[", i, "]: expected >= 0, got ",
                 view.stride[i]);
  SEQPAR_CHECK(dim <= 1 || view.stride[3] == 1, ConfigError, name,
               ".stride[3] (head_dim): expected 1, got ", view.stride[3]);
  SEQPAR_CHECK(view.numel() == 0 || view.data != nullptr, ConfigError, name,
               ": null data pointer for a non-empty tensor");
  if (use == ViewUse::read || view.numel() == 0) return;
  // Non-overlap: sorted by stride, each dimension must step past the whole previous one.
  std::array<int, 4> order{0, 1, 2, 3};
  for (int i = 1; i < 4; ++i)
    for (int j = i; j > 0 && view.stride[order[j]] < view.stride[order[j - 1]]; --j)
      std::swap(order[j], order[j - 1]);
  std::int64_t span = 1;
  for (int i : order) {
    if (view.extent[i] <= 1) continue;
    SEQPAR_CHECK(view.stride[i] >= span, ConfigError, name, ": strides overlap (dimension ", dims[i],
                 " has stride ", view.stride[i], " but must be at least ", span, ")");
    span = view.stride[i] * view.extent[i];
  }
}

}  // namespace seqpar
