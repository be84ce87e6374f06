"""The scans' op (`ScanOp`, docs/dev/op-framework.md): what the estimators and the forward scans
(semantics §2-§5) add to `op.Op`.

A scan declares its input NamedTuple (one order for the public function, the custom op and the
kernel's slots), its scalars, its options (`extras`), its argument check, its Triton plan builder
and its torch and loop implementations. `ScanOp.__call__` is the hot path: a call whose
signature (`_args.signature`, with time_dim, backend, out_dtype, the options and the grad mode)
passed the checks finds its launch plan in one lookup (`plans._PLANS`) and launches, the value
checks (Retrace's actions) still run; else every argument is checked and the backend runs:
- Triton, eager: the launch plan cached under the call's signature, else a new one; with
  gradients through `op.Eager`;
- Triton inside `torch.compile`: the op's custom op (`custom_ops.register`: its tensors are the
  inputs and `row_params`, its options the scalars, time_dim, out_dtype and extras), whose
  implementation is the eager path above;
- torch and loop: the implementation on time-major views, copied into outputs in the caller's
  layout, through `op.FirstOrder`.
Packed rows (`cu_seqlens`, docs/semantics.md §7, `ScanOp._packed`): on the Triton backend in
place (inside `torch.compile` through `torch.ops.rl_triton.<name>_packed`); on the torch backend,
and wherever gradients are needed, the torch implementation on the same packed row (traced by
torch.compile); the loop backend, and Triton calls with per-row discounts, as padded rows.
Gradients (semantics §6): the op's backward (Triton kernels); a tensor gamma or lam (one per row)
reaches the kernels as a `[k, *batch]` tensor of the op's first k kernel scalars (`row_params`),
built here from the tensors: autograd carries its gradient back.
Nothing under `rl_triton.scan` imports this module.
"""
from __future__ import annotations

import operator
import typing
from typing import Callable, NamedTuple, Optional

import torch

from .. import reference
from .._args import Call, check_backend, check_bool, check_offsets, check_out_dtype, signature
from ..scan import torch_scan
from . import custom_ops
from .op import Eager, Op, first_order
from .plans import _PLANS, backend_for, cached_plan, unreadable

Tensor = torch.Tensor
DTYPE = torch.dtype  # (`torch` is an argument of ScanOp's constructor)
DISCOUNTS = ("gamma", "lam")  # the scalars that may be tensors (one per row)


