"""The one scan machinery every Triton estimator runs on.

`scan_kernel` runs one program per tile of `BLOCK_T` steps x `BLOCK_B` rows. The estimator's
`COEF` builds the tile's coefficients (alpha, beta) in registers from the raw inputs, the tile is
scanned with `tl.associative_scan` from a zero carry, the carry from the steps before the tile (in
scan order: later steps for reverse scans) is applied, and the estimator's `STORE` writes the
outputs. Each gets one argument, a `Step`: the steps, with the tensors, indices, scalars and
flags the kernel has for them. Inputs are read once and nothing but the outputs goes to memory, whatever the length.

Reverse scans run as forward scans over steps laid in decreasing t: Triton's `reverse=True`
reverses the whole tile, across lanes, around the scan
(docs/dev/kernel-decisions.md#reverse-scans-run-forward). Time-major tiles (`DESC`) simply
hold their steps in decreasing order (their loads are along rows). A batch-major tile (`FLIP`)
holds its groups of 8 steps in decreasing order, each group still 8 consecutive steps (one
thread's vector load); each group is reversed in registers, the tile is scanned forward and
reversed back.

A time-major tile is built as `SUB` sub-tiles (`scan_chunk`): sub-tile J holds every SUB-th
step from J on, all with one layout, so each thread holds SUB consecutive steps of its rows, one in
each. They are composed in registers, and only the groups' compositions cross threads (Triton lays
a whole time-major tile out with no two consecutive steps in one thread).

When a row spans several tiles and the batch alone fills the GPU (`WALK`), one program walks the
tiles of its rows in scan order and passes the carry from one to the next in registers.
Otherwise (`LOOKBACK`) the tiles of a row run in parallel and find their carries by a
single-pass decoupled look-back: each tile publishes its composed map `A -> agg_a + agg_b * A`
as soon as its own scan is done, then reads the maps of the tiles before it, `DEPTH` at a time,
until the composition no longer depends on anything earlier (a tile that already knows its carry
publishes its outgoing value, a constant map; a step with beta = 0, a termination, also cuts the
dependence), and publishes its own outgoing value in turn.

A tile's predecessors have lower program ids, and the GPU starts programs in the order of their
ids, so a waiting tile never waits for one that cannot start (the scheme of CUB's single-pass
scan). Every published word carries a tag that names its launch, so that stale words from an
earlier launch are never taken for current ones. Every tile writes its own first word in every
launch, so a tile finds this launch's tag in the word it wrote last time (`launch_tag`): no
counter, no reset from the host. The scratch serves every later launch of the same plan on the
same stream, CUDA graph replays included.

Every tensor is addressed as `ptr + t * st + b1 * s1 + b2 * s2`, where the flattened row index b
splits as (b // B2, b % B2): two strides describe any layout whose batch axes fall into two
contiguous groups (time-major, batch-major, slices, broadcast flags over feature axes).
"""
from typing import NamedTuple

from .jit import tl, triton


@triton.jit
def apply_map(a, b, x):
    """The map A -> a + b * A applied to x: exactly a where b = 0, whatever x holds (a cut is a
    select, not a multiplication by zero: 0 * inf is NaN, and nothing after a cut may reach the
    steps before it), and where b is NaN, which in a composed map means 0 (`combine`). One
    ordered compare (false for NaN), as many instructions as a test of b == 0."""
    return tl.where(tl.abs(b) > 0, a + b * x, a)


@triton.jit
def combine(a1, b1, a2, b2):
    """(a1, b1) then (a2, b2): the later element in scan order applied to the earlier's result.
    Where b2 = 0 the result is (a2, 0) exactly (`apply_map`). The betas' product is NaN only as
    0 * inf (an infinite beta, e.g. V-trace's c with c_clip = inf, beside a cut; every builder
    turns a NaN coefficient into alpha NaN with beta 0, `cut_coefficient`): the composition
    with a cut is a constant map, and its NaN beta stands for that 0 wherever a map is applied
    (`apply_map`) or its product taken (NaN again). No instruction beyond the plain product."""
    return apply_map(a2, b2, a1), b1 * b2


@triton.jit
def combine_with_exclusive(a1, b1, ea1, eb1, a2, b2, ea2, eb2):
    """`combine`, plus (ea, eb): the composition of all elements but the last one in scan order."""
    return apply_map(a2, b2, a1), b1 * b2, apply_map(ea2, eb2, a1), b1 * eb2


@triton.jit
def nan_beta(alpha, beta):
    """A step's map whose beta may be NaN: there alpha NaN and beta 0, as A[t] = alpha + beta *
    A[t+1] is NaN, so that no beta is NaN (a NaN beta stands for 0 in a composed map,
    `combine`)."""
    nan = beta != beta
    return tl.where(nan, float("nan"), alpha), tl.where(nan, 0.0, beta)


@triton.jit
def cut_coefficient(alpha, c, cut):
    """A step's map with beta = c where the trace goes on and 0 at a cut (a select), for a
    coefficient c that may be NaN (0 * inf in its product, a NaN ratio or discount): there
    `nan_beta`'s alpha NaN and beta 0, written on c and cut (`nan_beta` of the select made
    ptxas issue V-trace's loads in two rounds instead of one: docs/dev/ab-history.md)."""
    bad = (c != c) & ~cut
    return tl.where(bad, float("nan"), alpha), tl.where(cut | bad, 0.0, c)


@triton.jit
def offsets(t, b1, b2, st, s1, s2):
    return t * st + b1 * s1 + b2 * s2


