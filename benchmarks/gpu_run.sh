#!/usr/bin/env bash
# One full run on a GPU machine: build, every test (gpu ones included), the bench.
# Usage: OUT=/path/for/logs TRAINSTREAM_COMMIT=<sha> bash benchmarks/gpu_run.sh [bench args...]
# Give TRAINSTREAM_COMMIT as the sha of the checkout the tree came from, written out: a copy of
# the tree on a device machine may carry a stale .git, whose HEAD would stamp the wrong commit.
# Leaves $OUT/run.log (everything) and $OUT/results/ (the bench's JSON and markdown).
# A device call is limited to 10 minutes, so a full run is split: TESTS="tests/test_a.py ..."
# picks the test files (TESTS=none: no tests), NO_BENCH=1 skips the bench.
# Peers (DeepSpeed, ...) are installed from ./.whl when present (../shared/device/peer-wheels.sh).
set -uo pipefail
OUT=${OUT:-/tmp/trainstream-gpu-run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log() { echo "== $*" | tee -a "$OUT/run.log"; }

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  log "installing peers from .whl"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -3
  if ls .whl/deepspeed-*.tar.gz >/dev/null 2>&1; then
    DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site \
      .whl/deepspeed-*.tar.gz 2>&1 | tail -3
  fi
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

log "build"
python3 -m pip install --no-build-isolation --no-deps . > /tmp/build.log 2>&1 || { cp /tmp/build.log "$OUT/"; tail -40 /tmp/build.log; exit 1; }
(cd /tmp && python3 -m trainstream) 2>&1 | tee -a "$OUT/run.log"

log "tests (gpu tests included), one process per file: a CUDA fault in one cannot hide the others"
test_rc=0
[ "${TESTS:-}" = none ] && TESTS=" "
for f in ${TESTS:-tests/test_*.py}; do
  python3 -m pytest "$f" -q -rs 2>&1 | tee -a "$OUT/run.log" | tail -4
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || test_rc=$rc
done

bench_rc=0
if [ -z "${NO_BENCH:-}" ]; then
  log "bench"
  python3 -m trainstream.bench --out "$OUT/results" "$@" 2>&1 | tee -a "$OUT/run.log"
  bench_rc=${PIPESTATUS[0]}
fi
log "tests rc=$test_rc bench rc=$bench_rc"
[ "$test_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
