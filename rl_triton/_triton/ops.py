"""The Triton backend: one launcher for all estimators, registered as PyTorch custom ops.

Each op takes the caller's tensors in their own layout (already checked by `rl_triton._args`),
describes every tensor to `scan.scan_kernel` by its strides (no copies), allocates the outputs in
the caller's layout, and launches. The ops are `torch.library.custom_op`s (`rl_triton::gae`, ...)
with fake implementations, so compiled code sees them as single opaque nodes; eager calls skip
the dispatcher and run a `Launch` plan directly (cached by `rl_triton.estimators`).
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import triton
from triton.runtime import driver

from . import coefficients as C
from . import config, host
from .scan import scan_kernel

Tensor = torch.Tensor


@dataclass(frozen=True)
class Kernel:
    coef: object
    store: object
    reverse: bool
    exclusive: bool = False  # the writer needs A at the previous step in scan order
    aux: bool = False  # the writer takes per-step values of the builder (`config.choose`)
    # the bootstrap value (last_value, without next_values) enters as the scan's initial carry,
    # the builder's VARIANT 1, rather than through its alpha at step T-1
    carries_last: bool = False
    # The builder's (terminations, truncations) slots, where its time-major calls without
    # truncation flags read the terminations in the truncation slot too
    # (`config.TRUNCATION_SLOT_ALWAYS`, `Launch`): the same results bit for bit (cut = terminated
    # | truncated), and the compiler's schedule of the builder with both flags issues its loads up
    # front; without the slot, Triton 3.6 issued lambda-returns' in 3-4 dependent rounds, against
    # 1-3 with it (sm_90 SASS, `tools/registers.py`), and on the H200 lambda-returns took
    # 0.76-0.95 of the time with the slot at every time-major shape measured, Retrace 0.88-0.94;
    # GAE 1.09 at 4096x128, the others and batch-major tiles 0.99-1.01 (docs/benchmarks.md, log).
    trunc_slot_always: Optional[tuple] = None
    # the builder for tiles that span their rows' whole window (each holds step T-1), where it
    # differs from `coef`
    coef_whole: object = None


GAE = Kernel(C.gae_coef, C.gae_store, reverse=True, aux=True)
LAMBDA_RETURNS = Kernel(C.lambda_returns_coef, C.single_store, reverse=True,
                        trunc_slot_always=(C.TERM.value, C.TRUNC.value))
DISCOUNTED_RETURNS = Kernel(C.discounted_returns_coef, C.single_store, reverse=True,
                            carries_last=True)
VTRACE = Kernel(C.vtrace_coef, C.vtrace_store, reverse=True, exclusive=True, aux=True)
RETRACE = Kernel(C.retrace_coef, C.retrace_store, reverse=True,
                 trunc_slot_always=(C.RT_TERM.value, C.RT_TRUNC.value),
                 coef_whole=C.retrace_whole_coef)
FORWARD = Kernel(C.forward_coef, C.single_store, reverse=False)
SCAN_REVERSE = Kernel(C.linear_scan_coef, C.single_store, reverse=True)
SCAN_FORWARD = Kernel(C.linear_scan_coef, C.single_store, reverse=False)

INT32_MAX = 2**31 - 1
_RETRACE_ACTION_SLOTS = tuple(s.value for s in (C.RT_Q, C.RT_PI, C.RT_LAST_Q, C.RT_LAST_PI))


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
    """Actions per vector load along Retrace's action axis (`retrace_coef`): the largest power
    of two, up to 16 bytes, that divides the action count and every stride of the tensors with
    an action axis, when their data is 16-byte aligned and contiguous along actions; else 1. A
    plan's signature holds all of these (shapes, strides, dtypes and 16-byte alignment), so the
    promise holds for every call that uses the plan."""
    xs = [x for x in xs if x is not None]
    vec = 1
    while xs and all(x.stride(-1) == 1 and x.data_ptr() % 16 == 0
                     and 2 * vec * x.element_size() <= 16 and n_act % (2 * vec) == 0
                     and all(s % (2 * vec) == 0 for s in x.stride()[:-1]) for x in xs):
        vec *= 2
    return vec


def row_vector(views: list, B: int, B2: int) -> int:
    """Time-major rows: 4 or 2 when every time stride and the row count B are multiples of it
    and the batch is one group of rows (B2 == 1), else 1; also 1 when all are multiples of 16,
    which the compiler knows already (Triton specializes such integer arguments). `scan_kernel`
    then tells the compiler, which otherwise sees a time stride of e.g. 300 as arbitrary: each
    step's rows would load one value at a time where they can load 4 (16 bytes of float32;
    time-major 300x4096: lambda-returns 19.1 -> 14.7 µs, H200). A plan's signature holds every
    stride, so the promise holds for every call that uses it."""
    strides = [v.stride(0) for v in views]
    if all(x % 16 == 0 for x in strides + [B]):
        return 1
    vec = 4
    while vec > 1 and (B2 != 1 or B % vec or any(x % vec for x in strides)):
        vec //= 2
    return vec


def over_time(x: Optional[Tensor], T: int) -> Optional[Tensor]:
    """A bootstrap tensor [*batch] seen as [T, *batch] with time stride 0 (read at one step)."""
    return None if x is None else x.unsqueeze(0).expand(T, *x.shape)


class Launch:
    """One estimator call's kernel launch, minus its data: grid, strides, tiles, flags.

    Everything here depends only on the inputs' shapes, strides, dtypes and devices, so a plan
    built once serves every later call with the same signature (`run`), skipping argument
    checks and stride analysis: the per-call host work left is output allocation and the launch.
    Slot i of the kernel reads caller tensor `src[i]` (None: unused slot).

    When rows span several tiles the kernel needs a small scratch for its look-back (16 bytes
    per tile row plus two counters), zeroed once per plan and stream and reused by every later
    launch there: launches on one stream never overlap. Two CUDA graphs that captured the same
    call on the same stream share it, and must not be replayed concurrently.
    """

    def __init__(self, kernel: Kernel, T: int, bshape: tuple, ins: list, src: list,
                 out_shape: tuple, time_dim: int, n_out: int, out_dtype: torch.dtype, *,
                 init: Optional[Tensor] = None, init_src: Optional[int] = None,
                 action_slots: tuple = (), has_trunc: bool = False, has_next: bool = False,
                 has_last: bool = False, variant: int = 0):
        # batch-major tiles where the steps are contiguous (slot 0, the rewards), else time-major
        time_contiguous = ins[0].stride(0) == 1 and T > 1
        if (kernel.trunc_slot_always and not has_trunc and config.TRUNCATION_SLOT_ALWAYS
                and not time_contiguous):
            term, trunc = kernel.trunc_slot_always
            ins, src = list(ins), list(src)
            ins[trunc], src[trunc], has_trunc = ins[term], src[term], True
        self.T, self.B = T, math.prod(bshape)  # never 0: empty calls return before a plan
        self.out_shape, self.out_dtype, self.n_out = out_shape, out_dtype, n_out
        self.src, self.init_src = src, init_src
        self.device = device = next(x for x in ins if x is not None).device
        out_view = torch.empty(out_shape, device="meta").movedim(time_dim, 0)
        flat = [x[..., 0] if (i in action_slots and x is not None) else x
                for i, x in enumerate(ins)]
        init_view = over_time(init, T)
        present = [x for x in flat if x is not None] + [out_view] + (
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

        n_act = max([ins[i].shape[-1] for i in action_slots] + [1])
        sa = tuple(ins[i].stride(-1) if i in action_slots else 0 for i in range(len(ins)))
        largest = max([_extent(v, (n_act - 1) * a) for v, a in zip(flat, sa) if v is not None]
                      + [_extent(v) for v in present])
        itemsize = max([x.element_size() for x in flat if x is not None
                        and x.is_floating_point()] or [4])
        cfg = config.choose(T, self.B, time_contiguous=time_contiguous, device=device,
                            n_act=n_act if action_slots else 0, exclusive=kernel.exclusive,
                            reverse=kernel.reverse, aux=kernel.aux, itemsize=itemsize)
        n_chunks = cfg.chunks(T)
        n_row_tiles = triton.cdiv(self.B, cfg.block_b)
        self.lookback = n_chunks > 1 and not cfg.walk
        self.grid = (n_row_tiles * (n_chunks if self.lookback else 1), 1)
        # look-back scratch: two words per (tile, row)
        self.state_size = 2 * self.grid[0] * cfg.block_b if self.lookback else 1
        self.in_strides = strides(flat) + (sa,)
        self.out_strides = tuple(s * n_out for s in strides([out_view]))  # n_out alike
        self.init_strides = ((stride1[id(init_view)], stride2[id(init_view)])
                             if init_view is not None else (0, 0))
        self.ints = (T, self.B, B2, n_act, n_row_tiles, n_chunks)
        # Retrace's action axis, in blocks of block_a
        block_a = config.action_block(n_act, itemsize)
        # tiles that span their rows' whole window hold step T-1 (`coefficients.retrace_terms`)
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
                         ROW_VEC=(row_vector(present, self.B, B2) if config.vector_rows(
                             self.B, time_contiguous, bool(action_slots)) else 1),
                         SUB=cfg.sub, EVEN=config.even(T, self.B, cfg),
                         num_warps=cfg.num_warps)
        if cfg.max_registers:
            self.meta["maxnreg"] = cfg.max_registers
        self.device_index = device.index
        self.states = {}  # look-back scratch by stream: launches on one stream never overlap
        self.compiled, self.tail = None, ()
        self.host = None  # the C++ plan (host.py) of a cached plan, once compiled (index_plan)

    def run(self, tensors: tuple, scalars: tuple) -> list:
        """Allocate the outputs and launch on `tensors` (the caller's, in signature order).
        Later calls with a cached plan's signature take the C++ path instead (`index_plan`)."""
        # One allocation each: outputs that are views of one buffer would alias, which custom
        # ops (torch.compile) forbid.
        outs = tuple(torch.empty(self.out_shape, dtype=self.out_dtype, device=self.device)
                     for _ in range(self.n_out))
        ptrs = tuple(outs[0] if i is None else tensors[i] for i in self.src)
        init = outs[0] if self.init_src is None else tensors[self.init_src]
        # the caller's current device may change between calls with one plan: check each time
        if self.device.type == "cuda" and self.device_index != torch.cuda.current_device():
            with torch.cuda.device(self.device):
                self._launch(ptrs, outs, init, scalars)
        else:
            self._launch(ptrs, outs, init, scalars)
        return list(outs)

    def _launch(self, ptrs, outs, init, scalars):
        stream = _stream(self.device_index) if self.device.type == "cuda" else None
        state = self.states.get(stream)
        if state is None:
            # Zeroed once; the kernel tags what it writes with its launch (scan.py).
            state = self.states[stream] = torch.zeros(self.state_size, dtype=torch.int64,
                                                      device=self.device)
            if self.host is not None:
                host.module().add_state(self.host, stream, state)
        args = self._args(ptrs, outs, init, state, scalars)
        kernel = self.compiled
        if kernel is None:
            if self.meta["EVEN"] and self.device.type == "cuda":
                self.meta["EVEN"] = even_keeps_occupancy(args, self.grid, self.meta)
            kernel = scan_kernel[self.grid](*args, **self.meta)
            if hasattr(kernel, "packed_metadata"):  # compiled (not the interpreter)
                self.compiled = kernel
                self.tail = tuple(self.meta[name] for name in _ARG_NAMES[len(args):])
            return
        # Launch the compiled kernel directly: what JITFunction.run does once it has found the
        # kernel in its cache, minus re-deriving the specialization key from the arguments (the
        # plan's signature fixes it, pointer alignment included). Launch hooks (profilers) are
        # honoured as JITFunction.run honours them.
        enter, leave = _launch_hooks()
        meta = (kernel.launch_metadata(self.grid + (1,), stream, *args, *self.tail)
                if enter is not None else None)
        kernel.run(self.grid[0], self.grid[1], 1, stream, kernel.function, kernel.packed_metadata,
                   meta, enter, leave, *args, *self.tail)

    def _args(self, ptrs, outs, init, state, scalars) -> tuple:
        """`scan_kernel`'s positional arguments, in its order (the launch and the C++ plan)."""
        return (ptrs, *self.in_strides, outs, *self.out_strides, init, *self.init_strides,
                state, scalars, *self.ints)

    def _make_host(self, kernel, n_scalars: int):
        """The C++ plan of later calls: the kernel's arguments as `host.Src` markers where they
        come from the call, the plan's constants elsewhere."""
        I, O = host.INPUT, host.OUTPUT
        ptrs = tuple(host.Src(O) if i is None else host.Src(I, i) for i in self.src)
        outs = tuple(host.Src(O, j) for j in range(self.n_out))
        init = host.Src(O) if self.init_src is None else host.Src(I, self.init_src)
        scalars = tuple(host.Src(host.SCALAR, i) for i in range(n_scalars))
        args = self._args(ptrs, outs, init, host.Src(host.STATE), scalars) + self.tail
        self.host = host.make(kernel, self.grid[0], args, self.device_index, self.out_shape,
                              self.out_dtype, self.n_out)
        if self.host is not None:
            for stream, state in self.states.items():
                host.module().add_state(self.host, stream, state)


def even_keeps_occupancy(args: tuple, grid: tuple, meta: dict, compile=None) -> bool:
    """Whether the kernel without masks (`EVEN`, `config.even`) fits at least as many warps on
    a multiprocessor as the one with masks: both are compiled (once, at a plan's first launch)
    and their registers compared. `compile(meta)` returns a compiled kernel (default: this
    GPU's, `JITFunction.warmup`). Where the registers cannot be read (`registers`), the masks
    are kept: the kernel that is never slower for want of warps."""
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
        fraction.append(config.occupancy(used[0], meta["num_warps"], used[1])[1])
    return fraction[0] >= fraction[1]


def registers(kernel):
    """(registers per thread, shared memory bytes) of a compiled kernel, or None (with a
    warning, once) where this Triton does not say. Triton has no public API for the registers:
    `CompiledKernel.n_regs`, set once `_init_handles()` has loaded the binary on the GPU (Triton
    3.6 to 3.9 at least)."""
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


_RUNTIME_KNOBS = getattr(getattr(triton, "knobs", None), "runtime", None)


def _launch_hooks():
    """Triton's launch hooks (profilers), None when none is installed."""
    if _RUNTIME_KNOBS is None:
        return None, None
    return _hook(_RUNTIME_KNOBS.launch_enter_hook), _hook(_RUNTIME_KNOBS.launch_exit_hook)


def _no_hooks() -> bool:
    return _launch_hooks() == (None, None)


def index_plan(fast: dict, key, tensors: tuple, plan: Launch, n_scalars: int):
    """Index a cached `plan` for the C++ path, once its first launch has compiled the kernel:
    `fast[key]` (made here) runs it for calls with the signature of `tensors` (see
    `rl_triton.estimators._FAST`). Plans that are not cached (copies) never get a C++ plan."""
    if plan.compiled is None:  # the interpreter
        return
    if plan.host is None:
        plan._make_host(plan.compiled, n_scalars)
        if plan.host is None:  # no C++ path here (host.py)
            return
    mod = host.module()
    entry = fast.get(key)
    if entry is None:
        entry = fast[key] = functools.partial(_fast_call, mod.call, mod.table())
    mod.table_add(entry.args[1], tensors, plan.host)


def _fast_call(call, table, tensors, scalars):
    return call(table, tensors, scalars) if _no_hooks() else None


def _hook(h):
    # Newer Triton keeps a (possibly empty) chain of hooks rather than None.
    return None if h is None or getattr(h, "calls", True) == [] else h


def _stream(device_index: int):
    return driver.active.get_current_stream(device_index)


_ARG_NAMES = scan_kernel.arg_names


# ---- plans: caller-layout tensors in, a Launch out -------------------------------------------
# Each `plan_*` takes the caller's tensors in the order of its `tensors` tuple and returns
# `_plan_with_fallback`'s (plan, copy).

def _tm(x: Optional[Tensor], time_dim: int) -> Optional[Tensor]:
    return None if x is None else x.movedim(time_dim, 0)


def _contiguous(tensors):
    return tuple(None if t is None else t.contiguous() for t in tensors)


def _plan_with_fallback(build, tensors, copy=_contiguous):
    """(plan, copy): copy is None when the plan reads the caller's tensors in place, else the
    function that makes the copies it reads (batch axes that no two strides describe)."""
    plan = build(tensors)
    if plan.ok:
        return plan, None
    return build(copy(tensors)), copy


def plan_value_estimator(kernel: Kernel, n_out: int, tensors: tuple, time_dim: int,
                         out_dtype: torch.dtype):
    """tensors: (rewards, values, terminated, truncated, last_value, next_values, *extra)."""

    def build(ts):
        rewards, values, terminated, truncated, last_value, next_values, *extra = ts
        carried = kernel.carries_last and last_value is not None and next_values is None
        r = _tm(rewards, time_dim)
        T = r.shape[0]
        ins = [r, _tm(values, time_dim), _tm(terminated, time_dim), _tm(truncated, time_dim),
               _tm(next_values, time_dim), None if carried else over_time(last_value, T)]
        ins += [_tm(x, time_dim) for x in extra]
        src = [0, 1, 2, 3, 5, 4] + [6 + i for i in range(len(extra))]
        src = [i if ins[k] is not None else None for k, i in enumerate(src)]
        return Launch(kernel, T, tuple(r.shape[1:]), ins, src, tuple(rewards.shape), time_dim,
                      n_out, out_dtype, has_trunc=truncated is not None,
                      has_next=next_values is not None, has_last=ins[5] is not None,
                      init=last_value if carried else None, init_src=4 if carried else None,
                      variant=int(carried))

    return _plan_with_fallback(build, tensors)


def plan_retrace(tensors: tuple, return_advantages: bool, time_dim: int, out_dtype: torch.dtype):
    """tensors: (rewards, q_values, actions, target_probs, behavior_probs, terminated,
    truncated, last_q_values, last_target_probs)."""

    def build(ts):
        rewards, q, actions, pi, mu, term, trunc, last_q, last_pi = ts
        T = rewards.shape[time_dim]
        ins = [_tm(rewards, time_dim), _tm(q, time_dim), _tm(actions, time_dim),
               _tm(pi, time_dim), _tm(mu, time_dim), _tm(term, time_dim), _tm(trunc, time_dim),
               over_time(last_q, T), over_time(last_pi, T)]
        src = [i if ts[i] is not None else None for i in range(9)]
        return Launch(RETRACE, T, tuple(ins[0].shape[1:]), ins, src, tuple(rewards.shape),
                      time_dim, 2 if return_advantages else 1, out_dtype,
                      action_slots=_RETRACE_ACTION_SLOTS, has_trunc=trunc is not None,
                      variant=int(return_advantages))

    return _plan_with_fallback(build, tensors)


def plan_forward_scan(tensors: tuple, time_dim: int, out_dtype: torch.dtype):
    """Eligibility traces and episodic prefix sums. tensors: (x, dones, initial)."""

    def build(ts):
        x, dones, initial = ts
        xt = _tm(x, time_dim)
        d = _tm(dones, time_dim)
        d = d[(...,) + (None,) * (xt.ndim - d.ndim)].expand(xt.shape)  # broadcast over features
        return Launch(FORWARD, xt.shape[0], tuple(xt.shape[1:]), [xt, d],
                      [0, 1], tuple(x.shape), time_dim, 1, out_dtype, init=initial,
                      init_src=None if initial is None else 2)

    def copy(ts):  # the flags materialized over the feature axes, so one group describes them
        x, dones, initial = ts
        d = dones[(...,) + (None,) * (x.ndim - dones.ndim)].expand(x.shape)
        return _contiguous((x, d, initial))

    return _plan_with_fallback(build, tensors, copy)


def plan_linear_scan(tensors: tuple, reverse: bool, time_dim: int, out_dtype: torch.dtype):
    """tensors: (alpha, beta, initial)."""

    def build(ts):
        alpha, beta, initial = ts
        a = _tm(alpha, time_dim)
        return Launch(SCAN_REVERSE if reverse else SCAN_FORWARD, a.shape[0],
                      tuple(a.shape[1:]), [a, _tm(beta, time_dim)], [0, 1], tuple(alpha.shape),
                      time_dim, 1, out_dtype, init=initial,
                      init_src=None if initial is None else 2)

    return _plan_with_fallback(build, tensors)


# ---- the ops: what torch.compile sees --------------------------------------------------------

def _run(name, build, tensors, scalars, options):
    """Run the plan `build(tensors)` makes, through the eager path's plan cache
    (`rl_triton.estimators`, keys "op:<name>"): a compiled step pays a look-up per call, not a
    plan (nor a new look-back scratch)."""
    from .. import estimators  # the one plan cache (imported here: it imports this lazily)
    name = "op:" + name
    out = estimators._cached(name, tensors, options, scalars)
    if out is not None:
        return out
    return estimators._plan_and_run(name, tensors, options, scalars, build)


def gae(rewards: Tensor, values: Tensor, terminated: Tensor, truncated: Optional[Tensor],
        last_value: Optional[Tensor], next_values: Optional[Tensor], gamma: float, lam: float,
        time_dim: int, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    ts = (rewards, values, terminated, truncated, last_value, next_values)
    adv, ret = _run("gae", lambda t: plan_value_estimator(GAE, 2, t, time_dim, out_dtype), ts,
                    (gamma, lam), (time_dim, out_dtype))
    return adv, ret


def lambda_returns(rewards: Tensor, values: Optional[Tensor], terminated: Tensor,
                   truncated: Optional[Tensor], last_value: Optional[Tensor],
                   next_values: Optional[Tensor], gamma: float, lam: float, time_dim: int,
                   out_dtype: torch.dtype) -> Tensor:
    ts = (rewards, values, terminated, truncated, last_value, next_values)
    return _run("lambda_returns",
                lambda t: plan_value_estimator(LAMBDA_RETURNS, 1, t, time_dim, out_dtype), ts,
                (gamma, lam), (time_dim, out_dtype))[0]


def discounted_returns(rewards: Tensor, terminated: Tensor, truncated: Optional[Tensor],
                       last_value: Optional[Tensor], next_values: Optional[Tensor], gamma: float,
                       time_dim: int, out_dtype: torch.dtype) -> Tensor:
    ts = (rewards, None, terminated, truncated, last_value, next_values)
    return _run("discounted_returns",
                lambda t: plan_value_estimator(DISCOUNTED_RETURNS, 1, t, time_dim, out_dtype), ts,
                (gamma,), (time_dim, out_dtype))[0]


def vtrace(rewards: Tensor, values: Tensor, terminated: Tensor, target_log_probs: Tensor,
           behavior_log_probs: Tensor, truncated: Optional[Tensor], last_value: Optional[Tensor],
           next_values: Optional[Tensor], gamma: float, lam: float, rho_clip: float,
           c_clip: float, pg_rho_clip: float, time_dim: int,
           out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    ts = (rewards, values, terminated, truncated, last_value, next_values, target_log_probs,
          behavior_log_probs)
    vs, pg = _run("vtrace", lambda t: plan_value_estimator(VTRACE, 2, t, time_dim, out_dtype), ts,
                  (gamma, lam, rho_clip, c_clip, pg_rho_clip), (time_dim, out_dtype))
    return vs, pg


def retrace(rewards: Tensor, q_values: Tensor, actions: Tensor, target_probs: Tensor,
            behavior_probs: Tensor, terminated: Tensor, truncated: Optional[Tensor],
            last_q_values: Tensor, last_target_probs: Tensor, gamma: float, lam: float,
            c_clip: float, return_advantages: bool, time_dim: int,
            out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(G, G - Q(s_t, a_t)); the second is empty unless return_advantages."""
    ts = (rewards, q_values, actions, target_probs, behavior_probs, terminated, truncated,
          last_q_values, last_target_probs)
    outs = _run("retrace", lambda t: plan_retrace(t, return_advantages, time_dim, out_dtype), ts,
                (gamma, lam, c_clip), (return_advantages, time_dim, out_dtype))
    if not return_advantages:
        outs.append(outs[0].new_empty(0))
    return outs[0], outs[1]


def forward_scan(x: Tensor, dones: Tensor, initial: Optional[Tensor], keep: float, time_dim: int,
                 out_dtype: torch.dtype) -> Tensor:
    """Eligibility traces (keep = gamma * lam) and episodic prefix sums (keep = 1)."""
    ts = (x, dones, initial)
    return _run("forward_scan", lambda t: plan_forward_scan(t, time_dim, out_dtype), ts, (keep,),
                (time_dim, out_dtype))[0]


def linear_scan(alpha: Tensor, beta: Tensor, initial: Optional[Tensor], reverse: bool,
                time_dim: int, out_dtype: torch.dtype) -> Tensor:
    ts = (alpha, beta, initial)
    return _run("linear_scan", lambda t: plan_linear_scan(t, reverse, time_dim, out_dtype), ts,
                (0.0,), (reverse, time_dim, out_dtype))[0]


# ---- registration ----------------------------------------------------------------------------

def _fake_outputs(ref: Tensor, out_dtype: torch.dtype, n: int):
    return tuple(torch.empty(ref.shape, dtype=out_dtype, device=ref.device) for _ in range(n))


def _fake_retrace(rewards, q_values, actions, target_probs, behavior_probs, terminated, truncated,
                  last_q_values, last_target_probs, gamma, lam, c_clip, return_advantages,
                  time_dim, out_dtype):
    g = torch.empty(rewards.shape, dtype=out_dtype, device=rewards.device)
    adv = torch.empty(rewards.shape if return_advantages else (0,), dtype=out_dtype,
                      device=rewards.device)
    return g, adv


_FAKES = {
    gae: lambda *a: _fake_outputs(a[0], a[-1], 2),
    lambda_returns: lambda *a: _fake_outputs(a[0], a[-1], 1)[0],
    discounted_returns: lambda *a: _fake_outputs(a[0], a[-1], 1)[0],
    vtrace: lambda *a: _fake_outputs(a[0], a[-1], 2),
    retrace: _fake_retrace,
    forward_scan: lambda *a: _fake_outputs(a[0], a[-1], 1)[0],
    linear_scan: lambda *a: _fake_outputs(a[0], a[-1], 1)[0],
}
OPS = {}
for _fn, _fake in _FAKES.items():
    OPS[_fn.__name__] = torch.library.custom_op(f"rl_triton::{_fn.__name__}", _fn,
                                                mutates_args=())
    OPS[_fn.__name__].register_fake(_fake)

