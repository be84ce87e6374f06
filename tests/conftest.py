"""Test set-up: compiled kernels on a CUDA machine, Triton's interpreter everywhere else.

The interpreter must be chosen before triton is imported, so this runs first.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device():
    return DEVICE

# Large-shape tests need a real GPU: not collected elsewhere.
collect_ignore_glob = [] if torch.cuda.is_available() else ["test_gpu*.py"]
