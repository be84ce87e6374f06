"""Soft Q-learning targets (SAC, semantics §9), continuous and discrete actions: one kernel forward,
one backward."""
from __future__ import annotations

import numbers
from typing import NamedTuple, Optional

import torch

from .. import reference
from .._args import FLAG, Call, check_backend, check_out_dtype, check_scalar
from ..reference import _decided, _prep
from ..scan.jit import cdiv, next_power_of_2, tl, triton
from .._core.op import Op
from . import _losses as L

Tensor = torch.Tensor


class Inputs(NamedTuple):
    rewards: Tensor
    terminated: Tensor
    next_q_values: Tensor
    next_log_probs: Tensor
    next_probs: Optional[Tensor]
    alpha: Optional[Tensor]  # a learned temperature (one element), else `Options.alpha_value`


class Options(NamedTuple):
    gamma: float
    alpha_value: float
    out_dtype: torch.dtype


@triton.jit
def soft_values(q, logp, probs, n, a, ok, A, K, q_n, q_a, q_k, lp_n, lp_a, p_n, p_a, alpha,
                HAS_PROBS: tl.constexpr):
    """At each (sample, action) of the tile: the smallest critic (NaN if any is) and the first
    critic that has it, pi(a) (1 for continuous actions) and log pi(a)."""
    base = q + n[:, None] * q_n + a[None, :] * q_a
    smallest = tl.load(base, mask=ok, other=0.0).to(tl.float32)
    which = tl.zeros(smallest.shape, tl.int32)
    for k in range(1, K):
        qk = tl.load(base + k * q_k, mask=ok, other=0.0).to(tl.float32)
        take = (qk < smallest) | (qk != qk)
        smallest = tl.where(take, qk, smallest)
        which = tl.where(take, k, which)
    lp = tl.load(logp + n[:, None] * lp_n + a[None, :] * lp_a, mask=ok, other=0.0).to(tl.float32)
    p = tl.full(smallest.shape, 1.0, tl.float32)
    if HAS_PROBS:
        p = tl.load(probs + n[:, None] * p_n + a[None, :] * p_a, mask=ok, other=0.0).to(
            tl.float32)
    return smallest, which, p, lp


@triton.jit
def temperature(alpha_t, alpha, ALPHA_TENSOR: tl.constexpr):
    if ALPHA_TENSOR:
        return tl.load(alpha_t).to(tl.float32)
    return alpha


@triton.jit
def forward_kernel(rewards, term, q, logp, probs, alpha_t, y, N, A, K, r_n, t_n, q_n, q_a, q_k,
                   lp_n, lp_a, p_n, p_a, gamma, alpha, HAS_PROBS: tl.constexpr,
                   ALPHA_TENSOR: tl.constexpr, INT64: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_A: tl.constexpr):
    """y = r + gamma * (1 - term) * sum_a pi(a) (min_k Q_k(a) - alpha log pi(a))."""
    n, inb = L.positions(N, INT64, BLOCK_N)
    alpha = temperature(alpha_t, alpha, ALPHA_TENSOR)
    v = tl.zeros([BLOCK_N], tl.float32)
    for a0 in range(0, A, BLOCK_A):
        a = a0 + tl.arange(0, BLOCK_A)
        ok = inb[:, None] & (a[None, :] < A)
        smallest, _, p, lp = soft_values(q, logp, probs, n, a, ok, A, K, q_n, q_a, q_k, lp_n,
                                         lp_a, p_n, p_a, alpha, HAS_PROBS)
        keep = ok
        if HAS_PROBS:  # an action of probability 0 adds 0, whatever its log pi and Q hold
            keep = ok & (p != 0)
        v += tl.sum(tl.where(keep, p * (smallest - alpha * lp), 0.0), axis=1)
    r = tl.load(rewards + n * r_n, mask=inb, other=0.0).to(tl.float32)
    done = tl.load(term + n * t_n, mask=inb, other=0) != 0
    # a termination drops the bootstrap by a select: the next state's NaN stays out
    tl.store(y + n, (r + tl.where(done, 0.0, gamma * v)).to(y.dtype.element_ty), mask=inb)


