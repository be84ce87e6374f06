"""verl integration: its advantage estimators, one rl_triton call each, same signatures and outputs.

verl (checked against 0.9.1, `verl/trainer/ppo/core_algos.py`) computes token-level GAE and
REINFORCE++ returns with a Python loop over the response's tokens, a dozen kernel launches per
token; these functions give the same results from the scan kernels::

    from rl_triton.integrations.verl import use_rl_triton
    use_rl_triton()          # verl's trainer now calls the functions below; revert_rl_triton() undoes it

or call them directly, in place of `core_algos.compute_gae_advantage_return` and the others.

verl's semantics are kept exactly, where they go beyond semantics §7:
- GAE skips masked tokens (the semantics' `mask`), and its outputs at masked tokens are verl's: the
  advantage carries the next response token's accumulator (0 in the right padding), returns are
  that plus the token's value, and the whitened advantages are shifted and scaled everywhere (so
  padding is not 0);
- whitening is verl's `masked_whiten` (unbiased variance, eps 1e-8), which raises `ValueError` when
  fewer than two tokens are masked in;
- GRPO divides a lone response's score by 1 + epsilon (verl's group of one has std 1).
Masks are read as verl uses them, 0 or 1. Importing this module does not import verl;
`use_rl_triton()` does.
"""
from __future__ import annotations

import numpy as np
import torch

import rl_triton

__all__ = ["compute_gae_advantage_return", "compute_grpo_outcome_advantage",
           "compute_rloo_outcome_advantage", "compute_reinforce_plus_plus_outcome_advantage",
           "compute_reinforce_plus_plus_baseline_outcome_advantage", "use_rl_triton",
           "revert_rl_triton"]

Tensor = torch.Tensor
# the rl_triton backend these functions call ("auto": the Triton kernels on CUDA, torch on CPU)
backend = "auto"


def _scalar(name, x):
    """verl passes gamma and lam as floats or 0-d tensors."""
    if isinstance(x, Tensor) and x.numel() != 1:
        raise ValueError(f"{name} must be a number or a one-element tensor, got shape "
                         f"{tuple(x.shape)}")
    return float(x)


def _whiten(x: Tensor, m: Tensor) -> Tensor:
    """verl's `masked_whiten`: statistics over the masked-in tokens (unbiased variance), the
    shift and scale applied to every token."""
    mf = m.to(x.dtype).reshape(-1)
    n = mf.sum()
    mean = torch.dot(x.reshape(-1), mf) / n
    d = x - mean
    var = torch.dot((d * d).reshape(-1), mf) / (n - 1)
    out = d * torch.rsqrt(var + 1e-8)
    # verl's masked_var raises for 0 and 1 tokens (a division by zero); checked last, so that
    # the host waits once, behind the queued kernels
    if n < 2:
        raise ValueError(f"response_mask selects {int(n)} token(s); whitening needs at least 2")
    return out


def _no_flags(x: Tensor) -> Tensor:
    """No termination inside a response: its end is the episode's (last_value 0)."""
    return torch.zeros((), dtype=torch.bool, device=x.device).expand(x.shape)


@torch.no_grad()
def compute_gae_advantage_return(token_level_rewards: Tensor, values: Tensor,
                                 response_mask: Tensor, gamma, lam):
    """verl's `compute_gae_advantage_return`: `(advantages, returns)`, `[bs, response_length]`."""
    r, v = token_level_rewards, values
    m = response_mask != 0
    adv, _ = rl_triton.gae(r, v, _no_flags(r), last_value=torch.zeros_like(r[:, 0]), mask=m,
                           gamma=_scalar("gamma", gamma), lam=_scalar("lam", lam), time_dim=1,
                           backend=backend)
    # a masked token holds the next response token's advantage: A[t] = A[t + 1] there
    adv = rl_triton.linear_scan(adv, (~m).float(), reverse=True, time_dim=1, backend=backend)
    dtype = torch.result_type(r, v)
    returns = adv.to(dtype) + v
    return _whiten(adv, m).to(dtype), returns


