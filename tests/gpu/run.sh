#!/usr/bin/env bash
# tests/gpu/run.sh: seqpar's GPU check, in one go, on a machine with an NVIDIA GPU and nvcc.
#   tests/gpu/run.sh            (from anywhere; OUT=/some/dir to keep the log and the table)
# It configures and builds the GPU tests and the GPU benchmark for this GPU's architecture,
# runs the tests (ctest -L gpu, plus the CPU tile-math test and, when compute-sanitizer is
# installed, a memcheck/racecheck pass over a small kernel smoke test), then the benchmark
# (CudaFlashKernel forward TFLOP/s at 4K-32K tokens and backward at 4K and 16K, head dim
# 64/128, causal and not; each policy's forward and backward on one GPU with 2-8 virtual
# ranks), and prints a short summary table last.
#
# Built to run once, unattended, within 8 minutes on one H200: every step has a time limit
# taken from what is left of the budget, a failing step does not stop the later ones, the
# benchmark shrinks to a quick pass when time runs short, and without CMake or doctest it
# still compiles and runs the benchmark with nvcc directly. Exit status: 0 when every step
# that ran passed.
set -u -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUDGET=${SEQPAR_GPU_BUDGET_S:-470}   # seconds for the whole script (8 minutes, minus slack)
START=$(date +%s)
BUILD=${SEQPAR_GPU_BUILD_DIR:-$ROOT/build-gpu-check}
OUTDIR=${OUT:-}
if [ -n "$OUTDIR" ]; then mkdir -p "$OUTDIR" || OUTDIR=""; fi
LOGDIR=${OUTDIR:-$BUILD}
mkdir -p "$BUILD" "$LOGDIR"
LOG=$LOGDIR/gpu_run.log
TABLE=$LOGDIR/gpu_table.md
: > "$LOG"
SUMMARY=()   # "step|status|seconds|note"
FAILED=0

log() { echo "[run.sh $(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
left() { echo $((BUDGET - ($(date +%s) - START))); }

# step NAME LIMIT_S CMD...: runs CMD with a time limit (capped by the budget), logs its output.
step() {
  local name=$1 limit=$2
  shift 2
  local rem
  rem=$(left)
  if [ "$rem" -lt 15 ]; then
    log "SKIP $name: out of time"
    SUMMARY+=("$name|skipped (no time)|0|")
    return 2
  fi
  [ "$limit" -gt $((rem - 10)) ] && limit=$((rem - 10))
  log "BEGIN $name (limit ${limit}s): $*"
  local t0 rc
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >> "$LOG" 2>&1
  rc=$?
  local dt=$(($(date +%s) - t0))
  local status=ok
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status="TIMEOUT"
  elif [ $rc -ne 0 ]; then status="FAILED (rc $rc)"; fi
  # SOFT=1: a failure that is retried, or judged by the caller, does not fail the run here.
  if [ $rc -ne 0 ]; then
    if [ "${SOFT:-0}" = 1 ]; then status="$status, not counted"; else FAILED=1; fi
  fi
  log "END $name: $status in ${dt}s"
  SUMMARY+=("$name|$status|$dt|")
  return $rc
}

log "seqpar GPU check in $ROOT, build dir $BUILD, log $LOG"
{
  echo "## environment"
  date -u
  uname -a
  timeout 30 nvidia-smi 2>&1 || echo "nvidia-smi unavailable"
  command -v nvcc >/dev/null 2>&1 && nvcc --version || /usr/local/cuda/bin/nvcc --version 2>&1 || echo "nvcc not found"
  command -v cmake >/dev/null 2>&1 && cmake --version | head -1 || echo "cmake not found"
  echo "cores: $(nproc)"
  git -C "$ROOT" log --oneline -1 2>/dev/null || true
} >> "$LOG" 2>&1

NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
JOBS=$(nproc)
# Build for this GPU only (half the compile time of the default sm_80 + sm_90).
CAP=$(timeout 20 nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
case "$CAP" in
  [0-9][0-9] | [0-9][0-9][0-9]) ARCH=$CAP ;;
  *) ARCH="80-real;90" ;;
