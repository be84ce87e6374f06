"""gymnax (JAX) environments as the trainers' vector environment: `--env-backend gymnax`.

N copies of one gymnax environment step under a single jax.jit(jax.vmap(...)) on the trainer's
device. Observations, rewards and flags reach torch through DLPack and actions reach JAX the same
way, so on a GPU the rollout never copies to the host (on CPU it shares JAX's CPU buffers).

gymnax's own `Environment.step` resets in the step that ends an episode (the final observation
only in its info dict). The trainers use next-step autoreset (docs/trainers.md), so this module
steps with `step_env`, `is_truncated` and `reset_env` and resets on the following step itself:
the step after a done ignores its action and returns the first observation of the next episode
with reward 0 and both flags False; the step that ends an episode returns its final observation,
with terminations and truncations kept apart.

The trainers import this module only for `--env-backend gymnax` (`python trainers/ppo.py` has
trainers/ on sys.path); it needs the `gymnax` extra (pyproject.toml, docs/trainers.md).
"""
import os

# JAX claims 75% of a GPU's memory when it starts; torch holds the agent on the same GPU
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import gymnasium as gym
import gymnax
import jax
import jax.numpy as jnp
import torch
from gymnax.environments.spaces import gymnax_space_to_gym_space


def jax_device(device):
    """The JAX device whose memory is the torch device's, so that DLPack shares buffers."""
    device = torch.device(device)
    if device.type == "cuda":
        return jax.devices("cuda")[torch.cuda.current_device() if device.index is None else device.index]
    return jax.devices("cpu")[0]


class GymnaxVectorEnv:
    """`num_envs` copies of the gymnax environment `env_id` (a gymnax registry id such as
    "CartPole-v1" or "Breakout-MinAtar"); `params` override fields of its default EnvParams
    (e.g. max_steps_in_episode). step() and reset() return torch tensors on `device`."""

    def __init__(self, env_id, num_envs, device="cpu", **params):
        self.env, default_params = gymnax.make(env_id)
        self.params = default_params.replace(**params)
        self.num_envs = num_envs
        self.device = jax_device(device)
        obs_space = self.env.observation_space(self.params)
        self.single_observation_space = gymnax_space_to_gym_space(obs_space)
        self.single_action_space = gymnax_space_to_gym_space(self.env.action_space(self.params))
        self.obs_dtype = obs_space.dtype  # MinAtar's grids are bool arrays in a float32 Box
        discrete = isinstance(self.single_action_space, gym.spaces.Discrete)
        self.action_dtype = torch.int32 if discrete else torch.float32  # JAX's dtypes without x64
        self._reset = jax.jit(jax.vmap(self._reset_one))
        self._step = jax.jit(jax.vmap(self._step_one))
        self._carry = None

    def _reset_one(self, key):
        key, reset_key = jax.random.split(key)
        obs, state = self.env.reset_env(reset_key, self.params)
        return (key, state, jnp.bool_(False)), obs.astype(self.obs_dtype)

    def _step_one(self, carry, action):
        key, state, done = carry  # done: the previous step ended the episode
        key, step_key, reset_key = jax.random.split(key, 3)
        obs, next_state, reward, terminated, _ = self.env.step_env(step_key, state, action, self.params)
        truncated = self.env.is_truncated(next_state, self.params)
        reset_obs, reset_state = self.env.reset_env(reset_key, self.params)
        # after a done: the reset transition (next-step autoreset); both branches were computed,
        # as in gymnax's own step, and one is selected per environment
        obs, next_state = jax.tree.map(lambda reset, stepped: jnp.where(done, reset, stepped),
                                       (reset_obs, reset_state), (obs, next_state))
        reward = jnp.where(done, 0.0, reward).astype(jnp.float32)
        terminated = jnp.logical_and(terminated, ~done)
        truncated = jnp.logical_and(truncated, ~done)
        return ((key, next_state, terminated | truncated),
                (obs.astype(self.obs_dtype), reward, terminated, truncated))

    def reset(self, seed=0, options=None):
        keys = jax.device_put(jax.random.split(jax.random.key(seed), self.num_envs), self.device)
        self._carry, obs = self._reset(keys)
        return torch.from_dlpack(obs), {}

    def step(self, actions):
        # int64 (torch's categorical samples) would be copied by JAX to int32: cast in torch first
        actions = torch.as_tensor(actions).to(self.action_dtype).contiguous()
        actions = jax.device_put(jax.dlpack.from_dlpack(actions), self.device)  # numpy: host
        self._carry, out = self._step(self._carry, actions)
        obs, reward, terminated, truncated = (torch.from_dlpack(x) for x in out)
        return obs, reward, terminated, truncated, {}

    def close(self):
        self._carry = None