def _groups(index, device):
    """verl's `index` (an array of prompt ids, often uuid strings) as integer ids, and whether
    each response is its group's only one."""
    if isinstance(index, Tensor):
        _, ids, counts = torch.unique(index, return_inverse=True, return_counts=True)
        return ids.to(device), (counts[ids] == 1).to(device)
    _, ids, counts = np.unique(np.asarray(index), return_inverse=True, return_counts=True)
    ids = torch.as_tensor(ids.reshape(-1), device=device)
    return ids, torch.as_tensor(counts, device=device)[ids] == 1


def _per_token(a: Tensor, token_level_rewards: Tensor, response_mask: Tensor) -> Tensor:
    """verl's `scores.unsqueeze(-1) * response_mask`, in its dtype."""
    dtype = torch.result_type(token_level_rewards, response_mask)
    return a.to(dtype).unsqueeze(-1) * response_mask


@torch.no_grad()
def compute_grpo_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor, index,
                                   epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True,
                                   config=None):
    """verl's `compute_grpo_outcome_advantage` (GRPO; Dr. GRPO with
    `norm_adv_by_std_in_grpo=False`): `(advantages, advantages)`."""
    scores = token_level_rewards.sum(dim=-1)
    ids, lone = _groups(index, scores.device)
    scale = "std" if norm_adv_by_std_in_grpo else "none"
    a = rl_triton.group_advantages(scores, ids, scale=scale, eps=epsilon, backend=backend)
    if norm_adv_by_std_in_grpo:
        a = torch.where(lone, a / (1.0 + epsilon), a)
    out = _per_token(a, token_level_rewards, response_mask)
    return out, out


@torch.no_grad()
def compute_rloo_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor, index,
                                   epsilon: float = 1e-6, config=None, **kwargs):
    """verl's `compute_rloo_outcome_advantage` (leave-one-out baseline): `(advantages,
    advantages)`; `epsilon` is unused, as in verl."""
    scores = token_level_rewards.sum(dim=-1)
    ids, _ = _groups(index, scores.device)
    a = rl_triton.group_advantages(scores, ids, baseline="leave_one_out", scale="none",
                                   backend=backend)
    out = _per_token(a, token_level_rewards, response_mask)
    return out, out


@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards: Tensor,
                                                           response_mask: Tensor, index,
                                                           epsilon: float = 1e-6, config=None,
                                                           **kwargs):
    """verl's `compute_reinforce_plus_plus_baseline_outcome_advantage`: the group mean as
    baseline, then whitened over the batch's tokens: `(advantages, advantages)`."""
    scores = token_level_rewards.sum(dim=-1)
    ids, _ = _groups(index, scores.device)
    a = rl_triton.group_advantages(scores, ids, scale="none", backend=backend)
    tok = _per_token(a, token_level_rewards, response_mask)
    m = response_mask != 0
    out = (_whiten(tok.float(), m) * m).to(tok.dtype)
    return out, out


@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards: Tensor,
                                                  response_mask: Tensor, config=None, **kwargs):
    """verl's `compute_reinforce_plus_plus_outcome_advantage`: discounted returns over the
    response tokens (masked tokens skipped), whitened: `(advantages, returns)`. `config` is verl's
    `AlgoConfig` (or anything with `.gamma`)."""
    if config is None:
        raise ValueError("config is required: verl's AlgoConfig, for config.gamma")
    r = token_level_rewards
    m = response_mask != 0
    returns = rl_triton.discounted_returns(r, _no_flags(r), mask=m,
                                           gamma=_scalar("config.gamma", config.gamma),
                                           time_dim=1, backend=backend).to(r.dtype)
    return (_whiten(returns.float(), m) * m).to(r.dtype), returns


