"""verl integration: every advantage estimator of its registry, its KL penalties and its rollout
correction, rl_triton calls with verl's signatures and outputs.

verl (checked against 0.9.1, `verl/trainer/ppo/core_algos.py` and `rollout_corr_helper.py`)
computes token-level GAE and REINFORCE++ returns with a Python loop over the response's tokens,
and most group estimators with a Python loop over the responses; these functions give the same
results from the scan kernels, the group kernel and torch segment reductions (docs/llm.md, "The
zoo", says which entry runs where)::

    from rl_triton.integrations.verl import use_rl_triton
    use_rl_triton()          # verl's trainer now calls the functions below; revert_rl_triton() undoes it

or call them directly, in place of `core_algos.compute_gae_advantage_return` and the others.
The switch is a table per registry (`ESTIMATORS`; `FUNCTIONS`, the module functions the trainer
calls by name; `ROLLOUT_CORRECTION`, in `rollout_corr_helper`): one row per entry.

verl's semantics are kept exactly, where they go beyond semantics §7:
- GAE skips masked tokens (the semantics' `mask`), and its outputs at masked tokens are verl's: the
  advantage carries the next response token's accumulator (0 in the right padding), returns are
  that plus the token's value, and the whitened advantages are shifted and scaled everywhere (so
  padding is not 0);
- whitening is verl's `masked_whiten` (unbiased variance, eps 1e-8), which raises `ValueError` when
  fewer than two tokens are masked in;
- GRPO divides a lone response's score by 1 + epsilon (verl's group of one has std 1); RLOO keeps
  a lone response's score, its vectorized version gives it 0;
- ReMax, OTB and TIR-OTB sum rewards to go through masked tokens (zero-reward steps), as verl does.
Masks are read as verl uses them, 0 or 1. Importing this module does not import verl;
`use_rl_triton()` does, and so do the rollout-correction functions (their metrics are verl's).
"""
from __future__ import annotations

import numpy as np
import torch

import rl_triton

__all__ = ["compute_gae_advantage_return", "compute_grpo_outcome_advantage",
           "compute_grpo_vectorized_outcome_advantage", "compute_grpo_passk_outcome_advantage",
           "compute_rloo_outcome_advantage", "compute_rloo_vectorized_outcome_advantage",
           "compute_reinforce_plus_plus_outcome_advantage",
           "compute_reinforce_plus_plus_baseline_outcome_advantage",
           "compute_remax_outcome_advantage", "compute_opo_outcome_advantage",
           "compute_gpg_outcome_advantage", "compute_optimal_token_baseline_advantage",
           "compute_multi_turn_optimal_token_baseline_advantage",
           "compute_gdpo_outcome_advantage", "kl_penalty", "compute_rollout_correction_weights",
           "compute_rollout_rejection_mask", "compute_policy_loss_vanilla",
           "compute_policy_loss_dppo_tv", "compute_policy_loss_dppo_kl", "compute_policy_loss_gspo",
           "compute_policy_loss_sapo", "compute_policy_loss_gpg", "compute_policy_loss_clip_cov",
           "compute_policy_loss_kl_cov", "compute_policy_loss_geo_mean", "compute_policy_loss_dro",
           "compute_policy_loss_cispo", "compute_policy_loss_bypass_mode", "agg_loss",
           "compute_value_loss", "use_rl_triton", "revert_rl_triton"]

Tensor = torch.Tensor
# the rl_triton backend these functions call ("auto": the Triton kernels on CUDA, torch on CPU)
backend = "auto"


def _scalar(name, x):
    """verl passes gamma and lam as floats or 0-d tensors."""
    if isinstance(x, Tensor) and x.numel() != 1:
        raise ValueError(f"{name} must be a number or a one-element tensor, got shape "
                         f"{tuple(x.shape)}")
    return float(x)


def _whiten(x: Tensor, mask: Tensor) -> Tensor:
    """verl's `masked_whiten` over the 0 / 1 `mask` (any dtype): the mean and the unbiased
    variance of the masked-in tokens, the shift and scale applied to every token. The reductions
    are verl's own (`masked_mean`: sum over `mask.sum() + 1e-8`; the Bessel factor n / (n - 1)
    after), in its dtypes: on near-constant inputs another summation order moves the mean by an
    ulp, and that flips the sign of the whitened noise."""
    keep = mask.bool()
    n = mask.sum()
    mean = (torch.where(keep, x, 0.0) * mask).sum() / (n + 1e-8)
    d = x - mean
    var = (torch.where(keep, d ** 2, 0.0) * mask).sum() / (n + 1e-8) * (n / (n - 1))
    out = d * torch.rsqrt(var + 1e-8)
    # verl's masked_var raises for 0 and 1 tokens (a division by zero); checked last, so that
    # the host waits once, behind the queued kernels
    if n < 2:
        raise ValueError(f"response_mask selects {int(n)} token(s); whitening needs at least 2")
    return out


def _like_tokens(x, tokens: Tensor, name: str):
    """`x` broadcast to the tokens' shape (a view), as the frameworks' arithmetic broadcasts it:
    advantages of one per response, `[B, 1]`, are each response's for all its tokens."""
    if not isinstance(x, Tensor) or x.shape == tokens.shape:
        return x
    try:
        return x.expand(tokens.shape)
    except RuntimeError:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, which does not broadcast to the "
                         f"log-probabilities' {tuple(tokens.shape)}") from None


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
    return _whiten(adv, response_mask).to(dtype), returns


