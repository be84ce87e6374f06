"""Drop-in integrations with existing trainers.

- `rl_triton.integrations.sb3`: Stable-Baselines3 rollout buffers that compute GAE with
  `rl_triton.gae` (`PPO(..., rollout_buffer_class=RLTritonRolloutBuffer)`, `use_rl_triton(model)`).
- `rl_triton.integrations.torchrl`: TorchRL value estimators (GAE, TD(lambda), V-trace) that a
  TorchRL loss module takes in place of its own.
- `rl_triton.integrations.verl`: verl's advantage estimators (GAE, GRPO, RLOO, REINFORCE++),
  same signatures and outputs; `use_rl_triton()` patches verl's `core_algos`.
- `rl_triton.integrations.openrlhf`: OpenRLHF's `get_advantages_and_returns` and
  `get_cumulative_returns`; `use_rl_triton()` patches `RemoteExperienceMaker`.
- CleanRL: patches for the single-file scripts live in the repository's `patches/cleanrl/`.

Each submodule imports its framework when it is itself imported; `import rl_triton` and
`import rl_triton.integrations` never import Stable-Baselines3, TorchRL, verl or OpenRLHF.
"""
