#!/usr/bin/env bash
# A/B of a decode change in one device call: the working tree ('exp') against a base revision
# ('base'), built side by side, measured interleaved on the same GPU.
#
#   bench/gpu_decode_ab.sh --prepare REF   # here: ab_base/ gets REF's version of every file that
#                                          # differs between REF and the working tree (untracked,
#                                          # so it travels with the tree; delete it before committing)
#   bench/gpu_decode_ab.sh --prebuild      # optional, here, after --prepare: builds both sides
#                                          # with this machine's nvcc into .ab-bin/ (ignored), so
#                                          # the device call spends no time compiling
#   bench/gpu_decode_ab.sh --prebuild-exp  # after a change to exp: rebuilds exp, keeps base
#   bash bench/gpu_decode_ab.sh            # on the device (run carry [".gpu-deps"], plus
#                                          # ".ab-bin" if prebuilt), OUT set
#
# On the device: both trees built in parallel (exp with the GPU tests; or the prebuilt binaries),
# the GPU tests on exp, the bundled-shape decode (f16-storage, and f32 unless F32=0) interleaved
# REPS times, the form-4 profile of each, then, unless TORCH=0, PyTorch's generate interleaved
# with exp TORCH_REPS (3) times (the ratio), and exp's gate lines. EXTRA="VAR=VALUE ...": a third
# arm, exp run with those variables set (an experiment's switch), in the decode loop, the
# profiles and a second run of the decode-step and model tests.
# Everything also lands in $OUT (decode.txt, tests.log, torch.txt, sample.txt, build logs).
set -uo pipefail

if [[ "${1:-}" == "--prepare" ]]; then
  ref=${2:?usage: $0 --prepare REF}
  changed=$(git diff --name-only "$ref" -- src tests)
  rm -rf ab_base && mkdir ab_base
  for f in $changed; do
    mkdir -p "ab_base/$(dirname "$f")"
    if git cat-file -e "$ref:$f" 2> /dev/null; then
      git show "$ref:$f" > "ab_base/$f"
    else
      echo "$f" >> ab_base/.absent  # new in the working tree: removed from the base
    fi
  done
  echo "ab_base/ holds $(git rev-parse --short "$ref")'s side of:" $changed
  exit 0
fi

