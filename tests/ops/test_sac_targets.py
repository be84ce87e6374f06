"""`sac_targets` (docs/semantics.md §9): the torch and loop backends by float64 gradcheck, the
Triton kernels against the plain PyTorch transcription of the spec (loss_cases.spec_sac), bf16 and
flags, alpha's gradient, tied critics, zero probabilities; CleanRL's SAC targets. What the losses
share: tests/ops/test_losses.py; the checks shared with other ops (tests/ops/op_checks) run here
too."""
import pytest
import torch

import rl_triton
from loss_cases import (BACKENDS, both_ways, check_against_spec, cleanrl_sac_continuous,
                        cleanrl_sac_discrete, gen, grads_of, leaves, sac_case, spec_sac)
import op_checks

OPS = ["sac_targets"]


@pytest.mark.parametrize("backend", ["torch", "loop"])
@pytest.mark.parametrize("actions", [None, 4])
def test_gradcheck_sac_targets(actions, backend):
    case = sac_case(7, 2, actions, dtype=torch.float64)
    names = [k for k, v in case.items() if v.is_floating_point()]
    xs = leaves(*(case[k] for k in names), torch.tensor(0.3, dtype=torch.float64))

    def fn(*xs):
        args = dict(case, **dict(zip(names, xs)))
        return rl_triton.sac_targets(**args, gamma=0.9, alpha=xs[-1], backend=backend,
                                     out_dtype=torch.float64)
    assert torch.autograd.gradcheck(fn, xs)


@pytest.mark.parametrize("actions,critics", [(None, 1), (None, 2), (4, 2), (70, 3)])
@pytest.mark.parametrize("alpha", ["float", "tensor"])
def test_sac_targets_triton(actions, critics, alpha, device):
    """Continuous (K = 1, 2 critics) and discrete actions (4, and 70: more than one tile of
    actions), alpha a number or a learned temperature (its gradient too)."""
    for batch in [(37,), (3, 7)]:
        N = batch[0] * (batch[1] if len(batch) > 1 else 1)
        case = sac_case(N, critics, actions, seed=2, device=device)
        case = {k: v.reshape(batch + v.shape[1:]) for k, v in case.items()}
        names = [k for k, v in case.items() if v.is_floating_point()]
        a = torch.tensor(0.3, device=device)
        xs = leaves(*(case[k] for k in names), *([a] if alpha == "tensor" else []))

        def call(*xs):
            args = dict(case, **dict(zip(names, xs)))
            return rl_triton.sac_targets(**args, gamma=0.9, alpha=xs[-1] if alpha == "tensor"
                                         else 0.3, backend="triton")

        def spec(*xs):
            args = dict(zip(names, xs))
            return spec_sac(args["rewards"], case["terminated"], args["next_q_values"],
                            args["next_log_probs"], gamma=0.9,
                            alpha=xs[-1] if alpha == "tensor" else 0.3,
                            probs=args.get("next_probs"))
        check_against_spec(call, spec, xs)


def test_sac_targets_bf16_and_flags(device):
    """bf16 inputs; flags of any dtype, set where nonzero; a truncation is no termination."""
    case = sac_case(37, 2, 5, seed=3, dtype=torch.bfloat16, device=device)
    term = case["terminated"].float() * 0.5
    names = [k for k, v in case.items() if v.is_floating_point()]
    xs = leaves(*(case[k] for k in names))

    def call(*xs):
        return rl_triton.sac_targets(**dict(case, **dict(zip(names, xs)), terminated=term),
                                     gamma=0.97, alpha=0.1, backend="triton")

    def spec(*xs):
        args = dict(zip(names, xs))
        return spec_sac(args["rewards"], case["terminated"], args["next_q_values"],
                        args["next_log_probs"], gamma=0.97, alpha=0.1, probs=args["next_probs"])
    check_against_spec(call, spec, xs, grad_tol=1e-2)


