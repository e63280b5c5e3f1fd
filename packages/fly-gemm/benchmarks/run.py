"""Benchmarks of fly-gemm (see fly_gemm.bench).

python packages/fly-gemm/benchmarks/run.py [--quick] [--only NAME] [--sweep] [--seed N] [--list]
"""

import sys

import flydsl  # noqa: F401 - choose compiled vs interpreted Triton first
from fly_gemm.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
