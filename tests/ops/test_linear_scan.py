"""The primitive `linear_scan` (docs/semantics.md §2), both directions: against its float64 reference
(rl_triton/reference.py), forward and backward; its masks, packed rows, non-finite inputs and
boundaries; its large shapes on a CUDA device (marked gpu_large). The checks it shares with
other ops (tests/ops/op_checks) run here for it too."""
import pytest
import torch

import op_checks
import rl_triton
from rl_triton.testing import NAMES

OPS = [n for n in NAMES if n.startswith("linear_scan")]


def test_linear_scan_by_hand(backend, device):
    a, b = t(1.0, 2.0, 3.0).to(device), t(0.5, 2.0, -1.0).to(device)
    close(rl_triton.linear_scan(a, b, backend=backend), [1 + 0.5 * (2 + 2 * 3), 8.0, 3.0])
    close(rl_triton.linear_scan(a, b, initial=torch.tensor([1.0], device=device),
                                backend=backend), [1 + 0.5 * (2 + 2 * 2), 6.0, 2.0])
    close(rl_triton.linear_scan(a, b, reverse=False, backend=backend), [1.0, 4.0, -1.0])
