"""The one custom-op registration (docs/dev/op-framework.md): every op's Triton path as
`torch.ops.rl_triton.<name>` (its tensors, then its options; returns its outputs, then the
tensors its backward reads) with its autograd, whose backward is a second custom op,
`torch.ops.rl_triton.<name>_backward` (the tensors, the outputs, the saved tensors, the outputs'
gradients, the options and which gradients to form; one gradient per tensor, empty where not
formed). torch.compile traces both without a graph break (semantics §6: first-order gradients
only; a second-order backward raises `SECOND_ORDER`, as every path does).
"""
from __future__ import annotations

import inspect
import typing
from typing import Callable, Optional

import torch

Tensor = torch.Tensor
SECOND_ORDER = ("rl_triton computes first-order gradients only: a backward pass with "
                "create_graph=True (second-order gradients) through it is not supported")


def define(name: str, impl: Callable, fake: Callable, hints: list, returns) -> object:
    """`torch.ops.rl_triton.<name>`: `impl` with the schema of `hints` (dicts of argument name
    -> type, in order) returning `returns`, and its fake."""
    params = [inspect.Parameter(k, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=v)
              for h in hints for k, v in h.items()]
    impl.__signature__ = inspect.Signature(params, return_annotation=returns)
    impl.__name__ = name
    custom = torch.library.custom_op(f"rl_triton::{name}", impl, mutates_args=())
    custom.register_fake(fake)
    return custom


def _returns(n: int):
    return Tensor if n == 1 else tuple[(Tensor,) * n]


def register(op) -> tuple:
    """(forward custom op, backward custom op or None) of `op` (`op.Op`)."""
    tensors = typing.get_type_hints(op.tensors)
    options = typing.get_type_hints(op.options)
    n_in, n_out = len(tensors), op.outputs
    n_ret = n_out + op.saved

    def unpack(args):
        return op.tensors(*args[:n_in]), op.options(*args[n_in:])

    def pack(res):
        outs, saved = res
        res = tuple(outs) + tuple(saved)
        return res[0] if n_ret == 1 else res

    def impl(*args):
        return pack(op.forward(*unpack(args)))

    def fake(*args):
        return pack(op.fake(*unpack(args)))

    custom = define(op.name, impl, fake, [tensors, options], _returns(n_ret))
    if not op.differentiable:
        return custom, None

    saved = {f"saved{i}": Tensor for i in range(op.saved)}
    outs = {f"out{i}": Tensor for i in range(n_out)}
    grads = {f"grad{i}": Optional[Tensor] for i in range(n_out)}

    def unpack_backward(args):
        k = n_in + n_out + op.saved
        x = op.tensors(*args[:n_in])
        return (x, args[n_in:n_in + n_out], args[n_in + n_out:k], args[k:k + n_out],
                op.options(*args[k + n_out:-1]), list(args[-1]))

    def backward_impl(*args):
        x, outs, saved, grads, o, needs = unpack_backward(args)
        res = op.backward(x, o, outs, saved, grads, needs)
        return [outs[0].new_empty(0) if r is None else r for r in res]

    def backward_fake(*args):
        x, outs, saved, grads, o, needs = unpack_backward(args)
        return [op.grad_like(t) if need else outs[0].new_empty(0)
                for t, need in zip(x, needs)]

    grad_op = define(op.name + "_backward", backward_impl, backward_fake,
                     [tensors, outs, saved, grads, options, {"needs": list[bool]}],
                     list[Tensor])

    def refuse(ctx, *grads):
        raise RuntimeError(SECOND_ORDER)

    grad_op.register_autograd(refuse, setup_context=lambda ctx, inputs, output: None)

    def setup_context(ctx, inputs, output):
        res = output if isinstance(output, tuple) else (output,)
        ctx.save_for_backward(*inputs[:n_in], *res)
        ctx.o = inputs[n_in:]

    def backward(ctx, *grads):
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            raise RuntimeError(SECOND_ORDER)
        saved_tensors = ctx.saved_tensors
        needs = list(ctx.needs_input_grad[:n_in])
        res = grad_op(*saved_tensors, *grads[:n_out], *ctx.o, needs)
        return (*[r if need else None for r, need in zip(res, needs)], *(None,) * len(ctx.o))

    custom.register_autograd(backward, setup_context=setup_context)
    return custom, grad_op
