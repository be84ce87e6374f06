"""The fused loss head (semantics §11): log-probabilities, entropies and a policy loss from the
policy's last hidden states and its LM head, never holding more than one chunk of logits.

One loop serves every call (`_Head.chunks`): for each chunk of `chunk_size` tokens, the logits
`hidden[chunk] @ weight.T` go into one float32 buffer `[chunk_size, V]` (cuBLAS; bf16 and fp16
inputs multiply in their own dtype with float32 accumulation and a float32 result, through
`torch.mm(..., out_dtype=torch.float32)`), `stats` reads the buffer once for each token's
log-sum-exp, log-probability of its label and entropy, and `grad` turns it, in place, into the
gradient of the logits (in the matmul's dtype), from which d hidden (one matmul per chunk) and
d weight (accumulated in float32 across chunks) follow. `stats` and `grad` are one Triton kernel
each on the Triton backend (a program per token, looping over the vocabulary) and a few torch
ops on the torch backend, on the same chunks.

`token_log_probs` recomputes each chunk's logits in its backward (four matmuls in all);
`linear_policy_loss` computes its gradients during the forward, chunk by chunk (three matmuls):
its loss is sum_i w_i l_i with per-token weights w_i the mask, the offsets and the aggregation
fix up front, and l_i a function of token i's log-probability and entropy alone, so each chunk's
d loss / d lp and d loss / d entropy are known as soon as the chunk's statistics are (the
per-token formula is `policy_loss.token_terms`, differentiated with torch.func: it also runs
inside the custom op). The backward scales the stored gradients by the loss's gradient. A loss
type whose token depends on its sequence or the batch (gspo, sequence ratios, geo_mean,
clip_cov, kl_cov) runs in two passes instead: `token_log_probs`, `policy_loss` on its output,
and `token_log_probs`'s backward.

Both are ops of kind "head" (`TOKEN_LOG_PROBS`, `LINEAR_POLICY_LOSS`, docs/dev/op-framework.md).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import reference
from .._args import (INDEX, VALUE, Call, check_backend, check_bool, check_choice, check_clips,
                     check_scalar)
from .._core.op import Op, Plan, first_order
from .._core.plans import backend_for
from ..scan.jit import next_power_of_2, tl, triton
from . import _losses as L
from . import policy_loss as PL
from .kl_penalty import KINDS as KL_KINDS

Tensor = torch.Tensor
HALF = (torch.bfloat16, torch.float16)
# the default chunk: a power of two of tokens whose float32 logits hold at most this many bytes
# (2048 tokens at V = 151936; docs/dev/fused-head.md measured 1024 to 4096)
LOGITS_BYTES = 3 * 2**29
MAX_BLOCK_V = 4096  # vocabulary entries per step of a kernel's loop over a row
NUM_WARPS = 8


# ---- the kernels: one program per token of the chunk ---------------------------------------------

@triton.jit
def _label(labels, row, V, ignore_index):
    """(valid, y): whether the token counts (label != ignore_index) and the column to read (the
    label, clamped into [0, V): a kernel never reads outside the row, whatever labels hold)."""
    label = tl.load(labels + row).to(tl.int64)
    valid = label != ignore_index
    y = tl.where(valid & (label >= 0) & (label < V), label, 0)
    return valid, y


@triton.jit
def stats_kernel(logits, s_row, labels, bias, lp, ent, lse, V, ignore_index, inv_t,
                 HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """z = logits / T + bias: the log-sum-exp, z[label] - lse and the entropy, from one read of
    the row (an online log-sum-exp; the entropy as log s - t / s with s = sum e^(z - m) and
    t = sum e^(z - m) (z - m), both rescaled as the running maximum m grows: no cancellation
    of two large terms)."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * s_row
    valid, y = _label(labels, row, V, ignore_index)
    m = -3.0e38  # finite: exp(m - m_new) and s * (m - m_new) stay 0, not NaN, at the start
    s = 0.0
    t = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inb = cols < V
        z = tl.load(base + cols, mask=inb, other=float("-inf")).to(tl.float32) * inv_t
        if HAS_BIAS:
            z += tl.load(bias + cols, mask=inb, other=0.0).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        alpha = tl.exp(m - m_new)
        e = tl.exp(z - m_new)
        # a -inf logit (a token masked out through the bias) has e = 0 and adds 0, not 0 * -inf
        t = alpha * (t + s * (m - m_new)) + tl.sum(e * tl.where(e > 0, z - m_new, 0.0), axis=0)
        s = alpha * s + tl.sum(e, axis=0)
        m = m_new
    log_s = tl.log(s)
    lse_row = m + log_s
    zy = tl.load(base + y).to(tl.float32) * inv_t
    if HAS_BIAS:
        zy += tl.load(bias + y).to(tl.float32)
    tl.store(lse + row, lse_row)
    tl.store(lp + row, tl.where(valid, zy - lse_row, 0.0))
    tl.store(ent + row, tl.where(valid, log_s - t / s, 0.0))


