#!/usr/bin/env bash
# Backward time against forward time for each policy (issue 5), as a markdown table on stdout.
# Runs build/examples/seqpar_demo over threads with and without --backward, in one go so the
# ratios come from the same minutes of the same machine. Usage:
#   bench/backward_vs_forward.sh [build-dir]      (default: build)
set -euo pipefail
build="${1:-build}"
demo="$build/examples/seqpar_demo"
[[ -x "$demo" ]] || { echo "backward_vs_forward.sh: $demo not built" >&2; exit 1; }
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
2|Ulysses|--policy ulysses
2|Ring contiguous|--policy ring --layout contiguous
2|Ring zigzag|--policy ring --layout zigzag
2|Ring stripe|--policy ring --layout stripe
4|Unified 2x2 zigzag|--policy unified --ulysses-degree 2 --ring-degree 2 --layout zigzag
4|Anything Unified 2x2, seq 2047|--policy unified --anything --ulysses-degree 2 --ring-degree 2 --layout zigzag --seq 2047
CASES
