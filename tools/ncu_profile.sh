#!/usr/bin/env bash
# Nsight Compute on the device machine (Firecracker: hardware counters readable): one launch of each
# target's kernels matching KERNEL_RE (default: fly-norm's row kernels; torch's for copy), after the warm-up runs; reports and text
# under $OUT/ncu (summarize the SASS lines with tools/ncu_sass.py). Usage: bash tools/ncu_profile.sh 'OP N [--bwd]' ...
# NCU_TARGET: another target script (default fly-norm's benchmarks/ncu_target.py), e.g.
#   NCU_TARGET=packages/fly-gemm/benchmarks/ncu_target.py KERNEL_RE='regex:_gemm|_gemv|_read|gemm|gemv' \
#     bash tools/ncu_profile.sh 'gemm 1 4096 4096' 'read 32'   (SKIP: matching launches passed over first)
set -uo pipefail
OUT=${OUT:-/tmp/out}
dir=$OUT/ncu
mkdir -p "$dir"
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
 --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
 --section InstructionStats --section SourceCounters"
for target in "$@"; do
  re="${KERNEL_RE:-regex:(norm|softmax)_(fwd|bwd).*_kernel}"
  case $target in copy*) re="regex:copy|elementwise" ;; esac
  name=$(echo "$target" | tr ' ' '_' | tr -d '-')
  # the last run's launches: skip the first runs' (each run launches the same kernels)
  ncu --clock-control none -k "$re" --launch-skip "${SKIP:-3}" --launch-count "${COUNT:-1}" $sections \
    --import-source no -f -o "$dir/$name" \
    python3 "${NCU_TARGET:-packages/fly-norm/benchmarks/ncu_target.py}" $target > "$dir/$name.log" 2>&1
  echo "== $target rc=$?"; tail -3 "$dir/$name.log"
  ncu --import "$dir/$name.ncu-rep" --print-details all > "$dir/$name.txt" 2>&1
  ncu --import "$dir/$name.ncu-rep" --page raw --csv > "$dir/$name.raw.csv" 2>&1
  ncu --import "$dir/$name.ncu-rep" --page source --print-source sass --csv > "$dir/$name.sass.csv" 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|Warp Cycles Per Issued|No Eligible" \
    "$dir/$name.txt" | head -20
done
