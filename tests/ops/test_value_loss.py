"""`value_loss` (docs/semantics.md §9): the torch and loop backends by float64 gradcheck, the Triton
kernels against the plain PyTorch transcription of the spec (loss_cases.spec_value), packed rows
and bf16; verl's and OpenRLHF's value losses. What the losses share: tests/ops/test_losses.py; the
checks shared with other ops (tests/ops/op_checks) run here too."""
import pytest
import torch

import rl_triton
from loss_cases import (AGGREGATIONS, BACKENDS, CU, SEQ_MODES, both_ways, check_against_spec,
                        leaves, randn, random_mask, spec_value)
from loss_cases import frameworks  # noqa: F401 (a fixture)
import op_checks

OPS = ["value_loss"]


@pytest.mark.parametrize("backend", ["torch", "loop"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kind,clip", [("mse", None), ("mse", 0.3), ("huber", 0.3)])
def test_gradcheck_value_loss(kind, clip, aggregation, backend):
    v, ret = randn((3, 7), 3, dtype=torch.float64), randn((3, 7), 4, dtype=torch.float64)
    xs = leaves(v, ret, v + randn((3, 7), 5, 0.5, torch.float64))

    def fn(*xs):
        return rl_triton.value_loss(*xs, random_mask((3, 7), 6), clip=clip, kind=kind,
                                    huber_delta=0.7, aggregation=aggregation, backend=backend,
                                    out_dtype=torch.float64)
    assert torch.autograd.gradcheck(fn, xs)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kind,clip", [("mse", None), ("mse", 0.3), ("huber", None),
                                       ("huber", 0.3)])
def test_value_loss_triton(kind, clip, aggregation, device):
    shapes = [(5, 50)] if aggregation in SEQ_MODES else [(37,), (5, 50), (3, 7, 11)]
    for shape in shapes:
        v = randn(shape, 1, device=device)
        xs = leaves(v, randn(shape, 2, device=device), v + randn(shape, 3, 0.5, device=device))
        for mask in (None, random_mask(shape, 4, device)):
            m = torch.ones(shape, dtype=torch.bool, device=device) if mask is None else mask
            kw = dict(clip=clip, kind=kind, huber_delta=0.7, aggregation=aggregation)
            check_against_spec(
                lambda *xs: rl_triton.value_loss(*xs, mask, **kw, backend="triton"),
                lambda *xs: spec_value(*xs, m, **kw), xs)