def _blocks(index) -> int:
    """n where verl's `index` (not a tensor) is consecutive blocks of n equal labels, each block's
    label its own (the layout verl's rollout makes: a prompt's n responses side by side), else
    0. A host pass over the labels, cheaper than sorting them (np.unique) and with no copy to
    the device: such groups go to `group_advantages(group_size=n)`, one kernel."""
    arr = np.asarray(index, dtype=object).reshape(-1)
    B = arr.shape[0]
    if B == 0:
        return 0
    starts = np.flatnonzero(arr[1:] != arr[:-1]) + 1
    n = int(starts[0]) if starts.size else B
    if B % n or not np.array_equal(starts, np.arange(n, B, n)):
        return 0
    try:
        return n if len(set(arr[::n].tolist())) == B // n else 0
    except TypeError:  # unhashable labels: the general path
        return 0


def _ids(index, device, n=None):
    """verl's `index` (an array of prompt ids, often uuid strings, or a tensor) as integer ids
    0..G-1 and each group's size, on `device`; `n`: `_blocks(index)` where known. Consecutive
    blocks need no sort and no copy to the device."""
    if isinstance(index, Tensor):
        _, ids, counts = torch.unique(index, return_inverse=True, return_counts=True)
        return ids.reshape(-1).to(device), counts.to(device)
    n = _blocks(index) if n is None else n
    if n:
        B = len(index)
        return (torch.arange(B, device=device) // n,
                torch.full((B // n,), n, dtype=torch.int64, device=device))
    _, ids, counts = np.unique(np.asarray(index), return_inverse=True, return_counts=True)
    return torch.as_tensor(ids.reshape(-1), device=device), torch.as_tensor(counts, device=device)


def _groups(index, device):
    """verl's `index` as `group_advantages`' grouping (`group_size=n` for consecutive blocks of
    n, else `group_index`, ids 0..G-1), and whether each response is its group's only one (None
    where none is)."""
    n = 0 if isinstance(index, Tensor) else _blocks(index)
    if n:
        lone = torch.ones(len(index), dtype=torch.bool, device=device) if n == 1 else None
        return dict(group_size=n), lone
    ids, counts = _ids(index, device, 0)
    return dict(group_index=ids), counts[ids] == 1


def _over_std_one(a: Tensor, epsilon: float) -> Tensor:
    """`a / (std + epsilon)` at verl's std 1 of a group of one, rounded as verl's: a division
    by a tensor (on CUDA, a division by a Python number is a product with its reciprocal,
    an ulp away, which whitening a near-constant batch, as GDPO does, makes visible)."""
    return a / (torch.ones((), dtype=torch.float32, device=a.device) + epsilon)


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
    groups, lone = _groups(index, scores.device)
    scale = "std" if norm_adv_by_std_in_grpo else "none"
    a = rl_triton.group_advantages(scores, **groups, scale=scale, eps=epsilon, backend=backend)
    if norm_adv_by_std_in_grpo and lone is not None:
        a = torch.where(lone, _over_std_one(a, epsilon), a)
    out = _per_token(a, token_level_rewards, response_mask)
    return out, out


@torch.no_grad()
def compute_rloo_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor, index,
                                   epsilon: float = 1e-6, config=None, **kwargs):
    """verl's `compute_rloo_outcome_advantage` (leave-one-out baseline): `(advantages,
    advantages)`; `epsilon` is unused, as in verl."""
    scores = token_level_rewards.sum(dim=-1)
    groups, _ = _groups(index, scores.device)
    a = rl_triton.group_advantages(scores, **groups, baseline="leave_one_out", scale="none",
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
    groups, _ = _groups(index, scores.device)
    a = rl_triton.group_advantages(scores, **groups, scale="none", backend=backend)
    tok = _per_token(a, token_level_rewards, response_mask)
    m = response_mask != 0
    out = (_whiten(tok.float(), response_mask) * m).to(tok.dtype)
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
    return (_whiten(returns.float(), response_mask) * m).to(r.dtype), returns


def _index(index, device):
    """verl's `index` as integer ids 0..G-1, the number of groups G and each response's group
    size."""
    ids, counts = _ids(index, device)
    return ids, counts.numel(), counts[ids]


def _segment_sum(x: Tensor, ids: Tensor, n: int) -> Tensor:
    """Sums over the responses of each group: `[B, ...] -> [G, ...]`."""
    return x.new_zeros((n,) + tuple(x.shape[1:])).index_add_(0, ids, x)


def _group_stats(s: Tensor, ids: Tensor, n: int) -> tuple:
    """Each group's size, mean and unbiased standard deviation (torch.std; NaN for a group of
    one) of `s`, in its dtype: `[G]` each."""
    count = _segment_sum(torch.ones_like(s), ids, n)
    mean = _segment_sum(s, ids, n) / count
    return count, mean, (_segment_sum((s - mean[ids]) ** 2, ids, n) / (count - 1)).sqrt()


def _reverse_cumsum(x: Tensor) -> Tensor:
    """The sum from each token to the row's end (verl's flip-cumsum-flip), on the scan kernel."""
    return rl_triton.linear_scan(x, torch.ones_like(x), reverse=True, time_dim=1,
                                 backend=backend, out_dtype=x.dtype)


def _cumsum(x: Tensor) -> Tensor:
    """The sum from the row's start to each token, on the scan kernel."""
    return rl_triton.linear_scan(x, torch.ones_like(x), reverse=False, time_dim=1,
                                 backend=backend, out_dtype=x.dtype)


@torch.no_grad()
def compute_grpo_vectorized_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor,
                                              index, epsilon: float = 1e-6,
                                              norm_adv_by_std_in_grpo: bool = True, config=None):
    """verl's `compute_grpo_vectorized_outcome_advantage`: GRPO's values, the group statistics
    in float32 (verl's `group_mean_std`) and subtracted from the scores in their own dtype:
    `(advantages, advantages)`."""
    scores = token_level_rewards.sum(dim=-1)
    if scores.dtype == torch.float64:
        # verl subtracts the float32 mean from the float64 scores: the scores' digits below
        # float32 stay in the advantage, which the float32 group kernel cannot give
        # (verl's `group_mean_std(eps=0)`: float32 sums; a group of one has mean 0, std 1)
        ids, n, _ = _index(index, scores.device)
        count, mean, std = _group_stats(scores.float(), ids, n)
        single = count <= 1.0
        a = scores - torch.where(single, 0.0, mean)[ids]
        if norm_adv_by_std_in_grpo:
            a = a / (torch.where(single, 1.0, std)[ids] + epsilon)
    else:
        # a float32 or narrower score minus a float32 mean is the float32 score's difference
        groups, lone = _groups(index, scores.device)
        a = rl_triton.group_advantages(scores.float(), **groups,
                                       scale="std" if norm_adv_by_std_in_grpo else "none",
                                       eps=epsilon, backend=backend)
        if norm_adv_by_std_in_grpo and lone is not None:
            a = torch.where(lone, _over_std_one(a, epsilon), a)  # verl's group of one: std 1
    out = a.unsqueeze(-1) * response_mask
    return out, out


@torch.no_grad()
def compute_rloo_vectorized_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor,
                                              index, epsilon: float = 1e-6, config=None,
                                              **kwargs):
    """verl's `compute_rloo_vectorized_outcome_advantage`: RLOO, but a lone response gets 0
    (`compute_rloo_outcome_advantage` keeps its score): `(advantages, advantages)`."""
    scores = token_level_rewards.sum(dim=-1)
    groups, lone = _groups(index, scores.device)
    a = rl_triton.group_advantages(scores, **groups, baseline="leave_one_out", scale="none",
                                   backend=backend)
    if lone is not None:
        a = torch.where(lone, 0.0, a)
    out = _per_token(a.to(scores.dtype), token_level_rewards, response_mask)
    return out, out


@torch.no_grad()
def compute_grpo_passk_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor,
                                         index, epsilon: float = 1e-6,
                                         norm_adv_by_std_in_grpo: bool = True, config=None,
                                         **kwargs):
    """verl's `compute_grpo_passk_outcome_advantage` (Pass@k): only each group's best response
    gets an advantage, its score less the group's second best (divided by the group's std + eps
    unless `config.get("norm_adv_by_std_in_grpo")` is False; the argument is ignored, as in
    verl). Groups of one raise ValueError. `(advantages, advantages)`."""
    if config is None:
        raise ValueError("config is required: verl's AlgoConfig (norm_adv_by_std_in_grpo)")
    norm = config.get("norm_adv_by_std_in_grpo", True)
    scores = token_level_rewards.sum(dim=-1)
    ids, n, counts = _index(index, scores.device)
    if bool((counts < 2).any()):
        raise ValueError("Pass@k requires at least 2 samples per group (index has a group of one)")
    s = scores.double()
    B = s.numel()
    pos = torch.arange(B, device=s.device)
    best = s.new_full((n,), -torch.inf).scatter_reduce(0, ids, s, "amax")
    # the first response holding its group's best score; a tie for the best gives 0 whichever wins
    first = torch.full((n,), B, device=s.device).scatter_reduce(
        0, ids, torch.where(s == best[ids], pos, B), "amin")
    winner = pos == first[ids]
    second = s.new_full((n,), -torch.inf).scatter_reduce(
        0, ids, torch.where(winner, -torch.inf, s), "amax")
    a = torch.where(winner, best[ids] - second[ids], 0.0)
    if norm:
        a = a / (_group_stats(s.double(), ids, n)[2][ids] + epsilon)
    out = _per_token(a.to(scores.dtype), token_level_rewards, response_mask)
    return out, out


