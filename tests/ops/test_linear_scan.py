"""The primitive `linear_scan` (docs/semantics.md §2), reverse and forward (`linear_scan_reverse`
and `linear_scan_forward` in rl_triton.testing): by hand, and scans of 2^20 steps without a cut on a
CUDA device (marked gpu_large). The checks the scan ops share (tests/ops/op_checks: every backend,
layout and dtype against the float64 reference, gradcheck and the Triton backward, non-finite
inputs, large shapes) run here for both directions; and the gradient at beta = 0, the boundary
step's read of A[T] = 0 and infinite betas beside a cut."""
import pytest
import torch

import rl_triton
from rl_triton.scan import tiles
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


def test_zero_beta_gradient_by_hand(backend, device):
    """d beta[t] = H[t] A[t+1] (A[t-1] forward; docs/semantics.md §6) also where beta[t] = 0:
    the value there is a select, its gradient the product's."""
    a = t(1.0, 2.0, 3.0).to(device)
    for reverse, expected in ((True, [2.0, 4.5, 0.0]), (False, [0.0, 1.5, 2.0])):
        b = t(0.5, 0.0, 0.5).to(device).requires_grad_()
        rl_triton.linear_scan(a, b, reverse=reverse, backend=backend).sum().backward()
        close(b.grad, expected)


@pytest.mark.parametrize("backend", ["torch", "loop"])
@pytest.mark.parametrize("reverse", [True, False])
@pytest.mark.parametrize("initial", [False, True])
def test_gradcheck_at_zero_beta(backend, reverse, initial):
    g = torch.Generator().manual_seed(7)
    a = torch.randn(7, 3, generator=g, dtype=torch.float64).requires_grad_()
    b = torch.rand(7, 3, generator=g, dtype=torch.float64)
    b[[0, 3, 6], [0, 1, 2]] = 0.0
    b[2] = 0.0
    b.requires_grad_()
    leaves = (a, b) + ((torch.randn(3, generator=g, dtype=torch.float64).requires_grad_(),)
                       if initial else ())

    def fn(*x):
        return rl_triton.linear_scan(x[0], x[1], initial=x[2] if initial else None,
                                     reverse=reverse, backend=backend, out_dtype=torch.float64)

    assert torch.autograd.gradcheck(fn, leaves)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_boundary_step_reads_zero(backend, device):
    """Without `initial`, A[T] (A[-1] forward) = 0 is read as a product: a NaN or inf beta at
    the boundary step makes A NaN there (beta * 0), and a zero beta before it cuts it off."""
    nan, inf = float("nan"), float("inf")
    a = t(1.0, 1.0, 1.0).to(device)
    for reverse in (True, False):
        for bad in (nan, inf):
            beta = [0.5, 0.5, bad] if reverse else [bad, 0.5, 0.5]
            got = rl_triton.linear_scan(a, t(*beta).to(device), reverse=reverse,
                                        backend=backend)
            assert got.isnan().all(), (reverse, bad, got)
            beta = [0.5, 0.0, bad] if reverse else [bad, 0.0, 0.5]
            got = rl_triton.linear_scan(a, t(*beta).to(device), reverse=reverse,
                                        backend=backend).flatten().tolist()
            want = [1.5, 1.0, nan] if reverse else [nan, 1.0, 1.5]
            assert str(got) == str(want), (reverse, bad, got)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
def test_infinite_beta_beside_a_cut(backend, layout, device):
    """beta = +-inf next to a zero beta: 0 * inf is NaN in the scan's product of betas, which
    must not carry a NaN across the cut (docs/semantics.md §2). Rows of 37 steps, in tiles of 16
    carried by look-back or by a walking program, with the infinite beta on either side of a
    cut and of a tile's edge."""
    T, inf = 37, float("inf")
    a = torch.ones(T, 4, device=device)
    b = torch.full((T, 4), 0.5, device=device)
    cuts = {0: (15, 16), 1: (16, 15), 2: (31, 32), 3: (5, 4)}  # row: (inf at, cut at)
    for row, (at, cut) in cuts.items():
        b[at, row], b[cut, row] = (inf if row % 2 else -inf), 0.0
    ref = [rl_triton.linear_scan(a, b, reverse=rev, backend="loop") for rev in (True, False)]
    td = 0 if layout == "time-major" else 1
    steps = torch.arange(T)
    for walk in (False, True):
        with tiles.override(block_t=16, block_b=2, window=16, walk=walk):
            for rev, want in zip((True, False), ref):
                got = rl_triton.linear_scan(a if td == 0 else a.T.contiguous(),
                                            b if td == 0 else b.T.contiguous(), reverse=rev,
                                            time_dim=td, backend=backend)
                got = got if td == 0 else got.T
                for row, (at, cut) in cuts.items():
                    # the steps that read the infinite beta: from it on, in scan order, up to
                    # the cut (where it lies that way)
                    if rev:
                        reads = (steps <= at) & ~((cut < at) & (steps <= cut))
                    else:
                        reads = (steps >= at) & ~((cut > at) & (steps >= cut))
                    far = got[~reads, row].cpu()
                    assert torch.isfinite(far).all(), (rev, walk, row, got[:, row])
                    torch.testing.assert_close(far, want[~reads, row].cpu())


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
