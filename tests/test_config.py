"""The tile rule (`tiles.choose`): the invariants every tile it emits must keep, over shapes,
layouts and every estimator's kernel flags, and a handful of decisions whose reason is short.
(That a rewrite of the rule changes no decision is `tools/tile_rule_diff.py`'s to check.)"""
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_triton.scan import tiles

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # device objects only: nothing runs
SMS = 132  # the H200's multiprocessors
SHARED_LIMIT = 227 * 1024  # bytes of shared memory a program may take on the H200

# the flags `ops.Launch` passes for each kernel (`ops.Kernel`)
KERNELS = {
    "gae": dict(reverse=True, aux=True),
    "lambda_returns": dict(reverse=True),  # discounted returns, the reverse linear scan alike
    "vtrace": dict(reverse=True, exclusive=True, aux=True),
    "retrace": dict(reverse=True, n_act=18),
    "retrace_masked": dict(reverse=True, exclusive=True, aux=True, n_act=18),
    "forward": dict(),  # eligibility traces, episodic sums, the forward linear scan
    "backward": dict(exclusive=True, aux=True),  # GAE's, lambda-returns', discounted returns'
    "vtrace_backward": dict(exclusive=True, aux=True, heavy=True),
    "retrace_backward": dict(exclusive=True, aux=True, n_act=18),
}


@pytest.fixture(autouse=True, scope="module")
def h200():
    """Choose as for an H200 on a CUDA device; the interpreter (CPU) runs one program at a
    time."""
    real = tiles._multiprocessors
    tiles._multiprocessors = lambda device: SMS if device.type == "cuda" else 1
    yield
    tiles._multiprocessors = real


