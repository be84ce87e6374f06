"""The LLM zoo (semantics §10): every advantage estimator of verl 0.9.1's registry, verl's
kl_penalty names and compute_value_loss, OpenRLHF 0.11.2's compute_approx_kl and rollout
correction against the frameworks' own functions on the same inputs (multi-turn masks, right
padding, a fully masked row, groups of one), and the switches. Small shapes: the torch backend,
and the Triton interpreter for the kernels these reach (scans, kl_penalty, value_loss)."""
import importlib
import math
import re
import sys
import types

import numpy as np
import pytest
import torch

import rl_triton
from rl_triton.integrations import openrlhf as our_orl
from rl_triton.integrations import verl as our_verl
from rl_triton.testing import import_frameworks

try:
    FW = import_frameworks()
except ImportError as e:  # .ci/run installs them; elsewhere say how
    pytest.skip(f"{e}", allow_module_level=True)

from test_integrations_llm import _blocks_index, _index, assert_same, rows  # noqa: E402


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    monkeypatch.setattr(our_verl, "backend", request.param)
    monkeypatch.setattr(our_orl, "backend", request.param)
    return request.param


class Config(dict):
    """verl's AlgoConfig as the estimators read it (`.get`)."""


def _passk_index(B):
    """Groups of 2 to 4 (Pass@k refuses groups of one), in any order."""
    ids = np.repeat(np.arange(B), 4)[:B]
    ids[-1] = ids[-2]
    return np.random.default_rng(1).permutation(ids)


