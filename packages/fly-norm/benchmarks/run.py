"""Benchmarks of fly-norm (see fly_norm.bench): python packages/fly-norm/benchmarks/run.py [--quick] [--only NAME]."""

import sys

import flydsl  # noqa: F401 - choose compiled vs interpreted Triton first
from fly_norm.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
