#!/usr/bin/env bash
# Puts into .whl/ the Python packages measure_multigpu.py needs beyond a
# CUDA PyTorch + transformers + peft image: DeepSpeed and what it imports
# that such an image lacks. For a GPU machine that cannot reach a package
# registry: carry .whl there and install it with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site
# (tests/groundtruth/README.md has the whole command).
# Usage: tools/multigpu_wheels.sh [PYTHON]   (PYTHON: a pip that reaches PyPI; default python3)
set -euo pipefail
py="${1:-python3}"
root="$(git rev-parse --show-toplevel)"
cd "$root"
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
mkdir -p .whl
# DeepSpeed ships only a source archive; built without its CUDA ops (they
# compile just in time where they are used), the wheel is pure Python.
DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8
# Compiled dependencies for the GPU machine's Python 3.12 on x86-64.
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing-extensions==4.16.0
ls -l .whl
