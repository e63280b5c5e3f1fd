export TEST_LIMIT=60 PYTEST_WORKERS=4
TESTS="packages/fly-gemm/tests/test_gemm_package.py" bash tools/device_round.sh \
  "200 flydsl tune gemm --only gemm --match '{\"dtype\": \"fp8_e4m3\"}'" \
  '170 cp packages/fly-gemm/src/fly_gemm/artifacts/gemm.json $OUT/; python3 packages/fly-gemm/benchmarks/run.py --stem nvidia-h200-v1 --out $OUT/bench' \
  '100 python3 packages/fly-norm/benchmarks/run.py --only rmsnorm_quant --stem nvidia-h200-quant-v7b --out $OUT/nb' \
  '45 python3 packages/fly-norm/benchmarks/run.py --only layernorm_fwd rmsnorm_fwd --cases x32768 x16384 --providers flydsl torch.compile --stem nvidia-h200-fwd-v7b --out $OUT/nb'
