#pragma once
/// \file
/// Two-phase workspace (CUB style): the same carving code first runs on a null base to size
/// the workspace, then on the caller's buffer to hand out sub-buffers, so the two can never
/// disagree. Sub-buffers are aligned to 256 bytes.

#include <cstddef>
#include <cstdint>
#include <span>

#include "seqpar/core/error.hpp"

namespace seqpar {

/// Alignment of every sub-buffer carved from a workspace.
inline constexpr std::size_t workspace_alignment = 256;

/// Hands out aligned sub-buffers from one workspace, or (with no base) only counts bytes.
class WorkspaceCarver {
 public:
  /// Sizing mode: counts the bytes `take` would use.
  WorkspaceCarver() = default;
  /// Carving mode over the caller's buffer; the base is aligned up first.
  explicit WorkspaceCarver(std::span<std::byte> buffer)
      : base_(buffer.data()), capacity_(buffer.size()), carving_(true) {
    SEQPAR_CHECK(base_ != nullptr || capacity_ == 0, ConfigError, "workspace: null data pointer with a size of ",
                 capacity_, " bytes");
    const auto addr = reinterpret_cast<std::uintptr_t>(base_);
    const std::size_t skew = (workspace_alignment - addr % workspace_alignment) % workspace_alignment;
    used_ = skew;
  }

  /// Reserves `count` elements of T; returns null in sizing mode.
  template <class T>
  T* take(std::size_t count) {
    used_ = (used_ + workspace_alignment - 1) / workspace_alignment * workspace_alignment;
    const std::size_t at = used_;
    used_ += count * sizeof(T);
    // An empty span is a carving workspace too (of 0 bytes), never a silent switch to sizing.
    SEQPAR_CHECK(!carving_ || used_ <= capacity_, ConfigError, "workspace: expected at least ", used_,
                 " bytes, got ", capacity_, " (size it with plan.workspace_bytes())");
    return carving_ ? reinterpret_cast<T*>(base_ + at) : nullptr;
  }
  /// Current offset; with `rewind` it lets two phases share the same bytes.
  std::size_t mark() const { return used_; }
  /// Goes back to an earlier mark, so the next buffers alias the ones taken since.
  void rewind(std::size_t mark) { used_ = mark; }
  /// Bytes needed so far, plus the slack for aligning an arbitrary base.
  std::size_t bytes_needed() const { return used_ + workspace_alignment; }

 private:
  std::byte* base_ = nullptr;
  std::size_t capacity_ = 0;
  std::size_t used_ = 0;
  bool carving_ = false;
};

}  // namespace seqpar
