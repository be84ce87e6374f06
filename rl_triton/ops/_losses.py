"""What the losses (semantics §9) share: aggregation, the layout their kernels read, the reductions,
and their route through torch.autograd and torch.compile.

Aggregation. A loss reduces its per-position losses l over the positions that count (m: the
mask, set where nonzero; every position without one) to one weighted sum, sum_i m_i w_i l_i:

    token-mean            w = 1 / max(sum m, 1)
    sum                   w = 1
    seq-mean-token-sum    w = c[seq(i)],  c_s = 1 / S'
    seq-mean-token-mean   w = c[seq(i)],  c_s = 1 / (S' * n_s)

with n_s the positions of sequence s that count and S' the sequences with any (at least 1), so
that an empty selection gives 0, not NaN; "none" is m * l per position. A sequence is a row of
`[B, T]` inputs or a segment of `cu_seqlens`. The weights depend on the mask alone: torch forms
the c_s on the device before the kernel (for rows without a mask, from the shape), and the
backward of every mode is elementwise, dl_i = g * m_i * w_i.

Layout. Every per-position tensor is read as the row-major flat array of its shape through a
`[R, C]` view (C its last axis) with two strides of its own, in place; a tensor whose axes no two
strides describe (a permuted 3-d view) is copied. Where every tensor of a call is contiguous the
kernels index them by the flat position alone.

Reductions. Each program of a forward kernel writes its partial sums into one row of a small
`[programs, K]` scratch buffer (one per block of sums) and takes a ticket; the program with the
last ticket adds the rows in a fixed order (`finish_last`), in the same launch: results are
deterministic bit for bit (the ticket decides who adds, not the order), and nothing is read back
to the host, so a call captures in a CUDA graph. The scalars the backward needs (1 / count) stay
on the device.

Declaration. Each loss is an `_core.op.Op` of kind "loss" (docs/dev/op-framework.md): its
autograd (`Eager`, `FirstOrder`), custom ops (`torch.ops.rl_triton.<name>` and `<name>_backward`)
and hot path (`Op.__call__`: the checked options and the forward's layout cached under the
call's signature, `plan`) are the framework's; `runtime_check` the offsets' values.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import reference
from .._args import FLAG, check_choice, check_offsets
from .._core.op import Plan
from .._core.plans import backend_for, unreadable
from ..scan.jit import next_power_of_2, tl, triton
from ..scan.launch import launch as compiled_launch, replay
from ..scan.torch_scan import segment_ids
from ._last_program import last_program, reset, scratch

Tensor = torch.Tensor
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "sum", "none")
SEQ_MODES = ("seq-mean-token-sum", "seq-mean-token-mean")
NO_SEQ, ROWS, SEGMENTS = 0, 1, 2  # how a kernel finds a position's sequence
MAX_BLOCK = 2048  # positions per program of the elementwise kernels
NUM_WARPS = 8
INT32_MAX = 2**31 - 1


# ---- arguments -----------------------------------------------------------------------------------

def aggregation_args(call, aggregation, mask, cu_seqlens, check: bool = True):
    """(aggregation, mask, cu): the option, the mask (per position, any flag dtype) and the
    offsets (int64, contiguous, on the inputs' device), checked (their values on every call
    unless `check` is False)."""
    aggregation = check_choice("aggregation", aggregation, AGGREGATIONS)
    mask = call.step("mask", mask, FLAG, optional=True)
    shape = tuple(call.step_shape)
    cu = None
    if cu_seqlens is not None:
        if len(shape) != 1:
            raise ValueError(f"with cu_seqlens the inputs are packed sequences [L]; "
                             f"{call.ref_name} has shape {shape}")
        cu = check_offsets(cu_seqlens, shape[0], call.device,
                           data=check and not unreadable()).contiguous()
    elif aggregation in SEQ_MODES and len(shape) != 2:
        raise ValueError(f"aggregation={aggregation!r} averages over sequences, the rows of "
                         f"[B, T] inputs or the segments of cu_seqlens; {call.ref_name} has "
                         f"shape {shape}")
    return aggregation, mask, cu


def counted(mask: Optional[Tensor]) -> Optional[Tensor]:
    """The mask as bool (set where nonzero), None without one."""
    return None if mask is None else mask if mask.dtype is torch.bool else mask != 0


# ---- aggregation weights and the torch backend's aggregation -------------------------------------

def seq_kind(aggregation: str, cu: Optional[Tensor]) -> int:
    return NO_SEQ if aggregation not in SEQ_MODES else SEGMENTS if cu is not None else ROWS


def seq_scale(aggregation: str, m: Optional[Tensor], cu: Optional[Tensor], shape: tuple,
              dtype: torch.dtype, device: torch.device) -> Tensor:
    """c_s of a seq-mean aggregation, one per sequence (module docstring); `m` bool or None."""
    if cu is None:
        B, T = shape
        n = m.sum(-1) if m is not None else torch.full((B,), T, device=device)
    elif m is None:
        n = cu[1:] - cu[:-1]
    else:
        n = torch.zeros(cu.shape[0] - 1, dtype=torch.int64, device=device).index_add_(
            0, segment_ids(cu, shape[0]), m.long())
    n_seq = (n > 0).sum().clamp_min(1)
    if aggregation == "seq-mean-token-mean":
        return 1.0 / (n_seq * n.clamp_min(1)).to(dtype)
    return torch.ones(n.shape, dtype=dtype, device=device) / n_seq.to(dtype)


def seq_weights(aggregation: str, mask: Optional[Tensor], cu: Optional[Tensor], ref: Tensor):
    """(SEQ, scale, cu, S, STEPS): how the kernels weight a position's sequence (`seq_weight`);
    `ref` the per-position tensor whose shape the call has (also what unused slots point at)."""
    scale = ref if seq_kind(aggregation, cu) == NO_SEQ else seq_scale(
        aggregation, counted(mask), cu, tuple(ref.shape), torch.float32, ref.device)
    return saved_seq_weights(aggregation, cu, ref, scale)


def saved_seq_weights(aggregation: str, cu: Optional[Tensor], ref: Tensor, scale: Tensor):
    """`seq_weights` with the weights `scale` formed already (a backward's: its forward's,
    saved)."""
    seq = seq_kind(aggregation, cu)
    if seq == NO_SEQ:
        return seq, ref, ref, 0, 0
    S = scale.shape[0]
    return seq, scale, ref if cu is None else cu, S, max(S - 1, 0).bit_length()


def aggregate(l: Tensor, m: Optional[Tensor], aggregation: str, cu: Optional[Tensor]) -> Tensor:
    """The torch backend's aggregation of per-position losses `l` over `m` (bool or None)."""
    lm = l if m is None else torch.where(m, l, 0.0)
    if aggregation == "none":
        return lm
    if aggregation == "sum":
        return lm.sum()
    if aggregation == "token-mean":
        return lm.sum() / (max(l.numel(), 1) if m is None else m.sum().clamp_min(1))
    c = seq_scale(aggregation, m, cu, tuple(l.shape), l.dtype, l.device)
    if cu is None:
        return (lm.sum(-1) * c).sum()
    return (torch.zeros_like(c).index_add(0, segment_ids(cu, l.shape[0]), lm) * c).sum()


