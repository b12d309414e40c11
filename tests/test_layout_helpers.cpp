// scatter_sequence / gather_sequence and split_sequence: every layout, even and uneven, both
// placements; a round trip through every rank's slice rebuilds the global tensor exactly.
#include <doctest/doctest.h>

#include <numeric>
#include <random>

#include "seqpar/seqpar.hpp"

using namespace seqpar;

namespace {

template <class Policy>
void round_trip(int world, Policy policy, std::int64_t total) {
  const MeshConfig mesh = mesh_config(policy, world);
  const auto lengths = split_sequence(total, mesh);
  CHECK(std::accumulate(lengths.begin(), lengths.end(), std::int64_t{0}) == total);
  std::vector<std::int64_t> per_mesh(static_cast<std::size_t>(world));
  for (int w = 0; w < world; ++w) per_mesh[mesh.ring_rank(w) * mesh.ulysses + mesh.ulysses_rank(w)] = lengths[w];
  const SequenceLayout layout(mesh.layout, mesh.ring, mesh.ulysses, per_mesh);
  const std::int64_t B = 2, H = 3, D = 5;
  std::vector<double> global(static_cast<std::size_t>(B * total * H * D));
  std::iota(global.begin(), global.end(), 1.0);
  std::vector<double> rebuilt(global.size(), 0.0);
  std::vector<int> seen(static_cast<std::size_t>(total), 0);
  for (int w = 0; w < world; ++w) {
    const PositionMap pos = layout.positions(mesh.ring_rank(w), mesh.ulysses_rank(w));
    REQUIRE(pos.size() == lengths[w]);
    for (std::int64_t i = 0; i < pos.size(); ++i) {
      ++seen[pos(i)];
      if (i > 0) CHECK(pos(i) > pos(i - 1));  // positions increase within a slice
    }
    std::vector<float> local(static_cast<std::size_t>(B * pos.size() * H * D));
    const auto lv = TensorView<float>::bshd(local.data(), B, pos.size(), H, D);
    scatter_sequence(TensorView<const double>::bshd(global.data(), B, total, H, D), pos, lv);
    gather_sequence(TensorView<const float>(lv), pos, TensorView<double>::bshd(rebuilt.data(), B, total, H, D));
  }
  for (int s : seen) CHECK(s == 1);
  CHECK(rebuilt == global);
}

}  // namespace

TEST_CASE("layout helpers: scatter then gather rebuilds the global sequence for every layout") {
  for (int world : {1, 2, 3, 4, 5, 6, 7, 8})
    for (std::int64_t total : {0, 1, 7, 64, 99, 4099}) {
      CAPTURE(world);
      CAPTURE(total);
      round_trip(world, AnythingPolicy<UlyssesPolicy>{}, total);
      round_trip(world, AnythingPolicy<RingPolicy<Contiguous>>{}, total);
      round_trip(world, AnythingPolicy<RingPolicy<Zigzag>>{}, total);
      round_trip(world, AnythingPolicy<RingPolicy<Stripe>>{}, total);
      for (int u = 1; u <= world; ++u)
        if (world % u == 0) {
          round_trip(world, AnythingPolicy<UnifiedPolicy<Zigzag>>{{u, world / u}}, total);
          round_trip(world, AnythingPolicy<UnifiedPolicy<Stripe>>{{u, world / u, MeshPlacement::ring_adjacent}}, total);
        }
    }
}

TEST_CASE("layout helpers: a slice of the wrong length or a position outside the sequence throws") {
  std::vector<double> g(10 * 2), l(3 * 2);
  const auto gv = TensorView<const double>::bshd(g.data(), 1, 10, 1, 2);
  CHECK_THROWS_AS(scatter_sequence(gv, PositionMap::run(4, 0), TensorView<double>::bshd(l.data(), 1, 3, 1, 2)),
                  ConfigError);
  CHECK_THROWS_AS(scatter_sequence(gv, PositionMap::run(3, 8), TensorView<double>::bshd(l.data(), 1, 3, 1, 2)),
                  ConfigError);
}