@triton.jit
def backward_kernel(term, q, logp, probs, alpha_t, g, d_r, d_q, d_lp, d_p, d_alpha, N, A, K,
                    t_n, q_n, q_a, q_k, lp_n, lp_a, p_n, p_a, g_n, dq_n, dq_a, dlp_n, dlp_a,
                    dp_n, dp_a, gamma, alpha, HAS_PROBS: tl.constexpr,
                    ALPHA_TENSOR: tl.constexpr, D_R: tl.constexpr, D_Q: tl.constexpr,
                    D_LP: tl.constexpr, D_P: tl.constexpr, D_ALPHA: tl.constexpr,
                    INT64: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr):
    """With w = g gamma (1 - term) pi(a): dQ_k(a) = w where critic k is the smallest, dlog pi(a)
    = -alpha w, dpi(a) = g gamma (1 - term) (min Q(a) - alpha log pi(a)), d alpha = -sum of
    w log pi(a) (this program's part of it), d r = g; 0 at terminal steps and at actions of
    probability 0."""
    n, inb = L.positions(N, INT64, BLOCK_N)
    alpha = temperature(alpha_t, alpha, ALPHA_TENSOR)
    gy = tl.load(g + n * g_n, mask=inb, other=0.0).to(tl.float32)
    if D_R:
        tl.store(d_r + n, gy.to(d_r.dtype.element_ty), mask=inb)
    done = tl.load(term + n * t_n, mask=inb, other=0) != 0
    coef = tl.where(done, 0.0, gamma * gy)
    d_a = tl.zeros([BLOCK_N], tl.float32)
    for a0 in range(0, A, BLOCK_A):
        a = a0 + tl.arange(0, BLOCK_A)
        ok = inb[:, None] & (a[None, :] < A)
        smallest, which, p, lp = soft_values(q, logp, probs, n, a, ok, A, K, q_n, q_a, q_k,
                                             lp_n, lp_a, p_n, p_a, alpha, HAS_PROBS)
        # what a termination or a zero probability drops is selected away, never multiplied
        # by 0 (a NaN or inf there: 0 * inf is NaN)
        live = ok & ~done[:, None]
        if HAS_PROBS:
            live = live & (p != 0)
        w = tl.where(live, coef[:, None] * p, 0.0)
        if D_Q:
            base = d_q + n[:, None] * dq_n + a[None, :] * dq_a
            for k in range(K):
                tl.store(base + k, tl.where(which == k, w, 0.0).to(d_q.dtype.element_ty),
                         mask=ok)
        if D_LP:
            tl.store(d_lp + n[:, None] * dlp_n + a[None, :] * dlp_a,
                     (-alpha * w).to(d_lp.dtype.element_ty), mask=ok)
        if D_P:
            tl.store(d_p + n[:, None] * dp_n + a[None, :] * dp_a,
                     tl.where(live, coef[:, None] * (smallest - alpha * lp), 0.0).to(
                         d_p.dtype.element_ty), mask=ok)
        if D_ALPHA:
            d_a += tl.sum(tl.where(live, -w * lp, 0.0), axis=1)
    if D_ALPHA:
        tl.store(d_alpha + tl.program_id(0), tl.sum(d_a, axis=0))


def _samples(x: Tensor, N: int, trailing: tuple) -> Tensor:
    """`x` as [N, *trailing] (its batch axes as one): a view where one stride describes them,
    else a contiguous copy."""
    try:
        return x.view(N, *trailing)
    except RuntimeError:
        return x.contiguous().view(N, *trailing)


