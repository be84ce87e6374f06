"""The Triton backend: one launcher for all estimators, registered as PyTorch custom ops.

Each op takes the caller's tensors in their own layout (already checked by `rl_triton._args`),
describes every tensor to `scan.scan_kernel` by its strides (no copies), allocates the outputs in
the caller's layout, and launches. The ops are `torch.library.custom_op`s (`rl_triton::gae`, ...)
with fake implementations, so compiled code sees them as single opaque nodes; eager calls skip
the dispatcher and run the implementation directly.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from . import coefficients as C
from . import config
from .scan import scan_kernel

Tensor = torch.Tensor


@dataclass(frozen=True)
class Kernel:
    coef: object
    store: object
    reverse: bool
    exclusive: bool = False  # the writer needs A at the previous step in scan order
    weight: int = 1  # relative register cost of a step: smaller tiles for heavier estimators


GAE = Kernel(C.gae_coef, C.gae_store, reverse=True)
LAMBDA_RETURNS = Kernel(C.lambda_returns_coef, C.single_store, reverse=True)
DISCOUNTED_RETURNS = Kernel(C.discounted_returns_coef, C.single_store, reverse=True)
VTRACE = Kernel(C.vtrace_coef, C.vtrace_store, reverse=True, exclusive=True, weight=2)
RETRACE = Kernel(C.retrace_coef, C.retrace_store, reverse=True, weight=8)
FORWARD = Kernel(C.forward_coef, C.single_store, reverse=False)
SCAN_REVERSE = Kernel(C.linear_scan_coef, C.single_store, reverse=True)
SCAN_FORWARD = Kernel(C.linear_scan_coef, C.single_store, reverse=False)

INT32_MAX = 2**31 - 1
_RETRACE_ACTION_SLOTS = tuple(s.value for s in (C.RT_Q, C.RT_PI, C.RT_LAST_Q, C.RT_LAST_PI))


def _batch_groups(views, bshape):
    """Merge the batch axes of `views` (all shaped [T, *bshape]) into at most two groups.

    Returns [(size, [stride of each view])] * 2, or None when the strides need three or more.
    """
    groups = []
    for d, n in enumerate(bshape):
        if n == 1:
            continue
        if groups and all(v.stride(groups[-1][-1] + 1) == v.stride(d + 1) * n for v in views):
            groups[-1].append(d)
        else:
            groups.append([d])
    if len(groups) > 2:
        return None
    out = [(math.prod(bshape[d] for d in g), [v.stride(g[-1] + 1) for v in views]) for g in groups]
    while len(out) < 2:
        out.append((1, [0] * len(views)))
    return out


def _extent(v: Tensor, extra: int = 0) -> int:
    return extra + sum((n - 1) * s for n, s in zip(v.shape, v.stride()) if n > 0)


@functools.lru_cache(maxsize=None)
def _no_scratch(device: torch.device) -> Tensor:
    return torch.zeros(1, dtype=torch.float32, device=device)


def over_time(x: Optional[Tensor], T: int) -> Optional[Tensor]:
    """A bootstrap tensor [*batch] seen as [T, *batch] with time stride 0 (read at one step)."""
    return None if x is None else x.unsqueeze(0).expand(T, *x.shape)


def launch(kernel: Kernel, T: int, bshape: tuple, ins: list, outs: list, params: tuple, *,
           init: Optional[Tensor] = None, action_slots: tuple = (), has_trunc: bool = False,
           has_next: bool = False, has_last: bool = False, variant: int = 0) -> None:
    """Run `kernel` over views shaped [T, *bshape] (None for unused slots), writing `outs`.

    The views in `action_slots` carry a trailing action axis, [T, *bshape, n_act].
    """
    B = math.prod(bshape)
    if T == 0 or B == 0:
        return
    device = outs[0].device
    results = outs
    for attempt in range(2):
        if attempt == 1:
            # Batch axes that two strides cannot describe (e.g. a 3-D slice with the time axis
            # in the middle): fall back to contiguous copies. Ordinary layouts never get here.
            ins = [None if x is None else x.contiguous() for x in ins]
            outs = [torch.empty(o.shape, dtype=o.dtype, device=device) for o in outs]
            init = None if init is None else init.contiguous()
        flat = [x[..., 0] if (i in action_slots and x is not None) else x
                for i, x in enumerate(ins)]
        init_view = over_time(init, T)
        present = [x for x in flat if x is not None] + list(outs)
        if init_view is not None:
            present.append(init_view)
        groups = _batch_groups(present, bshape)
        if groups is not None:
            break
    n_act = max([ins[i].shape[-1] for i in action_slots] + [1])
    sa = tuple(ins[i].stride(-1) if i in action_slots else 0 for i in range(len(ins)))
    (B1, g1), (B2, g2) = groups
    stride1 = dict(zip(map(id, present), g1))
    stride2 = dict(zip(map(id, present), g2))
    dummy = outs[0]

    def describe(views):
        ptrs, st, s1, s2 = [], [], [], []
        for v in views:
            ptrs.append(dummy if v is None else v)
            st.append(0 if v is None else v.stride(0))
            s1.append(0 if v is None else stride1[id(v)])
            s2.append(0 if v is None else stride2[id(v)])
        return tuple(ptrs), tuple(st), tuple(s1), tuple(s2)

    largest = max([_extent(v, (n_act - 1) * a) for v, a in zip(flat, sa) if v is not None]
                  + [_extent(v) for v in present])
    ptrs, st, s1, s2 = describe(flat)
    optrs, ost, os1, os2 = describe(outs)
    first = flat[0] if flat[0] is not None else outs[0]
    cfg = config.choose(T, B, time_contiguous=first.stride(0) == 1 and T > 1,
                        weight=kernel.weight, device=device)
    if init_view is not None:
        init_args = (init_view, stride1[id(init_view)], stride2[id(init_view)])
    else:
        init_args = (dummy, 0, 0)
    agg = (torch.empty(2 * cfg.n_seg * B, dtype=torch.float32, device=device)
           if cfg.n_seg > 1 else _no_scratch(device))
    args = (ptrs, st, s1, s2, sa, optrs, ost, os1, os2, *init_args, agg,
            tuple(float(p) for p in params), T, B, B2, n_act, cfg.chunks_per_seg, cfg.n_seg)
    meta = dict(COEF=kernel.coef, STORE=kernel.store, REVERSE=kernel.reverse,
                EXCLUSIVE=kernel.exclusive, HAS_TRUNC=has_trunc, HAS_NEXT=has_next,
                HAS_LAST=has_last, HAS_INIT=init is not None, VARIANT=variant,
                INT64=largest > INT32_MAX or 2 * cfg.n_seg * B > INT32_MAX,
                BLOCK_T=cfg.block_t, BLOCK_B=cfg.block_b,
                BLOCK_A=min(_pow2(n_act), 32), num_warps=cfg.num_warps)
    grid = (triton.cdiv(B, cfg.block_b), cfg.n_seg)
    with _on(device):
        if cfg.n_seg > 1:
            scan_kernel[grid](*args, PHASE=0, **meta)
        scan_kernel[grid](*args, PHASE=1, **meta)
    if results is not outs:
        for r, o in zip(results, outs):
            r.copy_(o)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _on(device: torch.device):
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return _NULL


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NULL = _Null()


# ---- the ops: caller-layout tensors in, new outputs out --------------------------------------

def _tm(x: Optional[Tensor], time_dim: int) -> Optional[Tensor]:
    return None if x is None else x.movedim(time_dim, 0)


def _value_estimator(kernel: Kernel, n_out: int, rewards, values, terminated, truncated,
                     last_value, next_values, extra: list, params: tuple, time_dim: int,
                     out_dtype: torch.dtype):
    outs = [torch.empty(rewards.shape, dtype=out_dtype, device=rewards.device)
            for _ in range(n_out)]
    r = _tm(rewards, time_dim)
    ins = [r, _tm(values, time_dim), _tm(terminated, time_dim), _tm(truncated, time_dim),
           _tm(next_values, time_dim), over_time(last_value, r.shape[0])]
    ins += [_tm(x, time_dim) for x in extra]
    launch(kernel, r.shape[0], tuple(r.shape[1:]), ins, [_tm(o, time_dim) for o in outs], params,
           has_trunc=truncated is not None, has_next=next_values is not None,
           has_last=last_value is not None)
    return outs


def gae(rewards: Tensor, values: Tensor, terminated: Tensor, truncated: Optional[Tensor],
        last_value: Optional[Tensor], next_values: Optional[Tensor], gamma: float, lam: float,
        time_dim: int, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    adv, ret = _value_estimator(GAE, 2, rewards, values, terminated, truncated, last_value,
                                next_values, [], (gamma, lam), time_dim, out_dtype)
    return adv, ret


def lambda_returns(rewards: Tensor, values: Optional[Tensor], terminated: Tensor,
                   truncated: Optional[Tensor], last_value: Optional[Tensor],
                   next_values: Optional[Tensor], gamma: float, lam: float, time_dim: int,
                   out_dtype: torch.dtype) -> Tensor:
    return _value_estimator(LAMBDA_RETURNS, 1, rewards, values, terminated, truncated, last_value,
                            next_values, [], (gamma, lam), time_dim, out_dtype)[0]


def discounted_returns(rewards: Tensor, terminated: Tensor, truncated: Optional[Tensor],
                       last_value: Optional[Tensor], next_values: Optional[Tensor], gamma: float,
                       time_dim: int, out_dtype: torch.dtype) -> Tensor:
    return _value_estimator(DISCOUNTED_RETURNS, 1, rewards, None, terminated, truncated,
                            last_value, next_values, [], (gamma,), time_dim, out_dtype)[0]


def vtrace(rewards: Tensor, values: Tensor, terminated: Tensor, target_log_probs: Tensor,
           behavior_log_probs: Tensor, truncated: Optional[Tensor], last_value: Optional[Tensor],
           next_values: Optional[Tensor], gamma: float, lam: float, rho_clip: float,
           c_clip: float, pg_rho_clip: float, time_dim: int,
           out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    vs, pg = _value_estimator(VTRACE, 2, rewards, values, terminated, truncated, last_value,
                              next_values, [target_log_probs, behavior_log_probs],
                              (gamma, lam, rho_clip, c_clip, pg_rho_clip), time_dim, out_dtype)
    return vs, pg


def retrace(rewards: Tensor, q_values: Tensor, actions: Tensor, target_probs: Tensor,
            behavior_probs: Tensor, terminated: Tensor, truncated: Optional[Tensor],
            last_q_values: Tensor, last_target_probs: Tensor, gamma: float, lam: float,
            c_clip: float, return_advantages: bool, time_dim: int,
            out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(G, G - Q(s_t, a_t)); the second is empty unless return_advantages."""
    n_out = 2 if return_advantages else 1
    outs = [torch.empty(rewards.shape, dtype=out_dtype, device=rewards.device)
            for _ in range(n_out)]
    T = rewards.shape[time_dim]
    ins = [_tm(rewards, time_dim), _tm(q_values, time_dim), _tm(actions, time_dim),
           _tm(target_probs, time_dim), _tm(behavior_probs, time_dim), _tm(terminated, time_dim),
           _tm(truncated, time_dim), over_time(last_q_values, T), over_time(last_target_probs, T)]
    launch(RETRACE, T, tuple(ins[0].shape[1:]), ins, [_tm(o, time_dim) for o in outs],
           (gamma, lam, c_clip), action_slots=_RETRACE_ACTION_SLOTS,
           has_trunc=truncated is not None, variant=int(return_advantages))
    if not return_advantages:
        outs.append(outs[0].new_empty(0))
    return outs[0], outs[1]


