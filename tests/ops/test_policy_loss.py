"""rl_triton.policy_loss (semantics §10) and its drop-ins: verl 0.9.1's POLICY_LOSS_REGISTRY and
agg_loss, OpenRLHF 0.11.2's PolicyLoss (both called from .ci/frameworks through
`rl_triton.testing.import_frameworks`), TRL's GRPO loss against formulas transcribed from TRL's
code; the torch, loop and Triton (interpreter on CPU) backends against each other; bad input.
"""
import math

import pytest
import torch

import rl_triton
from rl_triton.integrations import openrlhf as our_orl
from rl_triton.integrations import trl as our_trl
from rl_triton.integrations import verl as our_verl
from rl_triton.ops.policy_loss import LOSS_TYPES, METRICS
from rl_triton.testing import import_frameworks

try:
    FW = import_frameworks()
except ImportError as e:  # .ci/run installs them; elsewhere say how
    FW = None
    FW_ERROR = str(e)

needs_fw = pytest.mark.skipif(FW is None, reason="verl / OpenRLHF not installed (.ci/run)")
# the Triton backend's tensors: CUDA where there is one, else the CPU (Triton's interpreter)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def device_of(backend):
    return DEVICE if backend == "triton" else "cpu"


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    """The drop-ins' backend (the modules' attribute)."""
    for module in (our_verl, our_orl, our_trl):
        monkeypatch.setattr(module, "backend", request.param)
    return request.param
VERL_AGGS = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm",
             "seq-mean-token-mean"]


def batch(B=5, T=37, kind="multi-turn", dtype=torch.float32, seed=0, device="cpu"):
    """log_probs, old_log_probs, advantages, weights, mask [B, T]: log-probabilities of
    probabilities in (0.02, 0.98), old ones up to ~0.5 away in log space (some ratios beyond the
    clips), advantages of both signs; right-padded rows of random length, with "multi-turn"
    masked spans inside; row 0 fully masked where B > 2."""
    g = torch.Generator().manual_seed(seed)
    lp = torch.empty(B, T).uniform_(0.02, 0.98, generator=g).log()
    old = (lp + 0.35 * torch.randn(B, T, generator=g)).clamp(max=-0.02)
    adv = torch.randn(B, T, generator=g)
    w = torch.empty(B, T).uniform_(0.5, 1.5, generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    if kind == "multi-turn":
        for b in range(B):
            s = int(torch.randint(0, T, (1,), generator=g))
            mask[b, s:s + int(torch.randint(1, 6, (1,), generator=g))] = False
    if B > 2:
        mask[0] = False
    mask[-1, :3] = True
    return [t.to(device, dtype) for t in (lp, old, adv, w)] + [mask.to(device)]


def grads(loss, inputs):
    got = torch.autograd.grad(loss, [t for t in inputs if t.requires_grad], allow_unused=True)
    it = iter(got)
    return [(next(it) if t.requires_grad else None) for t in inputs]


def close(got, want, tol):
    if got is None or want is None:
        z = got if want is None else want
        assert z is None or z.abs().max().item() <= tol, z
        return
    got, want = got.detach().cpu(), want.detach().cpu()
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    err = (got.to(torch.float64) - want.to(torch.float64)).abs().max().item() if got.numel() \
        else 0.0
    assert err <= tol * scale, (err, scale)


# ---- verl ----------------------------------------------------------------------------------------

def verl_config(rollout_correction=None, **info):
    import verl.workers.config.actor as A
    extra = {} if rollout_correction is None else dict(rollout_correction=rollout_correction)
    c = A.ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                      clip_ratio_high=0.28,
                      policy_loss=A.PolicyLossConfig(dro_beta=0.1, clip_cov_ratio=0.2,
                                                     clip_cov_lb=-1.0, clip_cov_ub=1.0,
                                                     kl_cov_ratio=0.2, ppo_kl_coef=0.5,
                                                     **extra))
    c.global_batch_info.update(info)
    return c


def run_both(name, inputs, mask, agg, config, weighted):
    """verl's registered function and ours on the same inputs: (loss, grads, metrics) each."""
    out = []
    for fn in (FW.verl.POLICY_LOSS_REGISTRY[name], our_verl.POLICY_LOSSES[name]):
        xs = [t.detach().clone().requires_grad_(True) for t in inputs]
        lp, old, adv, w = xs
        torch.manual_seed(7)  # clip_cov's draw: torch.randperm on the default generator
        loss, metrics = fn(old, lp, adv, mask, agg, config, w if weighted else None)
        out.append((loss, grads(loss, xs if weighted else xs[:3]), metrics))
    return out


@needs_fw
@pytest.mark.parametrize("name", [n for n in LOSS_TYPES])
@pytest.mark.parametrize("agg", VERL_AGGS)
def test_verl_losses(name, agg, backend):
    """Right-padded rows of random length with masked spans inside, a fully masked row; with and
    without rollout-correction weights."""
    kind = "multi-turn"
    *inputs, mask = batch(kind=kind, seed=LOSS_TYPES.index(name) * 10 + VERL_AGGS.index(agg),
                          device=device_of(backend))
    for weighted in (False, True):
        (l0, g0, m0), (l1, g1, m1) = run_both(name, inputs, mask.float(), agg, verl_config(),
                                              weighted)
        close(l1, l0, 2e-5)
        assert l1.dtype == l0.dtype
        for a, b in zip(g1, g0):
            close(a, b, 2e-5)
        assert m1.keys() == m0.keys()
        for k in m0:
            assert abs(m1[k] - m0[k]) <= 1e-6, (k, m1[k], m0[k])


@needs_fw
@pytest.mark.parametrize("name", [n for n in LOSS_TYPES])
def test_verl_losses_nan_where_it_counts(name, backend):
    """A NaN log-probability at a position that counts: the loss, the gradients' NaN pattern at
    the positions that count and the metrics as verl's (dppo's gate is a product with it, cispo
    counts a NaN ratio as clipped). Where the mask is not set the gradients are 0 (semantics
    §9), where verl's sequence-level losses multiply a NaN by the mask's 0."""
    *inputs, mask = batch(kind="multi-turn", seed=3, device=device_of(backend))
    b, t = (int(i) for i in mask.nonzero()[0])
    inputs[0] = inputs[0].clone()
    inputs[0][b, t] = torch.nan
    (l0, g0, m0), (l1, g1, m1) = run_both(name, inputs, mask.float(), "token-mean",
                                          verl_config(), False)
    assert l1.isnan().item() == l0.isnan().item()
    for a, w in zip(g1, g0):
        if w is not None:
            assert torch.equal(a.isnan()[mask], w.isnan()[mask])
            assert not a[~mask].any()
    assert m1.keys() == m0.keys()
    for k in m0:
        assert m1[k] == m0[k] or (m1[k] != m1[k] and m0[k] != m0[k]) or \
            abs(m1[k] - m0[k]) <= 1e-6, (k, m1[k], m0[k])


