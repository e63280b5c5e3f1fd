"""Benchmarks of fly-comm (see fly_comm.bench): all-reduce latency per size against NCCL on this host's GPUs.

python packages/fly-comm/benchmarks/run.py [--world N] [--sizes 4K,1M,...] [--dtype bf16] [--no-graph] [--out DIR]
"""

import sys

import flydsl  # noqa: F401 - choose compiled vs interpreted Triton first
from fly_comm.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
