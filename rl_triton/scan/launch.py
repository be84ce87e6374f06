"""One launch of `kernel.scan_kernel`, planned once per signature and replayed.

An op's plan builder hands `Launch` time-major views of its inputs in the op's slot order (its
input NamedTuple), and `Launch` fixes everything that depends only on shapes, strides, dtypes and
the device: the tile (`tiles.choose`), the grid, every stride, the compile-time flags. `run`
then allocates the outputs and launches: after the first launch, the compiled kernel directly,
with the tensors' addresses as integers (Triton's launcher asks the driver about every tensor it
is given, about 1 µs each; an integer it takes as it is).
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from . import tiles
from .jit import HAS_TRITON, triton
from .kernel import scan_kernel

Tensor = torch.Tensor
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Kernel:
    """What an op plugs into the scan kernel: its coefficient builder and output writer (each
    takes one `kernel.Step`)."""
    coef: object
    store: object
    reverse: bool
    exclusive: bool = False  # the writer needs A at the previous step in scan order
    aux: bool = False  # the writer takes per-step values of the builder (`tiles.choose`)
    heavy: bool = False  # ... many of them (`tiles.choose`)
    # the bootstrap value enters as the scan's initial carry (the builder's VARIANT 1)
    carries_last: bool = False
    # (terminations, truncations) slots: time-major calls without truncation flags read the
    # terminations in the truncation slot too, the same results bit for bit, because the
    # compiler then issues the builder's loads in fewer dependent rounds (docs/dev/tile-rule.md)
    trunc_slot_always: Optional[tuple] = None
    # the builder for tiles that span their rows' whole window (each holds step T-1)
    coef_whole: object = None
    action_slots: tuple = ()  # slots with a trailing action axis (Retrace)
    # outputs with that action axis (Retrace's backward: the gradients of the action slots, which
    # its writer forms from the inputs' action axis, read through its `kernel.Step`)
    action_outs: tuple = ()
    # masks (semantics §7): the mask's input slot; for reverse estimators, whose successor is the
    # next decision step, `boot` (both initial carries) and `finish` (the coefficients from the
    # successor's value) turn on the kernel's W scan (`kernel.scan_kernel`); on packed rows
    # `boot` gives the carries each segment restarts from (with or without `finish`)
    mask_slot: int = -1
    boot: object = None
    finish: object = None


def tm(x: Optional[Tensor], time_dim: int) -> Optional[Tensor]:
    """The time-major view of a per-step tensor (None stays None)."""
    return None if x is None else x.movedim(time_dim, 0)


def over_time(x: Optional[Tensor], T: int) -> Optional[Tensor]:
    """A bootstrap tensor [*batch] seen as [T, *batch] with time stride 0 (read at one step)."""
    return None if x is None else x.unsqueeze(0).expand(T, *x.shape)


def _batch_groups(views, bshape):
    """Merge the batch axes of `views` (all shaped [T, *bshape]) into at most two groups.

    Returns [(size, [stride of each view])] * 2, or None when the strides need three or more.
    """
    groups = []
    for d, n in enumerate(bshape):
        if n == 1:
            continue
        if groups and all(v.stride(groups[-1][-1] + 1) == v.stride(d + 1) * n for v in views):
            groups[-1].append(d)
        else:
            groups.append([d])
    if len(groups) > 2:
        return None
    out = [(math.prod(bshape[d] for d in g), [v.stride(g[-1] + 1) for v in views]) for g in groups]
    while len(out) < 2:
        out.append((1, [0] * len(views)))
    return out


def _extent(v: Tensor, extra: int = 0) -> int:
    return extra + sum((n - 1) * s for n, s in zip(v.shape, v.stride()) if n > 0)


def action_vector(xs: list, n_act: int) -> int:
    """Actions per vector load along Retrace's action axis: the largest power of two, up to 16
    bytes, that divides the action count and every stride of the tensors with an action axis,
    when their data is 16-byte aligned and contiguous along actions; else 1. A plan's signature
    holds all of these, so the promise holds for every call that uses the plan."""
    xs = [x for x in xs if x is not None]
    vec = 1
    while xs and all(x.stride(-1) == 1 and x.data_ptr() % 16 == 0
                     and 2 * vec * x.element_size() <= 16 and n_act % (2 * vec) == 0
                     and all(s % (2 * vec) == 0 for s in x.stride()[:-1]) for x in xs):
        vec *= 2
    return vec


def row_vector(views: list, B: int, B2: int) -> int:
    """Time-major rows: 4 or 2 when every time stride and the row count B are multiples of it
    and the batch is one group of rows (B2 == 1), else 1 (also when all are multiples of 16,
    which Triton's integer specialization tells the compiler already). Without it the compiler
    sees a time stride of e.g. 300 as arbitrary and loads one value at a time where it could
    load 4 (time-major 300x4096 lambda-returns 19.1 -> 14.7 µs on the H200)."""
    strides = [v.stride(0) for v in views]
    if all(x % 16 == 0 for x in strides + [B]):
        return 1
    vec = 4
    while vec > 1 and (B2 != 1 or B % vec or any(x % vec for x in strides)):
        vec //= 2
    return vec


class Launch:
    """One op call's kernel launch, minus its data: grid, strides, tiles, flags.

    `ins` are the kernel's slots as time-major views (None: unused); slot i reads the call's
    input `src[i]` (its position in the op's input tuple). When rows span several tiles the
    kernel needs a small scratch for its look-back (16 bytes per tile row), zeroed once per plan
    and stream and reused by every later launch there: launches on one stream never overlap.
    Two CUDA graphs that captured the same call on the same stream share it, and must not be
    replayed concurrently.

    Packed rows (semantics §7, `segments`: (S, {slot: (segment stride, extent)} of the bootstrap
    slots)): the per-step slots are one row `[L, *batch]` (T = L), the
    bootstrap slots `[S, *batch]` are seen as `[L, *batch]` views of their first segment whose
    time stride becomes the segment stride (`kernel.segment_slots`), and `run` takes the
    offsets `cu`.
    """

    def __init__(self, kernel: Kernel, T: int, bshape: tuple, ins: list, out_shape: tuple,
                 time_dim: int, n_out: int, out_dtype: torch.dtype, *,
                 init: Optional[Tensor] = None, init_src: Optional[int] = None,
                 has_trunc: bool = False, has_next: bool = False, has_last: bool = False,
                 variant: int = 0, n_boot: int = 0, segments: Optional[tuple] = None):
        src = [None if x is None else i for i, x in enumerate(ins)]
        self.n_seg, boots = segments if segments is not None else (None, {})
        action_slots = kernel.action_slots
        # batch-major tiles where the steps are contiguous (slot 0), else time-major
        time_contiguous = ins[0].stride(0) == 1 and T > 1
        if (kernel.trunc_slot_always and not has_trunc and tiles.TRUNCATION_SLOT_ALWAYS
                and not time_contiguous):
            term, trunc = kernel.trunc_slot_always
            ins, src = list(ins), list(src)
            ins[trunc], src[trunc], has_trunc = ins[term], src[term], True
        self.T, self.B = T, math.prod(bshape)  # never 0: empty calls return before a plan
        self.out_shape, self.out_dtype, self.n_out = out_shape, out_dtype, n_out
        # `n_boot` outputs after the per-step ones have no time axis (gradients of bootstraps:
        # written at one step)
        self.n_boot = n_boot
        self.boot_shape = tuple(out_shape[:time_dim]) + tuple(out_shape[time_dim + 1:])
        self.action_outs = kernel.action_outs
        self.src, self.init_src = tuple(src), init_src
        self.device = device = next(x for x in ins if x is not None).device
        out_view = torch.empty(out_shape, device="meta").movedim(time_dim, 0)
        flat = [x[..., 0] if (i in action_slots and x is not None) else x
                for i, x in enumerate(ins)]
        init_view = over_time(init, T)
        # bootstrap outputs and per-row scalars: contiguous [*batch], seen over time
        row_view = over_time(torch.empty(bshape, device="meta"), T)
        present = [x for x in flat if x is not None] + [out_view, row_view] + (
            [init_view] if init_view is not None else [])
        groups = _batch_groups(present, bshape)
        self.ok = groups is not None
        if not self.ok:
            return
        (B1, g1), (B2, g2) = groups
        stride1 = dict(zip(map(id, present), g1))
        stride2 = dict(zip(map(id, present), g2))

        def strides(views):
            return (tuple(0 if v is None else v.stride(0) for v in views),
                    tuple(0 if v is None else stride1[id(v)] for v in views),
                    tuple(0 if v is None else stride2[id(v)] for v in views))

        n_act = self.n_act = max([ins[i].shape[-1] for i in action_slots] + [1])
        sa = tuple(ins[i].stride(-1) if i in action_slots else 0 for i in range(len(ins)))
        largest = max([_extent(v, (n_act - 1) * a) for v, a in zip(flat, sa) if v is not None]
                      + [_extent(v) for v in present]
                      + [(_extent(out_view) + 1) * n_act - 1] * bool(kernel.action_outs)
                      + [extent for _, extent in boots.values()])
        itemsize = max([x.element_size() for x in flat if x is not None
                        and x.is_floating_point()] or [4])
        cfg = tiles.choose(T, self.B, time_contiguous=time_contiguous, device=device,
                           n_act=n_act if action_slots else 0, exclusive=kernel.exclusive,
                           reverse=kernel.reverse, aux=kernel.aux, itemsize=itemsize,
                           heavy=kernel.heavy, packed=segments is not None)
        n_chunks = cfg.chunks(T)
        n_row_tiles = triton.cdiv(self.B, cfg.block_b)
        self.lookback = n_chunks > 1 and not cfg.walk
        self.grid = (n_row_tiles * (n_chunks if self.lookback else 1), 1)
        # look-back scratch: two words per (tile, row), four with the W scan of masks
        w_phase = kernel.finish is not None
        words = 4 if w_phase else 2
        self.state_size = words * self.grid[0] * cfg.block_b if self.lookback else 1
        in_strides = strides(flat) + (sa,)
        if boots:  # bootstraps: the segment stride in place of the (zero) time stride
            in_strides = (tuple(boots[i][0] if i in boots else x
                                for i, x in enumerate(in_strides[0])),) + in_strides[1:]
        # n_out alike (those with an action axis contiguous along it: n_act times the strides),
        # then n_boot alike
        out_strides = tuple(tuple(x * (n_act if i in self.action_outs else 1)
                                  for i, x in enumerate(s * n_out)) + r * n_boot
                            for s, r in zip(strides([out_view]), strides([row_view])))
        init_strides = ((stride1[id(init_view)], stride2[id(init_view)])
                        if init_view is not None else (0, 0))
        row_strides = (math.prod(bshape), stride1[id(row_view)], stride2[id(row_view)])
        ints = (T, self.B, B2, n_act, n_row_tiles, n_chunks)
        # the kernel's arguments around the call's pointers, in its order (after `rows`: its
        # strides, then the sizes)
        self.strides = (in_strides, out_strides, init_strides, row_strides + ints)
        block_a = tiles.action_block(n_act, itemsize)
        coef = kernel.coef_whole if kernel.coef_whole is not None and n_chunks == 1 else kernel.coef
        self.meta = dict(COEF=coef, STORE=kernel.store, REVERSE=kernel.reverse,
                         EXCLUSIVE=kernel.exclusive, HAS_TRUNC=has_trunc, HAS_NEXT=has_next,
                         HAS_LAST=has_last, HAS_INIT=init is not None, VARIANT=variant,
                         LOOKBACK=self.lookback, WALK=cfg.walk and n_chunks > 1,
                         WINDOW=cfg.window, DEPTH=cfg.depth, TIME_AXIS=int(time_contiguous),
                         INT64=largest > INT32_MAX or self.state_size > INT32_MAX,
                         BLOCK_T=cfg.block_t, BLOCK_B=cfg.block_b,
                         BLOCK_A=block_a, ACT_BLOCKS=triton.cdiv(n_act, block_a),
                         ACT_VEC=min(block_a, action_vector([ins[i] for i in action_slots],
                                                            n_act)),
                         ROW_VEC=(row_vector(present, self.B, B2) if tiles.vector_rows(
                             self.B, time_contiguous, bool(action_slots)) else 1),
                         SUB=cfg.sub, EVEN=tiles.even(T, self.B, cfg), ROW_PARAMS=0,
                         MASK=kernel.mask_slot, W_PHASE=w_phase, BOOT=kernel.boot,
                         FINISH=kernel.finish, SEGMENTS=segments is not None,
                         BOOT_SLOTS=sum(1 << i for i in boots),
                         num_warps=cfg.num_warps)
        if cfg.max_registers:
            self.meta["maxnreg"] = cfg.max_registers
        self.device_index = device.index  # None on the CPU, as `_current_device()` there
        self.cuda = device.type == "cuda"
        self.grid3 = self.grid + (1,)
        self.shapes = self.output_shapes()
        # the input whose shape, dtype and (contiguous) strides every output has, if one has:
        # its `empty_like` allocates an output with the least host time
        x0 = ins[0].movedim(0, time_dim) if src[0] == 0 else None
        self.like = 0 if (x0 is not None and x0.dtype == out_dtype and x0.is_contiguous()
                          and all(shape == tuple(x0.shape) for shape in self.shapes)) else None
        self.states = {}  # look-back scratch by stream: launches on one stream never overlap
        self.compiled, self.tail = None, ()

    def per_row(self, k: int) -> "Launch":
        """The plan with its first k scalars per row (before its first launch)."""
        self.meta["ROW_PARAMS"] = k
        return self

    def run(self, x: tuple, scalars: tuple, rows: Optional[Tensor] = None,
            cu: Optional[Tensor] = None) -> list:
        """Allocate the outputs and launch on the call's inputs `x` (the op's input tuple);
        `rows`: the per-row scalars, contiguous `[row_params, *batch]` float32; `cu`: packed
        rows' offsets, contiguous int32 or int64 `[S + 1]` (S fixed by the plan's signature)."""
        # One allocation each: outputs that are views of one buffer would alias, which custom
        # ops (torch.compile) forbid.
        dtype, device = self.out_dtype, self.device
        like = self.like
        if like is not None and type(x[like]) is Tensor:  # (no shape or dtype to parse)
            outs = [torch.empty_like(x[like]) for _ in self.shapes]
        else:
            outs = [torch.empty(s, dtype=dtype, device=device) for s in self.shapes]
        if self.compiled is not None and self.device_index == _current_device():
            self._replay(x, outs, scalars, rows, cu)
        elif self.cuda and self.device_index != _current_device():
            with torch.cuda.device(device):
                self._launch(x, outs, scalars, rows, cu)
        else:
            self._launch(x, outs, scalars, rows, cu)
        return outs

    def output_shapes(self) -> list:
        """The `n_out` per-step outputs' shapes (with the action axis where `action_outs` says),
        then the `n_boot` bootstrap outputs'."""
        return ([self.out_shape + ((self.n_act,) if i in self.action_outs else ())
                 for i in range(self.n_out)] + [self.boot_shape] * self.n_boot)

    def _state(self, stream):
        """The look-back scratch of `stream` and its address: zeroed once; the kernel tags what
        it writes with its launch (kernel.py)."""
        state = self.states.get(stream)
        if state is None:
            t = torch.zeros(self.state_size, dtype=torch.int64, device=self.device)
            state = self.states[stream] = (t, t.data_ptr())
        return state

    def _launch(self, x, outs, scalars, rows, cu=None):
        if self.compiled is not None:
            self._replay(x, outs, scalars, rows, cu)
            return
        # the first launch: through Triton's JIT, which compiles
        state = self._state(_stream(self.device_index) if self.cuda else None)[0]
        out0 = outs[0]  # unused slots get a valid pointer; never read
        args = self._args(tuple(out0 if i is None else x[i] for i in self.src), tuple(outs),
                          out0 if self.init_src is None else x[self.init_src], state, scalars,
                          out0 if rows is None else rows, cu)
        if self.meta["EVEN"] and self.cuda:
            self.meta["EVEN"] = even_keeps_occupancy(args, self.grid, self.meta)
        compiled = scan_kernel[self.grid](*args, **self.meta)
        if hasattr(compiled, "packed_metadata"):  # compiled (not the interpreter)
            self.tail = tuple(self.meta[name] for name in _ARG_NAMES[len(args):])
            self.compiled = compiled

    def _replay(self, x, outs, scalars, rows, cu):
        """A launch of the compiled kernel with the tensors' addresses: what JITFunction.run
        does once it has found the kernel in its cache, minus re-deriving the specialization
        key (the plan's signature fixes it, pointer alignment included)."""
        stream = _stream(self.device_index)
        state = self.states.get(stream) or self._state(stream)
        i = self.init_src
        args = self._args(tuple([0 if j is None else x[j].data_ptr() for j in self.src]),
                          tuple([o.data_ptr() for o in outs]),
                          0 if i is None else x[i].data_ptr(), state[1], scalars,
                          0 if rows is None else rows.data_ptr(),
                          None if cu is None else cu.data_ptr()) + self.tail
        run_compiled(self.compiled, self.grid3, stream, args)

    def _args(self, ptrs, outs, init, state, scalars, rows, cu=None) -> tuple:
        """`scan_kernel`'s positional arguments, in its order (`cu`: packed rows' offsets,
        None for other calls: no argument of the compiled kernel)."""
        in_strides, out_strides, init_strides, rest = self.strides
        return (ptrs, *in_strides, outs, *out_strides, init, *init_strides, state, scalars,
                rows, *rest, cu, self.n_seg)


