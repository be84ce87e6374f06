"""The losses (semantics §9): ppo_policy_loss, value_loss, kl_penalty, sac_targets, crr_weights.

The torch and loop backends are checked by float64 gradcheck; the Triton kernels (Triton's
interpreter on the CPU) against autograd through the plain PyTorch transcriptions of semantics §9
below, outputs and gradients; and all of them against the installed verl 0.9.1 and OpenRLHF
0.11.2 functions, and CleanRL's loss and target lines (CleanRL is single-file scripts, not a
package: its few lines are transcribed here), on random inputs.
"""
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


# ---- semantics §9, transcribed -------------------------------------------------------------------

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


# ---- gradcheck of the torch and loop backends ----------------------------------------------------

def ppo_case(shape=(3, 7), seed=0, dtype=torch.float64, device="cpu"):
    """log_probs, old_log_probs (log-ratios of about +-0.4: some clipped), advantages."""
    lp = randn(shape, seed, 0.3, dtype, device)
    return lp, lp + randn(shape, seed + 1, 0.4, dtype, device), randn(shape, seed + 2, 1.0,
                                                                       dtype, device)


def packed(aggregation):
    return dict(cu_seqlens=torch.tensor(CU)) if aggregation in SEQ_MODES else {}


@pytest.mark.parametrize("backend", ["torch", "loop"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_gradcheck_ppo(aggregation, backend):
    options = dict(clip_high=0.28, dual_clip=2.0, log_ratio_clamp=0.5, aggregation=aggregation)
    for shape, extra in (((3, 7), {}), ((37,), packed(aggregation))):
        if aggregation in SEQ_MODES and len(shape) == 1 and not extra:
            continue
        xs = leaves(*ppo_case(shape))
        mask = random_mask(shape, 9)

        def fn(*xs):
            loss, _, kl = rl_triton.ppo_policy_loss(*xs, mask, **options, **extra,
                                                    backend=backend, out_dtype=torch.float64)
            return loss, kl
        assert torch.autograd.gradcheck(fn, xs)


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


@pytest.mark.parametrize("backend", ["torch", "loop"])
@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3"])  # "+": gradient is not the value's
@pytest.mark.parametrize("clamp", [None, 0.4])
def test_gradcheck_kl_penalty(kind, clamp, backend):
    xs = leaves(randn((3, 7), 7, dtype=torch.float64), randn((3, 7), 8, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda *xs: rl_triton.kl_penalty(
        *xs, kind, clamp, backend=backend, out_dtype=torch.float64), xs)


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


# ---- the Triton kernels against the transcriptions -----------------------------------------------

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


@pytest.mark.parametrize("options", list(PPO_OPTIONS))
@pytest.mark.parametrize("shape,aggregation", [
    (shape, aggregation) for shape in [(1,), (37,), (5, 50), (3, 7, 11)]
    for aggregation in AGGREGATIONS if len(shape) == 2 or aggregation not in SEQ_MODES])
def test_ppo_triton(shape, aggregation, options, device):
    """Odd shapes; the mean over sequences where they are rows of [B, T] (and below, segments
    of cu_seqlens)."""
    xs = leaves(*ppo_case(shape, dtype=torch.float32, device=device))
    for mask in (None, random_mask(shape, 3, device)):
        m = torch.ones(shape, dtype=torch.bool, device=device) if mask is None else mask
        kw = dict(PPO_OPTIONS[options], aggregation=aggregation)
        check_against_spec(
            lambda *xs: rl_triton.ppo_policy_loss(*xs, mask, **kw, backend="triton"),
            lambda *xs: spec_ppo(*xs, m, **kw), xs)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_ppo_triton_packed(aggregation, device):
    """cu_seqlens: every segment a sequence (an empty one, one of length 1), with and without
    a mask (that empties a further segment)."""
    xs = leaves(*ppo_case((37,), seed=4, dtype=torch.float32, device=device))
    cu = torch.tensor(CU, device=device)
    for mask in (None, random_mask((37,), 5, device)):
        m = torch.ones(37, dtype=torch.bool, device=device) if mask is None else mask.clone()
        if mask is not None:
            m[20] = mask[20] = False  # the segment [20, 21) has no position that counts
        kw = dict(dual_clip=2.0, aggregation=aggregation)
        check_against_spec(
            lambda *xs: rl_triton.ppo_policy_loss(*xs, mask, **kw, cu_seqlens=cu,
                                                  backend="triton"),
            lambda *xs: spec_ppo(*xs, m, **kw, cu=CU), xs)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "none"])
def test_ppo_triton_bf16_and_views(aggregation, device):
    """bf16 and fp16 inputs (float32 math, gradients in the inputs' dtypes), a transposed view,
    a broadcast mask and a float mask (set where nonzero) are read as they are."""
    lp, old, adv = ppo_case((5, 50), seed=6, dtype=torch.float32, device=device)
    mask = random_mask((5, 1), 7, device).expand(5, 50)
    xs = [lp.to(torch.bfloat16), old.to(torch.float16), adv.to(torch.bfloat16)]
    check_against_spec(
        lambda *xs: rl_triton.ppo_policy_loss(*xs, mask.float() * 0.5, aggregation=aggregation,
                                              backend="triton"),
        lambda *xs: spec_ppo(*xs, mask, aggregation=aggregation), leaves(*xs), grad_tol=1e-2)
    views = [t.t().contiguous().t() for t in (lp, old, adv)]  # [5, 50] of [50, 5] memory
    assert not views[0].is_contiguous()
    check_against_spec(
        lambda *xs: rl_triton.ppo_policy_loss(*xs, mask, aggregation=aggregation,
                                              backend="triton"),
        lambda *xs: spec_ppo(*xs, mask, aggregation=aggregation),
        [v.detach().requires_grad_() for v in views])


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


@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3", "k1+", "abs+", "k2+", "k3+"])
@pytest.mark.parametrize("clamp", [None, 0.5, 10.0])
def test_kl_penalty_triton(kind, clamp, device):
    for shape, dtype in [((1,), torch.float32), ((37,), torch.float32),
                         ((3, 7, 11), torch.float32), ((5, 50), torch.bfloat16)]:
        xs = leaves(randn(shape, 1, 2.0, dtype, device), randn(shape, 2, 2.0, dtype, device))
        check_against_spec(lambda *xs: rl_triton.kl_penalty(*xs, kind, clamp, backend="triton"),
                           lambda *xs: spec_kl(*xs, kind, clamp), xs,
                           grad_tol=1e-5 if dtype == torch.float32 else 1e-2)


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


# ---- semantics -----------------------------------------------------------------------------------

BACKENDS = ["loop", "torch", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_aggregations_by_hand(backend, device):
    """Two responses of 4 tokens, the second's last two masked: losses l = -A (ratio 1)."""
    adv = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]], device=device)
    lp = torch.zeros(2, 4, device=device)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool, device=device)
    want = {"token-mean": -(1 + 2 + 3 + 4 + 5 + 6) / 6, "sum": -21.0,
            "seq-mean-token-sum": -(10 + 11) / 2, "seq-mean-token-mean": -(2.5 + 5.5) / 2}
    for aggregation, value in want.items():
        loss, clip, kl = rl_triton.ppo_policy_loss(lp, lp, adv, mask, aggregation=aggregation,
                                                   backend=backend)
        assert abs(loss.item() - value) < 1e-6, aggregation
        assert clip.item() == 0 and kl.item() == 0
    loss = rl_triton.ppo_policy_loss(lp, lp, adv, mask, aggregation="none", backend=backend)[0]
    assert torch.equal(loss, torch.where(mask, -adv, 0.0))
    # packed: the same responses as segments [0, 4) and [4, 6)
    cu = torch.tensor([0, 4, 6], device=device)
    loss = rl_triton.ppo_policy_loss(lp[mask], lp[mask], adv[mask], cu_seqlens=cu,
                                     aggregation="seq-mean-token-mean", backend=backend)[0]
    assert abs(loss.item() - want["seq-mean-token-mean"]) < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_empty_selection_is_zero(aggregation, backend, device):
    """No position counts: the loss is 0 (not NaN) and so are its gradients; a row without a
    position that counts is left out of the mean over sequences."""
    lp, old, adv = leaves(*ppo_case((3, 7), dtype=torch.float32, device=device))
    none = torch.zeros(3, 7, dtype=torch.bool, device=device)
    loss, clip, kl = rl_triton.ppo_policy_loss(lp, old, adv, none, aggregation=aggregation,
                                               backend=backend)
    assert loss.abs().sum().item() == 0 and clip.item() == 0 and kl.item() == 0
    (loss.sum() + kl).backward()
    assert lp.grad.abs().sum() == 0 and adv.grad.abs().sum() == 0
    v = rl_triton.value_loss(lp, old, mask=none, aggregation=aggregation, backend=backend)
    assert v.abs().sum().item() == 0
    if aggregation in SEQ_MODES:
        one_row = none.clone()
        one_row[1] = True
        full = rl_triton.ppo_policy_loss(lp, old, adv, one_row, aggregation=aggregation,
                                         backend=backend)[0]
        alone = rl_triton.ppo_policy_loss(lp[1:2], old[1:2], adv[1:2],
                                          aggregation=aggregation, backend=backend)[0]
        assert abs(full.item() - alone.item()) < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("packed_rows,aggregation", [(False, a) for a in AGGREGATIONS]
                         + [(True, a) for a in SEQ_MODES])
