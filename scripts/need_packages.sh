#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages named on the command line that are missing, when run as
# root where apt-get is; otherwise names them on stderr and exits 3 (the caller decides whether
# to go on without them). Exit 0: all present (or installed now).
#   bash scripts/need_packages.sh PACKAGE...
set -euo pipefail
missing=()
for p in "$@"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
((${#missing[@]})) || exit 0
if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
  echo "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "not installing (needs root and apt-get): ${missing[*]}" >&2
  exit 3
fi
