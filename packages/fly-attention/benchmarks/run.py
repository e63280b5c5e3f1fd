"""Benchmarks of fly-attention (see fly_attention.bench).

python packages/fly-attention/benchmarks/run.py [--quick] [--only NAME] [--sweep] [--seed N] [--list]
"""

import sys

import flydsl  # noqa: F401 - choose compiled vs interpreted Triton first
from fly_attention.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
