#!/usr/bin/env bash
# Mutation check: does the test suite catch the faults it claims to? For every mutant in
# tests/mutants/mutants.txt (a literal edit of one library file, with the tests that must
# catch it) this script, in a scratch copy of the working tree:
#   1. checks that every mutant's pattern occurs exactly as often as its block says (a
#      pattern that is missing is an error, never a mutant that "applies nothing");
#   2. builds the union of the mutants' test targets unmutated and runs their tests: all must
#      pass, or the run stops (a failing baseline would make every mutant look killed);
#   3. per mutant: applies the edit, builds only that mutant's targets (one build directory,
#      reused), runs its tests through ctest, restores the file;
# and prints one line per mutant: KILLED (by which tests, and the first failing test case of
# each), SURVIVED, or ERROR (pattern not found, does not compile, test not configured).
# Exit status: 0 all killed, 1 some survived, 2 an error.
#
# Usage: tests/mutants/run.sh [--only NAME[,NAME...]] [--list] [-j N] [--scratch DIR] [--file FILE]
#   --only     run only these mutants (the baseline then builds and runs only their tests)
#   --list     print the mutants and exit
#   -j N       build jobs (default 2)
#   --scratch  scratch directory (default $SEQPAR_MUTANTS_DIR, else ${TMPDIR:-/tmp}/seqpar-mutants):
#              src/ (the copy), build/ (reused between runs), logs/ (build and test logs)
#   --file     another list of mutants in the format of mutants.txt (default: mutants.txt)
#
# The copy is the working tree as git sees it (tracked and untracked files, not ignored ones),
# so uncommitted tests count; files are copied only when their content changed, so a rerun
# rebuilds only what changed. Needs bash, git, perl, cmake (3.20+), ninja, a C++20 compiler;
# the mpi-offset mutant needs MPI (tests test_mpi_3, test_mpi_4), amx-backward-query-tail a CPU
# with AMX (its path runs nowhere else). The build is the project's
# Release build without CUDA, examples and benchmarks.
#
# Time: about 30 minutes on 2 cores for the 16 mutants of mutants.txt from an empty scratch
# directory: the baseline build of the ten test programs involved takes ~8 minutes, each mutant
# rebuilds one to three of them (30 s to 4 minutes; test_cpu_flash_kernel, which compiles its
# kernels once per vector instruction set, is the slowest). The tests themselves take seconds.
# tests/mutants/README.md says what each mutant is and has the table of the last full run.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
mutants_file="$here/mutants.txt"
scratch="${SEQPAR_MUTANTS_DIR:-${TMPDIR:-/tmp}/seqpar-mutants}"
jobs=2
only=""
list_only=0

usage() { sed -n '/^# Usage:/,/^#   --file/p' "$0" | sed 's/^# \{0,1\}//'; }
die() {
  echo "run.sh: $*" >&2
  exit 2
}

while [ $# -gt 0 ]; do
  case "$1" in
    --only) only="${2:?--only needs a list of names}"; shift 2 ;;
    --list) list_only=1; shift ;;
    -j) jobs="${2:?-j needs a number}"; shift 2 ;;
    --scratch) scratch="${2:?--scratch needs a directory}"; shift 2 ;;
    --file) mutants_file="${2:?--file needs a file}"; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument '$1'" ;;
  esac
done
case "$jobs" in '' | *[!0-9]*) die "-j: expected a number, got '$jobs'" ;; esac
[ -f "$mutants_file" ] || die "--file: no file '$mutants_file'"