def launch(fn, grid: int, args: tuple, device: torch.device, memo: Optional[dict] = None,
           **meta) -> None:
    """`fn[(grid,)](*args, **meta)` for a kernel other than the scan (`args`: its leading
    arguments, tensors and numbers; `meta`: its other arguments by name, constexprs, and launch
    options such as num_warps), with the host path `Launch` has: after the first launch of a
    specialization, its compiled kernel with the tensors' addresses as integers. The key holds
    what Triton specializes on (`_spec`). `memo`: a dict of the caller's plan whose signature
    fixes every specialization of this launch site (dtypes, alignment, integers, meta): the
    compiled kernel is kept there under `fn`, and the key is not formed again."""
    if device.type != "cuda" or not HAS_TRITON or torch.compiler.is_compiling():
        # Triton's interpreter; or traced by torch.compile, whose launch returns no kernel
        fn[(grid,)](*args, **meta)
        return
    hit = None if memo is None else memo.get(fn)
    if hit is None:
        key = (fn, device.index, *meta.items(), *map(_spec, args))
        hit = _COMPILED.get(key)
        if hit is None:
            on = device.index != _current_device()  # Triton launches on the current device
            with torch.cuda.device(device) if on else contextlib.nullcontext():
                compiled = fn[(grid,)](*args, **meta)
            if not hasattr(compiled, "packed_metadata"):  # no compiled kernel to replay
                return
            if len(_COMPILED) >= _MAX_COMPILED:
                _COMPILED.clear()
            # the tensors' positions, fixed by the key (a tensor's spec is not a number's)
            _COMPILED[key] = (compiled, tuple(meta[n] for n in fn.arg_names[len(args):]),
                              tuple(i for i, a in enumerate(args) if isinstance(a, Tensor)))
            return
        if memo is not None:
            memo[fn] = hit
    replay(hit, grid, args, device)


