#!/usr/bin/env bash
# The device rounds the twenty-first session wrote with no device lent (PERF.md v21c-v21f), two calls of
# under ten minutes each on the device machine (carry .whl; results in $OUT/round.tgz):
#   bash packages/fly-norm/benchmarks/round_v21.sh 1   GPU tests, layer_norm / rms_norm backward probes
#   bash packages/fly-norm/benchmarks/round_v21.sh 2   forward, softmax backward probes, latency benches
set -uo pipefail
P=packages/fly-norm/benchmarks/probe_configs.py
case "${1:-}" in
1)
  export TEST_LIMIT=${TEST_LIMIT:-300}
  export TESTS=${TESTS:-"packages/fly-norm/tests packages/fly-common/tests/test_common_device.py packages/flydsl-runtime/tests/test_native.py"}
  bash tools/device_round.sh \
    "170 python3 $P --op layer_norm --bwd --widths 16384 32768 --tag v21c-lnbwd --out \$OUT \
       --variant 'BWD_STAGED_FMA=0' --variant 'BWD_STAGED_FMA=3' --variant 'BWD_STAGED_FMA=1' \
       --variant 'BWD_STAGED_FMA=2' --variant 'BWD_STAGED_FMA=3; BWD_STAGED_ONE_WORD=True' \
       --variant 'BWD_STAGED_ONE_WORD=True' --variant 'BWD_STAGED=(8192, 8, 3)' \
       --variant 'BWD_STAGED=(8192, 8, 3); BWD_STAGED_FMA=3'" \
    "90 python3 $P --op rms_norm --bwd --widths 16384 32768 --tag v21f-rmsbwd --out \$OUT \
       --variant 'BWD_STAGED=(8192, 16, 3)' --variant 'BWD_STAGED=(8192, 8, 3)'"
  ;;
2)
  export TESTS=none
  bash tools/device_round.sh \
    "130 python3 $P --op layer_norm --widths 65536 131072 262144 --tag v21f-lnfwd --out \$OUT \
       --variant 'FWD_STAGED=(16384, 16, 3)' --variant 'FWD_STAGED=(16384, 8, 3)' \
       --variant 'FWD_STAGED=(8192, 8, 3); FWD_STAGED_WIDE_WB=True' --variant 'FWD_STAGED=(16384, 16, 3)'" \
    "110 python3 $P --op softmax --bwd --widths 32768 65536 131072 262144 --tag v21d-smbwd --out \$OUT \
       --variant 'SOFTMAX_BWD_WAIT_OWN=False' --variant 'SOFTMAX_BWD_WAIT_OWN=True'" \
    "90 python3 $P --op softmax --bwd --widths 1048576 --tag v21e-sm1m --out \$OUT \
       --variant 'SOFTMAX_BWD_MAX_PARTS=64' --variant 'SOFTMAX_BWD_MAX_PARTS=256' \
       --variant 'SOFTMAX_BWD_MAX_PARTS=256; SOFTMAX_BWD_SLICE=(8192, 8, None)'" \
    "120 python3 packages/fly-norm/benchmarks/run.py --only latency call_rate --out \$OUT --stem nvidia-h200-latency-v21c"
  ;;
*)
  echo "usage: $0 1|2" >&2
  exit 2
  ;;
esac
