"""Benchmarks of flydsl-common (quantization, vec_add) against torch, with ceilings measured in the same run.

    python packages/fly-common/benchmarks/run.py [--quick] [--sweep] [--seed N] [--out DIR] [--only quant]

Writes ``results/<gpu>.json|md|png`` (the tuned shapes) and, with ``--sweep``,
``results/<gpu>-sweep.json|md|png`` (60 unseen random quantization shapes, the
seed printed) beside this script; each case gets its GPU time (gpu_us) and its
call time (call_us). See ``--help``; ``flydsl bench common`` runs the same thing.
"""

from __future__ import annotations

import sys

from flydsl_common.bench.common_bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
