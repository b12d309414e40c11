#!/bin/bash
# Alternated A/B of the policy benchmarks of two builds (issue 16: before and after the engine split).
# Usage: build seqpar_bench of both commits into /work/build-ab-old and /work/build-ab-new, then run this.
filter='BM_policy<(UlyssesPolicy|RingPolicy<Zigzag>|UnifiedPolicy<Zigzag>)>/P:(2|4)/causal:1'
for round in 1 2 3; do
  for side in old new; do
    /work/build-ab-$side/bench/seqpar_bench --benchmark_filter="$filter" --benchmark_format=csv 2>/dev/null | grep BM_policy | sed "s/^/$side,$round,/"
  done
done
