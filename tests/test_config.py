"""The one place where tiles, warps and the look-back window are chosen."""
from dataclasses import replace

import pytest
import torch

from rl_triton.scan import tiles as config

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def h200(monkeypatch):
    """Choose as for a GPU with 132 multiprocessors."""
    monkeypatch.setattr(config, "_multiprocessors", lambda device: 132)


def choose(T, B, time_contiguous, n_act=0):
    return config.choose(T, B, time_contiguous=time_contiguous, device=CPU, n_act=n_act)


def test_tile_follows_the_contiguous_axis():
    bm = choose(4096, 512, time_contiguous=True)  # [N, T]: long side along time
    assert bm.block_t >= 256 and bm.block_t * bm.block_b <= config.TILE_ELEMENTS
    tm = choose(1024, 16384, time_contiguous=False)  # [T, N]: long side along rows, capped
    assert tm.block_b == config.MAX_ROWS_TIME_MAJOR
    assert tm.block_t * tm.block_b <= config.TILE_ELEMENTS


def test_retrace_walks_its_actions_in_blocks():
    """Blocks of 8 actions (2 for 2-byte inputs), 128 steps x rows per tile (256 time-major),
    one block of one step per thread: 4 warps (8 time-major). Measured on the H200
    (docs/benchmarks.md): against one 32-lane block, 6-16% faster at 16384x1024 in float32,
    22% (bfloat16 batch-major) and 14% (time-major) in bfloat16; bfloat16 time-major blocks of
    2 against 8, 19% faster there since the loads run on the transposed tile."""
    assert config.action_block(18) == config.action_block(18, 4) == 8
    assert config.action_block(18, 2) == 2 and config.action_block(1, 2) == 1
    assert config.action_block(5) == 8 and config.action_block(1) == 1
    for itemsize in (4, 2):
        for tc in (True, False):
            r = config.choose(1024, 16384, time_contiguous=tc, device=CPU, n_act=18,
                              itemsize=itemsize, reverse=True)
            assert r.block_t * r.block_b == (128 if tc else 256)
            assert r.num_warps == (4 if tc else 8) and r.sub == 1, (itemsize, tc)
    plain, retrace = choose(4096, 512, True), choose(4096, 512, True, n_act=18)
    assert retrace.block_t * retrace.block_b < plain.block_t * plain.block_b


def test_small_problems_take_smaller_tiles_for_more_programs():
    big, small = choose(1 << 10, 16384, True), choose(128, 512, True)
    assert big.block_t * big.block_b == config.TILE_ELEMENTS
    assert (small.block_t, small.block_b) == (128, 2)  # MIN_TILE_ELEMENTS: 256 tiles


def test_batch_major_tiles_fill_the_multiprocessors_with_rows_not_steps():
    """At 128x128, tiles of MIN_TILE_ELEMENTS give 64 tiles for 132 multiprocessors: their rows
    halve to one (128 tiles), their steps stay the whole row (no look-back). H200: GAE 5.76 ->
    4.96 µs, V-trace 5.22 -> 5.09, the others within 2% (docs/benchmarks.md, log)."""
    tile = choose(128, 128, True)
    assert (tile.block_t, tile.block_b, tile.num_warps) == (128, 1, 1)
    with config.rule(FILL_TILES_PER_SM=0):
        assert (choose(128, 128, True).block_t, choose(128, 128, True).block_b) == (128, 2)
    # down to one warp of 4 values per thread: 16 x 8 for 64 rows of 16 steps, not 16 x 1
    assert (choose(16, 64, True).block_t, choose(16, 64, True).block_b) == (16, 8)
    # rows only: tiles of one row keep their steps, however few the tiles (64 here)
    with config.rule(FILL_TILES_PER_SM=0):
        before = choose(1024, 16, True)
    assert choose(1024, 16, True) == before and before.block_b == 1
    assert choose(128, 128, False).block_b > 1  # time-major tiles: `_span` decides


def test_short_and_tiny_shapes():
    c = choose(1, 1, time_contiguous=False)
    assert c.block_t == config.MIN_BLOCK_T and c.block_b == 1 and c.chunks(1) == 1


def test_long_rows_are_cut_into_tiles():
    for T, B in [(10**6, 1), (3 * 16 + 7, 2), (100, 3)]:
        for tc in (True, False):
            c = choose(T, B, tc)
            assert (c.chunks(T) - 1) * c.block_t < T <= c.chunks(T) * c.block_t
    assert choose(1 << 20, 4, True).chunks(1 << 20) >= 256  # a handful of rows fills the GPU