def replay(hit: tuple, grid: int, args: tuple, device: torch.device) -> None:
    """The compiled launch of `launch`'s cache entry `hit` (compiled kernel, constexpr tail,
    the tensors' positions) with `args`' tensors as their addresses."""
    kernel, tail, tensors = hit
    args = list(args)
    for i in tensors:
        args[i] = args[i].data_ptr()
    args += tail
    if device.index == _current_device():
        run_compiled(kernel, (grid, 1, 1), _stream(device.index), args)
    else:  # Triton launches on the current device
        with torch.cuda.device(device):
            run_compiled(kernel, (grid, 1, 1), _stream(device.index), args)


def run_compiled(kernel, grid3: tuple, stream: int, args) -> None:
    """A compiled Triton kernel on `grid3` with its full argument list (tensors as addresses):
    what JITFunction.run does once its cache has the kernel; launch hooks (profilers) are
    honoured as it honours them."""
    enter, leave = _launch_hooks()
    info = kernel.launch_metadata(grid3, stream, *args) if enter is not None else None
    kernel.run(*grid3, stream, kernel.function, kernel.packed_metadata, info, enter, leave,
               *args)


def _spec(a):
    """What Triton specializes an argument on: a tensor's dtype and 16-byte alignment; an
    integer's value 1, divisibility by 16 and width."""
    if isinstance(a, Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, int) and not isinstance(a, bool):
        return int, a == 1, a % 16 == 0, -2**31 <= a <= INT32_MAX
    return type(a)


