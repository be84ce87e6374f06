"""The one place where tiles, warps and the split of long rows are chosen."""
import torch

from rl_triton._triton import config

CPU = torch.device("cpu")


def choose(T, B, time_contiguous, weight=1):
    return config.choose(T, B, time_contiguous=time_contiguous, weight=weight, device=CPU)


def test_tile_follows_the_contiguous_axis():
    bm = choose(4096, 512, time_contiguous=True)  # [N, T]: long side along time
    assert bm.block_t >= 256 and bm.block_t * bm.block_b <= config.TILE_ELEMENTS
    tm = choose(4096, 512, time_contiguous=False)  # [T, N]: long side along rows, <= 64
    assert tm.block_b == config.MAX_ROWS_TIME_MAJOR and tm.block_t * tm.block_b <= config.TILE_ELEMENTS


def test_heavier_estimators_take_smaller_tiles():
    light, heavy = choose(4096, 512, True), choose(4096, 512, True, weight=8)
    assert heavy.block_t * heavy.block_b < light.block_t * light.block_b
    assert heavy.block_t * heavy.block_b <= config.TILE_ELEMENTS // 8


def test_short_and_tiny_shapes():
    c = choose(1, 1, time_contiguous=False)
    assert c.block_t == config.MIN_BLOCK_T and c.block_b == 1 and c.n_seg == 1


def test_long_rows_are_split_and_cover_every_chunk():
    for T, B in [(10**6, 1), (3 * 16 + 7, 2), (100, 3)]:
        for tc in (True, False):
            c = choose(T, B, tc)
            n_chunks = -(-T // c.block_t)
            assert c.n_seg * c.chunks_per_seg >= n_chunks > (c.n_seg - 1) * c.chunks_per_seg


def test_override_is_scoped():
    with config.override(block_t=16, block_b=2, n_seg=3):
        c = choose(1000, 5, True)
        assert (c.block_t, c.block_b, c.n_seg) == (16, 2, 3)
    assert choose(1000, 5, True).block_t != 16