# --- the mutants -----------------------------------------------------------------------------
# One entry per block; from/to lists are joined with the unit separator.
sep=$'\x1f'
M_NAME=() M_WHAT=() M_FILE=() M_FROM=() M_TO=() M_COUNT=() M_FIRST=() M_BUILD=() M_TESTS=()
b_name="" b_what="" b_file="" b_from="" b_to="" b_count=1 b_first=no b_build="" b_tests="" b_line=0
flush_block() {
  if [ -z "$b_name$b_file$b_from" ]; then return; fi
  [ -n "$b_name" ] || die "$mutants_file:$b_line: a block without name"
  for key in file from build tests; do
    eval "[ -n \"\$b_$key\" ]" || die "$mutants_file: mutant '$b_name' has no '$key'"
  done
  [ "$(printf '%s' "$b_from" | tr -cd "$sep" | wc -c)" = "$(printf '%s' "$b_to" | tr -cd "$sep" | wc -c)" ] ||
    die "$mutants_file: mutant '$b_name': every 'from' needs its 'to'"
  M_NAME+=("$b_name") M_WHAT+=("$b_what") M_FILE+=("$b_file") M_FROM+=("$b_from") M_TO+=("$b_to")
  M_COUNT+=("$b_count") M_FIRST+=("$b_first") M_BUILD+=("$b_build") M_TESTS+=("$b_tests")
  b_name="" b_what="" b_file="" b_from="" b_to="" b_count=1 b_first=no b_build="" b_tests=""
}
append() { if [ -z "$1" ]; then printf '%s' "$2"; else printf '%s%s%s' "$1" "$sep" "$2"; fi; }
lineno=0
while IFS= read -r line || [ -n "$line" ]; do
  lineno=$((lineno + 1))
  case "$line" in
    '#'*) continue ;;
    '') flush_block; continue ;;
  esac
  key="${line%%:*}"
  value="${line#*:}"
  value="${value# }"
  [ "$key" != "$line" ] || die "$mutants_file:$lineno: expected 'key: value', got '$line'"
  [ -n "$b_name$b_file$b_from" ] || b_line=$lineno
  case "$key" in
    name) b_name="$value" ;;
    what) b_what="$value" ;;
    file) b_file="$value" ;;
    from) b_from=$(append "$b_from" "$value") ;;
    to) b_to=$(append "$b_to" "$value") ;;
    count) b_count="$value" ;;
    first) b_first="$value" ;;
    build) b_build="$value" ;;
    tests) b_tests="$value" ;;
    *) die "$mutants_file:$lineno: unknown key '$key'" ;;
  esac
