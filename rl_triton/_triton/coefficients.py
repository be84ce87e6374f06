"""Per-estimator coefficient builders and output writers for `scan.scan_kernel`.

A builder `*_coef(ins, st, s1, s2, sa, t, b1, b2, mask, end_rows, T, n_act, params, HAS_TRUNC,
HAS_NEXT, HAS_LAST, VARIANT, BLOCK_A, ACT_BLOCKS, ACT_VEC, after)` loads an estimator's raw
inputs for one tile and returns `(alpha, beta, aux)`; `after` is the builder's own `aux` at steps
t + 1 in the same places when the caller has it (time-major sub-tiles of a reverse scan,
`scan.scan_chunk`), else None; a writer `*_store(outs, ost, os1, os2, t, b1, b2,
mask, res, res_prev, aux, params, VARIANT)` turns the scanned tile into the outputs. The input
slot numbers below are the order in which `rl_triton._triton.ops` passes the tensors.
"""
import triton
import triton.language as tl

from .scan import (cut_flags, load_flag, load_step, load_step_flag, load_value, offsets,
                   store_out, successor)

# Slot numbers (compile-time constants, as Triton requires of globals read inside kernels).
_c = tl.constexpr
# the value-based backward estimators (gae, lambda_returns, discounted_returns, vtrace)
R, V, TERM, TRUNC, NEXT_V, LAST_V, TARGET_LP, BEHAVIOR_LP = (_c(i) for i in range(8))
# retrace
RT_R, RT_Q, RT_ACT, RT_PI, RT_MU, RT_TERM, RT_TRUNC, RT_LAST_Q, RT_LAST_PI = (
    _c(i) for i in range(9))
# the forward estimators, and linear_scan
X, DONES = _c(0), _c(1)
ALPHA, BETA = _c(0), _c(1)


@triton.jit
def gae_coef(ins, st, s1, s2, sa, t, b1, b2, mask, end_rows, T, n_act, params,
             HAS_TRUNC: tl.constexpr, HAS_NEXT: tl.constexpr, HAS_LAST: tl.constexpr,
             VARIANT: tl.constexpr, BLOCK_A: tl.constexpr, ACT_BLOCKS: tl.constexpr,
             ACT_VEC: tl.constexpr, after):
    gamma = params[0]
    lam = params[1]
    r = load_step(ins, st, s1, s2, R, t, b1, b2, mask)
    v = load_step(ins, st, s1, s2, V, t, b1, b2, mask)
    term, cut = cut_flags(ins, st, s1, s2, TERM, TRUNC, t, b1, b2, mask, T, HAS_TRUNC)
    v_succ, _ = successor(ins, st, s1, s2, V, NEXT_V, LAST_V, t, b1, b2, mask, end_rows, T, v,
                          True, HAS_NEXT, HAS_LAST, False, after)
    alpha = r + tl.where(term, 0.0, gamma * v_succ) - v
    beta = tl.where(cut, 0.0, gamma * lam)
    return alpha, beta, v


@triton.jit
def gae_store(outs, ost, os1, os2, t, b1, b2, mask, res, res_prev, aux, params,
              VARIANT: tl.constexpr):
    store_out(outs, ost, os1, os2, 0, t, b1, b2, mask, res)  # advantages
    store_out(outs, ost, os1, os2, 1, t, b1, b2, mask, res + aux)  # returns = A + V


@triton.jit
def lambda_returns_coef(ins, st, s1, s2, sa, t, b1, b2, mask, end_rows, T, n_act, params,
                        HAS_TRUNC: tl.constexpr, HAS_NEXT: tl.constexpr, HAS_LAST: tl.constexpr,
                        VARIANT: tl.constexpr, BLOCK_A: tl.constexpr, ACT_BLOCKS: tl.constexpr,
                        ACT_VEC: tl.constexpr, after):
    gamma = params[0]
    lam = params[1]
    r = load_step(ins, st, s1, s2, R, t, b1, b2, mask)
    term, cut = cut_flags(ins, st, s1, s2, TERM, TRUNC, t, b1, b2, mask, T, HAS_TRUNC)
    v_succ, _ = successor(ins, st, s1, s2, V, NEXT_V, LAST_V, t, b1, b2, mask, end_rows, T,
                          None, True, HAS_NEXT, HAS_LAST, False, None)
    keep = tl.where(cut, 0.0, lam)
    alpha = r + tl.where(term, 0.0, gamma * (1.0 - keep) * v_succ)
    beta = gamma * keep  # keep is 0 at terminations (cut includes them)
    return alpha, beta, 0.0


