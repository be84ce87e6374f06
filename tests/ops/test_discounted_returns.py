"""`discounted_returns` (docs/semantics.md §3): by hand, and packed rows without a bootstrap. The
checks every scan op shares (tests/ops/op_checks: every backend, layout and dtype against the
float64 reference, gradcheck and the Triton backward, masks, packed rows, non-finite inputs, large
shapes) run here for it too."""
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