@triton.jit
def grad_kernel(logits, s_row, dlogits, s_drow, labels, bias, lse, ent, g_lp, g_ent, V,
                ignore_index, inv_t, HAS_BIAS: tl.constexpr, HAS_ENT: tl.constexpr,
                NARROW: tl.constexpr, BLOCK: tl.constexpr):
    """d loss / d logits = (g_lp (onehot - p) - g_ent p (z - lse + H)) / T, written over the
    logits it is computed from (`dlogits` may alias `logits`): p = e^(z - lse), H the entropy;
    0 on a token that does not count."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * s_row
    dbase = dlogits + row * s_drow
    valid, y = _label(labels, row, V, ignore_index)
    lse_row = tl.load(lse + row)
    gl = tl.where(valid, tl.load(g_lp + row), 0.0)
    if HAS_ENT:
        ge = tl.where(valid, tl.load(g_ent + row), 0.0)
        h = tl.load(ent + row)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inb = cols < V
        z = tl.load(base + cols, mask=inb, other=float("-inf")).to(tl.float32) * inv_t
        if HAS_BIAS:
            z += tl.load(bias + cols, mask=inb, other=0.0).to(tl.float32)
        p = tl.exp(z - lse_row)
        d = tl.where(cols == y, gl, 0.0) - gl * p
        if HAS_ENT:
            d -= ge * p * tl.where(p > 0, z - lse_row + h, 0.0)
        d = tl.where(valid, d * inv_t, 0.0)
        if NARROW:
            # a bf16 / fp16 gradient over float32 logits: element j lands on the bytes of
            # logit j / 2, read by this block or an earlier one: every thread must have read
            # its logits before any writes (only the first block overlaps itself)
            tl.debug_barrier()
        tl.store(dbase + cols, d.to(dlogits.dtype.element_ty), mask=inb)


# ---- the same two steps in torch (the torch backend) ---------------------------------------------

def _stats_torch(z: Tensor, y: Tensor, valid: Tensor, bias, inv_t: float):
    """(lp, entropy, lse) of the logits chunk `z` (float32 or float64), as `stats_kernel`."""
    z = z * inv_t
    if bias is not None:
        z = z + bias.to(z.dtype)
    lse = torch.logsumexp(z, -1)
    logp = z - lse[:, None]
    p = logp.exp()
    ent = -torch.where(p == 0, 0.0, p * logp).sum(-1)  # (0 log 0 = 0; a NaN row stays NaN)
    lp = logp.gather(-1, y[:, None]).squeeze(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0), lse


def _grad_torch(z: Tensor, out: Tensor, y, valid, bias, inv_t, lse, ent, g_lp, g_ent) -> None:
    """`grad_kernel`'s d loss / d logits into `out` (which may be `z` itself)."""
    zz = z * inv_t
    if bias is not None:
        zz = zz + bias.to(zz.dtype)
    p = (zz - lse[:, None]).exp()
    gl = torch.where(valid, g_lp.to(zz.dtype), 0.0)[:, None]
    d = -gl * p
    d.scatter_add_(-1, y[:, None], gl)
    if g_ent is not None:
        ge = torch.where(valid, g_ent.to(zz.dtype), 0.0)[:, None]
        d -= ge * torch.where(p > 0, p * (zz - lse[:, None] + ent[:, None]), 0.0)
    out.copy_(torch.where(valid[:, None], d * inv_t, 0.0))


# ---- the chunk loop ------------------------------------------------------------------------------

_OUT_DTYPE_MM: dict = {}


def _mm_out_dtype_ok(device: torch.device) -> bool:
    """Whether `torch.mm(a, b, out_dtype=torch.float32)` runs for bf16 inputs here (CUDA, torch
    >= 2.8): a float32 result straight from cuBLAS's float32 accumulator."""
    key = (device.type, device.index)
    if key not in _OUT_DTYPE_MM:
        try:
            a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
            ok = torch.mm(a, a, out_dtype=torch.float32).dtype is torch.float32
        except (TypeError, RuntimeError, NotImplementedError):
            ok = False
        _OUT_DTYPE_MM[key] = ok
    return _OUT_DTYPE_MM[key]


class _Head:
    """One call's chunk loop over `hidden` [N, H] (flat), `weight` [V, H], `labels` [N]."""

    def __init__(self, hidden, weight, labels, bias, temperature, ignore_index, chunk_size,
                 backend):
        self.h, self.w, self.labels, self.bias = hidden, weight, labels, bias
        self.N, self.H = hidden.shape
        self.V = weight.shape[0]
        self.inv_t = 1.0 / temperature
        self.temperature = temperature
        self.ignore_index = ignore_index
        self.triton = backend == "triton"
        self.C = max(1, min(self.N, chunk_size))
        dt, dev = hidden.dtype, hidden.device
        # the matmuls' dtype: the inputs' own on CUDA (float32 logits through out_dtype); on
        # the CPU (or a torch without out_dtype) half inputs are upcast to float32: the same
        # products of the same (exactly representable) inputs
        self.native = dt in HALF and dev.type == "cuda" and _mm_out_dtype_ok(dev)
        if dt is torch.float64:
            self.mm_dtype = self.acc_dtype = torch.float64
        elif dt in HALF and not self.native:
            self.mm_dtype, self.acc_dtype = torch.float32, torch.float32
        else:
            self.mm_dtype, self.acc_dtype = dt, torch.float32
        self.buf = self._w_mm = None

    @property
    def w_mm(self):
        """The weight in the matmuls' dtype (a float32 copy only for half inputs on the CPU)."""
        if self._w_mm is None:
            w = self.w
            self._w_mm = w if self.mm_dtype == w.dtype else w.to(self.mm_dtype)
        return self._w_mm

    def release(self):
        """Drop the chunk buffer (and a weight copy) between the forward and the backward."""
        self.buf = self._w_mm = None

    def _buffer(self):
        if self.buf is None:
            self.buf = torch.empty((self.C, self.V), dtype=self.acc_dtype, device=self.h.device)
        return self.buf

    def _rows(self, s, e):
        h = self.h[s:e]
        return h if h.dtype == self.mm_dtype else h.to(self.mm_dtype)

    def logits(self, s, e) -> Tensor:
        """The chunk's logits hidden[s:e] @ weight.T in the float32 (float64) buffer."""
        z = self._buffer()[:e - s]
        h = self._rows(s, e)
        if self.native:
            torch.mm(h, self.w_mm.T, out_dtype=torch.float32, out=z)
        else:
            torch.mm(h, self.w_mm.T, out=z)
        return z

    def stats(self, z, s, e):
        """(lp, entropy, lse) [e - s] of the chunk's logits `z`."""
        labels = self.labels[s:e]
        if self.triton:
            n = e - s
            lp, ent, lse = (torch.empty(n, dtype=torch.float32, device=z.device)
                            for _ in range(3))
            b = self.bias if self.bias is not None else z
            stats_kernel[(n,)](z, z.stride(0), labels, b, lp, ent, lse, self.V,
                               self.ignore_index, self.inv_t, HAS_BIAS=self.bias is not None,
                               BLOCK=self._block(), num_warps=NUM_WARPS)
            return lp, ent, lse
        valid = labels != self.ignore_index
        y = torch.where(valid, labels, 0).long()
        return _stats_torch(z, y, valid, self.bias, self.inv_t)

    def _block(self):
        return max(16, min(MAX_BLOCK_V, next_power_of_2(self.V)))

    def grad_logits(self, z, s, e, lse, ent, g_lp, g_ent) -> Tensor:
        """d loss / d logits of the chunk, written over `z`, in the matmuls' dtype."""
        labels = self.labels[s:e]
        d = z if self.mm_dtype == z.dtype else z.view(self.mm_dtype)[:, :self.V]
        if self.triton:
            b = self.bias if self.bias is not None else z
            grad_kernel[(e - s,)](z, z.stride(0), d, d.stride(0), labels, b, lse, ent,
                                  g_lp.contiguous(), z if g_ent is None else g_ent.contiguous(),
                                  self.V, self.ignore_index, self.inv_t,
                                  HAS_BIAS=self.bias is not None, HAS_ENT=g_ent is not None,
                                  NARROW=d.dtype != z.dtype, BLOCK=self._block(),
                                  num_warps=NUM_WARPS)
        else:
            valid = labels != self.ignore_index
            y = torch.where(valid, labels, 0).long()
            _grad_torch(z, d, y, valid, self.bias, self.inv_t, lse, ent, g_lp, g_ent)
        return d

    def backprop(self, d, s, e, grads, needs) -> None:
        """d hidden[s:e] and the float32 accumulators of d weight and d bias from the chunk's
        d loss / d logits `d`; `grads` = [d_hidden, d_weight_acc, d_bias_acc]."""
        d_h, d_w, d_b = grads
        if needs[0]:
            if d_h.dtype == self.mm_dtype:
                torch.mm(d, self.w_mm, out=d_h[s:e])
            else:
                d_h[s:e] = torch.mm(d, self.w_mm)
        if needs[1]:
            # a token that does not count adds 0, not 0 * its hidden state (NaN where that is
            # not finite: semantics §11)
            h = torch.where((self.labels[s:e] != self.ignore_index)[:, None], self._rows(s, e),
                            0)
            # float32 accumulation of the bf16 / fp16 products, in place; the first chunk's
            # product overwrites the (uninitialized) accumulator: no pass to zero it
            beta = 0.0 if s == 0 else 1.0
            if self.native:
                torch.addmm(d_w, d.T, h, out_dtype=torch.float32, beta=beta, out=d_w)
            else:
                d_w.addmm_(d.T, h, beta=beta)
        if needs[2]:
            # d was scaled by 1 / T; the bias enters z unscaled
            part = d.sum(0, dtype=d_b.dtype)
            if s == 0:
                torch.mul(part, self.temperature, out=d_b)
            else:
                d_b.add_(part, alpha=self.temperature)

    def grad_buffers(self, needs):
        """[d_hidden (hidden's dtype), d_weight accumulator, d_bias accumulator] (None where
        not needed); the accumulators in float32 (float64 for float64 inputs)."""
        dev = self.h.device
        # contiguous, whatever hidden's strides: each chunk's matmul writes its rows in place
        d_h = torch.empty((self.N, self.H), dtype=self.h.dtype, device=dev) if needs[0] else None
        new = torch.empty if self.N else torch.zeros  # (no chunk writes them without tokens)
        d_w = new((self.V, self.H), dtype=self.acc_dtype, device=dev) if needs[1] else None
        d_b = new(self.V, dtype=self.acc_dtype, device=dev) if needs[2] else None
        return [d_h, d_w, d_b]

    def chunks(self):
        for s in range(0, self.N, self.C):
            yield s, min(self.N, s + self.C)


