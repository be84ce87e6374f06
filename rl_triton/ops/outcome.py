"""Outcome rewards (semantics §8): group-relative advantages (GRPO, Dr. GRPO, RLOO) and masked
whitening, global over a `torch.distributed` group.

Both are a handful of reductions over one score per response (or one value per token), not
scans. `group_advantages` runs as vectorized torch ops ("loop": the float64-capable sequential
references of `rl_triton.reference`), differentiable by autograd, and on the Triton backend by
`group_size` as the one kernel of `_group` where no gradient is needed; `masked_whiten` runs as
torch ops on the torch and loop backends, and on the Triton backend the kernels of `_whiten`
(two launches forward, three backward). Both are `_core.op.Op`s of kind "outcome"
(docs/dev/op-framework.md): their custom ops (`torch.ops.rl_triton.<name>`; whitening over a
process group is traced as torch ops instead), autograd and hot path are the framework's.
"""
from __future__ import annotations

import numbers

import torch

from .. import reference
from typing import NamedTuple, Optional

from .._args import (FLAG_DTYPES, INDEX, VALUE, _check_dtype, _flag_grad_error, check_backend,
                     check_out_dtype, resolved)
from .._core.op import Op, Plan, first_order
from .._core.plans import backend_for
from . import _group, _whiten

Tensor = torch.Tensor
BASELINES = ("mean", "leave_one_out")
SCALES = ("std", "none", "batch_std")


def _choice(name, value, options):
    if not isinstance(value, str) or value not in options:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, options))}; got {value!r}")
    return value


def _nonneg(name, value, kind=numbers.Real):
    if isinstance(value, bool) or not isinstance(value, kind) or not value >= 0:
        what = "a non-negative integer" if kind is numbers.Integral else "a non-negative number"
        raise (TypeError if not isinstance(value, numbers.Real) or isinstance(value, bool)
               else ValueError)(f"{name} must be {what}, got {value!r}")
    return value


def _tensor(name, x, device=None):
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} is on {x.device} but the data is on {device}; all tensors "
                         "must be on one device")
    return x


def _values(name, x):
    x = _tensor(name, x)
    _check_dtype(name, x.dtype, VALUE)
    return resolved(x)


def _mask(mask, device):
    """A mask (bool / integer / float, set where nonzero) as 0/1 in its place."""
    mask = _tensor("mask", mask, device)
    if mask.dtype not in FLAG_DTYPES:
        raise TypeError(f"mask has dtype {mask.dtype}; expected bool, uint8, int8, int16, int32, "
                        "int64, float32, float64, bfloat16 or float16")
    if mask.requires_grad and torch.is_grad_enabled():  # never a silent detach
        raise _flag_grad_error("mask")
    return mask


def _process_group(group):
    """`group` if it is None or a `torch.distributed` process group; else TypeError (before
    any work: an all-reduce would fail only after the first kernels ran)."""
    if group is None:
        return None
    dist = torch.distributed
    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(f"group must be a torch.distributed process group (e.g. "
                        f"torch.distributed.group.WORLD) or None, got {type(group).__name__}")
    return group


def _float(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype is torch.float64 else torch.float32


class GroupInputs(NamedTuple):
    scores: Tensor
    group_index: Optional[Tensor]
    mask: Optional[Tensor]


class GroupTensors(NamedTuple):  # the kernel's (consecutive groups, no gradient)
    scores: Tensor


class GroupOptions(NamedTuple):
    group_size: int
    baseline: str
    scale: str
    eps: float
    std_correction: int
    out_dtype: torch.dtype


def _group_check(t: tuple, a: tuple):
    """`group_advantages`' arguments checked: (inputs, plan)."""
    scores, group_index, mask = t
    group_size, baseline, scale, eps, std_correction, backend, out_dtype = a
    backend = check_backend(backend)
    out_dtype = check_out_dtype(out_dtype)
    s = _values("scores", scores)
    if s.ndim != 1:
        raise ValueError(f"scores must have shape (B,), one score per response; got shape "
                         f"{tuple(s.shape)}")
    B = s.shape[0]
    baseline = _choice("baseline", baseline, BASELINES)
    scale = _choice("scale", scale, SCALES)
    eps = float(_nonneg("eps", eps))
    correction = _nonneg("std_correction", std_correction, numbers.Integral)
    if (group_index is None) == (group_size is None):
        raise ValueError("pass exactly one of group_index (a group id per response) and "
                         "group_size (consecutive groups of that many responses)")
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral):
            raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
        if group_size < 1 or B % group_size:
            raise ValueError(f"group_size={group_size} must be positive and divide the number "
                             f"of scores, {B}")
        gi = None
    else:
        gi = _tensor("group_index", group_index, s.device)
        _check_dtype("group_index", gi.dtype, INDEX)
        if gi.shape != s.shape:
            raise ValueError(f"group_index has shape {tuple(gi.shape)} but scores has shape "
                             f"{tuple(s.shape)}; one group id per score")
    if mask is not None:
        mask = _mask(mask, s.device)
        if mask.ndim != 2 or mask.shape[0] != B:
            raise ValueError(f"mask has shape {tuple(mask.shape)}; expected (B, T) with B = "
                             f"{B}, the number of scores")
    o = GroupOptions(0 if group_size is None else int(group_size), baseline, scale, eps,
                     correction, out_dtype)  # (a NumPy integer too)
    backend = backend_for(backend, s.device)
    needs_grad = s.requires_grad and torch.is_grad_enabled()
    return GroupInputs(s, gi, mask), Plan(o, backend, needs_grad, _float(s))


