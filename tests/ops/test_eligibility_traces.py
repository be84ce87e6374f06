"""`eligibility_traces` (docs/semantics.md §4): by hand (with `episodic_cumsum`, the other forward
scan). The checks every scan op shares (tests/ops/op_checks: every backend, layout and dtype
against the float64 reference, gradcheck and the Triton backward, trailing feature axes, masks,
packed rows, non-finite inputs, large shapes) run here for it too."""
import torch

import rl_triton
from by_hand import close, flags, t
from by_hand import backend  # noqa: F401 (a fixture: every backend)
import op_checks

OPS = ["eligibility_traces"]


def test_forward_scans_by_hand(backend, device):
    dones = flags(0, 1, 0, 0).to(device)
    z = rl_triton.eligibility_traces(t(1.0, 1.0, 1.0, 1.0).to(device), dones, gamma=1.0, lam=0.5,
                                     backend=backend)
    close(z, [1.0, 1.5, 1.0, 1.5])
    c = rl_triton.episodic_cumsum(t(1.0, 2.0, 3.0, 4.0).to(device), dones, backend=backend)
    close(c, [1.0, 3.0, 3.0, 7.0])
    c = rl_triton.episodic_cumsum(t(1.0, 2.0, 3.0, 4.0).to(device), dones,
                                  initial=torch.tensor([10.0], device=device), backend=backend)
    close(c, [11.0, 13.0, 3.0, 7.0])


# the checks shared with other ops (tests/ops/op_checks), for this module's OPS
op_checks.install(globals(), OPS)
