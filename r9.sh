TESTS=none bash tools/device_round.sh \
 '120 python3 packages/fly-norm/benchmarks/probe_fwd_wide.py --ops 7 4 --cases 16384,16,3,1 --widths 65536 131072 262144 --out $OUT/fwd' \
 '40 python3 packages/fly-norm/benchmarks/probe_fwd_wide.py --ops 7 --cases 16384,16,3,1 --widths 131072 --offset 200 --out $OUT/fwd200'
