#!/usr/bin/env bash
# Browser and load tests of the web playground against a real `ptllm serve`.
#
#   tests/web/run_web_tests.sh PTLLM_BINARY OUTDIR
#
# Installs what is missing (node/npm, Debian's chromium, playwright-core via npm ci), starts
# `PTLLM_BINARY --threads 2 serve --port 0` (stdout OUTDIR/serve.out, stderr OUTDIR/serve.log,
# gate cache and telemetry under OUTDIR), waits for its "listening on" line, runs
# load.test.mjs then browser.test.mjs, and always stops the server. Screenshot:
# OUTDIR/playground.png (and playground-generate.png). Exits non-zero if any step failed.
set -euo pipefail

if [ $# -ne 2 ]; then
  echo "usage: $0 PTLLM_BINARY OUTDIR" >&2
  exit 2
fi
BIN=$(realpath "$1")
OUT=$(mkdir -p "$2" && realpath "$2")
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[ -x "$BIN" ] || { echo "run_web_tests: $BIN is not an executable" >&2; exit 2; }

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
apt_updated=0
apt_install() {
  if [ "$apt_updated" -eq 0 ]; then
    $SUDO apt-get update -qq
    apt_updated=1
  fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@" >/dev/null
}

# --- what is missing ---
if ! command -v node >/dev/null 2>&1; then
  echo "run_web_tests: installing nodejs npm (apt)"
  apt_install nodejs npm
fi
if [ ! -x /usr/bin/chromium ]; then
  echo "run_web_tests: installing chromium (apt)"
  apt_install chromium
fi
if [ ! -d "$HERE/node_modules/playwright-core" ] || [ ! -f "$HERE/node_modules/.package-lock.json" ] ||
   [ "$HERE/package-lock.json" -nt "$HERE/node_modules/.package-lock.json" ]; then
  echo "run_web_tests: npm ci (playwright-core)"
  (cd "$HERE" && npm ci --no-audit --no-fund --loglevel=error)
fi

# --- the server ---
: > "$OUT/serve.out"
: > "$OUT/serve.log"
rm -f "$OUT/playground.png" "$OUT/playground-generate.png" "$OUT/playground-failure.png"
mkdir -p "$OUT/xdg-cache" "$OUT/xdg-state"
SERVER_PID=""
status=0
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 50); do
      kill -0 "$SERVER_PID" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "$SERVER_PID" 2>/dev/null; then
      echo "run_web_tests: the server did not stop on SIGTERM in 5s; killing it" >&2
      kill -KILL "$SERVER_PID" 2>/dev/null || true
    fi
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=""
}
on_exit() {
  local rc=$?
  stop_server
  if [ "$rc" -ne 0 ]; then
    echo "---- server log tail ($OUT/serve.log) ----" >&2
    tail -n 40 "$OUT/serve.log" >&2 || true
    echo "---- end of server log ----" >&2
  fi
  exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT TERM

XDG_CACHE_HOME="$OUT/xdg-cache" XDG_STATE_HOME="$OUT/xdg-state" \
  "$BIN" --threads 2 serve --port 0 >"$OUT/serve.out" 2>"$OUT/serve.log" &
SERVER_PID=$!

URL=""
for _ in $(seq 1 600); do  # 60 s
  URL=$(grep -m1 -oE '^ptllm serve: listening on http://[^ ]+/' "$OUT/serve.out" 2>/dev/null |
        sed -E 's/^ptllm serve: listening on //' || true)
  [ -n "$URL" ] && break
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "run_web_tests: the server exited before listening" >&2
    exit 1
  fi
  sleep 0.1
done
if [ -z "$URL" ]; then
  echo "run_web_tests: no 'ptllm serve: listening on http://HOST:PORT/' line on stdout within 60s" >&2
  echo "stdout was: $(head -c 500 "$OUT/serve.out")" >&2
  exit 1
fi
echo "run_web_tests: server pid $SERVER_PID at $URL"

# --- the tests ---
export PTLLM_URL="$URL"
export PTLLM_SCREENSHOT="$OUT/playground.png"
steps_passed=0
steps_failed=0
run_step() {
  local name=$1; shift
  local t0=$SECONDS
  echo "== $name"
  if (cd "$HERE" && "$@"); then
    echo "== $name: PASS ($((SECONDS - t0))s)"
    steps_passed=$((steps_passed + 1))
  else
    echo "== $name: FAIL ($((SECONDS - t0))s)"
    steps_failed=$((steps_failed + 1))
    status=1
  fi
}
run_step "load test" timeout 200 node load.test.mjs
if ! kill -0 "$SERVER_PID" 2>/dev/null; then
  echo "run_web_tests: the server died during the load test" >&2
  exit 1
fi
run_step "browser test" timeout 150 node browser.test.mjs
if ! kill -0 "$SERVER_PID" 2>/dev/null; then
  echo "run_web_tests: the server died during the browser test" >&2
  status=1
fi
[ -f "$OUT/playground.png" ] && echo "run_web_tests: screenshot $OUT/playground.png"
echo "web: $steps_passed passed, $steps_failed failed"
exit "$status"
