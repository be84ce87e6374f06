"""How the benchmark times a call (CUDA only): device time, full-call time, host time, the
same-bytes copy floor and the launch floor.

- device time: `triton.testing.do_bench`'s protocol (median, L2 flushed before every call), plus
  a GPU hold after the flush (`device_time_us`);
- full-call time: synchronize, host timer, call, synchronize, host timer: what a trainer pays;
- host time: synchronize, host timer, call, host timer: what the CPU spends in one call before it
  returns (at small shapes the whole story: a trainer's loop waits on it);
both medians of the same calls (`call_times_us`), 200 after 20 warm-ups unless said.
"""
from __future__ import annotations

import statistics
import time

import torch
import triton
import triton.language as tl

_FLUSH_BYTES = 256 * 2**20  # what triton.testing.do_bench writes to flush the L2 cache
_HOLD_CYCLES = 200_000  # about 100 µs of GPU clock: longer than the host's part of any call
# ... of any forward call; a backward pass through torch's autograd engine takes 150-300 µs
# of host time on the H200 machine (the engine's device thread, its checks); and the token
# suite's calls: masked_whiten's Triton launches from Python, the drop-ins' dozen ops,
# took 120-230 µs of full call on 2026-12-03 (under the short hold, their device times jumped
# 5x between neighbouring cells)
_HOLD_CYCLES_GRAD = 2_000_000


def device_time_us(fn, warmup_ms=25.0, rep_ms=100.0, hold_cycles=_HOLD_CYCLES) -> float:
    """Median device time of fn() in µs: `triton.testing.do_bench`'s protocol (the L2 cache
    flushed before every call, warm-up, ~100 ms of timed calls), with one change: after the flush
    the GPU is held busy for ~100 µs, so that the host has queued the call before the GPU
    reaches the start event. Without it, a call whose host part outlasts the flush (ours take
    30-55 µs on the H200 machine, close to what the GPU spends on the flush) is timed with host
    time in it: plain do_bench gave 8.6 or 38.8 µs for one kernel from one measurement to the
    next."""
    flush = torch.empty(_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")

    def flush_and_hold():
        flush.zero_()
        torch.cuda._sleep(hold_cycles)

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush_and_hold()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = max(start.elapsed_time(end) / 5, 1e-3)  # a timed call with its flush, hold
    for _ in range(max(1, int(warmup_ms / estimate_ms))):
        fn()
    n = max(1, int(rep_ms / estimate_ms))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        flush_and_hold()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def call_times_us(fn, calls=200, warmup=20) -> tuple:
    """(full-call µs, host µs) of fn, medians over the same calls: synchronize, host timer,
    fn(), host timer (the host time ends where fn returns), synchronize, host timer (the full
    call). The synchronize before each call keeps the queue from filling."""
    return interleaved_call_times_us([fn], rounds=1, calls=calls, warmup=warmup)[0]


def interleaved_call_times_us(fns, rounds=7, calls=30, warmup=20) -> list:
    """[(full-call µs, host µs)] of each of fns, timed as `call_times_us` in `rounds` rounds of
    `calls` calls of every fn in turn (the order rotated each round), medians over each fn's
    calls: the host's drift over a run (on the H200 machine the same call's host time moved
    2x between neighbouring cells) falls on every fn alike, so their ratios hold."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    full, host = [[] for _ in fns], [[] for _ in fns]
    for r in range(rounds):
        for j in range(len(fns)):
            i = (j + r) % len(fns)
            fn = fns[i]
            for _ in range(calls):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                full[i].append(time.perf_counter() - t0)
                host[i].append(t1 - t0)
    return [(statistics.median(f) * 1e6, statistics.median(h) * 1e6) for f, h in zip(full, host)]


def full_call_us(fn, calls=200, warmup=20) -> float:
    return call_times_us(fn, calls, warmup)[0]


def device_full_host_us(fn, hold_cycles=_HOLD_CYCLES):
    """(device µs, full-call µs, host µs) of fn, the full call's and host's median over fewer
    calls where one is slow."""
    dev = device_time_us(fn, hold_cycles=hold_cycles)
    return (dev, *call_times_us(fn, calls=200 if dev < 5000 else 25))


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + i, tl.load(src + i, mask=i < n), mask=i < n)


_COPY_BLOCK = 1024  # values per program of the Triton copy, on _COPY_WARPS warps
_COPY_WARPS = 8


def copies(src, dst) -> dict:
    """Two device-to-device copies of src into dst, by name: torch's `copy_`, and a plain Triton
    copy, which on the H200 took a median of 0.85 of `copy_`'s time at 4-32 MB and 0.88 at
    32-64 MB (0.61-1.02 over the benchmark's sizes), the same from 128 MB
    (docs/dev/forward-grid.md)."""
    n = src.numel()
    grid = (triton.cdiv(n, _COPY_BLOCK),)
    return {"torch": lambda: dst.copy_(src),
            "triton": lambda: _copy_kernel[grid](src, dst, n, BLOCK=_COPY_BLOCK,
                                                 num_warps=_COPY_WARPS)}


_COPY_US: dict = {}


def same_bytes_copy_us(nbytes, device) -> float:
    """Device time of the faster of `copies` reading nbytes / 2 and writing nbytes / 2."""
    if nbytes not in _COPY_US:
        src = torch.empty(max(1, nbytes // 8), dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
        _COPY_US[nbytes] = min(device_time_us(f) for f in copies(src, dst).values())
    return _COPY_US[nbytes]


def copy_bandwidth(device) -> float:
    """Bytes read + written per second by a large device-to-device copy (1 GiB each way,
    `same_bytes_copy_us`)."""
    return 2**31 / (same_bytes_copy_us(2**31, device) * 1e-6)


def launch_floor(device):
    """(device µs, full-call µs, host µs) of `x.add_(1)` on one element: the launch floor."""
    x = torch.zeros(1, device=device)
    return (device_time_us(lambda: x.add_(1)), *call_times_us(lambda: x.add_(1), calls=1000))


def within_seconds(configs, max_seconds):
    """(i, configuration, tag) of each of `configs` in turn until `max_seconds` have passed
    (--max-seconds; None: all), a line then saying where the run stopped; the tag, "[i/n
    seconds]", starts the configuration's lines."""
    t_start = time.time()
    for i, config in enumerate(configs):
        if max_seconds is not None and time.time() - t_start > max_seconds:
            print(f"# stopped after {i} of {len(configs)} configurations (--max-seconds)")
            return
        yield i, config, f"[{i + 1}/{len(configs)} {time.time() - t_start:6.0f}s]"
