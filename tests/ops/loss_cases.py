"""Helpers of the losses' tests (tests/ops/test_<loss>.py, tests/ops/test_losses.py): inputs, the
plain PyTorch transcriptions of semantics §9, the frameworks' functions (verl 0.9.1, OpenRLHF
0.11.2) and CleanRL's lines, transcribed."""
import pytest
import torch

import rl_triton
from cases import rel_err


AGGREGATIONS = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "sum", "none"]


SEQ_MODES = AGGREGATIONS[1:3]


CU = [0, 5, 5, 20, 21, 37]  # packed [37]: five segments, one empty, one of length 1


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(shape, seed, scale=1.0, dtype=torch.float32, device="cpu"):
    return (scale * torch.randn(shape, generator=gen(seed), dtype=torch.float64)).to(
        device, dtype)


def random_mask(shape, seed, device="cpu", p=0.7):
    return (torch.rand(shape, generator=gen(seed)) < p).to(device)


def leaves(*xs):
    return [x.detach().clone().requires_grad_() for x in xs]


def assert_close(got, want, tol, what=""):
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = rel_err(got, want)
    assert err < tol, f"{what}: relative error {err:.3g} >= {tol}"


def spec_aggregate(l, m, aggregation, cu=None):
    """sum(l m) / sum(m), per sequence (a row of [B, T], or a segment of cu) then averaged over
    the sequences with a position that counts, sum, or l m per position."""
    lm = torch.where(m, l, 0.0)
    if aggregation == "none":
        return lm
    if aggregation == "sum":
        return lm.sum()
    if aggregation == "token-mean":
        return lm.sum() / m.sum().clamp_min(1)
    if cu is None:
        pieces = list(zip(lm, m))
    else:
        pieces = [(lm[a:b], m[a:b]) for a, b in zip(cu[:-1], cu[1:])]
    per = [x.sum() / (k.sum() if aggregation == "seq-mean-token-mean" else 1)
           for x, k in pieces if k.any()]
    return torch.stack(per).mean() if per else lm.sum()


def spec_ppo(lp, old, adv, m, *, clip_low=0.2, clip_high=None, dual_clip=None,
             log_ratio_clamp=20.0, aggregation="token-mean", cu=None):
    clip_high = clip_low if clip_high is None else clip_high
    d = torch.clamp(lp - old, -log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(d)
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    l = torch.max(l1, l2)
    if dual_clip is not None:
        l = torch.where(adv < 0, torch.min(l, -adv * dual_clip), l)
    n = m.sum().clamp_min(1)
    return (spec_aggregate(l, m, aggregation, cu), torch.where(m, (l2 > l1).double(), 0).sum() / n,
            torch.where(m, ratio - 1 - d, 0).sum() / n)


def spec_value(v, ret, old, m, *, clip=None, kind="mse", huber_delta=1.0,
               aggregation="token-mean", cu=None):
    def f(e):
        if kind == "mse":
            return 0.5 * e ** 2
        return torch.nn.functional.huber_loss(e, torch.zeros_like(e), reduction="none",
                                              delta=huber_delta)
    l = f(v - ret)
    if clip is not None:
        l = torch.max(l, f(old + torch.clamp(v - old, -clip, clip) - ret))
    return spec_aggregate(l, m, aggregation, cu)


def spec_kl(lp, ref, kind, clamp=None):
    d = lp - ref
    if kind.endswith("+"):  # straight-through: the value of the kind, the gradient of d^2 / 2
        half = d ** 2 / 2
        return spec_kl(lp, ref, kind[:-1], clamp).detach() + half - half.detach()
    k = {"k1": lambda: d, "abs": lambda: d.abs(), "k2": lambda: d ** 2 / 2,
         "k3": lambda: torch.exp(-d) + d - 1}[kind]()
    return k if clamp is None else torch.clamp(k, -clamp, clamp)


def spec_sac(r, term, q, lp, *, gamma, alpha, probs=None):
    soft = q.min(-1).values - alpha * lp
    if probs is not None:
        soft = (probs * soft).sum(-1)
    return r + gamma * torch.where(term != 0, 0.0, soft)


def spec_crr(q, sampled, *, beta=1.0, kind="exp", max_weight=20.0, baseline="mean"):
    adv = q - (sampled.mean(-1) if baseline == "mean" else sampled.max(-1).values)
    return torch.clamp(torch.exp(adv / beta), max=max_weight) if kind == "exp" else \
        (adv > 0).double()


def ppo_case(shape=(3, 7), seed=0, dtype=torch.float64, device="cpu"):
    """log_probs, old_log_probs (log-ratios of about +-0.4: some clipped), advantages."""
    lp = randn(shape, seed, 0.3, dtype, device)
    return lp, lp + randn(shape, seed + 1, 0.4, dtype, device), randn(shape, seed + 2, 1.0,
                                                                       dtype, device)


def packed(aggregation):
    return dict(cu_seqlens=torch.tensor(CU)) if aggregation in SEQ_MODES else {}


def sac_case(N=37, K=2, A=None, seed=0, dtype=torch.float32, device="cpu"):
    r = randn((N,), seed, dtype=dtype, device=device)
    term = random_mask((N,), seed + 1, device, p=0.2)
    if A is None:
        return dict(rewards=r, terminated=term,
                    next_q_values=randn((N, K), seed + 2, dtype=dtype, device=device),
                    next_log_probs=randn((N,), seed + 3, dtype=dtype, device=device))
    logits = randn((N, A), seed + 4, device=device)
    return dict(rewards=r, terminated=term,
                next_q_values=randn((N, A, K), seed + 2, dtype=dtype, device=device),
                next_log_probs=torch.log_softmax(logits, -1).to(dtype),
                next_probs=torch.softmax(logits, -1).to(dtype))


def grads_of(outs, xs, seed=11):
    """d sum_i w_i * out_i / d xs for random weights w_i (None: zero)."""
    g = gen(seed)
    total = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64).to(
        o.device)).sum() for o in outs if o.requires_grad)
    got = torch.autograd.grad(total, xs, allow_unused=True)
    return [torch.zeros_like(x) if d is None else d for x, d in zip(xs, got)]