@pytest.mark.parametrize("aggregation", SEQ_MODES)
def test_value_loss_triton_packed_bf16(aggregation, device):
    v = randn((37,), 1, device=device)
    xs = leaves(*(t.to(torch.bfloat16) for t in (v, randn((37,), 2, device=device),
                                                  v + randn((37,), 3, 0.5, device=device))))
    mask = random_mask((37,), 4, device)
    kw = dict(clip=0.2, kind="huber", aggregation=aggregation)
    check_against_spec(
        lambda *xs: rl_triton.value_loss(*xs, mask, **kw, cu_seqlens=torch.tensor(CU),
                                         backend="triton"),
        lambda *xs: spec_value(*xs, mask, **kw, cu=CU), xs, grad_tol=1e-2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_verl_value_loss(frameworks, mode, backend, device):
    v, ret = randn((6, 40), 1), randn((6, 40), 2)
    old = v + randn((6, 40), 3, 0.5)
    mask = random_mask((6, 40), 4, device)
    both_ways(lambda v, ret, old: rl_triton.value_loss(v, ret, old, mask, clip=0.2,
                                                       aggregation=mode, backend=backend),
              lambda v, ret, old: frameworks.verl.compute_value_loss(v, ret, old, mask.float(),
                                                                     0.2, mode)[0],
              (v, ret, old), device)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("clip", [None, 0.2])
def test_openrlhf_value_loss(frameworks, clip, backend, device):
    value_loss = frameworks.openrlhf_loss.ValueLoss(clip_eps=clip)
    v = randn((6, 40), 1)
    mask = random_mask((6, 40), 2, device)
    both_ways(lambda v, old, ret: rl_triton.value_loss(v, ret, old if clip else None, mask,
                                                       clip=clip, backend=backend),
              lambda v, old, ret: value_loss(v, old, ret, mask.float()),
              (v, v + randn((6, 40), 3, 0.5), randn((6, 40), 4)), device)


# the checks shared with other ops (tests/ops/op_checks), for this module's OPS
op_checks.install(globals(), OPS)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["mse", "huber"])
def test_clipped_loss_precise_far_from_zero(kind, backend, device):
    """Values around 1e3 with returns and old values within 0.5 of them: the clipped error as
    (old - R) + clamp(V - old), so the loss and its gradients keep float32's relative precision
    (old + clamp(V - old) - R rounds at 1e3: 1e-4 off in d old_values)."""
    from cases import rel_err
    g = torch.Generator().manual_seed(0)
    v = 1000 + torch.randn(8, 37, generator=g)
    ret, old = v + 0.1 * torch.randn(8, 37, generator=g), v + 0.1 * torch.randn(8, 37, generator=g)
    xs = [t.to(device).requires_grad_() for t in (v, ret, old)]
    loss = rl_triton.value_loss(*xs, clip=0.2, kind=kind, backend=backend)
    got = [loss, *torch.autograd.grad(loss, xs)]
    x64 = [t.double().requires_grad_() for t in (v, ret, old)]
    e = x64[0] - x64[1]
    ec = (x64[2] - x64[1]) + (x64[0] - x64[2]).clamp(-0.2, 0.2)
    f = (lambda e: 0.5 * e * e) if kind == "mse" else (
        lambda e: torch.nn.functional.huber_loss(e, torch.zeros_like(e), reduction="none"))
    want = torch.maximum(f(e), f(ec)).mean()
    for a, b in zip(got, [want, *torch.autograd.grad(want, x64)]):
        assert rel_err(a.detach().double().cpu(), b.detach()) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_errors_at_counted_positions(backend, device):
    """Huber's derivative beyond delta is +-delta, an infinite error's included (no 0 * inf from
    the quadratic branch), and a NaN value or return gives the NaN pattern of autograd through
    the formula (torch.maximum's shares) on every backend."""
    inf, nan = float("inf"), float("nan")
    v = torch.tensor([inf, 1.0, nan, 0.0, 0.5], device=device, requires_grad=True)
    ret = torch.tensor([0.0, -inf, 0.0, nan, 0.0], device=device)
    old = torch.tensor([0.0, 0.0, 0.0, 0.0, nan], device=device, requires_grad=True)
    loss = rl_triton.value_loss(v[:2], ret[:2], kind="huber", aggregation="none",
                                backend=backend)
    (g,) = torch.autograd.grad(loss.sum(), v)
    assert g[:2].tolist() == [1.0, 1.0]
    loss = rl_triton.value_loss(v[:2], ret[:2], aggregation="none", backend=backend)  # mse
    assert torch.autograd.grad(loss.sum(), v)[0][:2].tolist() == [inf, inf]
    for kind in ("mse", "huber"):
        a = [v.detach().clone().requires_grad_(), old.detach().clone().requires_grad_()]
        b = [v.detach().double().requires_grad_(), old.detach().double().requires_grad_()]
        got = rl_triton.value_loss(a[0], ret, a[1], clip=0.2, kind=kind, aggregation="none",
                                   backend=backend)
        want = spec_value(b[0], ret.double(), b[1], torch.ones(5, dtype=torch.bool,
                                                               device=device),
                          clip=0.2, kind=kind, aggregation="none")
        for x, y in zip(torch.autograd.grad(got.sum(), a), torch.autograd.grad(want.sum(), b)):
            torch.testing.assert_close(x.double(), y, rtol=1e-6, atol=1e-6, equal_nan=True)
