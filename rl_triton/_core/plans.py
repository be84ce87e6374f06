"""The plan cache every op shares (docs/dev/op-framework.md), the backend choice, and whether
the host may read device data now.

A plan is what an op derives from a call's signature (`_args.signature`: every tensor's type,
shape, strides, dtype, device, requires_grad, negation bit and 16-byte alignment, with the call's
options): scans cache their `scan.launch.Launch`, losses and the outcome ops the checked options
and what their forward computes from shapes. A signature that passed the checks once passes
them again (each check is a function of it), so the cached plan is itself the check; checks that
read values (offsets, Retrace's actions) run on every call.
"""
from __future__ import annotations

import os
from typing import Callable

import torch

from ..scan import jit
from ..scan.jit import HAS_TRITON

_PLANS: dict = {}
_MAX_PLANS = 4096


def clear_plans() -> None:
    """Forget every cached plan (tests and tuning: tile rules read at plan time)."""
    _PLANS.clear()


def store(key, plan) -> None:
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan


def cached_plan(key: tuple, build: Callable, x: tuple, copy: Callable, row_params: int = 0):
    """(plan, inputs): the scan plan cached under `key`, else `build(x)`'s; where that cannot
    read `x` in place (batch axes no two strides describe), the plan of contiguous copies,
    uncached."""
    plan = _PLANS.get(key)
    if plan is None:
        plan = build(x)
        if plan is None:
            x = copy(x)
            return build(x).per_row(row_params), x
        plan = plan.per_row(row_params)
        store(key, plan)
    return plan, x


def backend_for(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton":
        if not HAS_TRITON:
            raise RuntimeError("backend='triton' needs Triton, which is not installed here; use "
                               "backend='torch'")
        if device.type == "cpu" and not jit.INTERPRETER:
            if os.environ.get("TRITON_INTERPRET") == "1":
                raise ValueError("backend='triton' on CPU tensors: TRITON_INTERPRET=1 was set "
                                 "after rl_triton was imported, and Triton reads it when the "
                                 "kernels are defined; set it before `import rl_triton` (in "
                                 "the shell, or at the top of the script), or use "
                                 "backend='torch'")
            raise ValueError("backend='triton' on CPU tensors runs Triton's interpreter: set "
                             "TRITON_INTERPRET=1 before triton is imported, or use "
                             "backend='torch'")
    return backend


def unreadable() -> bool:
    """Whether the host cannot read device data now (tracing, CUDA-graph capture): offsets'
    values are then not checked (the kernels read only inside their tensors)."""
    return torch.compiler.is_compiling() or (
        torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