done < "$mutants_file"
flush_block
[ ${#M_NAME[@]} -gt 0 ] || die "$mutants_file: no mutants"

selected=()
for i in "${!M_NAME[@]}"; do
  if [ -z "$only" ] || [[ ",$only," == *",${M_NAME[$i]},"* ]]; then selected+=("$i"); fi
done
if [ -n "$only" ]; then
  IFS=, read -ra wanted <<< "$only"
  for w in "${wanted[@]}"; do
    found=0
    for i in "${!M_NAME[@]}"; do [ "${M_NAME[$i]}" = "$w" ] && found=1; done
    [ $found = 1 ] || die "--only: no mutant named '$w' (--list shows them)"
  done
fi

if [ $list_only = 1 ]; then
  for i in "${selected[@]}"; do
    printf '%-18s %s\n%-18s file %s; tests %s\n' "${M_NAME[$i]}" "${M_WHAT[$i]}" "" "${M_FILE[$i]}" "${M_TESTS[$i]}"
  done
  exit 0
fi

# --- the scratch copy ------------------------------------------------------------------------
src="$scratch/src" build="$scratch/build" logs="$scratch/logs"
mkdir -p "$src" "$build" "$logs"
exec 9> "$scratch/lock"
flock -n 9 || die "another run.sh is using $scratch (or pass --scratch DIR)"

# Copies a file only when its content differs (the copy gets a new time stamp, so everything
# that includes it rebuilds; an unchanged file keeps its stamp and nothing rebuilds), and
# deletes what the working tree no longer has.
sync_copy() {
  local listing="$scratch/files.txt" f
  (cd "$repo" && git ls-files -z -co --exclude-standard) > "$listing"
  while IFS= read -r -d '' f; do
    [ -f "$repo/$f" ] || continue  # deleted but not yet staged
    if ! cmp -s "$repo/$f" "$src/$f"; then
      mkdir -p "$(dirname "$src/$f")"
      cp "$repo/$f" "$src/$f"
    fi
  done < "$listing"
  (cd "$src" && find . -type f -printf '%P\0') | while IFS= read -r -d '' f; do
    grep -qzxF -- "$f" "$listing" || rm -f "$src/$f"
  done
}
echo "copying the working tree to $src"
sync_copy

if [ ! -f "$build/build.ninja" ]; then
  echo "configuring $build"
  cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSEQPAR_ENABLE_CUDA=OFF \
    -DSEQPAR_BUILD_EXAMPLES=OFF -DSEQPAR_BUILD_BENCHMARKS=OFF > "$logs/configure.log" 2>&1 ||
    die "configure failed: $logs/configure.log"
fi

# --- applying a mutant -----------------------------------------------------------------------
# Applies mutant $1 to the file under $2 (a source tree); prints why not and fails if a pattern
# does not occur exactly `count` times or the file did not change.
apply_mutant() {
  local i=$1 root=$2 f n k
  f="$root/include/seqpar/${M_FILE[$i]}"
  [ -f "$f" ] || { echo "file include/seqpar/${M_FILE[$i]} not found"; return 1; }
  local -a froms tos
  IFS="$sep" read -ra froms <<< "${M_FROM[$i]}"
  IFS="$sep" read -ra tos <<< "${M_TO[$i]}"
  cp "$f" "$f.pristine"
  for k in "${!froms[@]}"; do
    n=$(FROM="${froms[$k]}" perl -0777 -ne '$n = () = /\Q$ENV{FROM}\E/g; print $n' "$f")
    if [ "$n" != "${M_COUNT[$i]}" ]; then
      mv "$f.pristine" "$f"
      if [ "$n" = 0 ]; then echo "pattern not found: '${froms[$k]}'"; else echo "pattern found $n times, expected ${M_COUNT[$i]}: '${froms[$k]}'"; fi
      return 1
    fi
    if [ "${M_FIRST[$i]}" = yes ]; then
      FROM="${froms[$k]}" TO="${tos[$k]}" perl -0777 -i -pe 's/\Q$ENV{FROM}\E/$ENV{TO}/' "$f"
    else
      FROM="${froms[$k]}" TO="${tos[$k]}" perl -0777 -i -pe 's/\Q$ENV{FROM}\E/$ENV{TO}/g' "$f"
    fi
  done
  if cmp -s "$f" "$f.pristine"; then
    mv "$f.pristine" "$f"
    echo "the edit changes nothing"
    return 1
  fi
}
# Puts mutant $1's file back (a fresh time stamp: whatever was built from the mutant rebuilds).
restore_mutant() {
  local f="$src/include/seqpar/${M_FILE[$1]}"
  cp "$f.pristine" "$f"
  rm -f "$f.pristine"
}
current=""
trap '[ -z "$current" ] || restore_mutant "$current"' EXIT

# Every pattern checked on a throw-away copy of each file first: a stale pattern stops the
# run before any build.
status=()
check_dir="$scratch/check"
for i in "${selected[@]}"; do
  rm -rf "$check_dir"
  mkdir -p "$(dirname "$check_dir/include/seqpar/${M_FILE[$i]}")"
  [ -f "$src/include/seqpar/${M_FILE[$i]}" ] && cp "$src/include/seqpar/${M_FILE[$i]}" "$check_dir/include/seqpar/${M_FILE[$i]}"
  if why=$(apply_mutant "$i" "$check_dir"); then status[$i]=""; else status[$i]="ERROR $why"; fi
done
rm -rf "$check_dir"

# --- baseline --------------------------------------------------------------------------------
known_targets=$(ninja -C "$build" -t targets all 2>/dev/null | sed 's/:.*//')
known_tests=$(ctest --test-dir "$build" -N 2>/dev/null | sed -n 's/^ *Test *#[0-9]*: //p')
missing() {  # names of $2 (a list) that are not in $1 (lines)
  local have=$1 n out=""
  for n in $2; do grep -qxF -- "$n" <<< "$have" || out="$out $n"; done
  printf '%s' "${out# }"
}
for i in "${selected[@]}"; do
  [ -z "${status[$i]}" ] || continue
  m_t=$(missing "$known_targets" "${M_BUILD[$i]}")
  m_c=$(missing "$known_tests" "${M_TESTS[$i]}")
  if [ -n "$m_t$m_c" ]; then status[$i]="ERROR not configured here:${m_t:+ targets $m_t}${m_c:+ tests $m_c}"; fi
done
# The baseline: the tests of every mutant that can run.
declare -A targets=() tests=()
for i in "${selected[@]}"; do
  [ -z "${status[$i]}" ] || continue
  for t in ${M_BUILD[$i]}; do targets[$t]=1; done
  for t in ${M_TESTS[$i]}; do tests[$t]=1; done
done
base_targets="${!targets[*]}" base_tests="${!tests[*]}"

run_test() {  # $1 test, $2 log: 0 when it passes
  ctest --test-dir "$build" -R "^$1\$" --no-tests=error --output-on-failure > "$2" 2>&1
}
first_failure() {  # the first failing doctest test case named in log $1, or what ended the run
  local tc
  tc=$(grep -m1 -E '^TEST CASE: ' "$1" | sed 's/^TEST CASE: *//') || true
  if [ -n "$tc" ]; then printf '%s' "$tc"; return; fi
  if grep -q -m1 -E '\*\*\*Timeout' "$1"; then printf 'timed out'; return; fi
  grep -m1 -E 'FATAL|Exception|Failed|\*\*\*' "$1" | sed 's/^ *//' | cut -c1-80 || true
}

start=$(date +%s)
if [ -n "$base_targets" ]; then
  echo "baseline: building $base_targets"
  cmake --build "$build" -j "$jobs" --target $base_targets > "$logs/baseline.build.log" 2>&1 ||
    die "the unmutated tree does not build: $logs/baseline.build.log"
  for t in $base_tests; do
    run_test "$t" "$logs/baseline.$t.log" ||
      die "baseline: $t fails without any mutant ($(first_failure "$logs/baseline.$t.log")): $logs/baseline.$t.log"
  done
  echo "baseline: $(echo $base_tests | wc -w) tests pass ($(($(date +%s) - start)) s)"
fi

# --- the mutants -----------------------------------------------------------------------------
survived=0 errors=0
for i in "${selected[@]}"; do
  name=${M_NAME[$i]}
  t0=$(date +%s)
  if [ -z "${status[$i]}" ]; then
    if ! why=$(apply_mutant "$i" "$src"); then
      status[$i]="ERROR $why"
    else
      current=$i
      if ! cmake --build "$build" -j "$jobs" --target ${M_BUILD[$i]} > "$logs/$name.build.log" 2>&1; then
        status[$i]="ERROR does not compile: $logs/$name.build.log"
      else
        killers="" missed=""
        for t in ${M_TESTS[$i]}; do
          if run_test "$t" "$logs/$name.$t.log"; then
            missed="$missed $t"
          else
            killers="$killers, $t ($(first_failure "$logs/$name.$t.log"))"
          fi
        done
        if [ -n "$killers" ]; then
          status[$i]="KILLED by ${killers#, }${missed:+; not by$missed}"
        else
          status[$i]="SURVIVED (${missed# }: all pass)"
        fi
      fi
      restore_mutant "$i"
      current=""
    fi
  fi
  case "${status[$i]}" in
    SURVIVED*) survived=$((survived + 1)) ;;
    ERROR*) errors=$((errors + 1)) ;;
  esac
  printf '%-18s %s  [%d s]\n' "$name" "${status[$i]}" "$(($(date +%s) - t0))"
done

echo
echo "mutants: ${#selected[@]}, survived: $survived, errors: $errors ($(($(date +%s) - start)) s; logs in $logs)"
[ $errors = 0 ] || exit 2
[ $survived = 0 ] || exit 1
exit 0
