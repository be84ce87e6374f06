"""The one scan machinery every Triton estimator runs on.

`scan_kernel` runs one program per tile of `BLOCK_T` steps x `BLOCK_B` rows. The estimator's
`COEF` builds the tile's coefficients (alpha, beta) in registers from the raw inputs, the tile is
scanned with `tl.associative_scan` from a zero carry, the carry from the steps before the tile (in
scan order: later steps for reverse scans) is applied, and the estimator's `STORE` writes the
outputs. Inputs are read once and nothing but the outputs goes to memory, whatever the length.

When a row spans several tiles (`LOOKBACK`), the tiles of a row run in parallel and find their
carries by a single-pass decoupled look-back: each tile publishes its composed map
`A -> agg_a + agg_b * A` as soon as its own scan is done, then reads the maps of the tiles before
it, `WINDOW` at a time, until the composition no longer depends on anything earlier (a tile that
already knows its carry publishes its outgoing value, a constant map; a step with beta = 0, a
termination, also cuts the dependence), and publishes its own outgoing value in turn.

Tiles take a ticket from a counter in `state` so that a tile's predecessors have always started
(no deadlock whatever order the hardware schedules programs in); the counter also numbers the
launches, so every published word carries its launch's tag and stale words from an earlier launch
are never mistaken for current ones. The counter is never reset: the scratch can be reused by
every later launch of the same plan on the same stream, CUDA graph replays included.

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
def edge_row(x, REVERSE: tl.constexpr, BLOCK_T: tl.constexpr):
    """The row of a [BLOCK_T, BLOCK_B] scan result that holds the whole tile's composition."""
    rows = tl.arange(0, BLOCK_T)[:, None]
    if REVERSE:
        edge = 0
    else:
        edge = BLOCK_T - 1
    return tl.sum(tl.where(rows == edge, x, 0.0), axis=0)


@triton.jit
def pack(value, tag):
    """A float32 value and an int32 tag in one int64 word (written and read in one piece)."""
    bits = value.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    return bits | (tag.to(tl.int64) << 32)


