"""The ci/ helpers (monorepo, changed_packages, cpu_stack) are scripts, not an installed package: the tests
import them from the ci/ folder."""

import sys
from pathlib import Path

CI = Path(__file__).resolve().parents[1]
if str(CI) not in sys.path:
    sys.path.insert(0, str(CI))
