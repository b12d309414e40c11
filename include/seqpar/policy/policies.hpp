#pragma once
/// \file
/// The policies: small config types that say how the work and the communication are
/// arranged. All of them run on one engine (policy/mesh_engine.hpp) as a U x R mesh.

#include <type_traits>

#include "seqpar/core/error.hpp"
#include "seqpar/core/mesh.hpp"
#include "seqpar/core/sequence_layout.hpp"

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
    return m;
  } else {
    static_assert(detail::base_policy<P>::value,
                  "seqpar: a policy must be UlyssesPolicy, RingPolicy<Layout>, UnifiedPolicy<Layout> or AnythingPolicy<...>");
    MeshConfig m;
    if constexpr (std::is_same_v<P, UlyssesPolicy>) {
      m.ulysses = 0;
      m.policy = "UlyssesPolicy";
    } else if constexpr (requires { policy.ring_degree; }) {
      m.ulysses = policy.ulysses_degree;
      m.ring = policy.ring_degree;
      m.placement = policy.placement;
      m.layout = layout_kind_of<typename P::layout>();
      m.policy = "UnifiedPolicy";
    } else {
      m.ring = 0;
      m.layout = layout_kind_of<typename P::layout>();
      m.policy = "RingPolicy";
    }
    return m;
  }
}

/// Fills the derived degree of a request for `world` ranks; throws ConfigError when the
/// degrees are negative, both derived, or do not multiply to the world size.
inline MeshConfig resolve_mesh(MeshConfig m, int world) {
  SEQPAR_CHECK(world >= 1, ConfigError, "world size: expected >= 1, got ", world);
  const int u = m.ulysses, r = m.ring;
  SEQPAR_CHECK(u >= 0 && r >= 0, ConfigError, m.policy, ": degrees must be >= 0, got ulysses_degree ", u,
               ", ring_degree ", r);
  SEQPAR_CHECK(u > 0 || r > 0, ConfigError, m.policy, ": set ulysses_degree or ring_degree (both are 0)");
  if (m.ulysses == 0) m.ulysses = world % r == 0 ? world / r : 0;
  if (m.ring == 0) m.ring = world % u == 0 ? world / u : 0;
  SEQPAR_CHECK(m.ulysses > 0 && m.ring > 0 && m.ulysses * m.ring == world, ConfigError, m.policy,
               ": ulysses_degree x ring_degree = ", u, " x ", r, " must equal the world size ", world,
               " (a degree of 0 is derived from the other)");
  return m;
}

/// Resolves a policy into the mesh it runs on for `world` ranks; throws ConfigError if the
/// degrees do not multiply to the world size.
template <class P>
MeshConfig mesh_config(const P& policy, int world) {
  return resolve_mesh(mesh_request(policy), world);
}

}  // namespace seqpar