def _finish(grads, weight, bias):
    """The accumulators in their tensors' dtypes."""
    d_h, d_w, d_b = grads
    return (d_h, None if d_w is None else d_w.to(weight.dtype),
            None if d_b is None else d_b.to(bias.dtype))


def default_chunk_size(V: int) -> int:
    """The tokens per chunk when `chunk_size` is None (`LOGITS_BYTES`)."""
    rows = max(1, LOGITS_BYTES // (4 * V))
    return 1 << (rows.bit_length() - 1)


# ---- arguments -----------------------------------------------------------------------------------

class _Args(NamedTuple):
    call: Call
    hidden: Tensor  # [N, H]
    weight: Tensor
    labels: Tensor  # [N]
    bias: Optional[Tensor]
    shape: tuple  # labels' shape: the per-token outputs'
    backend: str
    chunk_size: int


def _head_args(hidden, weight, labels, bias, temperature, ignore_index, chunk_size, backend,
               check_labels) -> _Args:
    backend = check_backend(backend)
    call = Call("labels", labels, None)
    labels = call.step("labels", labels, INDEX)
    hidden = call.step("hidden", hidden, trailing=1)
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    weight = call._check("weight", weight, VALUE)
    H = hidden.shape[-1]
    if weight.ndim != 2 or weight.shape[1] != H or weight.shape[0] == 0:
        raise ValueError(f"weight has shape {tuple(weight.shape)} but hidden has shape "
                         f"{tuple(hidden.shape)}; weight must have shape (V, {H}), V >= 1 "
                         "(the LM head: one row per token of the vocabulary)")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden has dtype {hidden.dtype} but weight has dtype {weight.dtype}; "
                        "the matmul runs in one dtype: cast one of them")
    V = weight.shape[0]
    if bias is not None:
        if not isinstance(bias, Tensor):
            raise TypeError(f"bias must be a torch.Tensor, got {type(bias).__name__}")
        bias = call._check("bias", bias, VALUE)
        if bias.shape != (V,):
            raise ValueError(f"bias has shape {tuple(bias.shape)} but weight has shape "
                             f"{tuple(weight.shape)}; bias must have shape ({V},)")
    check_scalar("temperature", temperature, high=None, low_open=True)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    N = labels.numel()
    if chunk_size is None:
        chunk_size = default_chunk_size(V)
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if check_bool("check_labels", check_labels) and N:
        lo, hi = torch.stack(torch.aminmax(torch.where(labels == ignore_index, 0, labels))
                             ).tolist()  # one sync on CUDA
        if lo < 0 or hi >= V:
            bad = lo if lo < 0 else hi
            raise ValueError(f"labels holds {bad}, outside [0, {V}) (weight has {V} rows) and "
                             f"not ignore_index={ignore_index}")
    backend = backend_for(backend, call.device)
    # the kernels index labels and bias by position: contiguous ([N] integers, [V]: cheap)
    return _Args(call, hidden.reshape(N, H), weight, labels.reshape(N).contiguous(),
                 None if bias is None else bias.contiguous(), tuple(labels.shape), backend,
                 chunk_size)


def _head_plan(a: _Args, temperature, ignore_index) -> Plan:
    chunks = "triton" if a.backend == "triton" else "torch"
    dt = torch.float64 if a.call.float64 else torch.float32
    return Plan(HeadOptions(float(temperature), ignore_index, a.chunk_size, chunks), a.backend,
                a.call.needs_grad, dt)


# ---- token_log_probs -----------------------------------------------------------------------------

class HeadInputs(NamedTuple):
    """`token_log_probs`'s tensors, checked: [N, H], [V, H], [N] (contiguous), [V] or None."""
    hidden: Tensor
    weight: Tensor
    labels: Tensor
    bias: Optional[Tensor]


class HeadOptions(NamedTuple):
    temperature: float
    ignore_index: int
    chunk_size: int
    chunks: str  # the chunks' backend: "triton" (the kernels) or "torch"


def _head(x: HeadInputs, o) -> _Head:
    return _Head(x.hidden, x.weight, x.labels, x.bias, o.temperature, o.ignore_index,
                 o.chunk_size, o.chunks)


