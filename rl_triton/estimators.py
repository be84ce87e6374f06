"""The public estimators.

Every function here checks its arguments through `rl_triton._args`, picks a backend and returns
new tensors in the caller's layout (time axis `time_dim`), float32 unless `out_dtype` says
otherwise. Inputs are never written.

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
from __future__ import annotations

import os

import torch

from . import _torch, reference
from ._args import FLAG, INDEX, Call, check_backend, check_out_dtype, check_scalar

_LOOP_DTYPE = torch.float32


def _backend(name, call: Call) -> str:
    backend = check_backend(name, call.device)
    if backend == "triton" and call.device.type == "cpu" and os.environ.get(
            "TRITON_INTERPRET") != "1":
        raise ValueError("backend='triton' on CPU tensors runs Triton's interpreter: set "
                         "TRITON_INTERPRET=1 before triton is imported, or use backend='torch'")
    return backend


def _triton_ops():
    from ._triton import ops  # imported on first use: the torch backend needs no Triton
    return ops


# Launch plans of earlier Triton calls, by signature: every tensor's shape, strides, dtype,
# device and 16-byte alignment (the compiled kernel's specialization), and the options. A call
# with a known signature passed the same argument checks before, so it goes straight to the
# launch (host work: a dict look-up, the output allocations, the kernel launch). The custom ops
# that torch.compile calls keep their plans here too (keys starting with "op:").
class _PlanCache(dict):
    def clear(self):
        super().clear()
        _FAST.clear()


_PLANS: dict = _PlanCache()
_MAX_PLANS = 4096
# The same plans by (name, options), for the C++ host path (rl_triton/_triton/host.py): a
# function of (tensors, scalars) that finds the plan of the tensors' signature and runs it, or
# returns None (no such plan, or launch hooks installed). Cleared with _PLANS.
_FAST: dict = {}


def _signature(name, tensors, options):
    try:
        return (name, options) + tuple(None if t is None else (
            t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0) for t in tensors)
    except AttributeError:  # not a tensor: the checks will say so
        return None


def _cached(name, tensors, options, scalars):
    if torch.compiler.is_compiling():
        return None
    try:
        fast = _FAST.get((name, options))
        if fast is not None:
            outs = fast(tensors, scalars)
            if outs is not None:
                return outs
        plan = _PLANS.get(_signature(name, tensors, options))
    except TypeError:  # an unhashable option: the checks will say what is wrong with it
        return None
    return None if plan is None else plan.run(tensors, scalars)


def _triton(name, tensors, options, scalars, make_plan, op_args):
    """Run a checked call on the Triton backend: a custom op inside torch.compile, else a
    launch plan (cached under the call's signature when it reads the tensors in place)."""
    ops = _triton_ops()
    if torch.compiler.is_compiling():
        out = ops.OPS[name](*op_args)
        return list(out) if isinstance(out, tuple) else [out]
    return _plan_and_run(name, tensors, options, scalars, lambda ts: make_plan(ops))


def _plan_and_run(name, tensors, options, scalars, build):
    """Build the plan for a call that missed the cache, keep it when it reads the tensors in
    place (`build` returns (plan, copy); copy is None then), and run it."""
    plan, copy = build(tensors)
    if copy is not None:
        return plan.run(copy(tensors), scalars)
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[_signature(name, tensors, options)] = plan
    outs = plan.run(tensors, scalars)
    _triton_ops().index_plan(_FAST, (name, options), tensors, plan, len(scalars))
    return outs


def _one_or_tuple(outs):
    return outs[0] if len(outs) == 1 else tuple(outs)


def _python(backend: str, name: str):
    """The torch or loop implementation of estimator `name`."""
    if backend == "torch":
        return getattr(_torch, name)
    fn = getattr(reference, name)
    return lambda *a, **k: fn(*a, dtype=_LOOP_DTYPE, **k)


def _finish(call: Call, out_dtype, *results, trailing_shape=()):
    """Copy time-major results into new tensors in the caller's layout."""
    outs = []
    for res in results:
        out, view = call.output(out_dtype, trailing_shape)
        view.copy_(res)
        outs.append(out)
    return _one_or_tuple(outs)


def _empty(call: Call, out_dtype, n: int, trailing_shape=()):
    return _one_or_tuple([call.output(out_dtype, trailing_shape)[0] for _ in range(n)])


def _value_args(call: Call, rewards, values, terminated, truncated, last_value, next_values, *,
                values_optional=False):
    r = call.step("rewards", rewards)
    v = call.step("values", values, optional=values_optional)
    term = call.step("terminated", terminated, FLAG)
    trunc = call.step("truncated", truncated, FLAG, optional=True)
    nv = call.step("next_values", next_values, optional=True)
    lv = call.bootstrap("last_value", last_value)
    return r, v, term, trunc, lv, nv


def gae(rewards, values, terminated, truncated=None, *, last_value=None, next_values=None,
        gamma=0.99, lam=0.95, time_dim=0, backend="auto", out_dtype=torch.float32):
    """Generalized Advantage Estimation. Returns `(advantages, returns)`.

    Recurrence (reverse in time), with v'[t] the successor value and cut[t] = terminated[t] or
    truncated[t] or t == T-1::

        delta[t] = r[t] + gamma * (1 - terminated[t]) * v'[t] - V[t]
        A[t]     = delta[t] + gamma * lam * (1 - cut[t]) * A[t+1]
        returns  = A + V

    Boundaries: a termination drops v'[t]; a truncation keeps v'[t] (the value of the state the
    episode was cut at) and stops the trace; the last step of the window bootstraps from
    `last_value` (or `next_values[T-1]`) and stops the trace.

    Example::

        >>> T, N = 128, 8
        >>> rewards, values = torch.randn(T, N), torch.randn(T, N)
        >>> terminated = torch.rand(T, N) < 0.01
        >>> adv, ret = rl_triton.gae(rewards, values, terminated, last_value=torch.randn(N))
    """
    gamma, lam = check_scalar("gamma", gamma), check_scalar("lam", lam)
    tensors = (rewards, values, terminated, truncated, last_value, next_values)
    options = (time_dim, backend, out_dtype)
    outs = _cached("gae", tensors, options, (gamma, lam))
    if outs is not None:
        return tuple(outs)
    call = Call("rewards", rewards, time_dim)
    r, v, term, trunc, lv, nv = _value_args(call, rewards, values, terminated, truncated,
                                            last_value, next_values)
    call.require_bootstrap(next_values, last_value)
    out_dtype, backend = check_out_dtype(out_dtype), _backend(backend, call)
    if call.T == 0 or rewards.numel() == 0:
        return _empty(call, out_dtype, 2)
    if backend == "triton":
        td = call.time_dim
        return tuple(_triton("gae", tensors, options, (gamma, lam), lambda ops: (
            ops.plan_value_estimator(ops.GAE, 2, tensors, td, out_dtype)),
            (*tensors, gamma, lam, td, out_dtype)))
    adv, ret = _python(backend, "gae")(r, v, term, trunc, last_value=lv, next_values=nv,
                                       gamma=gamma, lam=lam)
    return _finish(call, out_dtype, adv, ret)


def lambda_returns(rewards, values, terminated, truncated=None, *, last_value=None,
                   next_values=None, gamma=0.99, lam=0.95, time_dim=0, backend="auto",
                   out_dtype=torch.float32):
    """TD(lambda) returns. Returns the tensor `G` of lambda-returns.

    Recurrence (reverse), with v'[t] the successor value and cut[t] as in `gae`::

        G[t] = r[t] + gamma * (1 - terminated[t]) * ((1 - lam * (1 - cut[t])) * v'[t]
                                                      + lam * (1 - cut[t]) * G[t+1])

    `values` are used only as successor values: with `next_values` given, `values` may be None.
    Equal to `gae(...)[1]` (the GAE returns) for the same inputs.

    Example::

        >>> G = rl_triton.lambda_returns(rewards, values, terminated, last_value=v_last, lam=0.9)
    """
    gamma, lam = check_scalar("gamma", gamma), check_scalar("lam", lam)
    tensors = (rewards, values, terminated, truncated, last_value, next_values)
    options = (time_dim, backend, out_dtype)
    outs = _cached("lambda_returns", tensors, options, (gamma, lam))
    if outs is not None:
        return outs[0]
    call = Call("rewards", rewards, time_dim)
    r, v, term, trunc, lv, nv = _value_args(call, rewards, values, terminated, truncated,
                                            last_value, next_values,
                                            values_optional=next_values is not None)
    call.require_bootstrap(next_values, last_value)
    out_dtype, backend = check_out_dtype(out_dtype), _backend(backend, call)
    if call.T == 0 or rewards.numel() == 0:
        return _empty(call, out_dtype, 1)
    if backend == "triton":
        td = call.time_dim
        return _triton("lambda_returns", tensors, options, (gamma, lam), lambda ops: (
            ops.plan_value_estimator(ops.LAMBDA_RETURNS, 1, tensors, td, out_dtype)),
            (*tensors, gamma, lam, td, out_dtype))[0]
    g = _python(backend, "lambda_returns")(r, v, term, trunc, last_value=lv, next_values=nv,
                                           gamma=gamma, lam=lam)
    return _finish(call, out_dtype, g)


def discounted_returns(rewards, terminated, truncated=None, *, last_value=None, next_values=None,
                       gamma=0.99, time_dim=0, backend="auto", out_dtype=torch.float32):
    """Discounted returns (reward-to-go). Returns `G`.

    Recurrence (reverse)::

        G[t] = r[t] + gamma * (1 - terminated[t]) * (cut[t] * v'[t] + (1 - cut[t]) * G[t+1])

    A missing bootstrap means zero: without `last_value` the window end is treated as the end of
    the returns (Monte-Carlo reward-to-go inside the window), and without `next_values` a
    truncation inside the window bootstraps with zero. The one estimator that allows it.

    Example::

        >>> G = rl_triton.discounted_returns(rewards, terminated, gamma=0.99)
    """
    gamma = check_scalar("gamma", gamma)
    tensors = (rewards, None, terminated, truncated, last_value, next_values)
    options = (time_dim, backend, out_dtype)
    outs = _cached("discounted_returns", tensors, options, (gamma,))
    if outs is not None:
        return outs[0]
    call = Call("rewards", rewards, time_dim)
    r = call.step("rewards", rewards)
    term = call.step("terminated", terminated, FLAG)
    trunc = call.step("truncated", truncated, FLAG, optional=True)
    nv = call.step("next_values", next_values, optional=True)
    lv = call.bootstrap("last_value", last_value)
    if nv is not None and lv is not None:
        call.require_bootstrap(nv, lv)  # raises: not both
    out_dtype, backend = check_out_dtype(out_dtype), _backend(backend, call)
    if call.T == 0 or rewards.numel() == 0:
        return _empty(call, out_dtype, 1)
    if backend == "triton":
        td = call.time_dim
        return _triton("discounted_returns", tensors, options, (gamma,), lambda ops: (
            ops.plan_value_estimator(ops.DISCOUNTED_RETURNS, 1, tensors, td, out_dtype)),
            (rewards, terminated, truncated, last_value, next_values, gamma, td, out_dtype))[0]
    g = _python(backend, "discounted_returns")(r, term, trunc, last_value=lv, next_values=nv,
                                               gamma=gamma)
    return _finish(call, out_dtype, g)


def vtrace(rewards, values, terminated, target_log_probs, behavior_log_probs, truncated=None, *,
           last_value=None, next_values=None, gamma=0.99, lam=1.0, rho_clip=1.0, c_clip=1.0,
           pg_rho_clip=1.0, time_dim=0, backend="auto", out_dtype=torch.float32):
    """V-trace targets (IMPALA). Returns `(vs, pg_advantages)`.

    With ratio[t] = exp(target_log_probs[t] - behavior_log_probs[t]) (log-probabilities of the
    taken actions), rho[t] = min(rho_clip, ratio[t]) and c[t] = lam * min(c_clip, ratio[t])::

        delta[t] = rho[t] * (r[t] + gamma * (1 - terminated[t]) * v'[t] - V[t])
        D[t]     = delta[t] + gamma * c[t] * (1 - cut[t]) * D[t+1]          vs = V + D
        vs'[t]   = vs[t+1] if not cut[t] else v'[t]
        pg_advantages[t] = min(pg_rho_clip, ratio[t])
                           * (r[t] + gamma * (1 - terminated[t]) * (lam * vs'[t] + (1 - lam) * v'[t]) - V[t])

    On-policy (ratio 1) with lam = 1 and no clipping, vs equals the lambda-return with lambda 1.

    Example::

        >>> vs, pg_adv = rl_triton.vtrace(rewards, values, terminated, logp_target, logp_behavior,
        ...                               last_value=v_last)
    """
    gamma, lam = check_scalar("gamma", gamma), check_scalar("lam", lam)
    rho_clip = check_scalar("rho_clip", rho_clip, high=None, low_open=True)
    c_clip = check_scalar("c_clip", c_clip, high=None, low_open=True)
    pg_rho_clip = check_scalar("pg_rho_clip", pg_rho_clip, high=None, low_open=True)
    scalars = (gamma, lam, rho_clip, c_clip, pg_rho_clip)
    tensors = (rewards, values, terminated, truncated, last_value, next_values, target_log_probs,
               behavior_log_probs)
    options = (time_dim, backend, out_dtype)
    outs = _cached("vtrace", tensors, options, scalars)
    if outs is not None:
        return tuple(outs)
    call = Call("rewards", rewards, time_dim)
    r, v, term, trunc, lv, nv = _value_args(call, rewards, values, terminated, truncated,
                                            last_value, next_values)
    tlp = call.step("target_log_probs", target_log_probs)
    blp = call.step("behavior_log_probs", behavior_log_probs)
    call.require_bootstrap(next_values, last_value)
    out_dtype, backend = check_out_dtype(out_dtype), _backend(backend, call)
    if call.T == 0 or rewards.numel() == 0:
        return _empty(call, out_dtype, 2)
    if backend == "triton":
        td = call.time_dim
        return tuple(_triton("vtrace", tensors, options, scalars, lambda ops: (
            ops.plan_value_estimator(ops.VTRACE, 2, tensors, td, out_dtype)),
            (rewards, values, terminated, target_log_probs, behavior_log_probs, truncated,
             last_value, next_values, *scalars, td, out_dtype)))
    vs, pg = _python(backend, "vtrace")(r, v, term, tlp, blp, trunc, last_value=lv,
                                        next_values=nv, gamma=gamma, lam=lam, rho_clip=rho_clip,
                                        c_clip=c_clip, pg_rho_clip=pg_rho_clip)
    return _finish(call, out_dtype, vs, pg)


def retrace(rewards, q_values, actions, target_probs, behavior_probs, terminated, truncated=None,
            *, last_q_values=None, last_target_probs=None, gamma=0.99, lam=1.0, c_clip=1.0,
            return_advantages=False, time_dim=0, backend="auto", out_dtype=torch.float32):
    """Retrace(lambda) Q targets for discrete actions. Returns `G`, or `(G, G - Q(s_t, a_t))`
    with `return_advantages=True`.

    Shapes, with S the step shape of `rewards` (time axis `time_dim`) and A actions:
    `q_values[..., a] = Q(s_t, a)` and `target_probs[..., a] = pi(a | s_t)` are `[*S, A]`;
    `actions` (integer) and `behavior_probs` (`mu(a_t | s_t)`, the behaviour probability of the
    taken action, stored at acting time) are `[*S]`; the bootstrap state s_T is given by
    `last_q_values` and `last_target_probs`, `[*batch, A]`. A negative `time_dim` counts from the
    end of `rewards`' shape, not of `q_values`'.

    With E[t] = sum_a pi(a | s_{t+1}) Q(s_{t+1}, a) (from slot t+1, or from the bootstrap state
    at t = T-1) and c[t+1] = lam * min(c_clip, pi(a_{t+1} | s_{t+1}) / mu(a_{t+1} | s_{t+1}))::

        G[t] = r[t] + gamma * (1 - terminated[t]) * (E[t] + (1 - cut[t]) * c[t+1] * (G[t+1] - Q(s_{t+1}, a_{t+1})))

    Slot t+1 must hold the successor state of step t (next-step autoreset): at a truncation its
    expectation is the bootstrap. The expectation over actions is formed inside the kernel.

    Example::

        >>> G = rl_triton.retrace(rewards, q, actions, pi, mu_taken, terminated,
        ...                       last_q_values=q_last, last_target_probs=pi_last, lam=0.95)
    """
    gamma, lam = check_scalar("gamma", gamma), check_scalar("lam", lam)
    c_clip = check_scalar("c_clip", c_clip, high=None, low_open=True)
    tensors = (rewards, q_values, actions, target_probs, behavior_probs, terminated, truncated,
               last_q_values, last_target_probs)
    options = (time_dim, backend, out_dtype, return_advantages)
    outs = _cached("retrace", tensors, options, (gamma, lam, c_clip))
    if outs is not None:
        return _one_or_tuple(outs)
    call = Call("rewards", rewards, time_dim)
    r = call.step("rewards", rewards)
    q = call.step("q_values", q_values, trailing=1)
    n_act = q.shape[-1]
    if n_act == 0:
        raise ValueError("q_values has an empty action axis")
    a = call.step("actions", actions, INDEX)
    pi = call.step("target_probs", target_probs, trailing_shape=(n_act,))
    mu = call.step("behavior_probs", behavior_probs)
    term = call.step("terminated", terminated, FLAG)
    trunc = call.step("truncated", truncated, FLAG, optional=True)
    lq = call.bootstrap("last_q_values", last_q_values, trailing_shape=(n_act,), optional=False)
    lpi = call.bootstrap("last_target_probs", last_target_probs, trailing_shape=(n_act,),
                         optional=False)
    if not isinstance(return_advantages, bool):
        raise TypeError(f"return_advantages must be a bool, got {type(return_advantages).__name__}")
    out_dtype, backend = check_out_dtype(out_dtype), _backend(backend, call)
    n_out = 2 if return_advantages else 1
    if call.T == 0 or rewards.numel() == 0:
        return _empty(call, out_dtype, n_out)
    if backend == "triton":
        td = call.time_dim
        outs = _triton("retrace", tensors, options, (gamma, lam, c_clip), lambda ops: (
            ops.plan_retrace(tensors, return_advantages, td, out_dtype)),
            (*tensors, gamma, lam, c_clip, return_advantages, td, out_dtype))
        return _one_or_tuple(outs[:n_out])
    g, adv = _python(backend, "retrace")(r, q, a, pi, mu, term, trunc, last_q_values=lq,
                                         last_target_probs=lpi, gamma=gamma, lam=lam,
                                         c_clip=c_clip)
    return _finish(call, out_dtype, *((g, adv) if return_advantages else (g,)))


def _forward_scan(name, x, dones, initial, keep, time_dim, backend, out_dtype, **py_kwargs):
    """Eligibility traces (keep = gamma * lam) and episodic prefix sums (keep = 1): one kernel."""
    tensors, options = (x, dones, initial), (time_dim, backend, out_dtype)
    outs = _cached("forward_scan", tensors, options, (keep,))
    if outs is not None:
        return outs[0]
    call = Call("dones", dones, time_dim, kind=FLAG)
    xs = call.step("x", x, trailing=max(0, x.ndim - dones.ndim) if isinstance(
        x, torch.Tensor) else 0)
    features = tuple(xs.shape[1 + len(call.batch_shape):])
    d = call.step("dones", dones, FLAG)
    init = call.bootstrap("initial", initial, trailing_shape=features)
    out_dtype, backend = check_out_dtype(out_dtype), _backend(backend, call)
    if call.T == 0 or x.numel() == 0:
        return _empty(call, out_dtype, 1, features)
    if backend == "triton":
        td = call.time_dim
        return _triton("forward_scan", tensors, options, (keep,), lambda ops: (
            ops.plan_forward_scan(tensors, td, out_dtype)), (*tensors, keep, td, out_dtype))[0]
    out = _python(backend, name)(xs, d, initial=init, **py_kwargs)
    return _finish(call, out_dtype, out, trailing_shape=features)


def eligibility_traces(x, dones, *, gamma, lam, initial=None, time_dim=0, backend="auto",
                       out_dtype=torch.float32):
    """Accumulating eligibility traces (forward in time). Returns `z`, shaped like `x`.

    ::

        z[t] = x[t] + gamma * lam * (1 - done[t-1]) * z[t-1],   z[-1] = initial (default 0),
                                                                done[-1] = 0

    `x` has the shape of `dones` followed by any trailing feature axes (traces of vectors, e.g.
    gradients); the flags broadcast over them. `done[t]` marks the last step of an episode, so
    the trace restarts at t+1. `time_dim` refers to `dones` (negative counts from its end).

    Example::

        >>> z = rl_triton.eligibility_traces(grads, dones, gamma=0.99, lam=0.9)  # grads [T, N, D]
    """
    gamma, lam = check_scalar("gamma", gamma), check_scalar("lam", lam)
    return _forward_scan("eligibility_traces", x, dones, initial, gamma * lam, time_dim, backend,
                         out_dtype, gamma=gamma, lam=lam)


def episodic_cumsum(x, dones, *, initial=None, time_dim=0, backend="auto",
                    out_dtype=torch.float32):
    """Prefix sums that restart after every episode end (forward in time). Returns `C`.

    ::

        C[t] = x[t] + (1 - done[t-1]) * C[t-1],   C[-1] = initial (default 0),   done[-1] = 0

    `done[t]` marks the last step of an episode (as everywhere in rl_triton), so the sum restarts
    at t+1. `x` may carry trailing feature axes; `time_dim` refers to `dones`.

    Example::

        >>> episode_return_so_far = rl_triton.episodic_cumsum(rewards, dones)
    """
    return _forward_scan("episodic_cumsum", x, dones, initial, 1.0, time_dim, backend, out_dtype)


def linear_scan(alpha, beta, *, reverse=True, initial=None, time_dim=0, backend="auto",
                out_dtype=torch.float32):
    """The primitive: a first-order linear recurrence along `time_dim`. Returns `A`.

    ::

        reverse=True:   A[t] = alpha[t] + beta[t] * A[t+1],   A[T]  = initial (default 0)
        reverse=False:  A[t] = alpha[t] + beta[t] * A[t-1],   A[-1] = initial (default 0)

    Evaluated as an associative scan over pairs (a, b) with the combine
    `(a1, b1) then (a2, b2) -> (a2 + b2 * a1, b1 * b2)`. `alpha` and `beta` have one shape;
    `initial` has it without the time axis. Express your own estimators with it.

    Example::

        >>> # discounted reward-to-go with a fixed gamma, no episode ends
        >>> G = rl_triton.linear_scan(rewards, torch.full_like(rewards, 0.99))
    """
    if not isinstance(reverse, bool):
        raise TypeError(f"reverse must be a bool, got {type(reverse).__name__}")
    tensors, options = (alpha, beta, initial), (time_dim, backend, out_dtype, reverse)
    outs = _cached("linear_scan", tensors, options, (0.0,))
    if outs is not None:
        return outs[0]
    call = Call("alpha", alpha, time_dim)
    al = call.step("alpha", alpha)
    be = call.step("beta", beta)
    init = call.bootstrap("initial", initial)
    out_dtype, backend = check_out_dtype(out_dtype), _backend(backend, call)
    if call.T == 0 or alpha.numel() == 0:
        return _empty(call, out_dtype, 1)
    if backend == "triton":
        td = call.time_dim
        return _triton("linear_scan", tensors, options, (0.0,), lambda ops: (
            ops.plan_linear_scan(tensors, reverse, td, out_dtype)),
            (alpha, beta, initial, reverse, td, out_dtype))[0]
    a = _python(backend, "linear_scan")(al, be, reverse=reverse, initial=init)
    return _finish(call, out_dtype, a)