class _Views(NamedTuple):
    N: int
    A: int
    K: int
    tensors: list  # rewards, terminated, next_q, next_log_probs, next_probs (or any tensor)
    strides: list  # r_n, t_n, q_n, q_a, q_k, lp_n, lp_a, p_n, p_a
    INT64: bool


def _views(x: Inputs) -> _Views:
    r = x.rewards
    N = r.numel()
    K = x.next_q_values.shape[-1]
    discrete = x.next_probs is not None
    A = x.next_probs.shape[-1] if discrete else 1
    rv, tv = _samples(r, N, ()), _samples(x.terminated, N, ())
    qv = _samples(x.next_q_values, N, (A, K) if discrete else (K,))
    lv = _samples(x.next_log_probs, N, (A,) if discrete else ())
    pv = _samples(x.next_probs, N, (A,)) if discrete else lv
    q_s = qv.stride() if discrete else (qv.stride(0), 0, qv.stride(1))
    lp_s = lv.stride() if discrete else (lv.stride(0), 0)
    p_s = pv.stride() if discrete else (0, 0)
    strides = [rv.stride(0), tv.stride(0), *q_s, *lp_s, *p_s]
    views = (rv, tv, qv, lv, pv)
    extent = max(sum((n - 1) * abs(st) for n, st in zip(v.shape, v.stride())) + 1
                 for v in views)
    return _Views(N, A, K, list(views), strides, max(extent, N * A * K) > L.INT32_MAX)