_COMPILED: dict = {}
_MAX_COMPILED = 256


def even_keeps_occupancy(args: tuple, grid: tuple, meta: dict, compile=None) -> bool:
    """Whether the kernel without masks (`EVEN`, `tiles.even`) fits at least as many warps on
    a multiprocessor as the one with masks: both are compiled (once, at a plan's first launch)
    and their registers compared. `compile(meta)` returns a compiled kernel (default: this
    GPU's, `JITFunction.warmup`). Where the registers cannot be read, the masks are kept."""
    if compile is None:
        def compile(m):
            kernel = scan_kernel.warmup(*args, grid=grid, **m)
            load = getattr(kernel, "_init_handles", None)  # loads the binary: its n_regs
            if load is not None:
                load()
            return kernel
    fraction = []
    for even in (True, False):
        kernel = compile({**meta, "EVEN": even})
        used = registers(kernel)
        if used is None:
            return False
        fraction.append(tiles.occupancy(used[0], meta["num_warps"], used[1])[1])
    return fraction[0] >= fraction[1]


def registers(kernel):
    """(registers per thread, shared memory bytes) of a compiled kernel, or None (with a
    warning, once) where this Triton does not say: `CompiledKernel.n_regs`, set once
    `_init_handles()` has loaded the binary (Triton 3.6 to 3.9 at least), is not public API."""
    used = getattr(kernel, "n_regs", None), getattr(getattr(kernel, "metadata", None),
                                                     "shared", None)
    if not all(isinstance(x, int) for x in used) or used[0] <= 0:
        if not _UNREADABLE:
            _UNREADABLE.append(True)
            warnings.warn(f"rl_triton: this Triton ({triton.__version__}) does not give a "
                          "compiled kernel's registers (CompiledKernel.n_regs); plans whose "
                          "tiles divide the problem keep their masks", RuntimeWarning,
                          stacklevel=3)
        return None
    return used