def kept(m: Optional[Tensor], dtype: torch.dtype, *xs: Optional[Tensor]) -> list:
    """`xs` in `dtype`, 0 where the mask `m` (bool or None) is not set (None stays None)."""
    return reference._decided(m, *(None if x is None else x.to(dtype) for x in xs))


def masked_mean(x: Tensor, m: Optional[Tensor]) -> Tensor:
    if m is None:
        return x.sum() / max(x.numel(), 1)
    return torch.where(m, x, 0.0).sum() / m.sum().clamp_min(1)


# ---- layout and launches -------------------------------------------------------------------------

def rows_view(x: Tensor) -> Tensor:
    """`x` as [R, C] (C its last axis, 1 for a 0-d tensor): a view where two strides describe
    it, else a contiguous copy."""
    C = x.shape[-1] if x.ndim else 1
    try:
        return x.view(-1, C)
    except RuntimeError:
        return x.contiguous().view(-1, C)


class Layout(NamedTuple):
    """The kernel arguments that place per-position tensors: `tensors` (the ones to pass),
    `strides` (two per tensor, flat), C, FLAT and INT64 (the constexprs)."""
    tensors: list
    strides: list
    C: int
    FLAT: bool
    INT64: bool


def layout(shape: tuple, *xs: Optional[Tensor], plan=None) -> Layout:
    """Where the per-position tensors `xs` (all of `shape`; None: unused, given `xs[0]`'s
    place) are read. With `plan` (a forward's or a `Site`: its key fixes every stride) the strides
    and flags are computed once and the tensors passed as they are (a kernel reads only their
    address) or, where no two strides describe them, copied."""
    memo = None if plan is None else plan.memo.get("layout")
    if memo is not None:
        strides, C, flat, int64, copied = memo
        first = next(x for x in xs if x is not None)
        return Layout([first if x is None else x.contiguous() if c else x
                       for x, c in zip(xs, copied)], strides, C, flat, int64)
    N = 1
    for n in shape:
        N *= n
    C = shape[-1] if shape else 1
    if N == 0:  # nothing to launch
        first = next(x for x in xs if x is not None)
        return Layout([first] * len(xs), [0, 0] * len(xs), 1, True, False)
    views, copied = [], []
    for x in xs:
        v = None if x is None else rows_view(x)
        views.append(v)
        copied.append(v is not None and v.data_ptr() != x.data_ptr())  # (a copy: new memory)
    flat = all(x is None or x.is_contiguous() for x in xs)
    strides, largest = [], N
    for v in views:
        s = (0, 0) if v is None else v.stride()
        strides += s
        if v is not None:
            largest = max(largest, (v.shape[0] - 1) * abs(s[0]) + (C - 1) * abs(s[1]) + 1)
    first = next(v for v in views if v is not None)
    tensors = [first if v is None else v for v in views]
    if plan is not None:
        plan.memo["layout"] = (strides, C, flat, largest > INT32_MAX, copied)
    return Layout(tensors, strides, C, flat, largest > INT32_MAX)


