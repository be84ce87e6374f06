"""Tile shapes, warps, the look-back window and the long-row split: chosen here and nowhere else.

One program scans a tile of `block_t` steps x `block_b` rows; rows longer than a tile are cut into
tiles that find their carries by look-back (`scan.py`), or walked by one program. The rule,
`choose` (the measurements behind its numbers: docs/dev/tile-rule.md):
- a tile holds TILE_ELEMENTS values, TILE_ELEMENTS_SMALL where the scan holds more than its pair
  per step or the time-major rows are few; Retrace's, TILE_STEPS_ACTIONS* steps x rows;
- its long side follows the contiguous axis: steps for batch-major data (`[N, T]`), rows for
  time-major data (`[T, N]`, at most MAX_ROWS_TIME_MAJOR: the scan along time crosses threads);
- small grids: tiles halve until they give MIN_PROGRAMS_PER_SM programs per multiprocessor;
  batch-major tiles then drop rows while they number fewer than the multiprocessors;
- batch-major rows longer than a tile are walked when their row tiles alone fill the GPU, else
  cut into one-warp tiles that look back; time-major tiles look back, in grids of few programs
  SPAN_STEPS long (fewer look-back round trips);
- values per thread set the warps; tiles that hold per-step values or look back cap their
  registers; time-major tiles run as sub-tiles (`sub_tiles`); the look-back window is laid out
  as `window` says;
- writers that hold many values per step (`heavy`: V-trace's backward) take time-major tiles of
  fewer values per thread, and a higher register cap where batch-major rows look back.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace

import torch

# The rule's constants, each with its decision in a line; the measurements behind them (H200
# device time) are on docs/dev/tile-rule.md, one section per constant. `rule` replaces them inside
# a block, for measurements.
# Tiles
TILE_ELEMENTS = 2048  # values per tile: bytes enough per program, registers few enough
TILE_ELEMENTS_SMALL = 1024  # scans holding 4 values per step: 4-warp programs fit more per SM
MAX_ROWS_NARROW = 8  # time-major tiles of <= 8 rows are small too: a few long rows, more tiles
MIN_TILE_ELEMENTS, MIN_PROGRAMS_PER_SM = 256, 4  # small grids: halve tiles for 4 programs per SM
FILL_TILES_PER_SM = 1  # then batch-major rows halve below 1 tile per SM: twice the programs
FILL_MIN_ELEMENTS = 128  # ... down to one warp of 4 values per thread (16-byte loads)
MIN_BLOCK_T = 16
MAX_ROWS_TIME_MAJOR = 32  # time-major tiles: rows along memory, the scan along time kept small
TILE_ELEMENTS_LOOKBACK = 512  # batch-major rows that look back: one-warp tiles, more in flight
TILE_ELEMENTS_EXCLUSIVE_LOOKBACK = 256  # ... V-trace's half (4 values per step in its scan)
WALK_PROGRAMS_PER_SM = 2  # walk the rows when their tiles alone give 2 programs per SM
WALK_PROGRAMS_PER_SM_ACTIONS = 5  # ... Retrace 5: its walk beats the look-back from there
# Time-major grids of < 32 programs per SM span 128 steps x 16 rows: fewer look-back round trips
SPAN_PROGRAMS_PER_SM, SPAN_STEPS, SPAN_ROWS = 32, 128, 16  # from 32 per SM the rule's tiles win
SPAN_MIN_ROWS = 2  # rows halve down to 2 below one tile per SM (1 row: 4-byte rows, slower)
SPAN_ELEMENTS_PER_THREAD = 32
SPAN_ELEMENTS_PER_THREAD_AUX = 16  # GAE's, V-trace's (writers holding values; V-trace capped) ...
SPAN_FEW_PROGRAMS_PER_SM = 4  # ... and the others' that look back in grids of <= 4: more warps
# Values per thread: they set the warps (at most MAX_WARPS)
MAX_WARPS = 8
ELEMENTS_PER_THREAD = 8  # batch-major tiles: the scan runs along each thread's own values
ELEMENTS_PER_THREAD_LOOKBACK = 16  # ... that look back: half the warps stall per look-back
# ... of packed rows (each step's segment, its window end and bootstrap, the restarts): at 16
# per thread they spill (tools/registers.py gae:512x4096:bm:packed)
ELEMENTS_PER_THREAD_PACKED_LOOKBACK = 4
HALF_PRECISION_SCALE = 2  # ... of 2-byte inputs in grids of many: as many bytes as 4-byte ones
MANY_PROGRAMS_PER_SM = 32  # a grid of many programs, per SM (with fewer, twice the values lose)
ELEMENTS_PER_THREAD_TIME_MAJOR = 32  # time-major forward scans in grids of few programs
ELEMENTS_PER_THREAD_MANY_TIME_MAJOR = 16  # ... of many: twice the warps, fewer registers
ELEMENTS_PER_THREAD_REVERSE_TIME_MAJOR = 16  # time-major reverse scans (run forward, `DESC`)
ELEMENTS_PER_THREAD_SMALL_TIME_MAJOR = 16  # time-major narrow tiles (TILE_ELEMENTS_SMALL)
ELEMENTS_PER_THREAD_EXCLUSIVE_TIME_MAJOR = 8  # time-major, per-step values held: occupancy
# V-trace's narrow time-major tiles: 4 per thread, 8 at >= 4 rows (vector rows, sub-tiles)
ELEMENTS_PER_THREAD_EXCLUSIVE_NARROW_TIME_MAJOR = 4
ELEMENTS_PER_THREAD_EXCLUSIVE_NARROW_VECTOR_TIME_MAJOR = 8
# Retrace: actions in blocks of 8 (bf16: 2), summed in each thread's registers, not across lanes
MAX_ACTION_BLOCK, ELEMENTS_PER_THREAD_ACTIONS = 8, 8
MAX_ACTION_BLOCK_HALF_PRECISION = 2  # 2-byte inputs: one 4-byte pair per load, no lane masked
TILE_STEPS_ACTIONS = 128
TILE_STEPS_ACTIONS_TIME_MAJOR = 256  # time-major only: batch-major tiles lose with 256
# Register caps (Triton's `maxnreg`): more programs per SM without spilling
MAX_REGISTERS_EXCLUSIVE_TIME_MAJOR = 80  # V-trace tm, >= 4 rows: 6 programs per SM, not 5
MAX_REGISTERS_EXCLUSIVE_WIDE = 128  # V-trace, 16 per thread (span, walked): 4 programs, not 3
MAX_REGISTERS_EXCLUSIVE_LOOKBACK = 80  # V-trace's one-warp look-back tiles: 25 programs per SM
MAX_REGISTERS_LONG_ROWS = 64  # the others' look-back tiles, GAE's walked: 8 programs per SM
# Writers holding many values per step (`heavy`: V-trace's backward, 6 or more beside the scan's
# 4): time-major tiles on 8 warps (4 values per thread; 8 in span tiles), else they spill
ELEMENTS_PER_THREAD_HEAVY_TIME_MAJOR = 4
MAX_REGISTERS_HEAVY_LOOKBACK = 128  # ... its batch-major look-back tiles: no stack at 128
# Look-back
WINDOW = 16  # tiles read per step of the look-back in the interpreter; on a GPU see `window`
DEPTH_WIDE = 1  # words read per pass of a window of one word per thread: the nearest decides
DEPTH_WIDE_MIN_WINDOW = 4  # ... and of one warp's worth at least 4 deep (2 deep: read whole)
# Sub-tiles of time-major tiles of >= 4 rows (`sub_tiles`): a thread's steps consecutive
SUB_TILES_TIME_MAJOR = 8
SUB_TILES_MIN_TIME_MAJOR = 4  # at least 4, 2 rows per thread (tiles of 8 values per thread)
SUB_TILES_WIDE_ROWS, SUB_TILES_MIN_WIDE = 16, 8  # at 16 rows at least 8 (2 rows per thread)
# Switches, for measurements
EVEN_TILES = 1  # full tiles drop their masks (`even`) where that keeps the occupancy (`launch`)
TRUNCATION_SLOT_ALWAYS = 1  # time-major calls without truncations read terminations there (`launch`)
# A multiprocessor's limits (sm_80 and sm_90: the H200), for `occupancy`
REGISTERS_PER_SM, MAX_WARPS_PER_SM, MAX_PROGRAMS_PER_SM = 65536, 64, 32
SHARED_PER_SM, SHARED_RESERVED_PER_PROGRAM = 228 * 1024, 1024


@dataclass(frozen=True)
class TileConfig:
    block_t: int
    block_b: int
    num_warps: int
    window: int = WINDOW
    walk: bool = False  # one program walks all tiles of its rows (else: one per tile)
    depth: int = 0  # words of the window read per pass of the look-back (0: `depth` decides)
    sub: int = 1  # time-major tiles: sub-tiles (consecutive steps per thread, `sub_tiles`)
    max_registers: int = 0  # registers per thread the compiler may use (0: its choice)

    def chunks(self, T: int) -> int:
        """Tiles along the time axis."""
        return -(-T // self.block_t)


def choose(T: int, B: int, *, time_contiguous: bool, device: torch.device,
           n_act: int = 0, exclusive: bool = False, reverse: bool = False,
           aux: bool = False, itemsize: int = 4, heavy: bool = False,
           packed: bool = False) -> TileConfig:
    """The tile for T steps x B rows; `time_contiguous` for batch-major data, `n_act` > 0 for
    Retrace's action axis, `exclusive` for scans that also carry the exclusive value (V-trace),
    `reverse` for reverse scans, `aux` for writers that hold per-step values of the builder
    through the scan (GAE, V-trace), `itemsize` the bytes of a floating-point input, `heavy` for
    writers that hold many (V-trace's backward), `packed` for packed rows (semantics §7: segments
    inside the row)."""
    sms = _multiprocessors(device)
    per_step = action_block(n_act, itemsize) if n_act else 1
    flags = (per_step, n_act, exclusive, reverse, aux, itemsize, heavy)
    if time_contiguous:
        block_t, block_b, per_thread, walk, cap = _batch_major(T, B, sms, *flags)
        if packed and T > block_t and not walk and not n_act:
            per_thread = min(per_thread, ELEMENTS_PER_THREAD_PACKED_LOOKBACK)
    else:
        block_t, block_b, per_thread, cap = _time_major(T, B, sms, *flags)
        walk = False  # time-major tiles look back: faster than walking (tile-rule.md)
    warps = min(MAX_WARPS, _pow2(max(1, block_t * block_b * per_step // (32 * per_thread))))
    cfg = TileConfig(block_t, block_b, warps, WINDOW, walk, max_registers=cap)
    if _overrides:
        cfg = replace(cfg, **_overrides)
    if time_contiguous:
        cfg = replace(cfg, sub=1)
    elif "sub" in _overrides:
        cfg = replace(cfg, sub=min(cfg.sub, cfg.block_t))
    elif vector_rows(B, time_contiguous, n_act > 0):
        cfg = replace(cfg, sub=sub_tiles(cfg, exclusive, heavy))
    win = window(cfg.window, cfg.block_b, cfg.num_warps, device)
    return replace(cfg, window=win, depth=min(win, cfg.depth or depth(win, cfg.block_b, device)))


def _batch_major(T, B, sms, per_step, n_act, exclusive, reverse, aux, itemsize, heavy):
    """Batch-major rows (`[N, T]`): block_t, block_b, values per thread, walk, register cap."""
    elements = (TILE_STEPS_ACTIONS * per_step if n_act
                else TILE_ELEMENTS_SMALL if exclusive else TILE_ELEMENTS)
    block_t, block_b, tiles = _fit(T, B, elements, per_step, True, sms)
    long_rows = T > block_t
    walk = long_rows and -(-B // block_b) >= sms * (
        WALK_PROGRAMS_PER_SM_ACTIONS if n_act else WALK_PROGRAMS_PER_SM)
    looks_back = long_rows and not walk
    if looks_back and not n_act:  # one-warp tiles (their rows and walk stay: one row, no walk)
        least = TILE_ELEMENTS_EXCLUSIVE_LOOKBACK if exclusive else TILE_ELEMENTS_LOOKBACK
        block_t, block_b, tiles = _fit(T, B, min(elements, least), per_step, True, sms)
    many = tiles >= MANY_PROGRAMS_PER_SM * sms
    per_thread = (min(ELEMENTS_PER_THREAD_ACTIONS, per_step) if n_act
                  else ELEMENTS_PER_THREAD_LOOKBACK if looks_back
                  else ELEMENTS_PER_THREAD * HALF_PRECISION_SCALE
                  if itemsize <= 2 and many and not exclusive  # as many bytes as 4-byte inputs
                  else ELEMENTS_PER_THREAD)
    cap = (MAX_REGISTERS_HEAVY_LOOKBACK if heavy and looks_back
           else MAX_REGISTERS_EXCLUSIVE_LOOKBACK if exclusive and looks_back
           else MAX_REGISTERS_EXCLUSIVE_WIDE if exclusive and walk
           else MAX_REGISTERS_LONG_ROWS if long_rows and not n_act and (aux or looks_back)
           else 0)
    return block_t, block_b, per_thread, walk, cap


def _time_major(T, B, sms, per_step, n_act, exclusive, reverse, aux, itemsize, heavy):
    """Time-major rows (`[T, N]`): block_t, block_b, values per thread, register cap."""
    narrow = not n_act and B <= MAX_ROWS_NARROW
    held = exclusive or (aux and not narrow)  # per-step values held through the scan
    elements = (TILE_STEPS_ACTIONS_TIME_MAJOR * per_step if n_act
                else TILE_ELEMENTS_SMALL if held or narrow else TILE_ELEMENTS)
    block_t, block_b, tiles = _fit(T, B, elements, per_step, False, sms)
    if held and not exclusive and itemsize < 4 and tiles < MANY_PROGRAMS_PER_SM * sms:
        held = False  # 2-byte GAE in grids of few programs: the others' tiles are faster
        block_t, block_b, tiles = _fit(T, B, TILE_ELEMENTS, per_step, False, sms)
    span = not n_act and not narrow and tiles < SPAN_PROGRAMS_PER_SM * sms
    if span:
        block_t = max(MIN_BLOCK_T, min(_pow2(T), SPAN_STEPS))
        block_b = _fewer_rows(T, B, block_t, min(_pow2(B), SPAN_ROWS), SPAN_MIN_ROWS, sms)
    few = T > block_t and _tiles(T, B, block_t, block_b) <= SPAN_FEW_PROGRAMS_PER_SM * sms
    per_thread = (min(ELEMENTS_PER_THREAD_ACTIONS, per_step) if n_act
                  else ELEMENTS_PER_THREAD_HEAVY_TIME_MAJOR if heavy
                  else SPAN_ELEMENTS_PER_THREAD_AUX if span and (aux or few)
                  else SPAN_ELEMENTS_PER_THREAD if span
                  else ELEMENTS_PER_THREAD_EXCLUSIVE_NARROW_VECTOR_TIME_MAJOR
                  if exclusive and narrow and vector_rows(B, False, False)
                  else ELEMENTS_PER_THREAD_EXCLUSIVE_NARROW_TIME_MAJOR if exclusive and narrow
                  else ELEMENTS_PER_THREAD_EXCLUSIVE_TIME_MAJOR if held
                  else ELEMENTS_PER_THREAD_SMALL_TIME_MAJOR if narrow
                  else ELEMENTS_PER_THREAD_REVERSE_TIME_MAJOR if reverse
                  else ELEMENTS_PER_THREAD_MANY_TIME_MAJOR
                  if tiles >= MANY_PROGRAMS_PER_SM * sms
                  else ELEMENTS_PER_THREAD_TIME_MAJOR)
    cap = (MAX_REGISTERS_EXCLUSIVE_WIDE if exclusive and span
           else MAX_REGISTERS_EXCLUSIVE_TIME_MAJOR
           if exclusive and vector_rows(B, False, n_act > 0) else 0)
    return block_t, block_b, per_thread, cap


def _fit(T, B, elements, per_step, time_contiguous, sms):
    """The tile of `elements` values (halved, down to MIN_TILE_ELEMENTS, while the tiles give
    fewer than MIN_PROGRAMS_PER_SM programs per SM; batch-major tiles then halve their rows, down
    to FILL_MIN_ELEMENTS values, while fewer than FILL_TILES_PER_SM): block_t, block_b, tiles."""
    while True:
        steps = max(1, elements // per_step)
        if time_contiguous:
            block_t = max(MIN_BLOCK_T, min(_pow2(T), steps))
            block_b = max(1, min(_pow2(B), steps // block_t))
        else:
            block_b = max(1, min(_pow2(B), MAX_ROWS_TIME_MAJOR, steps // MIN_BLOCK_T))
            block_t = max(MIN_BLOCK_T, min(_pow2(T), steps // block_b))
        if (_tiles(T, B, block_t, block_b) >= MIN_PROGRAMS_PER_SM * sms
                or elements // 2 < MIN_TILE_ELEMENTS):
            break
        elements //= 2
    if time_contiguous:
        block_b = _fewer_rows(T, B, block_t, block_b, max(1, -(-FILL_MIN_ELEMENTS // block_t)),
                              FILL_TILES_PER_SM * sms)
    return block_t, block_b, _tiles(T, B, block_t, block_b)


def _fewer_rows(T, B, block_t, block_b, least, target):
    """`block_b` halved, down to `least`, while the tiles number fewer than `target`."""
    while block_b // 2 >= least and _tiles(T, B, block_t, block_b) < target:
        block_b //= 2
    return block_b


def _tiles(T, B, block_t, block_b):
    return -(-T // block_t) * -(-B // block_b)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one after another


def action_block(n_act: int, itemsize: int = 4) -> int:
    """Actions loaded at once along Retrace's action axis (`rl_triton.ops.retrace.coef`)."""
    most = MAX_ACTION_BLOCK_HALF_PRECISION if itemsize <= 2 else MAX_ACTION_BLOCK
    return min(_pow2(n_act), most)


