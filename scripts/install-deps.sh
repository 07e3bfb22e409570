#!/usr/bin/env bash
# Installs the Debian packages the build needs (only those missing). Root or sudo.
#   --tests: also what the browser tests need; --peers: also the benchmark peers.
set -euo pipefail
PKGS=(cmake g++ make pkg-config libhwy-dev nlohmann-json3-dev libcli11-dev libfmt-dev libgtest-dev libcpp-httplib-dev)
if [[ "${1:-}" == "--tests" ]]; then
  # The playground's browser and load tests (tests/web): Debian's Chromium driven by
  # playwright-core under Node.js (the machine's own Node.js when it has one).
  PKGS+=(chromium)
  command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 || PKGS+=(nodejs npm)
fi
if [[ "${1:-}" == "--peers" ]]; then
  # For bench/: PyTorch CPU and OpenBLAS peers (see ../shared/peers/README.md).
  PKGS+=(python3 python3-torch python3-numpy libopenblas-dev gcc)
fi
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}" >&2
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