def test_warps_follow_the_tile():
    for T, B, n_act in [(4096, 512, 0), (128, 128, 0), (4096, 512, 18), (1, 1, 0)]:
        c = choose(T, B, True, n_act)
        assert 1 <= c.num_warps <= config.MAX_WARPS
        assert c.num_warps & (c.num_warps - 1) == 0


def test_vtrace_takes_smaller_tiles():
    """Measured on the H200 (docs/benchmarks.md): V-trace's scan carries the exclusive value too
    (4 values per step); its tiles hold 1024 values, the others' 2048: 4 warps against 8
    batch-major, 4 warps (8 values per thread) against 2 time-major."""
    def vtrace(T, B, tc):
        return config.choose(T, B, time_contiguous=tc, device=CPU, exclusive=True)
    for T, B, warps in [(1024, 16384, (4, 8)), (4096, 512, (4, 8))]:
        v, g = vtrace(T, B, True), choose(T, B, True)
        assert v.block_t * v.block_b == config.TILE_ELEMENTS_SMALL == 1024
        assert g.block_t * g.block_b == config.TILE_ELEMENTS == 2048
        assert (v.num_warps, g.num_warps) == warps
    with config.rule(MANY_PROGRAMS_PER_SM=1 << 30):  # a grid of few programs per multiprocessor
        v, g = vtrace(1024, 16384, False), choose(1024, 16384, False)
    assert v.block_t * v.block_b == 1024 and g.block_t * g.block_b == 2048
    assert v.block_b == g.block_b and (v.num_warps, g.num_warps) == (4, 2)


def test_batch_major_rows_that_look_back_take_one_warp_tiles():
    """Measured on the H200 (docs/benchmarks.md): batch-major rows longer than a tile that look
    back (not walked) in tiles of one warp: 512 steps (16 values per thread), 0.85-0.96 of the
    time of 2048 steps on 4 warps; V-trace's 256 steps at 80 registers, 0.75-0.89 of 1024 steps
    on 2 warps at 1 to 256 rows; walked rows (300x4096) keep their tiles (1.43-1.61)."""
    def vtrace(T, B):
        return config.choose(T, B, time_contiguous=True, device=CPU, exclusive=True,
                             reverse=True, aux=True)
    for T, B in [(1 << 20, 4), (1 << 22, 1), (1 << 19, 8), (4096, 3), (1025, 2), (1 << 17, 16),
                 (1 << 15, 64), (1 << 13, 256), (1 << 18, 12)]:
        c = vtrace(T, B)
        assert (c.block_t, c.block_b, c.num_warps, c.walk) == (256, 1, 1, False), (T, B)
        assert c.max_registers == config.MAX_REGISTERS_EXCLUSIVE_LOOKBACK == 80
        g = choose(T, B, True)
        if T >= 1 << 15:  # (smaller grids shrink their tiles for more programs)
            assert (g.block_t, g.block_b, g.num_warps, g.walk) == (512, 1, 1, False), (T, B)
            assert g.max_registers == config.MAX_REGISTERS_LONG_ROWS
    for T, B in [(4096, 300), (4096, 512)]:  # rows enough to walk: their tiles
        c, g = vtrace(T, B), choose(T, B, True)
        assert c.walk and (c.block_t, c.num_warps, c.max_registers) == (1024, 4, 128)
        assert g.walk and (g.block_t, g.num_warps) == (2048, 8)
    r = choose(1 << 20, 4, True, n_act=18)  # not Retrace's
    assert r.block_t * r.block_b == config.TILE_STEPS_ACTIONS and r.num_warps == 4
    assert config.choose(1 << 20, 4, time_contiguous=False, device=CPU,
                         exclusive=True).block_t * 4 == 1024  # nor time-major ones


def test_few_long_time_major_rows_take_smaller_tiles():
    """Measured on the H200 (docs/benchmarks.md): time-major tiles of at most 8 rows hold 1024
    values, 16 per thread (reverse scans 9-26% faster at 2 to 8 rows, 5-31% slower at 16)."""
    for B in (2, 4, 5, 8):
        c = choose(1 << 20, B, False)
        assert c.block_b == config._pow2(B) and c.block_t * c.block_b == 1024
        assert c.num_warps == 2
    c = choose(1 << 17, 16, False)
    assert c.block_b == 16 and c.block_t * c.block_b == 2048 and c.num_warps == 2
    r = choose(1 << 20, 4, False, n_act=18)  # Retrace's keep their steps x rows
    assert r.block_t * r.block_b == config.TILE_STEPS_ACTIONS_TIME_MAJOR