def _lp_forward(x: HeadInputs, o: HeadOptions, plan=None):
    """([log_probs, entropy], [lse, entropy]): one pass of the chunks; the backward reads the
    log-sum-exp and the entropy (a copy: a custom op's outputs alias nothing; [N] floats)."""
    lp, ent, lse = _token_stats(_head(x, o))
    return [lp, ent], [lse, ent.clone()]


def _lp_backward(x: HeadInputs, o: HeadOptions, saved, grads, needs, plan=None):
    """d hidden, d weight, d bias from the outputs' gradients: each chunk's logits again (never
    [N, V]), then `grad_logits` and the matmuls of `backprop`."""
    lse, ent = saved
    g_lp, g_ent = grads
    needs = [needs[0], needs[1], needs[3] and x.bias is not None]
    if (g_lp is None and g_ent is None) or not any(needs):
        return [None] * 4
    head = _head(x, o)
    g_lp = torch.zeros_like(lse) if g_lp is None else g_lp
    grads = head.grad_buffers(needs)
    for s, e in head.chunks():
        z = head.logits(s, e)
        d = head.grad_logits(z, s, e, lse[s:e], ent[s:e], g_lp[s:e].contiguous(),
                             None if g_ent is None else g_ent[s:e].contiguous())
        head.backprop(d, s, e, grads, needs)
    head.release()
    d_h, d_w, d_b = _finish(grads, x.weight, x.bias)
    return [d_h, d_w, None, d_b]


def _lp_fake(x: HeadInputs, o: HeadOptions):
    N = x.labels.shape[0]
    f64 = x.hidden.dtype is torch.float64 and o.chunks != "triton"
    dt = torch.float64 if f64 else torch.float32
    return ([x.hidden.new_empty(N, dtype=dt) for _ in range(2)],
            [x.hidden.new_empty(N, dtype=dt) for _ in range(2)])


def _lp_run(x: HeadInputs, plan: Plan):
    """The route: the loop backend is the reference (autograd through `FirstOrder`); the chunks
    (either backend) run through the framework's Triton route (`Op.triton`: the custom op
    inside torch.compile, `Eager` where an input needs gradients, else `forward`)."""
    if plan.backend == "loop":
        o = plan.o
        outs = list(reference.token_log_probs(x.hidden, x.weight, x.labels, bias=x.bias,
                                              temperature=o.temperature,
                                              ignore_index=o.ignore_index, dtype=plan.dtype))
        if plan.needs_grad:
            first_order(outs)
        return tuple(outs)
    return tuple(TOKEN_LOG_PROBS.triton(x, plan.o, plan, plan.needs_grad))


# declared as an op (docs/dev/op-framework.md): its custom op and backward the framework's; its
# own route (`_lp_run`) as the loop backend is the reference, and its public function checks
# the call and runs `OP.run` (no hot path yet, as policy_loss)
TOKEN_LOG_PROBS = Op("token_log_probs", "head", HeadInputs, HeadOptions, outputs=2, saved=2,
                     forward=_lp_forward, backward=_lp_backward, fake=_lp_fake, run=_lp_run)
def _token_stats(head):
    N, dev = head.N, head.h.device
    dt = torch.float64 if head.acc_dtype is torch.float64 and not head.triton else torch.float32
    lp, ent, lse = (torch.empty(N, dtype=dt, device=dev) for _ in range(3))
    for s, e in head.chunks():
        z = head.logits(s, e)
        lp[s:e], ent[s:e], lse[s:e] = head.stats(z, s, e)
    head.release()
    return lp, ent, lse


def token_log_probs(hidden, weight, labels, *, bias=None, temperature=1.0, return_entropy=False,
                    ignore_index=-100, chunk_size=None, check_labels=True, backend="auto"):
    """Log-probabilities of `labels` under `log_softmax(hidden @ weight.T / temperature + bias)`,
    without materializing the logits (semantics §11).

    `hidden` is `[..., H]` (the policy's last hidden states: `[L, H]` packed, or `[B, T, H]`),
    `weight` `[V, H]` (the LM head, `lm_head.weight`), `labels` `hidden`'s shape without H
    (integer token ids), `bias` `[V]` or None. `hidden` and `weight` share one dtype (bf16,
    fp16, float32; float64 for gradcheck): the matmuls run in it with float32 accumulation, the
    log-sum-exp, gather and entropy in float32. Returns `log_probs` (float32, `labels`' shape)
    and, with `return_entropy=True`, `(log_probs, entropy)`. A position whose label is
    `ignore_index` gets 0 in both and no gradient; any other label outside `[0, V)` raises
    `ValueError` (one reduction, a sync on CUDA; `check_labels=False` skips it, and a kernel
    never reads outside the row whatever labels hold).

    The tokens are processed `chunk_size` at a time (default: a power of two, the float32
    logits of at most 1.5 GiB: 2048 tokens at V = 151936): peak extra memory is
    O(chunk_size x V), whatever the number of tokens. The backward recomputes each chunk's
    logits; gradients reach `hidden`, `weight` and `bias` in their own dtypes (d weight and
    d bias accumulated in float32). `backend`: "auto" (the Triton kernels on CUDA, torch ops
    elsewhere), "triton", "torch" (the same chunks), or "loop" (the unfused reference: the
    whole `[N, V]` logits).

    Example::

        >>> lp, ent = rl_triton.token_log_probs(out.hidden_states[-1][:, :-1], model.lm_head.weight,
        ...                                     input_ids[:, 1:], return_entropy=True)
    """
    a = _head_args(hidden, weight, labels, bias, temperature, ignore_index, chunk_size, backend,
                   check_labels)
    check_bool("return_entropy", return_entropy)
    outs = TOKEN_LOG_PROBS.run(HeadInputs(a.hidden, a.weight, a.labels, a.bias),
                               _head_plan(a, temperature, ignore_index))
    outs = outs if return_entropy else outs[:1]
    outs = [o.reshape(a.shape) for o in outs]
    return tuple(outs) if return_entropy else outs[0]


# ---- linear_policy_loss: the per-token formulas --------------------------------------------------

class Terms(NamedTuple):
    """A loss type's per-token loss and the per-token metrics it reports (summed over the
    tokens that count, then divided by their number)."""
    loss: Tensor
    metrics: dict


