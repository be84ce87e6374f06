"""Rollout correction (semantics §10): importance weights between the trainer's and the rollout
engine's log-probabilities of the sampled tokens, at token, sequence or geometric-mean level,
truncated (TIS) or turned into a rejection mask (MIS / IcePop). On CUDA one kernel, one program
per sequence (a pass for the sequence's sums where the level needs them, a pass that writes);
torch ops elsewhere; `backend="loop"` is `rl_triton.reference`'s sequential definition."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from .. import reference
from .. import _args
from .._args import check_backend, check_bool, check_choice, check_out_dtype, check_scalar
from .._core.op import Op, Plan
from .._core.plans import backend_for, unreadable
from ..scan.jit import tl, triton
from . import _losses as L
from .outcome import _mask, _values

Tensor = torch.Tensor
LEVELS = ("token", "sequence", "geometric", "max")
MODES = ("truncate", "mask")
STATISTICS = ("ratio", "k1", "k2", "k3", "binary_kl", "tv")


class Inputs(NamedTuple):
    log_probs: Tensor
    rollout_log_probs: Tensor
    mask: Optional[Tensor]
    cu_seqlens: Optional[Tensor]


class Options(NamedTuple):
    level: str
    mode: str
    low: Optional[float]
    high: Optional[float]
    statistic: str
    weight_level: Optional[str]
    log_ratio_clamp: Optional[float]
    out_dtype: torch.dtype
    check_offsets: bool = True


def _bound(name, value, low=-math.inf):
    return None if value is None else check_scalar(name, value, low=low, high=None)


def _torch(lp, rp, mask, *, level, mode, low, high, statistic, weight_level, log_ratio_clamp,
           cu_seqlens):
    dtype = torch.promote_types(torch.promote_types(lp.dtype, rp.dtype), torch.float32)
    on = torch.ones_like(lp, dtype=torch.bool) if mask is None else mask != 0
    lp, rp = torch.where(on, lp.to(dtype), 0.0), torch.where(on, rp.to(dtype), 0.0)
    d = lp - rp  # masked positions reach nothing: 0 there
    if cu_seqlens is None:
        def reduce(x, how):  # over each row, broadcast back to its tokens
            if how == "sum":
                r = x.sum(dim=-1, keepdim=True)
            else:
                r = torch.where(on, x, -torch.inf).amax(dim=-1, keepdim=True)
            return r.expand_as(x)
    else:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=lp.device), lengths,
                                      output_size=lp.shape[0])

        def reduce(x, how):
            if how == "sum":
                return x.new_zeros(lengths.numel()).index_add_(0, seg, x)[seg]
            return x.new_full((lengths.numel(),), -torch.inf).scatter_reduce(
                0, seg, torch.where(on, x, -torch.inf), "amax")[seg]

    def aggregate(x, lvl):
        if lvl == "token":
            return x
        if lvl == "max":
            m = reduce(x, "max")
            return torch.where(m == -torch.inf, 0.0, m)  # a sequence without a set position
        s = reduce(x, "sum")
        if lvl == "geometric":
            s = s / reduce(on.to(dtype), "sum").clamp(min=1)
        return s

    def ratio(s):
        return torch.exp(s if log_ratio_clamp is None else s.clamp(-log_ratio_clamp,
                                                                  log_ratio_clamp))

    if statistic == "ratio":
        r = ratio(aggregate(d, level))
    else:
        r = aggregate(torch.where(on, reference.rollout_divergence(statistic, d, lp, rp,
                                                                   log_ratio_clamp), 0.0), level)
    if mode == "truncate":
        w = r if low is None and high is None else r.clamp(min=low, max=high)
        return torch.where(on, w, 0.0), on
    keep = on
    if low is not None:
        keep = keep & (r >= low)
    if high is not None:
        keep = keep & (r <= high)
    if weight_level is None:
        w = r if statistic == "ratio" else torch.ones_like(r)
    else:
        w = ratio(aggregate(d, weight_level))
    return torch.where(keep, w, 0.0), keep


# ---- the kernel ------------------------------------------------------------------------------

# constexpr codes: LEVEL / WLEVEL index LEVELS (WLEVEL -1: no weight level), STAT STATISTICS
@triton.jit
def _statistic(d, lp, rp, on, clamp, STAT: tl.constexpr, HAS_CLAMP: tl.constexpr):
    """The per-token statistic (0 where `on` is not set): the log-ratio, or a divergence."""
    if STAT == 0:
        x = d
    elif STAT <= 3:
        if HAS_CLAMP:
            d = L.clamp(d, -clamp, clamp)
        if STAT == 1:
            x = -d
        elif STAT == 2:
            x = 0.5 * d * d
        else:
            x = tl.exp(d) - 1.0 - d
    else:
        p = L.clamp(tl.exp(rp), 1e-6, 1.0 - 1e-6)
        q = L.clamp(tl.exp(lp), 1e-6, 1.0 - 1e-6)
        if STAT == 4:
            x = p * tl.log(p / q) + (1.0 - p) * tl.log((1.0 - p) / (1.0 - q))
        else:
            x = tl.abs(p - q)
    return tl.where(on, x, 0.0)


@triton.jit
def _level(s_sum, n, s_max, LEVEL: tl.constexpr):
    """The sequence's aggregate: sum, mean (0 without a set position) or max (0 likewise)."""
    if LEVEL == 1:
        return s_sum
    elif LEVEL == 2:
        return s_sum / tl.maximum(n, 1.0)
    else:
        return tl.where(s_max == -float("inf"), 0.0, s_max)