CASES = {  # name -> (args after (rewards, mask)) built from (B, T, mask, index)
    "compute_grpo_vectorized_outcome_advantage": lambda B, T, m, ix: ((ix,), {}),
    "compute_rloo_vectorized_outcome_advantage": lambda B, T, m, ix: ((ix,), {}),
    "compute_opo_outcome_advantage": lambda B, T, m, ix: ((ix,), {}),
    "compute_gpg_outcome_advantage": lambda B, T, m, ix: ((ix,), {"f_norm": 2.0}),
    "compute_gdpo_outcome_advantage": lambda B, T, m, ix: ((ix,), {}),
    "compute_grpo_passk_outcome_advantage": lambda B, T, m, ix: (
        (ix,), {"config": Config(norm_adv_by_std_in_grpo=True)}),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("kind", ["multi-turn", "padded"])
@pytest.mark.parametrize("layout", ["any order", "blocks"])
def test_verl_group_estimators(name, kind, layout, device):
    """Each against verl; `blocks`: verl's rollout layout, a prompt's 3 responses side by side
    (the drop-ins' path without a sort)."""
    B, T = 15, 17
    r, _, m = rows(B, T, device, kind=kind)
    passk = "passk" in name
    ix = _blocks_index(B)[0] if layout == "blocks" else _passk_index(B) if passk else _index(B)
    args, kw = CASES[name](B, T, m, ix)
    for dtype in (torch.float32, torch.int64, torch.bool):
        want = getattr(FW.verl, name)(r, m.to(dtype), *args, **kw)
        got = getattr(our_verl, name)(r, m.to(dtype), *args, **kw)
        for g, w in zip(got, want):
            assert_same(g, w.to(g.device), 2e-5)


def test_verl_passk_options_and_errors(device):
    r, _, m = rows(9, 7, device)
    ix = _passk_index(9)
    for norm in (True, False):
        cfg = Config(norm_adv_by_std_in_grpo=norm)
        want = FW.verl.compute_grpo_passk_outcome_advantage(r, m, ix, config=cfg)
        got = our_verl.compute_grpo_passk_outcome_advantage(r, m, ix, config=cfg)
        assert_same(got[0], want[0], 2e-6)
    with pytest.raises(ValueError, match="at least 2"):
        our_verl.compute_grpo_passk_outcome_advantage(r, m, _index(9), config=Config())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_verl_grpo_vectorized_reward_dtypes(dtype, device):
    """verl's vectorized GRPO takes its group statistics in float32 and subtracts the mean from
    the scores in their own dtype: float64 scores keep their digits below float32 (two scores
    equal in float32 but not in float64 get a nonzero advantage), bfloat16 scores are summed in
    bfloat16."""
    r = torch.tensor([[0.1, 0.2], [0.3, 0.0]], dtype=dtype, device=device)
    pair = np.array(["u", "u"], dtype=object)
    cases = [(r, torch.ones(2, 2, device=device), pair)]
    rr, _, m = rows(15, 17, device)
    cases += [(rr.to(dtype), m.to(mdt), ix) for mdt in (torch.float32, torch.bool)
              for ix in (_index(15), _blocks_index(15)[0])]
    for rewards, mask, ix in cases:
        for kw in ({}, {"norm_adv_by_std_in_grpo": False}):
            want = FW.verl.compute_grpo_vectorized_outcome_advantage(rewards, mask, ix, **kw)
            got = our_verl.compute_grpo_vectorized_outcome_advantage(rewards, mask, ix, **kw)
            for g, w in zip(got, want):
                assert_same(g, w, 1e-12 if dtype == torch.float64 else 2e-5)
    assert want[0].abs().max() > 0  # the pair's advantage: verl's is not 0


def test_verl_whitening_reductions(device):
    """verl's masked_whiten, reduction for reduction (its mean is a plain sum over
    mask.sum() + 1e-8): on near-constant inputs, such as GDPO's sum of equal GRPO advantages,
    another summation order flips the sign of the whitened noise."""
    B, T = 8, 9
    lengths = torch.tensor([9, 4, 0, 7, 1, 9, 5, 3])
    resp = (torch.arange(T)[None] < lengths[:, None]).to(device)
    flat = torch.full((B, T), 1.0, device=device) / (1 + 1e-6) * resp
    r, _, m = rows(7, 23, device)
    for x, mask in ((flat, resp), (r, m), (r.double(), m)):
        for dtype in (torch.float32, torch.float64, torch.int64, torch.bool):
            assert torch.equal(our_verl._whiten(x, mask.to(dtype)),
                               FW.verl_F.masked_whiten(x, mask.to(dtype)))
    P = 3
    batch = {"prompts": torch.zeros(B, P, device=device),
             "attention_mask": torch.cat([torch.ones(B, P, device=device), resp.float()], 1).long()}
    kw = dict(token_level_rewards=torch.zeros(B, T, device=device), response_mask=resp.float(),
              index=np.arange(B), config=Config(gdpo_reward_keys=["acc"]),
              non_tensor_batch={"acc": np.ones(B)}, batch=batch)
    want = FW.verl.compute_gdpo_outcome_advantage(**kw)[0]
    assert torch.equal(our_verl.compute_gdpo_outcome_advantage(**kw)[0], want)


def test_verl_gdpo_reward_components(device):
    B, T, P = 8, 9, 3
    r, _, m = rows(B, T, device, kind="padded")
    lengths = torch.randint(1, T + 1, (B,))
    attention = torch.cat([torch.ones(B, P), (torch.arange(T) < lengths[:, None])], 1).long()
    batch = {"prompts": torch.zeros(B, P), "attention_mask": attention.to(device)}
    g = np.random.default_rng(0)
    extra = {"fmt": g.random(B), "acc": g.integers(0, 2, B).astype(float)}
    cfg = Config(gdpo_reward_keys=["fmt", "acc"], gdpo_reward_weights=[0.5, 2.0])
    ix = np.repeat(np.arange(4), 2)
    want = FW.verl.compute_gdpo_outcome_advantage(r, m.float(), ix, config=cfg,
                                                  non_tensor_batch=extra, batch=batch)
    got = our_verl.compute_gdpo_outcome_advantage(r, m.float(), ix, config=cfg,
                                                  non_tensor_batch=extra, batch=batch)
    assert_same(got[0], want[0], 2e-5)


@pytest.mark.parametrize("B,T", [(1, 1), (13, 17)])
def test_verl_remax(B, T, backend, device):
    r, _, m = rows(B, T, device)
    base = torch.randn(B, device=device)
    for dtype in (torch.float32, torch.bool):
        want = FW.verl.compute_remax_outcome_advantage(r, base, m.to(dtype))
        got = our_verl.compute_remax_outcome_advantage(r, base, m.to(dtype))
        for g, w in zip(got, want):
            assert_same(g, w, 1e-5)


OTB = ["compute_optimal_token_baseline_advantage",
       "compute_multi_turn_optimal_token_baseline_advantage"]


@pytest.mark.parametrize("name", OTB)
@pytest.mark.parametrize("kind", ["multi-turn", "padded"])
def test_verl_optimal_token_baseline(name, kind, backend, device):
    B, T = 15, 17
    r, _, m = rows(B, T, device, kind=kind)
    g = torch.Generator().manual_seed(3)
    old = (-3 * torch.rand(B, T, generator=g)).to(device)
    spi = (0.5 * torch.rand(B, T, generator=g)).to(device)
    isw = (0.5 + torch.rand(B, T, generator=g)).to(device)
    full = backend == "torch" or torch.cuda.is_available()  # one case through the interpreter
    dtypes = (torch.float32, torch.bool) if full else (torch.float32,)
    for ix in (_index(B), _passk_index(B), _blocks_index(B)[0]) if full else (_index(B),):
        for w in (None, isw) if full else (isw,):
            for tail in (True, False) if full else (True,):
                for dtype in dtypes:
                    want = getattr(FW.verl, name)(r, m.to(dtype), ix, old, spi, w, tail)
                    got = getattr(our_verl, name)(r, m.to(dtype), ix, old, spi, w, tail)
                    for a, b in zip(got, want):
                        assert_same(a, b, 2e-5)


KL_NAMES = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]


def _grads(f, lp0, ref0, *args, **kw):
    lp, ref = lp0.clone().requires_grad_(), ref0.clone().requires_grad_()
    out = f(lp, ref, *args, **kw)
    out.backward(torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape))
    return out, lp.grad, ref.grad


