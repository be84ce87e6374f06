"""What the benchmark times: the estimators and shapes of its grid, their inputs at the public
functions' defaults, their output counts and minimal bytes, and the calls of the other suites
(token rows, the frameworks' loops, the losses, the host path).

The op registry (`rl_triton._core.op.OPS`, `ops("scan")`) gives the estimators, their outputs
and their scalars;
the public functions' signatures give the defaults; `rl_triton.testing` gives the inputs. What
none of them says is kept here, each with why.
"""
from __future__ import annotations

import functools
import inspect

import torch

import rl_triton
from rl_triton import testing
from rl_triton._core.op import OPS, ops


def _has_rollout_inputs(name: str) -> bool:
    try:
        testing.make_inputs(name, 2, (1,))
    except ValueError:
        return False
    return True


# the registry's public ops that take a rollout (`testing.make_inputs` makes their [T, N] steps),
# in the API's order; linear_scan takes the recurrence's coefficients, not a rollout
ESTIMATORS = [name for name in ops("scan")
              if name != "linear_scan" and _has_rollout_inputs(name)]
SHAPES = ["16384x16", "4096x128", "16384x1024", "128x128", "1024x1024", "512x4096",
          "64x32768", "16x131072", "4x1048576"]
LAYOUTS = ["time-major", "batch-major"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
N_ACTIONS = 18  # Atari
LOOP_MAX_T = 4096  # the sequential loop baseline is timed up to this many steps


def parse_shape(s):
    n, t = s.lower().split("x")
    return int(n), int(t)


# ---- the estimators' calls ---------------------------------------------------------------------

@functools.cache
def public_defaults(name: str) -> dict:
    """The defaults of `rl_triton.<name>`'s scalars and options (the op's `scalars` and
    `extras`): the benchmark times the calls users make. A scalar the function leaves to the
    caller (eligibility traces' gamma and lam) takes GAE's default; an option the function
    derives itself (discounted_returns' `carry_last`) is not the caller's, and not here."""
    op = OPS[name]
    params = inspect.signature(getattr(rl_triton, name)).parameters
    out = {}
    for field in op.scalars._fields + (op.extras._fields if op.extras is not None else ()):
        if field not in params:
            continue
        default = params[field].default
        out[field] = (public_defaults("gae")[field] if default is inspect.Parameter.empty
                      else default)
    return out


def make_inputs(name, N, T, layout, dtype, truncation, device, seed=0, flag_dtype=torch.bool):
    """Keyword arguments of `rl_triton.<name>` for an N x T problem (`rl_triton.testing`'s
    inputs: flags of `flag_dtype` set at 1% of steps, 18 actions, the functions' default
    scalars and options), and the minimal bytes."""
    defaults = public_defaults(name)
    op = OPS[name]
    steps, extra = testing.make_inputs(name, T, (N,), dtype=dtype, flag_dtype=flag_dtype,
                                       trunc=truncation, device=device, seed=seed,
                                       n_act=N_ACTIONS, p_term=0.01, p_trunc=0.01,
                                       params={f: defaults[f] for f in op.scalars._fields})
    # the options testing sets (Retrace's return_advantages) at the function's defaults
    extra.update({k: v for k, v in defaults.items() if k in extra})
    tm = layout == "time-major"
    kw = {k: v if tm or v is None else v.movedim(0, 1).contiguous() for k, v in steps.items()}
    kw.update(extra, time_dim=0 if tm else 1)
    tensors = [v for v in kw.values() if isinstance(v, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors) + n_out(name, kw) * N * T * 4
    return kw, nbytes


def n_out(name: str, kw: dict) -> int:
    """The outputs of the call `rl_triton.<name>(**kw)` (the registry's `Op.n_out` of its
    options)."""
    op = OPS[name]
    if op.extras is None:
        return op.outputs
    defaults = public_defaults(name)
    return op.n_out(op.extras(**{f: kw.get(f, defaults.get(f)) for f in op.extras._fields}))


def is_bootstrap(name: str) -> bool:
    """Whether an input has no time axis (`last_*`, `initial`), as `rl_triton._core.scan.ScanOp`
    reads the fields of an op's inputs."""
    return name.startswith(("last_", "initial"))


# what each backward reads besides the output gradients and flags (its formula, semantics §6,
# which the registry does not describe): inputs, and how many of the op's outputs it saves
BWD_READS = {"vtrace": (("rewards", "values", "target_log_probs", "behavior_log_probs",
                         "last_value"), 1),
             "retrace": (("q_values", "target_probs", "behavior_probs", "last_q_values",
                          "last_target_probs"), 1)}


def bwd_bytes(name, kw, leaves) -> int:
    """The backward's minimal bytes: output gradients (float32) and flags (every input that is
    not floating: flags, actions) read, the inputs its formula reads (`BWD_READS`) and its
    saved outputs, every input gradient written."""
    reads, saved = BWD_READS.get(name, ((), 0))
    ref = next(v for k, v in kw.items() if k in ("rewards", "x"))
    n = ref.numel()
    total = (n_out(name, kw) + saved) * n * 4
    for k, v in kw.items():
        if isinstance(v, torch.Tensor) and (not v.is_floating_point() or k in reads):
            total += v.numel() * v.element_size()
    return total + sum(t.numel() * t.element_size() for t in leaves)


# ---- the token-level suite (--suite tokens) ----------------------------------------------------

TOKEN_SHAPES = ["256x1024", "512x4096", "128x16384", "32x131072"]
# outcome rewards end each response: gamma 1 and verl's lam, as the LLM trainers call them
TOKEN_PARAMS = {"gae": dict(gamma=1.0, lam=0.95), "discounted_returns": dict(gamma=1.0)}
# the frameworks' own token loops, by function: (framework, the rl_triton estimator it computes)
FRAMEWORK_CALLS = {"compute_gae_advantage_return": ("verl", "gae"),
                   "compute_reinforce_plus_plus_outcome_advantage": ("verl", "discounted_returns"),
                   "get_advantages_and_returns": ("openrlhf", "gae"),
                   "get_cumulative_returns": ("openrlhf", "discounted_returns")}
FRAMEWORK_CALLS_TIMED = 3  # after one warm-up: at T = 131072 one call takes seconds
# the suite's other cells, compiles included, take 2-3 minutes on the H200: ~5 minutes in all
FRAMEWORKS_MAX_SECONDS = 120.0
GROUPS = (65536, 8192)  # group_advantages: scores, groups


# ---- the losses suite (--suite losses) ---------------------------------------------------------

LOSS_TOKENS = [2**20, 2**22, 2**24]
LOSS_T = 1024  # tokens per row of the [B, T] losses (PPO, value, KL)
SAC_CRITICS = 2  # twin target critics
CRR_SAMPLES = 4  # actions sampled from the policy per state (CRR's m)
# (loss, variant, options beyond the inputs, modes timed): SAC's targets are differentiable
# (semantics §9) but usually computed under no_grad, so both; CRR's weights have no gradient
LOSS_CASES = [
    ("ppo_policy_loss", "mask", {}, ("fwd+bwd",)),
    ("ppo_policy_loss", "mask, dual_clip=3", dict(dual_clip=3.0), ("fwd+bwd",)),
    ("value_loss", "mask, clip=0.2", dict(clip=0.2), ("fwd+bwd",)),
    ("kl_penalty", "k3, clamp=10", dict(clamp=10.0), ("fwd+bwd",)),
    ("sac_targets", "continuous K=2", {}, ("fwd", "fwd+bwd")),
    ("sac_targets", "discrete A=18 K=2", {}, ("fwd", "fwd+bwd")),
    ("crr_weights", "exp J=4", {}, ("fwd",)),
]
# eager and compile against rl_triton: outputs are float32 sums in another order; a gradient
# jumps where a ratio lands on the other side of a clip (tl.exp and torch.exp differ by ulps),
# by about 4e-4 of the norm per such position at 2^24 tokens; a wrong branch gives far more
LOSS_OUTPUT_TOL, LOSS_GRAD_TOL = 1e-4, 1e-2


# ---- the host-path suite (--suite host) --------------------------------------------------------

HOST_SHAPES = ["16384x16", "4096x128", "128x128", "1024x1024"]
FLAG_DTYPES = {"bool": torch.bool, "float": torch.float32}
HOST_OTHERS_SHAPE = "4096x128"  # Retrace, group advantages, whitening and the losses
# the LLM zoo's ops (semantics §10) in the host suite after the losses, on the PPO case's rows:
# (op, variant, options)
HOST_ZOO = [("policy_loss", "vanilla, mask, dual_clip=3", dict(dual_clip=3.0)),
            ("rollout_correction", "geometric mask", dict(level="geometric", mode="mask",
                                                          low=0.5, high=2.0))]