def test_vtrace_narrow_time_major_tiles_take_fewer_values_per_thread():
    """Measured on the H200 (docs/benchmarks.md): 4 per thread 15-23% faster at 2 to 8 rows,
    slower at 16; since rows of 4 and 8 load 4 at a time, as sub-tiles, 8 per thread there."""
    def vtrace(T, B):
        return config.choose(T, B, time_contiguous=False, device=CPU, exclusive=True)
    for B, per_thread in ((2, 4), (3, 4), (4, 8), (8, 8)):
        c = vtrace(1 << 20, B)
        assert c.block_t * c.block_b == 1024 and c.num_warps == 1024 // (32 * per_thread)
    with config.rule(SPAN_PROGRAMS_PER_SM=0):
        assert vtrace(1 << 17, 16).num_warps == 1024 // (32 * 8)
    assert vtrace(1024, 16384).num_warps == 4


def test_programs_walk_their_rows_when_row_tiles_fill_the_gpu():
    assert choose(4096, 512, True).walk  # 512 row tiles of 2 tiles each: walk
    assert choose(4096, 16384, True).walk
    assert not choose(1 << 20, 4, True).walk  # 4 rows: their tiles spread by look-back
    assert not choose(1024, 16384, True).walk  # one tile per row already


def test_time_major_tiles_look_back_rather_than_walk():
    """Measured on the H200 (docs/benchmarks.md): at 16384x1024 time-major, 512 row tiles of
    32 rows, the look-back beat walking the rows by 17-30%; Retrace's 4096 row tiles by 3%."""
    c = choose(1024, 16384, False)
    assert c.block_b == 32 and c.chunks(1024) > 1 and not c.walk
    assert not choose(4096, 65536, False).walk
    c = choose(1024, 16384, False, n_act=18)
    assert c.chunks(1024) > 1 and not c.walk


def test_retrace_walks_when_its_row_tiles_give_five_per_multiprocessor():
    """Walking beat the look-back from 768 rows (5.8 per multiprocessor) up, lost at 512 (3.9;
    bfloat16 by 27%) (H200, docs/benchmarks.md)."""
    assert choose(1024, 16384, True, n_act=18).walk
    for T, B in [(1024, 1024), (1024, 768), (256, 4096)]:
        c = choose(T, B, True, n_act=18)
        assert c.chunks(T) > 1 and c.walk, (T, B)
    for T, B in [(4096, 512), (4096, 640), (1 << 20, 4)]:
        c = choose(T, B, True, n_act=18)
        assert c.chunks(T) > 1 and not c.walk, (T, B)
    assert choose(4096, 512, True).walk  # the other estimators' threshold is lower


def test_rule_constants_can_be_changed_for_a_measurement():
    assert choose(4096, 512, True).walk
    with config.rule(WALK_PROGRAMS_PER_SM=4, WINDOW=64):  # 512 row tiles < 4 x 132
        c = choose(4096, 512, True)
        assert not c.walk and c.window == 64
    assert choose(4096, 512, True).walk and config.WINDOW == 16
    with pytest.raises(KeyError, match="not constants"):
        with config.rule(NO_SUCH_CONSTANT=1):
            pass


def test_override_is_scoped():
    with config.override(block_t=16, block_b=2, window=3):
        c = choose(1000, 5, True)
        assert (c.block_t, c.block_b, c.window) == (16, 2, 3)
    assert choose(1000, 5, True).block_t != 16


def test_look_back_window_on_a_gpu():
    """Tiles of several rows read one warp's worth of words per pass (one per lane, no barrier
    in the loop); one-row tiles one word per thread (no word held by two threads)."""
    cuda = torch.device("cuda")  # a device object only: nothing runs
    for block_b in (2, 4, 16, 32):
        for warps in (1, 2, 8):
            assert block_b * config.window(16, block_b, warps, cuda) == 32
    for block_b, warps in ((1, 8), (1, 2), (64, 8)):
        assert block_b * config.window(16, block_b, warps, cuda) == max(32 * warps, 16 * block_b)
    assert config.window(3, 4, 2, CPU) == 3  # the interpreter: any window