def _log_probs(device, B=5, T=37):
    g = torch.Generator().manual_seed(0)
    lp, ref = 4 * torch.randn(B, T, generator=g), 4 * torch.randn(B, T, generator=g)
    lp[0, 0], lp[0, 1] = 30.0, -30.0  # beyond every clamp
    return lp.to(device), ref.to(device), (lp + torch.randn(B, T, generator=g)).to(device)


@pytest.mark.parametrize("name", KL_NAMES + [n + "+" for n in KL_NAMES])
def test_verl_kl_penalty(name, backend, device):
    lp, ref, _ = _log_probs(device)
    for got, want in zip(_grads(our_verl.kl_penalty, lp, ref, name),
                         _grads(FW.verl.kl_penalty, lp, ref, name)):
        assert_same(got, want, 2e-6)
    for bad in ("full", "k4"):
        with pytest.raises(NotImplementedError):
            our_verl.kl_penalty(lp, ref, bad)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("unbiased", [False, True])
def test_openrlhf_compute_approx_kl(estimator, unbiased, backend, device):
    lp, ref, old = _log_probs(device)
    for o in (None, old):
        kw = dict(kl_estimator=estimator, unbiased_gradient=unbiased)
        for got, want in zip(_grads(our_orl.compute_approx_kl, lp, ref, o, **kw),
                             _grads(FW.openrlhf_utils.compute_approx_kl, lp, ref, o, **kw)):
            assert_same(got, want, 2e-6)
    with pytest.raises(ValueError):
        our_orl.compute_approx_kl(lp, ref, kl_estimator="k4")


@pytest.mark.parametrize("kind", ["k1+", "abs+", "k2+", "k3+"])
@pytest.mark.parametrize("clamp", [None, 10.0])
def test_kl_straight_through_backends(kind, clamp, backend, device):
    """The "+" kinds on every backend against the float64 reference: k's value, d's gradient."""
    lp, ref, _ = _log_probs(device)
    f = lambda a, b: rl_triton.kl_penalty(a, b, kind, clamp, backend=backend)  # noqa: E731
    g = lambda a, b: rl_triton.reference.kl_penalty(a, b, kind, clamp)  # noqa: E731
    for got, want in zip(_grads(f, lp, ref), _grads(g, lp.double(), ref.double())):
        assert (got.double() - want).abs().max() <= 2e-6 * max(1.0, want.abs().max().item())
    d = (lp - ref).detach()
    assert torch.allclose(_grads(f, lp, ref)[1], torch.linspace(
        -1, 1, d.numel(), device=device).reshape(d.shape) * d, rtol=1e-6, atol=1e-6)


# ---- the critic's loss ----------------------------------------------------------------------

VERL_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm",
              "seq-mean-token-mean"]


def _value_loss_and_grads(f, inputs, mask, *args, **kw):
    """(loss, clip fraction, gradients of vpreds, returns and the old values)."""
    xs = [t.clone().requires_grad_() for t in inputs]
    loss, clipfrac = f(*xs, mask, *args, **kw)
    loss.backward()
    return loss.detach(), clipfrac, [x.grad for x in xs]


@pytest.mark.parametrize("mode", VERL_MODES)
@pytest.mark.parametrize("kind", ["multi-turn", "padded"])
def test_verl_compute_value_loss(mode, kind, backend, device):
    """verl's compute_value_loss (the critic's): loss, gradients and clip fraction, with spans
    masked mid-row and a fully masked row, float and bool masks (verl's critic passes bool), and
    verl's global counts as numbers and as tensors."""
    B, T = 7, 23
    r, v, m = rows(B, T, device, kind=kind)
    g = torch.Generator().manual_seed(1)
    vpreds = v + (0.6 * torch.randn(B, T, generator=g)).to(device)
    counts = [{}, dict(dp_size=2, batch_num_tokens=50, global_batch_size=9, loss_scale_factor=7),
              dict(dp_size=torch.tensor(2), batch_num_tokens=torch.tensor(61.0),
                   global_batch_size=torch.tensor(9))]
    for dtype in (torch.float32, torch.bool):
        for kw in counts:
            args = ((vpreds, r, v), m.to(dtype), 0.3, mode)
            want = _value_loss_and_grads(FW.verl.compute_value_loss, *args, **kw)
            got = _value_loss_and_grads(our_verl.compute_value_loss, *args, **kw)
            assert_same(got[0], want[0], 2e-6)
            assert_same(got[1], want[1], 0.0)
            assert 0 < want[1] < 1
            for a, b in zip(got[2], want[2]):
                assert_same(a, b, 2e-6)


