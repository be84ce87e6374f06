"""Stable-Baselines3 integration: GAE with rl_triton inside SB3's on-policy algorithms.

Through SB3's own extension point (PPO and A2C)::

    from stable_baselines3 import PPO
    from rl_triton.integrations.sb3 import RLTritonRolloutBuffer

    model = PPO("MlpPolicy", "CartPole-v1", rollout_buffer_class=RLTritonRolloutBuffer)

or, for a model that already exists (also one loaded from disk)::

    from rl_triton.integrations.sb3 import use_rl_triton
    use_rl_triton(model)          # revert_rl_triton(model) puts SB3's own buffer back

Semantics are SB3's, unchanged: `episode_starts[t + 1]` (and `dones` after the last step) ends
step t, every done cuts the trace and drops the bootstrap, and truncations are handled where SB3
handles them, in `collect_rollouts`, which adds `gamma * V(terminal_observation)` to the reward of
a truncated step (same-step autoreset). Advantages and returns equal
`RolloutBuffer.compute_returns_and_advantage` to float32 rounding.

The GAE runs on the buffer's device (the model's): the Triton kernels on CUDA, the vectorized
torch backend on CPU (`backend="auto"`); pass `rollout_buffer_kwargs={"backend": ...}` to choose.
Importing this module imports Stable-Baselines3; `import rl_triton` does not.
"""
from __future__ import annotations

import numpy as np
import torch
from stable_baselines3.common.buffers import DictRolloutBuffer, RolloutBuffer

import rl_triton
from .._args import check_backend

__all__ = ["RLTritonGAEMixin", "RLTritonRolloutBuffer", "RLTritonDictRolloutBuffer",
           "use_rl_triton", "revert_rl_triton"]


class RLTritonGAEMixin:
    """Replaces `compute_returns_and_advantage` of an SB3 `RolloutBuffer` (sub)class with one
    `rl_triton.gae` call. Put it first in the bases of your own buffer class:
    `class MyBuffer(RLTritonGAEMixin, MyRolloutBuffer)`.
    """

    backend: str = "auto"

    def compute_returns_and_advantage(self, last_values: torch.Tensor, dones: np.ndarray) -> None:
        device = self.device
        rewards = torch.from_numpy(self.rewards).to(device)
        values = torch.from_numpy(self.values).to(device)
        # episode_starts[t + 1] says that step t ended an episode (SB3 treats every done alike)
        last_done = torch.as_tensor(np.asarray(dones, dtype=np.float32).reshape(1, -1),
                                    device=device)
        terminated = torch.cat([torch.from_numpy(self.episode_starts[1:]).to(device), last_done])
        last_value = last_values.detach().reshape(-1).to(device=device, dtype=torch.float32)
        advantages, returns = rl_triton.gae(rewards, values, terminated, last_value=last_value,
                                             gamma=self.gamma, lam=self.gae_lambda,
                                             backend=self.backend)
        self.advantages = advantages.cpu().numpy()
        self.returns = returns.cpu().numpy()


class RLTritonRolloutBuffer(RLTritonGAEMixin, RolloutBuffer):
    """SB3's `RolloutBuffer` with GAE computed by `rl_triton.gae`. Use it as
    `PPO(..., rollout_buffer_class=RLTritonRolloutBuffer)` (or A2C); `backend` ("auto", "triton",
    "torch", "loop") comes through `rollout_buffer_kwargs`.
    """

    def __init__(self, *args, backend: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        self.backend = backend


class RLTritonDictRolloutBuffer(RLTritonGAEMixin, DictRolloutBuffer):
    """SB3's `DictRolloutBuffer` (dict observation spaces) with GAE computed by `rl_triton.gae`."""

    def __init__(self, *args, backend: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        self.backend = backend


_SWAP = {RolloutBuffer: RLTritonRolloutBuffer, DictRolloutBuffer: RLTritonDictRolloutBuffer}
_UNSWAP = {new: old for old, new in _SWAP.items()}


def _rebuild(model, cls, kwargs):
    old = model.rollout_buffer
    model.rollout_buffer_class = cls
    model.rollout_buffer_kwargs = kwargs
    model.rollout_buffer = cls(old.buffer_size, old.observation_space, old.action_space,
                               device=old.device, gae_lambda=old.gae_lambda, gamma=old.gamma,
                               n_envs=old.n_envs, **kwargs)


def use_rl_triton(model, *, backend: str = "auto"):
    """Make an existing SB3 on-policy model (PPO, A2C, ...) compute GAE with rl_triton.

    Replaces `model.rollout_buffer` (refilled at every rollout anyway) with the rl_triton version
    of its class and records it in `model.rollout_buffer_class`, so later set-ups keep it. Returns
    the model. `revert_rl_triton(model)` undoes it. A custom buffer class is refused: derive it
    from `RLTritonGAEMixin` instead.
    """
    buffer = getattr(model, "rollout_buffer", None)
    if not isinstance(buffer, RolloutBuffer):
        raise TypeError(f"use_rl_triton needs an SB3 on-policy model with a RolloutBuffer (PPO, "
                        f"A2C); {type(model).__name__} has {type(buffer).__name__}")
    check_backend(backend)  # reject a bad name before touching the model
    kwargs = {k: v for k, v in model.rollout_buffer_kwargs.items() if k != "backend"}
    cls = type(buffer)
    if isinstance(buffer, RLTritonGAEMixin):
        buffer.backend = backend
        if cls in _UNSWAP:
            model.rollout_buffer_kwargs = {**kwargs, "backend": backend}
        return model
    if cls not in _SWAP:
        raise TypeError(f"use_rl_triton knows SB3's RolloutBuffer and DictRolloutBuffer, not "
                        f"{cls.__name__}: define class X(RLTritonGAEMixin, {cls.__name__}) and "
                        f"pass rollout_buffer_class=X")
    _rebuild(model, _SWAP[cls], {**kwargs, "backend": backend})
    return model


def revert_rl_triton(model):
    """Undo `use_rl_triton`: give the model SB3's own rollout buffer class back. Returns it."""
    cls = type(model.rollout_buffer)
    if cls in _UNSWAP:
        kwargs = {k: v for k, v in model.rollout_buffer_kwargs.items() if k != "backend"}
        _rebuild(model, _UNSWAP[cls], kwargs)
    return model
