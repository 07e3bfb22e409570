#!/usr/bin/env bash
# Side-by-side CPU benchmark: ptllm against the peers in ../shared/peers (PyTorch CPU nanoGPT,
# membw) on this machine, same thread count, in one run. Prints the raw peer= lines, then the
# ratios (bench/compare.py), and saves everything to bench/results/cpu-<date>.txt.
#   bench/run_bench.sh [REPS] [THREADS]       env: PEERS (default ../shared/peers), ONLY
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
REPS=${1:-3}
TH=${2:-2}
PEERS=${PEERS:-$ROOT/../shared/peers}
ONLY=${ONLY:-membw matmul gemm small bundled}
BIN=${BIN:-$ROOT/build/ptllm}
PY=/usr/bin/python3
want() { [[ " $ONLY " == *" $1 "* ]]; }
[[ -x $BIN ]] || { echo "build first: make build" >&2; exit 1; }
[[ -f $PEERS/torch_chargpt.py ]] || { echo "peers not found at $PEERS" >&2; exit 1; }
mkdir -p "$ROOT/bench/results" /tmp/ptllm-peers
OUT="$ROOT/bench/results/cpu-$(date -u +%Y%m%d-%H%M).txt"
LOG=$(mktemp /tmp/ptllm-bench.XXXXXX)
NOENV="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE -u OPENBLAS_NUM_THREADS -u OMP_NUM_THREADS"
gcc -O3 -march=native -fopenmp -o /tmp/ptllm-peers/membw "$PEERS/membw.c"
# OpenBLAS (what Debian's torch multiplies with) on the training step's GEMM shapes; its kernel
# set is auto-detected, as torch's is (NOENV drops any OPENBLAS_CORETYPE of the environment).
if want gemm; then
  gcc -O2 -o /tmp/ptllm-peers/gemm_peer "$HERE/gemm_peer.c" -lopenblas ||
    { echo "bench gemm: the OpenBLAS peer needs libopenblas-dev" >&2; exit 1; }
fi
SMALL="--n-layer 4 --n-head 4 --n-embd 128 --block-size 64"
BUNDLED="--n-layer 4 --n-head 4 --n-embd 256 --block-size 256"
T="$PY $PEERS/torch_chargpt.py"
{
  echo "# $(date -u) $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) threads=$TH"
  echo "# $BIN $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null)"
} | tee "$LOG"
for r in $(seq "$REPS"); do
  want membw && $NOENV /tmp/ptllm-peers/membw --threads "1,$TH" --passes 10 | tee -a "$LOG"
  want matmul && "$BIN" --threads "$TH" bench matmul 2>/dev/null | tee -a "$LOG"
  if want gemm; then
    "$BIN" --threads "$TH" bench gemm $BUNDLED --batch-size 16 --iters 10 | tee -a "$LOG"
    $NOENV OPENBLAS_NUM_THREADS="$TH" /tmp/ptllm-peers/gemm_peer --tokens 4096 --n-embd 256 \
      --iters 10 | tee -a "$LOG"
  fi
  for cfg in small bundled; do
    want $cfg || continue
    if [[ $cfg == small ]]; then A="$SMALL"; B=12; S=50; else A="$BUNDLED"; B=16; S=30; fi
    # torch: passive OpenMP wait (its fastest variant on 2 cores, see the peers README)
    $NOENV OMP_WAIT_POLICY=passive $T train $A --batch-size $B --steps $S --threads "$TH" | tee -a "$LOG"
    $NOENV OMP_WAIT_POLICY=passive $T sample $A --tokens 200 --threads "$TH" | tee -a "$LOG"
    for p in f32 auto; do
      "$BIN" --threads "$TH" --paths $p bench train $A --batch-size $B --steps $S 2>/dev/null | tee -a "$LOG"
      "$BIN" --threads "$TH" --paths $p bench sample $A --tokens 200 2>/dev/null | tee -a "$LOG"
    done
  done
done
$PY "$HERE/compare.py" "$LOG" | tee -a "$LOG"
cp "$LOG" "$OUT"
echo "saved $OUT" >&2