def _group_forward(x: GroupTensors, o: GroupOptions, plan=None):
    return [_group.group_advantages(x.scores, o.group_size, baseline=o.baseline, scale=o.scale,
                                    eps=o.eps, std_correction=o.std_correction,
                                    memo=None if plan is None else plan.memo)], []


def _group_run(x: GroupInputs, plan: Plan) -> Tensor:
    s, o = x.scores, plan.o
    B = s.shape[0]
    args = dict(baseline=o.baseline, scale=o.scale, eps=o.eps, std_correction=o.std_correction)
    # one kernel (_group, through the framework: the custom op inside torch.compile); scores
    # that need gradients, float64 ones and groups by index run the torch ops (differentiable
    # by autograd)
    fused = plan.memo.get("fused")  # (the signature fixes it)
    if fused is None:
        fused = plan.memo["fused"] = (
            plan.backend == "triton" and x.group_index is None and not plan.needs_grad
            and _group.usable(s, o.group_size))
    if fused:
        (a,) = GROUP.triton(GroupTensors(s), o, plan, False)
    else:
        if x.group_index is None:
            n_groups = B // o.group_size
            ids = torch.arange(B, device=s.device) // o.group_size
        else:
            _, ids = torch.unique(x.group_index, return_inverse=True)  # 0..G-1 (a CUDA sync)
            n_groups = int(ids.max()) + 1 if B else 0
        if plan.backend == "loop":
            a = reference.group_advantages(s, ids, **args, dtype=_float(s))
        else:
            a = _group_advantages_torch(s.to(_float(s)), ids, n_groups, **args)
    if x.mask is not None:  # a select: a NaN or inf advantage stays out of masked-out tokens
        a = torch.where(x.mask != 0, a[:, None], 0.0)
    return _first_order(a if a.dtype is o.out_dtype else a.to(o.out_dtype), plan)


GROUP = Op("group_advantages", "outcome", GroupInputs, GroupOptions, tensors=GroupTensors,
           outputs=1, forward=_group_forward, check=_group_check, run=_group_run,
           fake=lambda x, o: ([x.scores.new_empty(x.scores.shape, dtype=torch.float32)], []))


def group_advantages(scores, group_index=None, *, group_size=None, baseline="mean",
                     scale="std", eps=1e-6, std_correction=1, mask=None, backend="auto",
                     out_dtype=torch.float32):
    """Group-relative advantages of one score per sampled response (semantics §8).

    Groups are given by `group_index[B]` (any integer ids, in any order: one per prompt) or by
    `group_size=n` (consecutive groups of n responses). With mu and sigma the group's mean and
    standard deviation (`std_correction=1`: unbiased, as `torch.std`)::

        baseline="mean":          a = s - mu
        baseline="leave_one_out": a = s - (sum - s) / (n - 1)           (RLOO)
        scale="std":              a / (sigma + eps)                     (GRPO)
        scale="none":             a                                     (Dr. GRPO, RLOO)
        scale="batch_std":        a / (std of all B scores + eps)

    A group of one gets baseline 0 and scale 1. With `mask[B, T]` the result is broadcast to
    tokens, `a[:, None]` where the mask is set and 0 elsewhere (whatever the score). A NaN
    score makes its own group NaN and no other (with `scale="batch_std"`, all). `group_index`
    costs one device sync (the ids are renumbered); `group_size` none.

    Example::

        >>> adv = rl_triton.group_advantages(rewards, group_size=8)  # GRPO, 8 samples a prompt
        >>> tok = rl_triton.group_advantages(rewards, prompt_ids, scale="none", mask=resp_mask)
    """
    return GROUP((scores, group_index, mask),
                 (group_size, baseline, scale, eps, std_correction, backend, out_dtype))