@torch.no_grad()
def compute_opo_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor, index,
                                  epsilon: float = 1e-6, config=None, **kwargs):
    """verl's `compute_opo_outcome_advantage` (OPO): the baseline is the group's mean score
    weighted by response length (masked-in tokens); a lone response's is 0:
    `(advantages, advantages)`."""
    scores = token_level_rewards.sum(dim=-1)
    ids, n, counts = _index(index, scores.device)
    length = response_mask.sum(dim=-1).double()
    b = _segment_sum(length * scores.double(), ids, n) / _segment_sum(length, ids, n)
    a = scores.double() - torch.where(counts > 1, b[ids], 0.0)
    out = _per_token(a.to(scores.dtype), token_level_rewards, response_mask)
    return out, out


@torch.no_grad()
def compute_gpg_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor, index,
                                  epsilon: float = 1e-6, f_norm: float = 1.0, alpha: float = 1.0,
                                  config=None, **kwargs):
    """verl's `compute_gpg_outcome_advantage` (GPG): `alpha * (score - group mean) / f_norm`
    with alpha = B / (number of nonzero scores) (the argument is ignored, as in verl); a lone
    response's mean is 0: `(advantages, advantages)`."""
    scores = token_level_rewards.sum(dim=-1)
    groups, _ = _groups(index, scores.device)
    a = rl_triton.group_advantages(scores, **groups, scale="none", backend=backend)
    alpha = scores.numel() / torch.count_nonzero(scores).clamp(min=1)
    out = _per_token((alpha * a.to(scores.dtype) / f_norm).to(scores.dtype),
                     token_level_rewards, response_mask)
    return out, out


