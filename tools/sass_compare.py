"""Compare the SASS opcodes of two trees' kernels, case by case (``tools/sm90_compile.py --ops DIR``).

    FLYDSL_INTERPRET=0 python tools/sm90_compile.py --ops /tmp/a staged      (on one tree)
    FLYDSL_INTERPRET=0 python tools/sm90_compile.py --ops /tmp/b staged      (on the other)
    python tools/sass_compare.py /tmp/a /tmp/b

For each case in both folders: the instruction counts and how alike the two opcode sequences are (difflib's
ratio, 1.0 identical). A change that should only add code (a prologue, a tail) but moves the ratio far
from 1 has rescheduled the kernel, its loop included, which can cost more than the added code suggests.
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    a_dir, b_dir = (Path(p) for p in argv)
    for a in sorted(a_dir.glob("*.ops")):
        b = b_dir / a.name
        if not b.exists():
            print(f"{a.stem:40s} only in {a_dir}")
            continue
        x, y = a.read_text().split(), b.read_text().split()
        ratio = difflib.SequenceMatcher(None, x, y, autojunk=False).ratio()
        print(f"{a.stem:40s} {len(x):6d} -> {len(y):6d} instructions, alike {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
