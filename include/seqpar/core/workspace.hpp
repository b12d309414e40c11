#pragma once
/// \file
/// Workspace of named slots (CUB's temporary storage, with the aliasing declared): the plan
/// lists every buffer a call needs with its size and its lifetime, the layout places them once,
/// and a call takes its buffers from the caller's bytes by name. Which slots share bytes
/// follows from their lifetimes alone (SlotLife), so a buffer cannot overlap live data by a
/// slip in offset arithmetic; a workspace too small fails naming the slot that does not fit.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

#include "seqpar/core/error.hpp"

namespace seqpar {

/// Alignment of every slot (and of the workspace base, which is aligned up first).
inline constexpr std::size_t workspace_alignment = 256;

/// When a slot's bytes are live during one call. This is the one place aliasing is decided:
/// `whole_call` slots never share bytes; the slots of the exchange into the mesh
/// (`exchange_in`: packing for the first all-to-all) and those of the exchange back
/// (`exchange_out`) are never live together, so the two groups start at the same offset.
enum class SlotLife : std::uint8_t {
  whole_call,    ///< live from the first phase to the last
  exchange_in,   ///< live only until the inbound all-to-all has finished
  exchange_out,  ///< live only from the outbound all-to-all's packing on
};

/// One named buffer of a workspace: `bytes` is 0 for a slot this call does not use.
struct SlotSpec {
  const char* name = "";                 ///< for messages
  std::size_t bytes = 0;                 ///< size
  SlotLife life = SlotLife::whole_call;  ///< decides what it may share bytes with
  bool used = false;                     ///< false: the call never touches it (its pointer is null)
};

/// Offsets of N named slots in one workspace, laid out from their specs.
template <std::size_t N>
class WorkspaceLayout {
 public:
  /// An empty layout (no slots in use).
  WorkspaceLayout() = default;

  /// Places `whole_call` slots back to back, then the `exchange_in` and the `exchange_out`
  /// groups each from the same offset; every slot aligned to workspace_alignment.
  explicit WorkspaceLayout(const std::array<SlotSpec, N>& slots) : slots_(slots) {
    std::size_t end[3] = {0, 0, 0};
    auto place = [&](SlotLife life, std::size_t from) {
      std::size_t at = from;
      for (std::size_t i = 0; i < N; ++i) {
        if (!slots_[i].used || slots_[i].life != life) continue;
        at = align(at);
        offset_[i] = at;
        at += slots_[i].bytes;
      }
      end[static_cast<int>(life)] = at;
    };
    place(SlotLife::whole_call, 0);
    const std::size_t shared = align(end[0]);
    place(SlotLife::exchange_in, shared);
    place(SlotLife::exchange_out, shared);
    total_ = std::max({end[0], end[1], end[2]});
  }

  /// Bytes the caller provides: the slots plus the slack for aligning any base address.
  std::size_t bytes() const { return total_ + workspace_alignment; }
  /// The spec of slot i (name, size, lifetime).
  const SlotSpec& slot(std::size_t i) const { return slots_[i]; }

  /// Slot i of `workspace` as `T*` (null for an unused slot). Throws ConfigError naming the
  /// slot when the workspace is too small for it.
  template <class T>
  T* get(std::span<std::byte> workspace, std::size_t i) const {
    if (!slots_[i].used) return nullptr;
    const auto addr = reinterpret_cast<std::uintptr_t>(workspace.data());
    const std::size_t at = (workspace_alignment - addr % workspace_alignment) % workspace_alignment + offset_[i];
    SEQPAR_CHECK(workspace.data() != nullptr && at + slots_[i].bytes <= workspace.size(), ConfigError,
                 "workspace: slot ", slots_[i].name, " needs bytes [", at, ", ", at + slots_[i].bytes,
                 ") but the workspace holds ", workspace.size(), " bytes (size it with the plan's workspace bytes)");
    return reinterpret_cast<T*>(workspace.data() + at);
  }

 private:
  static std::size_t align(std::size_t x) { return (x + workspace_alignment - 1) / workspace_alignment * workspace_alignment; }

  std::array<SlotSpec, N> slots_{};
  std::array<std::size_t, N> offset_{};
  std::size_t total_ = 0;
};

}  // namespace seqpar