def policy_terms(lp, old, adv, options) -> Terms:
    """A per-token loss type's loss and metrics: `policy_loss`'s per-position formula
    (`policy_loss.token_terms`, semantics §10) on the token's clamped log-ratio. options:
    (policy_loss.Options, whether to report policy_loss's metrics; vanilla and grpo report
    clip_fraction and dual_clip_fraction, as `ppo_policy_loss`)."""
    o, full = options
    d = PL.clamped(lp - old, o.log_ratio_clamp)
    l, clip, lower, negative, positive = PL.token_terms(o, lp, old, adv, d, None)
    dt = lp.dtype
    metrics = {"clip_fraction": clip.to(dt), "approx_kl": reference.k3(-d).detach()}
    if full:
        metrics.update(clip_fraction_lower=lower.to(dt), clip_fraction_negative=negative.to(dt),
                       clip_fraction_positive=positive.to(dt), ppo_kl=-d.detach())
    elif o.dual_clip is not None:
        metrics["dual_clip_fraction"] = lower.to(dt)
    return Terms(l, metrics)


class LossType(NamedTuple):
    """A `loss_type` of `linear_policy_loss`: `policy_loss`'s loss type it runs, its default
    aggregation, and whether token i's loss depends on token i's log-probability alone (the
    chunk loop computes its gradient during the forward; the others run in two passes,
    semantics §11)."""
    name: str
    aggregation: str
    per_token: bool


LOSS_TYPES = {
    "vanilla": LossType("vanilla", "token-mean", True),
    # DeepSeekMath's GRPO: the same clipped surrogate (KL and entropy inside the token's loss),
    # each response's token mean, then the mean over responses (TRL's loss_type="grpo")
    "grpo": LossType("vanilla", "seq-mean-token-mean", True),
    # the other frameworks' names of the same clipped surrogate, by their reduction on one
    # process (semantics §11): TRL's "bnpo" and "dapo", OpenRLHF's "ppo"
    "bnpo": LossType("vanilla", "token-mean", True),
    "dapo": LossType("vanilla", "token-mean", True),
    "ppo": LossType("vanilla", "token-mean", True),
    # a sequence's ratio (gspo), a per-sequence loss (geo_mean, whose aggregation is then the
    # KL and entropy terms') or a batch-wide pick (clip_cov, kl_cov): two passes
    "gspo": LossType("gspo", "token-mean", False),
    "sapo": LossType("sapo", "token-mean", True),
    "gpg": LossType("gpg", "token-mean", True),
    "clip_cov": LossType("clip_cov", "token-mean", False),
    "kl_cov": LossType("kl_cov", "token-mean", False),
    "geo_mean": LossType("geo_mean", "seq-mean-token-mean", False),
    "cispo": LossType("cispo", "token-mean", True),
    "dppo_tv": LossType("dppo_tv", "token-mean", True),
    "dppo_kl": LossType("dppo_kl", "token-mean", True),
    "dro": LossType("dro", "token-mean", True),
}


def _token_weights(keep, aggregation, cu, shape, dtype):
    """w_i: the aggregation's weight of each token (0 where it does not count, semantics §9),
    from the mask and the offsets alone."""
    if aggregation == "sum":
        return keep.to(dtype)
    if aggregation == "token-mean":
        return keep.to(dtype) / keep.sum().clamp_min(1).to(dtype)
    c = L.seq_scale(aggregation, keep.reshape(shape), cu, shape, dtype, keep.device)
    if cu is None:
        per = c[:, None].expand(shape).reshape(-1)
    else:
        per = c[L.segment_ids(cu, keep.shape[0])]
    return torch.where(keep, per, 0.0)


class _Plan(NamedTuple):
    head: _Head
    per_token: object
    options: dict
    keep: Tensor  # [N] bool: the tokens that count
    w: Tensor  # [N] their weights
    kl_coef: float
    kl_kind: str
    kl_clamp: Optional[float]
    entropy_coef: float
    dtype: torch.dtype  # of the per-token arithmetic


def _policy_chunks(plan: _Plan, old, adv, ref, needs):
    """The loss, the metrics' sums and, where `needs` says, every input's gradient, chunk by
    chunk. needs: (hidden, weight, bias, old_log_probs, advantages, ref_log_probs)."""
    head, dt = plan.head, plan.dtype
    grads = head.grad_buffers(needs[:3])
    small = [torch.zeros(t.shape, dtype=dt, device=t.device) if need else None
             for t, need in zip((old, adv, ref), needs[3:])]
    any_grad = any(needs)
    loss = torch.zeros((), dtype=dt, device=head.h.device)
    sums: dict = {}
    for s, e in head.chunks():
        z = head.logits(s, e)
        lp, ent, lse = head.stats(z, s, e)
        keep, w = plan.keep[s:e], plan.w[s:e]
        # a token that does not count enters no arithmetic (its NaN would reach a gradient)
        leaves = [lp.to(dt), ent.to(dt)] + L.kept(keep, dt, *(None if t is None else t[s:e]
                                                               for t in (old, adv, ref)))
        # d contribution / d leaves through torch.func (autograd records nothing inside a
        # custom op's implementation, where this runs under torch.compile)
        wanted = [i for i, need in enumerate([needs[0] or needs[1] or needs[2]] * 2
                                             + list(needs[3:])) if need and leaves[i] is not None]

        def contribution_of(*xs, wanted=wanted, leaves=leaves, keep=keep, w=w):
            lv = list(leaves)
            for i, xi in zip(wanted, xs):
                lv[i] = xi
            lp_, ent_, old_, adv_, ref_ = lv
            terms = plan.per_token(lp_, old_, adv_, plan.options)
            total = terms.loss
            metrics = {k: v.detach() for k, v in terms.metrics.items()}
            if ref_ is not None:
                kl = reference.kl_estimate(lp_ - ref_, plan.kl_kind, plan.kl_clamp)
                total = total + plan.kl_coef * kl
                metrics["kl"] = kl.detach()
            if plan.entropy_coef != 0.0:
                total = total - plan.entropy_coef * ent_
            contribution = torch.where(keep, w * total, 0.0).sum()
            return contribution, (contribution.detach(), terms.loss.detach(), metrics)

        if wanted:
            _, vjp, (contribution, pg, metrics) = torch.func.vjp(
                contribution_of, *[leaves[i] for i in wanted], has_aux=True)
            got = dict(zip(wanted, vjp(torch.ones((), dtype=dt, device=keep.device))))
        else:
            _, (contribution, pg, metrics) = contribution_of()
            got = {}
        g = [got.get(i, None if t is None else torch.zeros_like(t))
             for i, t in enumerate(leaves)]
        terms = Terms(pg, metrics)
        parts = {"pg_loss": pg}
        loss += contribution.detach()
        for k, v in {**terms.metrics, "entropy": ent.to(dt)}.items():
            sums[k] = sums.get(k, 0.0) + torch.where(keep, v.detach(), 0.0).sum()
        sums["pg_loss"] = sums.get("pg_loss", 0.0) + torch.where(
            keep, w * parts["pg_loss"].detach(), 0.0).sum()
        if needs[0] or needs[1] or needs[2]:
            g_ent = g[1] if plan.entropy_coef != 0.0 else None  # (else zero: skipped)
            d = head.grad_logits(z, s, e, lse, ent, g[0].float() if head.triton else g[0],
                                 None if g_ent is None else (g_ent.float() if head.triton
                                                             else g_ent))
            head.backprop(d, s, e, grads, needs[:3])
        for acc, gi in zip(small, g[2:]):
            if acc is not None:
                acc[s:e] = gi
    head.release()
    if not any_grad:
        grads = [None, None, None]
    return loss, sums, grads, small


