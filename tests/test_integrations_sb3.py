"""Stable-Baselines3 integration: rl_triton's GAE inside SB3's PPO / A2C equals SB3's own."""
import copy
from pathlib import Path


import numpy as np
import pytest

pytest.importorskip("stable_baselines3")
import gymnasium as gym  # noqa: E402
from stable_baselines3 import A2C, PPO  # noqa: E402
from stable_baselines3.common.buffers import DictRolloutBuffer, RolloutBuffer  # noqa: E402
from stable_baselines3.common.env_util import make_vec_env  # noqa: E402

from rl_triton.integrations.sb3 import (  # noqa: E402
    RLTritonDictRolloutBuffer, RLTritonRolloutBuffer, revert_rl_triton, use_rl_triton)
from cases import subprocess_env  # noqa: E402

def _short_cartpole(n_envs=3, seed=0):
    # a 25-step time limit: truncations (bootstrapped through the reward by SB3) in every rollout
    return make_vec_env("CartPole-v1", n_envs=n_envs, seed=seed,
                        env_kwargs={"max_episode_steps": 25})


_calls = []


def _checked_compute(self, last_values, dones):
    """Computes SB3's own GAE on a copy of the real rollout, then ours, and records both."""
    theirs = copy.deepcopy(self)
    RolloutBuffer.compute_returns_and_advantage(theirs, last_values, dones)
    super(type(self), self).compute_returns_and_advantage(last_values, dones)
    _calls.append((self.advantages.copy(), theirs.advantages, self.returns.copy(), theirs.returns,
                   self.episode_starts.copy(), np.asarray(dones)))


def _checked(cls):
    return type("Checked" + cls.__name__, (cls,),
                {"compute_returns_and_advantage": _checked_compute})


_Checked = _checked(RLTritonRolloutBuffer)


def _check_calls(min_calls):
    calls = _calls[:]
    _calls.clear()
    assert len(calls) >= min_calls
    saw_done = False
    for adv, ref_adv, ret, ref_ret, starts, dones in calls:
        assert adv.dtype == np.float32 and ret.dtype == np.float32
        assert adv.shape == ref_adv.shape
        np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ret, ref_ret, rtol=1e-5, atol=1e-5)
        saw_done |= bool(starts[1:].any() or dones.any())
    assert saw_done  # the rollouts crossed episode ends


@pytest.mark.parametrize("algo", [PPO, A2C])
def test_equals_sb3_on_real_rollouts_and_trains(algo):
    n_steps = 64 if algo is PPO else 40
    extra = {"n_epochs": 2, "batch_size": 64} if algo is PPO else {}
    model = algo("MlpPolicy", _short_cartpole(), n_steps=n_steps, seed=0, device="cpu",
                 rollout_buffer_class=_Checked, policy_kwargs={"net_arch": [16]}, **extra)
    model.learn(total_timesteps=3 * n_steps * 3)  # 3 rollouts of 3 envs, each followed by training
    _check_calls(min_calls=3)


def test_triton_backend(device):
    """The kernels (on the GPU, or in Triton's interpreter) behind SB3's rollout buffer."""
    model = PPO("MlpPolicy", _short_cartpole(n_envs=2), n_steps=32, batch_size=32, n_epochs=1,
                seed=1, device=device, rollout_buffer_class=_Checked,
                rollout_buffer_kwargs={"backend": "triton"}, policy_kwargs={"net_arch": [8]})
    assert model.rollout_buffer.backend == "triton"
    model.learn(total_timesteps=128)
    _check_calls(min_calls=2)


def test_helper_on_existing_model_and_revert():
    model = PPO("MlpPolicy", _short_cartpole(n_envs=2), n_steps=32, batch_size=32, n_epochs=1,
                seed=0, device="cpu", policy_kwargs={"net_arch": [8]})
    assert type(model.rollout_buffer) is RolloutBuffer
    assert use_rl_triton(model, backend="torch") is model
    buf = model.rollout_buffer
    assert type(buf) is RLTritonRolloutBuffer and buf.backend == "torch"
    assert (buf.buffer_size, buf.n_envs, buf.gamma, buf.gae_lambda) == (32, 2, model.gamma,
                                                                       model.gae_lambda)
    assert model.rollout_buffer_class is RLTritonRolloutBuffer
    buf.__class__ = _checked(RLTritonRolloutBuffer)
    model.learn(total_timesteps=128)
    _check_calls(min_calls=2)
    buf.__class__ = RLTritonRolloutBuffer
    use_rl_triton(model)  # again: only the backend changes
    assert model.rollout_buffer is buf and buf.backend == "auto"
    revert_rl_triton(model)
    assert type(model.rollout_buffer) is RolloutBuffer
    assert model.rollout_buffer_class is RolloutBuffer
    assert "backend" not in model.rollout_buffer_kwargs
    with pytest.raises(ValueError, match="backend"):
        use_rl_triton(model, backend="cuda")
    with pytest.raises(TypeError, match="RLTritonGAEMixin"):
        model.rollout_buffer = type("Custom", (RolloutBuffer,), {})(
            4, model.observation_space, model.action_space, n_envs=2)
        use_rl_triton(model)


def test_dict_observations():
    class DictObs(gym.ObservationWrapper):
        def __init__(self, env):
            super().__init__(env)
            self.observation_space = gym.spaces.Dict({"state": env.observation_space})

        def observation(self, obs):
            return {"state": obs}

    env = make_vec_env("CartPole-v1", n_envs=2, seed=0, wrapper_class=DictObs,
                       env_kwargs={"max_episode_steps": 10})
    model = PPO("MultiInputPolicy", env, n_steps=16, batch_size=16, n_epochs=1, seed=0,
                device="cpu", policy_kwargs={"net_arch": [8]})
    assert type(model.rollout_buffer) is DictRolloutBuffer
    use_rl_triton(model)
    assert type(model.rollout_buffer) is RLTritonDictRolloutBuffer
    model.rollout_buffer.__class__ = _checked(RLTritonDictRolloutBuffer)
    model.learn(total_timesteps=64)
    _check_calls(min_calls=2)


def test_import_rl_triton_does_not_import_frameworks():
    import subprocess
    import sys
    code = ("import sys, rl_triton, rl_triton.integrations; "
            "bad = [m for m in ('stable_baselines3', 'torchrl', 'tensordict', 'gymnasium') "
            "if m in sys.modules]; assert not bad, bad")
    root = str(Path(__file__).resolve().parent.parent)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env=subprocess_env())