esac
log "GPU compute capability '${CAP:-unknown}': building for CMAKE_CUDA_ARCHITECTURES=$ARCH"

HAVE_CMAKE=0
command -v cmake >/dev/null 2>&1 && HAVE_CMAKE=1
BENCH=""
# Make (keep going with -k) unless only Ninja is there (-k 0).
GEN=(); KEEP=(-- -k)
if ! command -v make >/dev/null 2>&1 && command -v ninja >/dev/null 2>&1; then GEN=(-G Ninja); KEEP=(-- -k 0); fi
CONFIG=(-S "$ROOT" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DSEQPAR_ENABLE_CUDA=ON
  -DSEQPAR_ENABLE_NCCL=AUTO -DSEQPAR_ENABLE_MPI=OFF -DSEQPAR_BUILD_TESTS=ON -DSEQPAR_BUILD_EXAMPLES=OFF
  -DSEQPAR_BUILD_BENCHMARKS=OFF "-DCMAKE_CUDA_ARCHITECTURES=$ARCH" -DCMAKE_CUDA_COMPILER="$NVCC")
# No doctest on the machine (GPU images often lack it, and nothing can be installed there): the
# tests build against the minimal stand-in in tests/gpu/support/doctest_fallback.
if ! echo '#include <doctest/doctest.h>' | "${CXX:-c++}" -std=c++17 -x c++ -fsyntax-only - >/dev/null 2>&1; then
  log "doctest not found: using tests/gpu/support/doctest_fallback"
  CONFIG+=("-DDOCTEST_INCLUDE_DIR=$ROOT/tests/gpu/support/doctest_fallback")
fi
# NCCL outside the toolkit: the pip wheel (nvidia-nccl-cu13) that PyTorch images carry.
if [ -z "${NCCL_ROOT:-}" ] && [ ! -e /usr/local/cuda/include/nccl.h ] && [ ! -e /usr/include/nccl.h ]; then
  PYNCCL=$(timeout 30 python3 -c 'import nvidia.nccl as m, os; print(os.path.dirname(m.__file__) if m.__file__ else list(m.__path__)[0])' 2>/dev/null)
  if [ -n "$PYNCCL" ] && [ -e "$PYNCCL/include/nccl.h" ]; then
    export NCCL_ROOT=$PYNCCL
    log "NCCL from the Python wheel: NCCL_ROOT=$NCCL_ROOT"
  fi
fi
# A second try without the install rules and NCCL: neither is needed to test, and either can
# be what a half-finished checkout or an odd machine trips over.
if [ $HAVE_CMAKE -eq 1 ] && { SOFT=1 step configure 120 cmake "${CONFIG[@]}" ||
    { rm -f "$BUILD/CMakeCache.txt"; step configure-minimal 120 cmake "${CONFIG[@]}" -DSEQPAR_INSTALL=OFF \
      -DSEQPAR_ENABLE_NCCL=OFF; }; }; then
  TARGETS="seqpar_gpu_bench test_tile_math test_gpu_kernel test_gpu_masks test_gpu_decode test_gpu_policies_f32 test_gpu_policies_f16 test_gpu_policies_bf16"
  grep -q "test_gpu_nccl" "$BUILD/tests/gpu/CTestTestfile.cmake" 2>/dev/null && TARGETS="$TARGETS test_gpu_nccl"
  # One build of everything, all cores, keep going past a failing target: whatever builds runs.
  # shellcheck disable=SC2086
  step build "${SEQPAR_GPU_BUILD_LIMIT_S:-300}" cmake --build "$BUILD" -j "$JOBS" --target $TARGETS "${KEEP[@]}"
  [ -x "$BUILD/tests/gpu/seqpar_gpu_bench" ] && BENCH=$BUILD/tests/gpu/seqpar_gpu_bench