class PolicyInputs(NamedTuple):
    """The fused `linear_policy_loss`'s tensors, checked and flat: [N, H], [V, H], labels [N]
    (ignore_index where a token does not count), bias [V] or None, the per-token inputs [N],
    `keep` [N] bool (the tokens that count) and `weights` [N] (the aggregation's w_i)."""
    hidden: Tensor
    weight: Tensor
    labels: Tensor
    bias: Optional[Tensor]
    old_log_probs: Tensor
    advantages: Tensor
    ref_log_probs: Optional[Tensor]
    keep: Tensor
    weights: Tensor


class PolicyOptions(NamedTuple):
    temperature: float
    ignore_index: int
    chunk_size: int
    chunks: str  # "triton" or "torch"
    loss_type: str  # policy_loss's
    full: bool  # policy_loss's metrics (policy_terms)
    clip_low: float
    clip_high: float
    dual_clip: Optional[float]
    delta: Optional[float]
    log_ratio_clamp: Optional[float]
    tau_pos: float
    tau_neg: float
    truncation: float
    dro_beta: Optional[float]
    kl_coef: float
    kl_kind: str
    kl_clamp: Optional[float]
    entropy_coef: float
    # which gradients the forward forms (it forms them: the custom op's forward cannot ask
    # autograd): hidden, weight, bias, old_log_probs, advantages, ref_log_probs
    need_hidden: bool
    need_weight: bool
    need_bias: bool
    need_old: bool
    need_adv: bool
    need_ref: bool


_GRADS = (0, 1, 3, 4, 5, 6)  # the tensors (PolicyInputs' positions) with a gradient


def _needs(o: PolicyOptions) -> list:
    return list(o[-6:])


def _policy_dtype(x, o) -> torch.dtype:
    return torch.float64 if x.hidden.dtype is torch.float64 and o.chunks != "triton" \
        else torch.float32


def metric_names(o: PolicyOptions, has_ref: bool) -> list:
    """The metrics' names, in the order of the op's metrics output."""
    none = torch.zeros(0)
    names = list(policy_terms(none, none, none, _terms_options(o)).metrics)
    return names + (["kl"] if has_ref else []) + ["entropy", "pg_loss"]


def _terms_options(o: PolicyOptions):
    return (PL.Options(o.loss_type, "token", o.clip_low, o.clip_high, o.dual_clip, o.delta,
                       o.log_ratio_clamp, o.tau_pos, o.tau_neg, o.truncation, o.dro_beta, 1.0,
                       "sum", torch.float32), o.full)


def _lpl_forward(x: PolicyInputs, o: PolicyOptions, plan=None):
    """([loss, metrics [K]], the six gradients (empty where not formed)): the chunk loop,
    `_policy_chunks`, forming the gradients during the forward."""
    dt = _policy_dtype(x, o)
    head = _Head(x.hidden, x.weight, x.labels, x.bias, o.temperature, o.ignore_index,
                 o.chunk_size, o.chunks)
    p = _Plan(head, policy_terms, _terms_options(o), x.keep, x.weights.to(dt), o.kl_coef,
              o.kl_kind, o.kl_clamp, o.entropy_coef, dt)
    needs = _needs(o)
    needs[2] = needs[2] and x.bias is not None
    needs[5] = needs[5] and x.ref_log_probs is not None
    loss, sums, grads, small = _policy_chunks(p, x.old_log_probs, x.advantages,
                                              x.ref_log_probs, needs)
    names = metric_names(o, x.ref_log_probs is not None)
    count = x.keep.sum().clamp_min(1)
    zero = torch.zeros((), dtype=dt, device=x.keep.device)
    metrics = torch.stack([torch.as_tensor(sums.get(k, zero), dtype=dt, device=zero.device)
                           / (count if k != "pg_loss" else 1) for k in names]).to(dt)
    d_h, d_w, d_b = _finish(grads, x.weight, x.bias)
    d_old, d_adv, d_ref = (None if g is None else g.to(t.dtype) for g, t in
                           zip(small, (x.old_log_probs, x.advantages, x.ref_log_probs)))
    saved = [g if g is not None else loss.new_empty(0)
             for g in (d_h, d_w, d_b, d_old, d_adv, d_ref)]
    return [loss, metrics], saved


def _lpl_backward(x: PolicyInputs, o: PolicyOptions, saved, grads, needs, plan=None):
    """The stored gradients scaled by the loss's."""
    g = grads[0]
    out = [None] * len(PolicyInputs._fields)
    if g is None:
        return out
    for i, formed, t in zip(_GRADS, _needs(o), saved):
        if needs[i] and formed and x[i] is not None:  # (an empty tensor where not formed)
            out[i] = t * g.to(t.dtype)
    return out


def _lpl_fake(x: PolicyInputs, o: PolicyOptions):
    dt = _policy_dtype(x, o)
    K = len(metric_names(o, x.ref_log_probs is not None))
    outs = [x.hidden.new_empty((), dtype=dt), x.hidden.new_empty(K, dtype=dt)]
    saved = [t.new_empty(t.shape) if need and t is not None else x.hidden.new_empty(0, dtype=dt)
             for t, need in zip((x.hidden, x.weight, x.bias, x.old_log_probs, x.advantages,
                                 x.ref_log_probs), _needs(o))]
    return outs, saved