@triton.jit
def word_value(word):
    return (word & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def word_tag(word):
    return (word >> 32).to(tl.int32)


@triton.jit
def look_back(words_a, words_b, pid_b, order, n_row_tiles, r, live, tag, carry_in,
              WINDOW: tl.constexpr):
    """The carry into tile `k` (position `order` > 0 along its rows' time axis, in scan order).

    Reads the words of the tiles at positions order-1, order-2, ... (WINDOW per pass, oldest
    first), each an aggregate map (tag + 1) or an outgoing value (tag + 2, a constant map), and
    composes them until every live row's map is constant. Position -1 is the initial carry.
    """
    acc_a = tl.zeros(carry_in.shape, tl.float32)
    acc_b = tl.full(carry_in.shape, 1.0, tl.float32)
    hi = order - 1
    w = tl.arange(0, WINDOW)[:, None]
    busy = order > 0
    while busy:
        j = hi - (WINDOW - 1) + w  # [WINDOW, 1], oldest first
        real = (j >= 0) & live[None, :]
        slot = (j * n_row_tiles + pid_b) * r.shape[0] + r[None, :]
        ta = tl.load(words_a + slot, mask=real, other=0, volatile=True)
        constant = word_tag(ta) == tag + 2
        need_b = real & (word_tag(ta) == tag + 1)
        tb = tl.load(words_b + slot, mask=need_b, other=0, volatile=True)
        # every word of the window must carry this launch's tag, else read it again
        ready = tl.where(real, constant | (word_tag(tb) == tag + 1), 1)
        if tl.min(ready.to(tl.int32)) != 0:
            ma = tl.where(real, word_value(ta), tl.where(j == -1, carry_in[None, :], 0.0))
            mb = tl.where(real, tl.where(constant, 0.0, word_value(tb)),
                          tl.where(j == -1, 0.0, 1.0))
            ca, cb = tl.associative_scan((ma, mb), 0, combine)
            # the tiles read so far (acc) come after this window in scan order
            acc_a = acc_a + acc_b * tl.sum(tl.where(w == WINDOW - 1, ca, 0.0), axis=0)
            acc_b = acc_b * tl.sum(tl.where(w == WINDOW - 1, cb, 0.0), axis=0)
            hi -= WINDOW
            busy = tl.max(tl.where(live, acc_b != 0.0, False).to(tl.int32)) != 0
    return acc_a


@triton.jit
def scan_kernel(
    ins, st, s1, s2, sa,  # input slots: pointers, time / batch-1 / batch-2 / action strides
    outs, ost, os1, os2,  # outputs likewise
    init, init_s1, init_s2,  # the initial carry A[T] (reverse) or A[-1] (forward)
    state,  # int64 scratch of the look-back: [ticket counter, words_a..., words_b...]
    scalars,  # the estimator's float scalars (gamma, lambda, clips): runtime values
    T, B, B2, n_act, n_row_tiles, n_chunks,
    COEF: tl.constexpr, STORE: tl.constexpr, REVERSE: tl.constexpr, EXCLUSIVE: tl.constexpr,
    HAS_TRUNC: tl.constexpr, HAS_NEXT: tl.constexpr, HAS_LAST: tl.constexpr,
    HAS_INIT: tl.constexpr, VARIANT: tl.constexpr, LOOKBACK: tl.constexpr,
    WINDOW: tl.constexpr, INT64: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_A: tl.constexpr,
):
    if LOOKBACK:
        n_tiles = n_row_tiles * n_chunks
        ticket = tl.atomic_add(state, 1)  # int64: the launch count times n_tiles, plus k
        k = (ticket % n_tiles).to(tl.int32)
        tag = ((ticket // n_tiles) % (1 << 29)).to(tl.int32) * 2  # words: tag+1 map, tag+2 value
        order = k // n_row_tiles  # tiles before this one in scan order, along its rows
        pid_b = k % n_row_tiles
    else:
        k = tl.program_id(0)
        order = 0
        pid_b = k
    if REVERSE:
        chunk = n_chunks - 1 - order
    else:
        chunk = order
    r = tl.arange(0, BLOCK_B)
    b = pid_b * BLOCK_B + r
    mask_b = b < B
    if INT64:
        b = b.to(tl.int64)
    b1 = (b // B2)[None, :]
    b2 = (b % B2)[None, :]
    t = chunk * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    if INT64:
        t = t.to(tl.int64)
    mask = (t < T) & mask_b[None, :]

    alpha, beta, aux = COEF(ins, st, s1, s2, sa, t, b1, b2, mask, T, n_act, scalars,
                            HAS_TRUNC, HAS_NEXT, HAS_LAST, VARIANT, BLOCK_A)
    # Padding steps are the identity map: they pass the carry through unchanged.
    alpha = tl.where(mask, alpha, 0.0)
    beta = tl.where(mask, beta, 1.0)
    if EXCLUSIVE:
        a, bb, ea, eb = tl.associative_scan(
            (alpha, beta, tl.zeros_like(alpha), tl.full(alpha.shape, 1.0, tl.float32)), 0,
            combine_with_exclusive, reverse=REVERSE)
    else:
        a, bb = tl.associative_scan((alpha, beta), 0, combine, reverse=REVERSE)

    carry = tl.zeros((BLOCK_B,), tl.float32)
    if HAS_INIT:
        carry = load_value(init, b1 * init_s1 + b2 * init_s2, mask_b[None, :]).reshape((BLOCK_B,))
    if LOOKBACK:
        agg_a = edge_row(a, REVERSE, BLOCK_T)
        agg_b = edge_row(bb, REVERSE, BLOCK_T)
        n_words = n_tiles * BLOCK_B
        words_a = state + 1
        words_b = state + 1 + n_words
        slot = k * BLOCK_B + r
        if order > 0:
            tl.atomic_xchg(words_a + slot, pack(agg_a, tag + 1), sem="relaxed")
            tl.atomic_xchg(words_b + slot, pack(agg_b, tag + 1), sem="relaxed")
            carry = look_back(words_a, words_b, pid_b, order, n_row_tiles, r, mask_b, tag, carry,
                              WINDOW)
        if order < n_chunks - 1:
            tl.atomic_xchg(words_a + slot, pack(agg_a + agg_b * carry, tag + 2), sem="relaxed")

    res = a + bb * carry[None, :]
    if EXCLUSIVE:
        res_prev = ea + eb * carry[None, :]
    else:
        res_prev = res
    STORE(outs, ost, os1, os2, t, b1, b2, mask, res, res_prev, aux, scalars, VARIANT)


@triton.jit
def store_out(outs, ost, os1, os2, SLOT: tl.constexpr, t, b1, b2, mask, value):
    ptr = outs[SLOT] + offsets(t, b1, b2, ost[SLOT], os1[SLOT], os2[SLOT])
    tl.store(ptr, value.to(ptr.dtype.element_ty), mask=mask)