@triton.jit
def multiples(strides, VEC: tl.constexpr):
    """The tuple `strides`, each rounded down to a multiple of VEC (no-ops on multiples)."""
    out = ()
    for i in tl.static_range(len(strides)):
        out = out + (strides[i] // VEC * VEC,)
    return out


@triton.jit
def load_value(ptr, off, mask):
    return tl.load(ptr + off, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def load_flag(ptr, off, mask):
    return tl.load(ptr + off, mask=mask, other=0) != 0


class Rows(NamedTuple):
    """What every tile of a program's rows shares (`scan_kernel` builds it once): the input
    slots (pointers; time / batch-1 / batch-2 / action strides), the output slots, the rows'
    indices (b1, b2) and mask, the window end T, the action count and the op's scalars (per-row
    vectors with ROW_PARAMS, semantics §6). With `OPTS` (the constant tuple (HAS_TRUNC, HAS_NEXT,
    HAS_LAST, VARIANT, BLOCK_A, ACT_BLOCKS, ACT_VEC), then ROW_PARAMS for `row_discount_nan`)
    it is all a `Step` is built from."""
    ins: tuple
    st: tuple
    s1: tuple
    s2: tuple
    sa: tuple
    outs: tuple
    ost: tuple
    os1: tuple
    os2: tuple
    b1: object
    b2: object
    mask: object
    T: object
    n_act: object
    params: tuple


class Step(NamedTuple):
    """The one argument of an op's coefficient builder (`COEF(step, after)`), output writer
    (`STORE(step, res, res_prev, aux)`), boot (`BOOT(step)`) and finisher
    (`FINISH(step, pieces, beta, wn)`): the steps they work on, with everything the kernel knows
    of them. Read through `load_step`, `load_at`, `cut_flags`, `successor`, `row_value`,
    `store_out` and the like.

    `t` and `mask`: the steps of a (sub-)tile and where they are inside the window and the rows
    (None and the rows' mask for `BOOT` and `FINISH`, which work per row; for `BOOT` the rows
    that read the bootstraps). `end_rows`: the rows whose step T-1 (the bootstrap step) is in
    the tile (builders only, else None). `T`: the window end; for packed rows (semantics §7) an
    unmasked reverse builder sees each step's segment end as T, and its bootstrap slots read at
    that segment. The rest as in `Rows`. The compile-time flags: truncation flags given
    (HAS_TRUNC), next_values (HAS_NEXT), last_value (HAS_LAST), the op's variant bits (VARIANT),
    and Retrace's action axis: actions per block, blocks and vector width (BLOCK_A, ACT_BLOCKS,
    ACT_VEC).

    A Triton tuple with field names, which Triton 3.6 and 3.9 both pass to jit functions with
    its constants still constants. Both turn them into runtime values where such a tuple is
    assigned to a name, and Triton 3.6 where it is returned: a Step is only ever built in the
    call that passes it (`coefficients`, `write`, `boot_carries`, `finish`) and passed on by
    name. (`tl.core._aggregate` classes, which keep them, differ between the two versions and
    fail in the interpreter.)"""
    ins: tuple
    st: tuple
    s1: tuple
    s2: tuple
    sa: tuple
    outs: tuple
    ost: tuple
    os1: tuple
    os2: tuple
    t: object
    b1: object
    b2: object
    mask: object
    end_rows: object
    T: object
    n_act: object
    params: tuple
    HAS_TRUNC: tl.constexpr
    HAS_NEXT: tl.constexpr
    HAS_LAST: tl.constexpr
    VARIANT: tl.constexpr
    BLOCK_A: tl.constexpr
    ACT_BLOCKS: tl.constexpr
    ACT_VEC: tl.constexpr


@triton.jit
def slot_offsets(step, SLOT: tl.constexpr, t):
    """The offsets of input slot SLOT at steps t of the step's rows."""
    return offsets(t, step.b1, step.b2, step.st[SLOT], step.s1[SLOT], step.s2[SLOT])


@triton.jit
def load_at(step, SLOT: tl.constexpr, t, mask):
    """Input slot SLOT at steps t (float32), 0 outside `mask`."""
    return load_value(step.ins[SLOT], slot_offsets(step, SLOT, t), mask)


@triton.jit
def load_step(step, SLOT: tl.constexpr):
    """Input slot SLOT at the step's steps (float32)."""
    return load_at(step, SLOT, step.t, step.mask)


@triton.jit
def load_flag_at(step, SLOT: tl.constexpr, t, mask):
    return load_flag(step.ins[SLOT], slot_offsets(step, SLOT, t), mask)


@triton.jit
def load_step_flag(step, SLOT: tl.constexpr):
    return load_flag_at(step, SLOT, step.t, step.mask)


@triton.jit
def cut_flags_at(step, TERM: tl.constexpr, TRUNC: tl.constexpr, t, mask):
    """(terminated[t], cut[t]) with cut = terminated or truncated or t == T-1."""
    term = load_flag_at(step, TERM, t, mask)
    cut = term | (t == step.T - 1)
    if step.HAS_TRUNC:
        cut = cut | load_flag_at(step, TRUNC, t, mask)
    return term, cut


@triton.jit
def cut_flags(step, TERM: tl.constexpr, TRUNC: tl.constexpr):
    """`cut_flags_at` the step's steps."""
    return cut_flags_at(step, TERM, TRUNC, step.t, step.mask)


@triton.jit
def successor(step, V: tl.constexpr, NV: tl.constexpr, LV: tl.constexpr, v,
              HAS_VALUES: tl.constexpr, NEED_SLOT_NEXT: tl.constexpr, v_after):
    """(v'[t], values[t+1]): the successor value, and the value in slot t+1 (0 past the end).

    v'[t] is next_values[t] when given, else values[t+1], and last_value at t = T-1 (zero when
    neither is given: discounted returns only). The second result is loaded only when asked for.
    `v` is values[t] on the tile when the caller has it (batch-major tiles shift it), else None;
    `v_after` is values[t+1] when the caller has it (time-major sub-tiles), else None.
    """
    t = step.t
    T = step.T
    mask = step.mask
    inside = mask & (t + 1 < T)
    slot_next = tl.zeros(mask.shape, tl.float32)
    if HAS_VALUES:
        if NEED_SLOT_NEXT or not step.HAS_NEXT:
            if t.shape[0] == 1 and t.shape[1] >= 8:  # batch-major: time is the tile's last axis
                if v is None:
                    v = load_step(step, V)
                slot_next = step_after(v, step, V)
            elif v_after is not None:
                slot_next = v_after
            else:
                slot_next = load_at(step, V, t + 1, inside)
    if step.HAS_NEXT:
        v_succ = load_step(step, NV)
    else:
        v_succ = slot_next
        if step.HAS_LAST:
            # Bootstrap tensors have a zero time stride: read one row, in the tile holding T-1.
            last = load_value(step.ins[LV], slot_offsets(step, LV, 0), step.end_rows)
            v_succ = tl.where(t == T - 1, last, v_succ)
    return v_succ, slot_next


@triton.jit
def last_of_8(x, ROWS: tl.constexpr, G: tl.constexpr):
    """[ROWS, G]: the last of each group of 8 steps of a [ROWS, 8 * G] tile."""
    _, x = tl.split(tl.reshape(x, (ROWS, G, 4, 2)))
    _, x = tl.split(tl.reshape(x, (ROWS, G, 2, 2)))
    _, x = tl.split(tl.reshape(x, (ROWS, G, 1, 2)))
    return tl.reshape(x, (ROWS, G))


@triton.jit
def step_after(v, step, V: tl.constexpr):
    """values[t+1] on a batch-major tile (time along its last axis), from `v` = values[t]: moved
    by one step within groups of 8 steps (split and join, which stay in registers where a
    thread holds 8 consecutive steps), plus one load per group for the step after it; 0 past
    the end. Loading values[t+1] directly is 8 unaligned scalar loads per thread, 10% slower
    (docs/dev/kernel-decisions.md#the-next-steps-value-from-registers). T: the window end, or one
    per step (packed rows)."""
    t = step.t
    T = step.T
    BB: tl.constexpr = v.shape[0]
    BT: tl.constexpr = v.shape[1]
    G: tl.constexpr = BT // 8
    t_after = last_of_8(t, 1, G) + 1
    ends = last_of_8(T, 1, G) if len(T.shape) == 2 else T
    after = load_at(step, V, t_after, last_of_8(step.mask, BB, G) & (t_after < ends))
    e1, o1 = tl.split(tl.reshape(v, (BB, G, 4, 2)))  # steps 0 2 4 6 | 1 3 5 7 of each group
    e2, o2 = tl.split(tl.reshape(e1, (BB, G, 2, 2)))  # 0 4 | 2 6
    _, o3 = tl.split(tl.reshape(e2, (BB, G, 1, 2)))  # 4
    n1 = tl.reshape(tl.join(o3, after[:, :, None]), (BB, G, 2))  # 4 8: e2 one step on
    n2 = tl.reshape(tl.join(o2, n1), (BB, G, 4))  # 2 4 6 8: e1 one step on
    return tl.reshape(tl.join(o1, n2), (BB, BT))  # 1 2 ... 8


@triton.jit
def first_of_8(x, ROWS: tl.constexpr, G: tl.constexpr):
    """[ROWS, G]: the first of each group of 8 steps of a [ROWS, 8 * G] tile."""
    x, _ = tl.split(tl.reshape(x, (ROWS, G, 4, 2)))
    x, _ = tl.split(tl.reshape(x, (ROWS, G, 2, 2)))
    x, _ = tl.split(tl.reshape(x, (ROWS, G, 1, 2)))
    return tl.reshape(x, (ROWS, G))


@triton.jit
def shift_in(x, first):
    """A batch-major [BB, 8 * G] tile one step later within its groups of 8: per group
    [first, x0, ..., x6], `first` [BB, G] the value of the step before each group (split and
    join: in registers where a thread holds a group, as `step_after`)."""
    BB: tl.constexpr = x.shape[0]
    BT: tl.constexpr = x.shape[1]
    G: tl.constexpr = BT // 8
    e1, o1 = tl.split(tl.reshape(x, (BB, G, 4, 2)))  # steps 0 2 4 6 | 1 3 5 7
    e2, o2 = tl.split(tl.reshape(o1, (BB, G, 2, 2)))  # 1 5 | 3 7
    e3, _ = tl.split(tl.reshape(o2, (BB, G, 1, 2)))  # 3
    n1 = tl.reshape(tl.join(first[:, :, None], e3), (BB, G, 2))  # before 3
    n2 = tl.reshape(tl.join(n1, e2), (BB, G, 4))  # before 1 3 5
    return tl.reshape(tl.join(n2, e1), (BB, BT))  # before 0 1 ... 6


@triton.jit
def flags_before(step, TERM: tl.constexpr, TRUNC: tl.constexpr, term, cut):
    """(terminated[t-1], cut[t-1]), False at t = 0, from (term, cut) at t: on batch-major
    tiles moved by one step in registers plus one load per group of 8 (a load at t - 1 is 8
    unaligned scalar loads per thread and flag), else loaded at t - 1."""
    t = step.t
    mask = step.mask
    if t.shape[0] == 1 and t.shape[1] >= 8:  # batch-major (constexpr, inline for Triton 3.6)
        BB: tl.constexpr = mask.shape[0]
        G: tl.constexpr = mask.shape[1] // 8
        tb = first_of_8(t, 1, G) - 1
        term_g, cut_g = cut_flags_at(step, TERM, TRUNC, tb, first_of_8(mask, BB, G) & (tb >= 0))
        term_b = shift_in(term.to(tl.int8), term_g.to(tl.int8)) != 0
        cut_b = shift_in(cut.to(tl.int8), cut_g.to(tl.int8)) != 0
    else:
        term_b, cut_b = cut_flags_at(step, TERM, TRUNC, t - 1, mask & (t >= 1))
    return term_b, cut_b


@triton.jit
def value_before(step, SLOT: tl.constexpr, x):
    """Input slot SLOT at steps t - 1 (0 at t = 0), from x = its values at t: as
    `flags_before`."""
    t = step.t
    mask = step.mask
    if t.shape[0] == 1 and t.shape[1] >= 8:  # batch-major (constexpr, inline for Triton 3.6)
        BB: tl.constexpr = mask.shape[0]
        G: tl.constexpr = mask.shape[1] // 8
        tb = first_of_8(t, 1, G) - 1
        return shift_in(x, load_at(step, SLOT, tb, first_of_8(mask, BB, G) & (tb >= 0)))
    else:
        return load_at(step, SLOT, t - 1, mask & (t >= 1))


@triton.jit
def spread(x, AXIS: tl.constexpr):
    """A vector laid along axis AXIS of a 2-D tile."""
    if AXIS == 0:
        return x[:, None]
    else:
        return x[None, :]


@triton.jit
def edge(x, TIME_AXIS: tl.constexpr, BLOCK_T: tl.constexpr, AT: tl.constexpr):
    """The slice at tile position AT along the time axis (kept 2-D)."""
    pos = spread(tl.arange(0, BLOCK_T), TIME_AXIS)
    return tl.sum(tl.where(pos == AT, x, 0.0), axis=TIME_AXIS, keep_dims=True)


@triton.jit
def flip8(x):
    """Each group of 8 consecutive positions of a batch-major [BB, 8 * G] tile in reverse order
    (in registers where a thread holds the group)."""
    BB: tl.constexpr = x.shape[0]
    G: tl.constexpr = x.shape[1] // 8
    return tl.reshape(tl.flip(tl.reshape(x, (BB, G, 8)), 2), (BB, 8 * G))


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
def launch_tag(own_word):
    """This launch's tag base, from the word this tile wrote in the previous launch (tagged there
    with that launch's base + 1 or + 2; 0 in fresh scratch): that base + 2, in 30 bits. Every tile
    gets the same base, since every tile writes its first word in every launch."""
    return ((word_tag(own_word) + 1) // 2 * 2) & ((1 << 30) - 1)


@triton.jit
def look_back(words_a, words_b, pid_b, order, n_row_tiles, r, live, tag, carry_in,
              TIME_AXIS: tl.constexpr, WINDOW: tl.constexpr, DEPTH: tl.constexpr,
              BLOCK_B: tl.constexpr):
    """The carry into a tile at position `order` > 0 along its rows' time axis (scan order).

    Reads the words of the tiles at positions order-1, order-2, ... (DEPTH per pass, in the
    last DEPTH places of a WINDOW laid along the tile's time axis, oldest first; the other
    places are identity maps and read nothing), each an aggregate map (tag + 1) or an outgoing
    value (tag + 2, a constant map), and composes them until every live row's map is constant.
    Position -1 is the initial carry. `r`, `live` and `carry_in` are laid along the row axis.
    The loop also ends once it has read the initial carry: a map holding NaN (a NaN ratio) never
    becomes constant (NaN * 0 is NaN), and its composition is NaN whatever comes before.

    The window's size is `tiles.window`'s: exactly one warp's worth of words (every warp runs
    this loop on its own, nothing crosses warps inside it), or one word per thread (no word is
    held by two threads). Other sizes replicate words across threads, each replica read at its own
    moment, and threads that saw different words leave this loop at different passes (the GPU
    tests of long rows caught wrong results that way). A window of one word per thread reads
    only its nearest word per pass (`tiles.depth`): reading all its words cost more, and the
    nearest one almost always decides (docs/dev/kernel-decisions.md#one-word-per-pass).
    """
    acc_a = tl.zeros(carry_in.shape, tl.float32)
    acc_b = tl.full(carry_in.shape, 1.0, tl.float32)
    hi = order - 1
    w = spread(tl.arange(0, WINDOW), TIME_AXIS)
    near = w >= WINDOW - DEPTH
    busy = order > 0
    while busy:
        j = hi - (WINDOW - 1) + w  # oldest first
        start = (j == -1) & near  # the initial carry's place
        real = (j >= 0) & live & near
        slot = (j * n_row_tiles + pid_b) * BLOCK_B + r
        ta = tl.load(words_a + slot, mask=real, other=0, volatile=True)
        constant = word_tag(ta) == tag + 2
        need_b = real & (word_tag(ta) == tag + 1)
        tb = tl.load(words_b + slot, mask=need_b, other=0, volatile=True)
        # every word of the window must carry this launch's tag, else read it again
        ready = tl.where(real, constant | (word_tag(tb) == tag + 1), 1)
        if tl.min(ready.to(tl.int32)) != 0:
            ma = tl.where(real, word_value(ta), tl.where(start, carry_in, 0.0))
            mb = tl.where(real, tl.where(constant, 0.0, word_value(tb)), tl.where(start, 0.0, 1.0))
            ca, cb = tl.associative_scan((ma, mb), TIME_AXIS, combine)
            # the tiles read so far (acc) come after this window in scan order
            acc_a, acc_b = combine(edge(ca, TIME_AXIS, WINDOW, WINDOW - 1),
                                   edge(cb, TIME_AXIS, WINDOW, WINDOW - 1), acc_a, acc_b)
            hi -= DEPTH
            varies = tl.where(live, tl.abs(acc_b) > 0, False)  # (a NaN beta: 0, `combine`)
            busy = (tl.max(varies.to(tl.int32)) != 0) & (hi >= -1)
    return acc_a


# ---- the op's functions (COEF, STORE, BOOT, FINISH) are called here only, each with one `Step`
# built in the call (`Step`: Triton 3.6 keeps its constants so) ----------------------------------

@triton.jit
def coefficients(COEF: tl.constexpr, rows, OPTS: tl.constexpr, ins, t, mask, end_rows, T, after):
    """COEF's (alpha, beta, aux) at steps t of `rows` (input slots `ins`, window end T)."""
    return COEF(Step(ins, rows.st, rows.s1, rows.s2, rows.sa, rows.outs, rows.ost, rows.os1,
                     rows.os2, t, rows.b1, rows.b2, mask, end_rows, T, rows.n_act, rows.params,
                     OPTS[0], OPTS[1], OPTS[2], OPTS[3], OPTS[4], OPTS[5], OPTS[6]), after)


@triton.jit
def write(STORE: tl.constexpr, rows, OPTS: tl.constexpr, t, mask, res, res_prev, aux):
    """STORE's outputs at steps t of `rows`."""
    STORE(Step(rows.ins, rows.st, rows.s1, rows.s2, rows.sa, rows.outs, rows.ost, rows.os1,
               rows.os2, t, rows.b1, rows.b2, mask, None, rows.T, rows.n_act, rows.params,
               OPTS[0], OPTS[1], OPTS[2], OPTS[3], OPTS[4], OPTS[5], OPTS[6]),
          res, res_prev, aux)


@triton.jit
def boot_carries(BOOT: tl.constexpr, rows, OPTS: tl.constexpr, ins, mask):
    """BOOT's initial carries (A, w) of `rows`, bootstraps read (from input slots `ins`) where
    `mask` is set."""
    return BOOT(Step(ins, rows.st, rows.s1, rows.s2, rows.sa, rows.outs, rows.ost, rows.os1,
                     rows.os2, None, rows.b1, rows.b2, mask, None, rows.T, rows.n_act,
                     rows.params, OPTS[0], OPTS[1], OPTS[2], OPTS[3], OPTS[4], OPTS[5],
                     OPTS[6]))


@triton.jit
def finish(FINISH: tl.constexpr, rows, OPTS: tl.constexpr, pieces, beta, wn):
    """FINISH's (alpha, beta) from the builder's pieces and the successor's w'."""
    return FINISH(Step(rows.ins, rows.st, rows.s1, rows.s2, rows.sa, rows.outs, rows.ost,
                       rows.os1, rows.os2, None, rows.b1, rows.b2, rows.mask, None, rows.T,
                       rows.n_act, rows.params, OPTS[0], OPTS[1], OPTS[2], OPTS[3], OPTS[4],
                       OPTS[5], OPTS[6]), pieces, beta, wn)


@triton.jit
def tile_steps(chunk, J: tl.constexpr, TIME_AXIS: tl.constexpr, INT64: tl.constexpr,
               BLOCK_T: tl.constexpr, FLIP: tl.constexpr, DESC: tl.constexpr, SUB: tl.constexpr):
    """The steps of sub-tile J of tile `chunk`, laid as `tile_coefficients` says."""
    j = tl.arange(0, BLOCK_T // SUB) * SUB + J
    if FLIP:
        j = (BLOCK_T // 8 - 1 - j // 8) * 8 + j % 8
    if DESC:
        j = BLOCK_T - 1 - j
    t = chunk * BLOCK_T + spread(j, TIME_AXIS)
    if INT64:
        t = t.to(tl.int64)
    return t


@triton.jit
def tile_coefficients(rows, OPTS: tl.constexpr, chunk, n_chunks, COEF: tl.constexpr,
                      TIME_AXIS: tl.constexpr, INT64: tl.constexpr, BLOCK_T: tl.constexpr,
                      FLIP: tl.constexpr, DESC: tl.constexpr, J: tl.constexpr, SUB: tl.constexpr,
                      EVEN: tl.constexpr, MASK: tl.constexpr, W_PHASE: tl.constexpr, after,
                      window):
    """The steps `t` of sub-tile J of tile `chunk` (along the time axis), their mask, and the
    estimator's coefficients there; padding steps are the identity map (they pass the carry
    through), and so are masked steps (input slot MASK >= 0: semantics §7), whose aux is then
    (the builder's aux, the decision steps); with `W_PHASE` alpha is the builder's
    (w, pieces), finished once the successors' w is known (`finish_chunk`). Sub-tile J holds
    the tile positions p = g * SUB + J, g < BLOCK_T // SUB (SUB = 1: the whole tile).
    Position p holds step p of the chunk; with `FLIP`, step (G - 1 - p // 8) * 8 + p % 8 of
    its G groups of 8; with `DESC`, step BLOCK_T - 1 - p.
    With `EVEN` every tile is full (T and B multiples of the tile) and the mask is a constant.
    The builder gets one `Step` (`coefficients`): these steps of `rows` (`Rows`, with the
    constants `OPTS`).
    `after`: the builder's aux at steps t + 1 (the op's builder, `rl_triton.ops`), or None.
    `window`: None, or for packed rows what the builder sees instead of the input slots, T and
    the rows whose window ends here (`segment_windows`)."""
    mask_b = rows.mask
    # the steps of `tile_steps`, inline: as a call, unpacked kernels compiled to other SASS
    j = tl.arange(0, BLOCK_T // SUB) * SUB + J
    if FLIP:
        j = (BLOCK_T // 8 - 1 - j // 8) * 8 + j % 8
    if DESC:
        j = BLOCK_T - 1 - j
    t = chunk * BLOCK_T + spread(j, TIME_AXIS)
    if INT64:
        t = t.to(tl.int64)
    if EVEN:  # no step past T: the constant mask_b (`scan_kernel`), broadcast over the steps
        mask = tl.full(t.shape, 1, tl.int1) & mask_b
    else:
        mask = (t < rows.T) & mask_b
    # the rows whose step T-1 (the bootstrap step) is in this tile
    end_rows = tl.where(chunk == n_chunks - 1, mask_b, False)
    if window is None:
        alpha, beta, aux = coefficients(COEF, rows, OPTS, rows.ins, t, mask, end_rows, rows.T,
                                        after)
    else:
        w_ins, w_T, w_ends, _ = window
        alpha, beta, aux = coefficients(COEF, rows, OPTS, w_ins, t, mask, mask & w_ends, w_T,
                                        after)
    # one return: Triton 3.6 checks every return's types, even under a constant condition
    if MASK >= 0:
        keep = load_flag(rows.ins[MASK],
                         offsets(t, rows.b1, rows.b2, rows.st[MASK], rows.s1[MASK],
                                 rows.s2[MASK]), mask)
        if W_PHASE:
            w, pieces = alpha
            alpha = (tl.where(keep, w, 0.0), pieces)
        else:
            alpha, beta = row_discount_nan(OPTS, alpha, beta)
            alpha = tl.where(keep, alpha, 0.0)
            beta = tl.where(keep, beta, 1.0)
        aux = (aux, keep)
    else:
        alpha, beta = row_discount_nan(OPTS, alpha, beta)
        alpha = tl.where(mask, alpha, 0.0)
        beta = tl.where(mask, beta, 1.0)
    return t, mask, alpha, beta, aux


@triton.jit
def row_discount_nan(OPTS: tl.constexpr, alpha, beta):
    """With per-row discounts (OPTS[7], ROW_PARAMS > 0: tensors, not range-checked) a builder's
    beta may be NaN (a NaN gamma, inf * 0): `nan_beta`, alpha NaN and beta 0 there
    (the builders give 0 at a cut, never NaN). Nothing without them: number discounts are
    checked, and the builders' own NaN coefficients go through `cut_coefficient`."""
    if OPTS[7] > 0:
        alpha, beta = nan_beta(alpha, beta)
    return alpha, beta


@triton.jit
def scan_tile(alpha, beta, REVERSE: tl.constexpr, EXCLUSIVE: tl.constexpr,
              TIME_AXIS: tl.constexpr, FLIP: tl.constexpr):
    """The tile's scan from a zero carry: A = a + bb * carry at every step, and (ea, eb), the
    same without each step's own element (for writers that need the step before in scan order).
    With `FLIP` (the groups of 8 of a reverse scan laid in decreasing order; REVERSE is False
    then), a forward scan of the tile with every group reversed."""
    if FLIP:
        alpha = flip8(alpha)
        beta = flip8(beta)
    if EXCLUSIVE:
        a, bb, ea, eb = tl.associative_scan(
            (alpha, beta, tl.zeros_like(alpha), tl.full(alpha.shape, 1.0, tl.float32)),
            TIME_AXIS, combine_with_exclusive, reverse=REVERSE)
        if FLIP:
            ea = flip8(ea)
            eb = flip8(eb)
    else:
        a, bb = tl.associative_scan((alpha, beta), TIME_AXIS, combine, reverse=REVERSE)
    if FLIP:
        a = flip8(a)
        bb = flip8(bb)
    if not EXCLUSIVE:
        ea, eb = a, bb
    return a, bb, ea, eb


@triton.jit
def scan_chunk(rows, OPTS: tl.constexpr, chunk, n_chunks, COEF: tl.constexpr,
               EXCLUSIVE: tl.constexpr, SCAN_REVERSE: tl.constexpr, TIME_AXIS: tl.constexpr,
               INT64: tl.constexpr, BLOCK_T: tl.constexpr, FLIP: tl.constexpr,
               DESC: tl.constexpr, SUB: tl.constexpr, EVEN: tl.constexpr, WHOLE: tl.constexpr,
               MASK: tl.constexpr, windows):
    """Tile `chunk` scanned from a zero carry, as SUB sub-tiles (`tile_coefficients`): tuples
    of their (t, mask, a, bb, ea, eb, aux) as `scan_tile` returns them, and the tile's whole
    composition (agg_a, agg_b).

    With SUB > 1 (time-major tiles) a thread holds SUB consecutive steps in scan order, one in
    each sub-tile, at the same places: the sub-tiles are composed in registers, and only their
    groups' compositions go through `tl.associative_scan` (exclusive: the map into each group),
    1 / SUB of the tile. Triton's scan of a whole time-major tile lays no two consecutive steps
    in one thread: every step of it crosses lanes, warps and repetitions of the layout."""
    if SUB == 1:
        t, mask, alpha, beta, aux = tile_coefficients(
            rows, OPTS, chunk, n_chunks, COEF, TIME_AXIS, INT64, BLOCK_T, FLIP, DESC, 0, 1,
            EVEN, MASK, False, None, None if windows is None else windows[0])
        a, bb, ea, eb = scan_tile(alpha, beta, SCAN_REVERSE, EXCLUSIVE, TIME_AXIS, FLIP)
        agg_a = edge(a, TIME_AXIS, BLOCK_T, WHOLE)
        agg_b = edge(bb, TIME_AXIS, BLOCK_T, WHOLE)
        return (t,), (mask,), (a,), (bb,), (ea,), (eb,), (aux,), agg_a, agg_b
    else:
        ts = ()
        masks = ()
        As = ()  # each position's composition within its group (in scan order)
        Bs = ()
        auxs = ()
        for J in tl.static_range(SUB):
            # steps in decreasing t: the sub-tile before holds the steps t + 1
            after = auxs[J - 1] if DESC and J > 0 else None
            t, mask, alpha, beta, aux = tile_coefficients(
                rows, OPTS, chunk, n_chunks, COEF, TIME_AXIS, INT64, BLOCK_T, FLIP, DESC, J,
                SUB, EVEN, MASK, False, after, None if windows is None else windows[J])
            if J > 0:
                alpha, beta = combine(As[J - 1], Bs[J - 1], alpha, beta)
            ts = ts + (t,)
            masks = masks + (mask,)
            As = As + (alpha,)
            Bs = Bs + (beta,)
            auxs = auxs + (aux,)
        a_s, bb_s, ea_s, eb_s, agg_a, agg_b = compose_groups(As, Bs, SUB, TIME_AXIS, BLOCK_T)
        return ts, masks, a_s, bb_s, ea_s, eb_s, auxs, agg_a, agg_b


@triton.jit
def compose_groups(As, Bs, SUB: tl.constexpr, TIME_AXIS: tl.constexpr, BLOCK_T: tl.constexpr):
    """A time-major tile's scan from a zero carry, from its sub-tiles composed in registers
    (As[J], Bs[J]: each group's first J + 1 steps in scan order): per sub-tile (a, bb) and the
    exclusive (ea, eb), and the tile's whole composition (`scan_chunk`)."""
    # the map into each group from the tile's carry: the groups before it, composed
    _, _, pa, pb = tl.associative_scan(
        (As[SUB - 1], Bs[SUB - 1], tl.zeros_like(As[SUB - 1]),
         tl.full(As[SUB - 1].shape, 1.0, tl.float32)),
        TIME_AXIS, combine_with_exclusive)
    a_s = ()
    bb_s = ()
    ea_s = ()
    eb_s = ()
    for J in tl.static_range(SUB):
        if J == 0:
            ea_s = ea_s + (pa,)
            eb_s = eb_s + (pb,)
        else:
            ea_s = ea_s + (a_s[J - 1],)
            eb_s = eb_s + (bb_s[J - 1],)
        a_J, bb_J = combine(pa, pb, As[J], Bs[J])
        a_s = a_s + (a_J,)
        bb_s = bb_s + (bb_J,)
    G: tl.constexpr = BLOCK_T // SUB
    agg_a = edge(a_s[SUB - 1], TIME_AXIS, G, G - 1)
    agg_b = edge(bb_s[SUB - 1], TIME_AXIS, G, G - 1)
    return a_s, bb_s, ea_s, eb_s, agg_a, agg_b


@triton.jit
def compose(alphas, betas, EXCLUSIVE: tl.constexpr, SCAN_REVERSE: tl.constexpr,
            TIME_AXIS: tl.constexpr, FLIP: tl.constexpr, BLOCK_T: tl.constexpr,
            SUB: tl.constexpr, WHOLE: tl.constexpr):
    """`scan_chunk`'s scan of a tile whose coefficients are given (per sub-tile)."""
    if SUB == 1:
        a, bb, ea, eb = scan_tile(alphas[0], betas[0], SCAN_REVERSE, EXCLUSIVE, TIME_AXIS, FLIP)
        return ((a,), (bb,), (ea,), (eb,), edge(a, TIME_AXIS, BLOCK_T, WHOLE),
                edge(bb, TIME_AXIS, BLOCK_T, WHOLE))
    else:
        As = ()
        Bs = ()
        for J in tl.static_range(SUB):
            alpha = alphas[J]
            beta = betas[J]
            if J > 0:
                alpha, beta = combine(As[J - 1], Bs[J - 1], alpha, beta)
            As = As + (alpha,)
            Bs = Bs + (beta,)
        return compose_groups(As, Bs, SUB, TIME_AXIS, BLOCK_T)


@triton.jit
def chunk_coefficients(rows, OPTS: tl.constexpr, chunk, n_chunks, COEF: tl.constexpr,
                       TIME_AXIS: tl.constexpr, INT64: tl.constexpr, BLOCK_T: tl.constexpr,
                       FLIP: tl.constexpr, DESC: tl.constexpr, SUB: tl.constexpr,
                       EVEN: tl.constexpr, MASK: tl.constexpr, W_PHASE: tl.constexpr, windows):
    """A tile's steps, masks, builder coefficients, betas and auxes, per sub-tile, not yet
    scanned (`tile_coefficients`; with W_PHASE, the masked builders' (w, pieces))."""
    ts = ()
    masks = ()
    alphas = ()
    betas = ()
    auxs = ()
    for J in tl.static_range(SUB):
        t, mask, alpha, beta, aux = tile_coefficients(
            rows, OPTS, chunk, n_chunks, COEF, TIME_AXIS, INT64, BLOCK_T, FLIP, DESC, J, SUB,
            EVEN, MASK, W_PHASE, None, None if windows is None else windows[J])
        ts = ts + (t,)
        masks = masks + (mask,)
        alphas = alphas + (alpha,)
        betas = betas + (beta,)
        auxs = auxs + (aux,)
    return ts, masks, alphas, betas, auxs


@triton.jit
def successors(alphas, auxs, SCAN_REVERSE: tl.constexpr, TIME_AXIS: tl.constexpr,
               FLIP: tl.constexpr, BLOCK_T: tl.constexpr, SUB: tl.constexpr,
               WHOLE: tl.constexpr, restarts):
    """The W scan of a masked tile (semantics §7): W[t] = w[t] at decision steps, W[t+1] (in scan
    order) at masked ones, as maps (w, 0) and (0, 1) of the same scan. Returns the exclusive
    maps (each step's successor W as a map of the carry) and the tile's composition.
    `restarts`: None, or per sub-tile (heads, A's and W's carries there) of packed rows
    (`segment_restarts`): W restarts from its carry at every segment's last step."""
    ws = ()
    ds = ()
    for J in tl.static_range(SUB):
        w, _ = alphas[J]
        _, keep = auxs[J]
        d = tl.where(keep, 0.0, 1.0)
        if restarts is not None:
            head, _, w_boot = restarts[J]
            w, d = restart(w, d, head, w_boot)
        ws = ws + (w,)
        ds = ds + (d,)
    _, _, ew_s, ewd_s, agg_w, agg_wd = compose(ws, ds, True, SCAN_REVERSE, TIME_AXIS, FLIP,
                                               BLOCK_T, SUB, WHOLE)
    if restarts is not None:  # a segment's last step: its successor's W is the carry
        ew_s, ewd_s = restart_exclusive(ew_s, ewd_s, restarts, 2, SUB)
    return ew_s, ewd_s, agg_w, agg_wd


@triton.jit
def finish_chunk(alphas, betas, auxs, ew_s, ewd_s, carry_w, rows, OPTS: tl.constexpr,
                 FINISH: tl.constexpr, SUB: tl.constexpr, restarts):
    """A masked tile's coefficients once the W carry into it is known: the builder's pieces
    finished with each step's successor W (`FINISH`), masked steps the identity; the auxes
    become (the builder's aux, the decision steps, the successor W). With `restarts` (packed
    rows), each segment's last step composed with A's carry past the segment."""
    out_a = ()
    out_b = ()
    out_x = ()
    for J in tl.static_range(SUB):
        _, pieces = alphas[J]
        aux, keep = auxs[J]
        wn = apply_map(ew_s[J], ewd_s[J], carry_w)
        alpha, beta = finish(FINISH, rows, OPTS, pieces, betas[J], wn)
        alpha, beta = row_discount_nan(OPTS, alpha, beta)
        alpha = tl.where(keep, alpha, 0.0)
        beta = tl.where(keep, beta, 1.0)
        if restarts is not None:
            head, a_boot, _ = restarts[J]
            alpha, beta = restart(alpha, beta, head, a_boot)
        out_a = out_a + (alpha,)
        out_b = out_b + (beta,)
        out_x = out_x + ((aux, keep, wn),)
    return out_a, out_b, out_x


# ---- packed rows (semantics §7, `cu_seqlens`): one long row whose segment ends are window ends ---
# A packed call scans its [L] stream as one row split over tiles as any long row. Each tile finds
# the segments of its first and last steps by a search over the offsets (S + 1 integers, read
# from L2 by every tile), each step its own segment by a binary search over the few segments
# between them (none in most tiles: segments longer than a tile). Unmasked reverse builders see
# each step's segment as a row of its own (its end as T, its bootstrap read there); masked and
# forward scans restart at each segment's head (its first step in scan order) from their boot
# carries there, the W scan too. No pass over the stream but the scan's own, nothing on the
# host. (A per-step segment word built by a kernel beforehand would cost a launch and 1-4 bytes
# per step read again; the search costs two L2 round trips per tile and no bytes per step.)

SEGMENT_PROBES = tl.constexpr(64)  # offsets read per round of `tile_segments`' search


@triton.jit
def tile_segments(cu, last, t0, t1):
    """The segments of steps t0 <= t1 of packed rows (offsets `cu`, ascending, segments 0 to
    `last`): for each, the largest i with cu[i] <= t, found for both at once in rounds of
    SEGMENT_PROBES reads (two rounds up to 4096 segments). Reads stay inside cu[0..last]
    whatever it holds."""
    which = tl.arange(0, 2)[:, None]
    t = tl.where(which == 0, t0, t1)
    lo = tl.zeros((2, 1), tl.int32)
    hi = lo + last
    k = tl.arange(0, SEGMENT_PROBES)[None, :] + 1
    while tl.max(hi - lo) > 0:
        step = tl.maximum((hi - lo + SEGMENT_PROBES - 1) // SEGMENT_PROBES, 1)
        probe = lo + step * k
        inside = probe <= hi
        below = inside & (tl.load(cu + probe, mask=inside, other=0) <= t)
        lo = lo + step * tl.sum(below.to(tl.int32), axis=1, keep_dims=True)
        hi = tl.minimum(hi, lo + step - 1)
    return tl.sum(tl.where(which == 0, lo, 0)), tl.sum(tl.where(which == 1, lo, 0))


@triton.jit
def step_segments(cu, t, first, last, REVERSE: tl.constexpr):
    """(seg, bound) for steps t of a tile whose first and last steps lie in segments
    first <= last: each step's segment and its end cu[seg + 1] (REVERSE) or its start cu[seg].
    In tiles that hold a segment boundary, a binary search per step over cu[first + 1..last]
    (one index per step: the largest i with cu[i] <= t, in steps of powers of two)."""
    seg = tl.zeros(t.shape, tl.int32) + first
    if REVERSE:
        bound = tl.zeros(t.shape, t.dtype) + tl.load(cu + last + 1).to(t.dtype)
    else:
        bound = tl.zeros(t.shape, t.dtype) + tl.load(cu + first).to(t.dtype)
    if last > first:
        d = last - first
        step = 1
        while step * 2 <= d:
            step = step * 2
        while step > 0:
            ahead = seg + step
            inside = ahead <= last
            seg = tl.where(inside & (tl.load(cu + ahead, mask=inside, other=0) <= t), ahead, seg)
            step = step // 2
        if REVERSE:
            bound = tl.where(seg < last, tl.load(cu + seg + 1, mask=seg < last,
                                                 other=0).to(t.dtype), bound)
        else:
            bound = tl.where(seg > first, tl.load(cu + seg, mask=seg > first,
                                                  other=0).to(t.dtype), bound)
    return seg, bound


@triton.jit
def segment_slots(ins, st, seg, SLOTS: tl.constexpr):
    """The input slots, those of bit i set in SLOTS (bootstraps, their time stride the segment
    stride) at each step's segment."""
    out = ()
    for i in tl.static_range(len(ins)):
        if (SLOTS >> i) & 1:
            out = out + (ins[i] + seg * st[i],)
        else:
            out = out + (ins[i],)
    return out


@triton.jit
def segment_windows(rows, cu, n_seg, chunk, TIME_AXIS: tl.constexpr, INT64: tl.constexpr,
                    BLOCK_T: tl.constexpr, FLIP: tl.constexpr, DESC: tl.constexpr,
                    SUB: tl.constexpr, REVERSE: tl.constexpr, SLOTS: tl.constexpr,
                    RESTART: tl.constexpr):
    """Per sub-tile of tile `chunk` of packed rows: (the input slots, T and the heads its
    builders see (`tile_coefficients`), each step's segment). The heads are where the scan
    restarts: each segment's last step (reverse scans) or first step (forward scans).
    Unmasked reverse builders see each step's segment end as T (so that `t == T - 1` is its
    window end) and read the bootstraps (SLOTS) at its segment; with `RESTART` the builders see
    the plain row, and the scan restarts at the heads from the boot carries
    (`segment_restarts`)."""
    ins = rows.ins
    T = rows.T
    t0 = chunk * BLOCK_T
    first, last = tile_segments(cu, n_seg - 1, t0, tl.minimum(t0 + BLOCK_T, T) - 1)
    windows = ()
    for J in tl.static_range(SUB):
        t = tile_steps(chunk, J, TIME_AXIS, INT64, BLOCK_T, FLIP, DESC, SUB)
        seg, bound = step_segments(cu, t, first, last, REVERSE)
        if INT64:
            seg = seg.to(tl.int64)
        if REVERSE:
            bound = tl.minimum(bound, T)  # no read past the stream, whatever cu holds
            head = t == bound - 1
        else:
            head = t == bound
        if RESTART:
            windows = windows + ((ins, T, head, seg),)
        else:
            windows = windows + ((segment_slots(ins, rows.st, seg, SLOTS), bound, head, seg),)
    return windows


@triton.jit
def segment_restarts(windows, rows, OPTS: tl.constexpr, BOOT: tl.constexpr, SUB: tl.constexpr,
                     SLOTS: tl.constexpr):
    """Per sub-tile of packed rows: (its heads, the scan's carry there and the W scan's): the
    carries past each head's segment, `BOOT` read at the segment."""
    out = ()
    for J in tl.static_range(SUB):
        ins, _, head, seg = windows[J]
        a, w = boot_carries(BOOT, rows, OPTS, segment_slots(ins, rows.st, seg, SLOTS),
                            rows.mask & head)
        out = out + ((head, a, w),)
    return out


@triton.jit
def restart(a, b, head, carry):
    """A step's map (a, b), at the heads composed with the carry the scan restarts from:
    (a + b * carry, 0), a constant map."""
    return tl.where(head, apply_map(a, b, carry), a), tl.where(head, 0.0, b)


@triton.jit
def restart_chunk(alphas, betas, restarts, SUB: tl.constexpr):
    """A tile's maps (per sub-tile) restarted at their heads with the scan's carry."""
    out_a = ()
    out_b = ()
    for J in tl.static_range(SUB):
        head, a_boot, _ = restarts[J]
        a, b = restart(alphas[J], betas[J], head, a_boot)
        out_a = out_a + (a,)
        out_b = out_b + (b,)
    return out_a, out_b


@triton.jit
def restart_exclusive(ea_s, eb_s, restarts, WHICH: tl.constexpr, SUB: tl.constexpr):
    """Exclusive maps (the carry into each step), at the heads the constant carry
    restarts[J][WHICH] (1: the scan's, 2: the W scan's)."""
    out_a = ()
    out_b = ()
    for J in tl.static_range(SUB):
        head = restarts[J][0]
        out_a = out_a + (tl.where(head, restarts[J][WHICH], ea_s[J]),)
        out_b = out_b + (tl.where(head, 0.0, eb_s[J]),)
    return out_a, out_b


@triton.jit
def packed_forward_chunk(rows, OPTS: tl.constexpr, cu, n_seg, chunk, n_chunks,
                         COEF: tl.constexpr, BOOT: tl.constexpr, EXCLUSIVE: tl.constexpr,
                         SCAN_REVERSE: tl.constexpr, REVERSE: tl.constexpr,
                         TIME_AXIS: tl.constexpr, INT64: tl.constexpr, BLOCK_T: tl.constexpr,
                         FLIP: tl.constexpr, DESC: tl.constexpr, SUB: tl.constexpr,
                         EVEN: tl.constexpr, WHOLE: tl.constexpr, MASK: tl.constexpr,
                         BOOT_SLOTS: tl.constexpr):
    """`scan_chunk` for packed forward scans: the tile's maps restarted at its segments'
    starts from `BOOT`'s carries, then composed."""
    ts, masks, als, bes, auxs = chunk_coefficients(
        rows, OPTS, chunk, n_chunks, COEF, TIME_AXIS, INT64, BLOCK_T, FLIP, DESC, SUB, EVEN,
        MASK, False, None)
    # found after the coefficients' loads are issued: they overlap
    restarts = segment_restarts(
        segment_windows(rows, cu, n_seg, chunk, TIME_AXIS, INT64, BLOCK_T, FLIP, DESC, SUB,
                        REVERSE, BOOT_SLOTS, True),
        rows, OPTS, BOOT, SUB, BOOT_SLOTS)
    als, bes = restart_chunk(als, bes, restarts, SUB)
    a_s, bb_s, ea_s, eb_s, agg_a, agg_b = compose(
        als, bes, EXCLUSIVE, SCAN_REVERSE, TIME_AXIS, FLIP, BLOCK_T, SUB, WHOLE)
    if EXCLUSIVE:
        ea_s, eb_s = restart_exclusive(ea_s, eb_s, restarts, 1, SUB)
    return ts, masks, a_s, bb_s, ea_s, eb_s, auxs, agg_a, agg_b


@triton.jit
def store_chunk(rows, OPTS: tl.constexpr, ts, masks, a_s, bb_s, ea_s, eb_s, auxs, carry,
                STORE: tl.constexpr, SUB: tl.constexpr):
    """The outputs of a tile scanned by `scan_chunk`, whose carry is now known: the writer
    gets each sub-tile's `Step` (`write`), whose inputs it may read too (those of the plain
    rows, whose T is the window end)."""
    for J in tl.static_range(SUB):
        res = apply_map(a_s[J], bb_s[J], carry)
        res_prev = apply_map(ea_s[J], eb_s[J], carry)
        write(STORE, rows, OPTS, ts[J], masks[J], res, res_prev, auxs[J])


# n_row_tiles is never specialized: as the stride between a look-back window's words it must not
# look contiguous to the compiler, or the window's loads are vectorized (see `tiles.window`).
@triton.jit(do_not_specialize=["n_row_tiles"])
def scan_kernel(
    ins, st, s1, s2, sa,  # input slots: pointers, time / batch-1 / batch-2 / action strides
    outs, ost, os1, os2,  # outputs likewise
    init, init_s1, init_s2,  # the initial carry A[T] (reverse) or A[-1] (forward)
    state,  # int64 look-back scratch: [words_a..., words_b...], one of each per tile row
    scalars,  # the estimator's float scalars (gamma, lambda, clips): runtime values
    row_ptr, row_sk, row_s1, row_s2,  # per-row values of the first ROW_PARAMS scalars
    T, B, B2, n_act, n_row_tiles, n_chunks,
    cu, n_seg,  # packed rows: the segments' offsets and count (None otherwise)
    COEF: tl.constexpr, STORE: tl.constexpr, REVERSE: tl.constexpr, EXCLUSIVE: tl.constexpr,
    HAS_TRUNC: tl.constexpr, HAS_NEXT: tl.constexpr, HAS_LAST: tl.constexpr,
    HAS_INIT: tl.constexpr, VARIANT: tl.constexpr, LOOKBACK: tl.constexpr, WALK: tl.constexpr,
    WINDOW: tl.constexpr, DEPTH: tl.constexpr, TIME_AXIS: tl.constexpr, INT64: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_A: tl.constexpr,
    ACT_BLOCKS: tl.constexpr, ACT_VEC: tl.constexpr, SUB: tl.constexpr, ROW_VEC: tl.constexpr,
    EVEN: tl.constexpr, ROW_PARAMS: tl.constexpr, MASK: tl.constexpr, W_PHASE: tl.constexpr,
    BOOT: tl.constexpr, FINISH: tl.constexpr, SEGMENTS: tl.constexpr, BOOT_SLOTS: tl.constexpr,
):
    """One program per tile of `BLOCK_B` rows x `BLOCK_T` steps (`n_chunks` tiles along time),
    scanned once and kept in registers; with `LOOKBACK`, the tiles of a row run in parallel and
    find their carries by look-back. With `WALK`, one program per `BLOCK_B` rows instead, which
    walks their `n_chunks` tiles in scan order, passing the carry from tile to tile: when there
    are row tiles enough to fill the GPU, this beats the look-back.

    With a mask (input slot MASK >= 0, semantics §7) masked steps are identity maps. A reverse
    estimator's successor is then the next decision step, however far: with `W_PHASE` a second
    scan (`successors`) carries the successor's own value w across masked steps, with a carry
    and look-back of its own, before the main scan; `BOOT` gives both initial carries and
    `FINISH` the coefficients from each step's successor w.

    The op's functions (COEF, STORE, BOOT, FINISH) each get one `Step`, built from the rows'
    `Rows` and the constants `OPTS` where they are called (`coefficients`, `write`,
    `boot_carries`, `finish`).

    With `SEGMENTS` (packed rows, semantics §7) the one row of T steps holds n_seg segments (offsets
    `cu`), each a row of its own (`segment_windows`): the bootstrap slots (bits of BOOT_SLOTS)
    are read at each step's segment, and with `BOOT` the scan (and the W scan) restarts at every
    segment's head from BOOT's carries there (`segment_restarts`)."""
    # Reverse scans run forward over steps laid in decreasing t (module docstring). Retrace's
    # 3-D tiles too: they load along the action axis, whatever the order of their steps.
    FLIP: tl.constexpr = REVERSE and TIME_AXIS == 1 and BLOCK_T >= 8
    DESC: tl.constexpr = REVERSE and TIME_AXIS == 0
    SCAN_REVERSE: tl.constexpr = REVERSE and not FLIP and not DESC
    # The tile position whose scanned value is the whole tile's composition: that of the tile's
    # last step in scan order (a reverse scan's first step: at the end of a DESC tile, at the
    # start of a FLIP tile's last group). Constant expressions here: Triton 3.6's helpers return
    # runtime values.
    if FLIP:
        WHOLE: tl.constexpr = BLOCK_T - 8
    elif SCAN_REVERSE:
        WHOLE: tl.constexpr = 0
    else:
        WHOLE: tl.constexpr = BLOCK_T - 1
    if ROW_VEC > 1:
        # every time stride and the row count are multiples of ROW_VEC (`launch.row_vector`):
        # no-ops on the values that let the compiler see it, so that time-major rows load
        # ROW_VEC values at a time
        st = multiples(st, ROW_VEC)
        ost = multiples(ost, ROW_VEC)
        B = B // ROW_VEC * ROW_VEC
    # what every `Step` holds besides its rows and steps (compile-time constants), and
    # ROW_PARAMS (`row_discount_nan`)
    OPTS: tl.constexpr = (HAS_TRUNC, HAS_NEXT, HAS_LAST, VARIANT, BLOCK_A, ACT_BLOCKS, ACT_VEC,
                          ROW_PARAMS)
    k = tl.program_id(0)
    order = k // n_row_tiles  # tiles before this one in scan order, along its rows
    pid_b = k % n_row_tiles
    if LOOKBACK:
        words_a = state
        words_b = state + n_row_tiles * n_chunks * BLOCK_B
        tag = launch_tag(tl.load(words_a + k * BLOCK_B, volatile=True))  # +1: a map, +2: a value
        if W_PHASE:  # the W scan's words, after the main scan's
            words_wa = state + 2 * n_row_tiles * n_chunks * BLOCK_B
            words_wb = state + 3 * n_row_tiles * n_chunks * BLOCK_B
    # The tile is [BLOCK_T, BLOCK_B] (TIME_AXIS 0) or [BLOCK_B, BLOCK_T] (TIME_AXIS 1): its last
    # axis follows the contiguous axis of memory, as Triton's default layouts expect.
    if TIME_AXIS == 0:
        # Rows numbered so that the compiler infers runs of at most 4 contiguous rows (a hint
        # would override what it infers, wrong for strided rows). Every load of the tile is then
        # at most 4 wide, and all share one layout; else the 1-byte flags' 16-wide loads set the
        # layout of every input, one step per thread and 16 steps of the scan across lanes
        # (docs/dev/kernel-decisions.md#time-major-rows-in-runs-of-4).
        rows = tl.arange(0, BLOCK_B)
        r = spread(rows // 4 * 4 + rows % 4, 1)
    else:
        r = spread(tl.arange(0, BLOCK_B), 0)
    b = pid_b * BLOCK_B + r
    if EVEN:
        # T and B are multiples of the tile: no mask to compute, no predicate on any load or
        # store, no select of padding (fewer registers: time-major GAE 64 -> 56 at 16384x1024,
        # V-trace 110 -> 96; docs/dev/kernel-decisions.md#full-tiles-drop-their-masks)
        mask_b = tl.full(r.shape, 1, tl.int1)
    else:
        mask_b = b < B
    if INT64:
        b = b.to(tl.int64)
    b1 = b // B2
    b2 = b % B2
    if ROW_PARAMS > 0:
        # per-row gamma / lambda (semantics §6): vectors along the tile's rows, which broadcast over
        # its steps wherever the builders use the scalars
        scalars = row_scalars(row_ptr, row_sk, row_s1, row_s2, b1, b2, mask_b, scalars,
                              ROW_PARAMS)
    rows = Rows(ins, st, s1, s2, sa, outs, ost, os1, os2, b1, b2, mask_b, T, n_act, scalars)
    carry = tl.zeros(r.shape, tl.float32)
    if WALK:
        if HAS_INIT:
            carry = load_value(init, b1 * init_s1 + b2 * init_s2, mask_b)
        if W_PHASE:
            carry, carry_w = boot_carries(BOOT, rows, OPTS, ins, mask_b)
        for i in range(n_chunks):
            chunk = n_chunks - 1 - i if REVERSE else i
            windows = None
            if SEGMENTS and BOOT is None:  # the builders see each step's segment
                windows = segment_windows(rows, cu, n_seg, chunk, TIME_AXIS, INT64, BLOCK_T,
                                          FLIP, DESC, SUB, REVERSE, BOOT_SLOTS, False)
            if W_PHASE:
                ts, masks, als, bes, auxs = chunk_coefficients(
                    rows, OPTS, chunk, n_chunks, COEF, TIME_AXIS, INT64, BLOCK_T, FLIP, DESC,
                    SUB, EVEN, MASK, True, windows)
                restarts = None
                if SEGMENTS:  # found after the coefficients' loads are issued: they overlap
                    restarts = segment_restarts(
                        segment_windows(rows, cu, n_seg, chunk, TIME_AXIS, INT64, BLOCK_T,
                                        FLIP, DESC, SUB, REVERSE, BOOT_SLOTS, True),
                        rows, OPTS, BOOT, SUB, BOOT_SLOTS)
                ew_s, ewd_s, agg_w, agg_wd = successors(als, auxs, SCAN_REVERSE, TIME_AXIS, FLIP,
                                                        BLOCK_T, SUB, WHOLE, restarts)
                als, bes, auxs = finish_chunk(als, bes, auxs, ew_s, ewd_s, carry_w, rows, OPTS,
                                              FINISH, SUB, restarts)
                a_s, bb_s, ea_s, eb_s, agg_a, agg_b = compose(
                    als, bes, EXCLUSIVE, SCAN_REVERSE, TIME_AXIS, FLIP, BLOCK_T, SUB, WHOLE)
                if restarts is not None and EXCLUSIVE:
                    ea_s, eb_s = restart_exclusive(ea_s, eb_s, restarts, 1, SUB)
                carry_w = apply_map(agg_w, agg_wd, carry_w)
            elif SEGMENTS and BOOT is not None:  # packed forward scans: restart at starts
                ts, masks, a_s, bb_s, ea_s, eb_s, auxs, agg_a, agg_b = packed_forward_chunk(
                    rows, OPTS, cu, n_seg, chunk, n_chunks, COEF, BOOT, EXCLUSIVE, SCAN_REVERSE,
                    REVERSE, TIME_AXIS, INT64, BLOCK_T, FLIP, DESC, SUB, EVEN, WHOLE, MASK,
                    BOOT_SLOTS)
            else:
                ts, masks, a_s, bb_s, ea_s, eb_s, auxs, agg_a, agg_b = scan_chunk(
                    rows, OPTS, chunk, n_chunks, COEF, EXCLUSIVE, SCAN_REVERSE, TIME_AXIS, INT64,
                    BLOCK_T, FLIP, DESC, SUB, EVEN, WHOLE, MASK, windows)
            store_chunk(rows, OPTS, ts, masks, a_s, bb_s, ea_s, eb_s, auxs, carry, STORE, SUB)
            # the tile's outgoing value: the carry into the next tile in scan order
            carry = apply_map(agg_a, agg_b, carry)
    else:
        chunk = n_chunks - 1 - order if REVERSE else order
        windows = None
        if SEGMENTS and BOOT is None:  # the builders see each step's segment
            windows = segment_windows(rows, cu, n_seg, chunk, TIME_AXIS, INT64, BLOCK_T, FLIP,
                                      DESC, SUB, REVERSE, BOOT_SLOTS, False)
        if W_PHASE:
            ts, masks, als, bes, auxs = chunk_coefficients(
                rows, OPTS, chunk, n_chunks, COEF, TIME_AXIS, INT64, BLOCK_T, FLIP, DESC, SUB,
                EVEN, MASK, True, windows)
            restarts = None
            if SEGMENTS:  # found after the coefficients' loads are issued: they overlap
                restarts = segment_restarts(
                    segment_windows(rows, cu, n_seg, chunk, TIME_AXIS, INT64, BLOCK_T, FLIP,
                                    DESC, SUB, REVERSE, BOOT_SLOTS, True),
                    rows, OPTS, BOOT, SUB, BOOT_SLOTS)
            ew_s, ewd_s, agg_w, agg_wd = successors(als, auxs, SCAN_REVERSE, TIME_AXIS, FLIP,
                                                    BLOCK_T, SUB, WHOLE, restarts)
            # both initial carries: read by the first tile in scan order only (as HAS_INIT's)
            carry, carry_w = boot_carries(BOOT, rows, OPTS, ins,
                                          tl.where(order == 0, mask_b, False))
            if LOOKBACK:
                slot_w = k * BLOCK_B + r
                if order > 0:
                    tl.atomic_xchg(words_wa + slot_w, pack(agg_w, tag + 1), sem="relaxed")
                    tl.atomic_xchg(words_wb + slot_w, pack(agg_wd, tag + 1), sem="relaxed")
                    carry_w = look_back(words_wa, words_wb, pid_b, order, n_row_tiles, r, mask_b,
                                        tag, carry_w, TIME_AXIS, WINDOW, DEPTH, BLOCK_B)
                if order < n_chunks - 1:
                    tl.atomic_xchg(words_wa + slot_w,
                                   pack(apply_map(agg_w, agg_wd, carry_w), tag + 2),
                                   sem="relaxed")
            als, bes, auxs = finish_chunk(als, bes, auxs, ew_s, ewd_s, carry_w, rows, OPTS,
                                          FINISH, SUB, restarts)
            a_s, bb_s, ea_s, eb_s, agg_a, agg_b = compose(
                als, bes, EXCLUSIVE, SCAN_REVERSE, TIME_AXIS, FLIP, BLOCK_T, SUB, WHOLE)
            if restarts is not None and EXCLUSIVE:
                ea_s, eb_s = restart_exclusive(ea_s, eb_s, restarts, 1, SUB)
        elif SEGMENTS and BOOT is not None:  # packed forward scans: restart at starts
            ts, masks, a_s, bb_s, ea_s, eb_s, auxs, agg_a, agg_b = packed_forward_chunk(
                rows, OPTS, cu, n_seg, chunk, n_chunks, COEF, BOOT, EXCLUSIVE, SCAN_REVERSE,
                REVERSE, TIME_AXIS, INT64, BLOCK_T, FLIP, DESC, SUB, EVEN, WHOLE, MASK,
                BOOT_SLOTS)
        else:
            ts, masks, a_s, bb_s, ea_s, eb_s, auxs, agg_a, agg_b = scan_chunk(
                rows, OPTS, chunk, n_chunks, COEF, EXCLUSIVE, SCAN_REVERSE, TIME_AXIS, INT64,
                BLOCK_T, FLIP, DESC, SUB, EVEN, WHOLE, MASK, windows)
        if HAS_INIT:
            # read by the first tile in scan order only, after its scan (not held through it):
            # a tile after it never reaches the initial carry in its look-back, since the first
            # tile publishes its outgoing value (a constant map)
            carry = load_value(init, b1 * init_s1 + b2 * init_s2,
                               tl.where(order == 0, mask_b, False))
        if LOOKBACK:
            slot = k * BLOCK_B + r
            if order > 0:
                tl.atomic_xchg(words_a + slot, pack(agg_a, tag + 1), sem="relaxed")
                tl.atomic_xchg(words_b + slot, pack(agg_b, tag + 1), sem="relaxed")
                carry = look_back(words_a, words_b, pid_b, order, n_row_tiles, r, mask_b, tag,
                                  carry, TIME_AXIS, WINDOW, DEPTH, BLOCK_B)
            if order < n_chunks - 1:
                tl.atomic_xchg(words_a + slot, pack(apply_map(agg_a, agg_b, carry), tag + 2),
                               sem="relaxed")
        store_chunk(rows, OPTS, ts, masks, a_s, bb_s, ea_s, eb_s, auxs, carry, STORE, SUB)


@triton.jit
def row_scalars(rows, sk, s1, s2, b1, b2, mask_b, scalars, N: tl.constexpr):
    """`scalars` with its first N replaced by their values at rows (b1, b2)."""
    out = ()
    for i in tl.static_range(len(scalars)):
        if i < N:
            out = out + (load_value(rows, i * sk + b1 * s1 + b2 * s2, mask_b),)
        else:
            out = out + (scalars[i],)
    return out


@triton.jit
def row_value(step, SLOT: tl.constexpr):
    """A bootstrap slot's value at each row (its time stride is 0), zero outside the step's
    mask (`BOOT`'s: the rows that read it)."""
    return load_value(step.ins[SLOT], slot_offsets(step, SLOT, 0), step.mask)


@triton.jit
def finish_linear(step, pieces, beta, wn):
    """The masked builders' common `FINISH`: alpha = a + c * w', exactly a where c = 0 (a
    select, whatever the successor's value w' holds: a termination keeps out the next episode's
    NaN)."""
    a, c = pieces
    return tl.where(c == 0, a, a + c * wn), beta


@triton.jit
def out_offsets(step, SLOT: tl.constexpr):
    """The offsets of output slot SLOT at the step's steps."""
    return offsets(step.t, step.b1, step.b2, step.ost[SLOT], step.os1[SLOT], step.os2[SLOT])


@triton.jit
def store_at(step, SLOT: tl.constexpr, mask, value):
    """Output slot SLOT at the step's steps, where `mask` is set."""
    ptr = step.outs[SLOT] + out_offsets(step, SLOT)
    tl.store(ptr, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_out(step, SLOT: tl.constexpr, value):
    """Output slot SLOT at the step's steps."""
    store_at(step, SLOT, step.mask, value)


@triton.jit
def single_store(step, res, res_prev, aux):
    """The writer of ops whose one output is the scan's value."""
    store_out(step, 0, res)


@triton.jit
def single_store_masked(step, res, res_prev, aux):
    """`single_store` of a masked reverse scan (aux: the builder's, the decision steps, the
    successor's value): 0 at masked steps."""
    _, keep, _ = aux
    store_out(step, 0, tl.where(keep, res, 0.0))


@triton.jit
def clip(x, high):
    """min(x, high), NaN where x is NaN: a NaN ratio is never clipped into a finite number (plain
    `tl.minimum` returns the operand that is not NaN)."""
    return tl.minimum(x, high, propagate_nan=tl.PropagateNan.ALL)