@triton.jit
def _exp(s, clamp, HAS_CLAMP: tl.constexpr):
    if HAS_CLAMP:
        s = L.clamp(s, -clamp, clamp)
    return tl.exp(s)


@triton.jit
def rollout_kernel(lp_ptr, rp_ptr, mask_ptr, w_ptr, keep_ptr, cu_ptr, T, low, high, clamp,
                   LEVEL: tl.constexpr, WLEVEL: tl.constexpr, STAT: tl.constexpr,
                   TRUNCATE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_LOW: tl.constexpr,
                   HAS_HIGH: tl.constexpr, HAS_CLAMP: tl.constexpr, PACKED: tl.constexpr,
                   BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    if PACKED:
        a = tl.load(cu_ptr + pid).to(tl.int64)
        b = tl.load(cu_ptr + pid + 1).to(tl.int64)
    else:
        a = pid * T
        b = a + T
    lanes = tl.arange(0, BLOCK)
    x_sum = tl.zeros([BLOCK], tl.float32)
    d_sum = tl.zeros([BLOCK], tl.float32)
    count = tl.zeros([BLOCK], tl.float32)
    x_max = tl.full([BLOCK], -float("inf"), tl.float32)
    if LEVEL != 0 or WLEVEL > 0:  # pass 1: the sequence's sums
        for start in range(a, b, BLOCK):
            i = start + lanes
            on = i < b
            if HAS_MASK:
                on = on & (tl.load(mask_ptr + i, mask=on, other=0) != 0)
            lp = tl.where(on, tl.load(lp_ptr + i, mask=on, other=0.0).to(tl.float32), 0.0)
            rp = tl.where(on, tl.load(rp_ptr + i, mask=on, other=0.0).to(tl.float32), 0.0)
            d = lp - rp
            x = _statistic(d, lp, rp, on, clamp, STAT, HAS_CLAMP)
            x_sum += x
            d_sum += d
            count += on.to(tl.float32)
            x_max = L.maximum(x_max, tl.where(on, x, -float("inf")))
    n = tl.sum(count, 0)
    # (tl.max drops a NaN, as fmax does: a NaN statistic makes its sequence's max NaN)
    s_max = tl.where(tl.max((x_max != x_max).to(tl.int32), 0) > 0, float("nan"),
                     tl.max(x_max, 0))
    seq_x = _level(tl.sum(x_sum, 0), n, s_max, LEVEL)
    seq_d = _level(tl.sum(d_sum, 0), n, s_max, WLEVEL)
    for start in range(a, b, BLOCK):  # pass 2: the weights and the kept tokens
        i = start + lanes
        inb = i < b
        on = inb
        if HAS_MASK:
            on = on & (tl.load(mask_ptr + i, mask=inb, other=0) != 0)
        lp = tl.where(on, tl.load(lp_ptr + i, mask=on, other=0.0).to(tl.float32), 0.0)
        rp = tl.where(on, tl.load(rp_ptr + i, mask=on, other=0.0).to(tl.float32), 0.0)
        d = lp - rp
        if LEVEL == 0:
            s = _statistic(d, lp, rp, on, clamp, STAT, HAS_CLAMP)
        else:
            s = tl.zeros([BLOCK], tl.float32) + seq_x
        if STAT == 0:
            r = _exp(s, clamp, HAS_CLAMP)
        else:
            r = s
        keep = on
        if TRUNCATE:
            w = r
            if HAS_LOW:
                w = L.maximum(w, low)
            if HAS_HIGH:
                w = L.minimum(w, high)
        else:
            if HAS_LOW:
                keep = keep & (r >= low)
            if HAS_HIGH:
                keep = keep & (r <= high)
            if WLEVEL < 0:
                if STAT == 0:
                    w = r
                else:
                    w = tl.full([BLOCK], 1.0, tl.float32)
            elif WLEVEL == 0:
                w = _exp(d, clamp, HAS_CLAMP)
            else:
                w = _exp(tl.zeros([BLOCK], tl.float32) + seq_d, clamp, HAS_CLAMP)
        tl.store(w_ptr + i, tl.where(keep, w, 0.0).to(w_ptr.dtype.element_ty), mask=inb)
        tl.store(keep_ptr + i, keep.to(tl.uint8), mask=inb)


def _fixed(x, o):
    """The launch's grid, scalars and constexprs (fixed by the call's signature): one program
    per row of the `[..., T]` inputs, or per segment."""
    lp, cu = x.log_probs, x.cu_seqlens
    T = lp.shape[-1] if cu is None else 0
    programs = (lp.numel() // T if T else 0) if cu is None else cu.numel() - 1
    scalars = tuple(0.0 if v is None else v for v in (o.low, o.high, o.log_ratio_clamp))
    return programs, T, scalars, dict(
        LEVEL=LEVELS.index(o.level),
        WLEVEL=-1 if o.weight_level is None else LEVELS.index(o.weight_level),
        STAT=STATISTICS.index(o.statistic), TRUNCATE=o.mode == "truncate",
        HAS_MASK=x.mask is not None, HAS_LOW=o.low is not None, HAS_HIGH=o.high is not None,
        HAS_CLAMP=o.log_ratio_clamp is not None, PACKED=cu is not None,
        BLOCK=L.block(min(T or lp.numel(), 1024)), num_warps=4)


def _triton(x, o, plan=None):
    """(weights, kept mask) by `rollout_kernel`, which reads its inputs as flat arrays (the
    contiguous tensors as they are: it reads their addresses)."""
    lp, rp, mask, cu = x
    programs, T, scalars, meta = L.fixed(plan, _fixed, x, o)
    lp = lp if lp.is_contiguous() else lp.contiguous()
    rp = rp if rp.is_contiguous() else rp.contiguous()
    if mask is not None:
        mask = mask if mask.is_contiguous() else mask.contiguous()
        mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    w = torch.empty(lp.shape, dtype=o.out_dtype, device=lp.device)
    keep = torch.empty(lp.shape, dtype=torch.uint8, device=lp.device)
    if programs:
        L.launch(rollout_kernel, programs, lp, rp, lp if mask is None else mask, w, keep,
                 lp if cu is None else cu, T, *scalars, **meta, plan=plan)
    return w, keep.view(torch.bool)


# ---- the op ------------------------------------------------------------------------------------

def _check(t: tuple, a: tuple):
    """The public call's arguments checked (`rollout_correction`'s order): (inputs, plan),
    every error raised here, a function of the call's signature (the offsets' values aside:
    `runtime_check`)."""
    log_probs, rollout_log_probs, mask, cu_seqlens = t
    (level, mode, low, high, statistic, weight_level, log_ratio_clamp, check_offsets, backend,
     out_dtype) = a
    backend = check_backend(backend)
    out_dtype = check_out_dtype(out_dtype)
    lp = _values("log_probs", log_probs)
    rp = _values("rollout_log_probs", rollout_log_probs)
    if rp.device != lp.device:
        raise ValueError(f"rollout_log_probs is on {rp.device} but log_probs is on {lp.device}")
    if rp.shape != lp.shape:
        raise ValueError(f"rollout_log_probs has shape {tuple(rp.shape)}; expected log_probs' "
                         f"{tuple(lp.shape)}")
    if mask is not None:
        mask = _mask(mask, lp.device)
        if mask.shape != lp.shape:
            raise ValueError(f"mask has shape {tuple(mask.shape)}; expected log_probs' "
                             f"{tuple(lp.shape)}")
    level = check_choice("level", level, LEVELS)
    mode = check_choice("mode", mode, MODES)
    statistic = check_choice("statistic", statistic, STATISTICS)
    if weight_level is not None:
        weight_level = check_choice("weight_level", weight_level, LEVELS[:3])
        if mode != "mask":
            raise ValueError("weight_level is for mode 'mask' (a truncated weight is the gated "
                             "ratio itself)")
    if statistic != "ratio" and mode != "mask":
        raise ValueError(f"statistic={statistic!r} gates tokens: it needs mode='mask'")
    low, high = _bound("low", low), _bound("high", high)
    if low is not None and high is not None and low > high:
        raise ValueError(f"low={low} is above high={high}")
    clamp = _bound("log_ratio_clamp", log_ratio_clamp, low=0.0)
    check_offsets = check_bool("check_offsets", check_offsets)
    if cu_seqlens is None:
        if lp.ndim < 1:
            raise ValueError("log_probs must have a sequence axis (the last): shape [..., T]")
    else:
        if lp.ndim != 1:
            raise ValueError(f"packed log_probs must have shape [L]; got {tuple(lp.shape)}")
        cu_seqlens = _args.check_offsets(cu_seqlens, lp.shape[0], lp.device,
                                         data=check_offsets and not unreadable())
    o = Options(level, mode, low, high, statistic, weight_level, clamp, out_dtype, check_offsets)
    return Inputs(lp, rp, mask, cu_seqlens), Plan(o, backend_for(backend, lp.device))




def _options(x: Inputs, o: Options) -> dict:
    return dict(level=o.level, mode=o.mode, low=o.low, high=o.high, statistic=o.statistic,
                weight_level=o.weight_level, log_ratio_clamp=o.log_ratio_clamp,
                cu_seqlens=x.cu_seqlens)


def torch_impl(x: Inputs, o: Options, dtype=None):
    return _torch(x.log_probs, x.rollout_log_probs, x.mask, **_options(x, o))


def loop_impl(x: Inputs, o: Options, dtype=None):
    return reference.rollout_correction(x.log_probs, x.rollout_log_probs, x.mask,
                                        **_options(x, o))


def forward(x: Inputs, o: Options, plan=None):
    return list(_triton(x, o, plan)), []


def fake(x: Inputs, o: Options):
    lp = x.log_probs
    return [lp.new_empty(lp.shape, dtype=o.out_dtype),
            lp.new_empty(lp.shape, dtype=torch.bool)], []


def _run(x: Inputs, plan: Plan) -> tuple:
    """The checked call on its backend: (weights, kept mask), constants of the loss (no
    gradient, docstring)."""
    o = plan.o
    if plan.backend == "triton" and not torch.compiler.is_compiling():
        return tuple(OP.forward(x, o, plan)[0])  # (the kernel: no autograd)
    with torch.no_grad():
        if plan.backend == "triton":
            w, keep = OP.triton(x, o, plan, False)
            return w, keep
        w, keep = (torch_impl if plan.backend == "torch" else loop_impl)(x, o)
    return w.to(o.out_dtype), keep


# declared as an op (docs/dev/op-framework.md): checks, custom op and hot path the framework's;
# no gradients (its weights are constants of the loss), so its own route (`_run`)
OP = Op("rollout_correction", "loss", Inputs, Options, outputs=2, nondiff=(0, 1),
        forward=forward, fake=fake, check=_check, runtime_check=L.runtime_check,
        torch=torch_impl, loop=loop_impl, run=_run)


def rollout_correction(log_probs, rollout_log_probs, mask=None, *, level="token",
                       mode="truncate", low=None, high=2.0, statistic="ratio",
                       weight_level=None, log_ratio_clamp=20.0, cu_seqlens=None,
                       check_offsets=True, backend="auto", out_dtype=torch.float32):
    """Importance weights for the mismatch between the rollout engine's sampling policy and the
    trainer's, and the mask of the tokens they keep. Returns `(weights, mask)`.

    With `d = log_probs - rollout_log_probs` (the trainer's log-probability of each sampled
    token less the engine's) over the positions `mask` sets, a sequence being a row of the
    `[..., T]` inputs (or a segment of `cu_seqlens`, semantics §7), `statistic="ratio"`::

        level="token":      s = d[t]                           (the token's own ratio)
        level="sequence":   s = sum of d over the sequence     (the product of the ratios)
        level="geometric":  s = mean of d over the sequence    (their geometric mean)
        level="max":        s = max of d over the sequence
        r = exp(clamp(s, -log_ratio_clamp, log_ratio_clamp))  (no clamp with None)

        mode="truncate":  w = clamp(r, low, high)       (TIS; a bound None is absent)
        mode="mask":      keep = low <= r <= high       (MIS / IcePop; a bound None is absent)
                          w = r where keep, else 0, and the returned mask drops the rest

    A divergence `statistic` gates (mode "mask") on a per-token estimate of
    KL(pi_rollout || pi_trainer) instead, with d clamped to +-log_ratio_clamp first: "k1" -d,
    "k2" d^2 / 2, "k3" exp(d) - 1 - d; or on the sampled token's probabilities p (engine) and
    q (trainer), both clamped to [1e-6, 1 - 1e-6]: "binary_kl" p log(p/q) + (1-p) log((1-p) /
    (1-q)), "tv" |p - q|; aggregated by `level` (sum, mean or max over the sequence) and
    compared with [low, high] as it is (no exp). `weight_level` is the level of the ratio a kept
    token carries: by default the gated ratio itself (`statistic="ratio"`) or 1 (a divergence);
    OpenRLHF's seq-mask-tis gates whole sequences by the geometric mean and keeps each token's
    own ratio (`level="geometric", weight_level="token"`). Weights are 0 where the returned
    mask is not set; they are constants of the loss (no gradient, as in every framework: they
    change the measure, not the objective). The returned mask is bool: `mask` (all set when
    None) and, in mode "mask", the kept tokens. A sequence without a set position gets 0 for its
    sum, mean and max. A non-finite log-probability at a position `mask` removes reaches no
    output. docs/llm.md lists the options that reproduce verl's, OpenRLHF's and TRL's.

    Example::

        >>> w, keep = rl_triton.rollout_correction(old_log_probs, rollout_log_probs, mask,
        ...                                        level="token", mode="mask", low=0.5, high=5.0)
        >>> loss = (per_token_loss * w * keep).sum() / keep.sum()
    """
    return OP((log_probs, rollout_log_probs, mask, cu_seqlens),
              (level, mode, low, high, statistic, weight_level, log_ratio_clamp, check_offsets,
               backend, out_dtype))
