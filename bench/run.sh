#!/usr/bin/env bash
# Builds and runs seqpar's benchmarks and writes docs/perf/RESULTS.md and docs/perf/kernel_gflops.png.
# Usage: bench/run.sh [build-dir]   (default: build-bench, configured Release)
# Environment: SEQPAR_BENCH_JOBS (build parallelism, default 2), SEQPAR_BENCH_QUICK=1 (short
# smoke run: fewer sizes, results written to <build-dir>/bench-out only, RESULTS.md left alone).
# Needs: cmake, a C++20 compiler, Google Benchmark, python3, gnuplot; Open MPI for the MPI part.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
build="${1:-$root/build-bench}"
out="$build/bench-out"
jobs="${SEQPAR_BENCH_JOBS:-2}"
quick="${SEQPAR_BENCH_QUICK:-0}"
start=$(date +%s)
mkdir -p "$out"
rm -f "$out"/*.json "$out"/*.txt
: > "$out/commands.txt"

# Runs a command and records it for RESULTS.md.
run() {
  echo "$*" >> "$out/commands.txt"
  echo "+ $*" >&2
  "$@"
}

load() { cut -d' ' -f1-3 /proc/loadavg; }
load_start="$(load)"

# Figures whose point is concurrency (threads, ranks) need both cores. On a shared machine,
# wait for 2 s in which the CPUs are less than 15% busy: at most SEQPAR_BENCH_IDLE_WAIT
# seconds per stage (default 45) and SEQPAR_BENCH_IDLE_BUDGET seconds in all (default 100,
# which keeps the whole run under 10 minutes); the outcome is recorded in RESULTS.md.
idle_wait="${SEQPAR_BENCH_IDLE_WAIT:-45}"
idle_budget="${SEQPAR_BENCH_IDLE_BUDGET:-100}"
: > "$out/idle.txt"
cpu_busy() {  # percentage of CPU time not idle over 2 seconds
  local a b
  a=($(head -1 /proc/stat)); sleep 2; b=($(head -1 /proc/stat))
  local total=0 i
  for i in 1 2 3 4 5 6 7; do total=$(( total + b[i] - a[i] )); done
  echo $(( 100 * (total - (b[4] - a[4])) / (total > 0 ? total : 1) ))
}
wait_idle() {  # wait_idle <stage>
  local t0=$SECONDS busy limit=$(( idle_wait < idle_budget ? idle_wait : idle_budget ))
  while :; do
    busy=$(cpu_busy)
    if (( busy < 15 )); then
      echo "$1: started when the CPUs were ${busy}% busy (waited $(( SECONDS - t0 )) s)" >> "$out/idle.txt"
      break
    fi
    if (( SECONDS - t0 >= limit )); then
      echo "$1: no idle window in $(( SECONDS - t0 )) s; started with the CPUs ${busy}% busy" >> "$out/idle.txt"
      break
    fi
  done
  idle_budget=$(( idle_budget - (SECONDS - t0) ))
  (( idle_budget > 0 )) || idle_budget=0
}

run cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DSEQPAR_BUILD_TESTS=OFF -DSEQPAR_BUILD_EXAMPLES=OFF \
  -DSEQPAR_BUILD_BENCHMARKS=ON -DSEQPAR_BENCH_COMPILE_ONLY=OFF -DSEQPAR_BUILD_TOOLS=ON > "$out/cmake.log"
targets=(seqpar_bench)
# (The list is read whole first: grep -q would close the pipe early, which pipefail counts as a failure.)
help="$(cmake --build "$build" --target help)"
grep -q seqpar_bench_mpi <<< "$help" && targets+=(seqpar_bench_mpi)
grep -q 'seqpar_demo' <<< "$help" && targets+=(seqpar_demo)
run cmake --build "$build" -j "$jobs" --target "${targets[@]}" > "$out/build.log"

bench="$build/bench/seqpar_bench"
gb() {  # gb <json name> <filter> [more args]
  local name="$1" filter="$2"
  shift 2
  run "$bench" --benchmark_filter="$filter" --benchmark_out="$out/$name.json" --benchmark_out_format=json \
    --benchmark_counters_tabular=true "$@"
}

kernel_filter='BM_cpu_flash/|BM_cpu_flash_backward|BM_reference'
scaling_filter='BM_cpu_flash_scaling'
policy_filter='BM_policy'
pair_filter='BM_anything_vs_plain'
feature_filter='BM_cpu_flash_softcap|BM_cpu_flash_value_dim|BM_sinks_vs_plain'
paged_filter='BM_paged_decode'
bf16_filter='BM_peak_bf16|BM_cpu_flash_bf16|BM_decode_kernel<.*>/T:(1|16)/threads:1/'
if [[ "$quick" == 1 ]]; then
  kernel_filter='BM_cpu_flash/D:64/seq:512/|BM_cpu_flash_backward/D:64/seq:2048/causal:1/bf16:0|BM_reference/D:64/seq:512/'
  scaling_filter='BM_cpu_flash_scaling/D:128/seq:4096/causal:0'
  policy_filter='BM_policy<UlyssesPolicy>/P:2/causal:1'
  pair_filter='BM_anything_vs_plain<UlyssesPolicy>/P:2'
  feature_filter='BM_cpu_flash_softcap/causal:1|BM_cpu_flash_value_dim/causal:1|BM_sinks_vs_plain<UlyssesPolicy>'
  paged_filter='BM_paged_decode/P:1/'
  bf16_filter='BM_peak_bf16|BM_cpu_flash_bf16/D:64/seq:4096/causal:1|BM_decode_kernel<.*>/T:1/threads:1/'
fi

wait_idle "machine ceilings (before)"
gb machine_before 'BM_peak_fma|BM_memory'
gb kernels "$kernel_filter"
wait_idle "thread scaling"
gb scaling "$scaling_filter"
wait_idle "machine ceilings (after)"
gb machine_after 'BM_peak_fma|BM_memory'
gb policies "$policy_filter"
wait_idle "Anything vs plain"
gb pairs "$pair_filter"
wait_idle "today's models' features"
gb features "$feature_filter"
wait_idle "paged decode"
gb paged "$paged_filter"
wait_idle "bf16 against float"
gb bf16 "$bf16_filter"

# MPI strong scaling: the same global shape on 1 and 2 ranks, alternated so that a change of
# load on the shared machine hits both.
mpi_note=""
mpi_bin="$build/bench/seqpar_bench_mpi"
: > "$out/mpi_results.txt"
if [[ -x "$mpi_bin" ]] && command -v mpirun > /dev/null; then
  mpi_seq=16384
  [[ "$quick" == 1 ]] && mpi_seq=4096
  mpi_flags=(--oversubscribe --bind-to none)
  [[ "$(id -u)" == 0 ]] && mpi_flags+=(--allow-run-as-root)
  for round in 1 2; do
    wait_idle "MPI round $round"
    for policy in ring ulysses; do
      for ranks in 1 2; do
        run mpirun "${mpi_flags[@]}" -n "$ranks" "$mpi_bin" --policy "$policy" --seq "$mpi_seq" --heads 2 \
          --head-dim 64 --iters 4 | grep '^RESULT' | tee -a "$out/mpi_results.txt"
      done
    done
  done
else
  mpi_note="MPI strong scaling not measured: seqpar::mpi or mpirun not available in this build."
fi

# The serving demo (seqpar_demo --serve, its default workload) on 2 and 4 MPI ranks.
demo_bin="$build/tools/seqpar_demo/seqpar_demo"
: > "$out/serve_results.txt"
if [[ -x "$demo_bin" ]] && command -v mpirun > /dev/null && [[ "$quick" != 1 ]]; then
  for ranks in 2 4; do
    wait_idle "serving demo, $ranks ranks"
    run mpirun "${mpi_flags[@]}" -n "$ranks" "$demo_bin" --serve --threads 1 | grep '^RESULT' \
      | tee -a "$out/serve_results.txt"
  done
fi

{
  lscpu | grep -E '^(Architecture|CPU\(s\)|Model name|Thread|Core|Socket|L1d|L2|L3|NUMA node\(s\)|CPU max MHz)'
  echo "SIMD flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(fma|avx2|avx512f|avx512bw|avx512vl|avx512_bf16|avx512_fp16|amx_tile|amx_bf16)$' | tr '\n' ' ')"
  echo "Memory: $(grep MemTotal /proc/meminfo | tr -s ' ' | cut -d' ' -f2-)"
} > "$out/lscpu.txt"
# The bench's compile flags: from Make's flags.make, or from build.ninja in a Ninja build dir.
flags="$( (grep -h CXX_FLAGS "$build/bench/CMakeFiles/seqpar_bench.dir/flags.make" 2>/dev/null || true) | sed 's/^CXX_FLAGS = //')"
if [[ -z "$flags" && -f "$build/build.ninja" ]]; then
  flags="$( (grep -A8 'seqpar_bench.dir/bench_kernels.cpp.o:' "$build/build.ninja" || true) | (grep -m1 'FLAGS = ' || true) \
    | sed 's/^ *FLAGS = //')"
fi
{
  echo "date=$(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "commit=$(git -C "$root" rev-parse --short HEAD)$(git -C "$root" diff --quiet HEAD -- include bench \
    ':!docs/perf' || echo '+local changes')"
  echo "elapsed=$(( $(date +%s) - start )) s"
  echo "load_start=$load_start"
  echo "load_end=$(load)"
  echo "compiler=$(${CXX:-c++} --version | head -1)"
  echo "flags=$flags"
  echo "mpi_note=$mpi_note"
} > "$out/info.txt"

results="$root/docs/perf/RESULTS.md"
png="$root/docs/perf/kernel_gflops.png"
if [[ "$quick" == 1 ]]; then
  results="$out/RESULTS.md"
  png="$out/kernel_gflops.png"
fi
run python3 "$here/report.py" "$out" "$results"
peak="$(cat "$out/peak.txt")"
gnuplot <<EOF
set terminal pngcairo size 900,560 font ",10"
set output "$png"
set title "CpuFlashKernel (float, 1 thread) vs ReferenceKernel: GFLOP/s per CPU second"
set xlabel "sequence length (Sq = Sk)"
set ylabel "GFLOP/s"
set logscale x 2
set logscale y 10
set key outside right
set grid
plot "$out/kernel_gflops.dat" index 0 with linespoints title "flash D=64", \
     "" index 1 with linespoints title "flash D=64 causal", \
     "" index 2 with linespoints title "flash D=128", \
     "" index 3 with linespoints title "flash D=128 causal", \
     "" index 4 with linespoints dashtype 2 title "reference D=64", \
     "" index 5 with linespoints dashtype 2 title "reference D=64 causal", \
     "" index 6 with linespoints dashtype 2 title "reference D=128", \
     "" index 7 with linespoints dashtype 2 title "reference D=128 causal", \
     $peak with lines lw 2 title "fp32 FMA peak, 1 core", \
     0.75*$peak with lines dashtype 3 title "75% of peak"
EOF
echo "wrote $results and $png in $(( $(date +%s) - start )) s" >&2
