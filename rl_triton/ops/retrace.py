"""Retrace(lambda) Q targets for discrete actions."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import reference
from .._args import (FLAG, INDEX, VALUE, Call, check_action_range, check_actions, check_bool,
                     check_discount, check_scalar)
from .._core.scan import ScanOp
from ..reference import _decided, _flags, _prep, _when
from ..scan import torch_scan
from ..scan.jit import HAS_TRITON, INTERPRETER, cdiv, next_power_of_2, slots, tl, triton
from ..scan.kernel import (clip, cut_flags, finish_linear, flags_before, load_at, load_step,
                           load_value, out_offsets, slot_offsets, store_at, store_out)
from ..scan.launch import Kernel, launch
from ._common import bits, like, run_backward, scan_plan
from ._last_program import last_program, reset, scratch

Tensor = torch.Tensor


class Inputs(NamedTuple):
    rewards: Tensor
    q_values: Tensor  # [*S, A]
    actions: Tensor
    target_probs: Tensor  # [*S, A]
    behavior_probs: Tensor
    terminated: Tensor
    truncated: Optional[Tensor]
    last_q_values: Tensor  # [*batch, A]
    last_target_probs: Tensor  # [*batch, A]
    mask: Optional[Tensor]


class Scalars(NamedTuple):
    gamma: float
    lam: float
    c_clip: float


class Extras(NamedTuple):
    return_advantages: bool
    check_actions: bool


R, Q, ACT, PI, MU, TERM, TRUNC, LAST_Q, LAST_PI, MASK = slots(Inputs)


@triton.jit
def coef(step, after):
    return terms(step, False)


@triton.jit
def coef_whole(step, after):
    """`coef` for tiles that span their rows' whole window (each holds step T-1)."""
    return terms(step, True)


