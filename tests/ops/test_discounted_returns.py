"""`discounted_returns` (docs/semantics.md §3): against its float64 reference
(rl_triton/reference.py), forward and backward; its masks, packed rows, non-finite inputs and
boundaries; its large shapes on a CUDA device (marked gpu_large). The checks it shares with
other ops (tests/ops/op_checks) run here for it too."""
import pytest
import torch

import op_checks
import rl_triton

OPS = ["discounted_returns"]


def test_packed_discounted_returns_without_bootstrap(device, in_place):
    """A missing bootstrap is zero at every segment end (discounted returns only)."""
    for masked in (False, True):
        steps, extra, cu = packed_inputs("discounted_returns", SPLIT, masked, device=device,
                                         bootstrap=None)
        got = rl_triton.discounted_returns(**steps, **extra, cu_seqlens=cu, backend="triton")
        assert_close((got,), per_segment("discounted_returns", steps, extra, cu))