def _lpl_run(x: PolicyInputs, plan: Plan):
    """The route: the loop backend is the reference (autograd through `FirstOrder`); the chunk
    loop (either backend) through the framework's Triton route (`Op.triton`)."""
    o = plan.o
    if plan.backend != "loop":
        return tuple(LINEAR_POLICY_LOSS.triton(x, o, plan, plan.needs_grad))
    loss, metrics = reference.linear_policy_loss(
        x.hidden, x.weight, x.labels, x.old_log_probs, x.advantages, x.keep,
        ref_log_probs=x.ref_log_probs, kl_coef=o.kl_coef, kl_kind=o.kl_kind,
        kl_clamp=o.kl_clamp, entropy_coef=o.entropy_coef, temperature=o.temperature,
        bias=x.bias, ignore_index=o.ignore_index, loss_type=plan.memo["loss_type"],
        aggregation=plan.memo["aggregation"], cu_seqlens=plan.memo["cu"],
        shape=plan.memo["shape"], dtype=plan.dtype, ratio_level="token",
        clip_low=o.clip_low, clip_high=o.clip_high, dual_clip=o.dual_clip, delta=o.delta,
        log_ratio_clamp=o.log_ratio_clamp, tau_pos=o.tau_pos, tau_neg=o.tau_neg,
        truncation=o.truncation, dro_beta=o.dro_beta)
    outs = [loss, torch.stack([metrics[k].to(plan.dtype).reshape(())
                               for k in metric_names(o, x.ref_log_probs is not None)])]
    if plan.needs_grad:
        first_order(outs, (1,))
    return tuple(outs)


# declared as an op (docs/dev/op-framework.md), the per-token loss types' fused chunk loop: its
# custom op and `Eager` route the framework's; its public function checks the call, forms the
# mask's and the aggregation's per-token tensors and runs `OP.run` (no hot path yet); the
# two-pass loss types are a composition of ops (token_log_probs, policy_loss)
LINEAR_POLICY_LOSS = Op("linear_policy_loss", "head", PolicyInputs, PolicyOptions, outputs=2,
                        saved=6, nondiff=(1,), forward=_lpl_forward, backward=_lpl_backward,
                        fake=_lpl_fake, run=_lpl_run)


def _two_pass(a, labels, temperature, ignore_index, keep, cu, old, adv, ref, w, pl_args, kl,
              dt):
    """A loss type whose token's loss depends on other tokens (a sequence's ratio, a loss per
    sequence, a batch-wide pick: semantics §11) in two passes: `token_log_probs` (its chunks;
    the reference on the loop backend), `policy_loss` on its output, and the gradient back
    through the head chunk by chunk in `token_log_probs`'s backward (each chunk's logits again:
    one matmul more than the fused loop). Returns (loss, metrics)."""
    kl_coef, kl_kind, kl_clamp, entropy_coef = kl
    lp, ent = TOKEN_LOG_PROBS.run(HeadInputs(a.hidden, a.weight, labels, a.bias),
                                  _head_plan(a, temperature, ignore_index))
    lp, ent = lp.to(dt), ent.to(dt)
    m = keep.reshape(a.shape)
    pg, pm = PL.policy_loss(lp.reshape(a.shape), old.reshape(a.shape), adv.reshape(a.shape), m,
                            cu_seqlens=cu, check_offsets=False, backend=a.backend,
                            out_dtype=dt, **pl_args)
    x, old_, ref_ = L.kept(keep, dt, lp, old, ref)
    extra = -entropy_coef * ent
    sums = {}
    if ref_ is not None:
        k = reference.kl_estimate(x - ref_, kl_kind, kl_clamp)
        extra = extra + kl_coef * k
        sums["kl"] = torch.where(keep, k.detach(), 0.0).sum()
    loss = pg + torch.where(keep, w * extra, 0.0).sum()
    d = PL.clamped(x - old_, pl_args["log_ratio_clamp"]).detach()
    count = keep.sum().clamp_min(1)
    sums.update(approx_kl=torch.where(keep, reference.k3(-d), 0.0).sum(),
                entropy=torch.where(keep, ent.detach(), 0.0).sum())
    metrics = {k: v / count for k, v in sums.items()}
    metrics.update((k if k != "kl" else "ppo_kl", v) for k, v in pm.items())
    metrics["pg_loss"] = pg.detach()
    return loss, metrics


