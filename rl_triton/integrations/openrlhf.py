"""OpenRLHF integration: its GAE and cumulative returns, one rl_triton call each, and its KL
estimator `compute_approx_kl` on rl_triton's `kl_penalty`.

OpenRLHF (checked against 0.11.2, `openrlhf/trainer/ppo_utils/experience_maker.py`) computes them
in `RemoteExperienceMaker` with a Python loop over the response's tokens; these functions have the
methods' signatures (`self` first) and outputs::

    from rl_triton.integrations.openrlhf import use_rl_triton
    use_rl_triton()          # RemoteExperienceMaker's methods are now these; revert_rl_triton() undoes it

Its estimators (`reinforce`, `reinforce_baseline`, `rloo`, `group_norm`, `dr_grpo`,
`flash_reinforce`, `gae`) are branches of `RemoteExperienceMaker.compute_advantages_and_returns`,
whose group baselines are tensor ops already and whose token loops are the two methods replaced
here.

OpenRLHF's semantics are kept exactly, and they are not semantics §7's `mask`: it zeroes rewards and
values at masked tokens and keeps stepping through them, so a masked span inside a response (a
tool's output in a multi-turn rollout) is a run of zero-reward steps, each one decaying by gamma
(and gamma * lambd), and the token before it bootstraps from a value of 0. With right padding only
the two agree on the response tokens. `rl_triton.gae(..., mask=action_mask, last_value=0)` computes
the semantics' version, as if the masked tokens were not there (docs/llm.md shows both on one
rollout). Importing this module does not import OpenRLHF; `use_rl_triton()` does.
"""
from __future__ import annotations

import torch

import rl_triton
from .verl import _like_tokens, _no_flags, _put_back

__all__ = ["get_advantages_and_returns", "get_cumulative_returns", "compute_approx_kl",
           "PolicyLoss", "use_rl_triton", "revert_rl_triton"]

Tensor = torch.Tensor
# the rl_triton backend these functions call ("auto": the Triton kernels on CUDA, torch on CPU)
backend = "auto"


@torch.no_grad()
def get_advantages_and_returns(self, values: Tensor, rewards: Tensor, action_mask, gamma: float,
                               lambd: float):
    """`RemoteExperienceMaker.get_advantages_and_returns`: `(advantages, returns)`,
    `[batch, response_size]`; `self` is unused."""
    if action_mask is not None:
        values = action_mask * values
        rewards = action_mask * rewards
    adv, _ = rl_triton.gae(rewards, values, _no_flags(rewards),
                           last_value=torch.zeros_like(rewards[:, 0]), gamma=float(gamma),
                           lam=float(lambd), time_dim=1, backend=backend)
    adv = adv.to(torch.result_type(rewards, values))
    return adv, adv + values


@torch.no_grad()
def get_cumulative_returns(self, rewards: Tensor, action_mask, gamma: float):
    """`RemoteExperienceMaker.get_cumulative_returns`: the discounted sum of the (masked) rewards
    from each token to the end, `[batch, response_size]`; `self` is unused."""
    if action_mask is not None:
        rewards = action_mask * rewards
    return rl_triton.discounted_returns(rewards, _no_flags(rewards), gamma=float(gamma),
                                        time_dim=1, backend=backend).to(rewards.dtype)


# OpenRLHF's clamp of every estimate, and of the importance weight of its unbiased gradient
_KL_CLAMP = 10.0


def compute_approx_kl(log_probs: Tensor, log_probs_base: Tensor, log_probs_old=None,
                      kl_estimator: str = "k1", unbiased_gradient: bool = False) -> Tensor:
    """`openrlhf.models.utils.compute_approx_kl`: k1, k2 or k3 of `log_probs - log_probs_base`
    (float32), clamped to +-10; with `unbiased_gradient`, the same value and the gradient
    `w * d` (d the log-ratio, w = exp(log_probs - log_probs_old) clamped to 10 and detached,
    1 without `log_probs_old`). One `rl_triton.kl_penalty` call (its "+" kinds)."""
    if kl_estimator not in ("k1", "k2", "k3"):
        raise ValueError(f"Unknown kl_estimator: {kl_estimator}")
    lp, base = log_probs.float(), log_probs_base.float()
    if not unbiased_gradient:
        return rl_triton.kl_penalty(lp, base, kl_estimator, _KL_CLAMP, backend=backend)
    st = rl_triton.kl_penalty(lp, base, kl_estimator + "+", _KL_CLAMP, backend=backend)
    if log_probs_old is None:
        return st
    w = (lp - log_probs_old.float()).exp().clamp(max=_KL_CLAMP).detach()
    return st.detach() + w * (st - st.detach())


# ---- PolicyLoss (semantics §10) ------------------------------------------------------------------