class ScanOp(Op):
    """One scan's declaration (see the module docstring).

    check(x, time_dim, extra) -> (x, call): the checked inputs (the caller's tensors, or their
        values for lazily negated views) and the `Call` that checked them;
    plan(x, call, out_dtype, extra) -> `scan.launch.Launch`, or None where the plan cannot read
        `x` in place (then `copy(x)` gives tensors it can, and the call is not cached);
    torch(x, s, extra, dtype) and loop(x, s, extra, dtype): the outputs, time-major, from
        time-major views `x` (fields named `last_*` or `initial` are bootstraps: no time axis);
    n_out(extra): outputs of a call (the custom op returns `outputs`, the unused ones empty).
    Every output has the shape of input 0.
    backward(x, outs, grads, s, rows, call, extra, needs): the Triton backward: the gradient
        of every input (None where `needs` says no) and of `rows`, from the outputs' gradients
        (None: zero); `row_params`: the kernel scalars (leading) that per-row discounts set.
        An input named `mask` (semantics §7) is not among the inputs `backward` sees.
    masked_kernels(x): whether the Triton plan of inputs `x` reads their mask; masked calls
        it does not read, and masked calls that need gradients, run on the torch backend.
    packed_kernels(x): whether the Triton plan of inputs `x` runs packed rows (`cu_seqlens`,
        semantics §7) in place (`check` then takes `segments`, the plan sees `call.segments`); other
        packed calls run as padded rows (`_padded`).
    """

    reads_outputs = True  # its backward reads the outputs

    def __init__(self, name: str, inputs: type, scalars: type, *, check: Callable,
                 plan: Callable, torch: Callable, loop: Callable, outputs: int = 1,
                 extras: Optional[type] = None, n_out: Optional[Callable] = None,
                 copy: Optional[Callable] = None, runtime_check: Optional[Callable] = None,
                 kernel_scalars: Callable = tuple, backward: Optional[Callable] = None,
                 row_params: int = 0, masked_kernels: Callable = lambda x: False,
                 packed_kernels: Callable = lambda x: False):
        self.scalars, self.extras = scalars, extras
        self.row_params = row_params
        self.discounts = tuple(f for f in scalars._fields if f in DISCOUNTS)
        self.plan = plan
        self.n_out = n_out or (lambda extra: outputs)
        self.copy = copy or (lambda x: type(x)(*(None if t is None else t.contiguous()
                                                  for t in x)))
        self.kernel_scalars = kernel_scalars  # the kernel's float arguments from the scalars
        self._steps = tuple(not f.startswith(("last_", "initial")) for f in inputs._fields)
        # the mask (no gradient) is not among the inputs an op's backward sees
        self._mask = inputs._fields.index("mask") if "mask" in inputs._fields else None
        # masked_kernels(x): whether the op's Triton plan reads the mask of inputs x (else
        # masked calls run on the torch backend)
        self.masked_kernels = masked_kernels
        self.packed_kernels = packed_kernels
        # the custom op's arguments: the inputs and the per-row scalars; the scalars, time_dim,
        # out_dtype and the options
        hints = typing.get_type_hints
        tensors = NamedTuple(f"{name}_tensors", [*hints(inputs).items(),
                                                 ("row_params", Optional[Tensor])])
        options = NamedTuple(f"{name}_options", [
            *hints(scalars).items(), ("time_dim", int), ("out_dtype", DTYPE),
            *(hints(extras).items() if extras is not None else ())])
        self._n_s = len(scalars._fields)
        super().__init__(name, "scan", inputs, options, outputs=outputs, forward=None,
                         fake=None, backward=backward, tensors=tensors, torch=torch, loop=loop)
        # (after Op's: a scan's check and value check take the time axis and the options)
        self.check = check
        # data-dependent checks (Retrace's actions): eagerly before the launch, and inside the
        # custom op under torch.compile (where tracing cannot read data)
        self.runtime_check = runtime_check
        self.packed_op = _register_packed(self) if self._mask is not None else None

    def __call__(self, x: tuple, s: tuple, time_dim, backend, out_dtype, extra: tuple = (),
                 cu_seqlens=None, check_offsets=True):
        if cu_seqlens is not None:
            return self._packed(x, s, time_dim, backend, out_dtype, extra, cu_seqlens,
                                check_offsets)
        key = None
        if (type(time_dim) is int and type(backend) is str and type(check_offsets) is bool
                and not torch.compiler.is_compiling()):
            # the hot path: a signature that passed the checks before passes them now (each
            # check is a function of it, `_args.signature`), and its plan is cached under it
            try:
                key = (self, time_dim, backend, out_dtype, extra, torch.is_grad_enabled(),
                       *signature(x))
            except Exception:  # not a tensor (or no strides): the checks below name it
                pass
            else:
                plan = _PLANS.get(key)
                if plan is not None and all([type(v) is float for v in s]):
                    if self.runtime_check is not None:
                        self.runtime_check(x, extra)
                    outs = plan.run(x, self.kernel_scalars(s))
                    n = self.n_out(extra)
                    return outs[0] if n == 1 else tuple(outs[:n])
        if check_offsets is not True:
            check_bool("check_offsets", check_offsets)
        backend = check_backend(backend)
        out_dtype = check_out_dtype(out_dtype)
        given = x
        x, call = self.check(x, time_dim, extra)
        rows = None
        if self.discounts and any(isinstance(getattr(s, f), Tensor) for f in self.discounts):
            # a new tuple only where a discount is a tensor: torch 2.11's dynamo loses the
            # fields of a traced `_replace` across a graph break (Retrace's actions check)
            s = s._replace(**{f: call.discount(f, getattr(s, f)) for f in self.discounts})
            rows = self._rows(s, x[0], call)
        n = self.n_out(extra)
        if call.empty():
            return _empty(x[0].shape, n, out_dtype, call, x, s)
        backend = backend_for(backend, call.device)
        if backend == "triton" and getattr(x, "mask", None) is not None and (
                call.needs_grad or not self.masked_kernels(x)):
            # masked backward kernels do not exist yet: autograd through the torch backend
            # (exact; not the kernels' speed)
            backend = "torch"
        if backend == "triton":
            floats = self._floats(s)
            if call.key is None:  # compiling: the custom op checks data, its autograd
                outs = self.custom_op(*x, rows, *floats, call.time_dim, out_dtype, *extra)
                return _result(list(outs[:n]) if self.outputs > 1 else [outs])
            if self.runtime_check is not None:
                self.runtime_check(x, extra)
            if call.needs_grad:  # eager: the same backward, without the dispatcher's layers
                o = self.options(*floats, call.time_dim, out_dtype, *extra)
                return _result(list(Eager.apply(self, o, call, *x, rows))[:n])
            # the plan under the call's signature (`key`) where the hot path can find it: the
            # caller's own tensors, scalars that are numbers, no gradient
            same = key is not None and rows is None and all(map(operator.is_, x, given))
            return _result(self._launch(x, floats, call, out_dtype, extra, rows,
                                        key=key if same else None)[:n])
        if self.runtime_check is not None:
            self.runtime_check(x, extra)
        tx = self.inputs(*(call.tm(t) if step else t for t, step in zip(x, self._steps)))
        if rows is not None:  # per-row discounts over the time-major [T, *batch, *trailing]
            tail = (1,) * (x[0].ndim - len(call.step_shape))
            s = s._replace(**{f: getattr(s, f).reshape(call.batch_shape + tail)
                              for f in self.discounts if isinstance(getattr(s, f), Tensor)})
        dtype = torch.float64 if call.float64 else torch.float32
        res = (self.torch if backend == "torch" else self.loop)(tx, s, extra, dtype)
        # the loop reads only what each step's formula reads (a T = 1 Retrace no Q-values): the
        # rest, where it requires grad, gets a zero gradient, not None (semantics §6)
        return self._outputs(res, x[0].shape, out_dtype, call, n,
                             (*x, *s) if backend == "loop" else ())

    @staticmethod
    def _outputs(res, shape, out_dtype, call: Call, n: int, inputs: tuple = ()):
        """The first `n` time-major results of a torch or loop implementation as new outputs of
        `shape` in the caller's layout; differentiable (first order) where the call is, and
        attached to the `inputs` that require grad (a zero gradient each, `reference.attached`)."""
        res = res if isinstance(res, tuple) else (res,)
        # new tensors, contiguous in the caller's layout; not torch.empty(shape) filled by
        # copy_: torch.compile merges equal empty() calls, and two outputs became one
        td = call.time_dim
        tm = (shape[td], *shape[:td], *shape[td + 1:])  # the time-major shape
        outs = [r.expand(tm).movedim(0, td).to(out_dtype, copy=True,
                                                memory_format=torch.contiguous_format)
                for r in res[:n]]
        if call.needs_grad:
            if inputs:
                outs[0] = reference.attached(outs[0], *inputs)
            first_order(outs)
        return _result(outs)

    def _packed(self, x, s, time_dim, backend, out_dtype, extra, cu_seqlens, check):
        """Packed variable-length rows (semantics §7, FlashAttention's `cu_seqlens`): each segment
        [cu[i], cu[i+1]) of the per-step tensors `[L, ...]` is a row of its own, its last step
        a window end; bootstraps are `[S, ...]`, a tensor discount `[S]` or `[S, *batch]`.
        Every argument is checked against the caller's shapes, and the offsets' values unless
        `check` is False or tracing or capture forbids the read, before any route:
        - Triton, where nothing needs gradients and the discounts are scalars: the [L] stream
          scanned in place as one long row whose segment ends are window ends
          (`scan.kernel.segment_windows`): no copy, no host sync but the offsets' check;
          inside torch.compile through the op's packed custom op (`_register_packed`), whose
          implementation is this eager path;
        - torch, Triton calls that need gradients, and (inside torch.compile) Triton calls
          with per-row discounts: the torch implementation on the same long row
          (`_packed_torch`): no padding and no host read, so torch.compile traces it and
          autograd differentiates it;
        - loop, and Triton with per-row discounts: padded rows (`_padded`); the loop backend
          inside torch.compile through the packed custom op (no gradients there)."""
        if self._mask is None:
            raise TypeError(f"{self.name} takes no cu_seqlens")
        check = check_bool("check_offsets", check)
        ref_name, ref = self.inputs._fields[0], x[0]
        if not isinstance(ref, Tensor):
            raise TypeError(f"{ref_name} must be a torch.Tensor, got {type(ref).__name__}")
        if ref.ndim == 0:
            raise ValueError(f"{ref_name} must have a time axis; got a 0-d tensor")
        # time_dim counts the axes of the forward scans' dones (x may have trailing features)
        axes = x.dones if isinstance(getattr(x, "dones", None), Tensor) else ref
        if not isinstance(time_dim, int) or isinstance(time_dim, bool) or time_dim not in (
                0, -max(axes.ndim, 1)):
            raise ValueError(f"with cu_seqlens the per-step tensors are packed [L, ...] with "
                             f"time on axis 0; got time_dim={time_dim!r}")
        backend = backend_for(check_backend(backend), ref.device)
        out_dtype = check_out_dtype(out_dtype)
        compiling = torch.compiler.is_compiling()
        cu = check_offsets(cu_seqlens, ref.shape[0], ref.device,
                           data=check and not compiling and not unreadable(),
                           dtypes=(torch.int32, torch.int64))
        checked, call = self.check(x, 0, extra, segments=cu.shape[0] - 1)
        ps = self._segment_discounts(s, call)
        n = self.n_out(extra)
        if call.empty():
            return _empty(checked[0].shape, n, out_dtype, call, checked, ps)
        per_row = ps is not s
        in_place = (backend == "triton" and self.packed_kernels(x) and not per_row
                    and not call.needs_grad)
        if compiling and (in_place or backend == "loop"):
            if call.needs_grad:
                raise RuntimeError(
                    f"{self.name} with cu_seqlens and backend='loop' inside torch.compile "
                    "computes no gradients (it runs as one custom op); use backend='torch'")
            disc = [getattr(s, f) if isinstance(getattr(s, f), Tensor) else None
                    for f in self.discounts]
            outs = self.packed_op(*x, *self._floats(s), *disc, cu, backend, out_dtype, *extra,
                                  check)
            return _result(list(outs[:n]) if self.outputs > 1 else [outs])
        if in_place:
            if self.runtime_check is not None:
                self.runtime_check(checked, extra)
            cu = cu.contiguous()
            call.key.append(("cu_seqlens", cu.shape, cu.dtype, cu.data_ptr() % 16 == 0))
            return _result(self._launch(checked, ps, call, out_dtype, extra, cu=cu)[:n])
        if backend != "loop" and (backend == "torch" or call.needs_grad or compiling):
            return self._packed_torch(checked._replace(mask=x.mask), ps, out_dtype, extra, cu,
                                      call)
        return self._padded(x, ps, backend, out_dtype, extra, cu, call)

    def _segment_discounts(self, s, call: Call):
        """Per-row discounts of packed rows (docs/semantics.md §6, §7): a tensor is one value
        per segment, its leading axis the segment axis (`[S]`, `[S, *batch]`, or 0-d: one for
        all), returned as float32 (float64) on the call's device, shaped `[S, 1, ...]` so that
        it broadcasts over the batch shape `[S, *batch]` of padded rows (a bare `[S]` would
        otherwise meet the last batch axis); `s` itself where every discount is a number."""
        if not self.discounts or not any(isinstance(getattr(s, f), Tensor)
                                         for f in self.discounts):
            return s
        S, batch = call.segments, tuple(call.batch_shape)
        full = (S,) + batch
        out = {}
        for f in self.discounts:
            v = getattr(s, f)
            if not isinstance(v, Tensor):
                continue
            ok = v.ndim <= len(full)
            if ok and v.ndim:
                v = v.reshape(tuple(v.shape) + (1,) * (len(full) - v.ndim))
                try:
                    ok = torch.broadcast_shapes(v.shape, full) == full
                except RuntimeError:
                    ok = False
            if not ok:
                want = ", ".join(map(str, full))
                raise ValueError(
                    f"{f} has shape {tuple(getattr(s, f).shape)} but cu_seqlens has {S} "
                    f"segments; with packed rows a per-row {f} has one value per segment: "
                    f"shape ({S},) or ({want}{',' if len(full) == 1 else ''})")
            out[f] = call.adopt_discount(f, v)
        return s._replace(**out)

    def _packed_torch(self, x, s, out_dtype, extra, cu, call: Call):
        """Packed rows on the torch implementation, as one long row `[L, *batch]`
        (`torch_scan.packed_rows`): each segment's last decision step is a window end, its
        bootstraps and discounts are read per step; every index is formed on the device (no
        host read: traced by torch.compile, captured in a CUDA graph), and stays inside its
        tensor whatever the offsets hold. Differentiable by autograd."""
        seg, packed = torch_scan.packed_rows(cu, tuple(call.step_shape), x[self._mask])
        tail = (1,) * (x[0].ndim - len(call.step_shape))
        x = self.inputs(*(t if step or t is None else t[seg]
                          for t, step in zip(x, self._steps)))
        per_step = {}
        for f in self.discounts:
            v = getattr(s, f)
            if isinstance(v, Tensor) and v.ndim:  # [S or 1, 1 or batch...]: its segment's
                v = v.expand((call.segments,) + tuple(v.shape[1:]))[seg]
                per_step[f] = v.reshape(v.shape + tail)
        s = s._replace(**per_step)
        if self.runtime_check is not None and not torch.compiler.is_compiling():
            self.runtime_check(x, extra)  # (traced: unread, the implementation clamps)
        dtype = torch.float64 if call.float64 else torch.float32
        res = self.torch(x, s, extra, dtype, packed=packed)
        return self._outputs(res, x[0].shape, out_dtype, call, self.n_out(extra))

    def _padded(self, x, s, backend, out_dtype, extra, cu, call: Call):
        """Packed rows run as padded rows `[S, longest, *batch, ...]` whose padding is masked
        out (with the caller's mask), then packed back: one host read (the longest segment), a
        scatter in and a gather out; differentiable (the loop backend's gradients). `x` and
        the offsets `cu` are checked (`call`); whatever the offsets hold (`check_offsets=False`)
        every index stays inside its tensor."""
        L, S, batch = call.T, call.segments, tuple(call.batch_shape)
        cu = cu.long()
        longest = min(max(int((cu[1:] - cu[:-1]).max()), 1), L)  # (bounded, whatever cu holds)
        steps = torch.arange(L, device=call.device)
        seg = torch_scan.segment_ids(cu, L)
        pos = (steps - cu[:-1][seg]).clamp(0, longest - 1)

        def pad(t):
            out = t.new_zeros((S, longest) + tuple(t.shape[1:]))
            out[seg, pos] = t
            return out

        padded = [t if t is None or not step or name == "mask" else pad(t)
                  for name, t, step in zip(self.inputs._fields, x, self._steps)]
        valid = torch.zeros((S, longest), dtype=torch.bool, device=call.device)
        valid[seg, pos] = True
        valid = valid.view((S, longest) + (1,) * len(batch))
        user = x[self._mask]
        valid = (valid & (pad(user) != 0) if user is not None
                 else valid.expand((S, longest) + batch))
        padded[self._mask] = valid
        outs = self(self.inputs(*padded), s, 1, backend, out_dtype, extra)
        if isinstance(outs, Tensor):
            return outs[seg, pos]
        return tuple(o[seg, pos] for o in outs)

    # ---- the hooks of the custom op and `op.Eager` ------------------------------------------

    def _split(self, o: tuple):
        """(scalars, time_dim, out_dtype, extras) of the custom op's options."""
        k = self._n_s
        extra = self.extras(*o[k + 2:]) if self.extras is not None else ()
        return self.scalars(*o[:k]), o[k], o[k + 1], extra

    def forward(self, x: tuple, o: tuple, call: Optional[Call] = None):
        """The launch on the custom op's tensors (the inputs, then `row_params`) and options:
        `call` the checked call's, or None (the custom op: every check, the values' too)."""
        inputs, rows = self.inputs(*x[:-1]), x[-1]
        s, time_dim, out_dtype, extra = self._split(o)
        if call is None:
            inputs, call = self.check(inputs, time_dim, extra)
            if self.runtime_check is not None:
                self.runtime_check(inputs, extra)
            if call.empty():
                return _fake_outputs(self, inputs[0], out_dtype, extra), []
        outs = self._launch(inputs, s, call, out_dtype, extra, rows)[:self.n_out(extra)]
        res = _custom_outputs(self, outs, inputs[0], out_dtype)
        return (res if isinstance(res, tuple) else (res,)), []

    def backward(self, x, o, outs, saved, grads, needs, call: Optional[Call] = None) -> list:
        inputs, rows = self.inputs(*x[:-1]), x[-1]
        s, time_dim, out_dtype, extra = self._split(o)
        if call is None:
            inputs, call = self.check(inputs, time_dim, extra)
        m = self.n_out(extra)
        return self.run_backward(inputs, list(outs[:m]), list(grads[:m]), s, rows, call, extra,
                                 list(needs))

    def fake(self, x: tuple, o: tuple):
        s, time_dim, out_dtype, extra = self._split(o)
        res = _fake_outputs(self, x[0], out_dtype, extra)
        return (res if isinstance(res, tuple) else (res,)), []

    def grad_like(self, t: Tensor) -> Tensor:
        return torch.empty_like(t)

    def run_backward(self, x, outs, grads, s, rows, call, extra, needs) -> list:
        """`backward`'s gradients, one per input (None for the mask) and one for `rows`."""
        k = self._mask
        if k is None:
            return self._backward(x, outs, grads, s, rows, call, extra, needs)
        res = self._backward(x, outs, grads, s, rows, call, extra, needs[:k] + needs[k + 1:])
        return res[:k] + [None] + res[k:]

    def _floats(self, s: tuple) -> tuple:
        """The scalars with per-row discounts as 0.0 (the kernel reads `rows` there)."""
        if any(isinstance(v, Tensor) for v in s):
            return s._replace(**{f: 0.0 for f in self.discounts
                                 if isinstance(getattr(s, f), Tensor)})
        return s

    def _rows(self, s: tuple, x0: Tensor, call: Call) -> Tensor:
        """The kernel's first `row_params` scalars, per row: `[k, *rows]` float32 contiguous,
        rows being input 0's shape without its time axis (trailing feature axes included)."""
        shape = tuple(x0.shape[:call.time_dim]) + tuple(x0.shape[call.time_dim + 1:])
        tail = (1,) * (x0.ndim - len(call.step_shape))
        params = []
        for p in self.kernel_scalars(s)[:self.row_params]:
            if isinstance(p, Tensor):
                p = p.float().reshape(call.batch_shape + tail).expand(shape)
            else:
                p = torch.full(shape, p, dtype=torch.float32, device=call.device)
            params.append(p)
        return torch.stack(params)

    def _launch(self, x, s, call: Call, out_dtype, extra, rows=None, cu=None,
                key=None) -> list:
        """The eager Triton path: the cached plan of this signature, or a new one (`cu`: packed
        rows' offsets; `key`: the hot path's key of the call, else the `call`'s)."""
        k = self.row_params if rows is not None else 0
        plan, x = cached_plan(key or (self.name, out_dtype, extra, k, *call.key),
                              lambda y: self.plan(y, call, out_dtype, extra), x, self.copy, k)
        return plan.run(x, self.kernel_scalars(s), rows, cu)