def fixed(plan: Optional[Plan], build, *args):
    """`build(*args)`: what a forward derives from its call's signature (sizes, grid,
    constexprs), kept in the plan's memo where there is a plan (the custom op has none)."""
    if plan is None:
        return build(*args)
    f = plan.memo.get(build)
    if f is None:
        f = plan.memo[build] = build(*args)
    return f


class Site:
    """A launch site's own memo in a forward's plan (`backward_site`): `launch` keeps its
    compiled kernel there and `layout` its strides, where the site's specialization is not the
    forward's."""
    __slots__ = ("memo",)

    def __init__(self):
        self.memo = {}


def backward_site(plan: Optional[Plan], needs, *grads: Optional[Tensor]) -> Optional[Site]:
    """The `Site` of a backward's launch in its forward's plan; None without a plan (the custom
    op's calls). The forward's signature fixes its specialization but for the gradients asked
    for and the incoming gradients' dtype, alignment and strides: with those in the key, the
    backward's launch skips Triton's per-argument key as the forward's does."""
    if plan is None:
        return None
    key = ("backward", *needs, *[
        None if g is None else (g.dtype, g.data_ptr() % 16 == 0, g.stride()) for g in grads])
    s = plan.memo.get(key)
    if s is None:
        s = plan.memo[key] = Site()
    return s


SMALL = 256  # elements of the largest template a plan keeps