def dim(bits):
    """Sizes up to 2**bits, spread over every power of two, with their neighbours."""
    return st.integers(0, bits).flatmap(
        lambda e: st.integers(max(1, 2 ** e // 2), min(2 ** bits, 2 ** e + 1)))


@st.composite
def calls(draw, T=dim(24), B=dim(20)):
    flags = dict(draw(st.sampled_from(list(KERNELS.values()))))
    if flags.get("n_act"):
        flags["n_act"] = draw(st.sampled_from([1, 2, 3, 5, 18, 64, 1000]))
    return dict(T=draw(T), B=draw(B), time_contiguous=draw(st.booleans()),
                device=draw(st.sampled_from([CUDA, CUDA, CPU])),
                itemsize=draw(st.sampled_from([4, 2, 8])), **flags)


def choose(T, B, time_contiguous, device=CUDA, **flags):
    return tiles.choose(T, B, time_contiguous=time_contiguous, device=device, **flags)


def programs(cfg, T, B):
    """The grid `ops.Launch` launches: one program per tile, or per row tile where it walks."""
    chunks = cfg.chunks(T)
    return -(-B // cfg.block_b) * (chunks if chunks > 1 and not cfg.walk else 1)


def pow2(n):
    return n >= 1 and n & (n - 1) == 0


def check(call):
    cfg = tiles.choose(**call)
    T, B, tc, device = call["T"], call["B"], call["time_contiguous"], call["device"]
    n_act = call.get("n_act", 0)
    block_a = tiles.action_block(n_act, call["itemsize"]) if n_act else 1
    # bounds
    assert all(pow2(v) for v in (cfg.block_t, cfg.block_b, cfg.num_warps, cfg.window,
                                 cfg.depth, cfg.sub)), cfg
    assert cfg.block_t >= 16 and 1 <= cfg.num_warps <= 8
    assert cfg.max_registers == 0 or 32 <= cfg.max_registers <= 255
    # every program has work: no tile larger than the problem rounded up to a power of two
    # (the minimal 16 steps aside), so none starts past T or B
    assert cfg.block_t <= max(16, tiles._pow2(T))
    assert cfg.block_b <= tiles._pow2(B)
    assert (cfg.chunks(T) - 1) * cfg.block_t < T and (-(-B // cfg.block_b) - 1) * cfg.block_b < B
    # shared memory, conservatively: every value of the tile through the scan (the pair, the
    # exclusive pair, the held value) at 8 bytes, for each action of a block
    values = 2 + 2 * call.get("exclusive", False) + call.get("aux", False)
    assert values * 8 * cfg.block_t * cfg.block_b * block_a <= SHARED_LIMIT
    # registers: at most 2048 values per tile, 32 per thread
    assert cfg.block_t * cfg.block_b * block_a <= 2048
    assert cfg.block_t * cfg.block_b * block_a <= 32 * 32 * cfg.num_warps
    # the tile's long side follows memory: whole rows or >= 256 steps batch-major (32 for
    # Retrace, whose steps hold their actions), >= 2 rows or all of them time-major
    if tc:
        most = 32 if n_act else 256
        assert cfg.block_t >= min(max(16, tiles._pow2(T)), most)
    else:
        assert cfg.block_b >= min(tiles._pow2(B), 2) and cfg.block_b <= 32
    # walking: batch-major rows longer than a tile, when their row tiles alone fill the GPU
    if cfg.walk:
        least = (tiles.WALK_PROGRAMS_PER_SM_ACTIONS if n_act else tiles.WALK_PROGRAMS_PER_SM)
        assert tc and cfg.chunks(T) > 1
        assert -(-B // cfg.block_b) >= least * tiles._multiprocessors(device)
    # the GPU is kept busy: a program per multiprocessor once the problem has a tile's worth
    # of values for each
    assert programs(cfg, T, B) >= min(tiles._multiprocessors(device), -(-T * B // 2048))
    # sub-tiles: time-major tiles of >= 4 rows only (not Retrace's), dividing the tile
    assert cfg.block_t % cfg.sub == 0
    assert cfg.sub == 1 or tiles.vector_rows(B, tc, n_act > 0)
    # the look-back window (`window`'s constraints) and its depth
    if device.type == "cuda":
        words = cfg.window * cfg.block_b
        if 2 <= cfg.block_b <= 32:
            assert words == 32  # one warp's worth: one word per lane
        else:
            assert words >= 32 * cfg.num_warps  # one word per thread
        assert cfg.depth in (tiles.DEPTH_WIDE, cfg.window)
    else:
        assert cfg.window == cfg.depth == tiles.WINDOW  # the interpreter reads it whole
    assert 1 <= cfg.depth <= cfg.window
    return cfg


@settings(max_examples=2000, deadline=None)
@given(calls())
def test_every_tile_keeps_the_invariants(call):
    check(call)


@settings(max_examples=300, deadline=None)
@given(calls(T=st.integers(2 ** 20, 2 ** 24), B=st.integers(1, 16)))
def test_long_rows_are_split_across_the_gpu(call):
    """A few rows of 2^20 steps or more: at least one program per multiprocessor."""
    cfg = check(dict(call, device=CUDA))
    assert programs(cfg, call["T"], call["B"]) >= SMS


@settings(max_examples=300, deadline=None)
@given(calls(), calls())
def test_the_rule_is_deterministic(call, other):
    first = tiles.choose(**call)
    tiles.choose(**other)
    assert tiles.choose(**call) == first


def test_the_shared_memory_model_rejects_the_tile_that_failed():
    """A 1024 x 32 float32 pair tile needed 256 KB of shared memory and failed to launch."""
    assert 2 * 4 * 1024 * 32 > SHARED_LIMIT


def test_the_grid():
    """The benchmark grid, every kernel, both layouts, float32 and bfloat16."""
    for N, T in [(16384, 16), (4096, 128), (16384, 1024), (128, 128), (1024, 1024),
                 (512, 4096), (64, 32768), (16, 131072), (4, 1048576)]:
        for flags in KERNELS.values():
            for tc in (True, False):
                for itemsize in (4, 2):
                    check(dict(T=T, B=N, time_contiguous=tc, device=CUDA, itemsize=itemsize,
                               **flags))


def test_time_major_rows_look_back_and_never_walk():
    """Time-major 16384x1024 GAE: 512 row tiles of 32 rows, which look back (17-30% faster than
    walking the rows)."""
    c = choose(1024, 16384, False, **KERNELS["gae"])
    assert c.block_b == 32 and c.chunks(1024) > 1 and not c.walk


def test_batch_major_rows_walk_when_their_tiles_fill_the_gpu():
    """512 rows of 4096 steps give 512 row tiles, >= 2 per multiprocessor: each program walks
    its row. 4 rows of 2^20 steps cannot: one-warp tiles of 512 steps look back, registers
    capped (GAE 4x1048576 0.89 and 0.90 of the time)."""
    assert choose(4096, 512, True, **KERNELS["gae"]).walk
    c = choose(1 << 20, 4, True, **KERNELS["gae"])
    assert (c.block_t, c.block_b, c.num_warps, c.walk) == (512, 1, 1, False)
    assert c.max_registers == tiles.MAX_REGISTERS_LONG_ROWS


def test_retrace_walks_from_five_row_tiles_per_multiprocessor():
    """Retrace: walking beat the look-back at 768x1024 (5.8 row tiles per multiprocessor), lost at
    512x4096 (3.9)."""
    assert choose(1024, 768, True, **KERNELS["retrace"]).walk
    assert not choose(4096, 512, True, **KERNELS["retrace"]).walk


def test_small_batch_major_grids_take_one_row_per_tile():
    """128x128: 128 tiles of 128 x 1, one per multiprocessor, rather than 64 of 128 x 2."""
    c = choose(128, 128, True)
    assert (c.block_t, c.block_b, c.num_warps) == (128, 1, 1)


def test_vtrace_tiles_hold_half_the_values():
    """V-trace's scan holds 4 values per step: 1024 values per tile against 2048 (16384x1024,
    132 against 148 µs)."""
    v, g = choose(1024, 16384, True, **KERNELS["vtrace"]), choose(1024, 16384, True)
    assert (v.block_t * v.block_b, g.block_t * g.block_b) == (1024, 2048)


def test_vtrace_backward_tiles_hold_fewer_values_per_thread():
    """V-trace's backward holds 6 or more values per step beside the scan's 4 (`heavy`):
    time-major tiles on 8 warps, one sub-tile per step a thread holds (512x4096: 85 -> 50 µs);
    batch-major tiles that look back capped at 128 registers, not 80 (64x32768: 121 -> 60 µs).
    The other backward kernels keep their tiles."""
    c = choose(4096, 512, False, **KERNELS["vtrace_backward"])
    assert (c.block_t, c.block_b, c.num_warps, c.sub) == (128, 16, 8, 2)
    c = choose(1024, 16384, False, **KERNELS["vtrace_backward"])
    assert (c.block_t, c.block_b, c.num_warps, c.sub) == (32, 32, 8, 1)
    c = choose(32768, 64, True, **KERNELS["vtrace_backward"])
    assert (c.block_t, c.block_b, c.num_warps, c.walk) == (256, 1, 1, False)
    assert c.max_registers == tiles.MAX_REGISTERS_HEAVY_LOOKBACK == 128
    c = choose(4096, 512, False, **KERNELS["backward"])
    assert (c.num_warps, c.sub) == (4, 8)
    assert choose(32768, 64, True, **KERNELS["backward"]).max_registers == 80


def test_time_major_grids_of_few_programs_span_128_steps():
    """4096x128 time-major: tiles of all 128 steps, so no look-back at all."""
    c = choose(128, 4096, False, **KERNELS["lambda_returns"])
    assert (c.block_t, c.chunks(128)) == (128, 1)


def test_retrace_loads_its_actions_in_blocks():
    assert tiles.action_block(18) == 8 and tiles.action_block(18, 2) == 2
    assert tiles.action_block(1) == 1 and tiles.action_block(5) == 8


def test_look_back_window_on_a_gpu():
    """Tiles of several rows read one warp's worth of words per pass (one per lane, no barrier
    in the loop); one-row tiles one word per thread (no word held by two threads)."""
    for block_b in (2, 4, 16, 32):
        for warps in (1, 2, 8):
            assert block_b * tiles.window(16, block_b, warps, CUDA) == 32
    for block_b, warps in ((1, 8), (1, 2), (64, 8)):
        assert block_b * tiles.window(16, block_b, warps, CUDA) == max(32 * warps, 16 * block_b)
    assert tiles.window(3, 4, 2, CPU) == 3  # the interpreter: any window


def test_look_back_depth():
    """A window of one word per thread reads its nearest word per pass, and so does one warp's
    worth at least 4 tiles deep; shallower windows and the interpreter's are read whole."""
    assert tiles.depth(256, 1, CUDA) == tiles.depth(32, 1, CUDA) == tiles.DEPTH_WIDE == 1
    assert tiles.depth(8, 64, CUDA) == 1
    for block_b in (2, 4, 8):
        assert tiles.depth(32 // block_b, block_b, CUDA) == 1
    for block_b in (16, 32):
        assert tiles.depth(32 // block_b, block_b, CUDA) == 32 // block_b
    assert tiles.depth(16, 1, CPU) == 16
    with tiles.override(window=16, depth=3):
        assert choose(1 << 20, 4, True, CPU).depth == 3
    with tiles.override(window=2, depth=3):
        assert choose(1 << 20, 4, True, CPU).depth == 2  # never more than the window


def test_rule_constants_can_be_changed_for_a_measurement():
    assert choose(4096, 512, True).walk
    with tiles.rule(WALK_PROGRAMS_PER_SM=4, WINDOW=64):  # 512 row tiles < 4 x 132
        assert not choose(4096, 512, True).walk
        assert choose(4096, 512, True, CPU).window == 64  # the interpreter's window
    assert choose(4096, 512, True).walk and tiles.WINDOW == 16
    with pytest.raises(KeyError, match="not constants"):
        with tiles.rule(NO_SUCH_CONSTANT=1):
            pass


def test_override_is_scoped():
    with tiles.override(block_t=16, block_b=2, window=3):
        c = choose(1000, 5, True, CPU)
        assert (c.block_t, c.block_b, c.window) == (16, 2, 3)
    assert choose(1000, 5, True, CPU).block_t != 16
    with tiles.override(sub=32):  # a forced sub-tiling, at most the tile's steps
        assert choose(1024, 16384, False).sub == 32 and choose(1024, 16384, True).sub == 1
    with tiles.override(block_t=16, block_b=32, num_warps=4):
        assert choose(1024, 16384, False).sub == 1  # recomputed for the forced tile


def test_occupancy():
    """Programs per multiprocessor from registers (per warp, in units of 256), warps, programs
    and shared memory (H200 limits), for register counts of the grid's kernels."""
    assert tiles.occupancy(168, 2, 2048) == (6, 0.1875)  # V-trace's batch-major look-back tiles
    assert tiles.occupancy(56, 4, 2048) == (9, 0.5625)  # GAE's time-major tiles without masks
    assert tiles.occupancy(64, 4, 2048) == (8, 0.5)
    assert tiles.occupancy(32, 1, 0) == (32, 0.5)  # at most 32 programs
    assert tiles.occupancy(32, 4, 100 * 1024) == (2, 0.125)  # shared memory


def test_full_tiles_keep_their_masks_where_dropping_them_costs_warps():
    """A plan whose tiles divide the problem drops its masks unless the kernel without them fits
    fewer warps on a multiprocessor (registers of the two compiled kernels, `launch`)."""
    from rl_triton.scan import launch

    def keeps(regs_even, regs_masked, warps):
        def compile(meta):
            regs = regs_even if meta["EVEN"] else regs_masked
            return SimpleNamespace(n_regs=regs, metadata=SimpleNamespace(shared=2048))
        return launch.even_keeps_occupancy(None, None, {"EVEN": True, "num_warps": warps},
                                        compile=compile)

    assert keeps(56, 64, 4)  # fewer registers, more warps
    assert keeps(165, 155, 2)  # more registers, the same 6 programs
    assert keeps(72, 72, 4)
    assert not keeps(182, 168, 2)  # 5 programs instead of 6
    assert tiles.even(1024, 16384, tiles.TileConfig(32, 32, 4))
    assert not tiles.even(1000, 16384, tiles.TileConfig(32, 32, 4))
    assert not tiles.even(1024, 100, tiles.TileConfig(32, 32, 4))
    with tiles.rule(EVEN_TILES=0):
        assert not tiles.even(1024, 16384, tiles.TileConfig(32, 32, 4))


def test_full_tiles_keep_their_masks_where_registers_cannot_be_read(monkeypatch):
    """Registers come from a private attribute of Triton's compiled kernels (`launch.registers`):
    where a Triton does not have it, the masks are kept, with one warning per process."""
    from rl_triton.scan import launch

    monkeypatch.setattr(launch, "_UNREADABLE", [])
    kernels = {"no n_regs": SimpleNamespace(metadata=SimpleNamespace(shared=2048)),
               "n_regs None": SimpleNamespace(n_regs=None, metadata=SimpleNamespace(shared=0)),
               "no metadata": SimpleNamespace(n_regs=56)}
    with pytest.warns(RuntimeWarning, match="keep their masks") as warned:
        for kernel in kernels.values():
            assert not launch.even_keeps_occupancy(None, None, {"EVEN": True, "num_warps": 4},
                                                compile=lambda meta: kernel)
    assert len(warned) == 1
    assert launch.registers(SimpleNamespace(n_regs=56, metadata=SimpleNamespace(shared=0))) \
        == (56, 0)


def test_compiled_launch_keys_on_what_triton_specializes(monkeypatch):
    """`scan.launch.launch` (the losses', whitening's and group kernel's launches): the first
    launch of a specialization goes through Triton's JIT, a repeat replays its compiled kernel
    with the addresses as integers; another dtype, alignment, integer class (1, a multiple of
    16) or constexpr is another specialization, so it goes through the JIT again."""
    from rl_triton.scan import launch as L
    calls = []

    class Compiled:
        function = packed_metadata = None

        def run(self, *args):
            calls.append(("run", args))

    class Fn:
        arg_names = ["x", "n", "BLOCK"]

        def __getitem__(self, grid):
            def jit(*args, **meta):
                calls.append(("jit", args, meta))
                return Compiled()
            return jit

    monkeypatch.setattr(L, "_stream", lambda index: 7)
    monkeypatch.setattr(L, "_current_device", lambda: 0)
    monkeypatch.setattr(L, "_launch_hooks", lambda: (None, None))
    monkeypatch.setattr(L, "_COMPILED", {})
    fn, dev, x = Fn(), torch.device("cuda", 0), torch.zeros(64)
    for args, meta in [((x, 5), 4), ((x, 7), 4), ((x, 16), 4), ((x, 1), 4), ((x[1:], 7), 4),
                       ((x.double(), 7), 4), ((x, 7), 8), ((x[4:], 9), 4)]:
        L.launch(fn, 3, args, dev, BLOCK=meta, num_warps=2)
    assert [c[0] for c in calls] == ["jit", "run", "jit", "jit", "jit", "jit", "jit", "run"]
    assert calls[1][1][:4] == (3, 1, 1, 7) and calls[1][1][-3:] == (x.data_ptr(), 7, 4)
    assert calls[-1][1][-3:] == (x[4:].data_ptr(), 9, 4)  # 16 bytes in: aligned
    # the losses' `_losses.launch` replays the compiled kernel a plan's memo keeps (`launch`
    # puts it there at the second call), each tensor, wherever it stands, as its address
    from types import SimpleNamespace

    from rl_triton.ops import _losses
    assert all(hit[2] == (0,) for hit in L._COMPILED.values())  # x's position
    monkeypatch.setattr(L, "_current_device", lambda: None)  # (the CPU tensors' index)
    plan = SimpleNamespace(memo={fn: (Compiled(), (32,), (0, 2))})
    calls.clear()
    _losses.launch(fn, 2, x, 5, x[16:], plan=plan, BLOCK=32, num_warps=4)
    assert calls == [("run", (2, 1, 1, 7, None, None, None, None, None, x.data_ptr(), 5,
                              x[16:].data_ptr(), 32))]
