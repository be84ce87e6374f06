#!/usr/bin/env bash
# Here (a machine with a package index): the pure-Python packages and the wheels the test suite
# needs that the GPU machine lacks (it has no index), for its Python 3.12 on x86-64, into .whl/
# (ignored by git); tools/gpu_check.sh installs them there. EnvPool (50 MB and its assets) stays
# behind: its tests skip there, and run in CI. liger-kernel (pure Python; needs torch >= 2.1.2 and
# triton >= 2.3.1, and imported with torch 2.11 / triton 3.6 on the H200) is the fused head's
# peer in `python -m rl_triton.bench --suite head`.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "tyro==1.0.17" docstring_parser shtab typeguard "gymnasium==1.4.0" farama-notifications \
  "stable-baselines3==2.9.2" "torchrl==0.14.1" "tensordict==0.14.3" pyvers hoptorch orjson \
  importlib_metadata "gymnax==1.0.1" "liger-kernel==0.8.5"
du -sh .whl
