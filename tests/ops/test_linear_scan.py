"""The primitive `linear_scan` (docs/semantics.md §2), reverse and forward (`linear_scan_reverse`
and `linear_scan_forward` in rl_triton.testing): by hand, and scans of 2^20 steps without a cut on a
CUDA device (marked gpu_large). The checks the scan ops share (tests/ops/op_checks: every backend,
layout and dtype against the float64 reference, gradcheck and the Triton backward, non-finite
inputs, large shapes) run here for both directions."""
import pytest
import torch

import rl_triton
from rl_triton.testing import NAMES, vectorized
from by_hand import close, t
from by_hand import backend  # noqa: F401 (a fixture: every backend)
from cases import assert_close
import op_checks

OPS = [n for n in NAMES if n.startswith("linear_scan")]
DEV = "cuda"  # the gpu_large tests' device


def test_linear_scan_by_hand(backend, device):
    a, b = t(1.0, 2.0, 3.0).to(device), t(0.5, 2.0, -1.0).to(device)
    close(rl_triton.linear_scan(a, b, backend=backend), [1 + 0.5 * (2 + 2 * 3), 8.0, 3.0])
    close(rl_triton.linear_scan(a, b, initial=torch.tensor([1.0], device=device),
                                backend=backend), [1 + 0.5 * (2 + 2 * 2), 6.0, 2.0])
    close(rl_triton.linear_scan(a, b, reverse=False, backend=backend), [1.0, 4.0, -1.0])


@pytest.mark.parametrize("beta,tol", [(0.999, 1e-5), (0.9999, 5e-5)])
@pytest.mark.gpu_large
def test_long_reverse_scan_without_boundaries(beta, tol):
    """A reverse scan whose carry crosses every tile (no cut anywhere).

    With beta = 0.9999 (a 10^4-step horizon) float32 rounding adds up: measured on 2^20 steps,
    the sequential float32 loop reaches 2.3e-6, the doubling scan 2.0e-5 (docs/benchmarks.md)
    and the earlier two-pass kernels 2.3e-5 (docs/dev/kernel-decisions.md); at realistic
    horizons the usual 1e-5 holds.
    """
    T = 2**20
    alpha = torch.randn(1, T, device=DEV)
    beta_t = torch.full((1, T), beta, device=DEV)
    out = rl_triton.linear_scan(alpha, beta_t, time_dim=1)
    (ref,) = vectorized("linear_scan", alpha=alpha.T, beta=beta_t.T, reverse=True)
    ref = ref.T
    assert_close((out,), (ref,), tol=tol)


@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
@pytest.mark.gpu_large
def test_look_back_without_cuts(layout):
    """beta close to 1 and no cut: every tile's carry depends on every tile before it, so the
    look-back must reach back to published values or to the start (fresh plans, cold launches)."""
    from rl_triton._core import plans as _plans

    T, n, td = 2**20, 4, 0 if layout == "time-major" else 1
    g = torch.Generator(device=DEV).manual_seed(3)
    shape = (T, n) if td == 0 else (n, T)
    a = torch.randn(shape, generator=g, device=DEV)
    b = 0.999 + 0.001 * torch.rand(shape, generator=g, device=DEV)
    for reverse in (True, False):
        (ref,) = vectorized("linear_scan", alpha=a.movedim(td, 0), beta=b.movedim(td, 0),
                            reverse=reverse)
        for _ in range(3):
            _plans._PLANS.clear()
            for _ in range(3):
                out = rl_triton.linear_scan(a, b, reverse=reverse, time_dim=td).movedim(td, 0)
                assert_close((out,), (ref,))


# the checks shared with other ops (tests/ops/op_checks), for this module's OPS
op_checks.install(globals(), OPS)
