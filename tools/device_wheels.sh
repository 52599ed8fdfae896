#!/usr/bin/env bash
# Wheels the GPU machine's image lacks, into .whl/ (git-ignored), for the device tool to carry
# (run(..., carry=[".whl"])); tools/gpu_run.sh installs whatever .whl/ holds. Today: what
# tests/test_compressed.py needs to write checkpoints - compressed-tensors 0.14.0.1 (without
# its transformers<5 pin), loguru, psutil, and pydantic with the pydantic-core its version pins; and
# setuptools>=77, with which tests/test_tutorial.py builds the tutorial's plugin into a wheel. The
# image runs CPython 3.12 on x86_64 Linux.
set -euo pipefail
cd "$(dirname "$0")/.."
target=(--only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 --implementation cp -d .whl)
python3 -m pip download -q --no-deps "${target[@]}" compressed-tensors==0.14.0.1 loguru psutil
python3 -m pip download -q "${target[@]}" pydantic
python3 -m pip download -q --no-deps "${target[@]}" "setuptools>=77"
ls .whl