def test_look_back_depth():
    """Measured on the H200 (docs/benchmarks.md): windows of one word per thread read only their
    nearest word per pass, one-warp tiles' too (reading their 32 words: 1.02-1.23 of the
    time), and so do one warp's worth of words of tiles of at most 8 rows (time-major
    4x1048576: 0.94-0.96 of the time, 8x524288 0.98-0.99); of 16 rows it is read whole
    (1.01-1.06 with one word); the interpreter reads any window whole unless a test asks for
    less."""
    cuda = torch.device("cuda")  # a device object only: nothing runs
    assert config.depth(256, 1, cuda) == config.DEPTH_WIDE == 1
    assert config.depth(32, 1, cuda) == 1  # a one-warp, one-row tile's window
    assert config.depth(128, 1, cuda) == 1 and config.depth(8, 64, cuda) == 1
    for block_b in (2, 4, 8):
        assert config.depth(32 // block_b, block_b, cuda) == 1
    for block_b in (16, 32):
        assert config.depth(32 // block_b, block_b, cuda) == 32 // block_b
    assert config.depth(16, 1, CPU) == 16
    assert choose(1 << 20, 4, True).depth == 16  # the interpreter's window, whole
    with config.override(window=16, depth=3):
        assert choose(1 << 20, 4, True).depth == 3
    with config.override(window=2, depth=3):
        assert choose(1 << 20, 4, True).depth == 2  # never more than the window


def test_batch_major_look_back_tiles_take_16_values_per_thread():
    """Measured on the H200 (docs/benchmarks.md): batch-major tiles that look back (rows longer
    than a tile, not walked) on half the warps: 4-25% faster at 4x1048576 but for GAE float32."""
    for T, B in [(1 << 20, 4), (1 << 17, 16), (1 << 15, 64)]:
        c = choose(T, B, True)
        assert c.chunks(T) > 1 and not c.walk
        assert c.block_t * c.block_b == config.TILE_ELEMENTS_LOOKBACK
        assert c.num_warps == config.TILE_ELEMENTS_LOOKBACK // (32 * 16) == 1
    walked, one_tile = choose(4096, 512, True), choose(1024, 16384, True)
    assert walked.walk and walked.num_warps == 8
    assert one_tile.chunks(1024) == 1 and one_tile.num_warps == 8
    assert choose(1 << 20, 4, False).num_warps == 2  # time-major: unchanged


def test_time_major_reverse_scans_take_16_values_per_thread():
    """Measured on the H200 (docs/benchmarks.md): time-major reverse scans (forward over steps in
    decreasing t) 15-23% faster with 16 values per thread than 32; forward scans slower, but in
    grids of many programs per multiprocessor (eligibility traces 5% faster at 16384x1024)."""
    def tm(T, B, reverse):
        return config.choose(T, B, time_contiguous=False, device=CPU, reverse=reverse)
    for T, B, warps, many in [(1024, 16384, 4, True), (1024, 1024, 2, False),
                              (4096, 512, 4, False)]:
        with config.rule(SPAN_PROGRAMS_PER_SM=0):  # the grids of few programs span otherwise
            r, f = tm(T, B, True), tm(T, B, False)
        assert (r.block_t, r.block_b) == (f.block_t, f.block_b)
        assert (T // r.block_t * B // r.block_b >= config.MANY_PROGRAMS_PER_SM * 132) == many
        assert (r.num_warps, f.num_warps) == (warps, warps if many else warps // 2)
    with config.rule(MANY_PROGRAMS_PER_SM=1 << 30):
        assert (tm(1024, 16384, True).num_warps, tm(1024, 16384, False).num_warps) == (4, 2)
    bm = config.choose(1024, 16384, time_contiguous=True, device=CPU, reverse=True)
    assert bm == choose(1024, 16384, True)  # batch-major tiles: unchanged


def test_time_major_tiles_in_grids_of_few_programs_span_128_steps():
    """Time-major grids of fewer than SPAN_PROGRAMS_PER_SM programs per multiprocessor (with the
    tiles of the rest of the rule) take tiles of 128 steps x 16 rows, 32 values per thread (16
    for GAE and V-trace, whose writers hold per-step values through the scan; V-trace's capped
    at MAX_REGISTERS_EXCLUSIVE_WIDE registers), rows halved down to 2 while the tiles are fewer
    than the multiprocessors; 16 values per thread for every estimator where the tiles look
    back in a grid of at most SPAN_FEW_PROGRAMS_PER_SM programs per multiprocessor. Measured
    on the H200 (docs/benchmarks.md, grids before and after): 128x128 18-28% faster, 4096x128
    9-25%, 1024x1024 up to 13%, 64x32768 up to 12%, 16x131072 2-9%, 512x4096 up to 6%
    (V-trace 1-3% slower at 1024x1024 and 512x4096, then 5-8% faster on 4 warps with the cap);
    at 16384x1024 (62 programs per multiprocessor) such tiles were 8-41% slower. On 4 warps
    where few programs look back: 1024x1024 and 2048x512 2-6% faster, 512x4096 (1024
    programs) 4-11% slower."""
    def tm(T, B, **kw):
        return config.choose(T, B, time_contiguous=False, device=CPU, reverse=True, **kw)
    for T, B in [(128, 4096), (1024, 1024), (4096, 512), (32768, 64), (131072, 16),
                 (512, 2048), (512, 1024)]:
        c, gae = tm(T, B), tm(T, B, aux=True)
        few = T > 128 and c.chunks(T) * B // 16 <= config.SPAN_FEW_PROGRAMS_PER_SM * 132
        assert few == ((T, B) in [(1024, 1024), (512, 2048), (512, 1024)]), (T, B)
        assert (c.block_t, c.block_b, c.num_warps, c.sub) == (128, 16, 4 if few else 2, 8), (T, B)
        assert config.choose(T, B, time_contiguous=False, device=CPU) == c  # forward scans
        with config.rule(SPAN_FEW_PROGRAMS_PER_SM=0):
            assert tm(T, B).num_warps == 2
        assert (gae.block_t, gae.block_b, gae.num_warps, gae.max_registers) == (128, 16, 4, 0)
        vtrace = tm(T, B, exclusive=True, aux=True)
        assert vtrace == replace(gae, max_registers=config.MAX_REGISTERS_EXCLUSIVE_WIDE)
        assert tm(T, B, itemsize=2, aux=True) == gae
        with config.rule(SPAN_PROGRAMS_PER_SM=0):  # rows first, up to 32
            assert tm(T, B).block_b == min(B, 32) and tm(T, B) != c
    c = tm(128, 128)  # 8 tiles of 16 rows < 132 multiprocessors: 64 tiles of 2 rows
    assert (c.block_t, c.block_b, c.num_warps, c.sub, c.chunks(128)) == (128, 2, 1, 4, 1)
    assert tm(100, 7) == tm(100, 7, aux=True) != tm(128, 128)  # narrow: the rule above
    assert (tm(16, 16384).block_t, tm(16, 16384).block_b) == (16, 16)  # as before
    for T, B in [(1024, 16384), (1 << 20, 4)]:  # many programs; narrow rows
        with config.rule(SPAN_PROGRAMS_PER_SM=0):
            old = tm(T, B), tm(T, B, aux=True)
        assert (tm(T, B), tm(T, B, aux=True)) == old
    assert tm(128, 4096, n_act=18).block_t * tm(128, 4096, n_act=18).block_b == 256  # Retrace
    assert config.choose(128, 4096, time_contiguous=True, device=CPU).block_t == 128  # [N, T]


def test_time_major_tiles_hold_consecutive_steps_per_thread():
    """Sub-tiles: as many as each thread's steps (rows along lanes, 4 per thread), up to
    SUB_TILES_TIME_MAJOR, and at least SUB_TILES_MIN_TIME_MAJOR while each thread keeps 2 rows
    of a sub-tile (in tiles of 32 steps or more, or V-trace's), SUB_TILES_MIN_WIDE in tiles of
    16 rows or more; none for batch-major or Retrace tiles, nor below 4 rows. GAE's time-major
    tiles (`aux`) take 1024 values at 8 per thread, as V-trace's, for 4-byte inputs. Measured
    on the H200 (docs/benchmarks.md): V-trace 19%, lambda-returns and discounted returns 16-19%
    faster at time-major 16384x1024; at 2 rows GAE 75% slower; V-trace 10% and GAE 13% faster
    again with 4 sub-tiles of 2 rows and GAE's smaller tiles; discounted returns 7% faster
    with 8 sub-tiles of 2 rows than with 4 of 4, but GAE 23% slower in tiles of 4 rows."""
    def tm(T, B, **kw):
        return config.choose(T, B, time_contiguous=False, device=CPU, **kw)
    lam, fwd = tm(1024, 16384, reverse=True), tm(1024, 16384)
    gae = tm(1024, 16384, reverse=True, aux=True)
    vtrace = tm(1024, 16384, reverse=True, exclusive=True, aux=True)
    assert (lam.block_t, lam.block_b, lam.num_warps, lam.sub) == (64, 32, 4, 8)  # 2 rows each
    with config.rule(SUB_TILES_WIDE_ROWS=64):
        assert tm(1024, 16384, reverse=True).sub == 4  # 4 rows each
    assert (fwd.num_warps, fwd.sub) == (4, 8)  # many programs: 16 per thread, 2 rows each
    with config.rule(MANY_PROGRAMS_PER_SM=1 << 30):
        assert (tm(1024, 16384).num_warps, tm(1024, 16384).sub) == (2, 8)  # 32: 4 rows each
    assert (gae.block_t, gae.block_b, gae.num_warps, gae.sub) == (32, 32, 4, 4)  # 2 rows each
    assert (vtrace.block_t, vtrace.num_warps, vtrace.sub) == (32, 4, 4)
    with config.rule(SPAN_PROGRAMS_PER_SM=0):  # 128x128 spans otherwise (128 x 4, 4 sub-tiles)
        assert tm(128, 128).sub == 2  # 16x16 on one warp: 8 lanes along time, 4 rows each
        assert tm(128, 128, reverse=True, exclusive=True).sub == 4  # V-trace's: 2 rows each
    assert tm(1 << 20, 4, reverse=True).sub == 4  # 256 x 4 on 2 warps
    assert tm(1 << 20, 4, reverse=True, exclusive=True).sub == 4  # 256 x 4 on 4 warps: 2 rows
    assert tm(1 << 20, 4, reverse=True, aux=True) == tm(1 << 20, 4, reverse=True)  # narrow
    assert tm(1 << 21, 2, reverse=True).sub == tm(1 << 21, 3, reverse=True).sub == 1
    assert tm(1024, 16384, n_act=18).sub == 1  # Retrace
    assert choose(1024, 16384, True).sub == 1
    assert config.choose(1024, 16384, time_contiguous=True, device=CPU, reverse=True,
                         aux=True) == choose(1024, 16384, True)  # batch-major: unchanged
    with config.rule(SUB_TILES_TIME_MAJOR=2):
        assert tm(1024, 16384).sub == 2
    with config.rule(SUB_TILES_MIN_TIME_MAJOR=1, SUB_TILES_MIN_WIDE=1):
        assert tm(1024, 16384, reverse=True, aux=True).sub == 2
    with config.override(block_t=16, block_b=32, num_warps=4):
        assert tm(1024, 16384).sub == 1  # recomputed for the forced tile: one step per thread
        assert tm(1024, 16384, reverse=True, exclusive=True).sub == 2  # V-trace: 2 rows x 2
    with config.override(block_t=16, block_b=32, num_warps=8):
        assert tm(1024, 16384).sub == 1  # 2 values per thread: one step
    with config.override(sub=32):
        assert tm(1024, 16384).sub == 32 and choose(1024, 16384, True).sub == 1


def test_two_byte_inputs_take_twice_the_values_per_thread_in_large_grids():
    """Batch-major bfloat16 tiles without look-back load as many bytes per thread as float32
    ones where the grid holds at least MANY_PROGRAMS_PER_SM programs per multiprocessor, but
    V-trace's; measured on the H200 (docs/benchmarks.md): GAE and lambda-returns at 16384x1024
    10-11% faster, smaller grids 3-9% slower, V-trace 14-43% slower. Time-major bfloat16 GAE
    tiles take float32's 8 values per thread in those grids only."""
    def pick(T, B, time_contiguous, itemsize, **kw):
        return config.choose(T, B, time_contiguous=time_contiguous, device=CPU,
                             itemsize=itemsize, reverse=True, **kw)
    bm32, bm16 = pick(1024, 16384, True, 4), pick(1024, 16384, True, 2)
    assert (bm32.block_t, bm32.block_b) == (bm16.block_t, bm16.block_b) == (1024, 2)
    assert (bm32.num_warps, bm16.num_warps) == (8, 4)
    # time-major: GAE's bfloat16 tiles are its float32 ones (1024 values at 8 per thread) in
    # grids of many programs (H200: 16384x1024 7% faster), else the other estimators' (2048
    # values at 16 per thread; 512x4096, 64x32768 and 4096x128 5-10% faster)
    tm32, tm16 = pick(1024, 16384, False, 4, aux=True), pick(1024, 16384, False, 2, aux=True)
    assert (tm32.block_t, tm32.num_warps, tm32.sub) == (32, 4, 4) and tm16 == tm32
    for T, B in [(4096, 512), (32768, 64), (128, 4096), (1024, 1024)]:
        with config.rule(SPAN_PROGRAMS_PER_SM=0):  # these grids span otherwise
            few = pick(T, B, False, 2, aux=True)
            assert few == pick(T, B, False, 2) != pick(T, B, False, 4, aux=True), (T, B)
    with config.rule(MANY_PROGRAMS_PER_SM=1 << 30):
        assert pick(1024, 16384, False, 2, aux=True) == pick(1024, 16384, False, 2)
    for T, B, tc in [(1024, 1024, True), (4096, 512, True)]:  # 4-8 per multiprocessor
        assert pick(T, B, tc, 2, aux=True) == pick(T, B, tc, 4, aux=True), (T, B)
    assert (pick(1024, 16384, True, 2, exclusive=True, aux=True)
            == pick(1024, 16384, True, 4, exclusive=True, aux=True))  # V-trace
    assert pick(1 << 20, 4, True, 2) == pick(1 << 20, 4, True, 4)  # look-back tiles
    with config.rule(MANY_PROGRAMS_PER_SM=4):
        assert pick(1024, 1024, True, 2).num_warps == 2


def test_occupancy():
    """Programs per multiprocessor from registers (per warp, in units of 256), warps, programs
    and shared memory (H200 limits), for register counts of the grid's kernels."""
    assert config.occupancy(168, 2, 2048) == (6, 0.1875)  # V-trace's batch-major look-back tiles
    assert config.occupancy(56, 4, 2048) == (9, 0.5625)  # GAE's time-major tiles without masks
    assert config.occupancy(64, 4, 2048) == (8, 0.5)
    assert config.occupancy(32, 1, 0) == (32, 0.5)  # at most 32 programs
    assert config.occupancy(32, 4, 100 * 1024) == (2, 0.125)  # shared memory


def test_full_tiles_keep_their_masks_where_dropping_them_costs_warps():
    """A plan whose tiles divide the problem drops its masks unless the kernel without them fits
    fewer warps on a multiprocessor (registers of the two compiled kernels, `ops`)."""
    from types import SimpleNamespace

    from rl_triton._triton import ops

    def keeps(regs_even, regs_masked, warps):
        def compile(meta):
            regs = regs_even if meta["EVEN"] else regs_masked
            return SimpleNamespace(n_regs=regs, metadata=SimpleNamespace(shared=2048))
        return ops.even_keeps_occupancy(None, None, {"EVEN": True, "num_warps": warps},
                                        compile=compile)

    assert keeps(56, 64, 4)  # fewer registers, more warps
    assert keeps(165, 155, 2)  # more registers, the same 6 programs
    assert keeps(72, 72, 4)
    assert not keeps(182, 168, 2)  # 5 programs instead of 6
    assert config.even(1024, 16384, config.TileConfig(32, 32, 4))
    assert not config.even(1000, 16384, config.TileConfig(32, 32, 4))
    assert not config.even(1024, 100, config.TileConfig(32, 32, 4))
    with config.rule(EVEN_TILES=0):
        assert not config.even(1024, 16384, config.TileConfig(32, 32, 4))


def test_full_tiles_keep_their_masks_where_registers_cannot_be_read(monkeypatch):
    """Registers come from a private attribute of Triton's compiled kernels (`ops.registers`):
    where a Triton does not have it, the masks are kept, with one warning per process."""
    from types import SimpleNamespace

    import pytest

    from rl_triton._triton import ops

    monkeypatch.setattr(ops, "_UNREADABLE", [])
    kernels = {"no n_regs": SimpleNamespace(metadata=SimpleNamespace(shared=2048)),
               "n_regs None": SimpleNamespace(n_regs=None, metadata=SimpleNamespace(shared=0)),
               "no metadata": SimpleNamespace(n_regs=56)}
    with pytest.warns(RuntimeWarning, match="keep their masks") as warned:
        for kernel in kernels.values():
            assert not ops.even_keeps_occupancy(None, None, {"EVEN": True, "num_warps": 4},
                                                compile=lambda meta: kernel)
    assert len(warned) == 1
    assert ops.registers(SimpleNamespace(n_regs=56, metadata=SimpleNamespace(shared=0))) \
        == (56, 0)


def test_register_caps():
    """Tiles that hold per-step values through the scan cap their registers (Triton's
    `maxnreg`) where the H200 measured a gain (docs/benchmarks.md, log):
    - V-trace's time-major tiles of 8 values per thread, in grids of many programs and the
      narrow ones of 4 to 8 rows: MAX_REGISTERS_EXCLUSIVE_TIME_MAJOR (16384x1024 122.9 -> 116.7
      µs, 4x1048576 0.92 of the time); not at 2 rows (1.02);
    - V-trace's tiles of 16 values per thread, time-major span tiles and walked batch-major
      tiles of rows longer than the tile: MAX_REGISTERS_EXCLUSIVE_WIDE (0.92-0.95); its
      one-warp tiles of such rows that look back: MAX_REGISTERS_EXCLUSIVE_LOOKBACK (0.96 of the
      time uncapped);
    - the other batch-major tiles of rows longer than the tile that look back, and GAE's
      walked ones: MAX_REGISTERS_LONG_ROWS (0.85-0.99);
    - nothing else: not Retrace's tiles, not the forward scans' walked tiles (1.03), and caps
      on the other estimators' time-major tiles gained at most 2%."""
    def choose(T, B, tc, **kw):
        return config.choose(T, B, time_contiguous=tc, device=CPU, reverse=True, **kw)

    def vtrace(T, B, tc, **kw):
        return choose(T, B, tc, exclusive=True, aux=True, **kw).max_registers

    def gae(T, B, tc, **kw):
        return choose(T, B, tc, aux=True, **kw).max_registers

    def forward(T, B, tc, **kw):
        return config.choose(T, B, time_contiguous=tc, device=CPU, **kw).max_registers

    assert config.MAX_REGISTERS_EXCLUSIVE_TIME_MAJOR == 80
    assert config.MAX_REGISTERS_EXCLUSIVE_WIDE == 128
    assert config.MAX_REGISTERS_LONG_ROWS == 64
    for itemsize in (4, 2):
        for T, B in [(1024, 16384), (512, 16384), (1 << 20, 4), (1 << 19, 8)]:  # many; narrow
            assert vtrace(T, B, False, itemsize=itemsize) == 80, (T, B)
        for T, B in [(1 << 21, 2), (1 << 22, 1)]:  # narrow, 1-2 rows
            assert vtrace(T, B, False, itemsize=itemsize) == 0, (T, B)
        for T, B in [(1024, 1024), (4096, 512), (32768, 64), (128, 4096)]:  # span
            assert vtrace(T, B, False, itemsize=itemsize) == 128, (T, B)
        for T, B in [(1 << 20, 4), (32768, 64), (131072, 16), (1 << 22, 1)]:  # look-back
            assert choose(T, B, True, exclusive=True, aux=True).walk is False
            assert vtrace(T, B, True, itemsize=itemsize) == 80, (T, B)
            assert gae(T, B, True, itemsize=itemsize) == 64, (T, B)
            assert forward(T, B, True, itemsize=itemsize) == 64, (T, B)
            assert choose(T, B, True, itemsize=itemsize).max_registers == 64  # reverse scans
            assert choose(T, B, True, n_act=18, itemsize=itemsize).max_registers == 0  # Retrace
        assert choose(4096, 512, True, aux=True).walk and config.choose(
            4096, 512, time_contiguous=True, device=CPU).walk  # walked rows
        assert gae(4096, 512, True, itemsize=itemsize) == 64
        assert vtrace(4096, 512, True, itemsize=itemsize) == 128
        assert forward(4096, 512, True, itemsize=itemsize) == 0
        for T, B in [(1024, 16384), (1024, 1024), (128, 4096), (16, 16384)]:  # one tile per row
            assert vtrace(T, B, True, itemsize=itemsize) == gae(T, B, True, itemsize=itemsize) == 0
            assert forward(T, B, True, itemsize=itemsize) == 0
        for T, B in [(1024, 16384), (1024, 1024), (1 << 20, 4)]:  # time-major
            assert gae(T, B, False, itemsize=itemsize) == 0, (T, B)
            assert forward(T, B, False, itemsize=itemsize) == 0, (T, B)
            assert choose(T, B, False, n_act=18, itemsize=itemsize).max_registers == 0
    with config.rule(MAX_REGISTERS_EXCLUSIVE_TIME_MAJOR=0, MAX_REGISTERS_EXCLUSIVE_WIDE=0,
                     MAX_REGISTERS_LONG_ROWS=0, MAX_REGISTERS_EXCLUSIVE_LOOKBACK=0):
        assert vtrace(1024, 16384, False) == vtrace(1024, 1024, False) == 0
        assert vtrace(1 << 20, 4, True) == gae(1 << 20, 4, True) == forward(1 << 20, 4, True) == 0
