#pragma once
/// \file
/// How ranks agree on variable-length lists (packed documents, key padding, decode cache
/// lengths) in one fixed-size gather: each rank contributes a hash of its lists, and only when
/// the hashes differ does every rank gather the lists themselves, to name the first entry where
/// each rank differs from rank 0. Every rank sees the same hashes in the same gathered data, so
/// every rank takes that second path together (it is collective, and only on the error path).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <new>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace seqpar::detail {

/// 64-bit FNV-1a over integers, so that ranks can agree on variable-length data in one
/// fixed-size gather (and a decode step can tag its messages) without building a buffer.
struct Fnv {
  std::uint64_t h = 1469598103934665603ull;  ///< the running hash
  /// Mixes in the 8 bytes of `v`.
  void mix(std::int64_t v) {
    for (int byte = 0; byte < 8; ++byte) h = (h ^ ((static_cast<std::uint64_t>(v) >> (8 * byte)) & 0xff)) * 1099511628211ull;
  }
  /// Mixes in a list's size, then its values.
  void mix(std::span<const std::int64_t> list) {
    mix(static_cast<std::int64_t>(list.size()));
    for (std::int64_t v : list) mix(v);
  }
  /// The hash so far.
  std::int64_t value() const { return static_cast<std::int64_t>(h); }
};

/// The ranks 0..world-1 for which `pick(rank)` holds, as "1, 3" ("" when none: nothing is
/// allocated then, so an agreement that finds nothing to report costs no allocation).
template <class Pick>
std::string rank_list(int world, Pick&& pick) {
  std::string ranks;
  for (int w = 0; w < world; ++w)
    if (pick(w)) ranks += (ranks.empty() ? "" : ", ") + std::to_string(w);
  return ranks;
}

/// The hash of a list of integer lists (sizes included).
inline std::int64_t hash_lists(const std::vector<std::vector<std::int64_t>>& lists) {
  Fnv f;
  f.mix(static_cast<std::int64_t>(lists.size()));
  for (const auto& l : lists) f.mix(std::span<const std::int64_t>(l));
  return f.value();
}

/// Lists as one run of integers: the list count, each list's size, then the values.
inline std::vector<std::int64_t> flatten_lists(const std::vector<std::vector<std::int64_t>>& lists) {
  std::vector<std::int64_t> flat{static_cast<std::int64_t>(lists.size())};
  for (const auto& l : lists) flat.push_back(static_cast<std::int64_t>(l.size()));
  for (const auto& l : lists) flat.insert(flat.end(), l.begin(), l.end());
  return flat;
}

/// The lists of flatten_lists back (a prefix of `flat`; it may carry padding after them).
inline std::vector<std::vector<std::int64_t>> unflatten_lists(std::span<const std::int64_t> flat) {
  std::vector<std::vector<std::int64_t>> lists(static_cast<std::size_t>(flat[0]));
  std::size_t at = 1 + lists.size();
  for (std::size_t i = 0; i < lists.size(); ++i) {
    const auto n = static_cast<std::size_t>(flat[1 + i]);
    lists[i].assign(flat.begin() + static_cast<std::ptrdiff_t>(at), flat.begin() + static_cast<std::ptrdiff_t>(at + n));
    at += n;
  }
  return lists;
}

/// What a list field holds, which decides how its entries are named in messages.
enum class ListField : std::uint8_t {
  one_list,  ///< one list (kv_valid): entries named name[i]
  lists,     ///< a list of lists (documents): entries named name[l][i]
};