@triton.jit
def terms(step, WHOLE: tl.constexpr):
    t = step.t
    mask = step.mask
    T = step.T
    ins = step.ins
    sa = step.sa
    n_act = step.n_act
    BLOCK_A: tl.constexpr = step.BLOCK_A
    ACT_VEC: tl.constexpr = step.ACT_VEC
    gamma = step.params[0]
    lam = step.params[1]
    c_clip = step.params[2]
    inside = mask & (t + 1 < T)  # slot t+1 is in the window
    # The gathers of a_{t+1}'s entries of Q and pi come before E[t]'s blocks, so that their
    # round trip overlaps the blocks' loads (16384x1024 batch-major 787 -> 737 µs on the H200).
    # The blocks are unrolled (as a loop, 2.2x the registers). The loads run on the transposed
    # tile, whose lanes then cover neighbouring rows of actions (time-major 16384x1024 906 ->
    # 703 µs). One-row tiles that span the window load a_{t+1}, r, the flags and mu first
    # (EARLY: 3 load rounds instead of 5; 4096x128 0.85 of the time).
    EARLY: tl.constexpr = WHOLE and mask.shape[0] == 1
    if EARLY:
        a_next = load_action(step, t + 1, inside)
    r = load_step(step, R)
    term, cut = cut_flags(step, TERM, TRUNC)
    if EARLY:
        mu_next = tl.where(inside, load_at(step, MU, t + 1, inside), 1.0)
    q_row = tl.trans(slot_offsets(step, Q, t + 1))
    pi_row = tl.trans(slot_offsets(step, PI, t + 1))
    inside_tr = tl.trans(inside)
    # rows that start at a multiple of ACT_VEC actions load ACT_VEC at a time (`action_vector`)
    if ACT_VEC > 1:
        q_row = q_row // ACT_VEC * ACT_VEC
        pi_row = pi_row // ACT_VEC * ACT_VEC
    if not EARLY:
        a_next = load_action(step, t + 1, inside)
    a_next = tl.trans(a_next)
    q_a_next = tl.trans(load_value(ins[Q], q_row + a_next * sa[Q], inside_tr))
    pi_a_next = tl.trans(load_value(ins[PI], pi_row + a_next * sa[PI], inside_tr))
    # Tiles that span their rows' whole window hold step T-1: their blocks read E's bootstrap
    # state there too (FOLD: 16384x16 0.92-0.96 of the time); other tiles keep a pass of their
    # own, as such loads in every tile cost 1.09-1.42x.
    FOLD: tl.constexpr = (WHOLE and ins[Q].dtype == ins[LAST_Q].dtype
                          and ins[PI].dtype == ins[LAST_PI].dtype)
    state_tr = inside_tr
    if FOLD:
        at_end = tl.trans(mask & (t == T - 1))
        state_tr = inside_tr | at_end
        lq_row = tl.trans(slot_offsets(step, LAST_Q, 0))
        lpi_row = tl.trans(slot_offsets(step, LAST_PI, 0))
        if ACT_VEC > 1:
            lq_row = lq_row // ACT_VEC * ACT_VEC
            lpi_row = lpi_row // ACT_VEC * ACT_VEC
    if FOLD:
        products = tl.zeros([inside_tr.shape[0], inside_tr.shape[1], BLOCK_A], tl.float32)
    else:
        expected = tl.zeros(inside_tr.shape, tl.float32)
    for k in tl.static_range(step.ACT_BLOCKS):
        a = k * BLOCK_A + tl.arange(0, BLOCK_A)[None, None, :]
        in_a = tl.max_constancy(state_tr[:, :, None] & (a < n_act), [1, 1, ACT_VEC])
        q_ptr = ins[Q] + (q_row[:, :, None] + a * sa[Q])
        p_ptr = ins[PI] + (pi_row[:, :, None] + a * sa[PI])
        if FOLD:
            q_ptr = tl.where(at_end[:, :, None],
                             ins[LAST_Q] + (lq_row[:, :, None] + a * sa[LAST_Q]), q_ptr)
            p_ptr = tl.where(at_end[:, :, None],
                             ins[LAST_PI] + (lpi_row[:, :, None] + a * sa[LAST_PI]), p_ptr)
        q = tl.load(q_ptr, mask=in_a, other=0.0).to(tl.float32)
        p = tl.load(p_ptr, mask=in_a, other=0.0).to(tl.float32)
        if FOLD:
            products += q * p
        else:
            expected += tl.sum(q * p, axis=2)
    if FOLD:
        expected = tl.sum(products, axis=2)
    expected = tl.trans(expected)
    if not EARLY:
        mu_next = tl.where(inside, load_at(step, MU, t + 1, inside), 1.0)
    c_next = lam * clip(pi_a_next / mu_next, c_clip)

    # At t = T-1, E comes from the bootstrap state s_T: read by the tile that holds T-1 only.
    if not FOLD:
        if tl.max(step.end_rows.to(tl.int32)) != 0:
            last = step.end_rows
            lq_row = slot_offsets(step, LAST_Q, 0)[:, :, None]
            lpi_row = slot_offsets(step, LAST_PI, 0)[:, :, None]
            end = tl.zeros(last.shape, tl.float32)
            for a0 in range(0, n_act, BLOCK_A):
                a = a0 + tl.arange(0, BLOCK_A)[None, None, :]
                end_a = last[:, :, None] & (a < n_act)
                end += tl.sum(load_value(ins[LAST_Q], lq_row + a * sa[LAST_Q], end_a)
                              * load_value(ins[LAST_PI], lpi_row + a * sa[LAST_PI], end_a),
                              axis=2)
            expected = tl.where(t == T - 1, end, expected)

    alpha = r + tl.where(term, 0.0, gamma * (expected - tl.where(cut, 0.0, c_next * q_a_next)))
    # a NaN trace coefficient makes alpha NaN, with beta 0: no beta is NaN (the scan's combine
    # relies on it), but gamma = 0 times an infinite c, which makes alpha NaN too (gamma c Q'):
    # the scan reads that NaN beta as 0 (`kernel.combine`), A[t] = alpha, NaN
    beta = tl.where(cut | (c_next != c_next), 0.0, gamma * c_next)
    q_a = 0.0
    if step.VARIANT == 1:  # also return G - Q(s_t, a_t)
        a_t = load_action(step, t, mask)
        q_a = tl.trans(load_value(ins[Q], tl.trans(slot_offsets(step, Q, t) + a_t * sa[Q]),
                                  tl.trans(mask)))
    return alpha, beta, q_a


@triton.jit
def load_action(step, t, mask):
    """The actions at steps t (0 where masked), clamped into [0, n_act): whatever they hold,
    the gathers stay inside their rows (the host checks them unless told not to)."""
    a = tl.load(step.ins[ACT] + slot_offsets(step, ACT, t), mask=mask, other=0)
    return tl.minimum(tl.maximum(a, 0), step.n_act - 1)


@triton.jit
def store(step, res, res_prev, aux):
    store_out(step, 0, res)
    if step.VARIANT == 1:
        store_out(step, 1, res - aux)


KERNEL = Kernel(coef, store, reverse=True, trunc_slot_always=(TERM.value, TRUNC.value),
                coef_whole=coef_whole, action_slots=(Q.value, PI.value, LAST_Q.value,
                                                     LAST_PI.value))


