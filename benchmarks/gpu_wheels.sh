#!/usr/bin/env bash
# Wheels the GPU machine's image lacks, for benchmarks/gpu_check.py: downloaded here into
# .whl/ (git-ignored through .git/info/exclude), carried to the machine, installed there
# into /tmp/site (see benchmarks/README.md, "On a lent machine"). The image's Python is
# 3.12 and holds numba-cuda, cuda-bindings, cuda-core, cuda-pathfinder and nvidia-cublas;
# it lacks NVIDIA's cuBLAS bindings, nvmath-python.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    nvmath-python==1.0.1
ls -l .whl
