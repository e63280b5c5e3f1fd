"""Benchmarks of fly-conv (see fly_conv.bench).

python packages/fly-conv/benchmarks/run.py [--quick] [--only NAME] [--sweep] [--seed N] [--list]
"""

import sys

import flydsl  # noqa: F401 - choose compiled vs interpreted Triton first
from fly_conv.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