# verl's names -> ours; the registry keys are those of verl's `register_adv_est`
_PATCHED = {
    "compute_gae_advantage_return": ("gae", compute_gae_advantage_return),
    "compute_grpo_outcome_advantage": ("grpo", compute_grpo_outcome_advantage),
    "compute_rloo_outcome_advantage": ("rloo", compute_rloo_outcome_advantage),
    "compute_reinforce_plus_plus_outcome_advantage":
        ("reinforce_plus_plus", compute_reinforce_plus_plus_outcome_advantage),
    "compute_reinforce_plus_plus_baseline_outcome_advantage":
        ("reinforce_plus_plus_baseline", compute_reinforce_plus_plus_baseline_outcome_advantage),
}
_ORIGINALS: dict = {}


def _core_algos(module):
    if module is None:
        import verl.trainer.ppo.core_algos as module
    return module


def use_rl_triton(module=None) -> None:
    """Point verl's `core_algos` functions and its advantage-estimator registry at the functions
    above (the trainer looks GAE and GRPO up on the module, the others in the registry).
    `module`: the `core_algos` module to patch (default: import it). Idempotent."""
    module = _core_algos(module)
    registry = module.ADV_ESTIMATOR_REGISTRY
    for name, (key, ours) in _PATCHED.items():
        if (module, name) not in _ORIGINALS:
            _ORIGINALS[module, name] = (getattr(module, name), registry.get(key))
        setattr(module, name, ours)
        registry[key] = ours


def revert_rl_triton(module=None) -> None:
    """Undo `use_rl_triton`: verl's own functions back on the module and in the registry."""
    module = _core_algos(module)
    for name, (key, _) in _PATCHED.items():
        if (module, name) in _ORIGINALS:
            fn, registered = _ORIGINALS.pop((module, name))
            setattr(module, name, fn)
            if registered is not None:
                module.ADV_ESTIMATOR_REGISTRY[key] = registered


# ---- policy losses (semantics §10): verl's POLICY_LOSS_REGISTRY and agg_loss --------------------
#
# Each has verl's signature `(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
# config, rollout_is_weights) -> (pg_loss, pg_metrics)` and returns what verl 0.9.1 returns: the
# loss (verl's `agg_loss` with `config.global_batch_info`) and the metrics as Python floats, read
# in one sync. Differences: an empty selection gives 0 where verl's token-mean gives NaN;
# clip_cov's random draw is torch.randperm on the default generator, as verl's. Masks are read as
# verl's 0 / 1 (not as weights).

def _clips(config):
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    return dict(clip_low=float(low), clip_high=float(high))


def _batch_info(config) -> dict:
    """verl's `config.global_batch_info` (dp_size, batch_num_tokens, global_batch_size,
    loss_scale_factor) as policy_loss's arguments."""
    info = dict(getattr(config, "global_batch_info", None) or {})
    out = {k: info[k] for k in ("dp_size", "batch_num_tokens", "global_batch_size",
                                "loss_scale_factor") if info.get(k) is not None}
    if "dp_size" in out:  # verl's trainer may hand it over as a tensor or a NumPy integer
        out["dp_size"] = int(out["dp_size"])
    return out


def _option(config, name, default):
    value = getattr(config.policy_loss, name, None)
    return default if value is None else value


def _verl_loss(loss_type, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
               config, weights, keys, **options):
    """policy_loss with verl's inputs; `keys`: verl's metric names -> ours."""
    if config is None:
        raise ValueError("config is required: verl's ActorConfig")
    dtype = log_prob.dtype if log_prob.dtype in (torch.float32, torch.float64) else torch.float32
    loss, metrics = rl_triton.policy_loss(
        log_prob, old_log_prob, advantages, response_mask, loss_type=loss_type,
        aggregation=loss_agg_mode, weights=weights, backend=backend, out_dtype=dtype,
        **options)
    if not keys:
        return loss, {}
    values = torch.stack([metrics[k] for k in keys.values()]).tolist()  # one sync
    return loss, dict(zip(keys, values))