fi
if [ -z "$BENCH" ] && [ "$(left)" -gt 150 ]; then
  log "no CMake build of the benchmark: compiling it with nvcc directly"
  GENCODE="-gencode arch=compute_90,code=sm_90 -gencode arch=compute_80,code=sm_80"
  [[ $ARCH =~ ^[0-9]+$ ]] && GENCODE="-gencode arch=compute_${ARCH},code=sm_${ARCH}"
  # shellcheck disable=SC2086
  step build-bench-nvcc 200 "$NVCC" -std=c++20 -O3 --expt-relaxed-constexpr -diag-suppress=554 $GENCODE \
    -Xcompiler -pthread -I"$ROOT/include" "$ROOT/tests/gpu/bench_gpu.cu" -o "$BUILD/seqpar_gpu_bench" &&
    BENCH=$BUILD/seqpar_gpu_bench
fi

# Tests, leaving about two minutes for the benchmark.
if [ -x "$BUILD/tests/test_tile_math" ]; then step test-tile-math 60 "$BUILD/tests/test_tile_math"; fi
if [ -x "$BUILD/tests/gpu/test_gpu_kernel" ]; then
  LIMIT=$(($(left) - 130))
  [ $LIMIT -gt 220 ] && LIMIT=220
  [ $LIMIT -lt 60 ] && LIMIT=60
  step ctest-gpu $LIMIT ctest --test-dir "$BUILD" -L gpu --output-on-failure --timeout 150 -j 3
  # The ctest verdict goes to the table; a "Skipped" GPU test means the device was not seen.
  grep -E "tests passed|tests failed|Skipped|Failed|Timeout|Not Run" "$LOG" | grep -v "BEGIN\|END" | tail -14 \
    > "$BUILD/ctest_summary.txt" || true
  if grep -q "Skipped" "$BUILD/ctest_summary.txt"; then
    log "GPU tests were SKIPPED: the tests saw no CUDA device (see the SKIPPED line in the log)"
    SUMMARY+=("gpu tests|SKIPPED: no device seen||")
    FAILED=1
  fi
  if command -v compute-sanitizer >/dev/null 2>&1 && [ "$(left)" -gt 200 ]; then
    # Exit 9: the tool found an error (a failure). Any other failure means the tool could not
    # run here (some sandboxes refuse it): noted, not counted.
    for tool in memcheck racecheck; do
      SOFT=1 step "$tool" 45 compute-sanitizer --tool "$tool" --error-exitcode 9 \
        "$BUILD/tests/gpu/test_gpu_kernel" -tc="*smoke*"
      rc=$?
      if [ $rc -eq 9 ]; then FAILED=1; SUMMARY[${#SUMMARY[@]}-1]="$tool|ERRORS FOUND (see the log)||"; fi
    done
  else
    log "no compute-sanitizer pass (not installed, or no time)"
  fi
fi

BENCH_OUT=$BUILD/bench_output.txt
: > "$BENCH_OUT"
if [ -n "$BENCH" ]; then
  if [ "$(left)" -gt 150 ]; then
    step bench 240 bash -o pipefail -c "'$BENCH' | tee '$BENCH_OUT'"
  else
    step bench-quick 100 bash -o pipefail -c "'$BENCH' --quick | tee '$BENCH_OUT'"
  fi
fi

{
  echo "# seqpar GPU check ($(date -u +%Y-%m-%dT%H:%MZ))"
  echo
  timeout 10 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1
  echo
  echo "| step | status | seconds |"
  echo "|---|---|---|"
  for s in "${SUMMARY[@]}"; do
    IFS='|' read -r n st dt _ <<< "$s"
    echo "| $n | $st | $dt |"
  done
  if [ -s "$BUILD/ctest_summary.txt" ]; then
    echo
    echo '```'
    cat "$BUILD/ctest_summary.txt"
    echo '```'
  fi
  # The benchmark's own tables (from its first "## " heading on).
  if [ -s "$BENCH_OUT" ]; then
    echo
    sed -n '/^## /,$p' "$BENCH_OUT"
  fi
  echo
  echo "total: $(($(date +%s) - START)) s, overall: $([ $FAILED -eq 0 ] && echo PASS || echo FAIL)"
} > "$TABLE"
cat "$TABLE" >> "$LOG"
echo
echo "======================================================================"
cat "$TABLE"
exit $FAILED
