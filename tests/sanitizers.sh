#!/usr/bin/env bash
# Builds the tests that exercise ThreadCommunicator (threads, communication, policies, faults,
# bad input) under the `asan` (ASan + UBSan) and `tsan` presets of CMakePresets.json and runs
# them; any sanitizer report fails. Sized for CI on 2 cores: only these targets, at -O1.
#
# Usage: tests/sanitizers.sh [asan] [tsan]     (default: both)
# Env:   SEQPAR_SANITIZER_TESTS  space-separated test names (default below)
#        SEQPAR_SANITIZER_JOBS   build parallelism (default: nproc)
set -euo pipefail
cd "$(dirname "$0")/.."

read -r -a tests <<<"${SEQPAR_SANITIZER_TESTS:-test_thread_communicator test_faults test_errors test_policies test_thread_comm_alloc test_cpu_flash_backward_threads}"
jobs="${SEQPAR_SANITIZER_JOBS:-$(nproc)}"
presets=("$@")
[[ ${#presets[@]} -eq 0 ]] && presets=(asan tsan)

regex="^($(IFS='|'; echo "${tests[*]}"))\$"
for preset in "${presets[@]}"; do
  case "$preset" in asan | tsan) ;; *) echo "sanitizers.sh: unknown preset '$preset' (asan or tsan)" >&2; exit 2 ;; esac
  start=$SECONDS
  echo "== $preset: configure"
  # Ninja builds the test programs in parallel; Makefiles would build one target at a time.
  generator=()
  if [[ ! -f "build-$preset/CMakeCache.txt" ]] && command -v ninja >/dev/null; then generator=(-G Ninja); fi
  cmake --preset "$preset" "${generator[@]}" >/dev/null
  echo "== $preset: build ${tests[*]}"
  cmake --build --preset "$preset" -j "$jobs" --target "${tests[@]}"
  echo "== $preset: run"
  ctest --preset "$preset" -R "$regex" --no-tests=error
  echo "== $preset: passed in $((SECONDS - start)) s"
done
