#!/usr/bin/env bash
# Backward time against forward time, as markdown tables on stdout, in one go so the
# ratios come from the same minutes of the same machine:
#  1. CpuFlashKernel alone: forward and backward calls at seq 2048, D 64, 8 heads, float, causal
#     and not, on 1 and 2 threads (or the thread counts given). A small timing program, written
#     to the build directory and compiled with the flags the build used for seqpar_demo; the
#     thread counts alternate call by call in one process.
#  2. Each policy: build/tools/seqpar_demo/seqpar_demo, forward alone, then forward + backward.
# Usage:
#   bench/backward_vs_forward.sh [build-dir] [threads...]     (default: build 1 2)
set -euo pipefail
build="${1:-build}"
shift || true
threads=("$@")
[[ ${#threads[@]} -eq 0 ]] && threads=(1 2)
demo="$build/tools/seqpar_demo/seqpar_demo"
[[ -x "$demo" ]] || { echo "backward_vs_forward.sh: $demo not built" >&2; exit 1; }
root="$(cd "$(dirname "$0")/.." && pwd)"

# --- 1. The kernel alone -------------------------------------------------------------------
flags_file="$build/tools/seqpar_demo/CMakeFiles/seqpar_demo.dir/flags.make"
if [[ -f "$flags_file" ]]; then
  read -r -a cxx_flags <<<"$(sed -n 's/^CXX_FLAGS = //p' "$flags_file")"
else
  cxx_flags=(-O3 -DNDEBUG -march=native -std=c++20)  # not a Makefile build: the Release defaults
fi
timer="$build/bench_backward_kernel"
cat >"$timer.cpp" <<'CPP'
// Best-of-15 wall time of CpuFlashKernel forward and backward calls (written by
// bench/backward_vs_forward.sh). Args: causal threads... One kernel per thread count; their
// calls alternate round by round, so that every count gets the same chances at an idle moment.
// Prints "threads forward_ms backward_ms forward_GFLOP/s backward_GFLOP/s" per count.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "seqpar/seqpar.hpp"

int main(int argc, char** argv) {
  using namespace seqpar;
  const bool causal = std::atoi(argv[1]) != 0;
  const std::int64_t B = 1, S = 2048, H = 8, D = 64;
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  auto random = [&](std::int64_t n) {
    std::vector<float> x(static_cast<std::size_t>(n));
    for (auto& e : x) e = dist(rng);
    return x;
  };
  const auto q = random(B * S * H * D), k = random(B * S * H * D), v = random(B * S * H * D),
             dout = random(B * S * H * D);
  std::vector<float> out(q.size()), lse(static_cast<std::size_t>(B * S * H)), dq(q.size()), dk(k.size()), dv(v.size());
  KernelParams p;
  p.scale = 1.0 / std::sqrt(double(D));
  p.causal = causal;
  p.q_positions = PositionMap::run(S, 0);
  p.k_positions = PositionMap::run(S, 0);
  using C = TensorView<const float>;
  using M = TensorView<float>;
  struct Run {
    int threads;
    CpuFlashKernel kernel;
    double forward_ms = 1e30, backward_ms = 1e30;
  };
  std::vector<Run> runs;
  for (int i = 2; i < argc; ++i) runs.push_back({std::atoi(argv[i]), CpuFlashKernel(std::atoi(argv[i]))});
  auto forward = [&](CpuFlashKernel& kernel) {
    kernel.forward(C::bshd(q.data(), B, S, H, D), C::bshd(k.data(), B, S, H, D), C::bshd(v.data(), B, S, H, D),
                   M::bshd(out.data(), B, S, H, D), M::lse_bhs(lse.data(), B, S, H), p);
  };
  auto backward = [&](CpuFlashKernel& kernel) {
    kernel.backward(C::bshd(dout.data(), B, S, H, D), C::bshd(q.data(), B, S, H, D), C::bshd(k.data(), B, S, H, D),
                    C::bshd(v.data(), B, S, H, D), C::bshd(out.data(), B, S, H, D), C::lse_bhs(lse.data(), B, S, H),
                    M::bshd(dq.data(), B, S, H, D), M::bshd(dk.data(), B, S, H, D), M::bshd(dv.data(), B, S, H, D), p);
  };
  for (Run& r : runs) {  // warm-up: scratch, pool, caches
    forward(r.kernel);
    backward(r.kernel);
  }
  using ms = std::chrono::duration<double, std::milli>;
  for (int round = 0; round < 15; ++round)
    for (Run& r : runs) {
      const auto t0 = std::chrono::steady_clock::now();
      forward(r.kernel);
      const auto t1 = std::chrono::steady_clock::now();
      backward(r.kernel);
      const auto t2 = std::chrono::steady_clock::now();
      r.forward_ms = std::min(r.forward_ms, ms(t1 - t0).count());
      r.backward_ms = std::min(r.backward_ms, ms(t2 - t1).count());
    }
  // Forward FLOPs 4 S^2 D H (halved when causal); backward counted as 2.5x that (five products).
  const double flops = 4.0 * double(S) * double(S) * double(D) * double(H * B) * (causal ? 0.5 : 1.0);
  for (const Run& r : runs)
    std::printf("%d %.2f %.2f %.1f %.1f\n", r.threads, r.forward_ms, r.backward_ms, flops / r.forward_ms / 1e6,
                2.5 * flops / r.backward_ms / 1e6);
}
CPP
"${CXX:-c++}" "${cxx_flags[@]}" -I"$root/include" "$timer.cpp" -o "$timer" -pthread

echo "CpuFlashKernel alone: batch 1, seq 2048, 8 heads, D 64, float; best of 15 calls each, thread counts alternating"
echo
echo "| causal | threads | forward ms | backward ms | backward / forward | forward GFLOP/s | backward GFLOP/s (2.5x forward's FLOPs) | backward speed-up over ${threads[0]} thread(s) |"
echo "|---|---|---|---|---|---|---|---|"
for causal in 0 1; do
  "$timer" "$causal" "${threads[@]}" | awk -v c="$causal" 'NR == 1 { one = $3 } {
    printf "| %s | %d | %.1f | %.1f | %.2f | %.1f | %.1f | %.2f |\n", c ? "yes" : "no", $1, $2, $3, $3 / $2, $4, $5, one / $3 }'
done
echo

# --- 2. Each policy -------------------------------------------------------------------------
shape=(--batch 1 --seq 2048 --heads 8 --head-dim 64 --causal --iters 3 --comm threads)

field() { sed -n "s/.*[ ]$1=\([^ ]*\).*/\1/p" <<<"$2"; }

echo "| policy | ranks | forward ms | forward + backward ms | backward ms | backward / forward | bytes forward | bytes backward |"
echo "|---|---|---|---|---|---|---|---|"
while IFS='|' read -r ranks label args; do
  # shellcheck disable=SC2086  # args is a list of options
  fwd=$("$demo" "${shape[@]}" --ranks "$ranks" $args | tail -n 1)
  # shellcheck disable=SC2086
  both=$("$demo" "${shape[@]}" --ranks "$ranks" $args --backward | tail -n 1)
  tf=$(field time_ms_per_iter "$fwd"); tb=$(field time_ms_per_iter "$both")
  bf=$(field bytes_sent_per_rank "$fwd"); bb=$(field bytes_sent_per_rank "$both")
  awk -v l="$label" -v r="$ranks" -v tf="$tf" -v tb="$tb" -v bf="$bf" -v bb="$bb" 'BEGIN {
    printf "| %s | %d | %.1f | %.1f | %.1f | %.2f | %d | %d |\n", l, r, tf, tb, tb - tf, (tb - tf) / tf, bf, bb - bf }'
done <<'CASES'
1|single rank (no communication)|--policy ulysses
1|single rank, kernel on 2 threads|--policy ulysses --threads 2
2|Ulysses|--policy ulysses
2|Ring contiguous|--policy ring --layout contiguous
2|Ring zigzag|--policy ring --layout zigzag
2|Ring stripe|--policy ring --layout stripe
4|Unified 2x2 zigzag|--policy unified --ulysses-degree 2 --ring-degree 2 --layout zigzag
4|Anything Unified 2x2, seq 2047|--policy unified --anything --ulysses-degree 2 --ring-degree 2 --layout zigzag --seq 2047
CASES
