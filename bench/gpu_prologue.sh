# shellcheck shell=bash
# Sourced on the device by the session scripts that may carry binaries built here
# (gpu_decode_ab.sh, gpu_speculative.sh), once OUT is set: makes OUT, starts the `say` clock,
# sources gpu_deps.sh with the carried packages (.gpu-deps) and writes the GPU's line to
# OUT/env.txt. prebuiltCheckout: whether the checkout path the prebuilt test binaries have
# compiled in (.ab-bin/srcdir) reaches this copy — it is this copy, or it was free and is now
# a link to it.
mkdir -p "$OUT"
t0=$(date +%s)
say() { echo "[$(($(date +%s) - t0))s] $*"; }
# shellcheck disable=SC2034  # read by gpu_deps.sh
DEPS=.gpu-deps
source bench/gpu_deps.sh
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; } 2>&1 | tee "$OUT/env.txt"

prebuiltCheckout() {
  [[ -f .ab-bin/srcdir ]] || return 1
  local src
  src=$(cat .ab-bin/srcdir)
  [[ "$(cd "$src" 2> /dev/null && pwd -P)" == "$(pwd -P)" ]] ||
    { [[ ! -e "$src" ]] && mkdir -p "$(dirname "$src")" && ln -s "$(pwd -P)" "$src"; }
}
