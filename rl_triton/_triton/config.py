"""Tile shapes, warps and the split of long rows: chosen here and nowhere else.

The rule (a first choice, not yet tuned against measurements; docs/benchmarks.md has the status):
- a tile holds about `TILE_ELEMENTS / weight` steps x rows; heavier estimators (V-trace scans four
  values per step, Retrace walks the action axis) take smaller tiles;
- the tile's long side follows the contiguous axis of memory: time for batch-major data
  (`[N, T]`), rows for time-major data (`[T, N]`, at most 64 rows so that a time-major tile's
  transposition through shared memory stays small);
- when the rows alone give fewer programs than `PROGRAMS_PER_SM` per multiprocessor, the time axis
  is split into segments that run in parallel and are stitched by their carries.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace

import torch

TILE_ELEMENTS = 2048
MAX_ACTION_BLOCK = 32  # Retrace walks the action axis in blocks of at most this many actions
MIN_BLOCK_T = 16
MAX_ROWS_TIME_MAJOR = 64
PROGRAMS_PER_SM = 2
NUM_WARPS = 4


@dataclass(frozen=True)
class TileConfig:
    block_t: int
    block_b: int
    num_warps: int
    n_seg: int  # segments the time axis is split into (grid axis 1)
    chunks_per_seg: int  # tiles of block_t steps per segment


_overrides: dict = {}


@contextlib.contextmanager
def override(**fields):
    """Force tile fields (block_t, block_b, num_warps, n_seg) inside the block: for tests."""
    old = dict(_overrides)
    _overrides.update(fields)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(old)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one after another


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def action_block(n_act: int) -> int:
    """Actions loaded at once along Retrace's action axis."""
    return min(_pow2(n_act), MAX_ACTION_BLOCK)


def choose(T: int, B: int, *, time_contiguous: bool, weight: int, device: torch.device) -> TileConfig:
    elements = max(MIN_BLOCK_T, TILE_ELEMENTS // weight)
    if time_contiguous:
        block_t = max(MIN_BLOCK_T, min(_pow2(T), elements))
        block_b = max(1, min(_pow2(B), elements // block_t))
    else:
        block_b = max(1, min(_pow2(B), MAX_ROWS_TIME_MAJOR, elements // MIN_BLOCK_T))
        block_t = max(MIN_BLOCK_T, min(_pow2(T), elements // block_b))
    cfg = TileConfig(block_t, block_b, NUM_WARPS, 1, 1)
    if _overrides:
        cfg = replace(cfg, **{k: v for k, v in _overrides.items() if k != "n_seg"})
    n_chunks = -(-T // cfg.block_t)
    row_tiles = -(-B // cfg.block_b)
    n_seg = _overrides.get("n_seg")
    if n_seg is None:
        n_seg = max(1, PROGRAMS_PER_SM * _multiprocessors(device) // row_tiles)
    n_seg = max(1, min(n_seg, n_chunks))
    per_seg = -(-n_chunks // n_seg)
    return replace(cfg, n_seg=-(-n_chunks // per_seg), chunks_per_seg=per_seg)