def forward_scan(x: Tensor, dones: Tensor, initial: Optional[Tensor], keep: float, time_dim: int,
                 out_dtype: torch.dtype) -> Tensor:
    """Eligibility traces (keep = gamma * lam) and episodic prefix sums (keep = 1)."""
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    xt = _tm(x, time_dim)
    d = _tm(dones, time_dim)
    d = d[(...,) + (None,) * (xt.ndim - d.ndim)].expand(xt.shape)  # broadcast over features
    launch(FORWARD, xt.shape[0], tuple(xt.shape[1:]), [xt, d], [_tm(out, time_dim)], (keep,),
           init=initial)
    return out


def linear_scan(alpha: Tensor, beta: Tensor, initial: Optional[Tensor], reverse: bool,
                time_dim: int, out_dtype: torch.dtype) -> Tensor:
    out = torch.empty(alpha.shape, dtype=out_dtype, device=alpha.device)
    a = _tm(alpha, time_dim)
    launch(SCAN_REVERSE if reverse else SCAN_FORWARD, a.shape[0], tuple(a.shape[1:]),
           [a, _tm(beta, time_dim)], [_tm(out, time_dim)], (0.0,), init=initial)
    return out


# ---- registration ----------------------------------------------------------------------------

def _fake_outputs(ref: Tensor, out_dtype: torch.dtype, n: int):
    return tuple(torch.empty(ref.shape, dtype=out_dtype, device=ref.device) for _ in range(n))