# ---- with a mask (semantics §7): the successor is the next decision step (the kernel's W scan) ---
# With D = G - Q(s_t, a_t), own-step e[t] = sum_a pi(a | s_t) Q(s_t, a) and c[t] (semantics §3),
# G[t] = r[t] + gamma (1 - term[t]) (e[n] + (1 - cut[t]) U[n]), n the next decision step, where
# U = c D (a select where c = 0, as the trace's: U[n] = -c[n] Q(s_n, a_n) there) is a reverse
# scan with own-step coefficients: U[t] = c (r - Q_a) + c gamma (1 - term) e[n] + gamma c
# (1 - cut) U[n]. The W scan carries w = e across masked steps; the writer forms G from e[n]
# (w') and U[n] (the exclusive scan). Past the window: U = 0, w = the bootstrap state's e.

@triton.jit
def coef_masked(step, after):
    """w = e[t]; alpha = c (r - Q_a) + c gamma (1 - term) w' (`finish_linear`), beta = gamma c
    where the trace goes on. Slot t's action axis in blocks, on the transposed tile, as `terms`
    walks slot t+1's."""
    ACT_VEC: tl.constexpr = step.ACT_VEC
    mask = step.mask
    t = step.t
    gamma = step.params[0]
    lam = step.params[1]
    c_clip = step.params[2]
    a_t = tl.trans(load_action(step, t, mask))
    r = load_step(step, R)
    term, cut = cut_flags(step, TERM, TRUNC)
    mu = tl.where(mask, load_step(step, MU), 1.0)
    q_row = tl.trans(slot_offsets(step, Q, t))
    pi_row = tl.trans(slot_offsets(step, PI, t))
    mask_tr = tl.trans(mask)
    if ACT_VEC > 1:  # rows that start at a multiple of ACT_VEC actions (`action_vector`)
        q_row = q_row // ACT_VEC * ACT_VEC
        pi_row = pi_row // ACT_VEC * ACT_VEC
    q_a = tl.trans(load_value(step.ins[Q], q_row + a_t * step.sa[Q], mask_tr))
    pi_a = tl.trans(load_value(step.ins[PI], pi_row + a_t * step.sa[PI], mask_tr))
    expected = tl.zeros(mask_tr.shape, tl.float32)
    for k in tl.static_range(step.ACT_BLOCKS):
        a = k * step.BLOCK_A + tl.arange(0, step.BLOCK_A)[None, None, :]
        in_a = tl.max_constancy(mask_tr[:, :, None] & (a < step.n_act), [1, 1, ACT_VEC])
        q = tl.load(step.ins[Q] + (q_row[:, :, None] + a * step.sa[Q]), mask=in_a,
                    other=0.0).to(tl.float32)
        p = tl.load(step.ins[PI] + (pi_row[:, :, None] + a * step.sa[PI]), mask=in_a,
                    other=0.0).to(tl.float32)
        expected += tl.sum(q * p, axis=2)
    c = lam * clip(pi_a / mu, c_clip)
    # c = 0 keeps -c Q_a (NaN with a NaN Q_a, as the reference's c Q') and drops r
    a_own = c * (tl.where(c == 0, 0.0, r) - q_a)
    k_own = tl.where(term, 0.0, gamma * c)  # NaN with a NaN c: alpha NaN
    # a NaN trace coefficient makes alpha NaN, with beta 0 (the scan's combine relies on it; as
    # in `terms`, gamma = 0 times an infinite c makes k_own, so alpha, NaN too)
    beta = tl.where(cut | (c != c), 0.0, gamma * c)
    return (tl.trans(expected), (a_own, k_own)), beta, (r, term, cut, q_a)


BOOT_BLOCK_A = tl.constexpr(4)  # actions per load of the bootstrap state (`boot_masked`)


@triton.jit
def boot_masked(step):
    """(U, w) past the window: 0, and sum_a pi(a | s_T) Q(s_T, a) from the bootstrap state
    (read where the step's mask is set: the first tile in scan order, or packed rows' segment
    ends)."""
    rows = step.mask
    lq = step.ins[LAST_Q] + slot_offsets(step, LAST_Q, 0)
    lpi = step.ins[LAST_PI] + slot_offsets(step, LAST_PI, 0)
    end = tl.zeros(rows.shape, tl.float32)
    for a0 in range(0, step.n_act, BOOT_BLOCK_A):
        a = a0 + tl.arange(0, BOOT_BLOCK_A)[None, None, :]
        in_a = rows[:, :, None] & (a < step.n_act)
        end += tl.sum(tl.load(lq[:, :, None] + a * step.sa[LAST_Q], mask=in_a, other=0.0)
                      .to(tl.float32)
                      * tl.load(lpi[:, :, None] + a * step.sa[LAST_PI], mask=in_a, other=0.0)
                      .to(tl.float32), axis=2)
    return tl.zeros(rows.shape, tl.float32), end