def test_verl_compute_value_loss_empty_and_errors(device):
    """A batch with no token that counts: a loss of 0 (no gradient), where verl divides 0 by 0 in
    token-mean and the seq-mean modes (its token-sum gives 0, and so does every mode given the
    global counts); verl's errors for a bad mode and a missing global count."""
    r, v, m = rows(5, 9, device)
    none = torch.zeros_like(m)
    for mode in VERL_MODES:
        for kw in ({}, dict(batch_num_tokens=40, global_batch_size=8)):
            args = ((v + 0.5, r, v), none, 0.3, mode)
            want = _value_loss_and_grads(FW.verl.compute_value_loss, *args, **kw)
            got = _value_loss_and_grads(our_verl.compute_value_loss, *args, **kw)
            assert got[0].item() == 0 and got[1].item() == want[1].item() == 0
            assert all(not x.any() for x in got[2])
            assert want[0].isnan().item() == (mode != "token-sum" and not kw), mode
    for mode, kw in (("sum", {}), ("token-mean", dict(dp_size=2)),
                     ("seq-mean-token-mean", dict(dp_size=2))):
        for theirs in (FW.verl.compute_value_loss, our_verl.compute_value_loss):
            with pytest.raises(ValueError):
                theirs(v, r, v, m, 0.3, mode, **kw)


# ---- rollout correction ---------------------------------------------------------------------

def _rollout(device, B=7, T=13, seed=0):
    _, _, m = rows(B, T, device, seed=seed)
    g = torch.Generator().manual_seed(seed + 5)
    old = (-3 * torch.rand(B, T, generator=g)).to(device)
    roll = old + (0.5 * torch.randn(B, T, generator=g)).to(device)
    old = torch.where(m, old, torch.nan)  # non-finite where the mask removes: reaches nothing
    return old, roll, m


OPTIONS = [dict(level=lv, mode=md, low=lo, high=hi, weight_level=wl, log_ratio_clamp=c)
           for lv in ("token", "sequence", "geometric", "max") for md in ("truncate", "mask")
           for lo in (None, 0.7) for hi in (None, 1.3) for c in (20.0, None)
           for wl in ((None, "token") if md == "mask" else (None,))]
OPTIONS += [dict(level=lv, mode="mask", statistic=st, low=lo, high=0.05, weight_level=wl)
            for lv in ("token", "sequence", "geometric", "max")
            for st in ("k1", "k2", "k3", "binary_kl", "tv")
            for lo in (None, -0.05) for wl in (None, "geometric")]


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_rollout_correction_reference_and_packed(options, device):
    old, roll, m = _rollout(device)
    w, keep = rl_triton.rollout_correction(old, roll, m, **options)
    w_ref, keep_ref = rl_triton.rollout_correction(old.cpu(), roll.cpu(), m.cpu(),
                                                   backend="loop", **options)
    assert torch.equal(keep.cpu(), keep_ref) and w.dtype == torch.float32
    assert (w.cpu().double() - w_ref).abs().max() <= 1e-6 * max(1, w_ref.abs().max())
    assert not w.isnan().any() and (w[~keep] == 0).all()
    # the same rows packed: [L] with cu_seqlens (an empty segment included)
    B, T = m.shape
    cu = torch.tensor([0] + [T * (i + 1) for i in range(B)] + [B * T], device=device)
    wp, kp = rl_triton.rollout_correction(old.reshape(-1), roll.reshape(-1), m.reshape(-1),
                                          cu_seqlens=cu, **options)
    assert torch.equal(kp.reshape(B, T), keep) and torch.allclose(wp.reshape(B, T), w)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric", "max"])
def test_rollout_correction_loop_past_exp_range(level):
    """Log-ratios whose sum is past exp's range in float64, without a clamp: the loop backend
    gives the torch backend's weights (inf truncated to `high`, or rejected), not OverflowError."""
    old = torch.tensor([[400.0, 400.0, -1.0], [-1.0, -2.0, -3.0]], dtype=torch.float64)
    roll = torch.zeros_like(old)
    for mode in ("truncate", "mask"):
        kw = dict(level=level, mode=mode, high=2.0, log_ratio_clamp=None)
        w, keep = rl_triton.rollout_correction(old, roll, None, backend="loop", **kw)
        w_t, keep_t = rl_triton.rollout_correction(old, roll, None, backend="torch", **kw)
        assert torch.equal(keep, keep_t) and torch.allclose(w, w_t, rtol=1e-12, atol=0)


@pytest.mark.parametrize("options", OPTIONS[::5], ids=str)
def test_rollout_correction_kernel(options, device):
    """The kernel (the interpreter on CPU) against the torch backend, rows and packed."""
    old, roll, m = _rollout(device, B=5, T=37)
    want = rl_triton.rollout_correction(old, roll, m, backend="torch", **options)
    got = rl_triton.rollout_correction(old, roll, m, backend="triton", **options)
    assert torch.equal(got[1], want[1]) and got[0].dtype == torch.float32
    assert (got[0] - want[0]).abs().max() <= 1e-5 * max(1, want[0].abs().max())
    B, T = m.shape
    cu = torch.tensor([0, T, T, 2 * T, 3 * T, 4 * T, 5 * T], device=device)
    wp, kp = rl_triton.rollout_correction(old.reshape(-1), roll.reshape(-1), m.reshape(-1).int(),
                                          cu_seqlens=cu, backend="triton", **options)
    assert torch.equal(kp.reshape(B, T), want[1])
    assert (wp.reshape(B, T) - want[0]).abs().max() <= 1e-5 * max(1, want[0].abs().max())