def _fake_retrace(rewards, q_values, actions, target_probs, behavior_probs, terminated, truncated,
                  last_q_values, last_target_probs, gamma, lam, c_clip, return_advantages,
                  time_dim, out_dtype):
    g = torch.empty(rewards.shape, dtype=out_dtype, device=rewards.device)
    adv = torch.empty(rewards.shape if return_advantages else (0,), dtype=out_dtype,
                      device=rewards.device)
    return g, adv


_FAKES = {
    gae: lambda *a: _fake_outputs(a[0], a[-1], 2),
    lambda_returns: lambda *a: _fake_outputs(a[0], a[-1], 1)[0],
    discounted_returns: lambda *a: _fake_outputs(a[0], a[-1], 1)[0],
    vtrace: lambda *a: _fake_outputs(a[0], a[-1], 2),
    retrace: _fake_retrace,
    forward_scan: lambda *a: _fake_outputs(a[0], a[-1], 1)[0],
    linear_scan: lambda *a: _fake_outputs(a[0], a[-1], 1)[0],
}
OPS = {}
for _fn, _fake in _FAKES.items():
    OPS[_fn.__name__] = torch.library.custom_op(f"rl_triton::{_fn.__name__}", _fn,
                                                mutates_args=())
    OPS[_fn.__name__].register_fake(_fake)


def call(fn, *args):
    """Run `fn`: through its custom op inside torch.compile, directly (no dispatcher) in eager."""
    if torch.compiler.is_compiling():
        return OPS[fn.__name__](*args)
    return fn(*args)