@triton.jit
def store_masked(step, res, res_prev, aux):
    """G = r + gamma (1 - term) (e' + (1 - cut) U'), U' the exclusive scan (0 past the window)."""
    gamma = step.params[0]
    own, keep, e_succ = aux  # (no nested unpacking: Triton 3.6)
    r, term, cut, q_a = own
    g = r + tl.where(term, 0.0, gamma * (e_succ + tl.where(cut, 0.0, res_prev)))
    store_out(step, 0, tl.where(keep, g, 0.0))
    if step.VARIANT == 1:
        store_out(step, 1, tl.where(keep, g - q_a, 0.0))


KERNEL_MASKED = Kernel(coef_masked, store_masked, reverse=True, exclusive=True, aux=True,
                       trunc_slot_always=(TERM.value, TRUNC.value),
                       action_slots=(Q.value, PI.value, LAST_Q.value, LAST_PI.value),
                       mask_slot=MASK, boot=boot_masked, finish=finish_linear)


# ---- backward: H[t] = dA[t] + gamma * c[t] * (1 - cut[t-1]) * H[t-1], a forward scan --------
# At step t the kernel forms what step t-1's coefficients owe to slot t: c[t], Q(s_t, a_t) and
# E[t-1] = sum_a pi(a | s_t) Q(s_t, a). Its writer reads slot t's action axis once, in blocks as
# the forward's builder does, and writes d Q(s_t, .) = gamma he[t] pi(. | s_t) plus dqa[t] at
# a_t, and d pi(. | s_t) alike (he[t]: the weight of E[t-1], over gamma).

class GradInputs(NamedTuple):
    terminated: Tensor  # slot 0: the full shape in the caller's layout
    truncated: Optional[Tensor]
    q_values: Tensor  # [*S, A]
    actions: Tensor
    target_probs: Tensor  # [*S, A]
    behavior_probs: Tensor
    returns: Tensor  # G
    grad_returns: Optional[Tensor]
    grad_advantages: Optional[Tensor]


G_TERM, G_TRUNC, G_Q, G_ACT, G_PI, G_MU, G_RET, G_DRET, G_DADV = slots(GradInputs)
# VARIANT bits
D_R, D_Q, D_PI, D_MU, D_ROWS, D_LAST, HAS_DRET, HAS_DADV = (
    tl.constexpr(1 << i) for i in range(8))
# outputs: d r, d mu, d gamma and d lam per step, d Q, d pi; then the weight of E[T-1] per row
O_R, O_MU, O_GAMMA, O_LAM, O_Q, O_PI, O_LAST = (tl.constexpr(i) for i in range(7))


@triton.jit
def grad_coef(step, after):
    VARIANT: tl.constexpr = step.VARIANT
    mask = step.mask
    t = step.t
    gamma = step.params[0]
    lam = step.params[1]
    c_clip = step.params[2]
    first = t == 0
    term, cut = cut_flags(step, G_TERM, G_TRUNC)
    term_b, cut_b = flags_before(step, G_TERM, G_TRUNC, term, cut)
    # a_t's entries of Q and pi (on the transposed tile, as the forward's gathers)
    a_t = tl.load(step.ins[G_ACT] + slot_offsets(step, G_ACT, t), mask=mask, other=0)
    a_t = tl.minimum(tl.maximum(a_t, 0), step.n_act - 1)  # inside the rows, whatever they hold
    a_tr = tl.trans(a_t)
    mask_tr = tl.trans(mask)
    q_a = tl.trans(load_value(step.ins[G_Q], tl.trans(slot_offsets(step, G_Q, t))
                              + a_tr * step.sa[G_Q], mask_tr))
    pi_a = tl.trans(load_value(step.ins[G_PI], tl.trans(slot_offsets(step, G_PI, t))
                               + a_tr * step.sa[G_PI], mask_tr))
    mu = tl.where(mask, load_step(step, G_MU), 1.0)
    # correctly rounded, so that pi = mu is exactly 1, a tie at the clip (the gradient passes,
    # semantics §6); a GPU's default division is approximate (2 ulp) and can land above it
    ratio = tl.math.div_rn(pi_a, mu)
    c = lam * clip(ratio, c_clip)
    stop_b = cut_b | first
    beta = tl.where(stop_b | (c != c), 0.0, gamma * c)
    d_a = tl.zeros(mask.shape, tl.float32)
    d_adv = tl.zeros(mask.shape, tl.float32)
    if HAS_DRET & VARIANT:
        d_a += load_step(step, G_DRET)
    if HAS_DADV & VARIANT:
        d_adv = load_step(step, G_DADV)
    # G[t] - Q(s_t, a_t): what c[t] multiplies in G[t-1]; not read where t-1 is cut (a select:
    # a NaN there reaches neither d lam nor d c)
    ahead = tl.where(stop_b, 0.0, load_step(step, G_RET) - q_a)
    # d ratio = lam y ahead below the clip (ties too, as torch.clamp), y = d G[t-1] / d (c[t] ..)
    k_ratio = tl.where(ratio <= c_clip, lam * ahead, 0.0)
    return d_a + d_adv, beta, (d_adv, a_t, term_b | first, stop_b, c, k_ratio / mu,
                               -k_ratio * pi_a / (mu * mu), c * ahead,
                               clip(ratio, c_clip) * ahead, term, t == step.T - 1)