@torch.no_grad()
def compute_remax_outcome_advantage(token_level_rewards: Tensor, reward_baselines: Tensor,
                                    response_mask: Tensor, config=None, **kwargs):
    """verl's `compute_remax_outcome_advantage` (ReMax): returns are the reward-to-go of the
    masked rewards (masked tokens are zero-reward steps, not skipped), advantages the returns
    less the greedy response's reward on masked-in tokens: `(advantages, returns)`."""
    returns = _reverse_cumsum(token_level_rewards * response_mask)
    return returns - reward_baselines.unsqueeze(-1) * response_mask, returns


@torch.no_grad()
def compute_gdpo_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor, index,
                                   epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True,
                                   config=None, non_tensor_batch=None, batch=None, **kwargs):
    """verl's `compute_gdpo_outcome_advantage` (GDPO): GRPO on each reward component
    (`config.gdpo_reward_keys` of `non_tensor_batch`, placed on each response's last token; else
    the token rewards), their sum weighted by `config.gdpo_reward_weights`, whitened over the
    masked-in tokens: `(advantages, advantages)`."""
    score_list, weights = [token_level_rewards], None
    if config is not None and non_tensor_batch is not None and batch is not None:
        keys = config.get("gdpo_reward_keys", None)
        if not keys:
            raise ValueError("GDPO requires config.gdpo_reward_keys (the reward components)")
        device = token_level_rewards.device
        last = batch["attention_mask"][:, batch["prompts"].size(1):].sum(dim=1) - 1
        score_list = []
        for key in keys:
            if key not in non_tensor_batch:
                raise ValueError(f"GDPO reward key {key!r} is not in non_tensor_batch")
            comp = torch.tensor(np.asarray(non_tensor_batch[key], dtype=np.float32), device=device)
            placed = torch.zeros_like(response_mask, dtype=torch.float32)
            placed[torch.arange(placed.size(0), device=device), last] = comp
            score_list.append(placed)
        if config.get("gdpo_reward_weights", None) is not None:
            weights = list(config.get("gdpo_reward_weights"))
    total = None
    for i, scores in enumerate(score_list):
        a, _ = compute_grpo_outcome_advantage(scores, response_mask, index, epsilon,
                                              norm_adv_by_std_in_grpo)
        w = 1.0 if weights is None else float(weights[i])
        total = w * a if total is None else total + w * a
    out = _whiten(total.float(), response_mask) * response_mask
    out = out.to(torch.result_type(total, response_mask))
    return out, out


def _zero_tail(base: Tensor, lengths: Tensor, ids: Tensor, n: int, member: Tensor) -> Tensor:
    """verl's `handle_zero_tail`: in each group of two or more (`member` rows), the longest
    response, where it is the only one that long, gets baseline 0 from the second-longest's
    length on."""
    L = lengths.double()
    neg = torch.full_like(L, -1.0)
    longest = neg[:1].new_full((n,), -1.0).scatter_reduce(0, ids, torch.where(member, L, neg),
                                                          "amax")
    at_max = member & (L == longest[ids])
    n_max = _segment_sum(at_max.double(), ids, n)
    second = neg[:1].new_full((n,), -1.0).scatter_reduce(
        0, ids, torch.where(member & ~at_max, L, neg), "amax")
    cut = at_max & (n_max[ids] == 1)
    t = torch.arange(base.shape[1], device=base.device)
    return torch.where(cut[:, None] & (t[None, :] >= second[ids][:, None]), 0.0, base)


def _path_variance(old_log_probs, sum_pi_squared, rollout_is_weights, response_mask):
    """OTB's W_t: the cumulative sum of 1 - 2 pi_t + sum pi^2 (times the IS weight squared)
    over the masked-in tokens."""
    w = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * rollout_is_weights ** 2
    return _cumsum(w * response_mask)


@torch.no_grad()
def compute_optimal_token_baseline_advantage(token_level_rewards: Tensor, response_mask: Tensor,
                                             index, old_log_probs: Tensor,
                                             sum_pi_squared: Tensor,
                                             rollout_is_weights: Tensor = None,
                                             handle_zero_tail: bool = True,
                                             epsilon: float = 1e-8, **kwargs):
    """verl's `compute_optimal_token_baseline_advantage` (OTB): per token position t, the
    baseline `sum_i G_t W_t / (sum_i W_t + eps)` over the group's responses, with G the
    reward-to-go and W the cumulative path variance; a lone response's baseline is 0:
    `(advantages, returns)`."""
    m = response_mask
    returns = _reverse_cumsum(token_level_rewards * m)
    W = _path_variance(old_log_probs, sum_pi_squared, rollout_is_weights, m)
    ids, n, counts = _index(index, returns.device)
    num = _segment_sum(returns * W * m, ids, n)
    den = _segment_sum(W * m, ids, n) + epsilon
    base = torch.where((counts > 1)[:, None], (num / den)[ids], 0.0).to(returns.dtype)
    if handle_zero_tail:
        base = _zero_tail(base, m.sum(dim=-1), ids, n, counts > 1)
    return (returns - base) * m, returns