def check_against_spec(fn, spec, xs, *, tol=1e-5, grad_tol=1e-5, n_outputs=None):
    """`fn(*xs)` (the Triton backend) against `spec` (float64, the same values) in outputs and
    in gradients."""
    got = fn(*xs)
    got = got if isinstance(got, tuple) else (got,)
    refs = leaves(*(x.double() for x in xs))
    want = spec(*refs)
    want = want if isinstance(want, tuple) else (want,)
    for i, (o, w) in enumerate(zip(got, want)):
        assert o.dtype == torch.float32
        assert_close(o, w, tol, f"output {i}")
    diff = [o for o in got if o.requires_grad]
    d_got = grads_of(diff, xs)
    d_want = grads_of([w for o, w in zip(got, want) if o.requires_grad], refs)
    for i, (a, b, x) in enumerate(zip(d_got, d_want, xs)):
        assert a.dtype == x.dtype, (i, a.dtype, x.dtype)
        assert_close(a, b.to(a.dtype), grad_tol, f"gradient {i}")


PPO_OPTIONS = {"default": {}, "asymmetric": dict(clip_low=0.1, clip_high=0.3),
               "dual": dict(dual_clip=1.5), "log_ratio_clamp": dict(log_ratio_clamp=0.25),
               "all": dict(clip_low=0.15, clip_high=0.25, dual_clip=2.0, log_ratio_clamp=0.3)}


BACKENDS = ["loop", "torch", "triton"]


@pytest.fixture(scope="module")
def frameworks():
    from rl_triton.testing import import_frameworks
    try:
        return import_frameworks()
    except ImportError as e:
        pytest.skip(str(e))


def both_ways(ours, theirs, xs, device, tol=1e-5):
    """Outputs and gradients (of the first output) of `ours(*xs)` and `theirs(*xs)`, `xs` on
    `device`."""
    xs = [x.to(device) for x in xs]
    a, b = leaves(*xs), leaves(*xs)
    got, want = ours(*a), theirs(*b)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for i, (o, w) in enumerate(zip(got, want)):
        assert_close(o.detach(), torch.as_tensor(w, dtype=torch.float32).detach(), tol,
                     f"output {i}")
    if want[0].requires_grad:
        w = torch.randn(want[0].shape, generator=gen(12)).to(device)
        for i, (x, y) in enumerate(zip(
                torch.autograd.grad((got[0] * w).sum(), a, allow_unused=True),
                torch.autograd.grad((want[0] * w).sum(), b, allow_unused=True))):
            if y is not None:
                assert_close(x, y, tol, f"gradient {i}")


def cleanrl_ppo(newlogprob, b_logprobs, mb_advantages, newvalue, b_values, b_returns, clip_coef):
    """CleanRL ppo.py's loss lines (v1.0), transcribed."""
    logratio = newlogprob - b_logprobs
    ratio = logratio.exp()
    approx_kl = ((ratio - 1) - logratio).mean()
    pg_loss1 = -mb_advantages * ratio
    pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
    pg_loss = torch.max(pg_loss1, pg_loss2).mean()
    v_loss_unclipped = (newvalue - b_returns) ** 2
    v_clipped = b_values + torch.clamp(newvalue - b_values, -clip_coef, clip_coef)
    v_loss_clipped = (v_clipped - b_returns) ** 2
    v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
    return pg_loss, v_loss, approx_kl


def cleanrl_sac_continuous(rewards, dones, qf1_next_target, qf2_next_target, next_state_log_pi,
                           alpha, gamma):
    """CleanRL sac_continuous_action.py's target lines, transcribed."""
    min_qf_next_target = torch.min(qf1_next_target, qf2_next_target) - alpha * next_state_log_pi
    return rewards.flatten() + (1 - dones.flatten()) * gamma * min_qf_next_target.view(-1)


def cleanrl_sac_discrete(rewards, dones, qf1_next_target, qf2_next_target, next_state_log_pi,
                         next_state_action_probs, alpha, gamma):
    """CleanRL sac_atari.py's target lines, transcribed."""
    min_qf_next_target = next_state_action_probs * (
        torch.min(qf1_next_target, qf2_next_target) - alpha * next_state_log_pi)
    min_qf_next_target = min_qf_next_target.sum(dim=1)
    return rewards.flatten() + (1 - dones.flatten()) * gamma * min_qf_next_target
