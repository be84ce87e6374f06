"""A reduction's last program: the ticket and the per-stream scratch that let the last program
of a kernel to finish add every program's partial sums in the same launch (the losses'
`_losses.finish_last`, whitening's statistics), in a fixed order, so that results are the same
bits whichever program comes last.

Each program stores its partial sums, then takes a ticket (`last_program`): a barrier, then one
thread's acquire-release atomic add on the launch's ticket word (Triton issues a scalar atomic
from one thread and broadcasts its result). The program that draws `programs - 1` has seen every
other program's stores; it reads them from L2 (`.cg` loads) and puts the ticket back to 0 for
the next launch on its stream (`reset`).
"""
from __future__ import annotations

import torch

from ..scan.jit import next_power_of_2, tl, triton
from ..scan.launch import _stream


@triton.jit
def last_program(ticket):
    """Whether this program is the launch's last to arrive (after its partial sums' stores)."""
    tl.debug_barrier()  # every thread's stores before the ticket's release
    return tl.atomic_add(ticket, 1, sem="acq_rel") == tl.num_programs(0) - 1


@triton.jit
def reset(ticket):
    """The last program, done with the partial sums: the ticket back to 0."""
    tl.store(ticket, 0)


_SCRATCH: dict = {}  # (device, stream, dtype, size) -> (partial sums, ticket)


def scratch(device: torch.device, n: int, dtype: torch.dtype = torch.float32):
    """The partial sums' buffer (a power of two of `dtype`, at least `n` elements) and the
    ticket (int32, 0 between launches) of the current stream: launches on one stream never
    overlap, and every launch leaves its ticket at 0. Both live as long as the process (a CUDA
    graph keeps their addresses). A pair made during a graph's capture serves that call alone:
    its ticket's zeroing is a node of the graph, not done until a replay; it comes from the
    graph's private memory pool, which keeps it for the graph's life once the call drops it, as
    any temporary of a captured region."""
    cuda = device.type == "cuda"
    key = (device, _stream(device.index) if cuda else None, dtype, max(64, next_power_of_2(n)))
    hit = _SCRATCH.get(key)
    if hit is None:
        hit = (torch.empty(key[3], dtype=dtype, device=device),
               torch.zeros(1, dtype=torch.int32, device=device))
        if not (cuda and torch.cuda.is_current_stream_capturing()):
            _SCRATCH[key] = hit
    return hit
