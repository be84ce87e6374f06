"""`discounted_returns` (docs/semantics.md §3): by hand, gamma = 0 with a non-finite bootstrap, and
packed rows without a bootstrap. The checks every scan op shares (tests/ops/op_checks: every
backend, layout and dtype against the float64 reference, gradcheck and the Triton backward, masks,
packed rows, non-finite inputs, large shapes) run here for it too."""
import pytest
import torch

import rl_triton
from by_hand import G, LAST, R, close, flags, t
from by_hand import backend  # noqa: F401 (a fixture: every backend)
from cases import assert_close
import op_checks
from op_checks.masks import SPLIT, packed_inputs, per_segment

OPS = ["discounted_returns"]


# ---- by hand -------------------------------------------------------------------------------------

def test_discounted_returns_by_hand(backend, device):
    r, no = R.to(device), flags(0, 0, 0).to(device)
    close(rl_triton.discounted_returns(r, no, gamma=G, backend=backend), [2.75, 3.5, 3.0])
    close(rl_triton.discounted_returns(r, no, last_value=LAST.to(device), gamma=G,
                                       backend=backend), [3.0, 4.0, 4.0])
    close(rl_triton.discounted_returns(r, flags(1, 0, 0).to(device), gamma=G, backend=backend),
          [1.0, 3.5, 3.0])
    # truncation at t=0 without next_values: bootstrap zero, trace cut
    close(rl_triton.discounted_returns(r, no, flags(1, 0, 0).to(device), gamma=G,
                                       backend=backend), [1.0, 3.5, 3.0])
    # with next_values: bootstrap next_values[0] = 10
    close(rl_triton.discounted_returns(r, no, flags(1, 0, 0).to(device),
                                       next_values=t(10.0, 0.0, 0.0).to(device), gamma=G,
                                       backend=backend), [6.0, 3.5, 3.0])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_zero_gamma_multiplies_the_bootstrap(backend, device):
    """G[T-1] = r + gamma v' is a product (docs/semantics.md §3): gamma = 0 with an inf or NaN
    last_value gives NaN there, a number or a per-row gamma, on every backend (Triton's carried
    variant passed the bootstrap through a zero beta, a select); a termination at T-1 drops it."""
    r = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]], device=device)  # [T, 3 rows]
    term = torch.tensor([[False] * 3, [False, False, True]], device=device)
    for bad in (float("nan"), float("inf")):
        last = torch.tensor([bad, 5.0, bad], device=device)
        for gamma in (0.0, torch.tensor([0.0, 0.0, 0.0], device=device)):
            got = rl_triton.discounted_returns(r, term, last_value=last, gamma=gamma,
                                               backend=backend).cpu()
            assert got[1, 0].isnan(), (bad, gamma, got)
            torch.testing.assert_close(got[:, 1:], torch.tensor([[1.0, 1.0], [2.0, 2.0]]))
            torch.testing.assert_close(got[0, :1], torch.tensor([1.0]))
        # gamma 0 in one row only: the others' bootstraps as before
        gamma = torch.tensor([0.5, 0.0, 0.5], device=device)
        got = rl_triton.discounted_returns(r, term, last_value=torch.tensor([1.0, bad, 1.0],
                                                                            device=device),
                                           gamma=gamma, backend=backend).cpu()
        assert got[1, 1].isnan(), got
        torch.testing.assert_close(got[:, [0, 2]], torch.tensor([[2.25, 2.0], [2.5, 2.0]]))


# ---- packed rows (semantics §7) ------------------------------------------------------------------

def test_packed_discounted_returns_without_bootstrap(device, in_place):
    """A missing bootstrap is zero at every segment end (discounted returns only)."""
    for masked in (False, True):
        steps, extra, cu = packed_inputs("discounted_returns", SPLIT, masked, device=device,
                                         bootstrap=None)
        got = rl_triton.discounted_returns(**steps, **extra, cu_seqlens=cu, backend="triton")
        assert_close((got,), per_segment("discounted_returns", steps, extra, cu))


# the checks shared with other ops (tests/ops/op_checks), for this module's OPS
op_checks.install(globals(), OPS)
