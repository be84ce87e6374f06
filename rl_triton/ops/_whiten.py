"""`masked_whiten`'s Triton path (semantics §8), two launches forward (three past 8M elements),
three backward: the kernels of the op `outcome.WHITEN` (its autograd and custom op are the
framework's, `_core.op`).

Forward: a reduction pass (each program its block's count, mean and centered sum of squares),
whose last program combines the blocks in float64 (Chan's parallel formula, `_last_program`;
past LAST_MAX blocks a one-program kernel after it), the all-reduce over a process group where
there is one, then an elementwise pass. Backward, with xhat = (x - mean) r and
r = rsqrt(var + eps), var = M2 / (n - c), over the masked-in positions:

    dx = r (g - A / n - xhat B / (n - c)) + [not shift_mean] A / n,   A = sum g, B = sum g xhat

(0 at masked positions): a reduction pass of A and B, their float64 sum (all-reduced over the
group: the gradient of global statistics), then an elementwise pass. Arithmetic is float32
(float64 for float64 inputs); the statistics are float64 from the combine on.

A process group all-reduces each rank's (n, sum, M2 + n mean^2) in float64: the semantics' one
all-reduce of (count, sum, sum of squares), each rank's part centered first; M2 = sum of
squares - sum * mean then loses about 1e-16 (mean / std)^2 relatively (1e-10 at
|mean| = 1000 std), where one process's Chan combination loses nothing.
"""
from __future__ import annotations

import contextlib

import torch

from ..scan.jit import cdiv, tl, triton
from ..scan.launch import _current_device, launch
from ._last_program import last_program, reset, scratch

Tensor = torch.Tensor
# memory-bound passes on the H200: 8192 elements per program of the reductions keeps the
# partials few (1024 at 32 MB of float32) for the last program to combine; 4096 elementwise
BLOCK = 8192
WARPS = 8
APPLY_BLOCK = 4096
APPLY_WARPS = 4
COMBINE_BLOCK = 4096  # partials per step of the combining kernel
# The reduction pass's last program combines up to LAST_MAX partials (at most 4 steps of
# LAST_BLOCK: its float64 tile costs the pass registers, each step a round trip to L2); more
# partials (past 8M elements) go to the combining kernel, where one more launch costs nothing
LAST_BLOCK = 256
LAST_MAX = 4 * LAST_BLOCK