@triton.jit
def discounted_returns_coef(ins, st, s1, s2, sa, t, b1, b2, mask, end_rows, T, n_act, params,
                            HAS_TRUNC: tl.constexpr, HAS_NEXT: tl.constexpr,
                            HAS_LAST: tl.constexpr, VARIANT: tl.constexpr,
                            BLOCK_A: tl.constexpr, ACT_BLOCKS: tl.constexpr,
                            ACT_VEC: tl.constexpr, after):
    gamma = params[0]
    r = load_step(ins, st, s1, s2, R, t, b1, b2, mask)
    if VARIANT == 1:
        # last_value is the scan's initial carry A[T] (`ops.Kernel.carries_last`): step T-1
        # passes it on unless terminated, as v'[T-1] = last_value, truncated or not. Through
        # alpha instead, its per-step selects waited on the flags' and last_value's loads, and
        # the compiler issued the rewards' loads only after them: two or three memory round
        # trips in a row (sm_90 SASS; H200 time-major 16384x1024 68.6 -> 56.6 µs,
        # docs/benchmarks.md, log).
        cut = load_step_flag(ins, st, s1, s2, TERM, t, b1, b2, mask)
        if HAS_TRUNC:
            cut = cut | (load_step_flag(ins, st, s1, s2, TRUNC, t, b1, b2, mask) & (t < T - 1))
        return r, tl.where(cut, 0.0, gamma), 0.0
    term, cut = cut_flags(ins, st, s1, s2, TERM, TRUNC, t, b1, b2, mask, T, HAS_TRUNC)
    v_succ, _ = successor(ins, st, s1, s2, V, NEXT_V, LAST_V, t, b1, b2, mask, end_rows, T,
                          None, False, HAS_NEXT, HAS_LAST, False, None)
    alpha = r + tl.where(term, 0.0, tl.where(cut, gamma * v_succ, 0.0))
    beta = tl.where(cut, 0.0, gamma)
    return alpha, beta, 0.0


@triton.jit
def single_store(outs, ost, os1, os2, t, b1, b2, mask, res, res_prev, aux, params,
                 VARIANT: tl.constexpr):
    store_out(outs, ost, os1, os2, 0, t, b1, b2, mask, res)


@triton.jit
def vtrace_coef(ins, st, s1, s2, sa, t, b1, b2, mask, end_rows, T, n_act, params,
                HAS_TRUNC: tl.constexpr, HAS_NEXT: tl.constexpr, HAS_LAST: tl.constexpr,
                VARIANT: tl.constexpr, BLOCK_A: tl.constexpr, ACT_BLOCKS: tl.constexpr,
                ACT_VEC: tl.constexpr, after):
    gamma = params[0]
    lam = params[1]
    rho_clip = params[2]
    c_clip = params[3]
    r = load_step(ins, st, s1, s2, R, t, b1, b2, mask)
    v = load_step(ins, st, s1, s2, V, t, b1, b2, mask)
    term, cut = cut_flags(ins, st, s1, s2, TERM, TRUNC, t, b1, b2, mask, T, HAS_TRUNC)
    v_succ, v_slot_next = successor(ins, st, s1, s2, V, NEXT_V, LAST_V, t, b1, b2, mask,
                                    end_rows, T, v, True, HAS_NEXT, HAS_LAST, True,
                                    None if after is None else after[1])
    ratio = tl.exp(load_step(ins, st, s1, s2, TARGET_LP, t, b1, b2, mask)
                   - load_step(ins, st, s1, s2, BEHAVIOR_LP, t, b1, b2, mask))
    target = r + tl.where(term, 0.0, gamma * v_succ)
    alpha = tl.minimum(ratio, rho_clip) * (target - v)
    beta = tl.where(cut, 0.0, gamma * lam * tl.minimum(ratio, c_clip))
    return alpha, beta, (r, v, term, cut, ratio, v_succ, v_slot_next)


@triton.jit
def vtrace_store(outs, ost, os1, os2, t, b1, b2, mask, res, res_prev, aux, params,
                 VARIANT: tl.constexpr):
    gamma = params[0]
    lam = params[1]
    pg_rho_clip = params[4]
    r, v, term, cut, ratio, v_succ, v_slot_next = aux
    store_out(outs, ost, os1, os2, 0, t, b1, b2, mask, v + res)  # vs
    # vs'[t] = vs[t+1] = V[t+1] + D[t+1] inside an episode and the window, v'[t] at a cut.
    vs_succ = tl.where(cut, v_succ, v_slot_next + res_prev)
    pg = tl.minimum(ratio, pg_rho_clip) * (
        r + tl.where(term, 0.0, gamma * (lam * vs_succ + (1.0 - lam) * v_succ)) - v)
    store_out(outs, ost, os1, os2, 1, t, b1, b2, mask, pg)


