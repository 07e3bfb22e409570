#!/usr/bin/env bash
# Speculative greedy decoding on the GPU (Gpt2::setSpeculativeLanes, fused form 4's lanes) in one
# device call: the GPU tests first (the speculative runs bit for bit against single greedy
# steps), then the bundled model's decode at batch 1 with and without speculation, interleaved
# REPS times — the trained checkpoint (whose greedy text decides how many drafts are kept) and
# random weights of its shape (what the PyTorch peer times) — then PyTorch's generate
# interleaved with ours TORCH_REPS times, and `ptllm sample` with and without speculation (the
# texts must be identical).
#
#   bench/gpu_speculative.sh --prebuild   # here: ptllm and the GPU tests built with this
#                                         # machine's nvcc into .ab-bin/spec.tar.xz (ignored)
#   bash bench/gpu_speculative.sh         # on the device: run carry [".gpu-deps", ".ab-bin"],
#                                         # OUT set; everything lands in $OUT
#   BENCH=1 bash bench/gpu_speculative.sh # the tests and the profile, then
#                                         # bench/run_cuda_bench.sh instead
set -uo pipefail
T="ptllm test_cuda_decode_step test_cuda_model test_cuda_ops test_cuda_paths"
if [[ "${1:-}" == "--prebuild" ]]; then
  # shellcheck disable=SC2086  # T is a list of targets
  cmake -S . -B build-ab-exp -G Ninja -DCMAKE_BUILD_TYPE=Release > /dev/null &&
    cmake --build build-ab-exp -j"$(nproc)" --target $T | grep -E "warning|error|FAILED"
  rm -rf .ab-bin/spec && mkdir -p .ab-bin/spec/tests
  cp build-ab-exp/ptllm .ab-bin/spec/ && cp build-ab-exp/tests/test_cuda_* .ab-bin/spec/tests/
  rm -f .ab-bin/spec/tests/*.cmake
  strip .ab-bin/spec/ptllm .ab-bin/spec/tests/test_cuda_*
  (cd .ab-bin && tar -cf - spec | xz -T1 --lzma2=preset=6,dict=128MiB > spec.tar.xz && rm -rf spec)
  pwd -P > .ab-bin/srcdir
  du -sh .ab-bin/spec.tar.xz
  exit 0
fi

OUT=${OUT:-/tmp/spec}
REPS=${REPS:-3}
source bench/gpu_prologue.sh
# The test binaries have the build machine's checkout path compiled in (the bundled model).
prebuiltCheckout || { echo "the prebuilt tests need $(cat .ab-bin/srcdir), taken here" >&2; exit 1; }
rm -rf /tmp/spec-bin && mkdir -p /tmp/spec-bin
xz -dc .ab-bin/spec.tar.xz | tar -xf - -C /tmp/spec-bin || exit 1
BIN=/tmp/spec-bin/spec/ptllm
TESTS=/tmp/spec-bin/spec/tests

say tests
timeout 120 "$TESTS/test_cuda_decode_step" --gtest_filter='*Speculative*' > "$OUT/tests-speculative.log" 2>&1
echo "speculative test rc $?" | tee -a "$OUT/tests-speculative.log"
grep -E "OK|FAILED|Failure|Expected|Which is|first difference|refused|stopped|draft" \
  "$OUT/tests-speculative.log" | head -30
for t in "$TESTS"/test_cuda_*; do
  (timeout 200 "$t" --gtest_brief=1 > "$OUT/tests-$(basename "$t").log" 2>&1
    echo "$(basename "$t") rc $?") &
done > "$OUT/tests.log"
wait
cat "$OUT"/tests-test_cuda_*.log >> "$OUT/tests.log" && rm -f "$OUT"/tests-test_cuda_*.log
grep -E " rc |PASSED|FAILED|Failure" "$OUT/tests.log" | head -20

# The step's timeline (PTLLM_DECODE_PROFILE=1, form 4 forced): the ordinary greedy run's mean
# step beside the speculative run's, lane by lane.
say profile
for k in 0 4; do
  PTLLM_DECODE_PROFILE=1 timeout 60 "$BIN" --device cuda bench sample --decode-form 4 \
    --model models/shakespeare.safetensors --tokens 200 --repeats 5 --speculative $k \
    > "$OUT/profile-$k.txt" 2>&1
  echo "profile --speculative $k rc $?"
done
grep -hE "launches|total:|^\[decode profile\] +1[4-7] " "$OUT"/profile-*.txt

if [[ "${BENCH:-0}" == 1 ]]; then  # the whole side-by-side bench instead of the loops below
  say bench
  BIN=$BIN bash bench/run_cuda_bench.sh "$OUT/bench.txt" | tail -30
  say "done"
  exit 0
fi

say decode
B="--n-layer 4 --n-head 4 --n-embd 256 --block-size 256"
CK="--model models/shakespeare.safetensors"
S="--tokens 200 --repeats 5"
run() { timeout 30 "$BIN" --device cuda "$@" 2>&1 | grep "^peer=" || echo "FAILED: $*"; }
{
  run bench sample $CK $S > /dev/null  # warm-up
  for rep in $(seq "$REPS"); do
    echo "# rep $rep"
    for k in 0 2 3 4 6 8; do run bench sample $CK $S --speculative $k; done
    for k in 0 4; do run --paths f32 bench sample $CK $S --speculative $k; done
    for k in 0 4; do run bench sample $B $S --speculative $k; done
  done
} > "$OUT/decode.txt"
sed -E 's/.*path=([^ ]+).*us_token=([^ ]+).*weights=([^ ]+) spec_lanes=([^ ]+).*per_step=([^ ]+) text_hash=([^ ]+).*/  \1 \3 lanes=\4 us_token=\2 per_step=\5 hash=\6/' "$OUT/decode.txt"

say torch
for rep in $(seq "${TORCH_REPS:-3}"); do
  env -u LD_LIBRARY_PATH timeout 60 python3 bench/torch_cuda_peer.py --no-gemm --iters 10 2>&1 |
    grep -E "mode=sample"
  run bench sample $CK $S --speculative 4
  run bench sample $CK $S
done > "$OUT/torch.txt" 2>&1
sed -E 's/.*peer=([^ ]+).*(tok_s=[^ ]+).*(spec_lanes=[^ ]+).*/\1 \2 \3/; s/.*peer=torch.*(tok_s=[^ ]+).*/torch \1/' "$OUT/torch.txt"

say sample
for k in 0 4; do
  timeout 60 "$BIN" --device cuda sample --prompt "ROMEO:" --tokens 240 --temperature 0 \
    --speculative $k > "$OUT/sample-$k.txt" 2> "$OUT/sample-$k.err"
  echo "sample --speculative $k rc $?"
done
cmp "$OUT/sample-0.txt" "$OUT/sample-4.txt" && echo "sample texts identical"
head -c 300 "$OUT/sample-4.txt"
echo
say "done"