def _masked_mean(x: Tensor, mask, dim=None) -> Tensor:
    """OpenRLHF's `masked_mean`: `mask=None` a plain mean, as its own. The masked positions leave
    by a select, not by OpenRLHF's product: a NaN or inf there (0 * NaN is NaN) reaches no
    statistic, metric or gradient (semantics §9, where we deliberately differ from OpenRLHF)."""
    if mask is None:
        return x.mean() if dim is None else x.mean(dim)
    x = torch.where(mask != 0, x * mask, 0.0)
    return x.sum() / mask.sum() if dim is None else x.sum(dim) / mask.sum(dim)


class PolicyLoss(torch.nn.Module):
    """OpenRLHF's `openrlhf.models.loss.PolicyLoss` (0.11.2): same constructor, same forward,
    same outputs `(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)`, the loss one
    `rl_triton.policy_loss` call ("ppo": vanilla; "gspo": the sequence ratio, differentiable).
    The train / rollout correction (`is_correction_*`, with `rollout_log_probs`) forms its
    per-token coefficient in torch, as OpenRLHF, and passes it as policy_loss's `weights`.
    Differences: an empty selection gives a loss of 0 where OpenRLHF's masked mean gives NaN; a
    NaN or inf at a masked position reaches no output (semantics §9), where OpenRLHF's product
    by the mask gives NaN (and its "seq" correction rejects the sequence)."""

    def __init__(self, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2,
                 dual_clip: float = None, token_level_loss: bool = True,
                 policy_loss_type: str = "ppo", is_correction_level: str = "off",
                 is_correction_mode: str = "mask", is_correction_gating: str = "ratio",
                 is_correction_threshold: list = (0.5, 5.0)) -> None:
        super().__init__()
        if policy_loss_type not in ("ppo", "gspo"):
            raise ValueError(f"Invalid policy loss type: {policy_loss_type}")
        if dual_clip is not None and not dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1.0, got {dual_clip}")
        if is_correction_level not in {"off", "token", "seq"}:
            raise ValueError(f"is_correction_level must be off/token/seq, got "
                             f"{is_correction_level}")
        if is_correction_mode not in {"mask", "clip"}:
            raise ValueError(f"is_correction_mode must be mask/clip, got {is_correction_mode}")
        if is_correction_gating not in {"ratio", "binary_kl", "tv"}:
            raise ValueError(f"is_correction_gating must be ratio/binary_kl/tv, got "
                             f"{is_correction_gating}")
        if is_correction_mode == "clip" and (is_correction_level == "seq"
                                             or is_correction_gating != "ratio"):
            raise ValueError("is_correction_mode=clip requires is_correction_level=token and "
                             "is_correction_gating=ratio")
        if is_correction_gating != "ratio" and is_correction_level != "off" and \
                is_correction_threshold[0] > 0:
            raise ValueError(f"is_correction_gating={is_correction_gating} takes an upper bound "
                             "only (a single delta)")
        self.clip_eps_low, self.clip_eps_high = clip_eps_low, clip_eps_high
        self.dual_clip = dual_clip
        # GSPO's loss is per sample, as OpenRLHF's
        self.token_level_loss = token_level_loss and policy_loss_type != "gspo"
        self.policy_loss_type = policy_loss_type
        self.is_correction_level = is_correction_level
        self.is_correction_mode = is_correction_mode
        self.is_correction_gating = is_correction_gating
        self.is_correction_threshold = is_correction_threshold

    def _correction(self, old_log_probs, rollout_log_probs, action_mask):
        """OpenRLHF's coefficient (no gradient), filter fraction and vLLM KL; `action_mask=None`
        takes plain means, as OpenRLHF's."""
        low, high = self.is_correction_threshold
        seq_level = self.is_correction_level == "seq"
        is_log_ratio = (old_log_probs - rollout_log_probs).detach()
        token_is = is_log_ratio.exp()

        def seq_mean(x):
            # a sequence's statistic over its masked-in tokens only (semantics §9)
            return _masked_mean(x, action_mask, -1).unsqueeze(-1)

        if self.is_correction_gating == "ratio":
            stat = (seq_mean(is_log_ratio) if seq_level else is_log_ratio).exp()
        else:
            p = rollout_log_probs.detach().exp().clamp(1e-6, 1 - 1e-6)
            q = old_log_probs.detach().exp().clamp(1e-6, 1 - 1e-6)
            if self.is_correction_gating == "binary_kl":
                stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
            else:
                stat = (p - q).abs()
            if seq_level:
                stat = seq_mean(stat)
        if self.is_correction_mode == "clip":
            coef = stat.clamp(min=low, max=high)
            filtered = (stat < low) | (stat > high)
        else:
            keep = (stat >= low) & (stat <= high)
            coef = torch.where(keep, token_is, 0.0)
            filtered = ~keep
        if seq_level:
            ratio = filtered.float().mean()
        else:
            ratio = _masked_mean(filtered.float(), action_mask)
        vllm_kl = _masked_mean(rollout_log_probs - old_log_probs, action_mask)
        return coef.expand(old_log_probs.shape), ratio, vllm_kl

    def forward(self, log_probs, old_log_probs, advantages, action_mask=None,
                rollout_log_probs=None, dp_size: int = 1, batch_num_tokens=None,
                global_batch_size=None):
        gspo = self.policy_loss_type == "gspo"
        advantages = _like_tokens(advantages, log_probs, "advantages")
        correct = self.is_correction_level != "off"
        weights = vllm_kl = is_filter_ratio = None
        if correct and not gspo:
            weights, is_filter_ratio, vllm_kl = self._correction(old_log_probs,
                                                                 rollout_log_probs, action_mask)
        # OpenRLHF's gspo with the correction on takes its ratio against the rollout
        ratio_base = rollout_log_probs if gspo and correct else old_log_probs
        if self.token_level_loss:
            agg, counts = "token-mean", {}
            if batch_num_tokens is not None:
                counts = dict(batch_num_tokens=batch_num_tokens, dp_size=int(dp_size))
        else:
            agg, counts = "seq-mean-token-mean", {}
            if global_batch_size is not None:
                counts = dict(global_batch_size=global_batch_size, dp_size=int(dp_size))
        dtype = log_probs.dtype if log_probs.dtype in (torch.float32, torch.float64) \
            else torch.float32
        loss, metrics = rl_triton.policy_loss(
            log_probs, ratio_base, advantages, action_mask, loss_type="vanilla",
            aggregation=agg, weights=weights, ratio_level="sequence" if gspo else "token",
            clip_low=float(self.clip_eps_low), clip_high=float(self.clip_eps_high),
            dual_clip=None if self.dual_clip is None else float(self.dual_clip),
            log_ratio_clamp=None if gspo else 20.0, backend=backend, out_dtype=dtype, **counts)
        ppo_kl = metrics["kl"]
        if not gspo or correct:
            # OpenRLHF's ppo_kl: the unclamped log-ratio against the old policy (the loss clamps
            # it at +-20, and gspo with the correction takes its ratio against the rollout)
            ppo_kl = -_masked_mean((log_probs - old_log_probs).detach(), action_mask)
        return loss, metrics["clip_fraction"], ppo_kl, vllm_kl, is_filter_ratio