def linear_policy_loss(hidden, weight, labels, old_log_probs, advantages, mask=None, *,
                       ref_log_probs=None, kl_coef=0.0, kl_kind="k3", kl_clamp=None,
                       entropy_coef=0.0, loss_type="vanilla", temperature=1.0, bias=None,
                       ignore_index=-100, clip_low=0.2, clip_high=None, dual_clip=None,
                       log_ratio_clamp=20.0, aggregation=None, cu_seqlens=None,
                       ratio_level="token", delta=None, tau_pos=1.0, tau_neg=1.05,
                       truncation=20.0, dro_beta=None, cov_ratio=2e-4, cov_bounds=(1.0, 5.0),
                       kl_cov_coef=1.0, generator=None, chunk_size=None, check_labels=True,
                       check_offsets=True, backend="auto"):
    """A policy loss on the log-probabilities of `hidden @ weight.T`, without ever holding the
    `[N, V]` logits (semantics §11). Returns `(loss, metrics)`.

    `hidden`, `weight`, `labels`, `bias`, `temperature`, `ignore_index`, `chunk_size` as
    `token_log_probs`; `old_log_probs`, `advantages`, `mask` and `ref_log_probs` have `labels`'
    shape (`[B, T]` rows or packed `[L]` with `cu_seqlens`). Per token, with lp the
    log-probability and H the entropy::

        l = policy_loss(lp, old_log_probs, advantages) + kl_coef * KL(lp, ref_log_probs)
            - entropy_coef * H

    aggregated over the tokens that count (mask set and label not `ignore_index`) as
    `aggregation` says (semantics §9; "none" is refused: the loss must be a scalar). The KL term
    is `kl_penalty(lp, ref_log_probs, kl_kind, kl_clamp)`, present when `ref_log_probs` is given.
    `loss_type` is a loss of `policy_loss` (semantics §10), with its options (`clip_low`,
    `clip_high`, `dual_clip`, `delta`, `log_ratio_clamp`, `ratio_level`, `tau_pos`, `tau_neg`,
    `truncation`, `dro_beta`, `cov_ratio`, `cov_bounds`, `kl_cov_coef`, `generator`), or
    "grpo": "vanilla" with default aggregation "seq-mean-token-mean" (each response's mean over
    its tokens, then the mean over responses with a token that counts: DeepSeekMath's GRPO,
    TRL's `loss_type="grpo"`); "bnpo", "dapo" (TRL) and "ppo" (OpenRLHF): "vanilla", their
    token mean on one process. The default aggregation is "token-mean" otherwise; geo_mean's
    policy term is its own mean over sequences, and `aggregation` (default
    "seq-mean-token-mean") aggregates its KL and entropy terms.

    The per-token losses (vanilla, grpo, sapo, gpg, cispo, dppo_tv, dppo_kl, dro, at
    `ratio_level="token"`) compute their gradient chunk by chunk during the forward (three
    matmuls). A loss whose token depends on its sequence or the batch (gspo,
    `ratio_level="sequence"`, geo_mean, clip_cov, kl_cov) runs in two passes:
    `token_log_probs`, `policy_loss` on its output, and the gradient back through the head in
    chunks (four matmuls); neither holds `[N, V]`.

    `loss` is a 0-d float32 tensor (float64 for float64 inputs on the torch and loop backends);
    `metrics` (0-d float32 tensors, no gradient): "pg_loss" (the aggregated policy term alone),
    "approx_kl" (k3 of old against new, per token), "entropy", "kl" (with `ref_log_probs`),
    means over the tokens that count, and the loss type's: "clip_fraction" and, with
    `dual_clip`, "dual_clip_fraction" for vanilla and grpo with token ratios (as
    `ppo_policy_loss`); `policy_loss`'s "clip_fraction", "clip_fraction_lower",
    "clip_fraction_negative", "clip_fraction_positive" and its "kl" as "ppo_kl" for the others
    (and for those two with ratio_level="sequence"). Gradients reach `hidden`,
    `weight`, `bias`, and the floating per-token inputs that require grad, each in its own
    dtype.

    Example::

        >>> loss, metrics = rl_triton.linear_policy_loss(
        ...     hidden, model.lm_head.weight, labels, old_log_probs, advantages, mask,
        ...     loss_type="grpo", clip_high=0.28)
        >>> loss.backward()
    """
    a = _head_args(hidden, weight, labels, bias, temperature, ignore_index, chunk_size, backend,
                   check_labels)
    call = a.call
    loss_type = check_choice("loss_type", loss_type, tuple(LOSS_TYPES))
    kind = LOSS_TYPES[loss_type]
    old = call.step("old_log_probs", old_log_probs)
    adv = call.step("advantages", advantages)
    ref = call.step("ref_log_probs", ref_log_probs, optional=True)
    aggregation = kind.aggregation if aggregation is None else aggregation
    check_offsets = check_bool("check_offsets", check_offsets)
    aggregation, mask, cu = L.aggregation_args(call, aggregation, mask, cu_seqlens,
                                               check_offsets)
    if aggregation == "none":
        raise ValueError("aggregation='none' is not supported by linear_policy_loss (its "
                         "gradient is computed in the forward, for a scalar loss); use "
                         "token_log_probs and a loss of per-token values")
    kl_coef = check_scalar("kl_coef", kl_coef, high=None)
    kl_kind = check_choice("kl_kind", kl_kind, KL_KINDS)
    if kl_clamp is not None:
        kl_clamp = check_scalar("kl_clamp", kl_clamp, high=None, low_open=True)
    if kl_coef != 0.0 and ref is None:
        raise ValueError("kl_coef is nonzero but ref_log_probs is None; pass the reference "
                         "policy's log-probabilities")
    entropy_coef = check_scalar("entropy_coef", entropy_coef, low=-float("inf"), high=None)
    ratio_level = check_choice("ratio_level", ratio_level, ("token", "sequence"))
    if kind.name == "vanilla":  # PPO's clips (semantics §9), as ppo_policy_loss
        check_clips(clip_low, clip_high, dual_clip, log_ratio_clamp)
    elif dual_clip is not None or delta is not None:
        raise ValueError(f"dual_clip and delta apply to loss_type 'vanilla' and 'grpo'; got "
                         f"loss_type={loss_type!r}")
    if ratio_level == "sequence" and kind.name not in PL.RATIO_TYPES:
        raise ValueError(f"ratio_level='sequence' applies to loss_type 'vanilla', 'grpo', "
                         f"'sapo' and 'cispo'; {loss_type!r} has its own")
    (clip_low, clip_high, dual_clip, delta, log_ratio_clamp, tau_pos, tau_neg, truncation,
     dro_beta, cov_ratio, cov_bounds, kl_cov_coef) = PL.check_options(
        kind.name, clip_low, clip_high, dual_clip, delta, log_ratio_clamp, tau_pos, tau_neg,
        truncation, dro_beta, cov_ratio, cov_bounds, kl_cov_coef)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    per_token = kind.per_token and ratio_level == "token"
    N = a.labels.shape[0]
    keep = a.labels != ignore_index
    if mask is not None:
        keep = keep & (L.counted(mask).reshape(N))
    dt = torch.float64 if call.float64 and a.backend != "triton" else torch.float32
    flat = [None if t is None else t.reshape(N) for t in (old, adv, ref)]
    # a token that does not count is read as an ignored one: 0 log-probability, entropy and
    # logit gradient, whatever its logits hold (semantics §9: a masked position's NaN reaches
    # no gradient through the loss)
    labels = a.labels if mask is None else torch.where(keep, a.labels, ignore_index)
    w = _token_weights(keep, aggregation, cu, a.shape, dt)
    if not per_token:
        pl_args = dict(loss_type=kind.name, ratio_level=ratio_level,
                       aggregation="seq-mean" if kind.name == "geo_mean" else aggregation,
                       clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, delta=delta,
                       log_ratio_clamp=log_ratio_clamp, tau_pos=tau_pos, tau_neg=tau_neg,
                       truncation=truncation, dro_beta=dro_beta, cov_ratio=cov_ratio,
                       cov_bounds=cov_bounds, kl_cov_coef=kl_cov_coef, generator=generator)
        loss, metrics = _two_pass(a, labels, temperature, ignore_index, keep, cu, *flat, w,
                                  pl_args, (kl_coef, kl_kind, kl_clamp, entropy_coef), dt)
        return loss, {k: v.detach().float() for k, v in metrics.items()}
    full = kind.name != "vanilla"
    floating = [t is not None and call.grad and t.requires_grad for t in
                (a.hidden, a.weight, a.bias, *flat)]
    po = PolicyOptions(float(temperature), ignore_index, a.chunk_size,
                       "triton" if a.backend == "triton" else "torch", kind.name, full,
                       clip_low, clip_high, dual_clip, delta, log_ratio_clamp, tau_pos, tau_neg,
                       truncation, dro_beta, kl_coef, kl_kind, kl_clamp, entropy_coef,
                       *floating)
    plan = Plan(po, a.backend, call.needs_grad, dt)
    plan.memo.update(loss_type=loss_type, aggregation=aggregation, cu=cu, shape=a.shape)
    x = PolicyInputs(a.hidden, a.weight, labels, a.bias, *flat, keep, w)
    loss, vec = LINEAR_POLICY_LOSS.run(x, plan)
    metrics = dict(zip(metric_names(po, ref is not None), vec.detach().float()))
    return loss, metrics
