"""OpenRLHF integration: its GAE and cumulative returns, one rl_triton call each.

OpenRLHF (checked against 0.11.2, `openrlhf/trainer/ppo_utils/experience_maker.py`) computes them
in `RemoteExperienceMaker` with a Python loop over the response's tokens; these functions have the
methods' signatures (`self` first) and outputs::

    from rl_triton.integrations.openrlhf import use_rl_triton
    use_rl_triton()          # RemoteExperienceMaker's methods are now these; revert_rl_triton() undoes it

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

__all__ = ["get_advantages_and_returns", "get_cumulative_returns", "use_rl_triton",
           "revert_rl_triton"]

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


_ORIGINALS: dict = {}


def _maker(cls):
    if cls is None:
        from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker as cls
    return cls


def use_rl_triton(cls=None) -> None:
    """Replace `get_advantages_and_returns` and `get_cumulative_returns` on OpenRLHF's
    `RemoteExperienceMaker` (or on `cls`). Idempotent."""
    cls = _maker(cls)
    for fn in (get_advantages_and_returns, get_cumulative_returns):
        _ORIGINALS.setdefault((cls, fn.__name__), cls.__dict__[fn.__name__])
        setattr(cls, fn.__name__, fn)


def revert_rl_triton(cls=None) -> None:
    """Undo `use_rl_triton`: OpenRLHF's own methods back on the class."""
    cls = _maker(cls)
    for name in ("get_advantages_and_returns", "get_cumulative_returns"):
        if (cls, name) in _ORIGINALS:
            setattr(cls, name, _ORIGINALS.pop((cls, name)))