@pytest.mark.parametrize("level", ["token", "sequence", "geometric", "max"])
def test_rollout_correction_nan_where_it_counts(level, device):
    """A NaN log-probability at a set position: its sequence's weights are NaN (truncate) or the
    sequence is rejected (mask) on every backend, rows and packed, the max's included (fmax and
    Python's max drop a NaN); the other sequences are as without it."""
    old, roll, m = _rollout(device, B=4, T=9)
    old = torch.where(m, old, -1.0)
    t = int(m[1].nonzero()[0])
    bad = old.clone()
    bad[1, t] = torch.nan
    B, T = m.shape
    cu = torch.arange(0, B * T + 1, T, device=device)
    for kw in (dict(mode="truncate", high=2.0), dict(mode="mask", statistic="k2", high=2.0)):
        clean = rl_triton.rollout_correction(old, roll, m, level=level, backend="torch", **kw)
        for backend in ("loop", "torch", "triton"):
            for w, keep in (rl_triton.rollout_correction(bad, roll, m, level=level,
                                                         backend=backend, **kw),
                            [r.reshape(B, T) for r in rl_triton.rollout_correction(
                                bad.reshape(-1), roll.reshape(-1), m.reshape(-1),
                                cu_seqlens=cu, level=level, backend=backend, **kw)]):
                others = torch.arange(B, device=device) != 1
                assert torch.equal(keep[others], clean[1][others]), (backend, kw)
                assert torch.allclose(w[others], clean[0][others].to(w.dtype)), (backend, kw)
                hit = slice(None) if level != "token" else t
                if kw["mode"] == "truncate":
                    assert w[1, hit][m[1, hit]].isnan().all(), (backend, kw)
                else:
                    assert not keep[1, hit].any(), (backend, kw)


def test_rollout_correction_weights_are_constants(device):
    """Weights carry no gradient (they reweight samples) and the inputs are left as they were."""
    old, roll, m = _rollout(device)
    old = torch.where(m, old, -1.0).requires_grad_()
    before = old.detach().clone()
    for backend in ("torch", "triton", "loop"):
        w, keep = rl_triton.rollout_correction(old, roll, m, level="sequence", backend=backend)
        assert not w.requires_grad and keep.dtype == torch.bool
    assert torch.equal(old.detach(), before)


def test_rollout_correction_errors():
    old, roll, m = _rollout("cpu")
    with pytest.raises(ValueError, match="level"):
        rl_triton.rollout_correction(old, roll, m, level="seq")
    with pytest.raises(ValueError, match="low"):
        rl_triton.rollout_correction(old, roll, m, low=2.0, high=1.0)
    with pytest.raises(ValueError, match="weight_level"):
        rl_triton.rollout_correction(old, roll, m, weight_level="token", level="sequence")
    with pytest.raises(ValueError, match="shape"):
        rl_triton.rollout_correction(old, roll[:, 1:], m)
    with pytest.raises(ValueError, match="cu_seqlens"):
        rl_triton.rollout_correction(old.reshape(-1), roll.reshape(-1),
                                     cu_seqlens=torch.tensor([0, 5]))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rollout_correction_hot_path(backend, device):
    """A repeated call finds its plan (one per signature) and still checks the offsets' values
    and new options; under torch.compile(fullgraph=True) the kernel is its custom op
    (docs/dev/op-framework.md)."""
    from rl_triton._core import plans
    old, roll, m = _rollout(device, B=3, T=37)
    kw = dict(level="geometric", mode="mask", low=0.5, high=2.0, backend=backend)
    plans.clear_plans()
    first = rl_triton.rollout_correction(old, roll, m, **kw)
    again = rl_triton.rollout_correction(old.flip(0), roll.flip(0), m.flip(0), **kw)
    assert len(plans._PLANS) == 1
    assert all(torch.equal(a.flip(0), b) for a, b in zip(first, again))
    with pytest.raises(ValueError, match="low"):
        rl_triton.rollout_correction(old, roll, m, **dict(kw, low=3.0))
    cu = torch.tensor([0, 37, 74, 111], device=device)
    flat = [x.reshape(-1) for x in (old, roll, m)]
    rl_triton.rollout_correction(*flat, cu_seqlens=cu, **kw)
    cu[1] = 80  # in place: the same signature
    with pytest.raises(ValueError, match="never decrease"):
        rl_triton.rollout_correction(*flat, cu_seqlens=cu, **kw)
    if backend == "triton":
        def step(a, b):
            w, keep = rl_triton.rollout_correction(a, b, m, **kw)
            return w * 2.0, keep

        torch._dynamo.reset()
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(old, roll)
        assert torch.equal(got[0], first[0] * 2.0) and torch.equal(got[1], first[1])