def _result(outs: list):
    return outs[0] if len(outs) == 1 else tuple(outs)


def _empty(shape, n: int, out_dtype, call: Call, *groups):
    """`n` empty outputs of `shape`; where the call needs gradients, attached to every input of
    `groups` (tensors and scalars) that requires grad, which gets a zero gradient: never a
    silent detach (docs/semantics.md §6)."""
    outs = [torch.empty(shape, dtype=out_dtype, device=call.device) for _ in range(n)]
    if call.needs_grad:
        # (x.sum() * 0 is NaN for a non-finite x, but it is added to no element; its gradient
        # is 0 * the empty outputs' summed gradient, 0)
        zero = sum(t.sum() * 0 for group in groups for t in group
                   if isinstance(t, Tensor) and t.requires_grad)
        outs = [o + zero for o in outs]
        first_order(outs)
    return _result(outs)


def _custom_outputs(op: ScanOp, outs, ref: Tensor, out_dtype):
    """A custom op's return value: its `op.outputs` tensors, those the call does not compute
    empty (a custom op returns a fixed number of tensors)."""
    outs = list(outs) + [ref.new_empty(0, dtype=out_dtype) for _ in range(op.outputs - len(outs))]
    return outs[0] if op.outputs == 1 else tuple(outs)


def _fake_outputs(op: ScanOp, ref: Tensor, out_dtype, extra):
    """A custom op's fake: outputs of input 0's shape."""
    return _custom_outputs(op, [torch.empty(ref.shape, dtype=out_dtype, device=ref.device)
                                for _ in range(op.n_out(extra))], ref, out_dtype)


