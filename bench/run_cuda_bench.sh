#!/usr/bin/env bash
# Side-by-side GPU benchmark: ptllm against PyTorch (bench/torch_cuda_peer.py) on the same GPU in
# one run. Prints the raw peer= lines, then the ratios (bench/compare_cuda.py). A command that
# fails is reported and the rest still run.
#   bench/run_cuda_bench.sh [OUTFILE]      env: BIN (default build/ptllm), PY (default python3)
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
BIN=${BIN:-$ROOT/build/ptllm}
PY=${PY:-python3}
OUT=${1:-$ROOT/bench/results/cuda-$(date -u +%Y%m%d-%H%M).txt}
mkdir -p "$(dirname "$OUT")"
LOG=$(mktemp /tmp/ptllm-cuda-bench.XXXXXX)
BUNDLED="--n-layer 4 --n-head 4 --n-embd 256 --block-size 256"
SAMPLE="bench sample $BUNDLED --tokens 200 --repeats 5"
run() {
  echo "# \$ $*"
  "$@" || echo "# FAILED (exit $?): $*"
}
{
  echo "# $(date -u) $(nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader 2>/dev/null || echo '?')"
  # Decode first (the issue's goal): the default (the faster of the fused launch and the op
  # kernels, timed on the first step), each form forced (fused at 16 and 8 blocks), the f32
  # path the same way, the CPU.
  # A throwaway generation first: the session's first command ran ~10% slow (clocks ramping,
  # bench/results/cuda-20261203-*.txt), which made the default look slower than its own form.
  $BIN --device cuda bench sample $BUNDLED --tokens 200 > /dev/null 2>&1 || true
  run $BIN --device cuda $SAMPLE
  # Speculative greedy runs (4 lanes, and the default 6 on the checkpoint): on the bundled
  # checkpoint (its greedy text decides how many drafts are kept; the peer's speed does not
  # depend on weights) and on random weights.
  run $BIN --device cuda $SAMPLE --model "$ROOT/models/shakespeare.safetensors"
  run $BIN --device cuda $SAMPLE --model "$ROOT/models/shakespeare.safetensors" --speculative 4
  run $BIN --device cuda $SAMPLE --model "$ROOT/models/shakespeare.safetensors" --speculative 6
  run $BIN --device cuda $SAMPLE --speculative 4
  run $BIN --device cuda $SAMPLE --decode-cluster 16
  run $BIN --device cuda $SAMPLE --decode-cluster 8
  run $BIN --device cuda $SAMPLE --no-fused-step
  run $BIN --device cuda $SAMPLE --decode-form 1
  run $BIN --device cuda $SAMPLE --decode-form 2
  run $BIN --device cuda --paths f32 $SAMPLE --decode-form 1
  run $BIN --device cuda --paths f32 $SAMPLE --decode-form 2
  run $BIN --device cuda --paths f32 $SAMPLE
  run $BIN --device cuda --paths f32 $SAMPLE --decode-cluster 16
  run $BIN --device cuda --paths f32 $SAMPLE --no-fused-step
  run $BIN --device cpu bench sample $BUNDLED --tokens 200
  run env -u LD_LIBRARY_PATH PYTHONUNBUFFERED=1 $PY "$HERE/torch_cuda_peer.py"
  run $BIN --device cuda bench cuda
} 2>&1 | tee "$LOG"
{
  cat "$LOG"
  echo
  $PY "$HERE/compare_cuda.py" "$LOG"
} > "$OUT"
$PY "$HERE/compare_cuda.py" "$LOG"
echo "saved $OUT"
