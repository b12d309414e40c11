#!/usr/bin/env bash
# Alternated A/B of two builds of seqpar_bench: runs the benchmarks matching FILTER with the old
# and the new binary in turn, ROUNDS times, and prints for each benchmark the median of the
# rounds' real times (each the benchmark's mean over its iterations) of each side, new / old of
# the medians, and the spread of each side's rounds (max / min). Alternating (old, new, old, new,
# ...) spreads the drift of a shared machine over both sides; the median, not the fastest round,
# keeps one lucky or unlucky round from deciding the ratio.
# Usage: bench/ab_alternate.sh OLD_BINARY NEW_BINARY FILTER [ROUNDS=3]
# AB_COUNTER=NAME compares that counter of each benchmark instead of its real time (e.g.
# backward_ms of BM_cpu_flash_backward, whose real time is a forward and a backward).
# Example (before and after a change to the engine, both builds Release, CUDA off):
#   bench/ab_alternate.sh /work/build-ab-old/bench/seqpar_bench /work/build-ab-new/bench/seqpar_bench \
#     'BM_policy<' 3
set -euo pipefail
(( $# >= 3 )) || { sed -n '2,10p' "$0" >&2; exit 2; }
old="$1" new="$2" filter="$3" rounds="${4:-3}"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
for round in $(seq "$rounds"); do
  for side in old new; do
    bin="$old"; [[ $side == new ]] && bin="$new"
    # JSON, not CSV: the CSV reporter aborts when benchmarks carry different counters.
    "$bin" --benchmark_filter="$filter" --benchmark_out="$dir/$side.$round.json" \
      --benchmark_out_format=json > /dev/null 2>&1 || { echo "$bin failed (round $round)" >&2; exit 1; }
  done
done
python3 - "$dir" "$(dirname "$0")" "${AB_COUNTER:-}" << 'PY'
import re, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from report import load  # the JSON reader bench/run.sh's report uses
import statistics
times, order = {}, []  # (name, side) -> [real time of each round], unit; names as first seen
units = {}
for path in sorted(Path(sys.argv[1]).glob("*.json")):
    side = path.name.split(".")[0]
    for full, b in load(path).items():
        # The two builds may give a benchmark different minimum times: pair them without it.
        name = re.sub(r"/min_time:[0-9.]+", "", full)
        if name not in order:
            order.append(name)
        counter = sys.argv[3]
        times.setdefault((name, side), []).append(b[counter] if counter else b["real_time"])
        units[name] = counter if counter else b["time_unit"]
print("| benchmark | old (median) | new (median) | new / old | spread old, new |")
print("|---|---|---|---|---|")
ratios = []
for name in order:
    o, n = times.get((name, "old")), times.get((name, "new"))
    if o and n:
        mo, mn, u = statistics.median(o), statistics.median(n), units[name]
        ratios.append(mn / mo)
        print(f"| {name} | {mo:.3g} {u} | {mn:.3g} {u} | {mn / mo:.3f} | {max(o) / min(o):.2f}, {max(n) / min(n):.2f} |")
if ratios:
    print(f"\n{len(ratios)} rows; new / old geometric mean {statistics.geometric_mean(ratios):.3f}, "
          f"range {min(ratios):.3f}-{max(ratios):.3f}")
PY
