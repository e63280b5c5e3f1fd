#!/usr/bin/env bash
# Download the build tools the GPU machine's image lacks (hatchling for editable installs)
# into .whl/ (git-ignored); carry .whl with each device run: tools/gpu_session.sh installs them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
  hatchling editables trove-classifiers tomlkit
ls .whl
