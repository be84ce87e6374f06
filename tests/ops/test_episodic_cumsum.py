"""`episodic_cumsum` (docs/semantics.md §4): 64-bit indexing on a CUDA device (marked gpu_large);
by hand with `eligibility_traces` (tests/ops/test_eligibility_traces.py). The checks every scan op
shares (tests/ops/op_checks: every backend, layout and dtype against the float64 reference,
gradcheck and the Triton backward, trailing feature axes, masks, packed rows, non-finite inputs,
large shapes) run here for it too."""
import pytest
import torch

import rl_triton
import op_checks

OPS = ["episodic_cumsum"]
DEV = "cuda"  # the gpu_large tests' device


@pytest.mark.gpu_large
def test_64bit_indexing():
    """More than 2^31 elements: offsets need 64 bits."""
    n, T, k = 2**21 + 5, 1024, 7
    x = torch.ones(n, T, device=DEV)
    t = torch.arange(T, device=DEV)
    dones = ((t % k) == k - 1).expand(n, T)  # a stride-0 view: read in place
    out = rl_triton.episodic_cumsum(x, dones, time_dim=1)
    expected = ((t % k) + 1).float()
    assert out.numel() > 2**31
    assert torch.equal(out[0], expected) and torch.equal(out[-1], expected)
    assert torch.equal(out[n // 2 + 3], expected)
    del x, out


# the checks shared with other ops (tests/ops/op_checks), for this module's OPS
op_checks.install(globals(), OPS)
