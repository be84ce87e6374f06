"""One op framework (docs/dev/op-framework.md): every public op is an `Op`, declared the same
way and registered in `OPS`.

An op declares its tensor arguments and its options (NamedTuples with type hints: the custom
op's schema, `custom_ops.register`), a forward (the Triton kernels), a backward (the kernels'
gradients, semantics §6), a fake (the outputs' shapes for torch.compile), its argument check and
its torch and loop implementations. Every backend runs through one of three paths:
- Triton inside torch.compile: the op's custom op `torch.ops.rl_triton.<name>`, whose autograd
  calls `torch.ops.rl_triton.<name>_backward`;
- Triton eagerly: `forward` directly, or where an input needs gradients the one autograd
  Function `Eager`, whose backward calls the op's `backward` directly (the custom op's autograd
  runs the same function, through dispatcher layers that cost host time);
- torch and loop: the implementation, differentiated by autograd through `FirstOrder`.
Every path refuses second-order gradients with `SECOND_ORDER`.

A call first looks its signature up in the plan cache (`plans._PLANS`, `Op.__call__`): a hit is
a signature that passed every check before, and finds the checked options and whatever the
forward derived from shapes; checks that read values (`runtime_check`) run on every call.
Scans specialize this in `scan.ScanOp`.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .. import reference
from .._args import signature
from . import custom_ops
from .custom_ops import SECOND_ORDER
from .plans import _PLANS, store

Tensor = torch.Tensor
OPS: dict = {}  # every public op, by name, in declaration order
KINDS = ("scan", "loss", "outcome", "head")
# public functions not declared as ops yet (docs/dev/op-framework.md): none
UNDECLARED = ()


def ops(kind: Optional[str] = None) -> list:
    """The public ops' names in the API's order (`rl_triton.__all__`), all or those of one kind
    ("scan", "loss", "outcome", "head"): what tests, the benchmark, the sm_90 compile check and
    the docs' reference page derive their lists from."""
    import rl_triton  # (the public functions: every op's module is imported by then)

    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}; got {kind!r}")
    return [n for n in rl_triton.__all__ if n in OPS and (kind is None or OPS[n].kind == kind)]


class Plan:
    """What a checked call fixed: the options (`o`, the custom op's), the backend, whether an
    input needs gradients, the compute dtype of the torch and loop backends, and `memo`, what
    the forward derives from shapes (filled by its first run)."""

    def __init__(self, o: tuple, backend: str, needs_grad: bool = False,
                 dtype: torch.dtype = torch.float32):
        self.o, self.backend, self.needs_grad, self.dtype = o, backend, needs_grad, dtype
        self.memo = {}
        self.drop = None  # the positions of the tensors the checks set aside as unread
        # False where the checked call holds objects of its own (a tensor option, a generator:
        # a key per call), run once, uncached
        self.cache = True


