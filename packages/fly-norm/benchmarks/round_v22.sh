#!/usr/bin/env bash
# The twenty-second session's device rounds (PERF.md v22), each under ten minutes on the device machine
# (carry .whl; results in $OUT/round.tgz):
#   bash packages/fly-norm/benchmarks/round_v22.sh 1   GPU tests; the staged backward's one-word sums
#       (layer_norm, also with a residual gradient; rms_norm's one slot a slice); softmax backward slices
#   bash packages/fly-norm/benchmarks/round_v22.sh 2   the split tests; layer_norm's staged backward with a
#       residual gradient, both forms; the backward benchmarks of the three ops
set -uo pipefail
P=packages/fly-norm/benchmarks/probe_configs.py
case "${1:-}" in
1)
  export TEST_LIMIT=${TEST_LIMIT:-300}
  export TESTS=${TESTS:-"packages/fly-norm/tests packages/fly-common/tests/test_common_device.py"}
  bash tools/device_round.sh \
    "60 python3 $P --op layer_norm --bwd --widths 8192 16384 32768 --tag v22-lnbwd --out \$OUT" \
    "60 python3 $P --op layer_norm --bwd --residual --widths 16384 32768 --tag v22-lnbwd-res --out \$OUT" \
    "60 python3 $P --op rms_norm --bwd --widths 16384 32768 --tag v22-rmsbwd --out \$OUT" \
    "120 python3 $P --op softmax --bwd --widths 262144 524288 1048576 --tag v22-smbwd-wide --out \$OUT \
       --variant 'SOFTMAX_BWD_MAX_PARTS=256' --variant 'SOFTMAX_BWD_MAX_PARTS=0' \
       --variant 'SOFTMAX_BWD_SLICE=(8192, 8, None)' --variant 'SOFTMAX_BWD_SLICE_WIDE=(16384, 16, None)' \
       --variant 'SOFTMAX_BWD_SLICE_WIDE=(8192, 4, None)'"
  ;;
2)
  export TEST_LIMIT=${TEST_LIMIT:-120}
  export TESTS=${TESTS:-"packages/fly-norm/tests/test_split.py packages/fly-norm/tests/test_softmax.py"}
  bash tools/device_round.sh \
    "60 python3 $P --op layer_norm --bwd --residual --widths 16384 32768 --tag v22-lnbwd-res-pair --out \$OUT \
       --variant 'BWD_STAGED_DRES_PAIR=False' --variant 'BWD_STAGED_DRES_PAIR=True'" \
    "170 python3 packages/fly-norm/benchmarks/run.py --only layernorm_bwd --out \$OUT --stem nvidia-h200-layernorm_bwd-v22" \
    "150 python3 packages/fly-norm/benchmarks/run.py --only softmax_bwd --out \$OUT --stem nvidia-h200-softmax_bwd-v22" \
    "150 python3 packages/fly-norm/benchmarks/run.py --only rmsnorm_bwd --out \$OUT --stem nvidia-h200-rmsnorm_bwd-v22"
  ;;
*)
  echo "usage: $0 1|2" >&2
  exit 2
  ;;
esac
