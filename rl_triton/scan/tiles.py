"""Tile shapes, warps and the look-back window: chosen here and nowhere else.

One program scans one tile of `block_t` steps x `block_b` rows; rows longer than a tile are
split into tiles that run in parallel and find their carries by look-back (`scan.py`). The rule:
- a tile holds about `TILE_ELEMENTS` values (Retrace's `TILE_STEPS_ACTIONS*` steps x rows, each
  step's actions walked in blocks, `action_block`;
  `TILE_ELEMENTS_SMALL` for tiles whose scan also carries the exclusive value, V-trace, for
  GAE's time-major tiles, whose writer holds values[t] through the scan (bfloat16: in grids
  of many programs only), and for time-major tiles of at most `MAX_ROWS_NARROW` rows): enough
  bytes per program to keep the memory system busy, few enough registers per thread;
- the tile's long side follows the contiguous axis of memory: time for batch-major data
  (`[N, T]`), rows for time-major data (`[T, N]`, at most `MAX_ROWS_TIME_MAJOR` rows, so that
  the scan along time, which crosses threads, stays small);
- when the tiles would not give `MIN_PROGRAMS_PER_SM` programs per multiprocessor, they shrink (down
  to `MIN_TILE_ELEMENTS`): small problems are latency-bound, and more programs hide the latency;
  batch-major tiles then shrink their rows while there are fewer tiles than multiprocessors;
- time-major tiles in grids of few programs per multiprocessor span up to `SPAN_STEPS` steps
  instead (`_span`): each tile along time costs a look-back round trip;
- `ELEMENTS_PER_THREAD*` values per thread set the warps;
- the look-back lays out `window` tiles' words per step: one warp's worth for tiles of several
  rows, one word per thread for one-row tiles; it reads only the nearest word per pass
  (`depth`) but where a window of several rows is shallower than `DEPTH_WIDE_MIN_WINDOW`;
- batch-major tiles that look back take `ELEMENTS_PER_THREAD_LOOKBACK` values per thread;
- batch-major tiles of 2-byte inputs in large grids take twice the values per thread;
- time-major forward scans in large grids take half the values per thread (twice the warps);
- batch-major tiles that look back hold `TILE_ELEMENTS_LOOKBACK` steps on one warp (V-trace's
  `TILE_ELEMENTS_EXCLUSIVE_LOOKBACK`);
- V-trace's time-major tiles and the batch-major tiles of long rows cap their registers
  (`_max_registers`, Triton's `maxnreg`): more programs per multiprocessor;
- time-major tiles run as sub-tiles so that each thread holds consecutive steps (`sub_tiles`),
  2 rows per thread in tiles of 16 rows or more;
- plans whose tiles divide the problem drop their masks where that keeps the occupancy (`even`);
- when the row tiles alone fill the GPU, a program walks all tiles of its rows (batch-major
  tiles only: time-major tiles look back faster, see `choose`).
docs/benchmarks.md has the measurements behind the numbers.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace

import torch

TILE_ELEMENTS = 2048
# Tiles whose scan carries 4 values per step (the exclusive value too: V-trace). Batch-major:
# 1024 values (4 warps) took 132 µs at 16384x1024 and 29 at 512x4096, 2048 (8 warps) 148 and
# 40: at 95-145 registers per thread, 4-warp programs fit more warps per multiprocessor. The
# other estimators lost up to 27% with 1024. Time-major: 1024 values of 16 per thread took 257
# µs at 16384x1024 and 92 at 4x1048576, 2048 of 32 per thread 314 and 153.
# Time-major tiles of at most MAX_ROWS_NARROW rows (a few long rows): reverse scans 9-26% faster
# with 1024 values at 2, 4 and 8 rows, forward scans within 2%; at 16 rows and more, 5-31%
# slower (docs/benchmarks.md, log).
TILE_ELEMENTS_SMALL = 1024
MAX_ROWS_NARROW = 8
# Batch-major tiles of rows longer than the tile above that look back (not walked) hold
# TILE_ELEMENTS_LOOKBACK steps on one warp instead (16 values per thread), V-trace's
# TILE_ELEMENTS_EXCLUSIVE_LOOKBACK (8 per thread) at most MAX_REGISTERS_EXCLUSIVE_LOOKBACK
# registers (25 programs per multiprocessor; its 1024-step tiles on 2 warps at 128: 8), each
# reading one word of its look-back window per pass (`depth`). H200 device time (2026-12-01)
# against 2048 steps on 4 warps: GAE 4x1048576 0.89 (bfloat16 0.85), 16x131072 0.92, 64x32768
# 0.91, discounted returns 4x1048576 0.96, lambda-returns 16x131072 0.95, eligibility traces
# 64x32768 0.94, episodic sums bfloat16 16x131072 0.92 (256 steps 0.96-1.10, 1024 on 2 warps
# 0.98-1.05). V-trace against 1024 steps on 2 warps: at up to 8 rows 4x1048576 0.81-0.83
# (bfloat16 0.82-0.85), 1x4194304 0.79, 8x524288 0.89 (reading all 32 words of the window per
# pass, as then); at more rows, one word per pass: 16x131072 0.79 (bfloat16 0.79, without
# truncation flags 0.88), 64x32768 0.80 (without flags 0.86), 128x16384 0.79, 200x16384 0.75,
# 256x8192 0.80, 12x262144 0.76; walked rows, 300x4096 and 512x4096, 1.43-1.61, so not those
# (docs/benchmarks.md, log).
TILE_ELEMENTS_LOOKBACK = 512
TILE_ELEMENTS_EXCLUSIVE_LOOKBACK = 256
MAX_REGISTERS_EXCLUSIVE_LOOKBACK = 80
MIN_TILE_ELEMENTS = 256
MIN_PROGRAMS_PER_SM = 4
# Batch-major tiles that give fewer than FILL_TILES_PER_SM tiles per multiprocessor even at
# MIN_TILE_ELEMENTS then halve their rows (down to one, and to FILL_MIN_ELEMENTS values: one
# warp of 4 values per thread, 16-byte loads of float32; their steps stay, so no look-back is
# added): at 128x128, 128 tiles of 128 x 1 instead of 64 of 128 x 2, both on one warp. H200
# device time (2026-12-01): GAE 5.76 -> 4.96 µs (bfloat16 5.31 -> 4.86), V-trace 5.22 -> 5.09,
# the other estimators within 2%; 64 rows of 16 steps, 16 x 8 against 16 x 16: GAE 5.63 ->
# 4.80, the others within 3%; 16 x 1 1-4% slower than 16 x 8 (docs/benchmarks.md, log).
FILL_TILES_PER_SM = 1
FILL_MIN_ELEMENTS = 128
# Retrace walks the action axis in blocks of at most MAX_ACTION_BLOCK actions (unrolled; each
# thread sums its steps' actions in registers across blocks), MAX_ACTION_BLOCK_HALF_PRECISION
# for 2-byte inputs, and its tiles hold TILE_STEPS_ACTIONS steps x rows
# (TILE_STEPS_ACTIONS_TIME_MAJOR time-major), each thread up to ELEMENTS_PER_THREAD_ACTIONS
# values of a block (4 warps batch-major, 8 time-major). Against one block of 32 lanes for 18
# actions (14 masked) and 2048 values per tile, H200 device µs at 16384x1024: blocks of 8,
# float32 batch-major 848 -> 794, time-major 1085 -> 949, bfloat16 time-major 863 -> 776; blocks
# of 2 (one step's pair per thread), bfloat16 batch-major 531 -> 413 (blocks of 8: 435; float32
# with blocks of 2: 1006). Time-major 16384x16 7-14% slower (26.7 -> 28.7, bfloat16 20.0 ->
# 22.8), the other cells measured faster or within 3%. Time-major tiles of 256 steps x rows:
# 16384x1024 946 -> 905 µs (bfloat16 780 -> 748), 1024x1024 82 -> 78, 4x1048576 bfloat16 167 ->
# 176; batch-major ones 6% slower at 16384x1024. In the fourteenth session's grid, against the
# 32-lane rule: slower at 16384x16 time-major (7-11%), 128x128 batch-major float32 (8.6 -> 9.1
# µs) and 4096x128 time-major float32 (3%). Since the action loads run on the transposed tile
# (`coefficients.retrace_coef`), bfloat16 time-major takes blocks of 2 as well: 16384x1024 564
# -> 455 µs, 16x131072 93 -> 75, 1024x1024 50 -> 45, 4096x128 30 -> 27, 16384x16 unchanged;
# float32 there lost 20-41% with blocks of 2 (docs/benchmarks.md, log).
MAX_ACTION_BLOCK = 8
MAX_ACTION_BLOCK_HALF_PRECISION = 2
TILE_STEPS_ACTIONS = 128
TILE_STEPS_ACTIONS_TIME_MAJOR = 256
MIN_BLOCK_T = 16
MAX_ROWS_TIME_MAJOR = 32
# Time-major tiles in grids of fewer than SPAN_PROGRAMS_PER_SM programs per multiprocessor (with
# the tiles above) span SPAN_STEPS steps x SPAN_ROWS rows instead, SPAN_ELEMENTS_PER_THREAD per
# thread (GAE's, whose writer holds values[t] through the scan: SPAN_ELEMENTS_PER_THREAD_AUX),
# and halve their rows (down to SPAN_MIN_ROWS) while they give fewer programs than
# multiprocessors: fewer tiles along time, so fewer look-back round trips (none at T <= 128).
# H200 grid against the tiles above (2026-11-30, device time, every estimator but Retrace):
# 128x128 (32 tiles of 128 x 4) 0.72-0.82, 4096x128 0.75-0.91, 1024x1024 0.87-1.01, 512x4096
# 0.94-1.03, 64x32768 0.88-1.00, 16x131072 0.91-0.98. At 16384x1024 (62 programs per
# multiprocessor) tiles of 128 x 16 were 8-41% slower; 128 x 16 at 128x128 0.76-0.99 against
# 128 x 4's 0.73-0.80; GAE on 2 warps 3-5% slower than on 4. At 128x128, 64 tiles of 128 x 2
# against 32 of 128 x 4 (2026-12-01): 0.95-0.98 (GAE 5.76 -> 5.50 µs, V-trace 6.21 -> 5.98),
# the forward scans 1.01; 128 tiles of 128 x 1 1.04-1.13. V-trace's too take 16 per thread
# (4 warps), with at most MAX_REGISTERS_EXCLUSIVE_WIDE registers (below): against 32 per
# thread (255 registers, 4 programs of 2 warps per multiprocessor), 1024x1024 0.95 (bfloat16
# 0.92), 512x4096 0.93, 64x32768 0.93, 16x131072 0.92, 4096x128 0.98; on 4 warps without the
# cap (147 registers, 3 programs) 1.03-1.10 (docs/benchmarks.md, log). The other estimators'
# span tiles that look back take 16 per thread too in grids of at most SPAN_FEW_PROGRAMS_PER_SM
# programs per multiprocessor (one wave of few warps, each waiting through its look-back):
# 1024x1024 0.95-0.98 (discounted returns bfloat16 1.01), 2048x512 0.94-0.97, 1024x512
# 0.96-0.99; with 1024 programs (512x4096) 1.04-1.11, without a look-back (4096x128) 0.99-1.06
# (2026-12-01; docs/benchmarks.md, log).
SPAN_PROGRAMS_PER_SM = 32
SPAN_FEW_PROGRAMS_PER_SM = 4
SPAN_STEPS = 128
SPAN_ROWS = 16
SPAN_MIN_ROWS = 2
SPAN_ELEMENTS_PER_THREAD = 32
SPAN_ELEMENTS_PER_THREAD_AUX = 16
ELEMENTS_PER_THREAD = 8  # batch-major tiles: the scan runs along each thread's own values
# Batch-major tiles that look back (rows longer than a tile, not walked): half the warps, so
# that each look-back (one exposed L2 round trip per tile) stalls half as many. At 4x1048576
# (H200): discounted returns 28.4 -> 21.2 µs, eligibility traces 24.1 -> 19.5, lambda-returns
# 29.1 -> 25.8, V-trace 64.0 -> 59.9, GAE bfloat16 31.9 -> 30.2; GAE float32 2-5% slower
# (docs/benchmarks.md, log).
ELEMENTS_PER_THREAD_LOOKBACK = 16
# Batch-major tiles of 2-byte inputs (bfloat16, float16) without look-back take this many
# times the values per thread of 4-byte inputs, so that a thread loads as many bytes, where the
# grid holds at least MANY_PROGRAMS_PER_SM programs per multiprocessor: bfloat16 16384x1024 GAE
# 71.8 -> 63.8 µs, lambda-returns 53.5 -> 48.3 (discounted returns 40.1 -> 41.1). With fewer
# programs (4-8 per multiprocessor: 1024x1024, 4096x128, 512x4096) 3-9% slower; V-trace (its
# exclusive scan holds 4 values per step) 14-43% slower everywhere (docs/benchmarks.md, log).
HALF_PRECISION_SCALE = 2
MANY_PROGRAMS_PER_SM = 32
ELEMENTS_PER_THREAD_TIME_MAJOR = 32  # time-major forward scans: the scan crosses threads
# ... but in grids of at least MANY_PROGRAMS_PER_SM programs per multiprocessor, where twice the
# warps (2 rows per thread in 8 sub-tiles, `sub_tiles`; 64 registers instead of 104) pay: H200,
# 16384x1024 eligibility traces 48.8 -> 46.5 µs, bfloat16 44.9 -> 42.2; with fewer programs
# 512x4096 and 64x32768 within 2%, 1024x1024 3-4% and 16x131072 11% slower (docs/benchmarks.md,
# log).
ELEMENTS_PER_THREAD_MANY_TIME_MAJOR = 16
# Time-major reverse scans (run forward over steps in decreasing t, scan.py): 16 values per
# thread took 15-23% less time than 32 at 16384x1024 and 1024x1024 (GAE 141 -> 108 µs, 19 -> 15);
# forward scans (eligibility traces) lost 4-10% with 16 (docs/benchmarks.md, log).
ELEMENTS_PER_THREAD_REVERSE_TIME_MAJOR = 16
ELEMENTS_PER_THREAD_SMALL_TIME_MAJOR = 16  # time-major tiles of TILE_ELEMENTS_SMALL values
# V-trace's time-major tiles (1024 values, 4 values per step through the scan): 4 warps took
# 9-24% less time than 2 at every grid shape once their loads shared one layout (183 against
# 215 µs at 16384x1024); the other estimators lost up to 16% at 16 or 8 per thread. Since the
# sub-tiles, GAE's time-major tiles of 4-byte inputs too (`choose`, `aux`: its writer holds
# values[t] through the scan; 96 registers per thread and 31% occupancy at 16 per thread):
# 16384x1024 110 -> 96 µs, 4096x128 11.9 -> 10.3, 1024x1024 14.9 -> 14.1. bfloat16 GAE lost
# 5-10% at 512x4096, 64x32768 and 4096x128, and gained 7% in the grid of many programs,
# 16384x1024 (93 -> 56 registers; `choose`); lambda-returns (72 registers, 44% occupancy) and
# the forward scans gained nothing from smaller tiles (docs/benchmarks.md, log).
ELEMENTS_PER_THREAD_EXCLUSIVE_TIME_MAJOR = 8
# ... and those tiles compile with at most MAX_REGISTERS_EXCLUSIVE_TIME_MAJOR registers per
# thread (Triton's `maxnreg`; 0: the compiler's choice): 94-107 registers give 5 programs of 4
# warps per multiprocessor, 80 give 6 (sm_90, a few values spilled to the stack). H200,
# 16384x1024: 122.9 -> 116.7 µs (bfloat16 112.6 -> 104.5), 16384x512 65.9 -> 63.0 (59.9 ->
# 55.9); a cap of 72 3% slower in float32; caps on the other time-major tiles (forward scans,
# discounted and lambda-returns at 64 or 56 registers, GAE at 48 or 80) gained at most 2% and
# lost up to 17%. The narrow tiles of 4 to 8 rows (vector rows, 108-110 registers, 4 programs)
# likewise: 4x1048576 0.92 (bfloat16 0.87), 8x524288 0.90 (0.89); at 2 rows (86 registers, 8
# warps) 1.02 (docs/benchmarks.md, log). Not the span tiles (below).
MAX_REGISTERS_EXCLUSIVE_TIME_MAJOR = 80
# ... except at most MAX_ROWS_NARROW rows: 4 values per thread took 15-23% less time at 2, 4 and
# 8 rows (4x1048576: 77.7 -> 61.3 µs), 2% more at 16 rows and 14% more at 16384x1024; the other
# estimators' narrow tiles lost 7-12% at 8 per thread (docs/benchmarks.md, log).
ELEMENTS_PER_THREAD_EXCLUSIVE_NARROW_TIME_MAJOR = 4
# ... and at 4 to 8 rows, since their rows load 4 at a time (`ops.row_vector`) and they run as
# sub-tiles: 8 per thread (4x1048576: 61.9 -> 53.3 µs, 8 rows 59.1 -> 49.2; with 4 per thread
# 67.6 and 66.3; docs/benchmarks.md, log).
ELEMENTS_PER_THREAD_EXCLUSIVE_NARROW_VECTOR_TIME_MAJOR = 8
# V-trace's tiles of 16 values per thread (time-major span tiles, batch-major tiles of rows
# longer than the tile, now walked ones only: 147-166 registers) compile with at most this
# many: 4 programs of 4 warps (span) or 8 of 2 (look-back) per multiprocessor instead of 3 or 6.
# Batch-major look-back tiles (H200, 2026-12-01): 4x1048576 0.95 (bfloat16 0.94), 1x4194304
# 0.92, 8x524288 0.95, 64x32768 0.94 (0.93), 16x131072 0.94 (0.92); a cap of 112 0.99-1.02, 96
# 1.20-1.28 (spills); the walked tiles (120 registers) stay below it (caps of 96 and 80 there:
# 1.00-1.03).
MAX_REGISTERS_EXCLUSIVE_WIDE = 128
# The other batch-major tiles of rows longer than the tile that look back (measured when they
# held 2048 values on 4 warps; now TILE_ELEMENTS_LOOKBACK's one-warp tiles, measured with the
# cap), but Retrace's, and GAE's walked ones compile with at most this many: GAE's (84
# registers, 5 programs per multiprocessor; walked: 8 warps, 80 registers, 3 programs) and the
# forward scans' (91 registers) fit 8 programs (walked GAE 4). H200 (2026-12-01): GAE 4x1048576
# 0.90 (bfloat16 0.97), 1x4194304 0.89, 64x32768 0.92 (0.93), 16x131072 0.90, walked 512x4096
# 0.85 (1.01); eligibility traces 4x1048576 0.97 (0.98), 64x32768 0.95, episodic sums
# 4x1048576 0.97, 16x131072 0.92; discounted returns (66 registers) 0.99; a cap of 72 or 80
# 0.92-1.08, GAE's time-major span tiles at 80 or 64 1.00-1.16, the forward scans' walked
# tiles at 64 1.03 (docs/benchmarks.md, log).
MAX_REGISTERS_LONG_ROWS = 64
ELEMENTS_PER_THREAD_ACTIONS = 8
MAX_WARPS = 8
WINDOW = 16  # tiles read per step of the look-back: in the interpreter; on a GPU see `window`
# Look-back windows of one word per thread (one-row tiles) read only their DEPTH_WIDE nearest
# words per pass, the rest of the window masked: at 4x1048576, GAE 40.6 -> 37.1 µs, V-trace
# 70.5 -> 63.6, with or without cuts (reading 8 or 32 gained less). One-warp tiles too (their
# window of 32 words had been read whole): H200 (2026-12-01), V-trace 4x1048576 0.89,
# 8x524288 0.82, 1x4194304 0.95, 8x65536 0.92, bfloat16 without flags 0.82-0.87; one-warp tiles
# of small grids (GAE 8x4096, Retrace 4x8192 and others) 0.94-0.98 (docs/benchmarks.md, log).
# Windows of one warp's worth for tiles of several rows likewise when they lay at least
# DEPTH_WIDE_MIN_WINDOW words along time (tiles of at most 8 rows): time-major 4x1048576 0.94-0.96
# (the six scan estimators but Retrace, bfloat16 and without flags too; Retrace 0.88-0.91 in the
# grid), 2x2097152 0.95, 8x524288 0.98-0.99; windows of 2 words (tiles of 16 rows) 1.01-1.06, so
# those are read whole.
DEPTH_WIDE = 1
DEPTH_WIDE_MIN_WINDOW = 4
# Lambda-returns' and Retrace's time-major calls without truncation flags read the terminations
# in the truncation slot (`ops.Kernel.trunc_slot_always`); 0 builds them without the slot.
TRUNCATION_SLOT_ALWAYS = 1
# A batch-major program walks all tiles of its rows (passing the carry in registers, no
# look-back) when its rows' tiles alone give WALK_PROGRAMS_PER_SM programs per multiprocessor;
# Retrace's WALK_PROGRAMS_PER_SM_ACTIONS. Retrace's tiles of 128 steps x 1 row (4 warps), H200
# device time, walking against the look-back (2026-12-01): 1024x1024 0.87 (bfloat16 0.95),
# 896x1024 0.88, 768x1024 0.90 (bfloat16 1.00), 2048x512 0.91, 4096x256 0.93, 8192x256 0.90,
# 1024x2048 0.86; with fewer rows per multiprocessor, 640x4096 (4.8) 0.95, 512x4096 (3.9) 1.02
# (bfloat16 1.27). (With the 32-lane action blocks of the ninth session, the look-back had been
# faster up to 31 rows per multiprocessor; docs/benchmarks.md, log.)
WALK_PROGRAMS_PER_SM = 2
WALK_PROGRAMS_PER_SM_ACTIONS = 5
# Time-major tiles of at least 4 rows, but Retrace's, run as sub-tiles of one step per thread
# each (`sub_tiles`; at most this many): against whole tiles at 16384x1024 (H200), V-trace 187 ->
# 152 µs, lambda-returns 80 -> 67, discounted returns 82 -> 67, eligibility traces 57 -> 54, GAE
# bfloat16 110 -> 96, float32 108 -> 111; at 4x1048576, with rows loaded 4 at a time, lambda-
# returns 36.0 -> 30.3, eligibility traces 25.8 -> 23.8. Tiles of 2 rows: GAE 38 -> 67 µs at
# 2x2097152; Retrace's 3-D tiles: 2.3x slower (docs/benchmarks.md, log).
SUB_TILES_TIME_MAJOR = 8
# ... and at least this many where the tile's threads hold fewer values than 4 rows x this many
# steps (8 per thread: V-trace, GAE), each thread then holding 2 rows of a sub-tile: V-trace
# 16384x1024 150 -> 135 µs (bfloat16 144 -> 129), 1024x1024 to 64x32768 6-7% less time, 128x128
# 9.7 -> 8.0; one row per thread (8 sub-tiles) 153. Not in tiles of 16 steps but V-trace's: GAE
# and discounted returns at 16384x16 and 128x128 0.5-0.9 µs slower (docs/benchmarks.md, log).
SUB_TILES_MIN_TIME_MAJOR = 4
# ... and in tiles of at least SUB_TILES_WIDE_ROWS rows, at least SUB_TILES_MIN_WIDE: tiles of 16
# values per thread as 8 sub-tiles of 2 rows, not 4 of 4 (H200, 16384x1024: discounted returns
# 57.4 -> 53.3 µs, bfloat16 55.2 -> 49.6, lambda-returns bfloat16 60.6 -> 56.3; 2-8% at the other
# shapes but GAE bfloat16 16384x1024, 81.9 -> 84.0, and lambda-returns float32 there, 67.3 ->
# 67.7). Not in the long rows' tiles of 4 rows: 8-23% slower (docs/benchmarks.md, log).
SUB_TILES_WIDE_ROWS = 16
SUB_TILES_MIN_WIDE = 8
# Plans whose tiles divide the problem (T and the rows multiples of the tile) drop their masks
# (`even`) where that keeps the kernel's occupancy (`ops`, at a plan's first launch); 0 turns
# that off, for measurements (`python -m rl_triton.bench --rule EVEN_TILES=0`).
EVEN_TILES = 1
# A multiprocessor's limits (sm_80 and sm_90: the H200), for `occupancy`
REGISTERS_PER_SM = 65536
MAX_WARPS_PER_SM = 64
MAX_PROGRAMS_PER_SM = 32
SHARED_PER_SM = 228 * 1024
SHARED_RESERVED_PER_PROGRAM = 1024


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
    """Replace constants of the rule inside the block (`python -m rl_triton.bench --rule`), to
    check the rule against measurements. Plans built before keep their tiles."""
    unknown = sorted(set(values) - set(constants()))
    if unknown:
        raise KeyError(f"not constants of the tile rule: {unknown}")
    old = {k: globals()[k] for k in values}
    globals().update(values)
    try:
        yield
    finally:
        globals().update(old)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one after another


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def action_block(n_act: int, itemsize: int = 4) -> int:
    """Actions loaded at once along Retrace's action axis (`coefficients.retrace_coef`)."""
    most = MAX_ACTION_BLOCK_HALF_PRECISION if itemsize <= 2 else MAX_ACTION_BLOCK
    return min(_pow2(n_act), most)