@triton.jit
def grad_store(step, res, res_prev, aux):
    """res = H[t], res_prev = H[t-1]; reads slot t's action axis of the inputs too."""
    gamma = step.params[0]
    t = step.t
    ins = step.ins
    sa = step.sa
    outs = step.outs
    n_act = step.n_act
    VARIANT: tl.constexpr = step.VARIANT
    BLOCK_A: tl.constexpr = step.BLOCK_A
    ACT_VEC: tl.constexpr = step.ACT_VEC
    d_adv, a_t, off_b, stop_b, c, k_pi, k_mu, c_ahead, clip_ahead, term, at_end = aux
    if D_R & VARIANT:
        store_out(step, O_R, res)
    y = tl.where(stop_b, 0.0, gamma * res_prev)  # d G[t-1] / d (c[t] (G[t] - Q(s_t, a_t)))
    if D_MU & VARIANT:  # d mu = -d ratio * ratio / mu
        store_out(step, O_MU, k_mu * y)
    if D_LAST & VARIANT:  # the weight of E[T-1] (the bootstrap state's), over gamma
        store_at(step, O_LAST, step.mask & at_end, tl.where(term, 0.0, res))
    if (D_Q | D_PI | D_ROWS) & VARIANT:
        # slot t's action axis, in blocks on the transposed tile (as the forward's builder):
        # d Q(s_t, .) = gamma he pi(. | s_t), plus dqa at a_t; d pi(. | s_t) alike
        he = tl.where(off_b, 0.0, res_prev)  # the weight of E[t-1] in the loss, over gamma
        g_he = tl.trans(gamma * he)[:, :, None]
        dqa = tl.trans(-y * c - d_adv)[:, :, None]
        dpia = tl.trans(y * k_pi)[:, :, None]
        a_tr = tl.trans(a_t)[:, :, None]
        in_tr = tl.trans(step.mask)[:, :, None]
        q_row = tl.trans(slot_offsets(step, G_Q, t))[:, :, None]
        pi_row = tl.trans(slot_offsets(step, G_PI, t))[:, :, None]
        dq_row = tl.trans(out_offsets(step, O_Q))[:, :, None]
        dpi_row = tl.trans(out_offsets(step, O_PI))[:, :, None]
        # rows that start at a multiple of ACT_VEC actions load ACT_VEC at a time
        # (`launch.action_vector`); the gradients' rows are contiguous, n_act long
        if ACT_VEC > 1:
            q_row = q_row // ACT_VEC * ACT_VEC
            pi_row = pi_row // ACT_VEC * ACT_VEC
            dq_row = dq_row // ACT_VEC * ACT_VEC
            dpi_row = dpi_row // ACT_VEC * ACT_VEC
        e_slot = tl.zeros([g_he.shape[0], g_he.shape[1], BLOCK_A], tl.float32)
        for k in tl.static_range(step.ACT_BLOCKS):
            a = k * BLOCK_A + tl.arange(0, BLOCK_A)[None, None, :]
            in_a = tl.max_constancy(in_tr & (a < n_act), [1, 1, ACT_VEC])
            taken = a == a_tr
            q = tl.load(ins[G_Q] + (q_row + a * sa[G_Q]), mask=in_a, other=0.0).to(tl.float32)
            p = tl.load(ins[G_PI] + (pi_row + a * sa[G_PI]), mask=in_a,
                        other=0.0).to(tl.float32)
            if D_Q & VARIANT:
                dq = g_he * p + tl.where(taken, dqa, 0.0)
                tl.store(outs[O_Q] + (dq_row + a), dq.to(outs[O_Q].dtype.element_ty),
                         mask=in_a)
            if D_PI & VARIANT:
                dpi = g_he * q + tl.where(taken, dpia, 0.0)
                tl.store(outs[O_PI] + (dpi_row + a), dpi.to(outs[O_PI].dtype.element_ty),
                         mask=in_a)
            if D_ROWS & VARIANT:
                e_slot += q * p
        if D_ROWS & VARIANT:  # d gamma: E[t-1] from slot t, and c[t] (G[t] - Q(s_t, a_t))
            e = tl.trans(tl.sum(e_slot, axis=2))
            store_out(step, O_GAMMA, tl.where(off_b, 0.0, he * e)
                      + tl.where(stop_b, 0.0, res_prev * c_ahead))
            store_out(step, O_LAM, y * clip_ahead)


