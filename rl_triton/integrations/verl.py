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