def test_mask_is_binary(packed_rows, aggregation, backend, device):
    """The mask is set where nonzero: 0.5, 2.0 and -3.0 count as 1 (a weight goes in through
    the inputs, not the mask), the same losses, metrics and gradients bit for bit as a bool
    mask; a sequence without a set position (a masked-out row or segment, an empty segment)
    does not count in the mean over sequences."""
    shape = (37,) if packed_rows else (4, 9)
    lp, old, adv = ppo_case(shape, dtype=torch.float32, device=device)
    mask = random_mask(shape, 3, device)
    kw = dict(aggregation=aggregation)
    if packed_rows:
        kw["cu_seqlens"] = torch.tensor(CU, device=device)
        mask[5:20] = False  # segment 2 (segment 1 is empty)
    else:
        mask[2] = False
    weights = torch.tensor([0.5, 2.0, -3.0], device=device)[torch.arange(mask.numel(),
                                                                         device=device) % 3]
    results = []
    for m in (mask, torch.where(mask, weights.view(shape), 0.0)):
        xs = leaves(lp, old, adv)
        outs = rl_triton.ppo_policy_loss(*xs, m, **kw, backend=backend)
        v = leaves(lp, adv, old)
        outs = (*outs, rl_triton.value_loss(*v, m, clip=0.2, **kw, backend=backend))
        results.append([o.detach() for o in outs] + grads_of(outs, xs + v))
    for a, b in zip(*results):
        assert torch.equal(a, b), (a, b)
    if aggregation in SEQ_MODES:  # the mean over the sequences with a set position
        l = -adv * torch.exp(lp - old)
        l = torch.maximum(l, -adv * torch.exp(lp - old).clamp(0.8, 1.2))
        seqs = ([slice(a, b) for a, b in zip(CU[:-1], CU[1:])] if packed_rows
                else [slice(b, b + 1) for b in range(4)])
        per = [l[s][mask[s]].sum() / (mask[s].sum() if aggregation.endswith("mean") else 1)
               for s in seqs if mask[s].any()]
        assert len(per) < len(seqs)
        assert abs(results[0][0].item() - (sum(per) / len(per)).item()) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan(backend, device):
    """A NaN at a position that counts gives NaN (a NaN ratio is never clipped); at a masked
    position it reaches nothing."""
    lp, old, adv = ppo_case((2, 6), dtype=torch.float32, device=device)
    lp[0, 2] = float("nan")
    mask = torch.ones(2, 6, dtype=torch.bool, device=device)
    per = rl_triton.ppo_policy_loss(lp, old, adv, mask, aggregation="none", backend=backend)[0]
    assert per[0, 2].isnan() and per.isnan().sum() == 1
    assert rl_triton.ppo_policy_loss(lp, old, adv, mask, backend=backend)[0].isnan()
    mask[0, 2] = False
    out = rl_triton.ppo_policy_loss(lp, old, adv, mask, dual_clip=3.0, backend=backend)
    assert all(o.isfinite() for o in out)
    assert rl_triton.value_loss(lp, old, old, mask, clip=0.2, backend=backend).isfinite()
    assert rl_triton.kl_penalty(lp, old, "k3", 10.0, backend=backend).isnan().sum() == 1
    case = sac_case(6, 2, device=device)
    case["next_q_values"][1, 0] = float("nan")
    case["terminated"][:] = False
    case["terminated"][3] = True
    case["next_q_values"][3, 1] = float("nan")  # terminal: its bootstrap is dropped (a select)
    y = rl_triton.sac_targets(**case, backend=backend)
    assert y[1].isnan() and y.isnan().sum() == 1
    q = torch.zeros(4, device=device)
    sampled = torch.randn(4, 3, device=device)
    sampled[2, 1] = float("nan")
    for kind in ("exp", "binary"):
        for baseline in ("mean", "max"):
            w = rl_triton.crr_weights(q, sampled, kind=kind, baseline=baseline,
                                      backend=backend)
            assert w[2].isnan() and w.isnan().sum() == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_input_gets_its_gradient_and_none_is_written(backend, device):
    """No silent detach; inputs never modified; outputs in out_dtype; second order refused."""
    lp, old, adv = ppo_case((4, 9), dtype=torch.float32, device=device)
    mask = random_mask((4, 9), 2, device)
    xs = leaves(lp, old, adv)
    before = [x.detach().clone() for x in xs]
    loss, clip, kl = rl_triton.ppo_policy_loss(*xs, mask, out_dtype=torch.float64,
                                               backend=backend)
    assert loss.dtype == clip.dtype == kl.dtype == torch.float64
    assert loss.requires_grad and kl.requires_grad and not clip.requires_grad
    (loss + kl).backward()
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in xs)
    assert all(torch.equal(x.detach(), b) for x, b in zip(xs, before))
    v, ret, vold = leaves(lp, adv, old)
    rl_triton.value_loss(v, ret, vold, mask, clip=0.1, backend=backend).backward()
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in (v, ret, vold))
    case = sac_case(9, 2, 3, device=device)
    floats = {k: leaves(t)[0] for k, t in case.items() if t.is_floating_point()}
    alpha = torch.tensor(0.2, device=device, requires_grad=True)
    rl_triton.sac_targets(**dict(case, **floats), alpha=alpha, backend=backend).sum().backward()
    assert all(t.grad is not None for t in floats.values()) and alpha.grad is not None
    a, b = leaves(lp, old)
    out = rl_triton.kl_penalty(a, b, backend=backend)
    with pytest.raises(RuntimeError, match="first-order"):
        torch.autograd.grad(out.sum(), a, create_graph=True)
    with pytest.raises(RuntimeError, match="mask requires grad"):
        rl_triton.ppo_policy_loss(lp, old, adv, mask.float().requires_grad_(), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_approx_kl_alone(backend, device):
    """approx_kl's gradient when the loss gets none (k3 of (old, new): r - 1 per position)."""
    xs = leaves(*ppo_case((5, 50), dtype=torch.float32, device=device))
    kl = rl_triton.ppo_policy_loss(*xs, backend=backend)[2]
    d = torch.autograd.grad(kl, xs[0])[0]
    ratio = (xs[0] - xs[1]).detach().exp()
    assert_close(d, (ratio - 1) / ratio.numel(), 1e-5)


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


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_non_finite_reaches_no_gradient(backend, device):
    """An inf advantage (PPO) or a NaN return (value loss) at a masked position: the loss and
    every gradient are those of a finite value there, the masked positions' gradients 0."""
    lp, old, adv = ppo_case((3, 7), dtype=torch.float32, device=device)
    mask = random_mask((3, 7), 4, device)
    mask[1, 2] = False
    for op, inputs, spoilt in [
            (lambda x: rl_triton.ppo_policy_loss(*x, mask, backend=backend)[::2],
             (lp, old, adv), 2),
            (lambda x: (rl_triton.value_loss(*x, mask, clip=0.2, backend=backend),),
             (lp, old, adv), 1)]:
        results = []
        for value in (0.5, float("inf"), float("nan")):
            xs = [t.clone() for t in inputs]
            xs[spoilt][1, 2] = value
            xs = leaves(*xs)
            outs = op(xs)
            results.append([o.detach() for o in outs] + grads_of(outs, xs))
        for got in results[1:]:
            for a, b in zip(got, results[0]):
                assert a.isfinite().all() and torch.equal(a, b), (a, b)
        assert all((g[~mask] == 0).all() for g in results[0][-3:])


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


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_inputs(backend, device):
    for shape in [(0,), (2, 0)]:
        xs = leaves(*ppo_case(shape, dtype=torch.float32, device=device))
        for aggregation in AGGREGATIONS:
            if aggregation in SEQ_MODES and len(shape) == 1:
                continue
            loss, clip, kl = rl_triton.ppo_policy_loss(*xs, aggregation=aggregation,
                                                       backend=backend)
            assert loss.shape == (shape if aggregation == "none" else ())
            (loss.sum() + kl).backward()
            assert xs[0].grad.shape == shape
            assert rl_triton.value_loss(*xs[:2], aggregation=aggregation,
                                        backend=backend).sum().item() == 0
        assert rl_triton.kl_penalty(*xs[:2], backend=backend).shape == shape
    case = sac_case(0, 2, 3, device=device)
    assert rl_triton.sac_targets(**case, backend=backend).shape == (0,)
    assert rl_triton.crr_weights(torch.zeros(0, device=device), torch.zeros(0, 4, device=device),
                                 backend=backend).shape == (0,)


def test_64_bit_indexing(monkeypatch, device):
    """The kernels' 64-bit indexing (tensors past 2^31 elements), taken here at small shapes."""
    from rl_triton.ops import _losses
    monkeypatch.setattr(_losses, "INT32_MAX", 16)
    xs = leaves(*ppo_case((5, 50), dtype=torch.float32, device=device))
    mask = random_mask((5, 50), 1, device)
    check_against_spec(
        lambda *xs: rl_triton.ppo_policy_loss(*xs, mask, aggregation="seq-mean-token-mean",
                                              backend="triton"),
        lambda *xs: spec_ppo(*xs, mask, aggregation="seq-mean-token-mean"), xs)
    check_against_spec(lambda *xs: rl_triton.value_loss(*xs, mask, clip=0.2, backend="triton"),
                       lambda *xs: spec_value(*xs, mask, clip=0.2), xs)
    check_against_spec(lambda a, b: rl_triton.kl_penalty(a, b, backend="triton"),
                       lambda a, b: spec_kl(a, b, "k3"), xs[:2])
    case = sac_case(37, 2, 5, device=device)
    names = [k for k, v in case.items() if v.is_floating_point()]
    check_against_spec(
        lambda *xs: rl_triton.sac_targets(**dict(case, **dict(zip(names, xs))), backend="triton"),
        lambda *xs: spec_sac(xs[0], case["terminated"], *xs[1:3], gamma=0.99, alpha=0.2,
                             probs=xs[3]), leaves(*(case[k] for k in names)))
    q, sampled = randn((37,), 1, device=device), randn((37, 5), 2, device=device)
    assert_close(rl_triton.crr_weights(q, sampled, backend="triton"), spec_crr(q, sampled), 1e-6)


def test_triton_is_deterministic(device):
    lp, old, adv = ppo_case((64, 300), seed=8, dtype=torch.float32, device=device)
    mask = random_mask((64, 300), 9, device)
    runs = [rl_triton.ppo_policy_loss(lp, old, adv, mask, aggregation="seq-mean-token-mean",
                                      backend="triton") for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


# ---- the frameworks' own functions ---------------------------------------------------------------

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


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum",
                                  "seq-mean-token-mean"])
