"""The one scan machinery every Triton estimator runs on.

`scan_kernel` walks a tile of `BLOCK_T` steps x `BLOCK_B` rows at a time through one segment of
the time axis, in scan order (decreasing t for reverse scans). For each tile it asks the
estimator's `COEF` to build the coefficients (alpha, beta) in registers from the raw inputs, scans
the tile with `tl.associative_scan`, applies the carry from the tiles already done, and hands the
result to the estimator's `STORE`. Nothing but the final outputs goes to memory.

Long rows are split into segments that run in parallel (grid axis 1). Then a first launch
(PHASE 0) composes each segment's coefficients into one affine map `A -> agg_a + agg_b * A` and
writes it to a small scratch buffer; the second launch (PHASE 1) folds the maps of the segments
before it (in scan order) into its carry and produces the outputs.

Every tensor is addressed as `ptr + t * st + b1 * s1 + b2 * s2`, where the flattened row index b
splits as (b // B2, b % B2): two strides describe any layout whose batch axes fall into two
contiguous groups (time-major, batch-major, slices, broadcast flags over feature axes).
"""
import triton
import triton.language as tl


@triton.jit
def combine(a1, b1, a2, b2):
    """(a1, b1) then (a2, b2): the later element in scan order applied to the earlier's result."""
    return a2 + b2 * a1, b1 * b2


@triton.jit
def combine_with_exclusive(a1, b1, ea1, eb1, a2, b2, ea2, eb2):
    """`combine`, plus (ea, eb): the composition of all elements but the last one in scan order."""
    return a2 + b2 * a1, b1 * b2, ea2 + eb2 * a1, b1 * eb2


@triton.jit
def offsets(t, b1, b2, st, s1, s2):
    return t * st + b1 * s1 + b2 * s2


