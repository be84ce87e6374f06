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
`[programs, K]` buffer, and one program of `finish_kernel` adds them in a fixed order: results
are deterministic bit for bit (no atomics), and nothing is read back to the host, so a call
captures in a CUDA graph. The scalars the backward needs (1 / count) stay on the device.

Autograd. An eager call that needs gradients runs through `_Function` (its backward calls the
op's backward kernel directly); inside `torch.compile` the same forward and backward are the
custom ops `torch.ops.rl_triton.<name>` and `<name>_backward`, with the backward registered on
the first: no graph break.
"""
from __future__ import annotations

import inspect
import typing
from typing import Callable, NamedTuple, Optional

import torch

from .. import reference
from .._args import FLAG, check_choice, check_offsets
from .._plans import SECOND_ORDER, _FirstOrder, backend_for, unreadable
from ..scan.jit import next_power_of_2, tl, triton
from ..scan.launch import launch as compiled_launch

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


def segment_ids(cu: Tensor, L: int) -> Tensor:
    """The segment of every packed position (clamped into range whatever `cu` holds)."""
    positions = torch.arange(L, device=cu.device)
    return torch.searchsorted(cu[1:], positions, right=True).clamp_max(max(cu.shape[0] - 2, 0))


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


def layout(shape: tuple, *xs: Optional[Tensor]) -> Layout:
    """Where the per-position tensors `xs` (all of `shape`; None: unused, given `xs[0]`'s
    place) are read."""
    N = 1
    for n in shape:
        N *= n
    C = shape[-1] if shape else 1
    if N == 0:  # nothing to launch
        first = next(x for x in xs if x is not None)
        return Layout([first] * len(xs), [0, 0] * len(xs), 1, True, False)
    views = [None if x is None else rows_view(x) for x in xs]
    flat = all(x is None or x.is_contiguous() for x in xs)
    strides, largest = [], N
    for v in views:
        s = (0, 0) if v is None else v.stride()
        strides += s
        if v is not None:
            largest = max(largest, (v.shape[0] - 1) * abs(s[0]) + (C - 1) * abs(s[1]) + 1)
    first = next(v for v in views if v is not None)
    tensors = [first if v is None else v for v in views]
    return Layout(tensors, strides, C, flat, largest > INT32_MAX)


def block(n: int) -> int:
    return max(16, min(MAX_BLOCK, next_power_of_2(max(n, 1))))


def launch(kernel, programs: int, *args, **meta) -> None:
    """`kernel` on `programs` programs, on the device of the tensors (`meta`: constexprs), by
    `scan.launch.launch` (the compiled kernel after the first call)."""
    if programs == 0:
        return
    device = next(a.device for a in args if isinstance(a, Tensor))
    compiled_launch(kernel, programs, args, device, **meta)


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
def maximum(x, y):
    return tl.maximum(x, y, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def minimum(x, y):
    return tl.minimum(x, y, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def finish_kernel(parts, n, loss, inv, metric_a, metric_b, K: tl.constexpr,
                  MEAN: tl.constexpr, WRITE_LOSS: tl.constexpr, BLOCK: tl.constexpr):
    """The partial sums `parts` [n, K] (columns: positions counted, weighted loss, then the
    metrics to average) added in a fixed order: inv = 1 / max(count, 1), the loss (times inv
    for a token mean), and the metrics' means."""
    cols = tl.arange(0, K)
    acc = tl.zeros([BLOCK, K], tl.float32)
    for start in range(0, n, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        acc += tl.load(parts + rows[:, None] * K + cols[None, :], mask=rows[:, None] < n,
                       other=0.0)
    total = tl.sum(acc, axis=0)
    scale = 1.0 / tl.maximum(tl.sum(tl.where(cols == 0, total, 0.0), axis=0), 1.0)
    tl.store(inv, scale)
    if WRITE_LOSS:
        value = tl.sum(tl.where(cols == 1, total, 0.0), axis=0)
        if MEAN:
            value = value * scale
        tl.store(loss, value.to(loss.dtype.element_ty))
    if K > 2:
        tl.store(metric_a, (tl.sum(tl.where(cols == 2, total, 0.0), axis=0) * scale).to(
            metric_a.dtype.element_ty))
        tl.store(metric_b, (tl.sum(tl.where(cols == 3, total, 0.0), axis=0) * scale).to(
            metric_b.dtype.element_ty))


def finish(parts: Tensor, loss: Tensor, inv: Tensor, metrics: tuple = (), *,
           mean: bool, write_loss: bool = True) -> None:
    """`finish_kernel` over the partial sums of a forward kernel (metrics: none or two)."""
    a, b = metrics or (inv, inv)
    # 1024 partial sums a pass: 8 passes at 2^24 positions, 1 at 2^21
    launch(finish_kernel, 1, parts, parts.shape[0], loss, inv, a, b, K=parts.shape[1],
           MEAN=mean, WRITE_LOSS=write_loss, BLOCK=1024, num_warps=8)


# ---- backends and autograd -----------------------------------------------------------------------

class Fused:
    """A loss op's Triton path, with its gradients (module docstring).

    forward(x, o) -> (outputs, saved): `outputs` new tensors, `saved` the tensors the backward
        needs besides the inputs (`n_saved` of them, empty ones where unused);
    backward(x, o, saved, grads, needs) -> one gradient per input (None where `needs` says no),
        from the outputs' gradients (None: zero);
    fake(x, o) -> (outputs, saved): empty tensors of their shapes, for torch.compile;
    `inputs` and `options` are NamedTuples with type hints (the custom op's schema); outputs at
    `nondiff` carry no gradient (a count). An input `cu_seqlens` has its values checked by the
    custom op, at run time (tracing cannot read them).
    """

    def __init__(self, name: str, inputs: type, options: type, *, forward: Callable,
                 fake: Callable, n_out: int, n_saved: int, backward: Optional[Callable] = None,
                 nondiff: tuple = ()):
        self.name, self.inputs, self.options = name, inputs, options
        self.forward, self.backward, self.fake = forward, backward, fake
        self.n_out, self.n_saved, self.nondiff = n_out, n_saved, nondiff
        self.custom = self._register()
        self.grad_op = self._register_backward() if backward is not None else None

    def __call__(self, x: tuple, o: tuple, needs_grad: bool) -> list:
        if torch.compiler.is_compiling():
            return list(self.custom(*x, *o)[:self.n_out])
        if needs_grad and self.backward is not None:
            return list(_Function.apply(self, o, *x))
        return self.forward(x, o)[0]

    def _schema(self, *groups: dict, returns) -> inspect.Signature:
        params = [inspect.Parameter(k, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=v)
                  for group in groups for k, v in group.items()]
        return inspect.Signature(params, return_annotation=returns)

    def _register(self):
        n_in = len(self.inputs._fields)
        returns = tuple[(Tensor,) * (self.n_out + self.n_saved)]

        def impl(*args):
            x, o = self.inputs(*args[:n_in]), self.options(*args[n_in:])
            cu = getattr(x, "cu_seqlens", None)
            if cu is not None:  # (check_offsets=False: no read, no sync)
                check_offsets(cu, x[0].shape[0], cu.device,
                              data=getattr(o, "check_offsets", True) and not unreadable())
            outs, saved = self.forward(x, o)
            return tuple(outs) + tuple(saved)

        def fake(*args):
            outs, saved = self.fake(self.inputs(*args[:n_in]), self.options(*args[n_in:]))
            return tuple(outs) + tuple(saved)

        impl.__signature__ = self._schema(typing.get_type_hints(self.inputs),
                                          typing.get_type_hints(self.options), returns=returns)
        impl.__name__ = self.name
        custom = torch.library.custom_op(f"rl_triton::{self.name}", impl, mutates_args=())
        custom.register_fake(fake)
        if self.backward is not None:
            custom.register_autograd(self._custom_backward, setup_context=self._setup)
        return custom

    def _setup(self, ctx, inputs, output):
        n_in = len(self.inputs._fields)
        ctx.save_for_backward(*inputs[:n_in], *output[self.n_out:])
        ctx.o = inputs[n_in:]

    def _custom_backward(self, ctx, *grads):
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            raise RuntimeError(SECOND_ORDER)
        n_in = len(self.inputs._fields)
        needs = list(ctx.needs_input_grad[:n_in])
        res = self.grad_op(*ctx.saved_tensors, *grads[:self.n_out], *ctx.o, needs)
        return (*[r if need else None for r, need in zip(res, needs)], *(None,) * len(ctx.o))

    def _register_backward(self):
        n_in, n_s, n_out = len(self.inputs._fields), self.n_saved, self.n_out
        saved = {f"saved{i}": Tensor for i in range(n_s)}
        grads = {f"grad{i}": Optional[Tensor] for i in range(n_out)}

        def unpack(args):
            k = n_in + n_s + n_out
            return (self.inputs(*args[:n_in]), args[n_in:n_in + n_s], args[n_in + n_s:k],
                    self.options(*args[k:-1]), args[-1])

        def impl(*args):
            x, s, g, o, needs = unpack(args)
            res = self.backward(x, o, s, g, list(needs))
            return [x[0].new_empty(0) if r is None else r for r in res]

        def fake(*args):
            x, s, g, o, needs = unpack(args)
            return [t.new_empty(t.shape) if need else x[0].new_empty(0)
                    for t, need in zip(x, needs)]

        def refuse(ctx, *grads):
            raise RuntimeError(SECOND_ORDER)

        impl.__signature__ = self._schema(
            typing.get_type_hints(self.inputs), saved, grads, typing.get_type_hints(self.options),
            {"needs": list[bool]}, returns=list[Tensor])
        impl.__name__ = self.name + "_backward"
        custom = torch.library.custom_op(f"rl_triton::{self.name}_backward", impl,
                                         mutates_args=())
        custom.register_fake(fake)
        custom.register_autograd(refuse, setup_context=lambda ctx, inputs, output: None)
        return custom


class _Function(torch.autograd.Function):
    """An eager Triton call that records its backward (`Fused.backward`, directly)."""

    @staticmethod
    def forward(ctx, op, o, *x):
        outs, saved = op.forward(op.inputs(*x), o)
        ctx.save_for_backward(*x, *saved)
        ctx.op, ctx.o = op, o
        ctx.mark_non_differentiable(*[outs[i] for i in op.nondiff])
        ctx.set_materialize_grads(False)  # an output without gradient is not read
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(SECOND_ORDER)
        op = ctx.op
        n = len(op.inputs._fields)
        saved = ctx.saved_tensors
        res = op.backward(op.inputs(*saved[:n]), ctx.o, saved[n:], grads,
                          list(ctx.needs_input_grad[2:]))
        return (None, None, *res)


def run(op: Fused, x: tuple, o: tuple, call, backend: str, torch_impl: Callable,
        loop_impl: Callable, out_dtype: torch.dtype):
    """The call on its backend: the kernels (`op`), or the torch or loop implementation
    `impl(x, o, dtype)` (float64 where an input is, else float32), differentiated by autograd
    and refusing second-order gradients as the kernels' backward does. Returns the outputs
    (one tensor, or a tuple), every one of `out_dtype`."""
    backend = backend_for(backend, call.device)
    if backend == "triton":
        outs = op(x, o, call.needs_grad)
    else:
        dtype = torch.float64 if call.float64 else torch.float32
        impl = torch_impl if backend == "torch" else loop_impl
        outs = [t.to(out_dtype) for t in impl(x, o, dtype)]
        if call.needs_grad:
            grads = [i for i in range(len(outs)) if i not in op.nondiff]
            wrapped = _FirstOrder.apply(*[outs[i] for i in grads])
            for i, t in zip(grads, wrapped):
                outs[i] = t
    return outs[0] if len(outs) == 1 else tuple(outs)