def _tile(T: int, B: int, steps: int, time_contiguous: bool) -> tuple[int, int]:
    if time_contiguous:
        block_t = max(MIN_BLOCK_T, min(_pow2(T), steps))
        block_b = max(1, min(_pow2(B), steps // block_t))
    else:
        block_b = max(1, min(_pow2(B), MAX_ROWS_TIME_MAJOR, steps // MIN_BLOCK_T))
        block_t = max(MIN_BLOCK_T, min(_pow2(T), steps // block_b))
    return block_t, block_b


def _tiles(T: int, B: int, block_t: int, block_b: int) -> int:
    return -(-T // block_t) * -(-B // block_b)


def _fewer_rows(T: int, B: int, block_t: int, block_b: int, least: int, target: int) -> int:
    """`block_b` (a power of 2) halved, down to `least` rows, while the tiles number fewer
    than `target`: more programs for a grid too small to fill the GPU, each tile keeping its
    steps (no look-back added)."""
    while block_b // 2 >= least and _tiles(T, B, block_t, block_b) < target:
        block_b //= 2
    return block_b


def _fit(T: int, B: int, elements: int, per_step: int, time_contiguous: bool,
         device: torch.device) -> tuple[int, int, int]:
    """The tile of about `elements` values (halved down to MIN_TILE_ELEMENTS until the tiles
    give MIN_PROGRAMS_PER_SM programs per multiprocessor; batch-major tiles then halve their
    rows, down to FILL_MIN_ELEMENTS values, while they give fewer than FILL_TILES_PER_SM):
    block_t, block_b and the tiles."""
    target = MIN_PROGRAMS_PER_SM * _multiprocessors(device)
    while True:
        steps = max(1, elements // per_step)
        block_t, block_b = _tile(T, B, steps, time_contiguous)
        if _tiles(T, B, block_t, block_b) >= target or elements // 2 < MIN_TILE_ELEMENTS:
            break
        elements //= 2
    if time_contiguous:
        block_b = _fewer_rows(T, B, block_t, block_b, max(1, -(-FILL_MIN_ELEMENTS // block_t)),
                              FILL_TILES_PER_SM * _multiprocessors(device))
    return block_t, block_b, _tiles(T, B, block_t, block_b)


def _span(T: int, B: int, device: torch.device) -> tuple[int, int]:
    """A time-major tile of up to SPAN_STEPS steps x SPAN_ROWS rows, its rows halved (down to
    SPAN_MIN_ROWS) while the tiles give fewer programs than multiprocessors."""
    block_t = max(MIN_BLOCK_T, min(_pow2(T), SPAN_STEPS))
    block_b = _fewer_rows(T, B, block_t, min(_pow2(B), SPAN_ROWS), SPAN_MIN_ROWS,
                          _multiprocessors(device))
    return block_t, block_b


def choose(T: int, B: int, *, time_contiguous: bool, device: torch.device,
           n_act: int = 0, exclusive: bool = False, reverse: bool = False,
           aux: bool = False, itemsize: int = 4) -> TileConfig:
    """The tile for T steps x B rows; `n_act` > 0 for Retrace's action axis, `exclusive` for
    scans that also carry the exclusive value (V-trace), `reverse` for reverse scans, `aux` for
    writers that take per-step values of the builder (held in registers through the scan),
    `itemsize` the bytes of a floating-point input."""
    per_step = action_block(n_act, itemsize) if n_act else 1
    narrow = not time_contiguous and not n_act and B <= MAX_ROWS_NARROW
    # time-major tiles that hold more than the scan's pair per step: fewer values per thread;
    # GAE's tiles of 2-byte inputs only in grids of many programs (below)
    held = exclusive or (aux and not time_contiguous and not narrow)
    small = held or narrow
    steps_actions = TILE_STEPS_ACTIONS if time_contiguous else TILE_STEPS_ACTIONS_TIME_MAJOR
    elements = (steps_actions * per_step if n_act
                else TILE_ELEMENTS_SMALL if small else TILE_ELEMENTS)
    block_t, block_b, tiles = _fit(T, B, elements, per_step, time_contiguous, device)
    if (time_contiguous and not n_act and T > block_t
            and not _walks(B, block_b, n_act, device)):
        # batch-major rows that look back: one-warp tiles (TILE_ELEMENTS_LOOKBACK's comment)
        least = TILE_ELEMENTS_EXCLUSIVE_LOOKBACK if exclusive else TILE_ELEMENTS_LOOKBACK
        block_t, block_b, tiles = _fit(T, B, min(elements, least), per_step, time_contiguous,
                                       device)
    many = tiles >= MANY_PROGRAMS_PER_SM * _multiprocessors(device)
    if held and not exclusive and itemsize < 4 and not many:
        # bfloat16 GAE in grids of few programs per multiprocessor: 16 values per thread, not
        # 8 (H200, 512x4096 19.0 against 20.5 µs, 64x32768 19.0 against 20.9, 4096x128 9.5
        # against 10.0); in grids of many, 8 (16384x1024: 83.1 -> 77.1; docs/benchmarks.md, log)
        held = small = False
        block_t, block_b, tiles = _fit(T, B, TILE_ELEMENTS, per_step, time_contiguous, device)
        many = tiles >= MANY_PROGRAMS_PER_SM * _multiprocessors(device)
    span = (not time_contiguous and not n_act and not narrow
            and tiles < SPAN_PROGRAMS_PER_SM * _multiprocessors(device))
    if span:
        block_t, block_b = _span(T, B, device)
    # Time-major tiles do not walk their rows. At 16384x1024 (512 row tiles of 32 rows x 64
    # steps) the look-back took 17-30% less time than walking (GAE 154 against 189 µs, V-trace
    # 312 against 381); Retrace's (4096 row tiles of 4 rows x 16 steps x 32 actions) 3% less
    # (1206 against 1243; docs/benchmarks.md, log).
    walk = time_contiguous and T > block_t and _walks(B, block_b, n_act, device)
    if n_act:
        per_thread = min(ELEMENTS_PER_THREAD_ACTIONS, per_step)
    elif time_contiguous:
        looks_back = T > block_t and not walk
        # 2-byte inputs in grids of many programs per multiprocessor: the same bytes per thread
        # as 4-byte inputs (twice the values), but V-trace's
        wider = HALF_PRECISION_SCALE if itemsize <= 2 and many and not exclusive else 1
        per_thread = (ELEMENTS_PER_THREAD_LOOKBACK if looks_back
                      else ELEMENTS_PER_THREAD * wider)
    elif span:
        few = (T > block_t and _tiles(T, B, block_t, block_b)
               <= SPAN_FEW_PROGRAMS_PER_SM * _multiprocessors(device))
        per_thread = SPAN_ELEMENTS_PER_THREAD_AUX if aux or few else SPAN_ELEMENTS_PER_THREAD
    else:
        per_thread = (ELEMENTS_PER_THREAD_EXCLUSIVE_NARROW_VECTOR_TIME_MAJOR
                      if exclusive and narrow and vector_rows(B, time_contiguous, n_act > 0)
                      else ELEMENTS_PER_THREAD_EXCLUSIVE_NARROW_TIME_MAJOR if exclusive and narrow
                      else ELEMENTS_PER_THREAD_EXCLUSIVE_TIME_MAJOR if held
                      else ELEMENTS_PER_THREAD_SMALL_TIME_MAJOR if small
                      else ELEMENTS_PER_THREAD_REVERSE_TIME_MAJOR if reverse
                      else ELEMENTS_PER_THREAD_MANY_TIME_MAJOR if many
                      else ELEMENTS_PER_THREAD_TIME_MAJOR)
    warps = block_t * block_b * per_step // (32 * per_thread)
    cfg = TileConfig(block_t, block_b, min(MAX_WARPS, _pow2(max(1, warps))), WINDOW, walk,
                     max_registers=_max_registers(T, B, block_t, time_contiguous, span, walk,
                                                  n_act, exclusive, aux))
    if _overrides:
        cfg = replace(cfg, **_overrides)
    if time_contiguous:
        cfg = replace(cfg, sub=1)
    elif "sub" in _overrides:
        cfg = replace(cfg, sub=min(cfg.sub, cfg.block_t))
    elif vector_rows(B, time_contiguous, n_act > 0):
        cfg = replace(cfg, sub=sub_tiles(cfg, exclusive))
    win = window(cfg.window, cfg.block_b, cfg.num_warps, device)
    return replace(cfg, window=win, depth=min(win, cfg.depth or depth(win, cfg.block_b, device)))


def _max_registers(T: int, B: int, block_t: int, time_contiguous: bool, span: bool, walk: bool,
                   n_act: int, exclusive: bool, aux: bool) -> int:
    """The register cap of a tile (Triton's `maxnreg`; 0: none): V-trace's time-major tiles of
    8 values per thread, its tiles of 16 (span tiles, walked batch-major tiles of long rows) and
    its one-warp tiles of long rows that look back, the other batch-major tiles of long rows
    that look back (GAE's walked ones too), not Retrace's. Measured on the H200: more programs per
    multiprocessor without spilling (the constants above)."""
    long_rows = time_contiguous and T > block_t
    if exclusive and long_rows and not walk:
        return MAX_REGISTERS_EXCLUSIVE_LOOKBACK
    if exclusive and (span or long_rows):
        return MAX_REGISTERS_EXCLUSIVE_WIDE
    if exclusive and vector_rows(B, time_contiguous, n_act > 0):
        return MAX_REGISTERS_EXCLUSIVE_TIME_MAJOR
    if long_rows and not n_act and (aux or not walk):
        return MAX_REGISTERS_LONG_ROWS
    return 0


def _walks(B: int, block_b: int, n_act: int, device: torch.device) -> bool:
    """Whether a batch-major program walks all tiles of its rows (rather than one tile each,
    looking back) when they are longer than a tile: when its row tiles alone give
    WALK_PROGRAMS_PER_SM programs per multiprocessor (Retrace: WALK_PROGRAMS_PER_SM_ACTIONS)."""
    walk_programs = WALK_PROGRAMS_PER_SM_ACTIONS if n_act else WALK_PROGRAMS_PER_SM
    return -(-B // block_b) >= walk_programs * _multiprocessors(device)


def vector_rows(B: int, time_contiguous: bool, actions: bool) -> bool:
    """Time-major tiles of at least 4 rows, but Retrace's: their rows load 4 (or 2) at a time
    where the compiler cannot see that they may (`ops.row_vector`), and they run as sub-tiles
    (`sub_tiles`). Tiles of 2 rows as sub-tiles: GAE 44 -> 67 µs at 2x2097152; Retrace's: not
    measured with vector rows, 2.3x slower as sub-tiles (docs/benchmarks.md, log)."""
    return not time_contiguous and not actions and B >= 4


def sub_tiles(cfg: TileConfig, exclusive: bool) -> int:
    """Sub-tiles of a time-major tile (`scan.scan_chunk`): the steps each thread holds, up to
    SUB_TILES_TIME_MAJOR, so that a thread holds consecutive steps and the scan across threads
    sees one value per thread. Rows lie along lanes, up to 4 per thread (`scan_kernel`); tiles
    of fewer values per thread than 4 rows x SUB_TILES_MIN_TIME_MAJOR steps take that many
    sub-tiles all the same, down to 2 rows per thread (with 1, V-trace at 16384x1024 took 13%
    longer than with 2), but tiles of fewer than 32 steps whose scan is not `exclusive`; tiles
    of at least SUB_TILES_WIDE_ROWS rows likewise up to SUB_TILES_MIN_WIDE sub-tiles."""
    per_thread = cfg.block_t * cfg.block_b // (32 * cfg.num_warps)
    steps = per_thread // min(4, cfg.block_b)
    least = SUB_TILES_MIN_WIDE if cfg.block_b >= SUB_TILES_WIDE_ROWS else SUB_TILES_MIN_TIME_MAJOR
    least = (min(least, per_thread // 2)
             if exclusive or cfg.block_t >= 2 * MIN_BLOCK_T else 1)
    return max(1, min(SUB_TILES_TIME_MAJOR, max(steps, least), cfg.block_t))


def even(T: int, B: int, cfg: TileConfig) -> bool:
    """Whether every tile of a plan is full: T steps and B rows are multiples of the tile's.
    Such plans may compile without masks (`scan.scan_kernel`, `EVEN`): no predicated load or
    store, no select of padding. On a GPU the plan keeps the masks where the kernel without them
    takes more registers for fewer warps (`ops`; the compiler hoists loads it no longer has to
    predicate: V-trace's batch-major look-back tiles 168 -> 182 registers, 14-20% slower;
    docs/benchmarks.md, log)."""
    return bool(EVEN_TILES) and T % cfg.block_t == 0 and B % cfg.block_b == 0


def occupancy(registers: int, warps: int, shared: int) -> tuple[int, float]:
    """Programs of `warps` warps that fit on a multiprocessor, and the fraction of its warps
    they fill (registers are allocated per warp in units of 256)."""
    per_warp = -(-registers * 32 // 256) * 256
    programs = min((REGISTERS_PER_SM // per_warp) // warps, MAX_WARPS_PER_SM // warps,
                   MAX_PROGRAMS_PER_SM, SHARED_PER_SM // (shared + SHARED_RESERVED_PER_PROGRAM))
    return programs, programs * warps / MAX_WARPS_PER_SM


def window(least: int, block_b: int, num_warps: int, device: torch.device) -> int:
    """Tiles read per step of the look-back (`scan.look_back`). On a GPU its words
    (window x block_b) must be laid out so that no thread can see a word differently from the
    threads it decides with:
    - tiles of 2 to 32 rows: exactly one warp's worth of words, one per lane. Every warp holds
      the whole window and runs the look-back loop on its own, with nothing shared across warps
      inside the loop (no barrier), so warps that leave it at different passes are harmless.
      Faster than a wide window (no barriers) for these tiles; for one-row tiles, whose window
      would then be 32 tiles deep, 3x slower (docs/benchmarks.md, log);
    - one-row tiles (and tiles of more than 32 rows): one word per thread (Triton lays the
      window's loads out one word per thread: `scan_kernel` keeps the words' stride opaque), so
      that no word is held by two threads (each would read it at its own moment); more words
      per pass were slower (docs/benchmarks.md, log).
    Other sizes gave wrong carries on the H200 (first session: windows smaller than the thread
    count; later sweeps: windows of fewer words than a warp).
    The interpreter runs one thread: any window (`least`), which lets the tests walk long
    look-backs."""
    if device.type != "cuda":
        return least
    if 2 <= block_b <= 32:
        return 32 // block_b
    return max(least, _pow2(-(-32 * num_warps // block_b)))


def depth(window: int, block_b: int, device: torch.device) -> int:
    """Words of a look-back window read per pass (`scan.look_back`): a GPU window of one word per
    thread (one-row tiles, on one warp or several) reads its DEPTH_WIDE nearest only, and so does
    a window of one warp's worth for tiles of several rows that is at least DEPTH_WIDE_MIN_WINDOW
    words deep; shallower windows, and the interpreter's, read every word."""
    if device.type == "cuda" and (block_b == 1 or window * block_b > 32
                                  or window >= DEPTH_WIDE_MIN_WINDOW):
        return DEPTH_WIDE
    return window
