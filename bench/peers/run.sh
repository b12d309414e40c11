#!/usr/bin/env bash
# The peer benchmark (bench/peers/README.md): seqpar against torch, yunchang and diffusers on
# this machine's CPU. Not part of CI or of the library's build.
#
#   bash bench/peers/run.sh [BUILD_DIR] [peers.py options...]
#
# BUILD_DIR (default build/, as scripts/setup.sh makes it) must be a CMake build of seqpar with
# MPI; seqpar_demo is (re)built there. PEERS_VENV (default /work/peers-venv) is the Python
# venv for the peers, made outside the repository on first use. The report goes to stdout and
# to docs/perf/peers.md (PEERS_OUT overrides). peers.py --help lists the options.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
command="bash bench/peers/run.sh $*"
build="build"
if [[ $# -gt 0 && $1 != -* ]]; then build="$1"; shift; fi
[[ $build = /* ]] || build="$repo/$build"
venv="${PEERS_VENV:-/work/peers-venv}"
out="${PEERS_OUT:-$repo/docs/perf/peers.md}"

case "$venv/" in "$repo"/*) echo "run.sh: PEERS_VENV must be outside the repository ($repo)" >&2; exit 2 ;; esac

# 1. The peers' venv.
if ! "$venv/bin/python" -c "import torch, yunchang, diffusers" 2>/dev/null; then
  echo "run.sh: installing the peers into $venv (about 6 GB, a few minutes)" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q -r "$here/requirements.txt"
fi

# 2. seqpar_demo over MPI.
command -v mpirun >/dev/null || { echo "run.sh: mpirun not found: apt-get install -y libopenmpi-dev openmpi-bin" >&2; exit 2; }
if [[ ! -f $build/CMakeCache.txt ]]; then
  cmake -S "$repo" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSEQPAR_ENABLE_CUDA=OFF -DSEQPAR_BUILD_TESTS=OFF
fi
cmake --build "$build" --target seqpar_demo -j2

# 3. The kernel's C ABI for Python, with the flags of the project's own programs
#    (seqpar_dev_flags in CMakeLists.txt: -march=native, and -mno-avx512f on GCC < 13; the
#    kernel itself picks its vector width at run time).
cxx="${CXX:-g++}"
flags=(-O3 -DNDEBUG -std=c++20 -Wall -Wextra -march=native -shared -fPIC)
if "$cxx" --version | head -1 | grep -qE '^(g\+\+|c\+\+|gcc)' &&
   [[ $("$cxx" -dumpversion | cut -d. -f1) -lt 13 ]]; then
  flags+=(-mno-avx512f)
fi
mkdir -p "$build/peers"
"$cxx" "${flags[@]}" -I "$repo/include" "$here/seqpar_shim.cpp" -o "$build/peers/libseqpar_shim.so"

# 4. The two tables.
export PYTHONWARNINGS=ignore::FutureWarning  # torch.jit.script, funcol.all_gather_tensor
exec "$venv/bin/python" "$here/peers.py" --shim "$build/peers/libseqpar_shim.so" \
  --build "$build" --out "$out" --command "$command" "$@"
