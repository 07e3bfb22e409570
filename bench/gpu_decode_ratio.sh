#!/usr/bin/env bash
# The decode goal's ratio with the peer's noise in view: ptllm's default decode and PyTorch's
# generate for the bundled config, interleaved ROUNDS times in one call on one GPU, each round's
# ratio printed (PyTorch's eager generate is host-bound and moves ~1.5x between hosts and runs).
#   bench/gpu_decode_ratio.sh    env: OUT, JOBS, DEPS (as bench/gpu_session.sh), ROUNDS (4)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/gpu-ratio}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$OUT"
cd "$ROOT"
source "$ROOT/bench/gpu_deps.sh"
{ timeout "${BUILD_TIMEOUT:-300}" cmake -S . -B build "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release &&
  timeout "${BUILD_TIMEOUT:-300}" cmake --build build -j"$JOBS" --target ptllm; } \
  > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
BUNDLED="--n-layer 4 --n-head 4 --n-embd 256 --block-size 256"
{
  echo "# $(nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader)"
  build/ptllm --device cuda bench sample $BUNDLED --tokens 200 > /dev/null 2>&1  # clocks up
  for round in $(seq "${ROUNDS:-4}"); do
    ours=$(timeout 30 build/ptllm --device cuda bench sample $BUNDLED --tokens 200 --repeats 5 \
      2>&1 | grep "^peer=ptllm")
    theirs=$(env -u LD_LIBRARY_PATH timeout 90 python3 bench/torch_cuda_peer.py --no-gemm \
      --iters 10 2>&1 | grep "^peer=torch mode=sample")
    echo "$ours"
    echo "$theirs"
    o=$(sed -E 's/.* tok_s=([0-9.]+).*/\1/' <<< "$ours")
    t=$(sed -E 's/.* tok_s=([0-9.]+).*/\1/' <<< "$theirs")
    awk -v r="$round" -v o="$o" -v t="$t" \
      'BEGIN { printf "round %d: ptllm %.0f tok/s, torch %.0f tok/s: %.1fx\n", r, o, t, o / t }'
  done
} 2>&1 | tee "$OUT/ratio.txt"