def _register_packed(op: ScanOp):
    """`torch.ops.rl_triton.<name>_packed`: a packed call (docs/semantics.md §7) that
    torch.compile must not trace (the in-place kernels, or the loop backend's padded rows) as
    one custom op: the op's inputs, its scalars (a per-row discount 0.0, its tensor in
    `<discount>_rows`), the offsets, backend, out_dtype, extras and check_offsets. Its
    implementation is the eager packed path
    (`ScanOp._packed`, which checks the offsets' values at run time); no autograd: calls that
    need gradients trace the torch implementation instead (`ScanOp._packed_torch`)."""
    inputs = typing.get_type_hints(op.inputs)
    scalars = typing.get_type_hints(op.scalars)
    rows = {f + "_rows": Optional[Tensor] for f in op.discounts}
    rest = {"cu_seqlens": Tensor, "backend": str, "out_dtype": torch.dtype}
    extras = typing.get_type_hints(op.extras) if op.extras is not None else {}
    hints = [inputs, scalars, rows, rest, extras, {"check_offsets": bool}]
    n_in, n_s, n_r, n_e = len(inputs), len(scalars), len(rows), len(extras)
    returns = Tensor if op.outputs == 1 else tuple[(Tensor,) * op.outputs]

    def unpack(args):
        x = op.inputs(*args[:n_in])
        k = n_in + n_s
        s = op.scalars(*args[n_in:k])
        s = s._replace(**{f: t for f, t in zip(op.discounts, args[k:k + n_r]) if t is not None})
        cu, backend, out_dtype = args[k + n_r:k + n_r + 3]
        k += n_r + 3
        extra = op.extras(*args[k:k + n_e]) if op.extras is not None else ()
        return x, s, cu, backend, out_dtype, extra, args[-1]

    def impl(*args):
        x, s, cu, backend, out_dtype, extra, check = unpack(args)
        outs = op._packed(x, s, 0, backend, out_dtype, extra, cu, check)
        return _custom_outputs(op, outs if isinstance(outs, tuple) else (outs,), x[0], out_dtype)

    def fake(*args):
        x, s, cu, backend, out_dtype, extra, check = unpack(args)
        return _fake_outputs(op, x[0], out_dtype, extra)

    return custom_ops.define(op.name + "_packed", impl, fake, hints, returns)