@needs_fw
@pytest.mark.parametrize("agg", VERL_AGGS)
def test_verl_global_batch_info(agg, backend):
    """dp_size, batch_num_tokens, global_batch_size and loss_scale_factor, as verl's agg_loss."""
    *inputs, mask = batch(seed=3, device=device_of(backend))
    info = dict(dp_size=4, batch_num_tokens=97, global_batch_size=11, loss_scale_factor=13)
    # as verl's trainer fills global_batch_info: counts as tensors too
    as_tensors = dict(dp_size=torch.tensor(2), batch_num_tokens=torch.tensor(150.0),
                      global_batch_size=torch.tensor(9), loss_scale_factor=None)
    for name in ("vanilla", "cispo"):
        for batch_info in (info, as_tensors):
            (l0, g0, _), (l1, g1, _) = run_both(name, inputs, mask.float(), agg,
                                                verl_config(**batch_info), False)
            close(l1, l0, 2e-5)
            for a, b in zip(g1, g0):
                close(a, b, 2e-5)
    loss_mat = inputs[0].detach().clone().requires_grad_(True)
    for kw in (info, {}, dict(loss_scale_factor=5)):
        want = FW.verl.agg_loss(loss_mat, mask.float(), agg, **kw)
        got = our_verl.agg_loss(loss_mat, mask.float(), agg, **kw)
        close(got, want, 2e-6)
        close(*[torch.autograd.grad(x, loss_mat)[0] for x in (got, want)], 2e-6)


@needs_fw
def test_verl_agg_loss_dp_needs_counts():
    lp, *_, mask = batch()
    with pytest.raises(ValueError, match="batch_num_tokens"):
        our_verl.agg_loss(lp, mask, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="global_batch_size"):
        our_verl.agg_loss(lp, mask, "seq-mean-token-mean", dp_size=2)


@needs_fw
def test_verl_modes_outside_its_list_raise():
    """verl's agg_loss knows five modes and raises ValueError for any other, policy_loss's
    "sum" included; its losses raise through it, and so do ours."""
    lp, old, adv, _, mask = batch()
    config = verl_config()
    for fn in (FW.verl.agg_loss, our_verl.agg_loss):
        with pytest.raises(ValueError, match="Invalid loss_agg_mode"):
            fn(lp, mask.float(), "sum")
    for fn in (FW.verl.get_policy_loss_fn("vanilla"), our_verl.compute_policy_loss_vanilla):
        with pytest.raises(ValueError, match="Invalid loss_agg_mode"):
            fn(old, lp, adv, mask.float(), "sum", config)


@needs_fw
@pytest.mark.parametrize("loss_type", ["reinforce", "ppo_clip"])
def test_verl_bypass_mode(loss_type, monkeypatch, backend):
    """The dispatch of bypass_mode. verl's rollout helper returns a DataProto, which needs
    tensordict (a stub here): both sides get the same stand-in, token-level truncated IS weights
    exp(log_prob - rollout_log_prob) clamped at the threshold, a mask dropping ratios below 0.5."""
    import types

    import verl.trainer.ppo.rollout_corr_helper as helper
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    def stand_in(old_log_prob, rollout_log_prob, response_mask, rollout_is_threshold, **kw):
        ratio = torch.exp(old_log_prob - rollout_log_prob)
        proto = types.SimpleNamespace(batch={"rollout_is_weights":
                                             ratio.clamp(max=rollout_is_threshold)})
        mask = response_mask * (ratio >= 0.5)
        return proto, mask, {"rollout_corr/kept": float(mask.sum() / response_mask.sum())}

    monkeypatch.setattr(helper, "compute_rollout_correction_and_rejection_mask", stand_in)
    *inputs, mask = batch(seed=5, device=device_of(backend))
    config = verl_config(RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.5,
                                                 loss_type=loss_type))
    (l0, g0, m0), (l1, g1, m1) = run_both("bypass_mode", inputs, mask.float(), "token-mean",
                                          config, False)
    close(l1, l0, 2e-5)
    for a, b in zip(g1, g0):
        close(a, b, 2e-5)
    assert m1.keys() == m0.keys()
    for k in m0:
        assert abs(float(m1[k]) - float(m0[k])) <= 1e-6, k


@needs_fw
def test_verl_patch_and_revert():
    """use_rl_triton() reaches every policy loss of verl's registry and agg_loss; revert undoes."""
    ca = FW.verl
    before = dict(ca.POLICY_LOSS_REGISTRY)
    agg = ca.agg_loss
    assert sorted(before) == sorted(our_verl.POLICY_LOSSES)  # every entry has its drop-in
    our_verl.use_rl_triton(ca)
    our_verl.use_rl_triton(ca)  # idempotent
    try:
        assert all(ca.POLICY_LOSS_REGISTRY[k] is v for k, v in our_verl.POLICY_LOSSES.items())
        assert ca.get_policy_loss_fn("gspo") is our_verl.compute_policy_loss_gspo
        assert ca.agg_loss is our_verl.agg_loss
    finally:
        our_verl.revert_rl_triton(ca)
    assert ca.POLICY_LOSS_REGISTRY == before and ca.agg_loss is agg


@needs_fw
@pytest.mark.parametrize("name", [n for n in LOSS_TYPES])
def test_verl_one_advantage_per_response(name, backend):
    """Advantages of one per response, [B, 1] (and weights of one per response), broadcast to
    the tokens as verl's arithmetic broadcasts them: loss, gradients (d advantages summed over
    the tokens) and metrics as verl's. clip_cov and kl_cov index the advantages by the tokens'
    mask, which verl 0.9.1 cannot do with [B, 1] (IndexError): there the drop-in computes what
    verl computes for the advantages expanded to the tokens."""
    lp, old, adv, w, mask = batch(seed=3, device=device_of(backend))
    inputs = [lp, old, adv[:, :1].contiguous(), w[:, :1].contiguous()]
    verl_fn = FW.verl.POLICY_LOSS_REGISTRY[name]
    if name in ("clip_cov", "kl_cov"):
        # on the CPU: on a GPU verl's out-of-range index is a device-side assert, which ends
        # the process's CUDA context instead of raising
        with pytest.raises(IndexError):
            verl_fn(old.cpu(), lp.cpu(), inputs[2].cpu(), mask.float().cpu(), "token-mean",
                    verl_config())

        def verl_fn(old, lp, adv, mask, agg, config, w, f=verl_fn):
            return f(old, lp, adv.expand_as(lp), mask, agg, config, w)
    for agg in ("token-mean", "seq-mean-token-sum"):
        out = []
        for fn in (verl_fn, our_verl.POLICY_LOSSES[name]):
            xs = [t.detach().clone().requires_grad_(True) for t in inputs]
            torch.manual_seed(7)  # clip_cov's draw
            loss, metrics = fn(xs[1], xs[0], xs[2], mask.float(), agg, verl_config(), xs[3])
            out.append((loss, grads(loss, xs), metrics))
        (l0, g0, m0), (l1, g1, m1) = out
        close(l1, l0, 2e-5)
        for a, b in zip(g1, g0):
            close(a, b, 2e-5)
        assert g1[2].shape == (lp.shape[0], 1)
        assert m1.keys() == m0.keys()
        for k in m0:
            assert abs(m1[k] - m0[k]) <= 1e-6, (k, m1[k], m0[k])


