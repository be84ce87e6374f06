"""The callables the benchmark times: a call with its keyword arguments, its backward pass
alone, and forward plus backward."""
from __future__ import annotations

import torch


def call_of(fn, kw, **extra):
    """fn(**kw, **extra), as a callable without arguments."""
    return lambda: fn(**kw, **extra)


def as_tuple(outs) -> tuple:
    return outs if isinstance(outs, tuple) else (outs,)


def grad_inputs(kw):
    """kw with every floating input a leaf that requires grad (flags are bool, actions
    integers: no gradient), and those leaves."""
    kw = {k: v.detach().clone().requires_grad_() if isinstance(v, torch.Tensor)
          and v.is_floating_point() else v for k, v in kw.items()}
    return kw, [v for v in kw.values() if isinstance(v, torch.Tensor) and v.requires_grad]


def output_grads(outs, seed=0) -> list:
    """Fixed random float32 gradients of those of `outs` that require grad."""
    g = torch.Generator(device=outs[0].device).manual_seed(seed)
    return [torch.randn(o.shape, generator=g, device=o.device) for o in outs if o.requires_grad]


def backward_fn(outs, leaves, seed=0):
    """The backward pass of `outs` alone, repeatable: `torch.autograd.grad` of fixed output
    gradients, keeping the graph."""
    outs = as_tuple(outs)
    grads = output_grads(outs, seed)
    return lambda: torch.autograd.grad(outs, leaves, grads, retain_graph=True)


def fwd_bwd_fn(forward, leaves, grads=None):
    """Forward and backward: the gradients of the outputs' sum, or with `grads` (`output_grads`)
    those of the outputs that require grad against them."""
    def run():
        outs = as_tuple(forward())
        if grads is None:
            return torch.autograd.grad(sum(o.sum() for o in outs), leaves)
        return torch.autograd.grad([o for o in outs if o.requires_grad], leaves, grads)
    return run