@torch.no_grad()
def compute_multi_turn_optimal_token_baseline_advantage(
        token_level_rewards: Tensor, response_mask: Tensor, index, old_log_probs: Tensor,
        sum_pi_squared: Tensor, rollout_is_weights: Tensor = None, handle_zero_tail: bool = True,
        epsilon: float = 1e-8, **kwargs):
    """verl's `compute_multi_turn_optimal_token_baseline_advantage` (`tir_optimal_token_baseline`):
    OTB with the responses' masked-in tokens aligned by their rank (the k-th decision token of
    every response of a group shares a baseline), responses without one left out of their group:
    `(advantages, returns)`."""
    m = response_mask
    returns = _reverse_cumsum(token_level_rewards * m)
    W = _path_variance(old_log_probs, sum_pi_squared, rollout_is_weights, m)
    keep = m.bool()
    lengths = m.sum(dim=-1).long()
    width = int(lengths.max()) if lengths.numel() else 0
    rank = torch.cumsum(keep.long(), dim=1) - 1
    rows, cols = keep.nonzero(as_tuple=True)
    k = rank[rows, cols]
    # each response's decision tokens, left-aligned: [B, width]
    W_c = W.new_zeros(W.shape[0], width).index_put_((rows, k), W[rows, cols])
    R_c = returns.new_zeros(W.shape[0], width).index_put_((rows, k), returns[rows, cols])
    ids, n, _ = _index(index, returns.device)
    member = lengths > 0
    size = _segment_sum(member.long(), ids, n)[ids]
    live = member[:, None]
    num = _segment_sum(torch.where(live, R_c * W_c, 0.0), ids, n)
    den = _segment_sum(torch.where(live, W_c, 0.0), ids, n) + epsilon
    base = torch.where((member & (size > 1))[:, None], (num / den)[ids], 0.0).to(R_c.dtype)
    if handle_zero_tail:
        base = _zero_tail(base, lengths, ids, n, member & (size > 1))
    adv = torch.zeros_like(returns)
    adv[rows, cols] = (R_c - base)[rows, k]
    return adv * m, returns


# verl's kl_penalty names -> (rl_triton.kl_penalty's kind, clamp); verl clamps k3 to +-10 only
_KL_NAMES = {"kl": ("k1", None), "k1": ("k1", None), "abs": ("abs", None),
             "mse": ("k2", None), "k2": ("k2", None), "low_var_kl": ("k3", 10.0),
             "k3": ("k3", 10.0)}


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kl_penalty) -> Tensor:
    """verl's `kl_penalty`: a per-token KL estimate by name (`kl`/`k1`, `abs`, `mse`/`k2`,
    `low_var_kl`/`k3`, clamped to +-10), and the straight-through names with a `+` (`k3+`: k3's
    value, the gradient of k2, d); one `rl_triton.kl_penalty` call, differentiable as verl's.
    `full` and unknown names raise NotImplementedError, as in verl."""
    plus = kl_penalty.endswith("+")
    base = kl_penalty[:-1] if plus else kl_penalty
    if base not in _KL_NAMES:
        raise NotImplementedError(f"kl_penalty {kl_penalty!r} (verl's names: "
                                  f"{sorted(_KL_NAMES)}, each with an optional '+')")
    kind, clamp = _KL_NAMES[base]
    # verl's "k2+" is k2: its straight-through gradient is k2's own
    if plus and kind != "k2":
        kind += "+"
    return rl_triton.kl_penalty(logprob, ref_logprob, kind, clamp, backend=backend,
                                out_dtype=torch.result_type(logprob, ref_logprob))