def test_verl_policy_loss(frameworks, mode, backend, device):
    """verl's "vanilla" policy loss (`compute_policy_loss_vanilla`, dual clip always on, at
    clip_ratio_c): loss and pg_clipfrac; its ppo_kl is the k1 mean (ours: k3)."""
    from omegaconf import OmegaConf
    config = OmegaConf.create(dict(clip_ratio=0.2, clip_ratio_low=0.15, clip_ratio_high=0.28,
                                   clip_ratio_c=2.5, global_batch_info={}))
    fn = frameworks.verl.get_policy_loss_fn("vanilla")
    mask = random_mask((6, 40), 1, device)
    mask[2] = False  # a response without tokens
    ours_mode = "sum" if mode == "token-sum" else mode

    def ours(lp, old, adv):
        return rl_triton.ppo_policy_loss(lp, old, adv, mask, clip_low=0.15, clip_high=0.28,
                                         dual_clip=2.5, aggregation=ours_mode,
                                         backend=backend)[:2]

    def theirs(lp, old, adv):
        loss, metrics = fn(old, lp, adv, mask.float(), mode, config)
        return loss, metrics["actor/pg_clipfrac"]
    both_ways(ours, theirs, ppo_case((6, 40), dtype=torch.float32), device)


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
@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_openrlhf_policy_loss(frameworks, token_level, dual_clip, backend, device):
    """OpenRLHF's PolicyLoss: token_level_loss=True is token-mean, False seq-mean-token-mean;
    loss and clip_ratio (its ppo_kl is the k1 mean of the raw log-ratio; ours: k3)."""
    policy_loss = frameworks.openrlhf_loss.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28,
                                                      dual_clip=dual_clip,
                                                      token_level_loss=token_level)
    mask = random_mask((6, 40), 5, device)

    def ours(lp, old, adv):
        return rl_triton.ppo_policy_loss(
            lp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip,
            aggregation="token-mean" if token_level else "seq-mean-token-mean",
            backend=backend)[:2]
    both_ways(ours, lambda lp, old, adv: policy_loss(lp, old, adv, mask.float())[:2],
              ppo_case((6, 40), seed=3, dtype=torch.float32), device)


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


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_openrlhf_approx_kl(frameworks, kind, backend, device):
    """compute_approx_kl clamps every estimator to +-10: ours with clamp=10."""
    xs = (randn((5, 50), 1, 6.0), randn((5, 50), 2, 6.0))
    both_ways(lambda lp, base: rl_triton.kl_penalty(lp, base, kind, 10.0, backend=backend),
              lambda lp, base: frameworks.openrlhf_utils.compute_approx_kl(
                  lp, base, kl_estimator=kind), xs, device)


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


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cleanrl_ppo(backend, device):
    """CleanRL's pg_loss, v_loss and approx_kl (its clipfracs counts |ratio - 1| > clip_coef
    whatever the advantage's sign: not ours, not compared)."""
    lp, old, adv = ppo_case((256,), seed=2, dtype=torch.float32)
    v, ret = randn((256,), 3), randn((256,), 4)
    old_v = v + randn((256,), 5, 0.3)

    def ours(lp, old, adv, v, old_v, ret):
        pg, _, kl = rl_triton.ppo_policy_loss(lp, old, adv, backend=backend)
        return pg, rl_triton.value_loss(v, ret, old_v, clip=0.2, backend=backend), kl
    both_ways(ours, lambda *xs: cleanrl_ppo(*xs, clip_coef=0.2), (lp, old, adv, v, old_v, ret), device)


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


