#!/usr/bin/env bash
# One device call for the decode and GEMV work (issue #6), inside a 300 s limit: build only the
# binary and the CUDA tests, run those tests (the fused step's bit-identity under each of its
# forms too), then the decode bench for each form with its phase profile, PyTorch's peer, and
# `ptllm bench cuda` (GEMV schedules), each stage under its own timeout. Files under $OUT:
# env.txt build.log tests.log decode.txt bundled.txt torch.txt benchcuda.txt summary.txt.
#   bench/gpu_decode_session.sh    env: OUT, JOBS, DEPS (as bench/gpu_session.sh);
#     STAGES (default "tests decode bundled torch benchcuda": which stages run, in that order),
#     FORMS ("4 3 2 1": the fused forms timed), PROFILE_FORMS ("4 3 1": the forms profiled)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/gpu-decode}
STAGES=${STAGES:-tests decode bundled torch benchcuda}
FORMS=${FORMS:-4 3 2 1}
PROFILE_FORMS=${PROFILE_FORMS:-4 3 1}
want() { [[ " $STAGES " == *" $1 "* ]]; }
JOBS=${JOBS:-$(nproc)}
mkdir -p "$OUT"
cd "$ROOT"
t0=$(date +%s)
say() { echo "[$(($(date +%s) - t0))s] $*"; }
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1
  nvcc --version 2>&1 | tail -1
} > "$OUT/env.txt" 2>&1
source "$ROOT/bench/gpu_deps.sh"
say "build"
{ timeout "${BUILD_TIMEOUT:-120}" cmake -S . -B build "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release &&
  timeout "${BUILD_TIMEOUT:-120}" cmake --build build -j"$JOBS" --target ptllm \
    test_cuda_decode_step test_cuda_model test_cuda_ops test_cuda_paths; } > "$OUT/build.log" 2>&1
say "build exit $?"
grep -E "warning|error" "$OUT/build.log" | head -10
[[ -x build/ptllm ]] || exit 1

if want tests; then
say "tests"
{
  # The decode-step tests run every fused form themselves (Ops::decodeStepForms()).
  timeout "${TEST_TIMEOUT:-70}" ctest --test-dir build -R Cuda -j4 --output-on-failure
} > "$OUT/tests.log" 2>&1
grep -E "tests passed|tests failed|\(Failed\)|Timeout" "$OUT/tests.log" | head -20
say "tests done"
fi

BIN=build/ptllm
BUNDLED="--n-layer 4 --n-head 4 --n-embd 256 --block-size 256"
SAMPLE="bench sample $BUNDLED --tokens 200 --repeats 5"
if want decode; then
say "decode"
{
  echo "# $(nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader 2>/dev/null)"
  $BIN --device cuda bench sample $BUNDLED --tokens 200 > /dev/null 2>&1 || true  # clocks up
  for form in $FORMS; do
    for paths in "" "--paths f32"; do
      echo "# form $form $paths: fused x16"
      timeout 20 $BIN --device cuda $paths $SAMPLE --decode-cluster 16 --decode-form $form 2>&1 |
        grep "^peer="
    done
  done
  for paths in "" "--paths f32"; do
    # The greedy run graph (one launch running 32 steps where the form can, else 32 launches)
    # against 32 launches and against a replay and a pick launch per token, interleaved twice.
    for rep in 1 2; do
      echo "# default form, $paths default choice"
      timeout 20 $BIN --device cuda $paths $SAMPLE 2>&1 | grep "^peer="
      echo "# default form, $paths no persistent run"
      timeout 20 $BIN --device cuda $paths $SAMPLE --no-persistent-run 2>&1 | grep "^peer="
      echo "# default form, $paths no greedy run graph"
      timeout 20 $BIN --device cuda $paths $SAMPLE --no-greedy-run-graph 2>&1 | grep "^peer="
    done
    echo "# $paths op kernels"
    timeout 20 $BIN --device cuda $paths $SAMPLE --no-fused-step 2>&1 | grep "^peer="
  done
  for form in $PROFILE_FORMS; do
    for paths in "" "--paths f32"; do
      echo "# profile: form $form $paths"
      PTLLM_DECODE_PROFILE=1 timeout 20 $BIN --device cuda $paths \
        bench sample $BUNDLED --tokens 200 --decode-cluster 16 --decode-form $form 2>&1 |
        grep -E "^peer=|decode profile"
    done
  done
  # Form 4 profiled with a launch per step (the lines above, with whole-run launches, trace
  # the first steps of each run: kTraceMarks per launch).
  echo "# profile: form 4, no persistent run"
  PTLLM_DECODE_PROFILE=1 timeout 20 $BIN --device cuda bench sample $BUNDLED --tokens 200 \
    --decode-cluster 16 --decode-form 4 --no-persistent-run 2>&1 | grep -E "^peer=|decode profile"
} > "$OUT/decode.txt" 2>&1
grep -E "^# form|^# default|^# .*op kernels|us_token" "$OUT/decode.txt" |
  sed -E 's/.*path=([^ ]+).*step_form=([^ ]+).*fused_form=([^ ]+) greedy_graph=([^ ]+) persistent_run=([^ ]+).*us_token=([^ ]+) tok_s=([^ ]+) step_us=([^ ]+).*/  \1 \2 form=\3 greedy_graph=\4 persistent=\5 us_token=\6 tok_s=\7 step_us=\8/'
fi
if want bundled; then
say "bundled"
{
  # The bundled checkpoint's greedy text on the default choice (fused step, f16-storage when its
  # gates pass), on f32 on the GPU, and on f32 on the CPU: 200 characters each, to compare.
  for dev in "cuda" "cuda --paths f32" "cpu --paths f32"; do
    echo "# bundled model, greedy, --device $dev"
    timeout 60 $BIN --device $dev sample --prompt "ROMEO:" --tokens 200 --temperature 0 2>&1
  done
} > "$OUT/bundled.txt" 2>&1
grep "^# bundled" "$OUT/bundled.txt"
fi
if want torch; then
say "torch"
env -u LD_LIBRARY_PATH PYTHONUNBUFFERED=1 timeout 70 python3 bench/torch_cuda_peer.py \
  > "$OUT/torch.txt" 2>&1
grep "^peer=" "$OUT/torch.txt" | sed -E 's/^(.{0,150}).*/\1/'
fi
if want benchcuda; then
say "bench cuda"
timeout "${BENCH_TIMEOUT:-90}" $BIN --device cuda bench cuda > "$OUT/benchcuda.txt" 2>&1
grep -E "mode=(copy|gemv|gemv_graph)" "$OUT/benchcuda.txt" | grep -E "f16|variant|copy|cublaslt" |
  sed -E 's/peer=ptllm mode=//; s/ copies=[0-9]+//; s/weight_bytes=[0-9]+ //'
fi
cat "$OUT"/decode.txt "$OUT"/torch.txt "$OUT"/benchcuda.txt > /tmp/all.txt 2> /dev/null
python3 bench/compare_cuda.py /tmp/all.txt > "$OUT/summary.txt" 2>&1
grep -E "GEMV|decode" "$OUT/summary.txt" | head -20
say "done"