def compute_rollout_correction_weights(log_ratio: Tensor, response_mask: Tensor,
                                       rollout_is: str = "token",
                                       rollout_is_threshold=2.0,
                                       rollout_is_batch_normalize: bool = False):
    """verl's `rollout_corr_helper.compute_rollout_correction_weights`: the weights of
    `rl_triton.rollout_correction` (level token or sequence, verl's safety clamp of the
    log-ratio at 20; a single threshold truncates, "lower_upper" zeroes the weights outside,
    IcePop), optionally divided by their mean (over every rank's batch under torch.distributed,
    as verl); the metrics are verl's own, computed from them
    (`compute_is_metrics`, imported on call). `(weights, metrics)`."""
    from verl.trainer.ppo import rollout_corr_helper as helper
    import verl.utils.torch_functional as verl_F
    if rollout_is not in ("token", "sequence"):
        raise ValueError(f"Invalid rollout_is: {rollout_is}. Must be one of token, sequence.")
    # verl's own parser: a number or "upper" (TIS), or "lower_upper" (IcePop), with its errors
    upper, lower = helper._parse_rollout_is_threshold(rollout_is_threshold)
    m = response_mask
    # verl zeroes the raw weights outside the mask before the lower bound: 0 there either way
    w, _ = rl_triton.rollout_correction(log_ratio, log_ratio.new_zeros(()).expand_as(log_ratio),
                                        m, level=rollout_is, mode="truncate" if lower is None
                                        else "mask", low=lower, high=upper,
                                        log_ratio_clamp=helper.SAFETY_BOUND, backend=backend)
    w = w.to(torch.result_type(log_ratio, m))
    # verl's metrics read the raw (untruncated) weights and the log-ratios
    if rollout_is == "token":
        for_metrics = log_ratio
        raw = torch.exp(log_ratio.clamp(-helper.SAFETY_BOUND, helper.SAFETY_BOUND)) * m
    else:
        for_metrics = verl_F.masked_sum(log_ratio, m, axis=-1).unsqueeze(-1)
        raw = torch.exp(for_metrics.clamp(-helper.SAFETY_BOUND,
                                          helper.SAFETY_BOUND)).expand_as(log_ratio) * m
    metrics = helper.compute_is_metrics(rollout_is_weights=w, raw_rollout_is_weights=raw,
                                        log_ratio_for_metrics=for_metrics, response_mask=m,
                                        rollout_is=rollout_is, rollout_is_threshold=upper,
                                        rollout_is_threshold_lower=lower)
    if lower is not None:
        oob = (raw < lower) | (raw > upper)
        metrics["rollout_is_oob_ratio"] = verl_F.masked_mean(oob.float(), m).item()
    if rollout_is_batch_normalize:
        # under torch.distributed (verl's FSDP workers) the mean is over every rank's batch,
        # verl's own all-reduce of the sum and the count
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if rollout_is == "token":
            mean = verl_F.distributed_masked_mean(w, m.to(w.dtype)) if distributed \
                else verl_F.masked_mean(w, m)
        else:
            seq = verl_F.masked_mean(w, m, axis=-1)
            seq_mask = (m.sum(dim=-1) > 0).to(w.dtype)
            mean = verl_F.distributed_masked_mean(seq, seq_mask) if distributed \
                else (seq * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if mean > 1e-8:
            w = w / mean
            metrics["rollout_is_batch_norm_factor"] = mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return w, metrics


def compute_rollout_rejection_mask(log_ratio: Tensor, response_mask: Tensor,
                                   rollout_rs: str = "token_k1", rollout_rs_threshold=None):
    """verl's `rollout_corr_helper.compute_rollout_rejection_mask`: every option of the comma
    separated `rollout_rs` (`token_k1`..`seq_max_k3`) one `rl_triton.rollout_correction` call
    (statistic k1/k2/k3, level token / sequence / geometric / max, mode "mask"; k1's bounds are
    ratio bounds, compared in log space), the kept masks and-ed into `response_mask`; the
    metrics are verl's own (`compute_rs_metrics`, imported on call). `(mask, metrics)`."""
    import math
    from verl.trainer.ppo import rollout_corr_helper as helper
    import verl.utils.torch_functional as verl_F
    if rollout_rs is None or not isinstance(rollout_rs, str):
        raise ValueError("rollout_rs must be a non-empty string (comma separated options)")
    if rollout_rs_threshold is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling.")
    if log_ratio.shape[0] == 0:
        return response_mask, {}
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    if not options:
        raise ValueError("rollout_rs must contain at least one valid option.")
    for o in options:
        if o not in helper.SUPPORTED_ROLLOUT_RS_OPTIONS:
            raise ValueError(f"Invalid rollout_rs option: {o}. Must be one of "
                             f"{sorted(helper.SUPPORTED_ROLLOUT_RS_OPTIONS)}.")
    thresholds = helper._parse_rollout_rs_thresholds(options, rollout_rs_threshold)
    m = response_mask
    m_bool = m.bool()
    seq_valid = m.sum(dim=-1) > 0
    zeros = log_ratio.new_zeros(()).expand_as(log_ratio)
    safe = log_ratio.clamp(-helper.SAFETY_BOUND, helper.SAFETY_BOUND)
    per_token = {"k1": -safe, "k2": 0.5 * safe ** 2, "k3": torch.exp(safe) - 1.0 - safe}
    combined = torch.ones_like(m, dtype=log_ratio.dtype)
    metrics = {}
    levels = {"token": "token", "seq_sum": "sequence", "seq_mean": "geometric",
              "seq_max": "max"}
    for o in options:
        prefix, k = o.rsplit("_", 1)
        lower, upper = thresholds[o]["lower"], thresholds[o]["upper"]
        if k == "k1":
            lower, upper = math.log(lower), math.log(upper)
        _, keep = rl_triton.rollout_correction(log_ratio, zeros, m, level=levels[prefix],
                                               mode="mask", statistic=k, low=lower, high=upper,
                                               log_ratio_clamp=helper.SAFETY_BOUND,
                                               backend=backend)
        # verl's keep is the test alone, outside the mask too
        token_keep = keep | ~m_bool
        seq_stat = None
        stat = per_token[k]
        if prefix != "token":
            if prefix == "seq_sum":
                seq_stat = verl_F.masked_sum(stat, m, axis=-1)
            elif prefix == "seq_mean":
                seq_stat = verl_F.masked_mean(stat, m, axis=-1)
            else:
                seq_stat = stat.masked_fill(~m_bool, -torch.inf).max(dim=-1).values
                seq_stat = torch.where(seq_stat == -torch.inf, 0.0, seq_stat)
            stat = seq_stat.unsqueeze(-1).expand_as(m)
        keep_f = token_keep.to(log_ratio.dtype)
        combined = combined * keep_f
        metrics.update(helper.compute_rs_metrics(
            option_name=o, rs_statistic=stat, response_mask=m, seq_valid_mask=seq_valid,
            level="token" if prefix == "token" else "sequence",
            per_sequence_values=seq_stat, rollout_rs_threshold=upper,
            rollout_rs_threshold_lower=lower if k == "k1" else 0.0,
            apply_lower_threshold=k == "k1"))
        metrics[f"rollout_rs_{o}_masked_fraction"] = verl_F.masked_mean(1 - keep_f, m).item()
        seq_keep = (~(~token_keep & m_bool)).all(dim=-1)
        valid = seq_valid.float()
        metrics[f"rollout_rs_{o}_seq_masked_fraction"] = (
            (((1.0 - seq_keep.to(log_ratio.dtype)) * valid).sum() / valid.sum()).item()
            if valid.sum() > 0 else 0.0)
    metrics["rollout_rs_masked_fraction"] = verl_F.masked_mean(1 - combined, m).item()
    final = (combined > 0.5) & m_bool
    metrics["rollout_rs_seq_masked_fraction"] = (~final & m_bool).any(dim=-1).float().mean().item()
    return (m * combined).to(m.dtype), metrics


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


# verl's agg_loss modes (it raises for any other; policy_loss's "sum" is not one)
_VERL_AGGREGATIONS = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                      "seq-mean-token-mean")


