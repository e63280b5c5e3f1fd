#!/usr/bin/env bash
# One full GPU session on the device machine (torch + triton preinstalled, no network):
# install our packages in place, run every package's tests compiled on the GPU, the
# runtime measurements, the demo and the benchmarks; logs and results go under $OUT.
# Usage: bash tools/gpu_session.sh [pytest-targets... | none]
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Build tools the device image lacks (hatchling for editable installs): run
# tools/fetch_device_wheels.sh here first and carry .whl with the device run.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -2
fi
for p in packages/flydsl-runtime packages/fly-common packages/fly-norm packages/fly-gemm packages/fly-attention packages/fly-conv; do
  [ -f "$p/pyproject.toml" ] && python3 -m pip install -q --no-deps --no-build-isolation -e "$p" 2>&1 | tail -2
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
[ "${1:-}" = none ] && exit 0  # install only (device_round.sh with TESTS=none)
status=0
for t in "${@:-packages/flydsl-runtime/tests packages/fly-common/tests}"; do
  for d in $t; do
    name=$(echo "${d%/}" | sed 's#^packages/##; s#/tests##; s#[/.]#-#g')  # fly-norm, fly-common-test_common_device-py
    python3 -m pytest "$d" -q -p no:cacheprovider --require-gpu -n "${PYTEST_WORKERS:-8}" > "$OUT/pytest-$name.txt" 2>&1 || status=1
    tail -8 "$OUT/pytest-$name.txt"
  done
done
exit $status
