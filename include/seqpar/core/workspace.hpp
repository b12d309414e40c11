#pragma once
/// \file
/// Workspace of named slots (CUB's temporary storage, with the aliasing declared): each part of
/// a call declares the buffers it needs, with their sizes, as `Slot`s whose name and lifetime
/// are fixed in code; the layout places them once, and a call takes its buffers from the
/// caller's bytes by slot. Which slots share bytes follows from their lifetimes alone
/// (SlotLife), so a buffer cannot overlap live data by a slip in offset arithmetic; a workspace
/// too small fails naming the slot that does not fit.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

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

/// A named buffer, as code declares it: its name (for messages) and its lifetime. A slot is
/// identified by the object, so define each as a `static constexpr` member or an `inline
/// constexpr` variable; its size comes from the plan (WorkspaceLayout::declare).
struct Slot {
  const char* name = "";                 ///< for messages
  SlotLife life = SlotLife::whole_call;  ///< decides what it may share bytes with
};

/// Where the slots a call uses live in one workspace. Slots are declared first, then placed
/// once (`place`); only a declared slot has a place.
class WorkspaceLayout {
 public:
  /// An empty layout (no slots in use).
  WorkspaceLayout() = default;

  /// Declares that a call uses `slot` with `bytes`. A slot declared again (two parts of a call
  /// that hand a buffer to each other) stays one buffer, of the larger size.
  void declare(const Slot& slot, std::size_t bytes) {
    for (Entry& e : entries_)
      if (e.slot == &slot) {
        e.bytes = std::max(e.bytes, bytes);
        return;
      }
    entries_.push_back({&slot, bytes, 0});
  }

  /// Places `whole_call` slots back to back in the order declared, then the `exchange_in` and
  /// the `exchange_out` groups each from the same offset; every slot aligned to
  /// workspace_alignment. Call once, after the last declare.
  void place() {
    std::size_t end[3] = {0, 0, 0};
    auto place_group = [&](SlotLife life, std::size_t from) {
      std::size_t at = from;
      for (Entry& e : entries_) {
        if (e.slot->life != life) continue;
        at = align(at);
        e.offset = at;
        at += e.bytes;
      }
      end[static_cast<int>(life)] = at;
    };
    place_group(SlotLife::whole_call, 0);
    const std::size_t shared = align(end[0]);
    place_group(SlotLife::exchange_in, shared);
    place_group(SlotLife::exchange_out, shared);
    total_ = std::max({end[0], end[1], end[2]});
  }

  /// Bytes the caller provides: the slots plus the slack for aligning any base address.
  std::size_t bytes() const { return total_ + workspace_alignment; }

  /// `slot` of `workspace` as `T*`. Throws ConfigError naming the slot when the workspace is
  /// too small for it, and Error when nobody declared it (a part of a call that uses a buffer
  /// must declare it).
  template <class T>
  T* get(std::span<std::byte> workspace, const Slot& slot) const {
    for (const Entry& e : entries_) {
      if (e.slot != &slot) continue;
      const auto addr = reinterpret_cast<std::uintptr_t>(workspace.data());
      const std::size_t at = (workspace_alignment - addr % workspace_alignment) % workspace_alignment + e.offset;
      SEQPAR_CHECK(workspace.data() != nullptr && at + e.bytes <= workspace.size(), ConfigError, "workspace: slot ",
                   slot.name, " needs bytes [", at, ", ", at + e.bytes, ") but the workspace holds ", workspace.size(),
                   " bytes (size it with the plan's workspace bytes)");
      return reinterpret_cast<T*>(workspace.data() + at);
    }
    SEQPAR_THROW(Error, "workspace: slot ", slot.name, " was not declared for this plan (a seqpar bug)");
  }

 private:
  static std::size_t align(std::size_t x) { return (x + workspace_alignment - 1) / workspace_alignment * workspace_alignment; }

  struct Entry {
    const Slot* slot;
    std::size_t bytes, offset;
  };
  std::vector<Entry> entries_;
  std::size_t total_ = 0;
};

}  // namespace seqpar
