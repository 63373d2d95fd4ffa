#!/usr/bin/env bash
# Sets up everything on a fresh machine and runs the main job on its built-in default:
#   bash setup.sh              # venv in .venv, purinec and its dependencies, then train
# Pass --no-run to only install. Safe to run again: it reuses .venv.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[dev]'
if [ "${1:-}" != "--no-run" ]; then
    # The main job: compile a small convolutional network for the CPU (fused Numba
    # kernels; the first run fills the kernel cache) and train it on scikit-learn's
    # digits to at least 97% test accuracy.
    .venv/bin/purinec train convnet --target cpu --data digits --epochs 15
fi