GRAD_KERNEL = Kernel(grad_coef, grad_store, reverse=False, exclusive=True, aux=True,
                     action_slots=(G_Q.value, G_PI.value), action_outs=(O_Q.value, O_PI.value))


def backward(x: Inputs, outs, grads, s: Scalars, rows, call, extra: Extras, needs):
    nr, nq, _, npi, nmu, _, _, nlq, nlpi, nrows = needs
    d_ret, d_adv = (*grads, None)[:2]  # one output unless return_advantages
    gx = GradInputs(x.terminated, x.truncated, x.q_values, x.actions, x.target_probs,
                    x.behavior_probs, outs[0], d_ret,
                    d_adv if extra.return_advantages else None)
    need_last = nlq or nlpi or nrows
    variant = bits(nr, nq, npi, nmu, nrows, need_last, d_ret is not None,
                   gx.grad_advantages is not None)
    dr, dmu, dg, dl, dq, dpi, hl = run_backward(OP.name, GRAD_KERNEL, gx, call, 6, 1, variant, s,
                                                rows, OP.row_params)
    gamma = rows[0] if rows is not None else s.gamma  # per row: [*batch]
    lq, lpi = x.last_q_values.float(), x.last_target_probs.float()
    res = [like(dr, x.rewards) if nr else None, like(dq, x.q_values) if nq else None, None,
           like(dpi, x.target_probs) if npi else None,
           like(dmu, x.behavior_probs) if nmu else None, None, None,
           like((gamma * hl).unsqueeze(-1) * lpi, x.last_q_values) if nlq else None,
           like((gamma * hl).unsqueeze(-1) * lq, x.last_target_probs) if nlpi else None, None]
    if nrows:  # E[T-1] from the bootstrap state, not read after a termination (a select)
        td = call.time_dim
        end = torch.where(x.terminated.select(td, -1) != 0, 0.0, hl * (lpi * lq).sum(-1))
        res[9] = torch.stack([dg.sum(td) + end, dl.sum(td)])
    return res


def torch_impl(x: Inputs, s: Scalars, extra=(), dtype=torch.float32, packed=None):
    r, q, pi, mu, lq, lpi = _prep(dtype, x.rewards, x.q_values, x.target_probs,
                                  x.behavior_probs, x.last_q_values, x.last_target_probs)
    term, trunc = _flags(x.terminated, x.truncated)
    m, end = torch_scan.decisions(x.mask, r, packed)
    r, q, pi = _decided(m, r, q, pi)
    (mu,) = _decided(m, mu, fill=1.0)  # pi / mu stays finite
    a = x.actions.long().clamp(0, q.shape[-1] - 1).unsqueeze(-1)  # as the kernel: in range
    q_a = q.gather(-1, a).squeeze(-1)
    pi_a = pi.gather(-1, a).squeeze(-1)
    zero = torch.zeros_like(r[0])
    if packed is None:
        expected = torch_scan.shift_up((pi * q).sum(-1), (lpi * lq).sum(-1), m)
    else:  # the bootstrap state per step (its segment's), at each segment's end
        expected = torch.where(packed.ends, (lpi * lq).sum(-1),
                               torch_scan.shift_up((pi * q).sum(-1), zero, m))
    c_next = torch_scan.shift_up(s.lam * torch.clamp(pi_a / mu, max=s.c_clip), zero, m)
    q_a_next = torch_scan.shift_up(q_a, zero, m)
    cut = torch_scan.cut(term, trunc, end)
    boot = expected - _when(~cut, c_next, q_a_next)
    alpha = r + _when(~term, s.gamma, boot)
    beta = _when(~cut, s.gamma, c_next)
    g = torch_scan.scan(*torch_scan.masked(alpha, beta, m), reverse=True)
    return torch_scan.zero_masked(g, m), torch_scan.zero_masked(g - q_a, m)


def loop_impl(x: Inputs, s: Scalars, extra=(), dtype=torch.float64):
    x = x._replace(actions=x.actions.clamp(0, x.q_values.shape[-1] - 1))  # as the kernel
    return reference.retrace(**x._asdict(), **s._asdict(), dtype=dtype)


