#!/usr/bin/env bash
# Builds the DEPS folder that bench/gpu_deps.sh carries to the lent GPU machine (its image has
# none of scripts/install-deps.sh's packages and cannot fetch them): the Debian 12 packages the
# build needs, unpacked (dpkg -x) under DEPS/usr, and the shared libraries they load that such a
# machine may lack in DEPS/fallback. Needs apt-get download (no root).
#   bench/make_gpu_deps.sh [DEPS]     (default: .gpu-deps in the repository root, git-ignored)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEPS=${1:-$ROOT/.gpu-deps}
PKGS=(libhwy-dev libhwy1 nlohmann-json3-dev libcli11-dev libfmt-dev libfmt9 libgtest-dev
  libcpp-httplib-dev libcpp-httplib0.11 pkgconf pkgconf-bin libpkgconf3 libssl-dev libbrotli-dev
  zlib1g-dev)
RUNTIME=(libssl3 libbrotli1 zlib1g)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download "${PKGS[@]}" "${RUNTIME[@]}" > /dev/null)
rm -rf "$DEPS"
mkdir -p "$DEPS/fallback"
for p in "${PKGS[@]}"; do dpkg -x "$work/${p}"_*.deb "$DEPS"; done
# The carry is limited (64 MiB with the tree): static libraries only where the build links them.
find "$DEPS" -name "*.a" ! -name "libgtest*.a" -delete
rm -rf "$DEPS/usr/share/doc" "$DEPS/usr/share/man"
for p in "${RUNTIME[@]}"; do
  dpkg -x "$work/${p}"_*.deb "$work/rt"
done
find "$work/rt" -name "*.so.*" \( -type f -o -type l \) -exec cp -a {} "$DEPS/fallback/" \;
echo "$DEPS: $(du -sh "$DEPS" | cut -f1)"
