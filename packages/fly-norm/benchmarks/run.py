"""Benchmarks of fly-norm (see fly_norm.bench).

    python packages/fly-norm/benchmarks/run.py                 the tuned set (results/<gpu>.json|md|png)
    python packages/fly-norm/benchmarks/run.py --sweep         also 60 unseen random shapes (<gpu>-sweep.*)
    python packages/fly-norm/benchmarks/run.py --sweep-only --seed N   repeat one sweep
    python packages/fly-norm/benchmarks/run.py --quick --only rmsnorm_fwd host   a smoke run of two benches
"""

import sys

import flydsl  # noqa: F401 - choose compiled vs interpreted Triton first
from fly_norm.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