def vector_rows(B: int, time_contiguous: bool, actions: bool) -> bool:
    """Time-major tiles of at least 4 rows, but Retrace's: their rows load 4 (or 2) at a time
    (`launch.row_vector`) and they run as sub-tiles (tiles of 2 rows lose as sub-tiles)."""
    return not time_contiguous and not actions and B >= 4


def sub_tiles(cfg: TileConfig, exclusive: bool, heavy: bool = False) -> int:
    """Sub-tiles of a time-major tile (`scan.scan_chunk`), so that a thread holds consecutive
    steps: its steps (rows along lanes, up to 4 per thread), at most SUB_TILES_TIME_MAJOR; at
    least SUB_TILES_MIN_TIME_MAJOR (SUB_TILES_MIN_WIDE in tiles of SUB_TILES_WIDE_ROWS rows), down
    to 2 rows per thread, but in tiles of fewer than 32 steps whose scan is not `exclusive`, and
    in `heavy` tiles (`choose`: their rows stay 4 per thread)."""
    per_thread = cfg.block_t * cfg.block_b // (32 * cfg.num_warps)
    steps = per_thread // min(4, cfg.block_b)
    least = SUB_TILES_MIN_WIDE if cfg.block_b >= SUB_TILES_WIDE_ROWS else SUB_TILES_MIN_TIME_MAJOR
    least = (min(least, per_thread // 2) if (exclusive or cfg.block_t >= 2 * MIN_BLOCK_T)
             and not heavy else 1)
    return max(1, min(SUB_TILES_TIME_MAJOR, max(steps, least), cfg.block_t))


def window(least: int, block_b: int, num_warps: int, device: torch.device) -> int:
    """Tiles read per step of the look-back (`scan.look_back`). On a GPU no thread may see a
    word (window x block_b of them) differently from the threads it decides with:
    - tiles of 2 to 32 rows: exactly one warp's worth, one word per lane; every warp holds the
      whole window and loops on its own (no barrier);
    - one-row tiles (and tiles of more than 32 rows): one word per thread, at least `least`
      tiles (Triton lays the window's loads out one word per thread).
    Other sizes gave wrong carries on the H200. The interpreter runs one thread: any window."""
    if device.type != "cuda":
        return least
    if 2 <= block_b <= 32:
        return 32 // block_b
    return max(least, _pow2(-(-32 * num_warps // block_b)))


def depth(window: int, block_b: int, device: torch.device) -> int:
    """Words of a look-back window read per pass (`scan.look_back`): on a GPU, DEPTH_WIDE for
    windows of one word per thread and for one warp's worth at least DEPTH_WIDE_MIN_WINDOW tiles
    deep; the whole window otherwise, and in the interpreter."""
    if device.type == "cuda" and (block_b == 1 or window * block_b > 32
                                  or window >= DEPTH_WIDE_MIN_WINDOW):
        return DEPTH_WIDE
    return window


def even(T: int, B: int, cfg: TileConfig) -> bool:
    """Whether every tile is full (T and B multiples of the tile's): the plan may then compile
    without masks (`scan.scan_kernel`, `EVEN`), where that keeps the occupancy (`launch`)."""
    return bool(EVEN_TILES) and T % cfg.block_t == 0 and B % cfg.block_b == 0


def occupancy(registers: int, warps: int, shared: int) -> tuple[int, float]:
    """Programs of `warps` warps that fit on a multiprocessor, and the fraction of its warps
    they fill (registers are allocated per warp in units of 256)."""
    per_warp = -(-registers * 32 // 256) * 256
    programs = min((REGISTERS_PER_SM // per_warp) // warps, MAX_WARPS_PER_SM // warps,
                   MAX_PROGRAMS_PER_SM, SHARED_PER_SM // (shared + SHARED_RESERVED_PER_PROGRAM))
    return programs, programs * warps / MAX_WARPS_PER_SM


_overrides: dict = {}


@contextlib.contextmanager
def override(**fields):
    """Force tile fields (block_t, block_b, num_warps, window, walk, depth, sub, max_registers)
    inside the block: for tests and tuning."""
    old = dict(_overrides)
    _overrides.update(fields)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(old)


def constants() -> dict:
    """The rule's constants (this module's upper-case integers), by name."""
    return {k: v for k, v in globals().items() if k.isupper() and isinstance(v, int)}


@contextlib.contextmanager
def rule(**values):
    """Replace constants of the rule inside the block (`python -m rl_triton.bench --rule`,
    `tools/ab.py`). Plans built before keep their tiles."""
    unknown = sorted(set(values) - set(constants()))
    if unknown:
        raise KeyError(f"not constants of the tile rule: {unknown}")
    old = {k: globals()[k] for k in values}
    globals().update(values)
    try:
        yield
    finally:
        globals().update(old)