def _check(x: Inputs, time_dim, extra, segments=None):
    call = Call("rewards", x.rewards, time_dim, segments=segments)
    r = call.step("rewards", x.rewards)
    q = call.step("q_values", x.q_values, trailing=1)
    n_act = q.shape[-1]
    if n_act == 0:
        raise ValueError("q_values has an empty action axis")
    checked = Inputs(
        r, q, call.step("actions", x.actions, INDEX),
        call.step("target_probs", x.target_probs, trailing_shape=(n_act,)),
        call.step("behavior_probs", x.behavior_probs),
        call.step("terminated", x.terminated, FLAG),
        call.step("truncated", x.truncated, FLAG, optional=True),
        call.bootstrap("last_q_values", x.last_q_values, VALUE, trailing_shape=(n_act,),
                       optional=False),
        call.bootstrap("last_target_probs", x.last_target_probs, VALUE,
                       trailing_shape=(n_act,), optional=False),
        call.step("mask", x.mask, FLAG, optional=True))
    if segments is not None and checked.mask is None:
        # packed rows run on the masked kernel (its W scan restarts at every segment's end):
        # without a mask, one of ones, a single byte seen at every step (no pass, no copy)
        checked = checked._replace(mask=_ones(call.device).expand(r.shape))
    return checked, call


_ONES: dict = {}  # a bool one per device: packed calls' mask where they give none


