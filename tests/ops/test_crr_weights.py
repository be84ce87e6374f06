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


def test_crr_weights_strided(device):
    """Batch axes a view reads in place (a transpose, a step) or that the kernel reads as a
    copy (a permutation no one stride describes), each called three times: the plan's later
    calls take its memo of the views' strides and whether they copy."""
    q, sampled = randn((6, 5, 4), 1, device=device), randn((6, 5, 4, 3), 2, device=device)
    cases = [(q.permute(2, 0, 1), sampled.permute(2, 0, 1, 3)), (q[:, ::2], sampled[:, ::2]),
             (q[..., 0], sampled[..., 0, :]), (q.transpose(0, 1), sampled.transpose(0, 1))]
    for a, b in cases:
        for _ in range(3):
            assert_close(rl_triton.crr_weights(a, b, backend="triton"),
                         spec_crr(a.double(), b.double()), 1e-6)


# the checks shared with other ops (tests/ops/op_checks), for this module's OPS
op_checks.install(globals(), OPS)