T="ptllm test_cuda_decode_step test_cuda_model test_cuda_ops test_cuda_paths"
if [[ "${1:-}" == "--prebuild" || "${1:-}" == "--prebuild-exp" ]]; then
  # One build folder for both sides: exp's targets, then ab_base's files swapped into the
  # working tree for base's ptllm (only what they touch recompiles), then the working tree's
  # files put back. --prebuild-exp rebuilds exp only and keeps the packed base (a change to exp
  # after --prebuild). The test binaries have this checkout's absolute path compiled in
  # (PTLLM_SOURCE_DIR, the ptllm they run): .ab-bin/srcdir records it, and the device links that
  # path to its copy.
  [[ -d ab_base ]] || { echo "no ab_base/: run $0 --prepare REF first" >&2; exit 2; }
  [[ ! -f ab_base/.absent ]] || { echo "--prebuild: files new in the working tree" >&2; exit 2; }
  rm -rf /tmp/ab-exp /tmp/ab-keep && mkdir -p /tmp/ab-exp /tmp/ab-keep
  if [[ $1 == --prebuild-exp ]]; then
    [[ -f .ab-bin/bin.tar.xz ]] || { echo "no .ab-bin/bin.tar.xz: run $0 --prebuild first" >&2; exit 2; }
    xz -dc .ab-bin/bin.tar.xz | tar -xf - -C /tmp/ab-keep base || exit 1
  fi
  rm -rf .ab-bin && mkdir -p .ab-bin/exp/tests .ab-bin/base
  files=$(cd ab_base && find . -type f)
  build() { cmake --build build-ab-exp -j"$(nproc)" --target "$@" | grep -E "warning|error|FAILED"; }
  cmake -S . -B build-ab-exp -G Ninja -DCMAKE_BUILD_TYPE=Release > /dev/null && build $T
  cp build-ab-exp/ptllm .ab-bin/exp/ && cp build-ab-exp/tests/test_cuda_* .ab-bin/exp/tests/
  if [[ $1 == --prebuild-exp ]]; then
    cp /tmp/ab-keep/base/ptllm .ab-bin/base/
  else
    for f in $files; do mkdir -p "/tmp/ab-exp/$(dirname "$f")" && cp -p "$f" "/tmp/ab-exp/$f"; done
    for f in $files; do cp "ab_base/$f" "$f"; done
    build ptllm
    cp build-ab-exp/ptllm .ab-bin/base/
    for f in $files; do cp "/tmp/ab-exp/$f" "$f"; done  # new mtimes: the next build recompiles
  fi
  [[ -x .ab-bin/exp/ptllm && -x .ab-bin/base/ptllm ]] || exit 1
  rm -f .ab-bin/exp/tests/*.cmake
  strip .ab-bin/exp/ptllm .ab-bin/base/ptllm .ab-bin/exp/tests/test_cuda_*
  cmp -s .ab-bin/exp/ptllm .ab-bin/base/ptllm && { echo "exp and base ptllm are identical" >&2; exit 1; }
  # Stripped, and in one xz stream whose window spans the files (they share the kernels):
  # ~9 MB instead of ~90, within what a device call carries.
  (cd .ab-bin && tar -cf - exp base | xz -T1 --lzma2=preset=6,dict=128MiB > bin.tar.xz &&
    rm -rf exp base)
  pwd -P > .ab-bin/srcdir
  du -sh .ab-bin
  exit 0
fi

OUT=${OUT:-/tmp/ab}
REPS=${REPS:-3}
source bench/gpu_prologue.sh

prebuilt=0
if prebuiltCheckout; then
  prebuilt=1
elif [[ -f .ab-bin/srcdir ]]; then
  echo "prebuilt binaries need $(cat .ab-bin/srcdir), which is taken here: building instead" |
    tee -a "$OUT/env.txt"
fi
rm -rf /tmp/base && mkdir /tmp/base
if ((prebuilt)); then
  say prebuilt
  rm -rf /tmp/ab-bin && mkdir -p /tmp/ab-bin build-ab-exp/tests /tmp/base/build
  xz -dc .ab-bin/bin.tar.xz | tar -xf - -C /tmp/ab-bin || exit 1
  cp /tmp/ab-bin/exp/ptllm build-ab-exp/ && cp /tmp/ab-bin/exp/tests/* build-ab-exp/tests/
  cp /tmp/ab-bin/base/ptllm /tmp/base/build/
  rm -rf build && ln -s build-ab-exp build
else
  [[ -d ab_base ]] || { echo "no ab_base/ (nor .ab-bin/): run $0 --prepare REF first" >&2; exit 2; }
  tar --exclude='./build*' --exclude=./.gpu-deps --exclude=./ab_base --exclude=./.ab-bin -cf - . |
    tar -xf - -C /tmp/base
  (cd ab_base && find . -type f ! -name .absent | while read -r f; do cp "$f" "/tmp/base/$f"; done)
  [[ -f ab_base/.absent ]] && while read -r f; do rm -f "/tmp/base/$f"; done < ab_base/.absent

  say build
  (cmake -S . -B build "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release > "$OUT/build-exp.log" 2>&1 &&
    timeout 450 cmake --build build -j16 --target $T >> "$OUT/build-exp.log" 2>&1
    echo "exp build rc $?") &
  (cd /tmp/base && cmake -S . -B build "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release > "$OUT/build-base.log" 2>&1 &&
    timeout 450 cmake --build build -j16 --target ptllm >> "$OUT/build-base.log" 2>&1
    echo "base build rc $?") &
  wait
  grep -E "warning|error" "$OUT"/build-*.log | head
fi
[[ -x build/ptllm && -x /tmp/base/build/ptllm ]] || exit 1

say bench
B="--n-layer 4 --n-head 4 --n-embd 256 --block-size 256"
S="bench sample $B --tokens 200 --repeats 5"
ARMS="base exp"
[[ -n "${EXTRA:-}" ]] && ARMS+=" exp+"
# arm ARGS...: that arm's ptllm (exp+ is exp with EXTRA's variables).
arm() {
  local v=$1
  shift
  case $v in
    base) timeout 20 /tmp/base/build/ptllm "$@" ;;
    exp) timeout 20 build/ptllm "$@" ;;
    # shellcheck disable=SC2086  # EXTRA is a list of VAR=VALUE words
    exp+) env $EXTRA timeout 20 build/ptllm "$@" ;;
  esac
}
{
  [[ -n "${EXTRA:-}" ]] && echo "# exp+ = exp with $EXTRA"
  build/ptllm --device cuda $S > /dev/null 2>&1
  for rep in $(seq "$REPS"); do
    for v in $ARMS; do
      echo "# $v rep $rep"
      arm $v --device cuda $S 2>&1 | grep "^peer="
      [[ "${F32:-1}" == 0 ]] || arm $v --device cuda --paths f32 $S 2>&1 | grep "^peer="
    done
  done
  for v in $ARMS; do
    echo "# profile $v form 4"
    PTLLM_DECODE_PROFILE=1 arm $v --device cuda bench sample $B --tokens 200 \
      --decode-cluster 16 --decode-form 4 2>&1 | grep -E "^peer=|decode profile"
  done
} > "$OUT/decode.txt" 2>&1
grep -E "^# (base|exp)|us_token" "$OUT/decode.txt" |
  sed -E 's/.*path=([^ ]+).*us_token=([^ ]+).*step_us=([^ ]+).*/  \1 us_token=\2 step_us=\3/'