def _group_advantages_torch(s, ids, n_groups, *, baseline, scale, eps, std_correction):
    def per_group(x):
        return torch.zeros(n_groups, dtype=s.dtype, device=s.device).index_add(0, ids, x)

    n = per_group(torch.ones_like(s))
    lone = n == 1
    alone = lone[ids]
    # groups of one get baseline 0 and scale 1 (the final select): their scores enter no
    # statistic, whose gradient would be 0 * NaN for a NaN or inf score, and the statistics
    # are kept finite so that no NaN reaches the gradients of the others through that select
    x = torch.where(alone, 0.0, s)
    # shifted by the group's first score, as the kernel (no gradient: the baseline cancels
    # it): a float32 mean of scores whose mean is far above their spread keeps their digits
    position = torch.arange(s.shape[0], device=s.device)
    first = torch.full((n_groups,), s.shape[0] - 1, device=s.device).scatter_reduce(
        0, ids, position, "amin")
    c = x.detach()[first]
    x = x - torch.where(c.isfinite(), c, 0.0)[ids]  # (a non-finite one: no shift)
    total = per_group(x)
    mu = total / n
    dev = x - mu[ids]
    var = per_group(dev * dev) / torch.where(lone, 1.0, n - std_correction).clamp_min(0)
    if baseline == "mean":
        a = dev
    else:  # the mean of the others: (sum - s) / (n - 1), shifted alike
        a = x - (total[ids] - x) / torch.where(alone, 1.0, n[ids] - 1)
    if scale == "std":
        a = a / (torch.where(lone, 1.0, var).sqrt()[ids] + eps)
    elif scale == "batch_std":
        a = a / (_group.batch_std(s, std_correction) + eps)
    return torch.where(alone, s, a)  # a group of one: baseline 0, scale 1


class WhitenInputs(NamedTuple):
    x: Tensor
    mask: Optional[Tensor]


class WhitenOptions(NamedTuple):
    shift_mean: bool
    eps: float
    std_correction: int
    out_dtype: torch.dtype


def _whiten_check(t: tuple, a: tuple):
    """`masked_whiten`'s arguments checked: (inputs, plan); `plan.group` the process group."""
    x, mask = t
    shift_mean, eps, std_correction, group, backend, out_dtype = a
    backend = check_backend(backend)
    out_dtype = check_out_dtype(out_dtype)
    x = _values("x", x)
    if mask is not None:
        mask = _mask(mask, x.device)
        if mask.shape != x.shape:
            raise ValueError(f"mask has shape {tuple(mask.shape)} but x has shape "
                             f"{tuple(x.shape)}; they must match")
    if not isinstance(shift_mean, bool):
        raise TypeError(f"shift_mean must be a bool, got {type(shift_mean).__name__}")
    eps = float(_nonneg("eps", eps))
    correction = _nonneg("std_correction", std_correction, numbers.Integral)
    group = _process_group(group)
    plan = Plan(WhitenOptions(shift_mean, eps, correction, out_dtype),
                backend_for(backend, x.device), x.requires_grad and torch.is_grad_enabled(),
                _float(x))
    plan.group = group
    return WhitenInputs(x, mask), plan


def _whiten_opts(o: WhitenOptions, plan) -> tuple:
    return (o.shift_mean, o.eps, o.std_correction, None if plan is None else plan.group,
            o.out_dtype)


def _whiten_forward(x: WhitenInputs, o: WhitenOptions, plan=None):
    plain = False
    if plan is not None:  # what the signature fixes, once
        plain = plan.memo.get("plain")
        if plain is None:
            plain = plan.memo["plain"] = all(t is None or (t.is_contiguous() and not t.is_neg())
                                             for t in x)
    with _whiten._on(x.x.device):
        y, stats = _whiten._forward(x.x, x.mask, _whiten_opts(o, plan), plain,
                                    plan.memo if plain else None)
    return [y], [stats]


def _whiten_backward(x: WhitenInputs, o: WhitenOptions, saved, grads, needs, plan=None):
    (g,) = grads
    if g is None or not needs[0]:
        return [None, None]
    with _whiten._on(x.x.device):
        return [_whiten._backward(x.x, x.mask, saved[0], g, _whiten_opts(o, plan)), None]


