"""rl_triton: fused GPU kernels for reinforcement-learning credit assignment.

Every estimator is one first-order linear recurrence `A[t] = alpha[t] + beta[t] * A[t+1]`,
evaluated as one associative scan (`rl_triton.scan`); each op is defined in one file of
`rl_triton.ops`, and `rl_triton.reference` holds the sequential definitions. Every function
checks its arguments on every call, picks a backend and returns new tensors in the caller's
layout (time axis `time_dim`), float32 unless `out_dtype` says otherwise. Inputs are never
written. The losses (`ppo_policy_loss`, `value_loss`, `kl_penalty`, `sac_targets`,
`crr_weights`) have no time axis: per-position formulas and their aggregation over a mask, one
fused kernel each way on CUDA (`rl_triton.ops._losses`). The fused loss head (`token_log_probs`,
`linear_policy_loss`) computes log-probabilities and a policy loss from hidden states and the LM
head chunk by chunk, never holding the [tokens, vocabulary] logits (`rl_triton.ops.loss_head`). What every op computes, boundaries,
masks, packing and non-finite input included, is docs/semantics.md; comments cite its sections
as "semantics §N".

Common arguments
----------------
time_dim : int, default 0
    The time axis of the per-step tensors (`[T, N]` time-major with 0, `[N, T]` batch-major with 1
    or -1). Any number of batch axes is allowed; any strides are read in place.
terminated, truncated : bool / integer / float tensors
    `terminated[t]`: the episode ended at step t in a terminal state: no value after it.
    `truncated[t]`: the episode was cut after step t (time limit) although s_{t+1} is not
    terminal: the successor value is used, and the trace is cut. `truncated=None` means none.
last_value, next_values
    The successor value v'[t] of step t is `next_values[t]` when `next_values` is given (same
    shape as `values`), else `values[t+1]`, and `last_value` (shape: `values` without the time
    axis) at t = T-1. Value-based estimators refuse to run without either.
backend : "auto" | "triton" | "torch" | "loop"
    "auto" runs the Triton kernels on CUDA tensors and the vectorized torch backend elsewhere;
    "loop" is the plain sequential loop of `rl_triton.reference` (slow, obviously correct).

Autoreset conventions
---------------------
Next-step autoreset (Gymnasium >= 1.0 default, EnvPool): the slot after a done step holds the
final observation of the episode, so `values[t+1]` already is the right bootstrap at a truncation;
pass `last_value` only. The slot after that is the reset transition: not a real transition, the
trainer masks it out of its loss (its advantage is computed but meaningless).

Same-step autoreset (Gymnasium < 1.0, Stable-Baselines3): the slot after a done step already holds
the next episode's first observation. Pass `next_values`: `values[t+1]` everywhere, except the
value of the final observation (`info["final_observation"]`) at truncated steps::

    next_values = torch.cat([values[1:], last_value[None]])
    next_values[truncated] = final_obs_values[truncated]
    adv, ret = rl_triton.gae(rewards, values, terminated, truncated, next_values=next_values)
"""
from .ops.discounted_returns import discounted_returns
from .ops.forward_scans import eligibility_traces, episodic_cumsum
from .ops.crr_weights import crr_weights
from .ops.gae import gae
from .ops.kl_penalty import kl_penalty
from .ops.lambda_returns import lambda_returns
from .ops.loss_head import linear_policy_loss, token_log_probs
from .ops.linear_scan import linear_scan
from .ops.outcome import group_advantages, masked_whiten
from .ops.policy_loss import policy_loss
from .ops.ppo_policy_loss import ppo_policy_loss
from .ops.retrace import retrace
from .ops.rollout_correction import rollout_correction
from .ops.sac_targets import sac_targets
from .ops.value_loss import value_loss
from .ops.vtrace import vtrace

__version__ = "0.1.0"

__all__ = ["linear_scan", "gae", "lambda_returns", "discounted_returns", "vtrace", "retrace",
           "eligibility_traces", "episodic_cumsum", "group_advantages", "masked_whiten",
           "ppo_policy_loss", "policy_loss", "value_loss", "kl_penalty", "sac_targets",
           "crr_weights", "token_log_probs", "linear_policy_loss", "rollout_correction"]