@triton.jit
def retrace_coef(ins, st, s1, s2, sa, t, b1, b2, mask, end_rows, T, n_act, params,
                 HAS_TRUNC: tl.constexpr, HAS_NEXT: tl.constexpr, HAS_LAST: tl.constexpr,
                 VARIANT: tl.constexpr, BLOCK_A: tl.constexpr, ACT_BLOCKS: tl.constexpr,
                 ACT_VEC: tl.constexpr, after):
    return retrace_terms(ins, st, s1, s2, sa, t, b1, b2, mask, end_rows, T, n_act, params,
                         HAS_TRUNC, VARIANT, BLOCK_A, ACT_BLOCKS, ACT_VEC, False)


@triton.jit
def retrace_whole_coef(ins, st, s1, s2, sa, t, b1, b2, mask, end_rows, T, n_act, params,
                       HAS_TRUNC: tl.constexpr, HAS_NEXT: tl.constexpr, HAS_LAST: tl.constexpr,
                       VARIANT: tl.constexpr, BLOCK_A: tl.constexpr, ACT_BLOCKS: tl.constexpr,
                       ACT_VEC: tl.constexpr, after):
    """`retrace_coef` for tiles that span their rows' whole window (every tile holds step T-1:
    `ops.Launch` picks it)."""
    return retrace_terms(ins, st, s1, s2, sa, t, b1, b2, mask, end_rows, T, n_act, params,
                         HAS_TRUNC, VARIANT, BLOCK_A, ACT_BLOCKS, ACT_VEC, True)


