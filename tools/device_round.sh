#!/usr/bin/env bash
# One device round: GPU tests (tools/gpu_session.sh) then each given command, each
# under its own time limit, all output under $OUT, packed into $OUT/round.tgz at
# the end (the device tool brings back at most 8 files).
# Usage: TESTS="pkg/tests ..." bash tools/device_round.sh 'LIMIT_S COMMAND' ...  (TESTS=none: install only)
set -uo pipefail
OUT=${OUT:-/tmp/out}
export OUT PYTHONUNBUFFERED=1
work=$OUT/round
rm -rf "$work"  # a round's files only (a machine may keep an earlier session's $OUT/round)
mkdir -p "$work"
start=$(date +%s)
OUT=$work timeout "${TEST_LIMIT:-300}" bash tools/gpu_session.sh ${TESTS:-} 2>&1 | tee "$work/tests.log" | tail -40
echo "tests done after $(( $(date +%s) - start )) s"
i=0
for step in "$@"; do
  i=$((i + 1))
  limit=${step%% *}
  cmd=${step#* }
  echo "== step $i (limit ${limit}s): $cmd"
  t0=$(date +%s)
  OUT=$work timeout "$limit" bash -c "$cmd" > "$work/step$i.log" 2>&1
  echo "   rc=$? in $(( $(date +%s) - t0 )) s"
  tail -30 "$work/step$i.log"
done
tar czf "$OUT/round.tgz" -C "$work" . && rm -rf "$work"
echo "round done after $(( $(date +%s) - start )) s"