def _blocks(N: int, A: int) -> dict:
    block_a = min(next_power_of_2(A), 64)
    return dict(BLOCK_A=block_a,
                BLOCK_N=max(16, min(1024 // block_a, next_power_of_2(max(N, 1)))),
                num_warps=4)


def _alpha(x: Inputs, o: Options, like: Tensor):
    return (like if x.alpha is None else x.alpha), o.alpha_value


def _fixed(x: Inputs):
    """(views' sizes and strides, which inputs they copy, grid, flags): fixed by the call's
    signature; the inputs read in place are passed as they are (a kernel reads their address)."""
    vw = _views(x)
    read = (x.rewards, x.terminated, x.next_q_values, x.next_log_probs,
            x.next_probs if x.next_probs is not None else x.next_log_probs)
    copied = [v.data_ptr() != t.data_ptr() for v, t in zip(vw.tensors, read)]
    meta = _blocks(vw.N, vw.A)
    return vw._replace(tensors=None), copied, meta, cdiv(vw.N, meta["BLOCK_N"])


def forward(x: Inputs, o: Options, plan=None):
    if plan is None:
        vw = _views(x)
        meta = _blocks(vw.N, vw.A)
    else:
        vw, copied, meta, _ = L.fixed(plan, _fixed, x)
        if any(copied):
            vw = _views(x)
        else:
            vw = vw._replace(tensors=[x.rewards, x.terminated, x.next_q_values,
                                      x.next_log_probs, x.next_probs if x.next_probs is not None
                                      else x.next_log_probs])
    y = torch.empty(x.rewards.shape, dtype=o.out_dtype, device=x.rewards.device)
    alpha_t, alpha = _alpha(x, o, y)
    L.launch(forward_kernel, cdiv(vw.N, meta["BLOCK_N"]), *vw.tensors, alpha_t, y, vw.N,
             vw.A, vw.K, *vw.strides, o.gamma, alpha, HAS_PROBS=x.next_probs is not None,
             ALPHA_TENSOR=x.alpha is not None, INT64=vw.INT64, **meta, plan=plan)
    return [y], []


def backward(x: Inputs, o: Options, saved, grads, needs, plan=None):
    vw = _views(x)
    (g,) = grads
    n_r, _, n_q, n_lp, n_p, n_alpha = needs
    d_r, d_q, d_lp, d_p = (torch.empty(t.shape, dtype=t.dtype, device=t.device) if need else None
                           for t, need in zip((x.rewards, x.next_q_values, x.next_log_probs,
                                               x.next_probs), (n_r, n_q, n_lp, n_p)))
    meta = _blocks(vw.N, vw.A)
    programs = cdiv(vw.N, meta["BLOCK_N"])
    parts = torch.empty(programs if n_alpha else 0, dtype=torch.float32,
                        device=x.rewards.device)
    discrete = x.next_probs is not None
    dq_s = (vw.A * vw.K, vw.K) if discrete else (vw.K, 0)
    dlp_s = (vw.A, 1) if discrete else (1, 0)
    dummy = vw.tensors[0]
    alpha_t, alpha = _alpha(x, o, dummy)
    at = L.backward_site(plan, needs, g)
    g = _samples(g, vw.N, ())
    L.launch(backward_kernel, programs, *vw.tensors[1:], alpha_t, g,
             *(dummy if t is None else t for t in (d_r, d_q, d_lp, d_p)), parts, vw.N, vw.A,
             vw.K, *vw.strides[1:], g.stride(0), *dq_s, *dlp_s, vw.A, 1,
             o.gamma, alpha, HAS_PROBS=discrete, ALPHA_TENSOR=x.alpha is not None, D_R=n_r,
             D_Q=n_q, D_LP=n_lp, D_P=n_p, D_ALPHA=n_alpha, INT64=vw.INT64, **meta, plan=at)
    d_alpha = parts.sum().reshape(x.alpha.shape).to(x.alpha.dtype) if n_alpha else None
    return [d_r, None, d_q, d_lp, d_p, d_alpha]


def fake(x: Inputs, o: Options):
    return [x.rewards.new_empty(x.rewards.shape, dtype=o.out_dtype)], []


def torch_impl(x: Inputs, o: Options, dtype):
    r, q, lp, p = _prep(dtype, x.rewards, x.next_q_values, x.next_log_probs, x.next_probs)
    alpha = o.alpha_value if x.alpha is None else x.alpha.to(dtype).reshape(())
    # what a termination (the bootstrap) or a zero probability (the action) drops is 0 before
    # any arithmetic: a NaN or inf there would reach the gradients through 0 * NaN
    live = x.terminated == 0
    if p is not None:
        (p,) = _decided(live, p)
        live = p != 0
    q, lp = _decided(live, q, lp)
    # the first minimal critic (argmin's), as the kernel: amin would split a tie's gradient
    v = q.gather(-1, q.argmin(-1, keepdim=True)).squeeze(-1) - alpha * lp
    if p is not None:
        v = (p * v).sum(-1)
    return (r + torch.where(x.terminated != 0, 0.0, o.gamma * v),)


def loop_impl(x: Inputs, o: Options, dtype):
    return (reference.sac_targets(x.rewards, x.terminated, x.next_q_values, x.next_log_probs,
                                  gamma=o.gamma,
                                  alpha=o.alpha_value if x.alpha is None else x.alpha,
                                  next_probs=x.next_probs, dtype=dtype),)




def _check(t: tuple, a: tuple):
    """The public call's arguments checked (`sac_targets`'s order): (inputs, plan)."""
    rewards, terminated, next_q_values, next_log_probs, next_probs, alpha = t
    gamma, number, backend, out_dtype = a
    alpha = number if alpha is None else alpha
    backend = check_backend(backend)
    out_dtype = check_out_dtype(out_dtype)
    call = Call("rewards", rewards, None)
    r = call.step("rewards", rewards)
    term = call.step("terminated", terminated, FLAG)
    if next_probs is None:
        q = call.step("next_q_values", next_q_values, trailing=1)
        lp = call.step("next_log_probs", next_log_probs)
        probs = None
    else:
        probs = call.step("next_probs", next_probs, trailing=1)
        A = probs.shape[-1]
        q = call.step("next_q_values", next_q_values, trailing=2)
        if q.shape[-2] != A:
            raise ValueError(f"next_q_values has shape {tuple(q.shape)} but next_probs has "
                             f"{A} actions; with next_probs, next_q_values is [..., A, K]")
        lp = call.step("next_log_probs", next_log_probs, trailing_shape=(A,))
    if q.shape[-1] == 0:
        raise ValueError(f"next_q_values has shape {tuple(q.shape)}: no critic (its last axis "
                         "holds the K target critics)")
    gamma = check_scalar("gamma", gamma)
    alpha_t, alpha_value = None, 0.0
    if isinstance(alpha, Tensor):
        if not alpha.is_floating_point():
            raise TypeError(f"alpha is a tensor of dtype {alpha.dtype}; a learned temperature "
                            "must be a floating tensor")
        if alpha.numel() != 1:
            raise ValueError(f"alpha must be a number or a tensor of one element; got shape "
                             f"{tuple(alpha.shape)}")
        if alpha.device != call.device:
            raise ValueError(f"alpha is on {alpha.device} but rewards is on {call.device}; "
                             "all tensors must be on one device")
        alpha_t = alpha.resolve_neg()
        if alpha.requires_grad and call.grad:
            call.needs_grad = True
        call.float64 |= alpha.dtype is torch.float64
    elif isinstance(alpha, numbers.Real) and not isinstance(alpha, bool):
        alpha_value = check_scalar("alpha", alpha, high=None)
    else:
        raise TypeError(f"alpha must be a number or a tensor, got {type(alpha).__name__}")
    o = Options(gamma, alpha_value, out_dtype)
    return Inputs(r, term, q, lp, probs, alpha_t), L.plan(call, backend, o)


OP = Op("sac_targets", "loss", Inputs, Options, outputs=1, forward=forward,
        backward=backward, fake=fake, check=_check, torch=torch_impl, loop=loop_impl)


def sac_targets(rewards, terminated, next_q_values, next_log_probs, *, gamma=0.99, alpha=0.2,
                next_probs=None, backend="auto", out_dtype=torch.float32):
    """Soft Q-learning targets (SAC), from K target critics at the next state.

    Continuous actions (`next_q_values[..., K]` at the sampled next action a',
    `next_log_probs[...]` = log pi(a'|s'))::

        y = r + gamma * (1 - terminated) * (min_k Q_k(s', a') - alpha * log pi(a'|s'))

    Discrete actions (`next_probs[..., A]` given, with `next_q_values[..., A, K]` and
    `next_log_probs[..., A]` for every action): the expectation
    `sum_a pi(a|s') * (min_k Q_k(s', a) - alpha * log pi(a|s'))` in place of the bracket.

    Only terminations drop the bootstrap (a truncation keeps it; flags are set where nonzero).
    `alpha` is a number or a one-element tensor (a learned temperature, read on the device).
    An action of probability 0 adds 0 to the expectation, whatever its log-probability (-inf
    from invalid-action masking) and Q-values hold, and gets gradient 0; so do a terminal
    step's next-state inputs. Differentiable with respect to every floating input, `alpha`
    included (`d y / d alpha =
    -gamma (1 - terminated) log pi`, in expectation over the actions for discrete ones);
    targets are usually held fixed, as CleanRL computes them
    under `torch.no_grad()`: do so, or pass `alpha.detach()`, where the temperature must not
    learn from the critic loss. At a tie between critics the gradient goes to the first.

    Example::

        >>> y = rl_triton.sac_targets(rewards, terminations, torch.stack([q1, q2], -1),
        ...                           next_log_pi, gamma=0.99, alpha=log_alpha.exp())
    """
    # a tensor alpha is among the tensors (its signature keys the plan), a number among the
    # options
    tensor = isinstance(alpha, Tensor)
    return OP((rewards, terminated, next_q_values, next_log_probs, next_probs,
               alpha if tensor else None),
              (gamma, None if tensor else alpha, backend, out_dtype))