_PPO_KEYS = {"actor/pg_clipfrac": "clip_fraction", "actor/ppo_kl": "kl",
             "actor/pg_clipfrac_lower": "clip_fraction_lower"}


def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask,
                                loss_agg_mode="token-mean", config=None, rollout_is_weights=None):
    """verl's `vanilla`: PPO's clipped surrogate with the dual clip `config.clip_ratio_c`."""
    c = float(getattr(config, "clip_ratio_c", 3.0))
    return _verl_loss("vanilla", old_log_prob, log_prob, advantages, response_mask,
                      loss_agg_mode, config, rollout_is_weights, _PPO_KEYS, dual_clip=c,
                      **_clips(config), **_batch_info(config))


def _dppo(kind):
    def loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
             config=None, rollout_is_weights=None):
        c = float(getattr(config, "clip_ratio_c", 20.0))
        return _verl_loss(kind, old_log_prob, log_prob, advantages, response_mask,
                          loss_agg_mode, config, rollout_is_weights, _PPO_KEYS, truncation=c,
                          **_clips(config), **_batch_info(config))
    loss.__name__ = f"compute_policy_loss_{kind}"
    loss.__doc__ = f"verl's `{kind}`: DPPO's binary trust region, truncated ratio."
    return loss


compute_policy_loss_dppo_tv = _dppo("dppo_tv")
compute_policy_loss_dppo_kl = _dppo("dppo_kl")


def compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask,
                             loss_agg_mode="seq-mean-token-mean", config=None,
                             rollout_is_weights=None):
    """verl's `gspo`: the sequence ratio (stopped gradient, times pi / sg(pi)), clamped at 10."""
    return _verl_loss("gspo", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                      config, rollout_is_weights, _PPO_KEYS, log_ratio_clamp=10.0,
                      **_clips(config), **_batch_info(config))


def compute_policy_loss_sapo(old_log_prob, log_prob, advantages, response_mask,
                             loss_agg_mode="seq-mean-token-mean", config=None,
                             rollout_is_weights=None):
    """verl's `sapo`: the soft gate; aggregated by seq-mean-token-mean whatever loss_agg_mode
    says, as verl."""
    return _verl_loss("sapo", old_log_prob, log_prob, advantages, response_mask,
                      "seq-mean-token-mean", config, rollout_is_weights, _PPO_KEYS,
                      tau_pos=float(config.tau_pos), tau_neg=float(config.tau_neg),
                      **_batch_info(config))


def compute_policy_loss_gpg(old_log_prob, log_prob, advantages, response_mask,
                            loss_agg_mode="token-mean", config=None, rollout_is_weights=None):
    """verl's `gpg`: -A log pi, no metrics."""
    return _verl_loss("gpg", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                      config, rollout_is_weights, {}, **_batch_info(config))


def compute_policy_loss_clip_cov(old_log_prob, log_prob, advantages, response_mask,
                                 loss_agg_mode="token-mean", config=None,
                                 rollout_is_weights=None):
    """verl's `clip_cov`: the clipped surrogate (no log-ratio clamp, no dual clip), zeroed at a
    random draw among the high-covariance tokens."""
    ratio = float(_option(config, "clip_cov_ratio", 0.0002))
    bounds = (float(_option(config, "clip_cov_lb", 1.0)), float(_option(config, "clip_cov_ub",
                                                                         5.0)))
    return _verl_loss("clip_cov", old_log_prob, log_prob, advantages, response_mask,
                      loss_agg_mode, config, rollout_is_weights,
                      {"actor/pg_clipfrac": "clip_fraction", "actor/ppo_kl": "kl"},
                      log_ratio_clamp=None, cov_ratio=ratio, cov_bounds=bounds,
                      **_clips(config), **_batch_info(config))


