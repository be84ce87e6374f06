"""`ppo_policy_loss` (docs/semantics.md §9): the torch and loop backends by float64 gradcheck, the
Triton kernels against the plain PyTorch transcription of the spec (loss_cases.spec_ppo), outputs
and gradients, odd shapes, packed rows, bf16 and views; aggregations by hand, approx_kl,
determinism; verl's and OpenRLHF's policy losses. What the losses share: tests/ops/test_losses.py;
the checks shared with other ops (tests/ops/op_checks) run here too."""
import math

import pytest
import torch

import rl_triton
from loss_cases import (AGGREGATIONS, BACKENDS, CU, PPO_OPTIONS, SEQ_MODES, assert_close, both_ways,
                        check_against_spec, leaves, packed, ppo_case, random_mask, spec_ppo)
from loss_cases import frameworks  # noqa: F401 (a fixture)
import op_checks

OPS = ["ppo_policy_loss"]


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
def test_approx_kl_alone(backend, device):
    """approx_kl's gradient when the loss gets none (k3 of (old, new): r - 1 per position)."""
    xs = leaves(*ppo_case((5, 50), dtype=torch.float32, device=device))
    kl = rl_triton.ppo_policy_loss(*xs, backend=backend)[2]
    d = torch.autograd.grad(kl, xs[0])[0]
    ratio = (xs[0] - xs[1]).detach().exp()
    assert_close(d, (ratio - 1) / ratio.numel(), 1e-5)


def test_triton_is_deterministic(device):
    lp, old, adv = ppo_case((64, 300), seed=8, dtype=torch.float32, device=device)
    mask = random_mask((64, 300), 9, device)
    runs = [rl_triton.ppo_policy_loss(lp, old, adv, mask, aggregation="seq-mean-token-mean",
                                      backend="triton") for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


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


# the checks shared with other ops (tests/ops/op_checks), for this module's OPS
op_checks.install(globals(), OPS)


def tie_case(device):
    """Advantages of exactly 0 (the two terms tie, ratios inside and outside the clip), a NaN
    advantage at a position that counts, and ordinary ones: (lp, old, adv) float64."""
    lp = torch.tensor([[-0.5, -1.5, -1.05, 0.3, -0.2, -1.4, -0.6]], dtype=torch.float64)
    adv = torch.tensor([[0.0, 0.0, 0.0, -0.0, float("nan"), -1.0, 2.0]], dtype=torch.float64)
    return [t.to(device) for t in (lp, torch.full_like(lp, -1.0), adv)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_and_nan_advantages_as_the_frameworks(backend, device):
    """Where the clipped and unclipped terms tie (an advantage of exactly 0, as a GRPO group of
    equal scores gives) the gradient is torch.maximum's, half to each term, as the frameworks'
    losses have it; a NaN advantage gives the same NaN pattern on every backend."""
    for aggregation in ("token-mean", "none"):
        a, b = leaves(*tie_case(device)), leaves(*tie_case(device))
        got = rl_triton.ppo_policy_loss(*a, clip_high=0.28, dual_clip=3.0,
                                        aggregation=aggregation, backend=backend)[0]
        want = spec_ppo(*b, torch.ones_like(b[0], dtype=torch.bool), clip_high=0.28,
                        dual_clip=3.0, aggregation=aggregation)[0]
        grads = torch.autograd.grad(got.sum(), a)
        for x, y in zip(grads, torch.autograd.grad(want.sum(), b)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, equal_nan=True)
        if aggregation == "none":  # the tie's share, by hand: -(r + clip(r)) / 2, not -r
            r = math.exp(0.5)
            assert abs(grads[2][0, 0].item() + (r + 1.28) / 2) < 1e-5