def new(plan: Optional[Plan], shape: tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A new tensor: `empty_like` of a template the plan keeps, where it is small (the scalar
    results, few partial sums: no shape, dtype or device to parse), else `torch.empty`."""
    if plan is not None:
        like = plan.memo.get((shape, dtype))
        if like is not None:
            return torch.empty_like(like)
    out = torch.empty(shape, dtype=dtype, device=device)
    if plan is not None and out.numel() <= SMALL:
        plan.memo[(shape, dtype)] = torch.empty_like(out)
    return out


def scalars(plan: Optional[Plan], n: int, dtype: torch.dtype, device: torch.device) -> tuple:
    """n new 0-d tensors: eagerly (a plan) the elements of one new [n] tensor, one allocation
    (about 4 µs of host time each on the H200), for results without gradient that the backward
    does not read (an in-place edit of one bumps their shared version counter); the custom
    op's (no plan) apart, since its outputs may not alias."""
    if plan is None:
        return tuple([torch.empty((), dtype=dtype, device=device) for _ in range(n)])
    return new(plan, (n,), dtype, device).unbind()


def block(n: int) -> int:
    return max(16, min(MAX_BLOCK, next_power_of_2(max(n, 1))))


def launch(kernel, programs: int, *args, plan=None, **meta) -> None:
    """`kernel` on `programs` programs, on the device of the tensors (`meta`: constexprs), by
    `scan.launch.launch` (the compiled kernel after the first call); `plan`: a forward's, whose
    signature fixes the launch's specialization, or a `Site` (the compiled kernel kept in its
    memo)."""
    if programs == 0:
        return
    device = next(a.device for a in args if isinstance(a, Tensor))
    hit = None if plan is None else plan.memo.get(kernel)
    if hit is not None:  # (compiled: the constexprs are in it)
        replay(hit, programs, args, device)
    else:
        compiled_launch(kernel, programs, args, device, None if plan is None else plan.memo,
                        **meta)


# ---- the kernels' shared pieces ------------------------------------------------------------------

@triton.jit
def positions(N, INT64: tl.constexpr, BLOCK: tl.constexpr):
    """This program's flat positions, and which of them exist."""
    pid = tl.program_id(0)
    if INT64:
        pid = pid.to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    return i, i < N


@triton.jit
def at(i, C, s_r, s_c, FLAT: tl.constexpr):
    """The offset of flat position i in a tensor read as [R, C] with strides (s_r, s_c)."""
    if FLAT:
        return i
    r = i // C
    return r * s_r + (i - r * C) * s_c


@triton.jit
def load(ptr, i, C, s_r, s_c, inb, FLAT: tl.constexpr):
    """A per-position input at positions i, as float32."""
    return tl.load(ptr + at(i, C, s_r, s_c, FLAT), mask=inb, other=0).to(tl.float32)


@triton.jit
def selected(mask, i, C, s_r, s_c, inb, HAS_MASK: tl.constexpr, FLAT: tl.constexpr):
    """The positions that count: in bounds and, with a mask, set in it (nonzero)."""
    if HAS_MASK:
        return inb & (tl.load(mask + at(i, C, s_r, s_c, FLAT), mask=inb, other=0) != 0)
    return inb


@triton.jit
def seq_weight(scale, cu, i, C, S, inb, STEPS, SEQ: tl.constexpr):
    """c of position i's sequence: its row i // C (ROWS), or the segment s with
    cu[s] <= i < cu[s + 1] by binary search over cu (SEGMENTS; STEPS = ceil(log2 S), every
    read inside cu whatever it holds)."""
    if SEQ == 1:
        s = i // C
    else:
        lo = tl.zeros(i.shape, tl.int64)
        hi = lo + S
        for _ in range(STEPS):
            mid = (lo + hi) // 2
            go = tl.load(cu + mid, mask=inb, other=0) <= i
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        s = lo
    return tl.load(scale + s, mask=inb, other=0.0)


@triton.jit
def clamp(x, low, high):
    """min(max(x, low), high), NaN where x is NaN (plain `tl.minimum` returns the operand that
    is not NaN: a NaN ratio is never clipped into a finite number)."""
    return tl.minimum(tl.maximum(x, low, propagate_nan=tl.PropagateNan.ALL), high,
                      propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def k3(x):
    """(exp(-x) + x - 1, its derivative 1 - exp(-x)): Schulman's k3 of the log-ratio x and
    its gradient, to float32 precision near 0 as well, from their series where |x| < 1 (there
    exp(-x) - 1 keeps only ~|x| of its digits; docs/semantics.md §9)."""
    small = tl.abs(x) < 1.0
    t = tl.where(small, -x, 0.0)
    # (exp(t) - 1 - t) / t^2 = 1/2! + t/3! + ... + t^8/10! (the next term is under 1e-7 of it)
    p = t * 2.755731922398589e-07 + 2.7557319223985893e-06
    p = p * t + 2.48015873015873e-05
    p = p * t + 0.0001984126984126984
    p = p * t + 0.001388888888888889
    p = p * t + 0.008333333333333333
    p = p * t + 0.041666666666666664
    p = p * t + 0.16666666666666666
    p = p * t + 0.5
    e = tl.exp(-x)
    k = tl.where(small, t * t * p, (e - 1.0) + x)
    dk = tl.where(small, -t * (1.0 + t * p), 1.0 - e)  # 1 - exp(-x) = -expm1(t)
    return k, dk


@triton.jit
def maximum(x, y):
    return tl.maximum(x, y, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def minimum(x, y):
    return tl.minimum(x, y, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def max_grad(x, y, dx, dy):
    """The derivative of max(x, y) from its sides' derivatives dx and dy, torch.maximum's: the
    larger side's, half of each at a tie, both where either side is NaN. The frameworks' losses
    are torch.maximum and torch.minimum, so at a tie (an advantage of exactly 0) their gradients
    are these. A side not taken adds nothing, whatever its derivative holds (a select)."""
    return tl.where(x > y, dx, tl.where(x < y, dy, tl.where(x == y, 0.5 * (dx + dy), dx + dy)))


@triton.jit
def min_grad(x, y, dx, dy):
    """`max_grad` of min(x, y), torch.minimum's."""
    return tl.where(x < y, dx, tl.where(x > y, dy, tl.where(x == y, 0.5 * (dx + dy), dx + dy)))


@triton.jit
def finish_last(parts, ticket, loss, inv, m0, m1, m2, m3, m4, m5, K: tl.constexpr,
                R: tl.constexpr, METRICS: tl.constexpr, MEAN: tl.constexpr,
                WRITE_LOSS: tl.constexpr, ROWS: tl.constexpr):
    """The end of a forward kernel whose every program wrote its partial sums into `parts`: R
    blocks [programs, K] (columns: positions counted, weighted loss, then two metrics to
    average). The program that takes the last ticket adds each block in a fixed order, ROWS
    rows a pass: inv = 1 / max(count, 1) (every block counts the same positions), the loss
    (block 0's; times inv for a token mean), block b's two metrics' means into m(2b) and
    m(2b + 1), the first METRICS of them (`_last_program`)."""
    n = tl.num_programs(0)
    if last_program(ticket):
        cols = tl.arange(0, K)
        for b in tl.static_range(R):
            acc = tl.zeros([ROWS, K], tl.float32)
            for start in range(0, n, ROWS):
                rows = start + tl.arange(0, ROWS)
                acc += tl.load(parts + (b * n + rows[:, None]) * K + cols[None, :],
                               mask=rows[:, None] < n, other=0.0, cache_modifier=".cg")
            total = tl.sum(acc, axis=0)
            scale = 1.0 / tl.maximum(tl.sum(tl.where(cols == 0, total, 0.0), axis=0), 1.0)
            if b == 0:
                tl.store(inv, scale)
                if WRITE_LOSS:
                    value = tl.sum(tl.where(cols == 1, total, 0.0), axis=0)
                    if MEAN:
                        value = value * scale
                    tl.store(loss, value.to(loss.dtype.element_ty))
            if K > 2:
                first = tl.sum(tl.where(cols == 2, total, 0.0), axis=0) * scale
                second = tl.sum(tl.where(cols == 3, total, 0.0), axis=0) * scale
                if b == 0:
                    tl.store(m0, first.to(m0.dtype.element_ty))
                    tl.store(m1, second.to(m1.dtype.element_ty))
                elif b == 1:
                    tl.store(m2, first.to(m2.dtype.element_ty))
                    tl.store(m3, second.to(m3.dtype.element_ty))
                else:
                    tl.store(m4, first.to(m4.dtype.element_ty))
                    if METRICS > 5:
                        tl.store(m5, second.to(m5.dtype.element_ty))
        reset(ticket)


MAX_FINISH_BLOCKS = 3  # finish_last's metric pointers: two per block
FINISH_ROWS = 1024  # partial sums a pass: 8 passes at 2^24 positions, 1 at 2^21


def finish_blocks(metrics: int) -> int:
    """The blocks of partial sums of a forward with `metrics` metrics: two metrics a block,
    the count and the loss in the first."""
    return max(1, (metrics + 1) // 2)


def finish_meta(metrics: int, *, mean: bool, write_loss: bool = True) -> dict:
    """`finish_last`'s constexprs (K, the partial sums' columns, is the kernel's own)."""
    return dict(R=finish_blocks(metrics), METRICS=metrics, MEAN=mean, WRITE_LOSS=write_loss,
                ROWS=FINISH_ROWS)


def finish_args(loss: Tensor, inv: Tensor, metrics: tuple, programs: int, K: int) -> tuple:
    """The forward kernels' arguments `loss, parts, ticket, inv, m0, ..., m5` for a launch of
    `programs` programs on `loss`'s device and the current stream: `parts` the partial sums'
    scratch (`finish_blocks` x programs x K float32, at least), the metrics' unused slots
    `inv`."""
    parts, ticket = scratch(loss.device, finish_blocks(len(metrics)) * programs * K)
    return (loss, parts, ticket, inv, *metrics, *(inv,) * (2 * MAX_FINISH_BLOCKS - len(metrics)))


# ---- the op's plan and value checks -------------------------------------------------------------

def plan(call, backend: str, o: tuple) -> Plan:
    """The plan of a checked call (`_core.op.Plan`): its options, backend, gradients and the
    torch and loop backends' dtype (float64 where an input is, else float32)."""
    return Plan(o, backend_for(backend, call.device), call.needs_grad,
                torch.float64 if call.float64 else torch.float32)


def runtime_check(x: tuple, o: tuple) -> None:
    """The offsets' values (semantics §7, `cu_seqlens`), on every call: on a GPU unless
    `check_offsets` is False or the host cannot read them now (no read, no sync); on the CPU
    always (a read costs nothing there), but while torch.compile traces."""
    cu = getattr(x, "cu_seqlens", None)
    if cu is not None and (o.check_offsets or cu.device.type == "cpu"):
        check_offsets(cu, x[0].shape[0], cu.device, data=o.check_offsets and not unreadable())
