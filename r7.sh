TESTS=none bash tools/device_round.sh \
 '200 python3 packages/fly-norm/benchmarks/probe_fwd_wide.py --ops 6 3 --cases 16384,16,3 8192,16,3 16384,16,4 --widths 65536 131072 262144 --out $OUT/fwd'