def _whiten_run(x: WhitenInputs, plan: Plan) -> Tensor:
    if plan.backend == "triton" and (plan.group is None or not torch.compiler.is_compiling()):
        # (inside torch.compile a process group's whitening is traced as the torch ops below:
        # a custom op's schema holds no process group)
        return WHITEN.triton(x, plan.o, plan, plan.needs_grad)[0]
    x, mask, o, group, backend = x.x, x.mask, plan.o, plan.group, plan.backend
    shift_mean, eps, correction, out_dtype = o
    m = torch.ones_like(x, dtype=torch.bool) if mask is None else mask != 0
    dtype = _float(x)
    if backend == "loop":
        if group is not None:
            raise ValueError("backend='loop' whitens one process's data; pass group=None")
        out = reference.masked_whiten(x, m, shift_mean=shift_mean, eps=eps,
                                      std_correction=correction, dtype=dtype)
        return _first_order(out.to(out_dtype), plan)
    # from xs, not x: a NaN at a masked position would reach the gradients through d out / d var
    xs = torch.where(m, x.to(dtype), 0.0)
    # float64 statistics, centered on this process's mean first (as the Triton path's): a
    # float32 sum of squares loses (mean / std)^2 ulps, 0.1 relative at a mean of 1e4 std
    count = m.sum().to(torch.float64)
    total = xs.sum(dtype=torch.float64)
    mean = total / count.clamp_min(1)
    d = torch.where(m, _centered(xs, mean), 0.0)
    m2 = (d * d).sum(dtype=torch.float64)
    if group is not None:
        import torch.distributed.nn.functional as dist_fn  # differentiable all-reduce

        # one all-reduce of (count, sum, sum of squares), each process's sum of squares from
        # its centered M2: the cancellation below is in float64, 1e-8 relative at 1e4 std
        count, total, squares = dist_fn.all_reduce(
            torch.stack([count, total, m2 + total * mean]), group=group)
        mean = total / count.clamp_min(1)
        m2 = (squares - total * mean).clamp_min(0)
    # fewer than 1 + std_correction positions: the variance is undefined, NaN (never 0 / 0's
    # luck, nor a division whose backward is 0 / 0 where the select drops it)
    valid = count > correction
    var = torch.where(valid, m2 / torch.where(valid, count - correction, 1.0), torch.nan)
    out = _centered(xs, mean) * torch.rsqrt(var + eps).to(dtype)
    if not shift_mean:
        out = out + mean.to(dtype)
    return _first_order(torch.where(m, out, 0.0).to(out_dtype), plan)


def _first_order(out: Tensor, plan: Plan) -> Tensor:
    """The torch and loop backends' output, refusing second-order gradients as every op does."""
    outs = [out]
    if plan.needs_grad:
        first_order(outs)
    return outs[0]




def _whiten_like(x: Tensor, dtype: torch.dtype) -> Tensor:
    """A new tensor laid out as the kernels write x's result or gradient (`_whiten._unflat`)."""
    return _whiten._unflat(x.new_empty(x.numel(), dtype=dtype), x, _whiten._order(x))


WHITEN = Op("masked_whiten", "outcome", WhitenInputs, WhitenOptions, outputs=1, saved=1,
            forward=_whiten_forward, backward=_whiten_backward, check=_whiten_check,
            run=_whiten_run, grad_like=lambda t: _whiten_like(t, t.dtype),
            fake=lambda x, o: ([_whiten_like(x.x, o.out_dtype)],
                               [x.x.new_empty(3, dtype=torch.float64)]))


def masked_whiten(x, mask=None, *, shift_mean=True, eps=1e-8, std_correction=1, group=None,
                  backend="auto", out_dtype=torch.float32):
    """`(x - mean) * rsqrt(var + eps)` over the positions where `mask` is set (semantics §8).

    Mean and variance (`std_correction=1`: unbiased) are taken over the masked-in positions of
    `x` (all without a mask); `shift_mean=False` adds the mean back; masked positions are 0.
    With `group` (a `torch.distributed` process group) mean and variance are global over its
    ranks, from one all-reduce of (count, sum, sum of squares) in float64: the result equals
    whitening the concatenation of every rank's data, and gradients flow across ranks (every
    rank calls it with the same backend: the Triton backward all-reduces its own sums); a
    `group` that is not a process group raises TypeError. Every backend accumulates in float64
    around a first estimate of the mean, so float32 data far from zero (mean 1e4 std) keeps
    float32 precision. Fewer than `1 + std_correction` positions set: NaN there. A NaN or inf
    at a masked position reaches neither the result nor any gradient.

    Example::

        >>> adv = rl_triton.masked_whiten(advantages, response_mask)  # PPO's normalization
    """
    return WHITEN((x, mask), (shift_mean, eps, std_correction, group, backend, out_dtype))


def _centered(x: Tensor, mean: Tensor) -> Tensor:
    """x - mean in x's dtype, the float64 mean as hi + lo: x - hi is exact near the mean, so
    the digits that |mean| >> std would round away from x - mean.to(dtype) are kept."""
    hi = mean.to(x.dtype)
    return (x - hi) - (mean - hi.to(mean.dtype)).to(x.dtype)