_UNREADABLE = []  # the warning above, once per process
_RUNTIME_KNOBS = getattr(getattr(triton, "knobs", None), "runtime", None) if HAS_TRITON else None


def _launch_hooks():
    """Triton's launch hooks (profilers), None when none is installed (newer Triton keeps a
    possibly empty chain of hooks rather than None)."""
    knobs = _RUNTIME_KNOBS
    if knobs is None:
        return None, None
    enter, leave = knobs.launch_enter_hook, knobs.launch_exit_hook
    return (None if enter is None or getattr(enter, "calls", True) == [] else enter,
            None if leave is None or getattr(leave, "calls", True) == [] else leave)


# Triton's own choice of the current stream (its CUDA driver), without its driver's proxy
_stream = (getattr(torch._C, "_cuda_getCurrentRawStream", None)
           or (lambda index: torch.cuda.current_stream(index).cuda_stream))


# torch.cuda.current_device() without its Python layers (lazy init and argument handling),
# where torch has it
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


_ARG_NAMES = scan_kernel.arg_names if HAS_TRITON else ()


def plan(build, x: tuple):
    """The plan `build(x)` makes, or None when it cannot read `x` in place (batch axes that no
    two strides describe): the caller then runs it on contiguous copies, uncached."""
    p = build(x)
    return p if p.ok else None