@triton.jit
def _offsets(start, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """A block's offsets as a [BLOCK // VEC, VEC] tile, VEC elements of x to a 16-byte load: a
    1-byte mask's loads then take VEC elements too, and x, mask and output share one layout
    (a flat block loads the mask 16 at a time and converts through shared memory)."""
    return start + tl.arange(0, BLOCK // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]


@triton.jit
def _load(ptr, offs, N, FULL: tl.constexpr):
    """Bounds checks only in the last, partial block: a bounded load of a length that is not
    a multiple of 16 cannot be vectorized."""
    if FULL:
        return tl.load(ptr + offs)
    return tl.load(ptr + offs, mask=offs < N, other=0)


@triton.jit
def _store(ptr, offs, N, value, FULL: tl.constexpr):
    if ptr.dtype.element_ty != tl.float64:  # float64 to 16 bits through float32, as torch does
        value = value.to(tl.float32)
    value = value.to(ptr.dtype.element_ty)
    if FULL:
        tl.store(ptr + offs, value)
    else:
        tl.store(ptr + offs, value, mask=offs < N)


@triton.jit
def _load_x(x_ptr, m_ptr, offs, N, HAS_MASK: tl.constexpr, F64: tl.constexpr,
            FULL: tl.constexpr):
    """x in the compute dtype, and where it counts (in range and masked in)."""
    x = _load(x_ptr, offs, N, FULL)
    x = x.to(tl.float64) if F64 else x.to(tl.float32)
    keep = tl.full(offs.shape, True, tl.int1) if FULL else offs < N
    if HAS_MASK:
        keep = keep & (_load(m_ptr, offs, N, FULL) != 0)
    return x, keep


@triton.jit
def _moments(stats_ptr, correction: tl.float64, eps: tl.float64, SUMS: tl.constexpr):
    """(n, mean, rsqrt(var + eps)) in float64 from the statistics: (n, mean, M2), or with SUMS
    (a process group's all-reduced statistics) (n, sum, sum of squares); rsqrt NaN where
    n <= correction (the variance is undefined: not 0 / 0's luck, nor M2 / 0 = inf's 0)."""
    n = tl.load(stats_ptr)
    a = tl.load(stats_ptr + 1)
    b = tl.load(stats_ptr + 2)
    if SUMS:
        mean = a / n
        m2 = b - a * mean
        m2 = tl.where(m2 < 0.0, 0.0, m2)  # the cancellation's rounding; a NaN stays NaN
    else:
        mean = a
        m2 = b
    rstd = 1.0 / tl.sqrt(m2 / (n - correction) + eps)
    return n, mean, tl.where(n > correction, rstd, float("nan"))


@triton.jit
def _split(mean, dtype: tl.constexpr):
    """The float64 mean as hi + lo in `dtype`."""
    hi = mean.to(dtype)
    return hi, (mean - hi.to(tl.float64)).to(dtype)


@triton.jit
def _centered(x, hi, lo):
    """x - mean: x - hi is exact near the mean, so float32 keeps the digits that |mean| >> std
    would round away from x - mean.to(float32)."""
    return (x - hi) - lo


@triton.jit
def _stats_block(x_ptr, m_ptr, part_ptr, start, pid, N, P, HAS_MASK: tl.constexpr,
                 F64: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
                 FULL: tl.constexpr):
    x, keep = _load_x(x_ptr, m_ptr, _offsets(start, BLOCK, VEC), N, HAS_MASK, F64, FULL)
    x = tl.where(keep, x, 0.0)  # a NaN at a masked position never enters
    n = tl.sum(keep.to(x.dtype))
    shift = tl.sum(x) / tl.maximum(n, 1.0)
    d = tl.where(keep, x - shift, 0.0)
    tl.store(part_ptr + pid, n)
    tl.store(part_ptr + P + pid, shift)
    tl.store(part_ptr + 2 * P + pid, tl.sum(d))
    tl.store(part_ptr + 3 * P + pid, tl.sum(d * d))


@triton.jit
def _stats_kernel(x_ptr, m_ptr, part_ptr, ticket, stats_ptr, N, P, HAS_MASK: tl.constexpr,
                  F64: tl.constexpr, SUMS: tl.constexpr, BLOCK: tl.constexpr,
                  VEC: tl.constexpr, LAST: tl.constexpr, COMBINE: tl.constexpr):
    """partials[:, pid] = (count, shift, sum of x - shift, sum of (x - shift)^2) of the block,
    shift its mean as rounded: the shifted sums give the mean and M2 without cancellation; with
    LAST the last program (`_last_program`) combines the P = programs partials into the
    statistics, COMBINE at a time."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * BLOCK
    if start + BLOCK <= N:
        _stats_block(x_ptr, m_ptr, part_ptr, start, pid, N, P, HAS_MASK, F64, BLOCK, VEC, True)
    else:
        _stats_block(x_ptr, m_ptr, part_ptr, start, pid, N, P, HAS_MASK, F64, BLOCK, VEC,
                     False)
    if LAST:
        if last_program(ticket):
            _combine(part_ptr, stats_ptr, P, SUMS, COMBINE)
            reset(ticket)


@triton.jit
def _combine_kernel(part_ptr, stats_ptr, P, SUMS: tl.constexpr, BLOCK: tl.constexpr):
    """One program: `_combine`, for more partials than the reduction's last program takes."""
    _combine(part_ptr, stats_ptr, P, SUMS, BLOCK)


@triton.jit
def _combine(part_ptr, stats_ptr, P, SUMS: tl.constexpr, BLOCK: tl.constexpr):
    """The P partials' (n, mean, M2) in float64, BLOCK at a time (exactly within a step, Chan's
    formula between steps); written as (n, mean, M2), or with SUMS as the summable (n, sum, sum
    of squares) that a process group all-reduces."""
    n = tl.zeros((), tl.float64)
    mean = tl.zeros((), tl.float64)
    m2 = tl.zeros((), tl.float64)
    for start in range(0, P, BLOCK):
        i = start + tl.arange(0, BLOCK)
        inside = i < P
        nb = tl.load(part_ptr + i, mask=inside, other=0.0, cache_modifier=".cg").to(tl.float64)
        shift = tl.load(part_ptr + P + i, mask=inside, other=0.0,
                        cache_modifier=".cg").to(tl.float64)
        s1 = tl.load(part_ptr + 2 * P + i, mask=inside, other=0.0,
                     cache_modifier=".cg").to(tl.float64)
        s2 = tl.load(part_ptr + 3 * P + i, mask=inside, other=0.0,
                     cache_modifier=".cg").to(tl.float64)
        nb1 = tl.maximum(nb, 1.0)  # a block with nothing masked in has sums 0
        mb = shift + s1 / nb1
        nc = tl.sum(nb)
        mc = tl.sum(nb * mb) / tl.maximum(nc, 1.0)
        dev = mb - mc
        m2c = tl.sum(s2 - s1 * s1 / nb1 + nb * dev * dev)
        delta = mc - mean
        w = nc / tl.maximum(n + nc, 1.0)
        mean = mean + delta * w
        m2 = m2 + m2c + delta * delta * n * w
        n = n + nc
    if SUMS:
        tl.store(stats_ptr + 1, n * mean)
        tl.store(stats_ptr + 2, m2 + n * mean * mean)
    else:
        tl.store(stats_ptr + 1, mean)
        tl.store(stats_ptr + 2, m2)
    tl.store(stats_ptr, n)


@triton.jit
def _apply_block(x_ptr, m_ptr, y_ptr, start, N, mean, rstd, HAS_MASK: tl.constexpr,
                 SHIFT: tl.constexpr, F64: tl.constexpr, BLOCK: tl.constexpr,
                 VEC: tl.constexpr, FULL: tl.constexpr):
    offs = _offsets(start, BLOCK, VEC)
    x, keep = _load_x(x_ptr, m_ptr, offs, N, HAS_MASK, F64, FULL)
    hi, lo = _split(mean, x.dtype)
    y = _centered(x, hi, lo) * rstd.to(x.dtype)
    if not SHIFT:
        y = (y + lo) + hi
    _store(y_ptr, offs, N, tl.where(keep, y, 0.0), FULL)


@triton.jit
def _apply_kernel(x_ptr, m_ptr, stats_ptr, y_ptr, N, correction: tl.float64, eps: tl.float64,
                  HAS_MASK: tl.constexpr, SUMS: tl.constexpr, SHIFT: tl.constexpr,
                  F64: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """y = (x - mean) r (+ mean without SHIFT) where masked in, else 0."""
    _, mean, rstd = _moments(stats_ptr, correction, eps, SUMS)
    # the blocks the reduction read last first: the likeliest to be still in L2
    start = (tl.num_programs(0) - 1 - tl.program_id(0)).to(tl.int64) * BLOCK
    if start + BLOCK <= N:
        _apply_block(x_ptr, m_ptr, y_ptr, start, N, mean, rstd, HAS_MASK, SHIFT, F64, BLOCK,
                     VEC, True)
    else:
        _apply_block(x_ptr, m_ptr, y_ptr, start, N, mean, rstd, HAS_MASK, SHIFT, F64, BLOCK,
                     VEC, False)


@triton.jit
def _grad_stats_block(x_ptr, m_ptr, g_ptr, part_ptr, start, pid, N, P, mean, rstd,
                      HAS_MASK: tl.constexpr, F64: tl.constexpr, BLOCK: tl.constexpr,
                      VEC: tl.constexpr, FULL: tl.constexpr):
    offs = _offsets(start, BLOCK, VEC)
    x, keep = _load_x(x_ptr, m_ptr, offs, N, HAS_MASK, F64, FULL)
    g = tl.where(keep, _load(g_ptr, offs, N, FULL).to(x.dtype), 0.0)
    hi, lo = _split(mean, x.dtype)
    xhat = tl.where(keep, _centered(x, hi, lo) * rstd.to(x.dtype), 0.0)
    tl.store(part_ptr + pid, tl.sum(g))
    tl.store(part_ptr + P + pid, tl.sum(g * xhat))


@triton.jit
def _grad_stats_kernel(x_ptr, m_ptr, g_ptr, stats_ptr, part_ptr, N, P,
                       correction: tl.float64, eps: tl.float64, HAS_MASK: tl.constexpr,
                       SUMS: tl.constexpr, F64: tl.constexpr, BLOCK: tl.constexpr,
                       VEC: tl.constexpr):
    """partials[:, pid] = (sum g, sum g xhat) over the block's masked-in positions."""
    _, mean, rstd = _moments(stats_ptr, correction, eps, SUMS)
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * BLOCK
    if start + BLOCK <= N:
        _grad_stats_block(x_ptr, m_ptr, g_ptr, part_ptr, start, pid, N, P, mean, rstd,
                          HAS_MASK, F64, BLOCK, VEC, True)
    else:
        _grad_stats_block(x_ptr, m_ptr, g_ptr, part_ptr, start, pid, N, P, mean, rstd,
                          HAS_MASK, F64, BLOCK, VEC, False)


@triton.jit
def _grad_apply_block(x_ptr, m_ptr, g_ptr, dx_ptr, start, N, mean, rstd, a, b,
                      HAS_MASK: tl.constexpr, SHIFT: tl.constexpr, F64: tl.constexpr,
                      BLOCK: tl.constexpr, VEC: tl.constexpr, FULL: tl.constexpr):
    offs = _offsets(start, BLOCK, VEC)
    x, keep = _load_x(x_ptr, m_ptr, offs, N, HAS_MASK, F64, FULL)
    g = _load(g_ptr, offs, N, FULL).to(x.dtype)
    r = rstd.to(x.dtype)
    a = a.to(x.dtype)
    hi, lo = _split(mean, x.dtype)
    dx = r * (g - a - _centered(x, hi, lo) * r * b.to(x.dtype))
    if not SHIFT:
        dx = dx + a
    _store(dx_ptr, offs, N, tl.where(keep, dx, 0.0), FULL)


@triton.jit
def _grad_apply_kernel(x_ptr, m_ptr, g_ptr, stats_ptr, sums_ptr, dx_ptr, N,
                       correction: tl.float64, eps: tl.float64, HAS_MASK: tl.constexpr,
                       SUMS: tl.constexpr, SHIFT: tl.constexpr, F64: tl.constexpr,
                       BLOCK: tl.constexpr, VEC: tl.constexpr):
    """dx = r (g - A / n - xhat B / (n - c)) (+ A / n without SHIFT) where masked in, else 0."""
    n, mean, rstd = _moments(stats_ptr, correction, eps, SUMS)
    a = tl.load(sums_ptr) / n
    b = tl.load(sums_ptr + 1) / (n - correction)
    start = (tl.num_programs(0) - 1 - tl.program_id(0)).to(tl.int64) * BLOCK  # as the forward
    if start + BLOCK <= N:
        _grad_apply_block(x_ptr, m_ptr, g_ptr, dx_ptr, start, N, mean, rstd, a, b, HAS_MASK,
                          SHIFT, F64, BLOCK, VEC, True)
    else:
        _grad_apply_block(x_ptr, m_ptr, g_ptr, dx_ptr, start, N, mean, rstd, a, b, HAS_MASK,
                          SHIFT, F64, BLOCK, VEC, False)


def _order(x: Tensor) -> list:
    """The axis order in which x is laid out in memory (any permutation of a contiguous
    tensor: read in place); the plain order where no permutation is dense (then copied)."""
    order = sorted(range(x.ndim), key=x.stride, reverse=True)
    return order if x.permute(order).is_contiguous() else list(range(x.ndim))


def _flat(t: Tensor, order: list) -> Tensor:
    """t's values (a lazily negated view resolved) in memory order `order`: a view, or a copy
    where t is laid out otherwise."""
    return t.resolve_neg().permute(order).contiguous().view(-1)


def _unflat(flat: Tensor, like: Tensor, order: list) -> Tensor:
    """A flat result as a tensor of `like`'s shape laid out in `order`."""
    shape = [like.shape[d] for d in order]
    return flat.view(shape).permute([order.index(d) for d in range(like.ndim)])


def _on(device: torch.device):
    """The device the launches must run on: Triton launches on the current one."""
    if device.type == "cuda" and device.index != _current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _all_reduce(t: Tensor, group) -> None:
    if group is not None:
        torch.distributed.all_reduce(t, group=group)


def _operands(x: Tensor, mask, *others) -> tuple:
    """(order, flat x, flat mask or x where there is none (never read), flat others, launch
    constants): every tensor in x's memory order."""
    order = _order(x)
    flat = [None if t is None else _flat(t, order) for t in (x, mask, *others)]
    if mask is None:
        flat[1] = flat[0]
    meta = dict(HAS_MASK=mask is not None, F64=x.dtype is torch.float64,
                VEC=16 // x.element_size())
    return order, flat, meta


def _forward(x: Tensor, mask, opts, plain: bool = False, memo=None) -> tuple:
    """(y, stats): the whitened x and the float64 statistics its backward reads; `plain`: x
    and the mask are contiguous and not negated (the plan's signature says so), read as they
    are (a kernel reads only their address); `memo`: the plan's (`scan.launch.launch`)."""
    shift_mean, eps, correction, group, out_dtype = opts
    if plain:
        xf, mf, order = x, x if mask is None else mask, None
        meta = dict(HAS_MASK=mask is not None, F64=x.dtype is torch.float64,
                    VEC=16 // x.element_size())
    else:
        order, (xf, mf), meta = _operands(x, mask)
    N = xf.numel()
    P = max(cdiv(N, BLOCK), 1)  # without data one program writes zeros, and combines them
    part, ticket = scratch(x.device, 4 * P, torch.float64 if meta["F64"] else torch.float32)
    stats = torch.empty(3, dtype=torch.float64, device=x.device)
    last = P <= LAST_MAX
    launch(_stats_kernel, P, (xf, mf, part, ticket, stats, N, P), x.device, memo, **meta,
           SUMS=group is not None, BLOCK=BLOCK, LAST=last, COMBINE=LAST_BLOCK,
           num_warps=WARPS)
    if not last:
        launch(_combine_kernel, 1, (part, stats, P), x.device, memo, SUMS=group is not None,
               BLOCK=COMBINE_BLOCK, num_warps=WARPS)
    _all_reduce(stats, group)  # on every rank, even one without data
    y = torch.empty(x.shape if plain else N, dtype=out_dtype, device=x.device)
    if N:
        launch(_apply_kernel, cdiv(N, APPLY_BLOCK),
               (xf, mf, stats, y, N, float(correction), float(eps)), x.device, memo, **meta,
               SUMS=group is not None, SHIFT=shift_mean, BLOCK=APPLY_BLOCK,
               num_warps=APPLY_WARPS)
    return (y if plain else _unflat(y, x, order)), stats


def _backward(x: Tensor, mask, stats: Tensor, g: Tensor, opts) -> Tensor:
    shift_mean, eps, correction, group, _ = opts
    order, (xf, mf, gf), meta = _operands(x, mask, g)
    N = xf.numel()
    P = cdiv(N, BLOCK)
    part = torch.empty(2, P, dtype=torch.float64 if meta["F64"] else torch.float32,
                       device=x.device)
    if N:
        launch(_grad_stats_kernel, P, (xf, mf, gf, stats, part, N, P, float(correction),
                                       float(eps)), x.device, **meta,
               SUMS=group is not None, BLOCK=BLOCK, num_warps=WARPS)
    totals = part.sum(dim=1, dtype=torch.float64)  # (A, B); (0, 0) without data
    _all_reduce(totals, group)
    dx = torch.empty(N, dtype=x.dtype, device=x.device)
    if N:
        launch(_grad_apply_kernel, cdiv(N, APPLY_BLOCK),
               (xf, mf, gf, stats, totals, dx, N, float(correction), float(eps)), x.device,
               **meta, SUMS=group is not None, SHIFT=shift_mean, BLOCK=APPLY_BLOCK,
               num_warps=APPLY_WARPS)
    return _unflat(dx, x, order)