def _ones(device) -> Tensor:
    one = _ONES.get(device)
    if one is None:
        one = torch.ones((), dtype=torch.bool, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _ONES[device] = one  # (one made in a capture is filled at its replays only)
    return one


def _check_actions(x: Inputs, extra: Extras):
    # (traced by torch.compile, the torch and loop backends' check would read values: there,
    # as with check_actions=False, they clamp; the Triton backend checks in its custom op)
    if extra.check_actions and not torch.compiler.is_compiling():
        n_act = x.q_values.shape[-1]
        # (the kernel where Triton compiles: a CUDA machine without it runs the torch backend)
        on_gpu = x.actions.is_cuda and HAS_TRITON and not INTERPRETER
        lo_hi = action_range(x.actions, x.mask) if on_gpu else None
        if lo_hi is not None:
            check_action_range(*lo_hi, n_act)
            return
        # the actions of masked steps are ignored (semantics §3), whatever they hold
        acts = x.actions if x.mask is None else torch.where(x.mask != 0, x.actions, 0)
        check_actions(acts, n_act)


RANGE_BLOCK = 1024
RANGE_PROGRAMS = 512  # at most: each loops over its share beyond 512 blocks


@triton.jit
def action_range_kernel(actions, mask, part, ticket, n, P, HAS_MASK: tl.constexpr,
                        MASK_STEP: tl.constexpr, PB: tl.constexpr, BLOCK: tl.constexpr):
    """The smallest and largest action of the decision steps, 0 counted (in range whatever
    the actions are): each of the P programs' over its blocks into `part` [2P], then the last
    program's over those into part[0] and part[1]."""
    pid = tl.program_id(0)
    lo = tl.zeros([BLOCK], tl.int64)
    hi = tl.zeros([BLOCK], tl.int64)
    for start in range(pid * BLOCK, n, P * BLOCK):
        i = start + tl.arange(0, BLOCK)
        inb = i < n
        a = tl.load(actions + i, mask=inb, other=0).to(tl.int64)
        if HAS_MASK:
            a = tl.where(tl.load(mask + i * MASK_STEP, mask=inb, other=0) != 0, a, 0)
        lo = tl.minimum(lo, a)
        hi = tl.maximum(hi, a)
    tl.store(part + pid, tl.min(lo, axis=0))
    tl.store(part + P + pid, tl.max(hi, axis=0))
    if last_program(ticket):
        j = tl.arange(0, PB)
        lo_all = tl.load(part + j, mask=j < P, other=0, cache_modifier=".cg")
        hi_all = tl.load(part + P + j, mask=j < P, other=0, cache_modifier=".cg")
        tl.store(part, tl.min(lo_all, axis=0))
        tl.store(part + 1, tl.max(hi_all, axis=0))
        reset(ticket)


def action_range(actions: Tensor, mask: Optional[Tensor]) -> Optional[tuple]:
    """(smallest, largest) action of the decision steps, 0 counted, by one launch of
    `action_range_kernel` and one read (on CUDA, a sync), where torch takes a reduction, a
    stack and a read (docs/dev/host-path.md, "Retrace's action check and the losses'
    scalars"). None where the actions or the mask are not one run of memory each (the caller
    reduces with torch)."""
    n = actions.numel()
    if n == 0:
        return 0, 0
    if n >= 2**30 or not actions.is_contiguous():
        return None
    step = 1
    if mask is not None:
        if not any(mask.stride()):  # one value broadcast (packed calls without a mask)
            step = 0
        elif not (mask.is_contiguous() and mask.shape == actions.shape):
            return None
    P = min(cdiv(n, RANGE_BLOCK), RANGE_PROGRAMS)
    part, ticket = scratch(actions.device, 2 * P, torch.int64)
    launch(action_range_kernel, P, (actions, actions if mask is None else mask, part, ticket,
                                    n, P), actions.device, HAS_MASK=mask is not None,
           MASK_STEP=step, PB=next_power_of_2(P), BLOCK=RANGE_BLOCK, num_warps=4)
    lo, hi = part[:2].tolist()  # one sync on CUDA
    return lo, hi


OP = ScanOp("retrace", Inputs, Scalars, outputs=2, extras=Extras, check=_check,
            plan=lambda x, call, out_dtype, extra: scan_plan(
                KERNEL if x.mask is None else KERNEL_MASKED, x, call, 1 + extra.return_advantages,
                out_dtype, variant=int(extra.return_advantages)),
            torch=torch_impl, loop=loop_impl, n_out=lambda extra: 1 + extra.return_advantages,
            runtime_check=_check_actions, row_params=2, backward=backward,
            masked_kernels=lambda x: True, packed_kernels=lambda x: True)


def retrace(rewards, q_values, actions, target_probs, behavior_probs, terminated, truncated=None,
            *, last_q_values=None, last_target_probs=None, mask=None, cu_seqlens=None,
            check_offsets=True, gamma=0.99, lam=1.0, c_clip=1.0, return_advantages=False,
            check_actions=True, time_dim=0, backend="auto", out_dtype=torch.float32):
    """Retrace(lambda) Q targets for discrete actions. Returns `G`, or `(G, G - Q(s_t, a_t))`
    with `return_advantages=True`.

    Shapes, with S the step shape of `rewards` (time axis `time_dim`) and A actions:
    `q_values[..., a] = Q(s_t, a)` and `target_probs[..., a] = pi(a | s_t)` are `[*S, A]`;
    `actions` (integer) and `behavior_probs` (`mu(a_t | s_t)`, the behaviour probability of the
    taken action, stored at acting time) are `[*S]`; the bootstrap state s_T is given by
    `last_q_values` and `last_target_probs`, `[*batch, A]`. A negative `time_dim` counts from the
    end of `rewards`' shape, not of `q_values`'.

    With E[t] = sum_a pi(a | s_{t+1}) Q(s_{t+1}, a) (from slot t+1, or from the bootstrap state
    at t = T-1) and c[t+1] = lam * min(c_clip, pi(a_{t+1} | s_{t+1}) / mu(a_{t+1} | s_{t+1}))::

        G[t] = r[t] + gamma * (1 - terminated[t]) * (E[t] + (1 - cut[t]) * c[t+1] * (G[t+1] - Q(s_{t+1}, a_{t+1})))

    Slot t+1 must hold the successor state of step t (next-step autoreset): at a truncation its
    expectation is the bootstrap. The expectation over actions is formed inside the kernel.

    Actions outside `[0, A)` raise `ValueError` (one reduction, and on CUDA one sync, per call);
    `check_actions=False` skips that check (for CUDA-graph capture), and every backend then
    clamps the actions into `[0, A)`: never a read outside the tensors. Traced by
    torch.compile, the torch and loop backends clamp them too (semantics §3).

    `mask` (semantics §7; bool, integer or float, the shape of `rewards`): the decision steps. The
    recurrence runs over them only, as if the other steps were deleted from each row: a step's
    successor state is that of the next decision step, each row's last decision step is its
    window end, and outputs at masked steps are 0 (their actions are ignored).
    `cu_seqlens` (semantics §7; integers [S + 1], FlashAttention's convention): packed rows. The
    per-step tensors are `[L, ...]` (time on axis 0), each segment [cu[i], cu[i+1]) a row of its
    own whose last step is a window end; bootstraps are `[S, ...]`. Combines with `mask`.
    Per-step tensors may carry batch axes after the packed one (`[L, N]`, bootstraps
    `[S, N]`); a tensor discount is one per segment, `[S]` or `[S, N]`. The offsets must
    start at 0, end at L and never decrease (else `ValueError`), checked on every call: free
    on CPU offsets, one device sync on CUDA ones, which `check_offsets=False` skips (for
    CUDA-graph capture; whatever the offsets hold, nothing is read outside the tensors).
    On the Triton backend both run on the masked kernel, packed rows in place (calls that need
    gradients: the torch implementation, packed rows on one long row).

    Example::

        >>> G = rl_triton.retrace(rewards, q, actions, pi, mu_taken, terminated,
        ...                       last_q_values=q_last, last_target_probs=pi_last, lam=0.95)
    """
    clip = dict(high=None, low_open=True)
    s = Scalars(check_discount("gamma", gamma), check_discount("lam", lam),
                check_scalar("c_clip", c_clip, **clip))
    extra = Extras(check_bool("return_advantages", return_advantages),
                   check_bool("check_actions", check_actions))
    return OP(Inputs(rewards, q_values, actions, target_probs, behavior_probs, terminated,
                     truncated, last_q_values, last_target_probs, mask), s, time_dim, backend,
              out_dtype, extra, cu_seqlens=cu_seqlens, check_offsets=check_offsets)
