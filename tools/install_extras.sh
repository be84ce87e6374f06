#!/usr/bin/env bash
# Everything the test suite uses beyond the README's install (which it follows): with both, no
# test skips for a missing package on a CPU machine. .ci/run calls it too.
set -euo pipefail
cd "$(dirname "$0")/.."
# The trainers' --env-backend gymnax (docs/trainers.md): the `gymnax` extra holds JAX (a CPU
# build here) and what `import gymnax` imports; gymnax and flax go in without their declared
# dependencies: gymnax 1.0.1 declares gymnasium<1.4 against the integrations extra's 1.4.0
# (tests/test_trainers.py's gymnax tests pass with 1.4.0), and flax declares optax,
# orbax-checkpoint, tensorstore and treescope, which `from flax import struct` never imports.
python -m pip install -q -e ".[gymnax]"
python -m pip install -q --no-deps "gymnax==1.0.1" "flax==0.12.8"
# The oldest Triton the project supports (pyproject), beside the newest: tests/test_compile.py
# builds every kernel variant with both (Triton 3.6 rejected constructs that 3.9 accepts).
# A folder, not a virtual environment: the tests run it with this same Python (`PYTHONPATH`),
# so that it works whether this Python is a venv or not.
rm -rf .ci/triton-oldest
python -m pip install -q --no-deps --target .ci/triton-oldest "triton==3.6.0"
# The LLM frameworks whose functions rl_triton.integrations.verl / .openrlhf reproduce, pinned,
# without their dependencies (rl_triton.testing.import_frameworks stubs the unused heavy ones):
rm -rf .ci/frameworks
python -m pip install -q --no-deps --target .ci/frameworks "verl==0.9.1" "openrlhf==0.11.2" \
  "omegaconf==2.3.0" "antlr4-python3-runtime==4.9.3" "codetiming==1.4.0" "PyYAML==6.0.3"
# TRL, whose GRPOTrainer rl_triton.integrations.trl.GRPOTrainer replaces the loss of
# (tests/test_trl_trainer.py runs both on a tiny random model), pinned, without dependencies:
# trl 1.16.0 and what `pip install trl==1.16.0` adds to this environment (transformers, accelerate,
# datasets and theirs), less what the environment already has. Its own folder, which
# rl_triton.testing.import_trl appends to sys.path (after the environment's, so the environment's
# versions win; it stays there, transformers imports lazily): not .ci/frameworks, which the verl
# and OpenRLHF imports put first on sys.path beside stubbed transformers (framework_suites_runner).
# 371 MB (pyarrow 170, transformers 130), 12 s from a local package index.
rm -rf .ci/trl
python -m pip install -q --no-deps --target .ci/trl "trl==1.16.0" "transformers==5.25.0" \
  "accelerate==1.16.0" "datasets==5.2.0" "huggingface_hub==2.4.0" "tokenizers==0.23.3" \
  "safetensors==0.8.0" "psutil==7.2.2" "tqdm==4.70.1" "pyarrow==26.0.1" "dill==0.4.1" \
  "multiprocess==0.70.19" "xxhash==4.1.0" "httpx2==2.16.2" "httpcore2==2.16.2" "h11==0.16.0" \
  "truststore==0.10.5" "anyio==4.16.0" "hf-xet==1.8.0" "kernels==0.19.1" "tomlkit==0.15.3" \
  "typer==0.29.2" "shellingham==1.5.4" "annotated-doc==0.0.7"
# The documentation site (mkdocs.yml; `mkdocs build --strict`)
python -m pip install -q -e ".[docs]"