def _verl_loss(loss_type, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
               config, weights, keys, **options):
    """policy_loss with verl's inputs; `keys`: verl's metric names -> ours."""
    if config is None:
        raise ValueError("config is required: verl's ActorConfig")
    if loss_agg_mode not in _VERL_AGGREGATIONS and loss_type != "geo_mean":
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
    dtype = log_prob.dtype if log_prob.dtype in (torch.float32, torch.float64) else torch.float32
    advantages = _like_tokens(advantages, log_prob, "advantages")
    weights = _like_tokens(weights, log_prob, "rollout_is_weights")
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


def _aggregation(mode, mask, shape, dp_size, batch_num_tokens, global_batch_size,
                 loss_scale_factor):
    """(mask as bool, our aggregation, the factor after it) of verl's `agg_loss` arguments."""
    from ..ops.policy_loss import _count, _plan

    if mode not in _VERL_AGGREGATIONS:
        raise ValueError(f"Invalid loss_agg_mode: {mode}")
    m = mask != 0
    base, factor = _plan(mode, m, None, shape, int(dp_size),
                         _count("batch_num_tokens", batch_num_tokens, m.device),
                         _count("global_batch_size", global_batch_size, m.device),
                         _count("loss_scale_factor", loss_scale_factor, m.device))
    return m, base, factor


def agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None,
             global_batch_size=None, loss_scale_factor=None):
    """verl's `agg_loss`: per-token losses `[B, T]` to a scalar (policy_loss's aggregation, in
    torch: a reduction already); an empty selection gives 0 where verl's token-mean gives NaN."""
    from ..ops import _losses

    m, base, factor = _aggregation(loss_agg_mode, loss_mask, tuple(loss_mat.shape), dp_size,
                                   batch_num_tokens, global_batch_size, loss_scale_factor)
    loss = _losses.aggregate(loss_mat, m, base, None)
    return loss if factor is None else loss * factor


def compute_value_loss(vpreds: Tensor, returns: Tensor, values: Tensor, response_mask: Tensor,
                       cliprange_value: float, loss_agg_mode: str = "token-mean",
                       dp_size: int = 1, batch_num_tokens=None, global_batch_size=None,
                       loss_scale_factor=None):
    """verl's `compute_value_loss` (the critic's loss, `verl.workers.utils.losses`): `0.5 *
    agg_loss(max((V - R)^2, (clip(V, old - c, old + c) - R)^2))`, the old values `values`, one
    `rl_triton.value_loss` call (semantics §9: kind "mse", `clip=cliprange_value`, verl's
    aggregation and global counts as in `agg_loss`). `(vf_loss, vf_clipfrac)`: the clip fraction
    is verl's, a 0-d float32 tensor, the masked mean of the tokens whose clipped error is strictly
    the larger (torch, no gradient; the kernel computes no such metric). Differences: an empty
    selection gives a loss of 0 where verl's token-mean and seq-mean modes give NaN; masks are read
    as 0 / 1."""
    m, base, factor = _aggregation(loss_agg_mode, response_mask, tuple(vpreds.shape), dp_size,
                                   batch_num_tokens, global_batch_size, loss_scale_factor)
    dtype = vpreds.dtype if vpreds.dtype in (torch.float32, torch.float64) else torch.float32
    loss = rl_triton.value_loss(vpreds, returns, values, m, clip=float(cliprange_value),
                                aggregation=base, backend=backend, out_dtype=dtype)
    if factor is not None:
        loss = loss * factor
    with torch.no_grad():
        # verl's clip_by_value and masked_mean, term for term: inside the range the clipped
        # prediction is V itself, so only a strictly larger clipped error counts
        clipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
        larger = torch.gt((clipped - returns) ** 2, (vpreds - returns) ** 2).float()
        clipfrac = (torch.where(m, larger, 0.0) * response_mask).sum() / \
            (response_mask.sum() + 1e-8)
    return loss, clipfrac


# verl's POLICY_LOSS_REGISTRY names -> ours
POLICY_LOSSES = {
    "vanilla": compute_policy_loss_vanilla, "dppo_tv": compute_policy_loss_dppo_tv,
    "dppo_kl": compute_policy_loss_dppo_kl, "gspo": compute_policy_loss_gspo,
    "sapo": compute_policy_loss_sapo, "gpg": compute_policy_loss_gpg,
    "clip_cov": compute_policy_loss_clip_cov, "kl_cov": compute_policy_loss_kl_cov,
    "geo_mean": compute_policy_loss_geo_mean, "dro": compute_policy_loss_dro,
    "cispo": compute_policy_loss_cispo, "bypass_mode": compute_policy_loss_bypass_mode,
}