def compute_policy_loss_kl_cov(old_log_prob, log_prob, advantages, response_mask,
                               loss_agg_mode="token-mean", config=None, rollout_is_weights=None):
    """verl's `kl_cov`: -A r, plus ppo_kl_coef |log r| at the top-k covariance tokens."""
    return _verl_loss("kl_cov", old_log_prob, log_prob, advantages, response_mask,
                      loss_agg_mode, config, rollout_is_weights, {"actor/ppo_kl": "kl"},
                      log_ratio_clamp=None,
                      cov_ratio=float(_option(config, "kl_cov_ratio", 0.0002)),
                      kl_cov_coef=float(_option(config, "ppo_kl_coef", 1.0)),
                      **_batch_info(config))


def compute_policy_loss_geo_mean(old_log_prob, log_prob, advantages, response_mask,
                                 loss_agg_mode="token-mean", config=None,
                                 rollout_is_weights=None):
    """verl's `geo_mean` (GMPO): per sequence, the mean over all sequences (loss_agg_mode and the
    global batch info unused, as verl)."""
    keys = {"actor/pg_clipfrac": "clip_fraction", "actor/ppo_kl": "kl",
            "actor/pg_clipfrac_lower": "clip_fraction_lower"}
    return _verl_loss("geo_mean", old_log_prob, log_prob, advantages, response_mask,
                      "seq-mean", config, rollout_is_weights, keys, log_ratio_clamp=None,
                      **_clips(config))


def compute_policy_loss_dro(old_log_prob, log_prob, advantages, response_mask,
                            loss_agg_mode="token-mean", config=None, rollout_is_weights=None):
    """verl's `dro`: -(A log pi - beta / 2 (log r)^2)."""
    if config is None:
        raise ValueError("config is required: verl's ActorConfig")
    beta = config.policy_loss.dro_beta
    if beta is None or beta <= 0:
        raise ValueError("policy_loss.dro_beta must be a positive value when using DRO")
    return _verl_loss("dro", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                      config, rollout_is_weights, {"actor/ppo_kl": "kl"}, log_ratio_clamp=None,
                      dro_beta=float(beta), **_batch_info(config))


def compute_policy_loss_cispo(old_log_prob, log_prob, advantages, response_mask,
                              loss_agg_mode="token-mean", config=None, rollout_is_weights=None):
    """verl's `cispo`: -sg(clip(r)) A log pi."""
    return _verl_loss("cispo", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                      config, rollout_is_weights, _PPO_KEYS, **_clips(config),
                      **_batch_info(config))