# ---- torch.compile -------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fullgraph_compile(backend, device):
    """Every loss inside one compiled step, forward and backward, without graph breaks (the
    kernels as custom ops; aot_eager on the CPU), equal to the eager step."""
    lp0, old, adv = ppo_case((5, 50), dtype=torch.float32, device=device)
    mask = random_mask((5, 50), 1, device)
    sac = sac_case(37, 2, 4, device=device)
    q, sampled = randn((37,), 2, device=device), randn((37, 5), 3, device=device)
    packed_x = ppo_case((37,), seed=5, dtype=torch.float32, device=device)
    cu = torch.tensor(CU, device=device)

    def step(lp, q_next, alpha):
        pg, clip, kl = rl_triton.ppo_policy_loss(lp, old, adv, mask, dual_clip=3.0,
                                                 aggregation="seq-mean-token-mean",
                                                 backend=backend)
        v = rl_triton.value_loss(lp, adv, old, mask, clip=0.2, kind="huber", backend=backend)
        k = rl_triton.kl_penalty(lp, old, "k3", 10.0, backend=backend)
        y = rl_triton.sac_targets(sac["rewards"], sac["terminated"], q_next,
                                  sac["next_log_probs"], alpha=alpha,
                                  next_probs=sac["next_probs"], backend=backend)
        w = rl_triton.crr_weights(q, sampled, backend=backend)
        packed_loss = rl_triton.ppo_policy_loss(*packed_x, cu_seqlens=cu,
                                                aggregation="seq-mean-token-sum",
                                                backend=backend)[0]
        return pg + v + (k * mask).mean() + kl + y.sum() + packed_loss, clip, w

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (step, compiled):
        xs = leaves(lp0, sac["next_q_values"], torch.tensor(0.2, device=device))
        total, clip, w = fn(*xs)
        total.backward()
        results.append([total.detach(), clip, w] + [x.grad for x in xs])
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_the_hot_path_still_checks(backend, device):
    """A repeated call finds its plan (one per signature), and still checks what its signature
    does not fix: the offsets' values; a new option value or type is a new signature, checked
    (docs/dev/op-framework.md)."""
    from rl_triton._core import plans
    lp, old, adv = (torch.randn(12, device=device) for _ in range(3))
    cu = torch.tensor([0, 5, 12], device=device)
    kw = dict(cu_seqlens=cu, aggregation="seq-mean-token-mean", backend=backend)
    plans.clear_plans()
    first = rl_triton.ppo_policy_loss(lp, old, adv, **kw)
    again = rl_triton.ppo_policy_loss(lp, old, adv, **kw)
    assert len(plans._PLANS) == 1
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    cu[1] = 13  # in place: no signature changes
    with pytest.raises(ValueError, match="never decrease"):
        rl_triton.ppo_policy_loss(lp, old, adv, **kw)
    cu[1] = 5
    with pytest.raises(ValueError, match="clip_low"):
        rl_triton.ppo_policy_loss(lp, old, adv, clip_low=2.0, **kw)
    with pytest.raises(TypeError, match="check_offsets"):
        rl_triton.ppo_policy_loss(lp, old, adv, check_offsets=1, **kw)
    with pytest.raises(ValueError, match="clip needs old_values"):
        rl_triton.value_loss(lp, adv, clip=0.2, backend=backend)
    # old_values unread without a clip: set aside by the check, on the hot path too
    for _ in range(2):
        torch.testing.assert_close(rl_triton.value_loss(lp, adv, old, backend=backend),
                                   rl_triton.value_loss(lp, adv, backend=backend))


