#include <doctest/doctest.h>

#include "support/attention_check.hpp"

using namespace seqpar;

TEST_CASE("smoke: every policy matches the exact reference on a small causal GQA case") {
  test::GlobalCase c;
  c.batch = 2;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = 16;
  c.seq_q = 37;
  c.causal = true;
  const auto g = test::make_global(c);
  for (int p : {1, 2, 3}) {
    CAPTURE(p);
    CHECK(test::run_distributed<float>(p, AnythingPolicy<UlyssesPolicy>{}, c, g).err.rel() < 1e-5);
    CHECK(test::run_distributed<float>(p, AnythingPolicy<RingPolicy<Zigzag>>{}, c, g).err.rel() < 1e-5);
    CHECK(test::run_distributed<double>(p, AnythingPolicy<RingPolicy<Stripe>>{}, c, g).err.rel() < 1e-12);
  }
}
