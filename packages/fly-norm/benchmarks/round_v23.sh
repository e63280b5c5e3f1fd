#!/usr/bin/env bash
# The next device round (PERF.md v22c and Next 1), one call of under ten minutes on the device machine (carry
# .whl; results in $OUT/round.tgz): the fly-norm GPU suite and fly-common's device tests on the shipped code,
# the probe FWD_STAGED_OWN_MEAN against the shipped merge (twice each, alternated), and torch.compile's softmax
# backward next to ours with inductor's generated source.
set -uo pipefail
P=packages/fly-norm/benchmarks/probe_configs.py
export TEST_LIMIT=${TEST_LIMIT:-300}
export TESTS=${TESTS:-"packages/fly-norm/tests packages/fly-common/tests/test_common_device.py"}
bash tools/device_round.sh \
  "90 python3 $P --op layer_norm --widths 65536 131072 262144 --tag v22c-lnfwd-own --out \$OUT \
     --variant 'FWD_STAGED_OWN_MEAN=False' --variant 'FWD_STAGED_OWN_MEAN=True' \
     --variant 'FWD_STAGED_OWN_MEAN=False' --variant 'FWD_STAGED_OWN_MEAN=True'" \
  "150 python3 packages/fly-norm/benchmarks/probe_inductor.py --widths 2048 4096 16384 --out \$OUT"
