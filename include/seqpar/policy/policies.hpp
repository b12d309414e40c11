#pragma once
/// \file
/// The policies: small config types that say how the work and the communication are
/// arranged, and policy_traits: the phases each one is made of (policy/phase.hpp), listed here
/// and nowhere else. All of them run on one engine (policy/mesh_engine.hpp) as a U x R mesh.

#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>

#include "seqpar/core/error.hpp"
#include "seqpar/core/mesh.hpp"
#include "seqpar/core/sequence_layout.hpp"
#include "seqpar/policy/join_sinks.hpp"
#include "seqpar/policy/local_compute.hpp"
#include "seqpar/policy/phase.hpp"
#include "seqpar/policy/ring_loop.hpp"
#include "seqpar/policy/ulysses_exchange.hpp"

namespace seqpar {

/// DeepSpeed-Ulysses: all-to-all to "my heads, all tokens", local attention, all-to-all back.
/// Plain form: every rank holds the same number of tokens and heads % world == 0.
struct UlyssesPolicy {};

/// Ring attention: Q stays, K/V blocks travel the ring, partial results merge by LSE.
/// `Layout` (Contiguous, Zigzag, Stripe) places tokens; Zigzag or Stripe balance causal work.
/// Plain form: every rank holds the same number of tokens (Zigzag: an even number).
template <class Layout = Contiguous>
struct RingPolicy {
  using layout = Layout;  ///< token placement
};

/// USP (Unified Sequence Parallelism): a ulysses_degree x ring_degree mesh, Ulysses inside each
/// group and Ring across groups. A degree of 0 is derived from the world size and the other.
template <class Layout = Contiguous>
struct UnifiedPolicy {
  using layout = Layout;  ///< token placement of the ring blocks
  int ulysses_degree = 0;  ///< U; 0 = world / ring_degree
  int ring_degree = 0;     ///< R; 0 = world / ulysses_degree
  MeshPlacement placement = MeshPlacement::ulysses_adjacent;  ///< which groups are consecutive ranks
};

/// Lifts every divisibility rule of `Inner`: any local length per rank (even 0), any head
/// count, Q and K/V of different lengths, with exact-size communication (no padding).
template <class Inner>
struct AnythingPolicy {
  Inner inner{};  ///< the arrangement (its degrees for Unified)
};

namespace detail {
template <class P>
struct base_policy : std::false_type {};
template <>
struct base_policy<UlyssesPolicy> : std::true_type {};
template <class L>
struct base_policy<RingPolicy<L>> : std::true_type {};
template <class L>
struct base_policy<UnifiedPolicy<L>> : std::true_type {};

}  // namespace detail

/// True for UlyssesPolicy, RingPolicy<L>, UnifiedPolicy<L> and AnythingPolicy of those.
template <class P>
inline constexpr bool is_policy_v = detail::base_policy<P>::value;
/// AnythingPolicy<P> is a policy when P is one of the three base policies (no nesting).
template <class Inner>
inline constexpr bool is_policy_v<AnythingPolicy<Inner>> = detail::base_policy<Inner>::value;

/// What a policy is made of, at compile time: its phases in order (`phases`, a PhaseList:
/// the engine instantiates those and no others), whether the divisibility rules are lifted,
/// and its name as C++ (for messages that suggest code). The primary template fails with a
/// message for anything that is not a policy. A new phase joins a policy by its name in that
/// policy's list below.
template <class P>
struct policy_traits {
  static_assert(sizeof(P) == 0,
                "seqpar: not a policy; use UlyssesPolicy, RingPolicy<Layout>, UnifiedPolicy<Layout> or "
                "AnythingPolicy<one of those>");
};

/// What follows from a policy's phase list: whether it has the Ulysses exchange and the ring
/// loop (a shorthand for `phases::has<...>`), and that the divisibility rules hold.
template <class Phases>
struct policy_phases {
  using phases = Phases;                                                          ///< the phases, in order
  static constexpr bool ulysses = Phases::template has<detail::UlyssesExchange>;  ///< has the Ulysses exchange
  static constexpr bool ring = Phases::template has<detail::RingLoop>;            ///< has the ring loop
  static constexpr bool anything = false;                                         ///< divisibility rules lifted
};
/// Ulysses: the all-to-all, then the local kernel (the sinks joined to its result).
template <>
struct policy_traits<UlyssesPolicy>
    : policy_phases<detail::PhaseList<detail::UlyssesExchange, detail::JoinSinks, detail::LocalCompute>> {
  static constexpr const char* name = "UlyssesPolicy";  ///< C++ spelling
};
/// Ring: the ring loop (the local kernel on a ring of one), the sinks joined to the merge.
template <class L>
struct policy_traits<RingPolicy<L>>
    : policy_phases<detail::PhaseList<detail::JoinSinks, detail::RingLoop, detail::LocalCompute>> {
  static constexpr const char* name = std::is_same_v<L, Zigzag>   ? "RingPolicy<Zigzag>"
                                      : std::is_same_v<L, Stripe> ? "RingPolicy<Stripe>"
                                                                  : "RingPolicy<Contiguous>";  ///< C++ spelling
};
/// Unified: the all-to-all around the ring loop (a degree of 1 skips its phase at run time),
/// the sinks joined inside the all-to-all.
template <class L>
struct policy_traits<UnifiedPolicy<L>> : policy_phases<detail::PhaseList<detail::UlyssesExchange, detail::JoinSinks,
                                                                         detail::RingLoop, detail::LocalCompute>> {
  static constexpr const char* name = std::is_same_v<L, Zigzag>   ? "UnifiedPolicy<Zigzag>"
                                      : std::is_same_v<L, Stripe> ? "UnifiedPolicy<Stripe>"
                                                                  : "UnifiedPolicy<Contiguous>";  ///< C++ spelling
};
/// Anything: the phases of its inner policy, with the divisibility rules lifted.
template <class Inner>
struct policy_traits<AnythingPolicy<Inner>> {
  static_assert(detail::base_policy<Inner>::value,
                "seqpar: AnythingPolicy<P> needs P = UlyssesPolicy, RingPolicy<Layout> or UnifiedPolicy<Layout> "
                "(AnythingPolicy does not nest)");
  using phases = typename policy_traits<Inner>::phases;           ///< the inner policy's phases
  static constexpr bool ulysses = policy_traits<Inner>::ulysses;  ///< has the Ulysses exchange
  static constexpr bool ring = policy_traits<Inner>::ring;        ///< has the ring loop
  static constexpr bool anything = true;                          ///< divisibility rules lifted
  static constexpr const char* name = "AnythingPolicy";  ///< C++ spelling (of the outer template)
};

/// The phases of policy P alone: the engine is keyed on them, so policies that differ only in
/// layout or in Anything share one compiled engine.
template <class P>
using policy_phases_of = typename policy_traits<P>::phases;

/// The mesh a policy asks for, before the world size is known: a degree of 0 means "derive
/// it from the world size" (Ulysses asks for U = world, Ring for R = world). Nothing is
/// checked here, so that every rank can first agree on the request and then fail alike.
template <class P>
MeshConfig mesh_request(const P& policy) {
  if constexpr (requires { policy.inner; }) {
    static_assert(detail::base_policy<std::remove_cvref_t<decltype(policy.inner)>>::value,
                  "seqpar: AnythingPolicy<P> needs P = UlyssesPolicy, RingPolicy<Layout> or UnifiedPolicy<Layout>");
    MeshConfig m = mesh_request(policy.inner);
    m.anything = true;
    return m;  // m.policy keeps the inner name: messages suggest AnythingPolicy<that>
  } else {
    static_assert(detail::base_policy<P>::value,
                  "seqpar: a policy must be UlyssesPolicy, RingPolicy<Layout>, UnifiedPolicy<Layout> or AnythingPolicy<...>");
    MeshConfig m;
    if constexpr (std::is_same_v<P, UlyssesPolicy>) {
      m.ulysses = 0;
      m.policy = policy_traits<P>::name;
    } else if constexpr (requires { policy.ring_degree; }) {
      m.ulysses = policy.ulysses_degree;
      m.ring = policy.ring_degree;
      m.placement = policy.placement;
      m.layout = layout_kind_of<typename P::layout>();
      m.policy = policy_traits<P>::name;
    } else {
      m.ring = 0;
      m.layout = layout_kind_of<typename P::layout>();
      m.policy = policy_traits<P>::name;
    }
    return m;
  }
}

/// Fills the derived degree of a request for `world` ranks; returns the reason it cannot
/// (degrees negative, both derived, or not multiplying to the world size), or "" when it can.
/// A derived degree is never printed as 0: the message says which given degree does not fit.
inline std::string resolve_mesh_reason(MeshConfig& m, int world) {
  std::ostringstream why;
  const int u = m.ulysses, r = m.ring;
  if (world < 1) {
    why << "world size: expected >= 1, got " << world;
  } else if (u < 0 || r < 0) {
    why << m.policy << ": degrees must be >= 0, got ulysses_degree " << u << ", ring_degree " << r;
  } else if (u == 0 && r == 0) {
    why << m.policy << ": set ulysses_degree or ring_degree (both are 0)";
  } else if (u == 0 && world % r != 0) {
    why << m.policy << ": ring_degree " << r << " does not divide the world size " << world;
  } else if (r == 0 && world % u != 0) {
    why << m.policy << ": ulysses_degree " << u << " does not divide the world size " << world;
  } else if (u > 0 && r > 0 && std::int64_t{u} * r != world) {  // in 64 bits: int would wrap
    why << m.policy << ": ulysses_degree x ring_degree = " << u << " x " << r << " must equal the world size "
        << world << " (it is " << std::int64_t{u} * r << "; leave one degree 0 to derive it from the other)";
  } else if (m.placement != MeshPlacement::ulysses_adjacent && m.placement != MeshPlacement::ring_adjacent) {
    why << m.policy << ": placement: expected MeshPlacement::ulysses_adjacent or ring_adjacent, got "
        << static_cast<std::int64_t>(m.placement);
  } else {
    if (u == 0) m.ulysses = world / r;
    if (r == 0) m.ring = world / u;
  }
  return why.str();
}

/// Fills the derived degree of a request for `world` ranks; throws ConfigError with
/// resolve_mesh_reason's message when it cannot.
inline MeshConfig resolve_mesh(MeshConfig m, int world) {
  const std::string why = resolve_mesh_reason(m, world);
  SEQPAR_CHECK(why.empty(), ConfigError, why);
  return m;
}

/// Resolves a policy into the mesh it runs on for `world` ranks; throws ConfigError if the
/// degrees do not multiply to the world size.
template <class P>
MeshConfig mesh_config(const P& policy, int world) {
  return resolve_mesh(mesh_request(policy), world);
}

}  // namespace seqpar