def test_drop_ins_name_advantages_that_do_not_broadcast():
    lp, old, adv, _, mask = batch()
    with pytest.raises(ValueError, match="advantages has shape"):
        our_orl.PolicyLoss()(lp, old, adv[:, :3], mask)
    if FW is not None:
        with pytest.raises(ValueError, match="advantages has shape"):
            our_verl.compute_policy_loss_vanilla(old, lp, adv[:2], mask, "token-mean",
                                                 verl_config())


# ---- OpenRLHF ------------------------------------------------------------------------------------

def orl_both(kwargs, inputs, mask, rollout=None, **call):
    out = []
    for cls in (FW.openrlhf_loss.PolicyLoss, our_orl.PolicyLoss):
        xs = [t.detach().clone().requires_grad_(True) for t in inputs[:3]]
        res = cls(**kwargs)(*xs, mask, rollout, **call)
        out.append((res[0], grads(res[0], xs), res[1:]))
    return out


def check_orl(pair):
    (l0, g0, m0), (l1, g1, m1) = pair
    close(l1, l0, 2e-5)
    assert l1.dtype == l0.dtype
    for a, b in zip(g1, g0):
        close(a, b, 2e-5)
    for a, b in zip(m1, m0):
        assert (a is None) == (b is None)
        if a is not None:
            close(a, b, 1e-6)