class Op:
    """One public op's declaration.

    name: the public function's (and the reference's, `rl_triton.reference.<name>`);
    kind: "scan", "loss", "outcome" or "head" (the fused loss head, semantics §11: chunks of
        logits, its kernels launched by its own loop);
    inputs: NamedTuple of the public function's tensor arguments, in its order; `tensors` the
        custom op's tensor arguments (default `inputs`), `options` its other arguments
        (a NamedTuple with type hints);
    outputs: the tensors a call returns (the custom op returns them, then `saved` more that its
        backward reads); outputs at `nondiff` carry no gradient;
    forward(x, o, plan) -> (outputs, saved): the Triton kernels on `tensors` x and options o;
        plan None: called by the custom op, every value check (`runtime_check`) to run;
    backward(x, o, saved, grads, needs, plan) -> one gradient per tensor argument (None where
        `needs` says no), from the outputs' gradients (None: zero); None: no gradient;
    fake(x, o) -> (outputs, saved): empty tensors of their shapes (`grad_like(t)`: a gradient's
        fake, default contiguous);
    check(t, a) -> (x, Plan): the public call's tensors `t` and other arguments `a` checked
        (every error raised here), `x` the `inputs` to run;
    runtime_check(x, o): the checks that read values, on every call;
    torch(x, o, dtype) / loop(x, o, dtype): the other backends' outputs;
    run(x, plan): the route among the backends, where the op has its own (default `Op.run`).
    """

    kind = None
    # whether `backward` reads the op's outputs (the scans'): `Eager` saves them only then, so
    # that an in-place edit of a returned metric does not break the backward
    reads_outputs = False

    def __init__(self, name: str, kind: str, inputs: type, options: type, *, outputs: int,
                 forward: Callable, fake: Callable, backward: Optional[Callable] = None,
                 saved: int = 0, nondiff: tuple = (), check: Optional[Callable] = None,
                 runtime_check: Optional[Callable] = None, torch: Optional[Callable] = None,
                 loop: Optional[Callable] = None, tensors: Optional[type] = None,
                 grad_like: Optional[Callable] = None, run: Optional[Callable] = None,
                 pairs: tuple = ()):
        if kind not in KINDS:
            raise ValueError(f"an op's kind is one of {KINDS}; got {kind!r}")
        self.name, self.kind, self.inputs, self.options = name, kind, inputs, options
        # the positions in `a` of options that are tuples of numbers: their items' types join
        # the plan's key (True == 1.0, so (True, 5.0) would find the plan of (1.0, 5.0))
        self.pairs = pairs
        self.tensors = tensors or inputs
        self.outputs, self.saved, self.nondiff = outputs, saved, nondiff
        self._forward, self._backward, self._fake = forward, backward, fake
        self.check, self.runtime_check = check, runtime_check
        self.torch, self.loop = torch, loop
        if grad_like is not None:
            self.grad_like = grad_like
        if run is not None:  # an op's own route among its backends (the outcome ops')
            self.run = run
        self.reference = getattr(reference, name)
        self.custom_op, self.grad_op = custom_ops.register(self)
        OPS[name] = self

    @property
    def function(self) -> Callable:
        """The public function `rl_triton.<name>`."""
        import rl_triton

        return getattr(rl_triton, self.name)

    @property
    def differentiable(self) -> bool:
        return self._backward is not None

    # the custom op's and `Eager`'s hooks (ScanOp overrides them)
    def forward(self, x: tuple, o: tuple, plan=None):
        if plan is None and self.runtime_check is not None:
            self.runtime_check(x, o)
        return self._forward(x, o, plan)

    def backward(self, x, o, outs, saved, grads, needs, plan=None) -> list:
        return self._backward(x, o, saved, grads, needs, plan)

    def fake(self, x: tuple, o: tuple):
        return self._fake(x, o)

    def grad_like(self, t: Tensor) -> Tensor:
        """A gradient's fake: contiguous, of `t`'s shape and dtype (the backward's layout)."""
        return t.new_empty(t.shape)

    # ---- the public call ----------------------------------------------------------------------

    def __call__(self, t: tuple, a: tuple):
        """The public call on its tensor arguments `t` (the order of `inputs`) and its other
        arguments `a`, as given. The hot path: a signature (tensors, `a` with its types, grad
        mode) that passed `check` before finds its plan in one lookup; the value checks run."""
        key = plan = None
        if not torch.compiler.is_compiling():
            try:
                key = (self, torch.is_grad_enabled(), a, tuple(map(type, a)), *signature(t))
                if self.pairs:
                    key += tuple([tuple(map(type, a[i])) for i in self.pairs])
                plan = _PLANS.get(key)
            except (AttributeError, TypeError):  # not a tensor, or unhashable: `check` names it
                key = None
        if plan is None:
            x, plan = self.check(t, a)
            plan.drop = tuple(i for i, (c, g) in enumerate(zip(x, t))
                              if c is None and g is not None) or None
            # cached where the checks ran on the caller's own tensors (no negated view
            # resolved, no offsets converted; some set aside as unread): the hot path runs on
            # those
            if key is not None and plan.cache and all([c is g or c is None
                                                        for c, g in zip(x, t)]):
                store(key, plan)
        else:
            x = self.inputs(*t) if plan.drop is None else self.inputs(
                *[None if i in plan.drop else g for i, g in enumerate(t)])
            if self.runtime_check is not None:
                self.runtime_check(x, plan.o)
        out = self.run(x, plan)
        if plan.drop is not None and torch.is_grad_enabled():
            # a tensor set aside as unread (value_loss's old_values without a clip) that
            # requires grad gets one, 0: never a silent detach (semantics §6)
            dropped = [t[i] for i in plan.drop]
            if isinstance(out, tuple):
                return (reference.attached(out[0], *dropped), *out[1:])
            return reference.attached(out, *dropped)
        return out

    def run(self, x: tuple, plan: Plan):
        """The checked call on its backend: a tensor, or a tuple of `outputs` tensors."""
        if plan.backend == "triton":
            outs = self.triton(x, plan.o, plan, plan.needs_grad)
        else:
            impl = self.torch if plan.backend == "torch" else self.loop
            outs = [r.to(plan.o.out_dtype) for r in impl(x, plan.o, plan.dtype)]
            if plan.needs_grad:
                first_order(outs, self.nondiff)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def triton(self, x: tuple, o: tuple, plan, needs_grad: bool) -> list:
        """The kernels' outputs, through the path the call needs (module docstring); `x` the
        custom op's tensor arguments."""
        if torch.compiler.is_compiling():
            res = self.custom_op(*x, *o)
            return list(res[:self.outputs]) if isinstance(res, tuple) else [res]
        if needs_grad and self.differentiable:
            return list(Eager.apply(self, o, plan, *x))
        return list(self.forward(x, o, plan)[0])


def first_order(outs: list, nondiff: tuple = ()) -> None:
    """The torch and loop backends' outputs (in place in `outs`), but those at `nondiff`,
    through `FirstOrder`."""
    idx = [i for i in range(len(outs)) if i not in nondiff]
    for i, r in zip(idx, FirstOrder.apply(*[outs[i] for i in idx])):
        outs[i] = r


class Eager(torch.autograd.Function):
    """An eager Triton call that records its backward: the op's `backward`, directly."""

    @staticmethod
    def forward(ctx, op, o, plan, *x):
        outs, saved = op.forward(op.tensors(*x), o, plan)
        kept = outs if op.reads_outputs else ()
        ctx.save_for_backward(*x, *kept, *saved)
        ctx.op, ctx.o, ctx.plan, ctx.n = op, o, plan, len(kept)
        ctx.mark_non_differentiable(*[outs[i] for i in op.nondiff])
        ctx.set_materialize_grads(False)  # an output without gradient is not read
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(SECOND_ORDER)
        op, saved = ctx.op, ctx.saved_tensors
        n = len(op.tensors._fields)
        if all(g is None for g in grads):  # no output has a gradient (gradcheck's undefined grad)
            return (None,) * (3 + n)
        res = op.backward(op.tensors(*saved[:n]), ctx.o, saved[n:n + ctx.n], saved[n + ctx.n:],
                          grads, list(ctx.needs_input_grad[3:]), ctx.plan)
        return (None, None, None, *res)


class FirstOrder(torch.autograd.Function):
    """The torch and loop backends' outputs, as they are: autograd differentiates those
    backends, and this refuses second-order gradients as the kernels' backward does."""

    @staticmethod
    def forward(ctx, *outs):
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(SECOND_ORDER)
        return grads
