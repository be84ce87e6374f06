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
from .verl import _no_flags

__all__ = ["get_advantages_and_returns", "get_cumulative_returns", "compute_approx_kl",
           "use_rl_triton", "revert_rl_triton"]

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


# The switch: RemoteExperienceMaker's methods (name, ours), and module functions (name, ours)
# replaced in every loaded OpenRLHF module that imported them by name
METHODS = [("get_advantages_and_returns", get_advantages_and_returns),
           ("get_cumulative_returns", get_cumulative_returns)]
FUNCTIONS = [("compute_approx_kl", compute_approx_kl)]
_FUNCTION_MODULES = ("openrlhf.models.utils", "openrlhf.trainer.ppo_utils.experience_maker",
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
    `RemoteExperienceMaker` (or on `cls`), and `compute_approx_kl` in the OpenRLHF modules that
    use it. Idempotent."""
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
    """Undo `use_rl_triton`: OpenRLHF's own methods and functions back."""
    cls = _maker(cls)
    for name, _ in METHODS:
        if (cls, name) in _ORIGINALS:
            setattr(cls, name, _ORIGINALS.pop((cls, name)))
    for module in _modules(cls):
        for name, _ in FUNCTIONS:
            if (module, name) in _ORIGINALS:
                setattr(module, name, _ORIGINALS.pop((module, name)))