def test_custom_ops_are_registered():
    from rl_triton._core.op import OPS, ops
    assert ops("loss") == ["ppo_policy_loss", "policy_loss", "value_loss", "kl_penalty",
                           "sac_targets", "crr_weights"]
    for name in ops("loss"):
        assert hasattr(torch.ops.rl_triton, name)
        assert hasattr(torch.ops.rl_triton, name + "_backward") == (name != "crr_weights")
        assert OPS[name].function is getattr(rl_triton, name)


# ---- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input(backend):
    lp, old, adv = ppo_case((3, 7), dtype=torch.float32)

    def raises(exc, match, fn, *args, **kw):
        with pytest.raises(exc, match=match):
            fn(*args, **kw, backend=backend)

    ppo = rl_triton.ppo_policy_loss
    raises(ValueError, r"old_log_probs has shape \(3, 6\) but log_probs has shape \(3, 7\)", ppo,
           lp, old[:, :6], adv)
    raises(ValueError, r"mask has shape \(7,\)", ppo, lp, old, adv, torch.ones(7))
    raises(TypeError, "advantages has dtype torch.int64", ppo, lp, old, adv.long())
    raises(TypeError, "log_probs must be a torch.Tensor", ppo, [0.0], old, adv)
    raises(ValueError, "old_log_probs is on meta but log_probs is on cpu", ppo, lp,
           old.to("meta"), adv)
    raises(ValueError, "aggregation must be one of", ppo, lp, old, adv, aggregation="mean")
    raises(ValueError, r"clip_low=1.5 is outside \[0.0, 1.0\]", ppo, lp, old, adv,
           clip_low=1.5)
    raises(ValueError, r"dual_clip=1.0 is outside \(1.0, inf\)", ppo, lp, old, adv,
           dual_clip=1.0)
    raises(ValueError, "log_ratio_clamp=0.0 is outside", ppo, lp, old, adv, log_ratio_clamp=0.0)
    raises(ValueError, "averages over sequences", ppo, lp[0], old[0], adv[0],
           aggregation="seq-mean-token-mean")
    raises(ValueError, r"with cu_seqlens the inputs are packed sequences \[L\]", ppo, lp, old,
           adv, cu_seqlens=torch.tensor([0, 21]))
    raises(ValueError, "cu_seqlens must start at 0, end at L = 7", ppo, lp[0], old[0], adv[0],
           cu_seqlens=torch.tensor([0, 3, 6]))
    raises(ValueError, "and it decreases", ppo, lp[0], old[0], adv[0],
           cu_seqlens=torch.tensor([0, 5, 3, 7]))
    raises(TypeError, "cu_seqlens has dtype torch.float32", ppo, lp[0], old[0], adv[0],
           cu_seqlens=torch.tensor([0.0, 7.0]))
    with pytest.raises(ValueError, match="backend must be one of"):
        ppo(lp, old, adv, backend="cuda")
    vl = rl_triton.value_loss
    raises(ValueError, "clip needs old_values", vl, lp, old, clip=0.2)
    raises(ValueError, "kind must be one of", vl, lp, old, kind="l1")
    raises(ValueError, "huber_delta=0.0 is outside", vl, lp, old, kind="huber", huber_delta=0.0)
    raises(ValueError, r"returns has shape \(7,\)", vl, lp, old[0])
    raises(ValueError, "kind must be one of", rl_triton.kl_penalty, lp, old, "k4")
    raises(ValueError, "clamp=-1.0 is outside", rl_triton.kl_penalty, lp, old, "k3", -1.0)
    raises(ValueError, r"ref_log_probs has shape \(3, 6\)", rl_triton.kl_penalty, lp, old[:, :6])
    sac = sac_case(5, 2, 3)
    raises(ValueError, "next_q_values has shape .* next_probs has 3 actions",
           rl_triton.sac_targets, **dict(sac, next_q_values=torch.randn(5, 4, 2)))
    raises(ValueError, r"next_log_probs has shape \(5,\)", rl_triton.sac_targets,
           **dict(sac, next_log_probs=torch.randn(5)))
    raises(ValueError, r"next_q_values has shape \(5,\)", rl_triton.sac_targets,
           **dict(sac_case(5, 2), next_q_values=torch.randn(5)))
    raises(ValueError, "no critic", rl_triton.sac_targets,
           **dict(sac_case(5, 2), next_q_values=torch.randn(5, 0)))
    raises(ValueError, r"alpha must be a number or a tensor of one element; got shape \(2,\)",
           rl_triton.sac_targets, **sac, alpha=torch.ones(2))
    raises(TypeError, "alpha is a tensor of dtype torch.int64", rl_triton.sac_targets, **sac,
           alpha=torch.tensor(1))
    raises(TypeError, "alpha must be a number or a tensor", rl_triton.sac_targets, **sac,
           alpha="0.2")
    raises(ValueError, "gamma=1.5 is outside", rl_triton.sac_targets, **sac, gamma=1.5)
    raises(TypeError, "terminated has dtype torch.complex64", rl_triton.sac_targets,
           **dict(sac, terminated=torch.zeros(5, dtype=torch.complex64)))
    raises(RuntimeError, "terminated requires grad", rl_triton.sac_targets,
           **dict(sac, terminated=torch.zeros(5).requires_grad_()))
    q, sampled = torch.randn(4), torch.randn(4, 3)
    raises(ValueError, "beta=0.0 is outside", rl_triton.crr_weights, q, sampled, beta=0.0)
    raises(ValueError, "kind must be one of", rl_triton.crr_weights, q, sampled, kind="soft")
    raises(ValueError, "baseline must be one of", rl_triton.crr_weights, q, sampled,
           baseline="median")
    raises(ValueError, "no sampled action", rl_triton.crr_weights, q, sampled[:, :0])
    raises(ValueError, r"sampled_q_values has shape \(3, 4\)", rl_triton.crr_weights, q,
           sampled.t())
