TESTS=none bash tools/device_round.sh \
 '150 python3 -m pytest -q -p no:cacheprovider --require-gpu -n 8 packages/fly-norm/tests/test_split.py packages/fly-norm/tests/test_softmax.py > $OUT/pytest-split.txt 2>&1; tail -4 $OUT/pytest-split.txt' \
 '150 python3 packages/fly-norm/benchmarks/run.py --only softmax_fwd --cases x65536 x131072 x262144 x1048576 --out $OUT/bench --stem nvidia-h200-softmax_fwd-v16'
