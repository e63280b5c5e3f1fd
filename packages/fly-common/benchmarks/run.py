"""Benchmarks of flydsl-common (quantization, vec_add) against torch, with ceilings measured in the same run.

    python packages/fly-common/benchmarks/run.py [--quick] [--out DIR] [--only quant] [--no-ceilings]

Writes ``results/<gpu>.json|md|png`` beside this script (see ``--help``);
``flydsl bench common`` runs the same thing.
"""

from __future__ import annotations

import sys

from flydsl_common.bench.common_bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