def compute_policy_loss_bypass_mode(old_log_prob, log_prob, advantages, response_mask,
                                    loss_agg_mode="token-mean", config=None,
                                    rollout_is_weights=None):
    """verl's `bypass_mode`: old_log_prob is the rollout's; the rollout-correction weights and
    rejection mask (verl's own `compute_rollout_correction_and_rejection_mask`, without gradient)
    feed `gpg` with the weights ("reinforce", reporting ppo_kl) or `vanilla` without them
    ("ppo_clip"); its metrics merged in."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    if config is None:
        raise ValueError("config is required for bypass_mode loss")
    rc = config.policy_loss.get("rollout_correction", None) if hasattr(config, "policy_loss") \
        else None
    if rc is None:
        raise ValueError("rollout_correction config not found in policy_loss. When using "
                         "loss_mode='bypass_mode', ensure rollout_correction config is passed.")
    loss_type = rc.get("loss_type", "ppo_clip")
    with torch.no_grad():
        weights, mask, rollout_metrics = compute_rollout_correction_and_rejection_mask(
            old_log_prob=log_prob, rollout_log_prob=old_log_prob, response_mask=response_mask,
            rollout_is=rc.get("rollout_is", None),
            rollout_is_threshold=rc.get("rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=rc.get("rollout_is_batch_normalize", False),
            rollout_rs=rc.get("rollout_rs", None),
            rollout_rs_threshold=rc.get("rollout_rs_threshold", None))
    weights = weights.batch["rollout_is_weights"] if weights else None
    if loss_type == "reinforce":
        loss, metrics = _verl_loss("gpg", old_log_prob, log_prob, advantages, mask,
                                   loss_agg_mode, config, weights, {"actor/ppo_kl": "kl"},
                                   log_ratio_clamp=None, **_batch_info(config))
    elif loss_type == "ppo_clip":
        loss, metrics = compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, mask,
                                                    loss_agg_mode, config, None)
    else:
        raise ValueError(f"Invalid loss_type: {loss_type}. Must be 'reinforce' or 'ppo_clip'.")
    metrics.update(rollout_metrics)
    return loss, metrics


def agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None,
             global_batch_size=None, loss_scale_factor=None):
    """verl's `agg_loss`: per-token losses `[B, T]` to a scalar (policy_loss's aggregation, in
    torch: a reduction already); an empty selection gives 0 where verl's token-mean gives NaN."""
    from ..ops import _losses
    from ..ops.policy_loss import AGGREGATIONS, _count, _plan

    if loss_agg_mode not in AGGREGATIONS[:6]:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
    m = loss_mask != 0
    base, factor = _plan(loss_agg_mode, m, None, tuple(loss_mat.shape), int(dp_size),
                         _count("batch_num_tokens", batch_num_tokens),
                         _count("global_batch_size", global_batch_size),
                         _count("loss_scale_factor", loss_scale_factor))
    loss = _losses.aggregate(loss_mat, m, base, None)
    return loss if factor is None else loss * factor


# verl's registry names -> ours (the coordinator wires them into use_rl_triton)
POLICY_LOSSES = {
    "vanilla": compute_policy_loss_vanilla, "dppo_tv": compute_policy_loss_dppo_tv,
    "dppo_kl": compute_policy_loss_dppo_kl, "gspo": compute_policy_loss_gspo,
    "sapo": compute_policy_loss_sapo, "gpg": compute_policy_loss_gpg,
    "clip_cov": compute_policy_loss_clip_cov, "kl_cov": compute_policy_loss_kl_cov,
    "geo_mean": compute_policy_loss_geo_mean, "dro": compute_policy_loss_dro,
    "cispo": compute_policy_loss_cispo, "bypass_mode": compute_policy_loss_bypass_mode,
}
_LOSS_ORIGINALS: dict = {}


def use_rl_triton_losses(module=None) -> None:
    """Point verl's POLICY_LOSS_REGISTRY entries (and the module's `compute_policy_loss_<name>`
    and `agg_loss`) at the functions above. Idempotent."""
    module = _core_algos(module)
    registry = module.POLICY_LOSS_REGISTRY
    names = {f"compute_policy_loss_{k}": v for k, v in POLICY_LOSSES.items()}
    names["agg_loss"] = agg_loss
    for key, ours in POLICY_LOSSES.items():
        if (module, "registry", key) not in _LOSS_ORIGINALS:
            _LOSS_ORIGINALS[module, "registry", key] = registry.get(key)
        registry[key] = ours
    for name, ours in names.items():
        if (module, name) not in _LOSS_ORIGINALS:
            _LOSS_ORIGINALS[module, name] = getattr(module, name)
        setattr(module, name, ours)


def revert_rl_triton_losses(module=None) -> None:
    """Undo `use_rl_triton_losses`."""
    module = _core_algos(module)
    for key in list(_LOSS_ORIGINALS):
        if key[0] is not module:
            continue
        original = _LOSS_ORIGINALS.pop(key)
        if key[1] == "registry":
            if original is None:
                module.POLICY_LOSS_REGISTRY.pop(key[2], None)
            else:
                module.POLICY_LOSS_REGISTRY[key[2]] = original
        else:
            setattr(module, key[1], original)
