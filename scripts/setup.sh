#!/usr/bin/env bash
# Sets up and builds seqpar on a Debian/Ubuntu machine, from any directory:
#   1. when run as root, installs the packages that are missing (apt-get);
#   2. configures (Release) and builds.
#
#   bash scripts/setup.sh        everything into build/ (tests, examples, the demo, the benchmarks as
#                                a compile check, and the CUDA and emulated GPU tests when nvcc is
#                                found; bench/run.sh builds and runs the measuring benchmarks)
#   bash scripts/setup.sh demo   only build-demo/tools/seqpar_demo/seqpar_demo: no tests, no
#                                examples, no benchmarks, no CUDA (the README's first command;
#                                about 75 s on an idle 2-core machine: three objects, one per
#                                element type, and the CPU kernel's files of those types)
#
# Idempotent: a second run installs nothing and rebuilds only what changed.
# Extra CMake options: SEQPAR_CMAKE_ARGS="-DSEQPAR_ENABLE_CUDA=OFF" bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

mode=${1:-all}
case "$mode" in
  all | demo) ;;
  -h | --help) sed -n '2,14p' "$0"; exit 0 ;;
  *) echo "setup.sh: unknown mode '$mode' (expected: demo, or nothing for everything)" >&2; exit 2 ;;
esac

# doxygen: the doxygen_no_warnings test exists only where it is installed.
packages=(g++ make ninja-build cmake git libopenmpi-dev openmpi-bin)
[[ $mode == all ]] && packages+=(doctest-dev libbenchmark-dev doxygen)
status=0
bash scripts/need_packages.sh "${packages[@]}" || status=$?
if ((status == 3)); then echo "setup.sh: trying to build anyway" >&2; elif ((status)); then exit "$status"; fi

jobs=$(nproc 2>/dev/null || echo 2)
if [[ $mode == demo ]]; then
  build=build-demo
  options=(-DSEQPAR_BUILD_TESTS=OFF -DSEQPAR_BUILD_EXAMPLES=OFF -DSEQPAR_BUILD_TOOLS=ON -DSEQPAR_BUILD_BENCHMARKS=OFF
           -DSEQPAR_ENABLE_CUDA=OFF)
  targets=(--target seqpar_demo)
else
  build=build
  # The benchmarks only as a compile check (-O0, they refuse to run): bench/run.sh builds the
  # measuring ones in build-bench/. It saves ~45 s of the suite's 2-core build.
  options=(-DSEQPAR_BENCH_COMPILE_ONLY=ON)
  targets=()
fi
# Ninja for a new build dir: it builds objects of every target in parallel, without Make's
# per-target dependency scans. An existing build dir keeps the generator it was configured with.
generator=()
if [[ ! -f $build/CMakeCache.txt ]] && command -v ninja >/dev/null; then generator=(-G Ninja); fi
# shellcheck disable=SC2086  # SEQPAR_CMAKE_ARGS is a list of options
cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "${options[@]}" ${SEQPAR_CMAKE_ARGS:-}
cmake --build "$build" -j "$jobs" "${targets[@]}"
