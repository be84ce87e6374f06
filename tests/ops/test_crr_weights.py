"""`crr_weights` (docs/semantics.md §9): every backend against the plain PyTorch transcription of
the spec (loss_cases.spec_crr). What the losses share: tests/ops/test_losses.py; the checks shared
with other ops (tests/ops/op_checks) run here too."""
import pytest
import torch

import rl_triton
from loss_cases import assert_close, randn, spec_crr
import op_checks

OPS = ["crr_weights"]


@pytest.mark.parametrize("backend", ["loop", "torch", "triton"])
@pytest.mark.parametrize("kind", ["exp", "binary"])
@pytest.mark.parametrize("baseline", ["mean", "max"])
def test_crr_weights(kind, baseline, backend, device):
    """Every backend against the transcription (J = 9, and 70: more than one tile of samples);
    the weights never require grad."""
    for J in (9, 70):
        q = randn((5, 8), 1, device=device).requires_grad_()
        sampled = randn((5, 8, J), 2, device=device).requires_grad_()
        kw = dict(beta=0.5, kind=kind, max_weight=3.0, baseline=baseline)
        w = rl_triton.crr_weights(q, sampled, **kw, backend=backend)
        assert not w.requires_grad and w.dtype == torch.float32
        assert_close(w, spec_crr(q.double(), sampled.double(), **kw), 1e-6)


# the checks shared with other ops (tests/ops/op_checks), for this module's OPS
op_checks.install(globals(), OPS)
