"""`kl_penalty` (docs/semantics.md §9): the torch and loop backends by float64 gradcheck, the Triton
kernels against the plain PyTorch transcription of the spec (loss_cases.spec_kl), clamps that bind
(far below, infinite log-ratios); verl's KL penalties and OpenRLHF's approx KL. What the losses
share: tests/ops/test_losses.py; the checks shared with other ops (tests/ops/op_checks) run here
too."""
import pytest
import torch

import rl_triton
from cases import rel_err
from loss_cases import BACKENDS, both_ways, check_against_spec, leaves, randn, spec_kl
from loss_cases import frameworks  # noqa: F401 (a fixture)
import op_checks

OPS = ["kl_penalty"]


@pytest.mark.parametrize("backend", ["torch", "loop"])
@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3"])  # "+": gradient is not the value's
@pytest.mark.parametrize("clamp", [None, 0.4])
def test_gradcheck_kl_penalty(kind, clamp, backend):
    xs = leaves(randn((3, 7), 7, dtype=torch.float64), randn((3, 7), 8, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda *xs: rl_triton.kl_penalty(
        *xs, kind, clamp, backend=backend, out_dtype=torch.float64), xs)


@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3", "k1+", "abs+", "k2+", "k3+"])
@pytest.mark.parametrize("clamp", [None, 0.5, 10.0])
def test_kl_penalty_triton(kind, clamp, device):
    for shape, dtype in [((1,), torch.float32), ((37,), torch.float32),
                         ((3, 7, 11), torch.float32), ((5, 50), torch.bfloat16)]:
        xs = leaves(randn(shape, 1, 2.0, dtype, device), randn(shape, 2, 2.0, dtype, device))
        check_against_spec(lambda *xs: rl_triton.kl_penalty(*xs, kind, clamp, backend="triton"),
                           lambda *xs: spec_kl(*xs, kind, clamp), xs,
                           grad_tol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [1e-1, 1e-3, 1e-5, 0.9, 1.1])
def test_k3_precise_near_zero(scale, backend, device):
    """k3 and its gradient to float32 precision where log-ratios are small (a policy near its
    reference), and on either side of |d| = 1, where the kernels switch from k3's series to
    its exp: kl_penalty and ppo_policy_loss's approx_kl against float64 on the same float32
    inputs. Written exp(-d) - 1 + d in float32, k3 is 4% off at |d| = 1e-3."""
    lp = -5 * torch.rand(5, 37, generator=torch.Generator().manual_seed(3))
    ref = (lp.double() + scale * randn((5, 37), 4, dtype=torch.float64)).float()
    d = lp.double() - ref.double()
    x = leaves(lp.to(device))[0]
    k = rl_triton.kl_penalty(x, ref.to(device), "k3", backend=backend)
    k.backward(torch.ones_like(k))
    assert rel_err(k.double().cpu(), torch.expm1(-d) + d) < 1e-6
    assert rel_err(x.grad.double().cpu(), -torch.expm1(-d)) < 1e-6
    x = leaves(ref.to(device))[0]
    _, _, approx = rl_triton.ppo_policy_loss(x, lp.to(device), torch.ones_like(x),
                                             backend=backend)
    approx.backward()
    want = (torch.expm1(-d) + d).mean()  # k3 of (old, new) = r - 1 - (new - old)
    assert abs(approx.item() - want.item()) < 1e-6 * want.item()
    assert rel_err(x.grad.double().cpu(), torch.expm1(-d) / d.numel()) < 1e-6


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # interpreter
@pytest.mark.parametrize("backend", BACKENDS)
def test_k3_clamp_far_below(backend, device):
    """k3 at d = -100 overflows exp(-d); clamped, the result is the clamp and the gradient 0
    (not 0 * inf) on every backend."""
    lp = torch.tensor([-100.0, -3.0, 0.5, 40.0], device=device, requires_grad=True)
    k = rl_triton.kl_penalty(lp, torch.zeros(4, device=device), "k3", 10.0, backend=backend)
    (d,) = torch.autograd.grad(k.sum(), lp)
    assert k[0].item() == 10.0 and k[3].item() == 10.0
    assert torch.equal(d[[0, 3]], torch.zeros(2, device=device)) and d.isfinite().all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3"])
def test_kl_clamp_binds_on_infinite_log_ratios(kind, backend, device):
    """An infinite log-ratio (either input +-inf) is beyond the clamp of every estimator: the
    value is the clamp's and both gradients are 0, never 0 * inf (k2's d, k3's exp(-d) on the
    torch and loop backends) nor inf - inf (k3 at log_probs = -inf in the kernel)."""
    inf = float("inf")
    lp = torch.tensor([inf, -inf, 0.0, 0.0, 0.5], device=device, requires_grad=True)
    ref = torch.tensor([0.0, 0.0, inf, -inf, 0.0], device=device, requires_grad=True)
    k = rl_triton.kl_penalty(lp, ref, kind, clamp=10.0, backend=backend)
    d_lp, d_ref = torch.autograd.grad(k.sum(), (lp, ref))
    sign = {"k1": [1, -1, -1, 1], "abs": [1] * 4, "k2": [1] * 4, "k3": [1] * 4}[kind]
    assert k[:4].tolist() == [10.0 * s for s in sign], k
    assert (d_lp[:4] == 0).all() and (d_ref[:4] == 0).all(), (d_lp, d_ref)
    assert d_lp[4] != 0 and d_lp.isfinite().all() and d_ref.isfinite().all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("theirs,kind,clamp", [("kl", "k1", None), ("k1", "k1", None),
                                               ("abs", "abs", None), ("mse", "k2", None),
                                               ("k2", "k2", None), ("low_var_kl", "k3", 10.0),
                                               ("k3", "k3", 10.0)])
def test_verl_kl_penalty(frameworks, theirs, kind, clamp, backend, device):
    """verl's kinds that are ours (the "+" straight-through variants and "full" are not); its
    k3 ("low_var_kl") clamps the log-ratio to +-20 and the result to +-10: ours with clamp=10,
    equal everywhere (log-ratios of up to +-24 here)."""
    xs = (randn((5, 50), 1, 6.0), randn((5, 50), 2, 6.0))
    both_ways(lambda lp, ref: rl_triton.kl_penalty(lp, ref, kind, clamp, backend=backend),
              lambda lp, ref: frameworks.verl.kl_penalty(lp, ref, theirs), xs, device)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_openrlhf_approx_kl(frameworks, kind, backend, device):
    """compute_approx_kl clamps every estimator to +-10: ours with clamp=10."""
    xs = (randn((5, 50), 1, 6.0), randn((5, 50), 2, 6.0))
    both_ways(lambda lp, base: rl_triton.kl_penalty(lp, base, kind, 10.0, backend=backend),
              lambda lp, base: frameworks.openrlhf_utils.compute_approx_kl(
                  lp, base, kl_estimator=kind), xs, device)


# the checks shared with other ops (tests/ops/op_checks), for this module's OPS
op_checks.install(globals(), OPS)