# The switch: (attribute of verl's core_algos, its key in the registry named by the table, ours).
# Each table is one registry.
ESTIMATORS = [
    ("compute_gae_advantage_return", "gae", compute_gae_advantage_return),
    ("compute_grpo_outcome_advantage", "grpo", compute_grpo_outcome_advantage),
    ("compute_grpo_vectorized_outcome_advantage", "grpo_vectorized",
     compute_grpo_vectorized_outcome_advantage),
    ("compute_grpo_passk_outcome_advantage", "grpo_passk", compute_grpo_passk_outcome_advantage),
    ("compute_rloo_outcome_advantage", "rloo", compute_rloo_outcome_advantage),
    ("compute_rloo_vectorized_outcome_advantage", "rloo_vectorized",
     compute_rloo_vectorized_outcome_advantage),
    ("compute_reinforce_plus_plus_outcome_advantage", "reinforce_plus_plus",
     compute_reinforce_plus_plus_outcome_advantage),
    ("compute_reinforce_plus_plus_baseline_outcome_advantage", "reinforce_plus_plus_baseline",
     compute_reinforce_plus_plus_baseline_outcome_advantage),
    ("compute_remax_outcome_advantage", "remax", compute_remax_outcome_advantage),
    ("compute_opo_outcome_advantage", "opo", compute_opo_outcome_advantage),
    ("compute_gpg_outcome_advantage", "gpg", compute_gpg_outcome_advantage),
    ("compute_optimal_token_baseline_advantage", "optimal_token_baseline",
     compute_optimal_token_baseline_advantage),
    ("compute_multi_turn_optimal_token_baseline_advantage", "tir_optimal_token_baseline",
     compute_multi_turn_optimal_token_baseline_advantage),
    ("compute_gdpo_outcome_advantage", "gdpo", compute_gdpo_outcome_advantage),
]
LOSSES = [(f"compute_policy_loss_{key}", key, ours) for key, ours in POLICY_LOSSES.items()]
# module functions the trainer calls by name, in no registry (verl.workers.utils.losses imports
# all three by name: the actor's KL and loss aggregation, the critic's loss)
FUNCTIONS = [("kl_penalty", None, kl_penalty), ("agg_loss", None, agg_loss),
             ("compute_value_loss", None, compute_value_loss)]
TABLES = {"ADV_ESTIMATOR_REGISTRY": ESTIMATORS, "POLICY_LOSS_REGISTRY": LOSSES,
          None: FUNCTIONS}
# functions of verl's rollout_corr_helper (its compute_rollout_correction_and_rejection_mask,
# which the trainer calls, looks them up there)
ROLLOUT_CORRECTION = [("compute_rollout_correction_weights", compute_rollout_correction_weights),
                      ("compute_rollout_rejection_mask", compute_rollout_rejection_mask)]
_ORIGINALS: dict = {}


def _core_algos(module):
    if module is None:
        import verl.trainer.ppo.core_algos as module
    return module


def _importers(module, name, original):
    """The loaded modules of `module`'s package (verl) other than it that hold `original` as
    `name`."""
    import sys
    package = module.__name__.split(".")[0] + "."
    return [m for n, m in list(sys.modules.items())
            if n.startswith(package) and m is not module and m is not None
            and vars(m).get(name) is original]


def _put_back(package: str, originals: dict) -> None:
    """In every loaded module of `package`, each attribute that is one of rl_triton's
    replacements gets the framework's own object back. `originals`: id(ours) -> (ours,
    original); an attribute counts only if it is that very object. This reaches the modules
    that imported a function by name while the switch was on, wherever and under whatever name."""
    import sys
    for name, m in list(sys.modules.items()):
        if m is None or not (name == package or name.startswith(package + ".")):
            continue
        attributes = getattr(m, "__dict__", None)
        for attr, value in list(attributes.items()) if isinstance(attributes, dict) else ():
            pair = originals.get(id(value))
            if pair is not None and pair[0] is value:
                setattr(m, attr, pair[1])


def _helper(module):
    """verl's `rollout_corr_helper`, beside `module` (core_algos)."""
    import importlib
    return importlib.import_module(module.__name__.rsplit(".", 1)[0] + ".rollout_corr_helper")


def use_rl_triton(module=None) -> None:
    """Point verl's `core_algos` functions and registries at the functions above (the trainer
    looks GAE and GRPO up on the module, the others in the registry), every row of `TABLES`,
    and the rollout-correction functions of its `rollout_corr_helper`. `module`: the
    `core_algos` module to patch (default: import it). Idempotent."""
    module = _core_algos(module)
    for registry_name, rows in TABLES.items():
        registry = getattr(module, registry_name) if registry_name else None
        for name, key, ours in rows:
            if (module, name) not in _ORIGINALS:
                _ORIGINALS[module, name] = (getattr(module, name),
                                            None if registry is None else registry.get(key))
            setattr(module, name, ours)
            if registry is not None:
                registry[key] = ours
    helper = _helper(module)
    for name, ours in ROLLOUT_CORRECTION:
        _ORIGINALS.setdefault((helper, name), (getattr(helper, name), None))
        setattr(helper, name, ours)
    # modules that imported a function by name before (verl.workers.utils.losses: the actor's KL
    # loss, the critic's loss) hold verl's own object; later imports read the patched attribute
    for name, _, ours in FUNCTIONS:
        original = _ORIGINALS[module, name][0]
        for other in _importers(module, name, original):
            setattr(other, name, ours)


def revert_rl_triton(module=None) -> None:
    """Undo `use_rl_triton`: verl's own functions back on its modules and in its registries, and
    in every loaded verl module that holds one of ours (imported by name before or after the
    switch)."""
    module = _core_algos(module)
    originals = {}
    for registry_name, rows in TABLES.items():
        for name, key, ours in rows:
            if (module, name) in _ORIGINALS:
                fn, registered = _ORIGINALS.pop((module, name))
                setattr(module, name, fn)
                if registered is not None:
                    getattr(module, registry_name)[key] = registered
                originals[id(ours)] = (ours, fn)
    helper = _helper(module)
    for name, ours in ROLLOUT_CORRECTION:
        if (helper, name) in _ORIGINALS:
            fn = _ORIGINALS.pop((helper, name))[0]
            setattr(helper, name, fn)
            originals[id(ours)] = (ours, fn)
    _put_back(module.__name__.split(".")[0], originals)
