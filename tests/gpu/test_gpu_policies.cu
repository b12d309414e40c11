// Every policy and layout on one GPU: P ranks as threads over CudaThreadCommunicator, each with
// its own stream, CudaFlashKernel and TensorOps<CudaSpace>, against the exact double reference.
// Compiled once per element type (SEQPAR_GPU_TEST_TYPE = float, __half or __nv_bfloat16).

#include <doctest/doctest.h>

#include "support/gpu_check.hpp"

#ifndef SEQPAR_GPU_TEST_TYPE
#define SEQPAR_GPU_TEST_TYPE float
#endif

using namespace seqpar;
using namespace seqpar::gpu_test;
using T = SEQPAR_GPU_TEST_TYPE;

namespace {

/// Runs `policy` on `ranks` ranks on case `c` and checks forward (and backward) errors.
template <class Policy>
void check(int ranks, Policy policy, const test::GlobalShape& c, GpuRunOptions opt = {}) {
  CAPTURE(type_name<T>());
  CAPTURE(ranks);
  CAPTURE(c.causal);
  CAPTURE(c.head_dim);
  CAPTURE(c.seq_q);
  CAPTURE(c.kv_len());
  CAPTURE(opt.tensor_cores);
  CAPTURE(opt.backward);
  const test::GlobalData g = test::make_global_as<T>(c);
  test::ReferenceGrads gr;
  if (opt.backward) gr = test::make_global_grads(g);
  const GpuRunResult r = run_on_gpu<T>(ranks, policy, g, &gr, opt);
  CHECK(!r.out.nan);
  CHECK(r.out.rel() <= tolerance<T>);
  if (opt.with_lse || opt.backward) CHECK(r.out.lse_rel() <= 1e-5);
  if (opt.backward) {
    CHECK(!r.grads.nan());
    CHECK(r.grads.worst() <= grad_tolerance<T>);
  }
}

test::GlobalShape make_case(std::int64_t seq, std::int64_t dim, bool causal, std::uint64_t seed) {
  return test::make_case(seq, 4, 2, dim, causal, seed, 2);
}

}  // namespace

TEST_CASE("GPU: Ulysses, Ring and Unified (every layout) match the reference") {
  std::uint64_t seed = 1;
  // head_dim 64 takes the tensor-core path for half/bf16; 40 the SIMT path.
  for (std::int64_t dim : {64, 40})
    for (bool causal : {false, true}) {
      const test::GlobalShape c = make_case(256, dim, causal, seed++);
      check(2, UlyssesPolicy{}, c);
      check(4, UlyssesPolicy{}, c);
      check(2, RingPolicy<Contiguous>{}, c);
      check(4, RingPolicy<Contiguous>{}, c);
      check(4, RingPolicy<Zigzag>{}, c);
      check(4, RingPolicy<Stripe>{}, c);
      check(4, UnifiedPolicy<Contiguous>{2, 2}, c);
      check(4, UnifiedPolicy<Zigzag>{2, 2}, c);
      check(4, UnifiedPolicy<Stripe>{2, 2}, c);
      check(4, UnifiedPolicy<Zigzag>{2, 2, MeshPlacement::ring_adjacent}, c);
    }
}

TEST_CASE("GPU: the SIMT path gives the same answers as the tensor-core path") {
  GpuRunOptions opt;
  opt.tensor_cores = false;
  const test::GlobalShape c = make_case(192, 128, true, 40);
  check(4, RingPolicy<Zigzag>{}, c, opt);
  check(4, UnifiedPolicy<Stripe>{2, 2}, c, opt);
  opt.tensor_cores = true;
  check(4, RingPolicy<Zigzag>{}, c, opt);
}

TEST_CASE("GPU: AnythingPolicy with uneven lengths, empty ranks and cross attention") {
  test::GlobalShape c = make_case(101, 64, true, 50);
  c.heads = 6;
  c.kv_heads = 3;
  check(3, AnythingPolicy<UlyssesPolicy>{}, c);
  check(3, AnythingPolicy<RingPolicy<Zigzag>>{}, c);
  check(3, AnythingPolicy<RingPolicy<Stripe>>{}, c);
  check(4, AnythingPolicy<UnifiedPolicy<Zigzag>>{{2, 2}}, c);
  GpuRunOptions uneven;
  uneven.lengths_q = {60, 0, 41};
  uneven.lengths_kv = uneven.lengths_q;
  check(3, AnythingPolicy<RingPolicy<Contiguous>>{}, c, uneven);
  // Joint/cross attention: K/V of another length than Q, not causal.
  test::GlobalShape x = make_case(77, 64, false, 51);
  x.seq_kv = 130;
  check(3, AnythingPolicy<RingPolicy<Contiguous>>{}, x);
  check(2, AnythingPolicy<UlyssesPolicy>{}, x);
}

TEST_CASE("GPU: forward without the LSE") {
  GpuRunOptions opt;
  opt.with_lse = false;
  const test::GlobalShape c = make_case(128, 64, true, 60);
  check(4, UnifiedPolicy<Zigzag>{2, 2}, c, opt);
  check(2, UlyssesPolicy{}, c, opt);
}

TEST_CASE("GPU: backward of every policy matches the exact gradients") {
  GpuRunOptions opt;
  opt.backward = true;
  std::uint64_t seed = 70;
  for (bool causal : {false, true}) {
    const test::GlobalShape c = make_case(128, 64, causal, seed++);
    check(2, UlyssesPolicy{}, c, opt);
    check(3, RingPolicy<Contiguous>{}, make_case(96, 64, causal, seed++), opt);
    check(4, RingPolicy<Zigzag>{}, c, opt);
    check(4, RingPolicy<Stripe>{}, c, opt);
    check(4, UnifiedPolicy<Zigzag>{2, 2}, c, opt);
  }
  test::GlobalShape odd = make_case(70, 40, true, 80);
  odd.heads = 6;
  odd.kv_heads = 3;
  check(3, AnythingPolicy<UnifiedPolicy<Stripe>>{{3, 1}}, odd, opt);
  check(3, AnythingPolicy<RingPolicy<Zigzag>>{}, odd, opt);
}