def test_sac_alpha_gradient_is_the_formula(device):
    """d y / d alpha = -gamma (1 - term) log pi (docs/semantics.md: differentiable); under no_grad,
    as CleanRL computes its targets, nothing is recorded."""
    case = sac_case(37, 2, seed=5, device=device)
    alpha = torch.tensor([0.25], device=device, requires_grad=True)
    y = rl_triton.sac_targets(**case, gamma=0.9, alpha=alpha, backend="triton")
    (d,) = torch.autograd.grad(y.sum(), alpha)
    want = -(0.9 * torch.where(case["terminated"], 0.0, case["next_log_probs"])).sum()
    assert d.shape == (1,) and abs(d.item() - want.item()) < 1e-4
    with torch.no_grad():
        assert not rl_triton.sac_targets(**case, alpha=alpha, backend="triton").requires_grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("actions", [None, 3])
def test_sac_tie_gradient_goes_to_the_first_critic(actions, backend, device):
    """Critics that tie: the whole gradient goes to the first of them (as argmin picks it),
    not half to each, on every backend."""
    case = sac_case(5, 3, actions, device=device)
    q = case["next_q_values"]
    q[..., 1] = q[..., 2]  # critics 1 and 2 tie, and are the smallest
    q[..., 0] = q[..., 1] + 1.0
    q = q.requires_grad_()
    y = rl_triton.sac_targets(**dict(case, next_q_values=q), gamma=0.9, backend=backend)
    (d,) = torch.autograd.grad(y.sum(), q)
    live = torch.where(case["terminated"], 0.0, 0.9)
    if actions is not None:
        live = live[:, None] * case["next_probs"]
    assert torch.equal(d[..., 0], torch.zeros_like(live))
    assert torch.allclose(d[..., 1], live) and torch.equal(d[..., 2], torch.zeros_like(live))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sac_zero_probability_contributes_nothing(backend, device):
    """Invalid-action masking: actions of probability 0 with log-probability -inf (or NaN, or
    anything) add 0 to the expectation, and every gradient is finite: that of a finite
    log-probability there, 0 at those actions."""
    case = sac_case(6, 2, 4, device=device)
    zero = torch.zeros(6, 4, dtype=torch.bool, device=device)
    zero[:, 1] = True
    zero[2, 3] = True
    logits = torch.where(zero, -float("inf"), torch.randn(6, 4, generator=gen(9)).to(device))
    probs = torch.softmax(logits, -1)
    results = []
    for filler in (-7.0, -float("inf"), float("nan")):
        lp = torch.where(zero, filler, torch.log_softmax(logits, -1))
        xs = leaves(case["next_q_values"], lp, probs, torch.tensor(0.3, device=device))
        y = rl_triton.sac_targets(case["rewards"], case["terminated"], xs[0], xs[1],
                                  next_probs=xs[2], alpha=xs[3], backend=backend)
        results.append([y.detach()] + grads_of([y], xs))
    for got in results:
        for a, b in zip(got, results[0]):
            assert a.isfinite().all() and torch.equal(a, b), (a, b)
    d_q, d_lp, d_p = results[0][1:4]
    assert (d_q[zero] == 0).all() and (d_lp[zero] == 0).all() and (d_p[zero] == 0).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cleanrl_sac(backend, device):
    continuous = sac_case(64, 2, seed=6, device=device)
    dones = continuous["terminated"].float()
    q = continuous["next_q_values"]
    both_ways(lambda r, q, lp: rl_triton.sac_targets(r, dones, q, lp, gamma=0.99, alpha=0.2,
                                                     backend=backend),
              lambda r, q, lp: cleanrl_sac_continuous(r, dones, q[:, :1], q[:, 1:], lp[:, None],
                                                      0.2, 0.99),
              (continuous["rewards"], q, continuous["next_log_probs"]), device)
    discrete = sac_case(64, 2, 6, seed=7, device=device)
    both_ways(lambda r, q, lp, p: rl_triton.sac_targets(r, dones, q, lp, gamma=0.99, alpha=0.2,
                                                        next_probs=p, backend=backend),
              lambda r, q, lp, p: cleanrl_sac_discrete(r, dones, q[..., 0], q[..., 1], lp, p,
                                                       0.2, 0.99),
              (discrete["rewards"], discrete["next_q_values"], discrete["next_log_probs"],
               discrete["next_probs"]), device)


# the checks shared with other ops (tests/ops/op_checks), for this module's OPS
op_checks.install(globals(), OPS)