# The switch: RemoteExperienceMaker's methods (name, ours), and module attributes (name, ours)
# replaced in every loaded OpenRLHF module that imported them by name
METHODS = [("get_advantages_and_returns", get_advantages_and_returns),
           ("get_cumulative_returns", get_cumulative_returns)]
FUNCTIONS = [("compute_approx_kl", compute_approx_kl), ("PolicyLoss", PolicyLoss)]
_FUNCTION_MODULES = ("openrlhf.models.utils", "openrlhf.models.loss", "openrlhf.models",
                     "openrlhf.trainer.ppo_utils.experience_maker",
                     "openrlhf.trainer.ray.ppo_actor")
_ORIGINALS: dict = {}


def _maker(cls):
    if cls is None:
        from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker as cls
    return cls


def _modules(cls):
    """The loaded modules that hold OpenRLHF's functions: `cls`'s own and `_FUNCTION_MODULES`."""
    import sys
    names = dict.fromkeys((cls.__module__,) + _FUNCTION_MODULES)
    return [sys.modules[n] for n in names if n in sys.modules]


def use_rl_triton(cls=None) -> None:
    """Replace `get_advantages_and_returns` and `get_cumulative_returns` on OpenRLHF's
    `RemoteExperienceMaker` (or on `cls`), and `compute_approx_kl` and `PolicyLoss` in the
    OpenRLHF modules that hold them. Idempotent."""
    cls = _maker(cls)
    for name, ours in METHODS:
        _ORIGINALS.setdefault((cls, name), cls.__dict__[name])
        setattr(cls, name, ours)
    for module in _modules(cls):
        for name, ours in FUNCTIONS:
            if name in vars(module):
                _ORIGINALS.setdefault((module, name), vars(module)[name])
                setattr(module, name, ours)


def revert_rl_triton(cls=None) -> None:
    """Undo `use_rl_triton`: OpenRLHF's own methods and functions back, in every loaded OpenRLHF
    module that holds one of ours too (`openrlhf.trainer.ray.ppo_actor` imports `PolicyLoss` and
    `compute_approx_kl` by name, often after the switch)."""
    cls = _maker(cls)
    for name, _ in METHODS:
        if (cls, name) in _ORIGINALS:
            setattr(cls, name, _ORIGINALS.pop((cls, name)))
    originals = {}
    for module in _modules(cls):
        for name, ours in FUNCTIONS:
            if (module, name) in _ORIGINALS:
                original = _ORIGINALS.pop((module, name))
                setattr(module, name, original)
                originals.setdefault(id(ours), (ours, original))
    _put_back(cls.__module__.split(".")[0], originals)