@triton.jit
def retrace_terms(ins, st, s1, s2, sa, t, b1, b2, mask, end_rows, T, n_act, params,
                  HAS_TRUNC: tl.constexpr, VARIANT: tl.constexpr, BLOCK_A: tl.constexpr,
                  ACT_BLOCKS: tl.constexpr, ACT_VEC: tl.constexpr, WHOLE: tl.constexpr):
    gamma = params[0]
    lam = params[1]
    c_clip = params[2]
    inside = mask & (t + 1 < T)  # slot t+1 is in the window
    # The entries of a_{t+1} gathered from slot t+1's rows of Q and pi; then E[t] = sum_a
    # pi(a|s_{t+1}) Q(s_{t+1}, a) over the same rows, in ACT_BLOCKS blocks of BLOCK_A actions.
    # The gathers come first so that their round trip (actions, then the entries they index)
    # overlaps the blocks' loads instead of following them: load rounds (`tools/registers.py`,
    # sm_90) 8 -> 6 time-major at 16384x1024, 11 -> 9 batch-major; H200 device time 16384x1024
    # batch-major 787 -> 737 µs, time-major 703 -> 688, 64x32768 time-major 121 -> 118,
    # 4096x128 time-major 39.9 -> 39.0, batch-major 37.8 -> 38.5 (docs/benchmarks.md, log,
    # twentieth session). The loops over blocks are unrolled: as a loop of n_act / BLOCK_A
    # steps, the one block of 18 actions took 2.2 times the registers (sm_90, 208 against 96)
    # and the kernel 1.3-2.2 times the time (H200; docs/benchmarks.md, log).
    # Where every row starts at a multiple of ACT_VEC actions (`ops.action_vector`), the
    # compiler is told so (the rows rounded down to that multiple: no-ops on the values) and that
    # the mask is constant over groups of ACT_VEC actions: ACT_VEC actions per vector load. 18
    # float32 actions in pairs: 201 -> 105 shuffles, 96 -> 80 registers (sm_90, batch-major),
    # 1016 -> 862 µs at 16384x1024 (H200; bfloat16 920 -> 530).
    # These loads run on the transposed tile. Their addresses are contiguous along neither axis
    # of the tile (a row of actions lies between two steps, or two rows, that are neighbours in
    # memory), and Triton lays lanes along the first of equally contiguous axes: on the
    # transposed tile that is the tile's last axis, which follows memory (`scan_kernel`), so a
    # warp's loads cover neighbouring rows of actions. On the tile itself lanes ran along the
    # strided axis, and the gathers' addresses crossed the threads through shared memory:
    # H200, time-major 16384x1024 906 -> 703 µs (bfloat16 747 -> 564), 16384x16 28.1 -> 25.3,
    # batch-major 16384x16 30.5 -> 23.4 (docs/benchmarks.md, log).
    # In one-row batch-major tiles that span the window (128 steps x 1 row: T in 65..128),
    # a_{t+1}, r, the flags and mu are loaded before the blocks' addresses are formed: Triton
    # 3.6's schedule then issues 28 of the tile's 31 loads in one round (3 rounds against 5,
    # 72 registers against 56; `tools/registers.py`): H200 4096x128 0.84-0.86 of the previous
    # time, against 0.96-0.98 in the order below (bfloat16 0.97 and 0.96). In tiles of several
    # rows the same order took 0.98-1.01 against 0.92-0.96 (16384x16), and 1.02-1.22 where rows
    # span several tiles (docs/benchmarks.md, log, twenty-fourth session).
    EARLY: tl.constexpr = WHOLE and mask.shape[0] == 1
    if EARLY:
        a_next = load_action(ins, st, s1, s2, t + 1, b1, b2, inside)
    r = load_step(ins, st, s1, s2, RT_R, t, b1, b2, mask)
    term, cut = cut_flags(ins, st, s1, s2, RT_TERM, RT_TRUNC, t, b1, b2, mask, T, HAS_TRUNC)
    if EARLY:
        mu_next = tl.where(inside, load_step(ins, st, s1, s2, RT_MU, t + 1, b1, b2, inside),
                           1.0)
    q_row = tl.trans(offsets(t + 1, b1, b2, st[RT_Q], s1[RT_Q], s2[RT_Q]))
    pi_row = tl.trans(offsets(t + 1, b1, b2, st[RT_PI], s1[RT_PI], s2[RT_PI]))
    inside_tr = tl.trans(inside)
    if ACT_VEC > 1:
        q_row = q_row // ACT_VEC * ACT_VEC
        pi_row = pi_row // ACT_VEC * ACT_VEC
    if not EARLY:
        a_next = load_action(ins, st, s1, s2, t + 1, b1, b2, inside)
    a_next = tl.trans(a_next)
    q_a_next = tl.trans(load_value(ins[RT_Q], q_row + a_next * sa[RT_Q], inside_tr))
    pi_a_next = tl.trans(load_value(ins[RT_PI], pi_row + a_next * sa[RT_PI], inside_tr))
    # Where every tile spans its rows' whole window (`retrace_whole_coef`) each holds step T-1,
    # and the blocks read E's state there from the bootstrap tensors (when they share Q's and
    # pi's dtypes: one pointer per value), summing the products in each thread before one
    # reduction, rather than in a pass of its own after them (below): H200 16384x16 0.92-0.96
    # of the time (bfloat16 0.90-0.92), 4096x128 0.96-0.98. Where rows span several tiles, such
    # loads in every tile (predicated off but at T-1) took 1.09-1.42x (72 registers against
    # 56 at 16384x1024, sm_90), so those tiles keep the pass (docs/benchmarks.md, log).
    FOLD: tl.constexpr = (WHOLE and ins[RT_Q].dtype == ins[RT_LAST_Q].dtype
                          and ins[RT_PI].dtype == ins[RT_LAST_PI].dtype)
    state_tr = inside_tr
    if FOLD:
        at_end = tl.trans(mask & (t == T - 1))
        state_tr = inside_tr | at_end
        lq_row = tl.trans(offsets(0, b1, b2, st[RT_LAST_Q], s1[RT_LAST_Q], s2[RT_LAST_Q]))
        lpi_row = tl.trans(offsets(0, b1, b2, st[RT_LAST_PI], s1[RT_LAST_PI], s2[RT_LAST_PI]))
        if ACT_VEC > 1:
            lq_row = lq_row // ACT_VEC * ACT_VEC
            lpi_row = lpi_row // ACT_VEC * ACT_VEC
    if FOLD:
        products = tl.zeros([inside_tr.shape[0], inside_tr.shape[1], BLOCK_A], tl.float32)
    else:
        expected = tl.zeros(inside_tr.shape, tl.float32)
    for k in tl.static_range(ACT_BLOCKS):
        a = k * BLOCK_A + tl.arange(0, BLOCK_A)[None, None, :]
        in_a = tl.max_constancy(state_tr[:, :, None] & (a < n_act), [1, 1, ACT_VEC])
        q_ptr = ins[RT_Q] + (q_row[:, :, None] + a * sa[RT_Q])
        p_ptr = ins[RT_PI] + (pi_row[:, :, None] + a * sa[RT_PI])
        if FOLD:
            q_ptr = tl.where(at_end[:, :, None],
                             ins[RT_LAST_Q] + (lq_row[:, :, None] + a * sa[RT_LAST_Q]), q_ptr)
            p_ptr = tl.where(at_end[:, :, None],
                             ins[RT_LAST_PI] + (lpi_row[:, :, None] + a * sa[RT_LAST_PI]), p_ptr)
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
        mu_next = tl.where(inside, load_step(ins, st, s1, s2, RT_MU, t + 1, b1, b2, inside),
                           1.0)
    c_next = lam * tl.minimum(pi_a_next / mu_next, c_clip)

    # At t = T-1, E comes from the bootstrap state s_T: read by the tile that holds T-1 only.
    # (The bootstrap tensors have a zero time stride: one row per batch entry.)
    if not FOLD:
        if tl.max(end_rows.to(tl.int32)) != 0:
            last = end_rows
            lq_row = offsets(0, b1, b2, st[RT_LAST_Q], s1[RT_LAST_Q], s2[RT_LAST_Q])[:, :, None]
            lpi_row = offsets(0, b1, b2, st[RT_LAST_PI], s1[RT_LAST_PI],
                              s2[RT_LAST_PI])[:, :, None]
            end = tl.zeros(last.shape, tl.float32)
            for a0 in range(0, n_act, BLOCK_A):
                a = a0 + tl.arange(0, BLOCK_A)[None, None, :]
                end_a = last[:, :, None] & (a < n_act)
                end += tl.sum(load_value(ins[RT_LAST_Q], lq_row + a * sa[RT_LAST_Q], end_a)
                              * load_value(ins[RT_LAST_PI], lpi_row + a * sa[RT_LAST_PI], end_a),
                              axis=2)
            expected = tl.where(t == T - 1, end, expected)

    alpha = r + tl.where(term, 0.0, gamma * (expected - tl.where(cut, 0.0, c_next * q_a_next)))
    beta = tl.where(cut, 0.0, gamma * c_next)
    q_a = 0.0
    if VARIANT == 1:  # also return G - Q(s_t, a_t)
        a_t = load_action(ins, st, s1, s2, t, b1, b2, mask)
        q_a = tl.trans(load_value(ins[RT_Q], tl.trans(offsets(t, b1, b2, st[RT_Q], s1[RT_Q],
                                                               s2[RT_Q]) + a_t * sa[RT_Q]),
                                  tl.trans(mask)))
    return alpha, beta, q_a


