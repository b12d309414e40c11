#!/usr/bin/env bash
# AArch64: the CPU kernels' 128-bit level is the only one off x86 (NEON there, through the same
# GCC vector extensions). This cross-builds CPU test programs with g++-aarch64-linux-gnu,
# statically, and runs them under qemu-aarch64 (user-mode emulation), so that the NEON copy is
# tested on an x86 machine: its conversions of fp16 and bf16, its tiles, softmax and backward,
# the decode path, the policies over thread ranks.
#
# By hand, not in CI: about 4.5 minutes on 2 cores with the default tests (2 of builds, 2.5 of
# emulated runs); test_cpu_flash_kernel adds 6 minutes of emulation: ask for it by name.
# When run as root, installs what is missing (g++-aarch64-linux-gnu qemu-user doctest-dev).
#
# Usage: tests/cross/aarch64.sh [TEST...]
#   default: test_f16 test_bf16 test_decode test_policies test_cpu_flash_backward_threads
#   SEQPAR_CROSS_DIR  where the binaries go (default: build-aarch64)
# Exit status: 0 when every test program passes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

tests=("$@")
((${#tests[@]})) || tests=(test_f16 test_bf16 test_decode test_policies test_cpu_flash_backward_threads)
bash scripts/need_packages.sh g++-aarch64-linux-gnu qemu-user doctest-dev || exit 2

out=${SEQPAR_CROSS_DIR:-build-aarch64}
mkdir -p "$out"
failed=()
for t in "${tests[@]}"; do
  [[ -f tests/$t.cpp ]] || { echo "aarch64.sh: no tests/$t.cpp" >&2; exit 2; }
  start=$SECONDS
  # -static: qemu-aarch64 then needs no AArch64 loader or libraries on this machine.
  aarch64-linux-gnu-g++ -std=c++20 -O2 -DNDEBUG -Wall -Wextra -Wno-psabi -Iinclude -Itests -static -pthread \
    tests/support/doctest_main.cpp "tests/$t.cpp" -o "$out/$t"
  built=$((SECONDS - start))
  if qemu-aarch64 "$out/$t" > "$out/$t.log" 2>&1; then
    echo "$t: passed (built in $built s, ran $((SECONDS - start - built)) s)"
  else
    echo "$t: FAILED (log: $out/$t.log)"
    tail -20 "$out/$t.log"
    failed+=("$t")
  fi
done
((${#failed[@]} == 0)) || { echo "aarch64.sh: failed: ${failed[*]}" >&2; exit 1; }
