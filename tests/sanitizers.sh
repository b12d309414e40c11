#!/usr/bin/env bash
# Builds the tests that exercise ThreadCommunicator (threads, communication, policies, faults,
# bad input), and the CPU emulation of the CUDA device's self-test (fibers, fiber stacks reused
# and unmapped, kernels on several threads; only where the CUDA headers are), under the `asan`
# (ASan + UBSan) and `tsan` presets of CMakePresets.json and runs them; any sanitizer report
# fails. Sized for CI on 2 cores: only these targets, ASan at -O0 and TSan at -O1 (CMakePresets.json).
#
# Usage: tests/sanitizers.sh [asan] [tsan]     (default: both)
# Env:   SEQPAR_SANITIZER_TESTS  space-separated test names (default below)
#        SEQPAR_SANITIZER_JOBS   build parallelism (default: nproc)
set -euo pipefail
cd "$(dirname "$0")/.."

read -r -a tests <<<"${SEQPAR_SANITIZER_TESTS:-test_thread_communicator test_faults test_call_isolation test_errors test_policies test_thread_comm_alloc test_cpu_flash_backward_threads emu_test_device}"
jobs="${SEQPAR_SANITIZER_JOBS:-$(nproc)}"
presets=("$@")
[[ ${#presets[@]} -eq 0 ]] && presets=(asan tsan)

for preset in "${presets[@]}"; do
  case "$preset" in asan | tsan) ;; *) echo "sanitizers.sh: unknown preset '$preset' (asan or tsan)" >&2; exit 2 ;; esac
  start=$SECONDS
  echo "== $preset: configure"
  # Ninja builds the test programs in parallel; Makefiles would build one target at a time.
  generator=()
  if [[ ! -f "build-$preset/CMakeCache.txt" ]] && command -v ninja >/dev/null; then generator=(-G Ninja); fi
  cmake --preset "$preset" "${generator[@]}" >/dev/null
  no_emu=""  # without the CUDA headers, tests/emu defines no targets
  if grep -q '^SEQPAR_EMU_CUDA_INCLUDE:.*-NOTFOUND$' "build-$preset/CMakeCache.txt"; then
    no_emu=1
    echo "== $preset: no CUDA headers: the emu_* tests are skipped"
  fi
  targets=()
  for t in "${tests[@]}"; do [[ -n $no_emu && $t == emu_* ]] || targets+=("$t"); done
  regex="^($(IFS='|'; echo "${targets[*]}"))\$"
  echo "== $preset: build ${targets[*]}"
  cmake --build --preset "$preset" -j "$jobs" --target "${targets[@]}"
  echo "== $preset: run"
  ctest --preset "$preset" -R "$regex" --no-tests=error -j "$jobs"
  echo "== $preset: passed in $((SECONDS - start)) s"
done