def _verl_helper():
    return importlib.import_module("verl.trainer.ppo.rollout_corr_helper")


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, "1.5", "0.6_1.4"])
@pytest.mark.parametrize("normalize", [False, True])
def test_verl_rollout_correction_weights(level, threshold, normalize, device):
    helper = _verl_helper()
    old, roll, m = _rollout(device)
    log_ratio = torch.where(m, old - roll, 0.0)
    for dtype in (torch.float32, torch.int64):
        args = (log_ratio, m.to(dtype), level, threshold, normalize)
        got, got_metrics = our_verl.compute_rollout_correction_weights(*args)
        want, want_metrics = helper.compute_rollout_correction_weights(*args)
        assert_same(got, want, 2e-6)
        assert got_metrics.keys() == want_metrics.keys()
        for k, v in want_metrics.items():
            assert math.isclose(got_metrics[k], v, rel_tol=1e-5, abs_tol=1e-6), k


def _normalize_rank(rank, world, store, out):
    """One gloo rank: verl's and our batch-normalized weights on this rank's own batch."""
    import os

    import torch.distributed as dist

    from rl_triton.testing import leave_rank

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    helper = _verl_helper()
    old, roll, m = _rollout("cpu", seed=rank)  # the ranks' batches differ
    log_ratio = torch.where(m, (1 + rank) * (old - roll), 0.0)
    saved = {}
    for level in ("token", "sequence"):
        args = (log_ratio, m.float(), level, 5.0, True)
        saved[level] = (our_verl.compute_rollout_correction_weights(*args),
                        helper.compute_rollout_correction_weights(*args), args)
    torch.save(saved, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()  # both ranks done before either tears down (testing.spawn_ranks)
    dist.destroy_process_group()
    leave_rank()


def test_verl_rollout_batch_normalize_distributed(tmp_path):
    """Two gloo ranks: under torch.distributed verl divides the weights by the mean over every
    rank's batch (its distributed_masked_mean); ours too, and that mean is not the rank's own."""
    from rl_triton.testing import spawn_ranks

    stores = iter(range(2))  # a new file store for a second spawn
    spawn_ranks(_normalize_rank, lambda: (2, str(tmp_path / f"store{next(stores)}"),
                                          str(tmp_path)), 2)
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        for level, ((got, got_metrics), (want, want_metrics), args) in saved.items():
            assert_same(got, want, 2e-6)
            assert got_metrics.keys() == want_metrics.keys()
            for k, v in want_metrics.items():
                assert math.isclose(got_metrics[k], v, rel_tol=1e-5, abs_tol=1e-6), k
            # without a process group (here) the mean is the rank's own, another number
            local = _verl_helper().compute_rollout_correction_weights(*args)[1]
            factor = "rollout_is_batch_norm_factor"
            assert not math.isclose(local[factor], want_metrics[factor], rel_tol=1e-3), level


@pytest.mark.parametrize("level,mode", [("token", "mask"), ("seq", "mask"), ("token", "clip")])
def test_openrlhf_rollout_correction(level, mode, device):
    """OpenRLHF's `PolicyLoss` correction factor (tis / icepop / seq-mask-tis), read off its
    gradient: with log_probs = old_log_probs the loss is sum(coef * -A * mask), so dL/dA is
    -coef * mask."""
    old, roll, m = _rollout(device)
    old = torch.where(m, old, -1.0)
    low, high = 0.7, 1.3
    loss = FW.openrlhf_loss.PolicyLoss(is_correction_level=level, is_correction_mode=mode,
                                       is_correction_threshold=(low, high))
    adv = torch.zeros_like(old, requires_grad=True)
    out = loss(old, old, adv, m.float(), rollout_log_probs=roll, batch_num_tokens=1.0)[0]
    out.backward()
    coef = -adv.grad
    options = {("token", "mask"): dict(level="token", mode="mask"),
               ("seq", "mask"): dict(level="geometric", mode="mask", weight_level="token"),
               ("token", "clip"): dict(level="token", mode="truncate")}[level, mode]
    w, keep = rl_triton.rollout_correction(old, roll, m, low=low, high=high,
                                           log_ratio_clamp=None, **options)
    assert_same(w, coef, 2e-6)


@pytest.mark.parametrize("trl_mode", ["token_truncate", "token_mask", "sequence_truncate",
                                      "sequence_mask"])
def test_trl_rollout_correction(trl_mode, device):
    """TRL's GRPOTrainer (vllm_importance_sampling_mode; the formula of its
    `_generate_and_score_completions`, TRL not installed): exp of the masked per-token (or
    per-sequence summed) log-ratio, clamped to [clip_min, clip_max] or zeroed outside."""
    old, roll, m = _rollout(device)
    old = torch.where(m, old, -1.0)
    lo, hi = 0.5, 1.2
    diff = (old - roll) * m
    if trl_mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if trl_mode.endswith("truncate"):
        ratio = ratio.clamp(lo, hi)
    else:
        ratio = ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
    want = ratio.expand_as(old) * m
    w, _ = rl_triton.rollout_correction(old, roll, m, level=trl_mode.split("_")[0],
                                        mode=trl_mode.split("_")[1], low=lo, high=hi,
                                        log_ratio_clamp=None)
    assert_same(w, want, 2e-6)


def test_openrlhf_use_rl_triton_kl():
    modules = [FW.openrlhf_utils, sys.modules[FW.openrlhf.__module__]]
    before = [m.compute_approx_kl for m in modules]
    our_orl.use_rl_triton(FW.openrlhf)
    our_orl.use_rl_triton(FW.openrlhf)
    try:
        assert all(m.compute_approx_kl is our_orl.compute_approx_kl for m in modules)
    finally:
        our_orl.revert_rl_triton(FW.openrlhf)
    assert [m.compute_approx_kl for m in modules] == before


def test_verl_switch_reaches_modules_that_imported_by_name(monkeypatch):
    """verl.workers.utils.losses imports kl_penalty by name (the actor's KL loss): the switch
    replaces it there too, and revert puts verl's back."""
    importer = types.ModuleType("verl.workers.utils.losses_like")
    importer.kl_penalty = FW.verl.kl_penalty
    monkeypatch.setitem(sys.modules, importer.__name__, importer)
    our_verl.use_rl_triton(FW.verl)
    try:
        assert importer.kl_penalty is our_verl.kl_penalty
    finally:
        our_verl.revert_rl_triton(FW.verl)
    assert importer.kl_penalty is FW.verl.kl_penalty


def _import_line(path, module):
    """The line of a framework's installed file that imports names from `module`."""
    import os
    root = os.path.dirname(os.path.dirname(sys.modules["verl"].__file__))
    with open(os.path.join(root, path)) as f:
        return next(line for line in f if line.startswith(f"from {module} import "))


def test_verl_revert_reaches_modules_imported_after_the_switch(monkeypatch):
    """A verl module imported while the switch is on takes ours by name (the trainer imports
    verl.workers.utils.losses after `use_rl_triton()`); revert puts verl's own back there too,
    under any name, and leaves modules outside verl alone."""
    losses = types.ModuleType("verl.workers.utils.losses_after")
    helper_user = types.ModuleType("verl.trainer.ppo.helper_user")
    ours_user = types.ModuleType("my_trainer")
    for m in (losses, helper_user, ours_user):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    helper = _verl_helper()
    our_verl.use_rl_triton(FW.verl)
    try:
        # verl's own import line (agg_loss, compute_value_loss, get_policy_loss_fn, kl_penalty)
        exec(_import_line("verl/workers/utils/losses.py", "verl.trainer.ppo.core_algos"),
             vars(losses))
        exec("from verl.trainer.ppo.rollout_corr_helper import "
             "compute_rollout_correction_weights as weights", vars(helper_user))
        ours_user.kl_penalty = our_verl.kl_penalty
        for name, _, fn in our_verl.FUNCTIONS:
            assert getattr(losses, name) is fn
        assert helper_user.weights is our_verl.compute_rollout_correction_weights
    finally:
        our_verl.revert_rl_triton(FW.verl)
    for name, _, _ in our_verl.FUNCTIONS:
        assert getattr(losses, name) is getattr(FW.verl, name) is not getattr(our_verl, name)
    assert losses.get_policy_loss_fn is FW.verl.get_policy_loss_fn
    assert helper_user.weights is helper.compute_rollout_correction_weights
    assert helper.compute_rollout_correction_weights is not \
        our_verl.compute_rollout_correction_weights
    assert ours_user.kl_penalty is our_verl.kl_penalty  # not verl's module: not ours to undo


def test_openrlhf_revert_reaches_modules_imported_after_the_switch(monkeypatch):
    """OpenRLHF's actor module imports PolicyLoss and compute_approx_kl by name, usually after the
    switch (it is loaded by the Ray workers): revert puts OpenRLHF's own back there."""
    actor = types.ModuleType("openrlhf.trainer.ray.ppo_actor")
    monkeypatch.setitem(sys.modules, actor.__name__, actor)
    our_orl.use_rl_triton(FW.openrlhf)
    try:
        # what ppo_actor.py imports (PolicyLoss through openrlhf.models, from its loss module)
        exec("from openrlhf.models.loss import PolicyLoss\n"
             "from openrlhf.models.utils import compute_approx_kl", vars(actor))
        assert actor.PolicyLoss is our_orl.PolicyLoss
        assert actor.compute_approx_kl is our_orl.compute_approx_kl
    finally:
        our_orl.revert_rl_triton(FW.openrlhf)
    assert actor.PolicyLoss is FW.openrlhf_loss.PolicyLoss is not our_orl.PolicyLoss
    assert actor.compute_approx_kl is FW.openrlhf_utils.compute_approx_kl
    assert actor.compute_approx_kl is not our_orl.compute_approx_kl


def test_verl_switch_reaches_the_trainer_path(device):
    """verl's own `compute_advantage` dispatch (registry lookup) reaches the drop-ins."""
    r, _, m = rows(9, 7, device)
    ix = _index(9)
    our_verl.use_rl_triton(FW.verl)
    try:
        fn = FW.verl.get_adv_estimator_fn("opo")
        assert fn is our_verl.compute_opo_outcome_advantage
        got = fn(token_level_rewards=r, response_mask=m, index=ix, config=Config())
        assert FW.verl.kl_penalty is our_verl.kl_penalty
    finally:
        our_verl.revert_rl_triton(FW.verl)
    want = FW.verl.get_adv_estimator_fn("opo")(token_level_rewards=r, response_mask=m, index=ix)
    assert_same(got[0], want[0], 2e-6)


RS = ["token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
      "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3",
      "token_k1,seq_mean_k3"]


@pytest.mark.parametrize("options", RS)
def test_verl_rollout_rejection_mask(options, device):
    helper = _verl_helper()
    old, roll, m = _rollout(device)
    log_ratio = torch.where(m, old - roll, 0.0)
    thresholds = {"k1": "0.8_1.25", "k2": "0.05", "k3": "0.05"}
    if "," in options:
        spec = "0.5_2.0,0.1"
    elif options.startswith("seq_sum"):
        spec = {"k1": "0.3_3.0", "k2": "0.4", "k3": "0.4"}[options[-2:]]
    elif options.startswith("seq_max"):
        spec = "0.2"
    else:
        spec = thresholds[options[-2:]]
    for dtype in (torch.float32, torch.int64):
        got, got_metrics = our_verl.compute_rollout_rejection_mask(log_ratio, m.to(dtype),
                                                                   options, spec)
        want, want_metrics = helper.compute_rollout_rejection_mask(log_ratio, m.to(dtype),
                                                                   options, spec)
        assert torch.equal(got, want) and 0 < got.sum() < m.sum()
        assert got_metrics.keys() == want_metrics.keys()
        for k, v in want_metrics.items():
            assert math.isclose(got_metrics[k], v, rel_tol=1e-5, abs_tol=1e-6), k


@pytest.mark.parametrize("gating", ["binary_kl", "tv"])
@pytest.mark.parametrize("level", ["token", "seq"])
def test_openrlhf_rollout_correction_divergence_gates(gating, level, device):
    old, roll, m = _rollout(device)
    old = torch.where(m, old, -1.0)
    delta = {"binary_kl": 0.02, "tv": 0.1}[gating]
    loss = FW.openrlhf_loss.PolicyLoss(is_correction_level=level, is_correction_mode="mask",
                                       is_correction_gating=gating,
                                       is_correction_threshold=(0.0, delta))
    adv = torch.zeros_like(old, requires_grad=True)
    loss(old, old, adv, m.float(), rollout_log_probs=roll, batch_num_tokens=1.0)[0].backward()
    w, keep = rl_triton.rollout_correction(
        old, roll, m, level="token" if level == "token" else "geometric", mode="mask",
        statistic=gating, low=0.0, high=delta, weight_level="token", log_ratio_clamp=None)
    assert_same(w, -adv.grad, 2e-6)
    assert 0 < keep.sum() < m.sum()


@pytest.mark.parametrize("threshold", [True, "", "x", "1_x", 0, -1.0, "0_2", "3_2", [2.0]])
def test_verl_rollout_is_threshold_errors(threshold):
    """A bad rollout_is_threshold raises verl's own exception, message included (verl's
    tests/trainer/ppo/test_rollout_corr.py matches "not a boolean")."""
    helper = _verl_helper()
    log_ratio, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises((TypeError, ValueError)) as want:
        helper.compute_rollout_correction_weights(log_ratio, m, rollout_is_threshold=threshold)
    with pytest.raises(want.type, match=f"^{re.escape(str(want.value))}$"):
        our_verl.compute_rollout_correction_weights(log_ratio, m,
                                                    rollout_is_threshold=threshold)


def test_verl_switch_reaches_rollout_correction(device, monkeypatch):
    """verl's own `compute_rollout_correction_and_rejection_mask` (what its trainer calls) runs
    the drop-ins after `use_rl_triton()`, and gives the same weights, mask and metrics."""
    helper = _verl_helper()
    # its DataProto wraps the weights in a TensorDict (tensordict is stubbed here): a plain holder
    monkeypatch.setattr(helper, "DataProto", types.SimpleNamespace(
        from_dict=lambda tensors: types.SimpleNamespace(batch=tensors)))
    old, roll, m = _rollout(device)
    old = torch.where(m, old, -1.0)
    kw = dict(rollout_is="token", rollout_is_threshold="0.7_1.4", rollout_rs="seq_mean_k3",
              rollout_rs_threshold=0.1)
    want = helper.compute_rollout_correction_and_rejection_mask(old, roll, m.float(), **kw)
    before = (helper.compute_rollout_correction_weights, helper.compute_rollout_rejection_mask)
    our_verl.use_rl_triton(FW.verl)
    try:
        assert helper.compute_rollout_rejection_mask is our_verl.compute_rollout_rejection_mask
        got = helper.compute_rollout_correction_and_rejection_mask(old, roll, m.float(), **kw)
    finally:
        our_verl.revert_rl_triton(FW.verl)
    assert (helper.compute_rollout_correction_weights,
            helper.compute_rollout_rejection_mask) == before
    assert_same(got[0].batch["rollout_is_weights"], want[0].batch["rollout_is_weights"], 2e-6)
    assert torch.equal(got[1], want[1])
    for k, v in want[2].items():
        assert math.isclose(got[2][k], v, rel_tol=1e-5, abs_tol=1e-6), k