@triton.jit
def load_value(ptr, off, mask):
    return tl.load(ptr + off, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def load_flag(ptr, off, mask):
    return tl.load(ptr + off, mask=mask, other=0) != 0


@triton.jit
def load_step(ins, st, s1, s2, SLOT: tl.constexpr, t, b1, b2, mask):
    """Input slot SLOT at steps t (float32)."""
    return load_value(ins[SLOT], offsets(t, b1, b2, st[SLOT], s1[SLOT], s2[SLOT]), mask)


@triton.jit
def load_step_flag(ins, st, s1, s2, SLOT: tl.constexpr, t, b1, b2, mask):
    return load_flag(ins[SLOT], offsets(t, b1, b2, st[SLOT], s1[SLOT], s2[SLOT]), mask)


@triton.jit
def cut_flags(ins, st, s1, s2, TERM: tl.constexpr, TRUNC: tl.constexpr, t, b1, b2, mask, T,
              HAS_TRUNC: tl.constexpr):
    """(terminated[t], cut[t]) with cut = terminated or truncated or t == T-1."""
    term = load_step_flag(ins, st, s1, s2, TERM, t, b1, b2, mask)
    cut = term | (t == T - 1)
    if HAS_TRUNC:
        cut = cut | load_step_flag(ins, st, s1, s2, TRUNC, t, b1, b2, mask)
    return term, cut


@triton.jit
def successor(ins, st, s1, s2, V: tl.constexpr, NV: tl.constexpr, LV: tl.constexpr, t, b1, b2,
              mask, T, HAS_VALUES: tl.constexpr, HAS_NEXT: tl.constexpr,
              HAS_LAST: tl.constexpr, NEED_SLOT_NEXT: tl.constexpr):
    """(v'[t], values[t+1]): the successor value, and the value in slot t+1 (0 past the end).

    v'[t] is next_values[t] when given, else values[t+1], and last_value at t = T-1 (zero when
    neither is given: discounted returns only). The second result is loaded only when asked for.
    """
    inside = mask & (t + 1 < T)
    slot_next = tl.zeros(mask.shape, tl.float32)
    if HAS_VALUES:
        if NEED_SLOT_NEXT or not HAS_NEXT:
            slot_next = load_step(ins, st, s1, s2, V, t + 1, b1, b2, inside)
    if HAS_NEXT:
        v_succ = load_step(ins, st, s1, s2, NV, t, b1, b2, mask)
    else:
        v_succ = slot_next
        if HAS_LAST:
            # Bootstrap tensors have a zero time stride: one row, read at t = T-1 only.
            last = load_step(ins, st, s1, s2, LV, t, b1, b2, mask & (t == T - 1))
            v_succ = tl.where(t == T - 1, last, v_succ)
    return v_succ, slot_next


@triton.jit
def scan_tile(alpha, beta, carry, REVERSE: tl.constexpr, EXCLUSIVE: tl.constexpr,
              BLOCK_T: tl.constexpr):
    """Scan a [BLOCK_T, BLOCK_B] tile along time, continuing from `carry` ([BLOCK_B]).

    Returns A (the recurrence at each step), A_prev (A at the previous step in scan order, i.e.
    A[t+1] for reverse scans; only when EXCLUSIVE, else A again) and the carry for the next tile.
    """
    if EXCLUSIVE:
        a, b, ea, eb = tl.associative_scan(
            (alpha, beta, tl.zeros_like(alpha), tl.full(alpha.shape, 1.0, tl.float32)), 0,
            combine_with_exclusive, reverse=REVERSE)
        a_prev = ea + eb * carry[None, :]
    else:
        a, b = tl.associative_scan((alpha, beta), 0, combine, reverse=REVERSE)
    res = a + b * carry[None, :]
    if not EXCLUSIVE:
        a_prev = res
    rows = tl.arange(0, BLOCK_T)[:, None]
    if REVERSE:
        edge = 0
    else:
        edge = BLOCK_T - 1
    new_carry = tl.sum(tl.where(rows == edge, res, 0.0), axis=0)
    return res, a_prev, new_carry


@triton.jit
def tile_total(alpha, beta, REVERSE: tl.constexpr, BLOCK_T: tl.constexpr):
    """The tile's coefficients composed into one map (agg_a, agg_b), in scan order."""
    a, b = tl.associative_scan((alpha, beta), 0, combine, reverse=REVERSE)
    rows = tl.arange(0, BLOCK_T)[:, None]
    if REVERSE:
        edge = 0
    else:
        edge = BLOCK_T - 1
    return (tl.sum(tl.where(rows == edge, a, 0.0), axis=0),
            tl.sum(tl.where(rows == edge, b, 0.0), axis=0))


@triton.jit
def scan_kernel(
    ins, st, s1, s2, sa,  # input slots: pointers, time / batch-1 / batch-2 / action strides
    outs, ost, os1, os2,  # outputs likewise
    init, init_s1, init_s2,  # the initial carry A[T] (reverse) or A[-1] (forward)
    agg,  # float32 scratch [2, n_seg, B]: each segment's composed map (PHASE 0 writes it)
    scalars,  # the estimator's float scalars (gamma, lambda, clips): runtime values
    T, B, B2, n_act, chunks_per_seg, n_seg,
    COEF: tl.constexpr, STORE: tl.constexpr, REVERSE: tl.constexpr, EXCLUSIVE: tl.constexpr,
    HAS_TRUNC: tl.constexpr, HAS_NEXT: tl.constexpr, HAS_LAST: tl.constexpr,
    HAS_INIT: tl.constexpr, VARIANT: tl.constexpr, PHASE: tl.constexpr, INT64: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_A: tl.constexpr,
):
    pid_b = tl.program_id(0)
    seg = tl.program_id(1)
    b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    mask_b = b < B
    if INT64:
        b = b.to(tl.int64)
    b1 = (b // B2)[None, :]
    b2 = (b % B2)[None, :]
    n_chunks = tl.cdiv(T, BLOCK_T)
    c_lo = seg * chunks_per_seg
    c_hi = tl.minimum(c_lo + chunks_per_seg, n_chunks)
    rows = tl.arange(0, BLOCK_T)[:, None]

    if PHASE == 0:
        agg_a = tl.zeros((BLOCK_B,), tl.float32)
        agg_b = tl.full((BLOCK_B,), 1.0, tl.float32)
    else:
        carry = tl.zeros((BLOCK_B,), tl.float32)
        if HAS_INIT:
            carry = load_value(init, b1 * init_s1 + b2 * init_s2, mask_b[None, :]).reshape(
                (BLOCK_B,))
        # Fold in the segments before this one in scan order.
        if REVERSE:
            n_before = n_seg - 1 - seg
        else:
            n_before = seg
        for j in range(0, n_before):
            if REVERSE:
                s = n_seg - 1 - j
            else:
                s = j
            ga = tl.load(agg + s * B + b, mask=mask_b, other=0.0)
            gb = tl.load(agg + (n_seg + s) * B + b, mask=mask_b, other=1.0)
            carry = ga + gb * carry

    for i in range(0, c_hi - c_lo):
        if REVERSE:
            c = c_hi - 1 - i
        else:
            c = c_lo + i
        t = c * BLOCK_T + rows
        if INT64:
            t = t.to(tl.int64)
        mask = (t < T) & mask_b[None, :]
        alpha, beta, aux = COEF(ins, st, s1, s2, sa, t, b1, b2, mask, T, n_act, scalars,
                                HAS_TRUNC, HAS_NEXT, HAS_LAST, VARIANT, BLOCK_A)
        # Padding steps are the identity map: they pass the carry through unchanged.
        alpha = tl.where(mask, alpha, 0.0)
        beta = tl.where(mask, beta, 1.0)
        if PHASE == 0:
            ta, tb = tile_total(alpha, beta, REVERSE, BLOCK_T)
            agg_a, agg_b = ta + tb * agg_a, agg_b * tb
        else:
            res, res_prev, carry = scan_tile(alpha, beta, carry, REVERSE, EXCLUSIVE, BLOCK_T)
            STORE(outs, ost, os1, os2, t, b1, b2, mask, res, res_prev, aux, scalars, VARIANT)

    if PHASE == 0:
        tl.store(agg + seg * B + b, agg_a, mask=mask_b)
        tl.store(agg + (n_seg + seg) * B + b, agg_b, mask=mask_b)


@triton.jit
def store_out(outs, ost, os1, os2, SLOT: tl.constexpr, t, b1, b2, mask, value):
    ptr = outs[SLOT] + offsets(t, b1, b2, ost[SLOT], os1[SLOT], os2[SLOT])
    tl.store(ptr, value.to(ptr.dtype.element_ty), mask=mask)