grep -E "profile (base|exp)|mark +(1[2-9]|2[0-3]) |total|starts after" "$OUT/decode.txt" | cut -c1-160

say tests
# The GPU test binaries themselves, side by side (no CTest files when prebuilt).
for t in build/tests/test_cuda_*; do
  [[ -x "$t" ]] || continue  # not the CTest include files
  (timeout 170 "$t" --gtest_brief=1 > "$OUT/tests-$(basename "$t").log" 2>&1
    echo "$(basename "$t") rc $?") &
done > "$OUT/tests.log"
if [[ -n "${EXTRA:-}" ]]; then  # the experiment's switch must keep the bits too
  for t in build/tests/test_cuda_decode_step build/tests/test_cuda_model; do
    [[ -x "$t" ]] || continue
    # shellcheck disable=SC2086
    (env $EXTRA timeout 170 "$t" --gtest_brief=1 > "$OUT/tests-extra-$(basename "$t").log" 2>&1
      echo "$(basename "$t") with $EXTRA rc $?") &
  done >> "$OUT/tests.log"
fi
wait
cat "$OUT"/tests-*.log >> "$OUT/tests.log" && rm -f "$OUT"/tests-*.log
grep -E " rc |PASSED|FAILED|Failure|SKIPPED" "$OUT/tests.log" | head -30

if [[ "${TORCH:-1}" != 0 ]]; then
  say torch
  for rep in $(seq "${TORCH_REPS:-3}"); do
    env -u LD_LIBRARY_PATH timeout 60 python3 bench/torch_cuda_peer.py --no-gemm --iters 10 2>&1 |
      grep -E "mode=sample"
    timeout 20 build/ptllm --device cuda $S 2>&1 | grep "^peer="
  done > "$OUT/torch.txt" 2>&1
  sed -E 's/.*peer=([^ ]+).*(tok_s=[^ ]+).*/\1 \2/' "$OUT/torch.txt"
fi

say gates
timeout 60 build/ptllm --device cuda sample --prompt "ROMEO:" --tokens 100 > "$OUT/sample.txt" 2>&1
grep -E "^\[" "$OUT/sample.txt" | grep -v "^\[cpu\]" | head -20 | cut -c1-220
say "done"
