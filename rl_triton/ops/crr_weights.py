"""Critic-regularized regression weights (CRR, semantics §9): one kernel, no gradient by definition
(CRR's loss is `-weight * log pi`, the weight a fixed coefficient)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import reference
from .._args import Call, check_backend, check_choice, check_out_dtype, check_scalar
from ..scan.jit import cdiv, next_power_of_2, tl, triton
from .._core.op import Op
from . import _losses as L

Tensor = torch.Tensor
KINDS = ("exp", "binary")
BASELINES = ("mean", "max")


class Inputs(NamedTuple):
    q_values: Tensor
    sampled_q_values: Tensor


class Options(NamedTuple):
    beta: float
    kind: str
    max_weight: float
    baseline: str
    out_dtype: torch.dtype


@triton.jit
def forward_kernel(q, sampled, out, N, J, q_n, s_n, s_j, beta, max_weight,
                   EXP: tl.constexpr, MEAN: tl.constexpr, INT64: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr):
    """adv = Q(s, a) - mean_j (or max_j) Q(s, a_j); min(exp(adv / beta), max_weight) or
    1[adv > 0], NaN where adv is NaN."""
    n, inb = L.positions(N, INT64, BLOCK_N)
    acc = tl.full([BLOCK_N], 0.0 if MEAN else float("-inf"), tl.float32)
    for j0 in range(0, J, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        ok = inb[:, None] & (j[None, :] < J)
        x = tl.load(sampled + n[:, None] * s_n + j[None, :] * s_j, mask=ok, other=0.0).to(
            tl.float32)
        if MEAN:
            acc += tl.sum(x, axis=1)
        else:
            acc = L.maximum(acc, tl.reduce(tl.where(ok, x, float("-inf")), 1, L.maximum))
    if MEAN:
        acc = acc / J
    adv = tl.load(q + n * q_n, mask=inb, other=0.0).to(tl.float32) - acc
    if EXP:
        w = L.minimum(tl.exp(adv / beta), max_weight)
    else:
        w = tl.where(adv != adv, adv, tl.where(adv > 0, 1.0, 0.0))
    tl.store(out + n, w.to(out.dtype.element_ty), mask=inb)


def _views(q: Tensor, sampled: Tensor):
    """q as [N] and sampled as [N, J]: views where one stride describes the batch axes, else
    copies."""
    N, J = q.numel(), sampled.shape[-1]
    try:
        return q.view(N), sampled.view(N, J)
    except RuntimeError:  # batch axes no one stride describes
        return q.reshape(N), sampled.reshape(N, J)


def _fixed(x: Inputs, o: Options):
    """(whether the views copy, grid, the sizes and strides, flags): fixed by the call's
    signature; views that do not copy share their tensor's address, which is all a kernel
    reads of them."""
    q, sampled = x
    N, J = q.numel(), sampled.shape[-1]
    qv, sv = _views(q, sampled)
    extent = max((N - 1) * abs(qv.stride(0)), (N - 1) * abs(sv.stride(0))
                 + (J - 1) * abs(sv.stride(1))) + 1
    block_j = min(next_power_of_2(J), 64)
    block_n = max(16, min(1024 // block_j, next_power_of_2(max(N, 1))))
    copies = qv.data_ptr() != q.data_ptr() or sv.data_ptr() != sampled.data_ptr()
    return (copies, cdiv(N, block_n), (N, J, qv.stride(0), *sv.stride()),
            dict(EXP=o.kind == "exp", MEAN=o.baseline == "mean",
                 INT64=max(extent, N * J) > L.INT32_MAX, BLOCK_N=block_n, BLOCK_J=block_j,
                 num_warps=4))


def forward(x: Inputs, o: Options, plan=None):
    q, sampled = x
    copies, programs, sizes, meta = L.fixed(plan, _fixed, x, o)
    out = torch.empty(q.shape, dtype=o.out_dtype, device=q.device)
    if copies:
        q, sampled = _views(q, sampled)
    L.launch(forward_kernel, programs, q, sampled, out, *sizes, o.beta, o.max_weight, **meta,
             plan=plan)
    return [out], []


def fake(x: Inputs, o: Options):
    return [x.q_values.new_empty(x.q_values.shape, dtype=o.out_dtype)], []


def torch_impl(x: Inputs, o: Options, dtype):
    q, sampled = (t.detach().to(dtype) for t in x)  # weights carry no gradient
    base = sampled.mean(-1) if o.baseline == "mean" else sampled.amax(-1)
    adv = q - base
    if o.kind == "exp":
        return (torch.exp(adv / o.beta).clamp(max=o.max_weight),)
    return (torch.where(adv.isnan(), adv, (adv > 0).to(dtype)),)


def loop_impl(x: Inputs, o: Options, dtype):
    return (reference.crr_weights(*(t.detach() for t in x), beta=o.beta, kind=o.kind,
                                  max_weight=o.max_weight,
                                  baseline=o.baseline, dtype=dtype),)




def _check(t: tuple, a: tuple):
    """The public call's arguments checked (`crr_weights`'s order): (inputs, plan)."""
    q_values, sampled_q_values = t
    beta, kind, max_weight, baseline, backend, out_dtype = a
    backend = check_backend(backend)
    out_dtype = check_out_dtype(out_dtype)
    call = Call("q_values", q_values, None)
    q = call.step("q_values", q_values)
    sampled = call.step("sampled_q_values", sampled_q_values, trailing=1)
    if sampled.shape[-1] == 0:
        raise ValueError(f"sampled_q_values has shape {tuple(sampled.shape)}: no sampled "
                         "action (its last axis holds them)")
    o = Options(check_scalar("beta", beta, high=None, low_open=True),
                check_choice("kind", kind, KINDS),
                check_scalar("max_weight", max_weight, high=None, low_open=True),
                check_choice("baseline", baseline, BASELINES), out_dtype)
    call.needs_grad = False
    if torch.compiler.is_compiling():  # (the custom op has no autograd)
        q, sampled = q.detach(), sampled.detach()
    return Inputs(q, sampled), L.plan(call, backend, o)


OP = Op("crr_weights", "loss", Inputs, Options, outputs=1, nondiff=(0,), forward=forward,
        fake=fake, check=_check, torch=torch_impl, loop=loop_impl)


def crr_weights(q_values, sampled_q_values, *, beta=1.0, kind="exp", max_weight=20.0,
                baseline="mean", backend="auto", out_dtype=torch.float32):
    """CRR's advantage weights for `loss = -(weight * log_pi(a|s)).mean()`.

    `q_values[...]` = Q(s, a) at the dataset's actions; `sampled_q_values[..., J]` = Q(s, a_j)
    at J actions sampled from the policy::

        adv = Q(s, a) - mean_j Q(s, a_j)        (baseline="max": max_j)
        w   = min(exp(adv / beta), max_weight)  kind="exp"
        w   = 1[adv > 0]                        kind="binary"

    A NaN advantage gives a NaN weight (on every backend). The weights carry no gradient, by
    definition: the result never requires grad, whatever the inputs do.

    Example::

        >>> w = rl_triton.crr_weights(q_data, q_sampled, beta=1.0)
        >>> actor_loss = -(w * policy.log_prob(actions)).mean()
    """
    return OP((q_values, sampled_q_values),
              (beta, kind, max_weight, baseline, backend, out_dtype))