@needs_fw
@pytest.mark.parametrize("loss_type", ["ppo", "gspo"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("kind", ["multi-turn", "padded"])
def test_openrlhf_policy_loss(loss_type, dual_clip, token_level, kind, backend):
    *inputs, mask = batch(kind=kind, seed=11, device=device_of(backend))
    kw = dict(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=dual_clip,
              token_level_loss=token_level, policy_loss_type=loss_type)
    check_orl(orl_both(kw, inputs, mask.float()))
    check_orl(orl_both(kw, inputs, mask.float(), dp_size=4, batch_num_tokens=90.0,
                       global_batch_size=9.0))


@needs_fw
@pytest.mark.parametrize("loss_type", ["ppo", "gspo"])
def test_openrlhf_one_advantage_per_response(loss_type, backend):
    """[B, 1] advantages broadcast to the tokens, as OpenRLHF's arithmetic does."""
    lp, old, adv, _, mask = batch(seed=13, device=device_of(backend))
    kw = dict(clip_eps_low=0.2, clip_eps_high=0.28, policy_loss_type=loss_type)
    pair = orl_both(kw, [lp, old, adv[:, :1].contiguous()], mask.float())
    check_orl(pair)
    assert pair[1][1][2].shape == (lp.shape[0], 1)


# OpenRLHF's train / rollout corrections (level, mode, gating, threshold)
ORL_CORRECTIONS = [
    ("token", "mask", "ratio", (0.8, 1.25)), ("token", "clip", "ratio", (0.8, 1.25)),
    ("seq", "mask", "ratio", (0.9, 1.1)), ("token", "mask", "binary_kl", (0.0, 0.05)),
    ("seq", "mask", "tv", (0.0, 0.1))]
# every level with every gating
ORL_ALL_CORRECTIONS = ORL_CORRECTIONS + [("seq", "mask", "binary_kl", (0.0, 0.05)),
                                         ("token", "mask", "tv", (0.0, 0.1))]


def orl_correction(inputs, level, mode, gating, threshold, **kw):
    """The rollout's log-probabilities (old_log_probs plus noise) and PolicyLoss's options."""
    old = inputs[1]
    g = torch.Generator().manual_seed(4)
    noise = torch.randn(old.shape, generator=g).to(old.device)
    rollout = (old + 0.2 * noise).clamp(max=-0.02)
    return rollout, dict(clip_eps_low=0.2, clip_eps_high=0.28, is_correction_level=level,
                         is_correction_mode=mode, is_correction_gating=gating,
                         is_correction_threshold=threshold, **kw)


@needs_fw
@pytest.mark.parametrize("level,mode,gating,threshold", ORL_CORRECTIONS)
@pytest.mark.parametrize("loss_type", ["ppo", "gspo"])
def test_openrlhf_is_correction(level, mode, gating, threshold, loss_type, backend):
    *inputs, mask = batch(seed=12, device=device_of(backend))
    mask[0, :4] = True  # OpenRLHF's per-sequence means need a token in every row
    rollout, kw = orl_correction(inputs, level, mode, gating, threshold,
                                 policy_loss_type=loss_type)
    check_orl(orl_both(kw, inputs, mask.float(), rollout))


@needs_fw
@pytest.mark.parametrize("level,mode,gating,threshold", ORL_ALL_CORRECTIONS)
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_openrlhf_is_correction_without_mask(level, mode, gating, threshold, dual_clip,
                                             backend):
    """action_mask=None: OpenRLHF's masked_mean takes it as a plain mean, in the correction's
    statistics, filter fraction and vllm_kl too (ppo's token-level loss: OpenRLHF's per-sample
    loss and gspo need the mask)."""
    *inputs, _ = batch(seed=14, device=device_of(backend))
    rollout, kw = orl_correction(inputs, level, mode, gating, threshold, dual_clip=dual_clip)
    check_orl(orl_both(kw, inputs, None, rollout))


@needs_fw
@pytest.mark.parametrize("level,mode,gating,threshold",
                         [("off", "mask", "ratio", (0.5, 5.0))] + ORL_ALL_CORRECTIONS)
@pytest.mark.parametrize("loss_type", ["ppo", "gspo"])
def test_openrlhf_masked_nonfinite(level, mode, gating, threshold, loss_type, backend):
    """A NaN or inf in log_probs, old_log_probs or rollout_log_probs where action_mask is 0
    reaches neither the loss, nor a gradient, nor a metric: the outputs are the clean call's
    (semantics §9). OpenRLHF's masked means multiply by the mask and give NaN there (with
    level="seq" a masked NaN rejects the whole sequence); here we deliberately differ."""
    *inputs, mask = batch(seed=15, device=device_of(backend))
    rollout, kw = orl_correction(inputs, level, mode, gating, threshold,
                                 policy_loss_type=loss_type)
    m = mask.float()

    def run(lp, old, roll):
        xs = [t.detach().clone().requires_grad_(True) for t in (lp, old, inputs[2])]
        res = our_orl.PolicyLoss(**kw)(*xs, m, roll)
        return res, grads(res[0], xs)

    out0, g0 = run(inputs[0], inputs[1], rollout)
    assert all(o is None or torch.isfinite(o).all() for o in out0)
    for which in range(3):
        for value in (float("nan"), float("inf"), -float("inf")):
            bad = [t.detach().clone() for t in (inputs[0], inputs[1], rollout)]
            bad[which][~mask] = value
            out, g = run(*bad)
            for a, b in zip(out, out0):
                assert (a is None) == (b is None)
                if a is not None:
                    close(a, b, 1e-6)
            for a, b in zip(g, g0):
                close(a, b, 1e-6)


@needs_fw
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_openrlhf_ppo_kl_unclamped(dual_clip):
    """OpenRLHF's ppo_kl averages the log-ratio unclamped (its own tests/test_loss_aggregation.py
    asserts it), while the loss clamps it at +-20: tokens beyond the clamp, both signs."""
    *inputs, mask = batch(seed=13)
    lp, old = inputs[0].clone(), inputs[1]
    lp[1, :3] = old[1, :3] + 30.0
    lp[2, 1:3] = old[2, 1:3] - 45.0
    mask[1, :3] = mask[2, 1:3] = True
    kw = dict(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=dual_clip)
    pair = orl_both(kw, [lp, *inputs[1:]], mask.float())
    check_orl(pair)
    d = (lp - old)[mask]
    close(pair[1][2][1], -d.mean(), 1e-6)  # (clip_ratio, ppo_kl, ...): ppo_kl


@needs_fw
def test_openrlhf_patch_and_revert():
    mod = FW.openrlhf_loss
    original = mod.PolicyLoss
    our_orl.use_rl_triton(FW.openrlhf)
    our_orl.use_rl_triton(FW.openrlhf)
    try:
        assert mod.PolicyLoss is our_orl.PolicyLoss
    finally:
        our_orl.revert_rl_triton(FW.openrlhf)
    assert mod.PolicyLoss is original


# ---- TRL -----------------------------------------------------------------------------------------

def trl_loss(per_token_logps, old_per_token_logps, advantages, mask, *, loss_type,
             importance_sampling_level, epsilon_low, epsilon_high, delta=None,
             sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, beta=0.0,
             ref_per_token_logps=None, use_bias_correction_kl=False,
             importance_sampling_ratio=None, max_completion_length=None,
             num_items_in_batch=None, num_processes=1, gradient_accumulation_steps=1,
             steps_per_generation=1, off_policy_mask=None, entropy_mask=None):
    """TRL 1.16.0's GRPOTrainer._compute_loss, transcribed from trl/trainer/grpo_trainer.py
    (the wheel trl-1.16.0): lines 3058-3059 (advantages [B] -> [B, 1]), 3083-3095 (log importance
    weights by level), 3098-3105 (the KL term and its bias correction), 3109-3136 (cispo, the
    clipped types with delta, sapo, vespo with get_gamma_weights, lines 2972-3018), 3140-3150
    (the off-policy and entropy masks, importance_sampling_ratio, beta), 3152-3185 (the
    aggregations) and 3254-3290 (the metrics, gathered over one process); training mode. The
    trainer itself is checked in tests/test_trl_trainer.py (TRL installed)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    log_ratio = per_token_logps - old_per_token_logps
    if importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    if beta != 0.0:
        per_token_kl = (torch.exp(ref_per_token_logps - per_token_logps)
                        - (ref_per_token_logps - per_token_logps) - 1)
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    if loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
    elif loss_type in ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]:
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss1 = coef_1 * advantages
        per_token_loss2 = coef_2 * advantages
        per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    elif loss_type == "sapo":
        temperatures = torch.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)
        soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
        per_token_loss = -soft_coef_1 * advantages
    elif loss_type == "vespo":
        with torch.no_grad():
            lower_clamp = math.log(1e-8)
            log_ratio_clamped = torch.clamp(log_ratio, -20.0, 20.0)
            seq_log_ratio = torch.sum(log_ratio_clamped * mask, dim=-1, keepdim=True)
            if importance_sampling_ratio is not None:
                log_is_ratio = torch.clamp(torch.log(importance_sampling_ratio), lower_clamp, 20.0)
                seq_log_ratio += torch.sum(log_is_ratio, dim=-1, keepdim=True)
            log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
            w_seq = torch.exp(log_w_seq)
            is_nonneg_adv = advantages >= 0
            k_seq = torch.where(is_nonneg_adv, 2.0, 3.0)
            lambda_seq = torch.where(is_nonneg_adv, 3.0, 2.0).clamp(min=1e-4)
            log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq
            phi_seq = torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        per_token_loss = -phi_seq * advantages * per_token_logps
    if off_policy_mask is not None:
        per_token_loss = per_token_loss * off_policy_mask
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if importance_sampling_ratio is not None and loss_type != "vespo":
        per_token_loss = per_token_loss * importance_sampling_ratio
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type in ["grpo", "sapo"]:
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        loss = loss / gradient_accumulation_steps
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
        loss = loss / gradient_accumulation_steps
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
        loss = loss / gradient_accumulation_steps
    elif loss_type == "luspo":
        loss = (per_token_loss * mask).sum(-1).mean()
        loss = loss / gradient_accumulation_steps
    else:
        normalizer = num_items_in_batch.clamp(min=1.0) / num_processes
        normalizer = normalizer * gradient_accumulation_steps / steps_per_generation
        loss = (per_token_loss * mask).sum() / normalizer

    def global_masked_mean(x):
        if x.shape[1] == 1:
            return x.sum() / max(float(x.shape[0]), 1.0)
        return (x * mask).sum() / mask.sum().float().clamp(min=1.0)

    metrics = {}
    if beta != 0.0:
        metrics["kl"] = global_masked_mean(per_token_kl)
    if loss_type in ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]:
        is_low_clipped = (coef_1 < 1 - epsilon_low) & (advantages < 0)
        is_high_clipped = (coef_1 > 1 + epsilon_high) & (advantages > 0)
        is_region_clipped = is_low_clipped | is_high_clipped
        metrics["clip_ratio/low_mean"] = global_masked_mean(is_low_clipped.float())
        metrics["clip_ratio/high_mean"] = global_masked_mean(is_high_clipped.float())
        metrics["clip_ratio/region_mean"] = global_masked_mean(is_region_clipped.float())

        def masked_seq_mean(x):  # lines 3224-3227, 3250-3253
            if x.shape[1] == 1:
                return x.squeeze(1)
            return (x * mask).sum(-1) / mask.sum(-1)

        def nanmin(t):  # trl/trainer/utils.py, lines 960-972 (nanmax alike)
            return t.new_tensor(float("nan")) if torch.isnan(t).all() else t[~torch.isnan(t)].min()

        def nanmax(t):
            return t.new_tensor(float("nan")) if torch.isnan(t).all() else t[~torch.isnan(t)].max()

        metrics["clip_ratio/low_min"] = nanmin(masked_seq_mean(is_low_clipped.float()))
        metrics["clip_ratio/high_max"] = nanmax(masked_seq_mean(is_high_clipped.float()))
    elif loss_type == "cispo":
        is_cispo_clipped = (coef_1 > epsilon_high) & (advantages > 0)
        metrics["cispo_clip_ratio"] = global_masked_mean(is_cispo_clipped.float())
    elif loss_type == "vespo":
        metrics["vespo/phi_seq_mean"] = global_masked_mean(phi_seq)
    return loss, metrics


TRL_CASES = [  # (loss_type, extra options)
    ("grpo", {}), ("bnpo", {}), ("dr_grpo", dict(max_completion_length=40)),
    ("dapo", dict(num_items_in_batch=torch.tensor(120.0))),
    ("dapo", dict(delta=1.5, num_items_in_batch=torch.tensor(90.0), num_processes=2)),
    ("cispo", dict(epsilon_high=1.3, num_items_in_batch=torch.tensor(100.0))),
    ("sapo", dict(sapo_temperature_pos=1.0, sapo_temperature_neg=1.05)),
    ("grpo", dict(beta=0.04, use_bias_correction_kl=True, gradient_accumulation_steps=4)),
    ("bnpo", dict(beta=0.04, weighted=True)),
    ("luspo", dict(beta=0.04, gradient_accumulation_steps=2)),
    ("vespo", dict(num_items_in_batch=torch.tensor(110.0))),
    ("vespo", dict(beta=0.04, weighted=True, num_items_in_batch=torch.tensor(110.0))),
    ("dapo", dict(num_items_in_batch=torch.tensor(120.0), gradient_accumulation_steps=4,
                  steps_per_generation=2, masks=True)),
    ("sapo", dict(masks=True, weighted=True)),
]


@pytest.mark.parametrize("case", range(len(TRL_CASES)))
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("rows", [True, False])  # advantages [B] (TRL's GRPO) or [B, T]
def test_trl_grpo_loss(case, level, rows, backend):
    loss_type, extra = TRL_CASES[case]
    extra = {k: v.to(device_of(backend)) if isinstance(v, torch.Tensor) else v
             for k, v in extra.items()}
    lp, old, adv, w, mask = batch(seed=20 + case, device=device_of(backend))
    ref = (lp + 0.1).clamp(max=-0.01)
    weighted = extra.pop("weighted", False)
    if extra.pop("masks", False):  # TRL's off-policy mask [B, 1] and entropy mask [B, T]
        extra["off_policy_mask"] = (torch.arange(lp.shape[0], device=lp.device) % 3 != 1
                                    ).float()[:, None]
        extra["entropy_mask"] = (torch.rand(lp.shape, generator=torch.Generator().manual_seed(
            case)) < 0.7).float().to(lp.device)
    if rows:
        adv = adv[:, 0]
    eps_high = extra.pop("epsilon_high", 0.28)
    common = dict(loss_type=loss_type, importance_sampling_level=level, **extra)
    if extra.get("beta"):
        common["ref_per_token_logps"] = ref
    if weighted:
        common["importance_sampling_ratio"] = w
    xs0 = [t.clone().requires_grad_(True) for t in (lp, old, adv)]
    want, wm = trl_loss(*xs0, mask.float(), epsilon_low=0.2, epsilon_high=eps_high, **common)
    xs1 = [t.clone().requires_grad_(True) for t in (lp, old, adv)]
    got, gm = our_trl.grpo_loss(*xs1, mask, epsilon=0.2, epsilon_high=eps_high,
                                sequence_extremes=True, **common)
    close(got, want, 2e-5)
    for a, b in zip(grads(got, xs1), grads(want, xs0)):
        close(a, b, 2e-5)
    assert gm.keys() == wm.keys()
    for k in wm:
        close(gm[k], wm[k].detach(), 1e-6)


# ---- the backends against each other -------------------------------------------------------------

CASES = [(t, "token") for t in LOSS_TYPES] + [(t, "sequence") for t in ("vanilla", "sapo",
                                                                          "cispo")]
OPTIONS = dict(dro_beta=0.1, cov_ratio=0.2, cov_bounds=(-1.0, 1.0), kl_cov_coef=0.5,
               clip_high=0.28, truncation=1.2)


def aggs_for(loss_type):
    if loss_type == "geo_mean":
        return ["seq-mean", "none"]
    return ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm",
            "seq-mean-token-mean", "none"]


def call(backend, xs, mask, loss_type, level, agg, dtype, **extra):
    """policy_loss on `backend` (Triton's tensors on DEVICE): (loss, grads, metrics) on the
    CPU, the gradients those of the CPU leaves `xs`."""
    if device_of(backend) != "cpu":
        leaves = [x.detach().to(DEVICE).requires_grad_(x.requires_grad) for x in xs]
        extra = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v
                 for k, v in extra.items()}
        loss, gs, metrics = _call(backend, leaves, mask.to(DEVICE), loss_type, level, agg,
                                  dtype, **extra)
        return (loss.cpu(), [None if g is None else g.cpu() for g in gs],
                {k: v.cpu() for k, v in metrics.items()})
    return _call(backend, xs, mask, loss_type, level, agg, dtype, **extra)


def _call(backend, xs, mask, loss_type, level, agg, dtype, **extra):
    lp, old, adv, w = xs
    kw = dict(OPTIONS, loss_type=loss_type, ratio_level=level, aggregation=agg, **extra)
    if loss_type == "vanilla":
        kw["dual_clip"] = 3.0
    g = torch.Generator().manual_seed(1)
    loss, metrics = rl_triton.policy_loss(lp, old, adv, mask, weights=w, generator=g,
                                          backend=backend, out_dtype=dtype, **kw)
    # a fixed cotangent per position for "none"
    probe = torch.linspace(-1, 1, loss.numel(), dtype=loss.dtype,
                           device=loss.device).view(loss.shape)
    return loss.detach(), grads((loss * probe).sum(), xs), metrics


def compare(a, b, tol):
    la, ga, ma = a
    lb, gb, mb = b
    close(la, lb, tol)
    for x, y in zip(ga, gb):
        close(x, y, tol)
    assert ma.keys() == mb.keys() == set(METRICS)
    for k in METRICS:
        close(ma[k], mb[k], tol)
        assert not ma[k].requires_grad


@pytest.mark.parametrize("case", CASES, ids=[f"{t}-{lv}" for t, lv in CASES])
@pytest.mark.parametrize("kind", ["multi-turn", "padded"])
def test_backends(case, kind):
    """loop vs torch in float64; Triton (the interpreter on CPU) in float32 vs torch float64."""
    loss_type, level = case
    inputs64 = [t.requires_grad_(True) for t in batch(kind=kind, dtype=torch.float64)[:4]]
    mask = batch(kind=kind)[4]
    for agg in aggs_for(loss_type):
        ref = call("torch", inputs64, mask, loss_type, level, agg, torch.float64)
        compare(call("loop", inputs64, mask, loss_type, level, agg, torch.float64), ref, 1e-10)
        inputs32 = [t.detach().float().requires_grad_(True) for t in inputs64]
        compare(call("triton", inputs32, mask, loss_type, level, agg, torch.float32), ref, 2e-5)


def pack(xs, mask):
    """[B, T] rows to packed [L] segments: each row up to its last masked-in token (row 0, fully
    masked: an empty segment), with its mask."""
    lengths = [int(r.nonzero().max()) + 1 if r.any() else 0 for r in mask]
    keep = torch.arange(mask.shape[1])[None, :] < torch.tensor(lengths)[:, None]
    cu = torch.tensor([0] + lengths).cumsum(0)
    return [x.detach()[keep].requires_grad_(True) for x in xs], mask[keep], cu


@pytest.mark.parametrize("case", CASES, ids=[f"{t}-{lv}" for t, lv in CASES])
@pytest.mark.parametrize("backend", ["torch", "loop", "triton"])
def test_packed_rows(case, backend):
    """Packed segments (cu_seqlens, an empty one included) give the rows' results."""
    loss_type, level = case
    *xs, mask = batch(B=4, T=23, seed=9)
    xs = [t.requires_grad_(True) for t in xs]
    pxs, pmask, cu = pack(xs, mask)
    for agg in aggs_for(loss_type):
        extra = dict(loss_scale_factor=23) if agg == "seq-mean-token-sum-norm" else {}
        lr, gr, mr = call(backend, xs, mask, loss_type, level, agg, torch.float32, **extra)
        lp_, gp, mp = call(backend, pxs, pmask, loss_type, level, agg, torch.float32,
                           cu_seqlens=cu, **extra)
        if agg == "none" and loss_type != "geo_mean":
            keep = torch.arange(23)[None, :] < (cu[1:] - cu[:-1])[:, None]
            lr = lr[keep]
            # the probe differs between layouts: compare values only
        else:
            for x, y, p in zip(gr, gp, xs):
                keep = torch.arange(23)[None, :] < (cu[1:] - cu[:-1])[:, None]
                if x is None:  # no gradient (gspo's old_log_probs)
                    assert y is None or y.abs().max() == 0
                    continue
                close(y, x[keep], 2e-5)
                assert x[~keep].abs().max() == 0
        close(lp_, lr, 2e-5)
        for k in METRICS:
            close(mp[k], mr[k], 2e-5)


@pytest.mark.parametrize("backend", ["torch", "loop", "triton"])
def test_smallest_and_empty(backend):
    """T = 1, N = 1; no position counts: loss 0, zero gradients, metrics 0."""
    dev = device_of(backend)
    for shape in [(1, 1), (3, 5)]:
        xs = [torch.full(shape, -0.5, device=dev).requires_grad_(True) for _ in range(3)]
        for t in LOSS_TYPES:
            agg = "seq-mean" if t == "geo_mean" else "seq-mean-token-mean"
            for mask in (torch.ones(shape, dtype=torch.bool, device=dev),
                         torch.zeros(shape, dtype=torch.bool, device=dev)):
                loss, metrics = rl_triton.policy_loss(*xs, mask, loss_type=t, aggregation=agg,
                                                      dro_beta=0.1, backend=backend)
                assert torch.isfinite(loss)
                if not mask.any():
                    assert loss.item() == 0
                    assert all(v.item() == 0 for v in metrics.values())
                    for g in grads(loss, xs):
                        assert g is None or g.abs().max() == 0


@pytest.mark.parametrize("backend", ["torch", "loop", "triton"])
def test_masked_nonfinite(backend):
    """NaN / inf at masked positions reach neither the loss nor any gradient."""
    *xs, mask = batch(B=3, T=11, seed=2)
    bad = [x.detach().clone() for x in xs]
    for x in bad:
        x[~mask] = float("nan")
    bad[0][0, 0] = -float("inf")
    for t, level in CASES:
        for agg in aggs_for(t)[:1]:
            a = call(backend, [x.detach().clone().requires_grad_(True) for x in xs], mask, t,
                     level, agg, torch.float32)
            b = call(backend, [x.clone().requires_grad_(True) for x in bad], mask, t, level,
                     agg, torch.float32)
            compare(b, a, 1e-6)


def test_backends_agree_on_log_probabilities_above_zero():
    """A log-probability above 0 (no probability: dppo_kl's binary KL takes the log of a
    negative number) or past exp's range in float64, at a position that counts: the loop backend
    gives the torch backend's values, not Python's math errors."""
    *xs, mask = batch(B=3, T=11, seed=4, dtype=torch.float64)
    xs = [x.detach().clone() for x in xs]
    xs[1][mask] = xs[1][mask].abs() * 0.5  # old log-probabilities above 0
    xs[0][1, mask[1].nonzero()[0, 0]] = 800.0  # exp overflows a double
    for t, level in CASES:
        for agg in aggs_for(t)[:1]:
            compare(call("loop", [x.clone().requires_grad_(True) for x in xs], mask, t, level,
                         agg, torch.float64),
                    call("torch", [x.clone().requires_grad_(True) for x in xs], mask, t, level,
                         agg, torch.float64), 1e-10)


# gspo, cispo and the dppo losses stop gradients by design (their gradient is not the value's
# derivative): test_backends and the framework tests check them
@pytest.mark.parametrize("case", [("vanilla", "token"), ("vanilla", "sequence"),
                                  ("sapo", "sequence"), ("kl_cov", "token"), ("dro", "token"),
                                  ("geo_mean", "token")])
@pytest.mark.parametrize("backend", ["torch", "loop"])
def test_gradcheck(case, backend):
    loss_type, level = case
    *xs, mask = batch(B=3, T=5, dtype=torch.float64, seed=4)
    xs = [x.requires_grad_(True) for x in xs]
    agg = "seq-mean" if loss_type == "geo_mean" else "seq-mean-token-mean"

    def fn(*xs):
        return rl_triton.policy_loss(*xs[:3], mask, weights=xs[3], loss_type=loss_type,
                                  ratio_level=level, aggregation=agg, backend=backend,
                                  out_dtype=torch.float64,
                                  **{k: v for k, v in OPTIONS.items() if k != "truncation"})[0]
    assert torch.autograd.gradcheck(fn, xs)


def test_global_factors():
    """token-mean with batch_num_tokens, the seq means with global_batch_size, dp_size, the -norm
    scale: the local aggregation times the factor verl's agg_loss applies."""
    for backend in ("torch", "triton"):
        *xs, mask = batch(seed=6, device=device_of(backend))
        B, T = mask.shape
        n, s = int(mask.sum()), int(mask.any(-1).sum())

        def loss(agg, **kw):
            return rl_triton.policy_loss(*xs[:3], mask, aggregation=agg, backend=backend,
                                         **kw)[0]
        close(loss("token-mean", batch_num_tokens=200, dp_size=2),
              loss("token-mean") * n / 200 * 2, 1e-6)
        close(loss("token-sum", dp_size=3), loss("token-mean") * n * 3, 1e-6)
        close(loss("seq-mean-token-sum", global_batch_size=20, dp_size=2),
              loss("seq-mean-token-sum") * s / 20 * 2, 1e-6)
        close(loss("seq-mean-token-sum-norm"), loss("seq-mean-token-sum") / T, 1e-6)
        close(loss("seq-mean-token-sum-norm", loss_scale_factor=4.0),
              loss("seq-mean-token-sum") / 4, 1e-6)
        twenty = torch.tensor(20.0, device=mask.device)
        close(loss("seq-mean-token-mean", global_batch_size=twenty),
              loss("seq-mean-token-mean") * s / 20, 1e-6)


def same(got, want):
    """Two (loss, metrics) results equal bit for bit."""
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(got[1][k], want[1][k]) for k in METRICS)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_hot_path_still_checks(backend):
    """A repeated call finds its plan (one per signature) and forms what it reads of values
    (the covariance pick, the sequence ratio, the global sequence count) again; bad input on a
    known signature still raises; a call holding a tensor count or a generator is not cached
    (docs/dev/op-framework.md)."""
    from rl_triton._core import plans
    *xs, mask = batch(seed=21, device=device_of(backend))
    kw = dict(backend=backend)
    plans.clear_plans()
    first = rl_triton.policy_loss(*xs[:3], mask, dual_clip=3.0, **kw)
    again = rl_triton.policy_loss(*xs[:3], mask, dual_clip=3.0, **kw)
    assert len(plans._PLANS) == 1
    same(again, first)
    # the same signature, other values: the picks and sequence ratios follow them
    other = [x.flip(0) for x in xs]
    for opts in (dict(loss_type="kl_cov", cov_ratio=0.1), dict(loss_type="gspo"),
                 dict(ratio_level="sequence", aggregation="seq-mean-token-mean"),
                 dict(aggregation="seq-mean-token-mean", global_batch_size=20)):
        for ins, m in ((xs, mask), (other, mask.flip(0)), (xs, mask)):
            got = rl_triton.policy_loss(*ins[:3], m, **opts, **kw)
            plans.clear_plans()
            want = rl_triton.policy_loss(*ins[:3], m, **opts, **kw)  # checked afresh
            same(got, want)
    n = len(plans._PLANS)
    with pytest.raises(ValueError, match="clip_low"):
        rl_triton.policy_loss(*xs[:3], mask, clip_low=-1.0, **kw)
    with pytest.raises(ValueError, match="dual_clip and delta apply"):
        rl_triton.policy_loss(*xs[:3], mask, dual_clip=3.0, loss_type="cispo", **kw)
    with pytest.raises(ValueError, match="mask has shape"):
        rl_triton.policy_loss(*xs[:3], mask[:, 1:], **kw)
    twenty = torch.tensor(20.0, device=mask.device)
    g = torch.Generator(device=mask.device).manual_seed(0)
    plans.clear_plans()
    for _ in range(2):
        rl_triton.policy_loss(*xs[:3], mask, aggregation="seq-mean-token-mean",
                              global_batch_size=twenty, **kw)
        rl_triton.policy_loss(*xs[:3], mask, loss_type="clip_cov", generator=g, **kw)
    assert len(plans._PLANS) == 0 and n > 0


# ---- bad input -----------------------------------------------------------------------------------

def test_errors():
    lp, old, adv, w, mask = batch(B=3, T=7)
    pl = rl_triton.policy_loss
    with pytest.raises(ValueError, match="loss_type"):
        pl(lp, old, adv, mask, loss_type="ppo")
    with pytest.raises(ValueError, match="aggregation"):
        pl(lp, old, adv, mask, aggregation="mean")
    with pytest.raises(ValueError, match="aggregation='seq-mean'"):
        pl(lp, old, adv, mask, aggregation="seq-mean")
    with pytest.raises(ValueError, match="geo_mean"):
        pl(lp, old, adv, mask, loss_type="geo_mean")
    with pytest.raises(ValueError, match="ratio_level"):
        pl(lp, old, adv, mask, loss_type="gpg", ratio_level="sequence")
    with pytest.raises(ValueError, match="dual_clip"):
        pl(lp, old, adv, mask, loss_type="gspo", dual_clip=3.0)
    with pytest.raises(ValueError, match="dual_clip"):
        pl(lp, old, adv, mask, dual_clip=0.5)
    with pytest.raises(ValueError, match="dro_beta"):
        pl(lp, old, adv, mask, loss_type="dro")
    with pytest.raises(ValueError, match="weights"):
        pl(lp, old, adv, mask, weights=w[:, :3])
    with pytest.raises(ValueError, match="mask"):
        pl(lp, old, adv, mask[:2])
    with pytest.raises(ValueError, match="old_log_probs"):
        pl(lp, old[:, 1:], adv, mask)
    with pytest.raises(TypeError, match="advantages"):
        pl(lp, old, adv.numpy(), mask)
    with pytest.raises(ValueError, match="batch_num_tokens"):
        pl(lp, old, adv, mask, dp_size=2)
    with pytest.raises(ValueError, match="dp_size"):
        pl(lp, old, adv, mask, dp_size=0)
    with pytest.raises(ValueError, match="cov_bounds"):
        pl(lp, old, adv, mask, loss_type="clip_cov", cov_bounds=(1.0,))
    with pytest.raises(ValueError, match="clip_low"):
        pl(lp, old, adv, mask, clip_low=-0.1)
    flat = lp.reshape(-1)
    with pytest.raises(ValueError, match="log_probs"):
        pl(flat, flat, flat, loss_type="gspo")
    cu = torch.tensor([0, 5, 20])  # ends before L = 21
    with pytest.raises(ValueError, match="cu_seqlens"):
        pl(flat, flat, flat, cu_seqlens=cu)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        pl(flat, flat, flat, cu_seqlens=torch.tensor([0, 5, 21]),
           aggregation="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="backend"):
        pl(lp, old, adv, mask, backend="cuda")


def test_inputs_untouched_and_dtypes():
    for backend in ("torch", "triton"):
        *xs, mask = batch(B=3, T=7, device=device_of(backend))
        copies = [x.clone() for x in xs]
        loss, metrics = rl_triton.policy_loss(*xs[:3], mask, weights=xs[3], backend=backend,
                                              out_dtype=torch.float64)
        assert loss.dtype == torch.float64
        assert all(v.dtype == torch.float64 for v in metrics.values())
        assert all(torch.equal(a, b) for a, b in zip(xs, copies))


def test_triton_bf16_views_and_mask_dtypes():
    """bf16 inputs, transposed (strided) views, integer and float masks (binary: set where
    nonzero) on the Triton backend, against torch on the same values in float32."""
    *xs, mask = batch(B=5, T=37, seed=13)
    for case in range(3):
        if case == 0:  # bf16
            ins = [x.to(torch.bfloat16) for x in xs]
            m = mask
        elif case == 1:  # transposed views: [T, B] storage read as [B, T]
            ins = [x.t().contiguous().t() for x in xs]
            m = mask.int()
        else:
            ins = xs
            m = mask.float() * 0.5
        ref_in = [x.float().detach().requires_grad_(True) for x in ins]
        for t, level in (("vanilla", "token"), ("sapo", "sequence"), ("dppo_kl", "token")):
            agg = "seq-mean-token-mean"
            got = call("triton", [x.detach().requires_grad_(True) for x in ins], m, t, level,
                       agg, torch.float32)
            want = call("torch", ref_in, m != 0, t, level, agg, torch.float32)
            compare(got, want, 2e-2 if case == 0 else 2e-5)


@pytest.mark.parametrize("level,packed", [("token", False), ("sequence", True)])
def test_fullgraph_compile(level, packed):
    """The Triton backend traces under torch.compile(fullgraph=True) (aot_eager on the CPU)."""
    *xs, mask = batch(B=4, T=23, seed=14, device=DEVICE)
    cu = None
    if packed:
        xs, mask, cu = pack([x.cpu() for x in xs], mask.cpu())
        xs, mask, cu = [x.detach().to(DEVICE) for x in xs], mask.to(DEVICE), cu.to(DEVICE)

    def step(lp, old, adv, w):
        loss, metrics = rl_triton.policy_loss(lp, old, adv, mask, weights=w, ratio_level=level,
                                              aggregation="seq-mean-token-mean",
                                              cu_seqlens=cu, clip_high=0.28, backend="triton")
        return loss * 2.0, metrics["clip_fraction"]

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True,
                             backend="inductor" if DEVICE == "cuda" else "aot_eager")
    a = [x.detach().requires_grad_(True) for x in xs]
    b = [x.detach().requires_grad_(True) for x in xs]
    got, want = compiled(*a), step(*b)
    close(got[0], want[0], 2e-6)
    close(got[1], want[1], 0)
    for x, y in zip(torch.autograd.grad(got[0], a), torch.autograd.grad(want[0], b)):
        close(x, y, 2e-6)


@pytest.mark.parametrize("backend", ["torch", "loop", "triton"])
def test_ties_and_nan_advantages_as_the_frameworks(backend, device):
    """The clipped surrogate's tie (an advantage of exactly 0) and a NaN advantage: gradients
    as torch.maximum's and torch.minimum's, the frameworks' (test_ppo_policy_loss's case)."""
    from test_ppo_policy_loss import tie_case
    from loss_cases import leaves
    for delta in (None, 2.0):
        a, b = leaves(*tie_case(device)), leaves(*tie_case(device))
        got = rl_triton.policy_loss(*a, clip_high=0.28, dual_clip=3.0, delta=delta,
                                    aggregation="none", backend=backend)[0]
        lp, old, adv = b
        r = torch.exp(lp - old)
        unclipped = -adv * (r if delta is None else torch.clamp(r, max=delta))  # (TRL's delta)
        want = torch.maximum(unclipped, -adv * torch.clamp(r, 0.8, 1.28))
        want = torch.where(adv < 0, torch.minimum(want, -adv * 3.0), want)
        for x, y in zip(torch.autograd.grad(got.sum(), a), torch.autograd.grad(want.sum(), b)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("log_ratio_clamp", [None, 20.0])
def test_nan_patterns_agree_across_backends(log_ratio_clamp):
    """A NaN log-probability at a position that counts: every backend gives the same loss and
    gradients' NaN pattern, with or without the log-ratio's clamp (the loop's clamp to +-inf
    passed no gradient to a NaN)."""
    lp = torch.tensor([[-1.0, -0.5, float("nan"), -0.3], [-1.0, -0.5, -0.2, -0.3]])
    old = torch.tensor([[-1.1, -0.6, -0.8, -0.2], [-1.1, -0.6, -0.8, -0.2]])
    adv = torch.tensor([[0.5, -0.3, 0.7, 1.0], [0.5, -0.3, 0.7, 1.0]])
    for t in LOSS_TYPES:
        kw = {"dro": dict(dro_beta=0.1), "geo_mean": dict(aggregation="seq-mean")}.get(t, {})
        seen = []
        for backend in ("loop", "torch", "triton"):
            dev = device_of(backend)
            xs = [x.to(dev).requires_grad_() for x in (lp, old, adv)]
            loss = rl_triton.policy_loss(*xs, loss_type=t, log_ratio_clamp=log_ratio_clamp,
                                         backend=backend, **kw)[0]
            seen.append([loss.isnan().item()] + [g.isnan().cpu().tolist()
                                                  for g in torch.autograd.grad(loss, xs)])
        assert seen[0] == seen[1] == seen[2], t


@pytest.mark.parametrize("backend", ["torch", "loop", "triton"])
def test_stopped_gradients_are_zeros_not_detached(backend):
    """The losses whose formula stops a gradient (gspo's, gpg's, cispo's and the dppo losses'
    old log-probabilities) still give every input that requires grad one, 0 there, on every
    backend: never a silent detach."""
    g = torch.Generator().manual_seed(0)
    dev = device_of(backend)
    lp = 0.3 * torch.randn(3, 7, generator=g)
    old, adv = lp + 0.2 * torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    lp, old, adv = lp.to(dev), old.to(dev), adv.to(dev)
    for t in LOSS_TYPES:
        xs = [x.clone().requires_grad_() for x in (lp, old, adv)]
        kw = {"dro": dict(dro_beta=0.1), "geo_mean": dict(aggregation="seq-mean")}.get(t, {})
        rl_triton.policy_loss(*xs, loss_type=t, backend=backend, **kw)[0].backward()
        assert all(x.grad is not None for x in xs), t
        if t in ("gspo", "gpg", "cispo", "dppo_tv", "dppo_kl"):
            assert (xs[1].grad == 0).all(), t


@pytest.mark.parametrize("backend", ["torch", "loop", "triton"])
def test_empty_inputs_keep_their_gradients(backend):
    """No position at all, or none that counts: loss 0, and every input that requires grad gets
    a zero gradient (the loop backend's loss was no function of them)."""
    dev = device_of(backend)
    for shape, mask in [((0,), None), ((3, 0), None), ((0, 5), None),
                        ((2, 4), torch.zeros(2, 4, device=dev))]:
        xs = [torch.zeros(shape, requires_grad=True, device=dev) for _ in range(3)]
        kinds = [dict(loss_type="vanilla"), dict(loss_type="sapo")]
        if len(shape) == 2:
            kinds += [dict(loss_type="gspo"), dict(ratio_level="sequence"),
                      dict(loss_type="geo_mean", aggregation="seq-mean")]
        for kw in kinds:
            loss = rl_triton.policy_loss(*xs, mask, backend=backend, **kw)[0]
            assert loss.item() == 0 and loss.requires_grad, kw
            assert all(g.shape == shape and not g.any()
                       for g in torch.autograd.grad(loss, xs)), kw
