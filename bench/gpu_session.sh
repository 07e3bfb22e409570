#!/usr/bin/env bash
# Everything one device call does on the lent GPU machine: build from scratch, every GPU test,
# then the side-by-side bench. Logs under $OUT (the device tool brings back at most 8 files):
# env.txt, build.log, tests.log, bench.txt (run_cuda_bench.sh's saved output), bench-console.log.
# Without a GPU (a dry run) it builds, runs the GPU tests (they skip) and skips the bench.
#   bench/gpu_session.sh     env: OUT (default /tmp/gpu-session), JOBS (default: all cores),
#                            TEST_TIMEOUT (240 s), BENCH_TIMEOUT (200 s), DEPS (bench/gpu_deps.sh);
#                            for a shorter call: TARGETS (build only these, e.g. "ptllm
#                            test_cuda_paths"), TESTS (ctest -R regex, default Cuda), BENCH (a
#                            command run instead of run_cuda_bench.sh, its output in bench.txt)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/gpu-session}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$OUT"
cd "$ROOT"
t0=$(date +%s)
say() { echo "[$(($(date +%s) - t0))s] $*"; }
{
  date -u
  uname -a
  nvidia-smi 2>&1 | head -20
  nvcc --version 2>&1 | tail -2
  cmake --version 2>&1 | head -1
  git log --oneline -1 2>/dev/null || true
} > "$OUT/env.txt" 2>&1
source "$ROOT/bench/gpu_deps.sh"
say "configure + build (-j$JOBS)"
# -k 0: a target that fails to build (its errors are in build.log) does not stop the others;
# the session goes on when the binary and the GPU tests were built.
build_rc=0
TGT=()
[[ -n "${TARGETS:-}" ]] && TGT=(--target $TARGETS)
{ cmake -S . -B build "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release &&
  cmake --build build -j"$JOBS" "${TGT[@]}" -- -k 0; } > "$OUT/build.log" 2>&1 || build_rc=$?
if ((build_rc != 0)); then
  grep -E "error:|FAILED:" "$OUT/build.log" | head -20
  say "BUILD FAILED (exit $build_rc)"
  [[ -x build/ptllm ]] || exit 1
fi
grep -i "warning" "$OUT/build.log" | head -5
# The Hopper kernels must be on the tensor-core instructions (HGMMA), fed by TMA (UTMALDG).
if command -v cuobjdump > /dev/null; then
  for o in $(find build -name "*_sm90a.cu.o"); do
    echo "$o: $(cuobjdump --dump-sass "$o" | grep -c HGMMA) HGMMA, $(cuobjdump --dump-sass "$o" |
      grep -c UTMALDG) UTMALDG"
  done
fi
say "GPU tests"
timeout "${TEST_TIMEOUT:-240}" ctest --test-dir build -R "${TESTS:-Cuda}" -j4 --output-on-failure \
  > "$OUT/tests.log" 2>&1
rc=$?
grep -E "tests passed|tests failed|\(Failed\)|Timeout|Not Run" "$OUT/tests.log" | head -30
say "GPU tests done (exit $rc)"
if nvidia-smi > /dev/null 2>&1; then
  say "bench"
  if [[ -n "${BENCH:-}" ]]; then
    timeout "${BENCH_TIMEOUT:-200}" bash -c "$BENCH" > "$OUT/bench.txt" 2>&1
  else
    timeout "${BENCH_TIMEOUT:-200}" bench/run_cuda_bench.sh "$OUT/bench.txt" \
      > "$OUT/bench-console.log" 2>&1
  fi
  say "bench done (exit $?)"
  if [[ -n "${BENCH:-}" ]]; then
    grep -v "^\[ops\]" "$OUT/bench.txt" | tail -40
  else
    grep -E "^(copy|f16-storage|    |tensor-core|decode)|FAILED" "$OUT/bench.txt" 2>/dev/null ||
      tail -30 "$OUT/bench-console.log"
  fi
else
  say "no GPU here: bench skipped"
fi
((build_rc != 0)) && exit 1
exit $rc