/// Where `theirs` first differs from `ours`, in the words of field `name` ("kv_valid[1] = 77",
/// "3 lists", "documents[0] with 2 entries"). Empty when they are equal.
inline std::string first_difference(const std::vector<std::vector<std::int64_t>>& ours,
                                    const std::vector<std::vector<std::int64_t>>& theirs, const char* name,
                                    ListField field, std::string& what_ours) {
  const bool single = field == ListField::one_list;
  auto entry = [&](std::size_t l, std::size_t i) {
    return std::string(name) + (single ? "" : "[" + std::to_string(l) + "]") + "[" + std::to_string(i) + "] = ";
  };
  if (ours.size() != theirs.size()) {
    what_ours = std::to_string(ours.size()) + " lists";
    return std::to_string(theirs.size()) + " lists";
  }
  for (std::size_t l = 0; l < ours.size(); ++l) {
    const auto& a = ours[l];
    const auto& b = theirs[l];
    for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
      if (a[i] != b[i]) {
        what_ours = std::to_string(a[i]);
        return entry(l, i) + std::to_string(b[i]);
      }
    if (a.size() != b.size()) {
      const std::string list = std::string(name) + (single ? "" : "[" + std::to_string(l) + "]");
      what_ours = std::to_string(a.size());
      return list + " with " + std::to_string(b.size()) + " entries";
    }
  }
  return "";
}

/// Collective, after every rank found that the hashes of field `name` differ: gathers every
/// rank's `lists` (of a field that is one list or several, `field`) and says, for each rank that
/// differs from rank 0, its first differing entry and rank 0's value there, e.g.
/// "ranks disagree on kv_valid: rank 2 has kv_valid[1] = 77 (rank 0: 120)". Two host
/// all-gathers: the sizes, then the lists padded to the longest.
template <class Comm>
std::string list_disagreement(Comm& comm, const char* prefix, const char* name,
                              const std::vector<std::vector<std::int64_t>>& lists, ListField field) {
  const int world = comm.size();
  std::vector<std::int64_t> flat = flatten_lists(lists);
  const std::int64_t mine[1] = {static_cast<std::int64_t>(flat.size())};
  std::vector<std::int64_t> sizes(static_cast<std::size_t>(world));
  comm.all_gather_host(std::span<const std::int64_t>(mine), sizes);
  const auto longest = static_cast<std::size_t>(*std::max_element(sizes.begin(), sizes.end()));
  flat.resize(longest, 0);
  std::vector<std::int64_t> all(longest * static_cast<std::size_t>(world));
  comm.all_gather_host(std::span<const std::int64_t>(flat), all);
  auto lists_of = [&](int w) {
    return unflatten_lists(std::span<const std::int64_t>(all).subspan(static_cast<std::size_t>(w) * longest, longest));
  };
  const auto rank0 = lists_of(0);
  std::string why = std::string(prefix) + "ranks disagree on " + name + ":";
  bool any = false;
  for (int w = 1; w < world; ++w) {
    std::string at_rank0;
    const std::string theirs = first_difference(rank0, lists_of(w), name, field, at_rank0);
    if (theirs.empty()) continue;
    why += std::string(any ? ";" : "") + " rank " + std::to_string(w) + " has " + theirs + " (rank 0: " + at_rank0 + ")";
    any = true;
  }
  return any ? why : why + " the lists hash differently but are equal (a hash of another field?)";
}

/// Runs `allocate` (a kernel's plan-time scratch) on every rank and agrees on the outcome: the
/// scratch a rank needs depends on its share of the work (a rank with no tokens or no heads
/// needs none), so one rank's std::bad_alloc is not every rank's. One host all-gather of a
/// flag; if any rank failed, every rank returns the same reason naming the ranks (empty when
/// none did), so all refuse the plan together and none is left waiting in its first call.
template <class Comm, class Allocate>
std::string allocation_disagreement(Comm& comm, const char* prefix, Allocate&& allocate) {
  std::int64_t failed[1] = {0};
  try {
    allocate();
  } catch (const std::bad_alloc&) {
    failed[0] = 1;
  } catch (const std::length_error&) {  // a size past what a vector can hold: the same refusal
    failed[0] = 1;
  }
  std::vector<std::int64_t> all(static_cast<std::size_t>(comm.size()));
  comm.all_gather_host(std::span<const std::int64_t>(failed), all);
  const std::string ranks = rank_list(comm.size(), [&](int w) { return all[static_cast<std::size_t>(w)] != 0; });
  if (ranks.empty()) return "";
  return std::string(prefix) + "the kernel could not allocate its scratch on rank(s) " + ranks +
         " (std::bad_alloc or std::length_error): the shape needs more memory than those ranks have";
}

}  // namespace seqpar::detail