@triton.jit
def load_action(ins, st, s1, s2, t, b1, b2, mask):
    """Retrace's actions at steps t (0 where masked)."""
    return tl.load(ins[RT_ACT] + offsets(t, b1, b2, st[RT_ACT], s1[RT_ACT], s2[RT_ACT]),
                   mask=mask, other=0)


@triton.jit
def retrace_store(outs, ost, os1, os2, t, b1, b2, mask, res, res_prev, aux, params,
                  VARIANT: tl.constexpr):
    store_out(outs, ost, os1, os2, 0, t, b1, b2, mask, res)
    if VARIANT == 1:
        store_out(outs, ost, os1, os2, 1, t, b1, b2, mask, res - aux)


@triton.jit
def forward_coef(ins, st, s1, s2, sa, t, b1, b2, mask, end_rows, T, n_act, params,
                 HAS_TRUNC: tl.constexpr, HAS_NEXT: tl.constexpr, HAS_LAST: tl.constexpr,
                 VARIANT: tl.constexpr, BLOCK_A: tl.constexpr, ACT_BLOCKS: tl.constexpr,
                 ACT_VEC: tl.constexpr, after):
    """Eligibility traces and episodic prefix sums:
    A[t] = x[t] + keep * (1 - done[t-1]) * A[t-1]."""
    keep = params[0]
    x = load_step(ins, st, s1, s2, X, t, b1, b2, mask)
    done_before = load_flag(ins[DONES], offsets(t - 1, b1, b2, st[DONES], s1[DONES], s2[DONES]),
                            mask & (t >= 1))
    return x, tl.where(done_before, 0.0, keep), 0.0


@triton.jit
def linear_scan_coef(ins, st, s1, s2, sa, t, b1, b2, mask, end_rows, T, n_act, params,
                     HAS_TRUNC: tl.constexpr, HAS_NEXT: tl.constexpr, HAS_LAST: tl.constexpr,
                     VARIANT: tl.constexpr, BLOCK_A: tl.constexpr, ACT_BLOCKS: tl.constexpr,
                     ACT_VEC: tl.constexpr, after):
    return (load_step(ins, st, s1, s2, ALPHA, t, b1, b2, mask),
            load_step(ins, st, s1, s2, BETA, t, b1, b2, mask), 0.0)
