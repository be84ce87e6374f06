"""Compile every kernel variant for an H100/H200 (sm_90) with the installed Triton, on a machine
without a GPU: `python tests/compile_sm90.py` prints one line per variant and exits non-zero if
any fails to compile. Triton's interpreter, which runs the other tests on the CPU, never runs the
compiler, and compiler failures (a crashing layout pass, a construct one Triton version rejects)
would otherwise first show on the GPU. Run by tests/test_compile.py, without TRITON_INTERPRET;
`python tests/compile_sm90.py losses` compiles the losses' kernels only."""
import os
import re
import sys
import time

assert os.environ.get("TRITON_INTERPRET") != "1", "run without TRITON_INTERPRET"

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from cases import make_case  # noqa: E402
import rl_triton  # noqa: E402
from rl_triton.testing import NAMES, VALUE_ESTIMATORS, make_packed_inputs  # noqa: E402
from rl_triton._core import plans as _plans  # noqa: E402
from rl_triton._core.op import OPS, ops  # noqa: E402
from rl_triton.ops import _group  # noqa: E402
from rl_triton.ops import _losses  # noqa: E402
from rl_triton.ops import _whiten, outcome  # noqa: E402
from rl_triton.ops import linear_scan as linear_scan_op  # noqa: E402
from rl_triton.scan import jit, kernel, launch, tiles  # noqa: E402

jit.INTERPRETER = True  # backend="triton" takes CPU tensors here: their launches are intercepted

TARGET = GPUTarget("cuda", 90, 32)


def plans_of(case, layout, grad=False, per_row=False):
    """The launch plans the call would run (with `grad`, its forward's, then its backward's),
    built on CPU tensors (the launches intercepted): [(plan, (tensors, scalars, rows, cu))]."""
    def call():
        out = case.call(layout, backend="triton")
        if grad:
            # output gradients laid out as the outputs, as the benchmark's (a sum's gradient has
            # stride 0: loads that nothing vectorizes, which set another layout for the scan)
            out = [o for o in out if o.requires_grad]
            torch.autograd.backward(out, [torch.ones_like(o) for o in out])

    if grad or per_row:
        case = differentiable(case, per_row)
    return launches_of(call)


def launches_of(call):
    """The launch plans that `call()` runs (on CPU tensors, the launches intercepted)."""
    seen = []

    def intercept(plan, tensors, scalars, rows=None, cu=None):
        seen.append((plan, (tensors, scalars, rows, cu)))
        return [torch.empty(s, dtype=plan.out_dtype) for s in plan.output_shapes()]

    run, os.environ["TRITON_INTERPRET"] = launch.Launch.run, "1"  # lets backend="triton" take CPU
    launch.Launch.run = intercept
    try:
        _plans._PLANS.clear()
        call()
    finally:
        launch.Launch.run = run
        del os.environ["TRITON_INTERPRET"]
    return seen


def packed_plans(name, lengths, mask=False, **kw):
    """The launch plans of a packed call (semantics §7) on segments of `lengths` (`kw`: as
    `make_inputs`'; `features`: per-step tensors `[L, *features]`; `transposed`: as a view
    `[L, D]` of `[D, L]` memory), with a mask of ~70% decision steps or none."""
    transposed = kw.pop("transposed", False)
    steps, extra, cu = make_packed_inputs(name, lengths, **kw)
    if transposed:
        steps = {k: None if v is None else v.t().contiguous().t() for k, v in steps.items()}
    if mask:
        steps["mask"] = torch.rand(int(cu[-1]), generator=torch.Generator().manual_seed(0)) < 0.7
    fn = getattr(rl_triton, name)
    return launches_of(lambda: fn(**steps, **extra, cu_seqlens=cu, backend="triton"))


def differentiable(case, per_row):
    """The case with its value inputs requiring grad, and gamma / lam per row (`per_row`)."""
    def leaf(t):
        return t.detach().clone().requires_grad_() if t.dtype.is_floating_point else t

    case.steps = {k: v if v is None or k in ("terminated", "truncated", "dones") else leaf(v)
                  for k, v in case.steps.items()}
    extra = {k: leaf(v) if isinstance(v, torch.Tensor) else v for k, v in case.extra.items()}
    if per_row:
        batch = case.steps["rewards" if "rewards" in case.steps else "dones"].shape[1:]
        extra.update({k: torch.full(batch, extra[k]).requires_grad_()
                      for k in ("gamma", "lam") if k in extra})
    case.extra = extra
    return case


def whiten_launches(x, mask, group=False, **kw):
    """The kernel launches (kernel, args, kwargs) of `masked_whiten(x, mask, **kw)` on the
    Triton backend, then of its backward, on CPU tensors (the launches intercepted); with
    `group`, as for a process group (the all-reduce skipped, and the check that `group` is one:
    any object stands for it)."""
    seen = []

    class Intercept:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append((self.fn, args, kwargs))

    kernels = {k: v for k, v in vars(_whiten).items() if k.endswith("_kernel")}
    all_reduce, _whiten._all_reduce = _whiten._all_reduce, lambda t, group: None
    process_group, outcome._process_group = outcome._process_group, lambda group: group
    os.environ["TRITON_INTERPRET"] = "1"  # lets backend="triton" take CPU tensors
    for name, fn in kernels.items():
        setattr(_whiten, name, Intercept(fn))
    try:
        x = x.clone().requires_grad_()
        y = rl_triton.masked_whiten(x, mask, group=object() if group else None,
                                    backend="triton", **kw)
        y.float().sum().backward()
    finally:
        for name, fn in kernels.items():
            setattr(_whiten, name, fn)
        _whiten._all_reduce = all_reduce
        outcome._process_group = process_group
        del os.environ["TRITON_INTERPRET"]
    return seen


def compile_kernel(fn, args, kwargs):
    """What JITFunction.run does before it launches, for TARGET instead of the current GPU."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(kwargs, debug=False)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization,
                                                          options)
    return compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET,
                   options=options.__dict__)


def compile_plan(plan, tensors, scalars, rows=None, cu=None):
    """The scan kernel of a launch plan, compiled for TARGET."""
    outs = tuple(torch.empty(s, dtype=plan.out_dtype) for s in plan.output_shapes())
    ptrs = tuple(outs[0] if i is None else tensors[i] for i in plan.src)
    init = outs[0] if plan.init_src is None else tensors[plan.init_src]
    state = torch.zeros(plan.state_size, dtype=torch.int64)
    args = plan._args(ptrs, outs, init, state, scalars, outs[0] if rows is None else rows, cu)
    return compile_kernel(kernel.scan_kernel, args, plan.meta)


def look_back_loop_barriers(ptx: str):
    """bar.sync instructions inside the look-back loop (the loop whose body holds the volatile
    loads of the look-back words), or None when the PTX has no such loop."""
    lines = ptx.split("\n")
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"\s*(\$L__BB\d+_\d+):", line))}
    found = None
    for i, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if m and labels.get(m.group(1), i) < i:  # a backward branch closes a loop
            body = lines[labels[m.group(1)]:i + 1]
            if any("ld.volatile" in b for b in body):
                found = (found or 0) + sum("bar.sync" in b for b in body)
    return found


def check_look_back(plan, kernel):
    """Tiles of several rows read one warp's worth of look-back words per pass and every warp runs
    the loop on its own (`tiles.window`): a barrier inside it would make warps that leave at
    different passes wait at different barriers. Returns what is wrong, or ''."""
    m = plan.meta
    if not m["LOOKBACK"] or not 2 <= m["BLOCK_B"] <= 32:
        return ""
    if m["WINDOW"] * m["BLOCK_B"] != 32:
        return f"look-back window of {m['WINDOW']} x {m['BLOCK_B']} words, not one warp's worth"
    barriers = look_back_loop_barriers(kernel.asm["ptx"])
    if barriers is None:
        return "no look-back loop found in the PTX"
    return f"{barriers} barriers inside the one-warp look-back loop" if barriers else ""


def check_loads(plan, kernel):
    """Two measured wins that a compiler change could silently undo
    (docs/dev/kernel-decisions.md#inside-a-tile).
    Time-major tiles: no tile load wider than 4 along rows (the flags' 16-wide loads once set
    every input's layout, and the scan crossed 16 lanes); rows loaded several at a time where
    the plan says the time strides allow it (`ops.row_vector`: rows of 300); sub-tiles laid out
    one step per thread where their rows load as wide as the sub-tile allows (up to 4,
    `tiles.sub_tiles`), no step held by two threads. Batch-major tiles: scalar 32-bit loads
    from at most 2 addresses per thread where a thread holds 8 steps or more (values[t+1] is
    moved in registers, plus the step after each group of 8 and the bootstrap value; it was 8
    unaligned loads). Triton 3.6 repeats a broadcast load (the bootstrap value, the initial
    carry) for every step a thread holds, from one address: counted once. Retrace's 3-D tiles
    (float32 in `variants`): rows of an even number of actions loaded ACT_VEC actions at a time
    (the sum over actions took half the shuffles). Returns what is wrong, or ''."""
    m = plan.meta
    if m["BLOCK_A"] != 1:
        vec = m["ACT_VEC"]
        if vec > 1 and not re.search(rf"ld\.global\S*\.v{vec}\.b32", kernel.asm["ptx"]):
            return f"no loads of {vec} actions at once"
        return ""
    if m["TIME_AXIS"] == 0:
        ttgir = kernel.asm["ttgir"]
        layouts = {name: tuple(map(int, dims)) for name, *dims in re.findall(
            r"^(#\w+) = #ttg\.blocked<\{sizePerThread = \[(\d+), (\d+)\], "
            r"threadsPerWarp = \[(\d+), \d+\], warpsPerCTA = \[(\d+), \d+\]", ttgir, re.M)}
        steps = m["BLOCK_T"] // m["SUB"]
        tile = rf"tensor<{steps}x{m['BLOCK_B']}x!tt\.ptr<\w+>, (#\w+)>"
        used = set(re.findall(r"tt\.load [^\n]*: " + tile, ttgir))
        if not used or not used <= set(layouts):
            return "tile loads not found in the TTGIR"
        wide = sorted(layouts[u][1] for u in used if layouts[u][1] > 4)
        if wide:
            return f"time-major tile loads {wide} wide along rows"
        if m["ROW_VEC"] > 1 and not re.search(r"ld\.global\S*\.v\d\.b32", kernel.asm["ptx"]):
            return f"rows loaded one at a time, though time strides are multiples of {m['ROW_VEC']}"
        for u in used:
            # where rows are contiguous and aligned (4 per thread, as `tiles.sub_tiles` counts,
            # or fewer where a sub-tile holds fewer values per thread), one step per thread;
            # otherwise (rows strided or unaligned: one per thread) a thread holds several steps
            # of a sub-tile, but no step is held by two threads
            cover = layouts[u][0] * layouts[u][2] * layouts[u][3]
            per_thread = steps * m["BLOCK_B"] // (32 * m["num_warps"])
            exact = layouts[u][1] == min(4, m["BLOCK_B"], per_thread)
            if cover > steps or (exact and m["SUB"] > 1 and cover != steps):
                return f"sub-tiles of {steps} steps laid over {cover} steps of threads"
        return ""
    if m["BLOCK_T"] * m["BLOCK_B"] < 8 * 32 * m["num_warps"]:
        # fewer than 8 steps per thread (`tiles.FILL_MIN_ELEMENTS`: grids of fewer tiles than
        # multiprocessors): groups of 8 steps span threads, so the steps after them are loaded
        # one by one; measured faster there all the same
        # (docs/dev/kernel-decisions.md#the-next-steps-value-from-registers)
        return ""
    scalar = {address for op, address in re.findall(
        r"\b(ld\.global\S*)\s+\{[^}]*\},\s*\[([^\]]+)\]", kernel.asm["ptx"])
        if not re.search(r"\.v\d", op) and op.endswith("32")}
    return f"scalar 32-bit loads from {len(scalar)} addresses per thread" if len(scalar) > 2 else ""


def check_register_cap(plan, kernel):
    """A plan's register cap (`tiles.TileConfig.max_registers`, Triton's `maxnreg`) reaches
    the PTX as `.maxnreg`. Returns what is wrong, or ''."""
    cap = plan.meta.get("maxnreg")
    if cap and not re.search(rf"\.maxnreg\s+{cap}\b", kernel.asm["ptx"]):
        return f"no .maxnreg {cap} in the PTX"
    return ""


def check_reverse_scans(plan, kernel):
    """Reverse scans run forward over steps laid in decreasing t (scan.py, `DESC` and `FLIP`):
    no `reverse = true` scan in the TTGIR. And batch-major tiles reverse their groups of 8 steps
    in registers: at most 16 shuffles per scanned quantity where Triton's `reverse=True` took
    20-30 with Triton 3.9 and 84-90 with 3.6 (it reverses the tile across lanes around the scan);
    counted in tiles without look-back (whose loop has shuffles of its own), and not for the
    generic linear scan, whose float32 inputs put 4 steps in a thread, not 8, nor for Retrace,
    whose sums over actions cross lanes. Returns what is wrong, or ''."""
    m = plan.meta
    if not m["REVERSE"] or (m["TIME_AXIS"] == 1 and m["BLOCK_T"] < 8):
        return ""
    if "reverse = true" in kernel.asm["ttgir"]:
        return "a reverse=True scan in the TTGIR"
    if (m["TIME_AXIS"] == 0 or m["LOOKBACK"] or m["BLOCK_A"] != 1
            or m["COEF"] is linear_scan_op.coef):
        return ""
    per_quantity = kernel.asm["ptx"].count("shfl.sync") / (4 if m["EXCLUSIVE"] else 2)
    return f"{per_quantity:g} shuffles per scanned quantity" if per_quantity > 16 else ""


# the registry's scans whose kernels read a mask and run packed rows (semantics §7)
MASKED = [n for n in ops("scan") if OPS[n]._mask is not None]


def variants():
    """(label, case, layout): every estimator, both layouts, one tile per row, look-back, walked
    rows, bf16 inputs, every optional input."""
    for name in [n for n in NAMES if n != "linear_scan_forward"]:
        for T, n in [(4096, 4), (16, 64), (4096, 300), (64, 8448)]:
            for layout in ("time-major", "batch-major"):
                yield f"{name} T={T} N={n} {layout}", make_case(name, T, (n,), n_act=18), layout
    yield "gae next_values", make_case("gae", 4096, (4,), bootstrap="next_values"), "time-major"
    yield "gae bf16, no truncation", make_case("gae", 4096, (4,), dtype=torch.bfloat16,
                                               trunc=False), "batch-major"
    case = make_case("retrace", 4096, (4,), n_act=40)
    case.extra["return_advantages"] = False
    yield "retrace, 40 actions, no advantages", case, "batch-major"
    # Retrace's tiles spanning the window: one row of 128 steps (`retrace_terms`' early loads),
    # and bootstrap tensors of another dtype than Q's (their pass of their own)
    yield "retrace T=128 N=4096 batch-major", make_case("retrace", 128, (4096,), n_act=18), \
        "batch-major"
    case = make_case("retrace", 16, (64,), n_act=18)
    case.extra.update({k: case.extra[k].to(torch.bfloat16)
                       for k in ("last_q_values", "last_target_probs")})
    yield "retrace T=16 N=64, bfloat16 bootstrap", case, "time-major"
    yield "eligibility traces of vectors", make_case("eligibility_traces", 4096, (4,),
                                                     features=(3,)), "time-major"
    # a grid of many programs: V-trace's time-major tiles with their register cap (maxnreg)
    yield "vtrace T=512 N=16384 time-major", make_case("vtrace", 512, (16384,)), "time-major"


def mask_variants():
    """(label, case, layout): every estimator whose kernel reads a mask (semantics §7), both
    layouts, one tile per row, look-back and walked rows, and next_values."""
    def masked(case):
        shape = case.steps["rewards" if "rewards" in case.steps else "dones"].shape
        case.steps["mask"] = torch.rand(shape, generator=torch.Generator().manual_seed(0)) < 0.7
        return case

    for name in MASKED:
        for T, n in [(4096, 4), (16, 64), (64, 8448)]:
            for layout in ("time-major", "batch-major"):
                yield f"masked {name} T={T} N={n} {layout}", masked(make_case(name, T, (n,))), \
                    layout
    for n_act in (1, 18):  # Retrace: one action block, several, without the advantages
        for layout in ("time-major", "batch-major"):
            case = masked(make_case("retrace", 4096, (4,), n_act=n_act))
            case.extra["return_advantages"] = False
            yield f"masked retrace {n_act} actions, no advantages {layout}", case, layout
    yield "masked retrace bf16", masked(make_case("retrace", 4096, (4,), n_act=18,
                                                  dtype=torch.bfloat16)), "batch-major"
    for name in VALUE_ESTIMATORS:
        yield f"masked {name} next_values bf16", masked(make_case(
            name, 4096, (4,), dtype=torch.bfloat16, bootstrap="next_values")), "batch-major"
    for T, n in [(4096, 4), (64, 8448)]:
        yield f"masked vtrace next_values T={T} N={n} time-major", masked(make_case(
            "vtrace", T, (n,), bootstrap="next_values")), "time-major"
    yield "masked eligibility traces of vectors", masked(make_case(
        "eligibility_traces", 4096, (4,), features=(3,))), "time-major"


def packed_variants():
    """(label, plans): packed rows (semantics §7) of every estimator whose kernels run them in
    place, with and without a mask: the [L] stream (look-back over many tiles, segments of 1 to 4096
    steps), bf16 and next_values, feature axes (time-major tiles), walked rows (a transposed
    view of many feature rows), and many short segments (the search's third round)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 4097, (64,), generator=g).tolist()
    for name in MASKED:
        for mask in (False, True):
            label = f"packed {name}{' masked' if mask else ''}"
            yield label, lambda n=name, m=mask: packed_plans(n, lengths, m)
    for name in VALUE_ESTIMATORS:
        yield f"packed {name} masked next_values bf16", lambda n=name: packed_plans(
            n, lengths, True, dtype=torch.bfloat16, bootstrap="next_values")
    yield "packed vtrace next_values", lambda: packed_plans("vtrace", lengths,
                                                            bootstrap="next_values")
    yield "packed discounted_returns, no bootstrap", lambda: packed_plans(
        "discounted_returns", lengths, True, bootstrap=None)
    for mask in (False, True):
        yield f"packed eligibility traces of vectors{' masked' if mask else ''}", \
            lambda m=mask: packed_plans("eligibility_traces", lengths[:8], m, features=(8,))
        yield f"packed episodic sums, walked{' masked' if mask else ''}", \
            lambda m=mask: packed_plans("episodic_cumsum", [2048] * 4, m, features=(300,),
                                        transposed=True)
        yield f"packed gae, 300000 segments{' masked' if mask else ''}", \
            lambda m=mask: packed_plans("gae", [3] * 300000, m)


def grad_variants():
    """(label, case, layout, per_row): the backward kernels (and forward kernels with per-row
    discounts) of every op, both layouts, one tile per row, look-back and walked rows."""
    for name in NAMES:
        for T, n in [(4096, 4), (16, 64), (64, 8448)]:
            for layout in ("time-major", "batch-major"):
                yield (f"backward {name} T={T} N={n} {layout}", make_case(name, T, (n,)),
                       layout, name not in ("episodic_cumsum", "linear_scan_reverse",
                                            "linear_scan_forward"))
    yield ("backward gae next_values bf16", make_case("gae", 4096, (4,), dtype=torch.bfloat16,
                                                       bootstrap="next_values"), "batch-major",
           False)
    yield ("backward eligibility traces of vectors", make_case(
        "eligibility_traces", 4096, (4,), features=(3,)), "time-major", True)


def whiten_variants():
    """(label, launches): masked_whiten's kernels, forward and backward, for every input dtype
    (float64: the float64 arithmetic), a mask of each kind and none, both shift_mean, a process
    group's statistics, and sizes that are and are not a multiple of 16."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=g)
    half = torch.rand(20000, generator=g) < 0.5
    yield "masked_whiten float32, bool mask", whiten_launches(x, half)
    yield "masked_whiten bfloat16, no mask, shift_mean=False, bfloat16 out", whiten_launches(
        x.to(torch.bfloat16), None, shift_mean=False, out_dtype=torch.bfloat16)
    yield "masked_whiten float16 [333], float mask", whiten_launches(
        x[:333].to(torch.float16), half[:333].float())
    yield "masked_whiten float64, int32 mask, group", whiten_launches(
        x.double(), half.int(), group=True, std_correction=0, out_dtype=torch.float64)
    limit, _whiten.LAST_MAX = _whiten.LAST_MAX, 0  # as past 8M elements
    try:
        launches = whiten_launches(x, half)
    finally:
        _whiten.LAST_MAX = limit
    yield "masked_whiten float32, bool mask, combining kernel", launches


def group_launches(s, group_size, **kw):
    """The kernel launch of `group_advantages(s, group_size=..., **kw)` on the Triton backend,
    on CPU tensors (intercepted)."""
    seen, kernel = [], _group._group_kernel

    class Intercept:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append((kernel, args, kwargs))

    _group._group_kernel = Intercept()
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        rl_triton.group_advantages(s, group_size=group_size, backend="triton", **kw)
    finally:
        _group._group_kernel = kernel
        del os.environ["TRITON_INTERPRET"]
    return seen


def group_variants():
    """(label, launches): group_advantages' kernel, by each scale and baseline, float32 and
    bfloat16 scores, a group of one and the largest group."""
    s = torch.randn(4096)
    yield "group_advantages std, mean, float32, groups of 8", group_launches(s, 8)
    yield "group_advantages none, leave_one_out, bfloat16, groups of 1", group_launches(
        s.bfloat16(), 1, baseline="leave_one_out", scale="none")
    yield "group_advantages batch_std, groups of 1024", group_launches(
        s[::2], 1024, scale="batch_std")


def compile_whiten():
    """masked_whiten's and group_advantages' kernels compile; returns the failures."""
    failed = 0
    for label, launches in [*whiten_variants(), *group_variants()]:
        t0 = time.time()
        try:
            assert len(launches) == (1 if label.startswith("group") else
                                     5 if "combining kernel" in label else 4), \
                f"{len(launches)} launches"
            for fn, args, kwargs in launches:
                compile_kernel(fn, args, kwargs)
            print(f"ok      {label} ({time.time() - t0:.1f} s)", flush=True)
        except Exception as e:  # noqa: BLE001 - report every failure, then fail
            failed += 1
            print(f"FAILED  {label}: {type(e).__name__}: {str(e)[-400:]}", flush=True)
    return failed


def loss_launches(run, int64=False):
    """The launches [(kernel, args, meta)] that `run()` (a loss call and its backward, on CPU
    tensors) makes, intercepted; `int64`: as if the tensors were past 2^31 elements."""
    seen = []

    def intercept(kernel, programs, *args, plan=None, **meta):  # (plan: the host's memo)
        seen.append((kernel, args, meta))

    saved, os.environ["TRITON_INTERPRET"] = _losses.launch, "1"  # backend="triton" on CPU
    limit = _losses.INT32_MAX
    _losses.launch = intercept
    if int64:
        _losses.INT32_MAX = 1000
    try:
        run()
    finally:
        _losses.launch, _losses.INT32_MAX = saved, limit
        del os.environ["TRITON_INTERPRET"]
    return seen


def loss_variants():
    """(label, run, int64): every loss kernel, forward and backward, with every aggregation
    path (no sequences, rows, segments, per position), masks, dual clip, bf16, strided views,
    64-bit indexing."""
    g = torch.Generator().manual_seed(0)
    B, T = 64, 1000

    def leaf(*shape, dtype=torch.float32, transposed=False):
        x = torch.randn(shape[::-1] if transposed else shape, generator=g).to(dtype)
        return (x.t() if transposed else x).requires_grad_()

    mask = torch.rand(B, T, generator=g) < 0.7
    cu = torch.tensor([0, 100, 100, 1000, B * T])

    def ppo(shape=(B, T), dtype=torch.float32, transposed=False, **kw):
        xs = [leaf(*shape, dtype=dtype, transposed=transposed) for _ in range(3)]

        def run():
            loss, _, kl = rl_triton.ppo_policy_loss(*xs, **kw, backend="triton")
            (loss.float().sum() + kl).backward()
        return run

    def value(shape=(B, T), **kw):
        xs = [leaf(*shape) for _ in range(3)]
        return lambda: rl_triton.value_loss(*xs, **kw, backend="triton").sum().backward()

    def kl(kind, clamp, dtype=torch.float32):
        xs = [leaf(B, T, dtype=dtype) for _ in range(2)]
        return lambda: rl_triton.kl_penalty(*xs, kind, clamp, backend="triton").sum().backward()

    def sac(actions=None, tensor_alpha=False):
        N = 4096
        q = leaf(N, 2) if actions is None else leaf(N, actions, 2)
        lp = leaf(N) if actions is None else leaf(N, actions)
        probs = None if actions is None else torch.softmax(leaf(N, actions), -1)
        alpha = torch.tensor(0.2, requires_grad=True) if tensor_alpha else 0.2
        return lambda: rl_triton.sac_targets(leaf(N), torch.zeros(N, dtype=torch.bool), q, lp,
                                             alpha=alpha, next_probs=probs,
                                             backend="triton").sum().backward()

    def crr(**kw):
        return lambda: rl_triton.crr_weights(torch.randn(4096), torch.randn(4096, 8), **kw,
                                             backend="triton")

    yield "ppo token-mean, mask, dual clip", ppo(mask=mask, dual_clip=3.0), False
    yield "ppo seq-mean-token-mean rows", ppo(aggregation="seq-mean-token-mean"), False
    yield "ppo seq-mean-token-sum packed, mask", ppo(
        shape=(B * T,), mask=mask.reshape(-1), cu_seqlens=cu,
        aggregation="seq-mean-token-sum"), False
    yield "ppo none bf16, mask", ppo(dtype=torch.bfloat16, mask=mask, aggregation="none"), False
    yield "ppo sum, transposed views", ppo(transposed=True, aggregation="sum"), False
    yield "ppo token-mean, mask, 64-bit", ppo(mask=mask, dual_clip=3.0), True
    yield "value mse, token-mean", value(), False
    yield "value huber, clip, seq-mean-token-mean, mask", value(
        mask=mask, clip=0.2, kind="huber", aggregation="seq-mean-token-mean"), False
    yield "value mse, clip, none, 64-bit", value(clip=0.2, aggregation="none"), True
    for kind in ("k1", "abs", "k2", "k3"):
        yield f"kl {kind}", kl(kind, None), False
        yield f"kl {kind} clamp bf16", kl(kind, 10.0, torch.bfloat16), False
    yield "kl k3 clamp, 64-bit", kl("k3", 10.0), True
    yield "sac continuous", sac(), False
    yield "sac discrete, alpha tensor", sac(18, True), False
    yield "sac discrete, 64-bit", sac(100, True), True
    for kind in ("exp", "binary"):
        for baseline in ("mean", "max"):
            yield f"crr {kind} {baseline}", crr(kind=kind, baseline=baseline), False
    yield "crr exp mean, 64-bit", crr(), True

    def policy(loss_type, shape=(B, T), dtype=torch.float32, **kw):
        xs = [leaf(*shape, dtype=dtype) for _ in range(4)]
        kw.setdefault("mask", mask.reshape(shape))

        def run():
            loss, _ = rl_triton.policy_loss(xs[0], xs[1].detach() - 0.1, xs[2], weights=xs[3],
                                            loss_type=loss_type, dro_beta=0.1, backend="triton",
                                            **kw)
            loss.float().sum().backward()
        return run

    yield "policy vanilla token-mean, dual clip, delta", policy("vanilla", dual_clip=3.0,
                                                               delta=2.0), False
    yield "policy vanilla sequence ratio, seq-mean-token-mean rows", policy(
        "vanilla", ratio_level="sequence", aggregation="seq-mean-token-mean"), False
    yield "policy gspo packed seq-mean-token-sum", policy(
        "gspo", shape=(B * T,), cu_seqlens=cu, aggregation="seq-mean-token-sum"), False
    for loss_type in ("sapo", "gpg", "cispo", "dppo_tv", "dppo_kl", "dro", "clip_cov", "kl_cov"):
        yield f"policy {loss_type} token-sum", policy(loss_type, aggregation="token-sum"), False
    yield "policy cispo none bf16", policy("cispo", dtype=torch.bfloat16,
                                           aggregation="none"), False
    yield "policy vanilla token-mean, 64-bit", policy("vanilla", dual_clip=3.0), True

    def rollout(shape=(B, T), dtype=torch.float32, mask_dtype=torch.bool, **kw):
        lp = torch.randn(shape, generator=g).to(dtype)
        rp = (lp.float() + 0.1 * torch.randn(shape, generator=g)).to(dtype)
        m = mask.reshape(shape).to(mask_dtype)
        return lambda: rl_triton.rollout_correction(lp, rp, m, backend="triton", **kw)

    yield "rollout token truncate", rollout(), False
    yield "rollout sequence mask, weight_level token, bf16", rollout(
        dtype=torch.bfloat16, level="sequence", mode="mask", low=0.5, weight_level="token"), False
    yield "rollout geometric k3 mask packed, int mask", rollout(
        shape=(B * T,), mask_dtype=torch.int32, cu_seqlens=cu, level="geometric", mode="mask",
        statistic="k3", high=0.1), False
    yield "rollout max tv mask, no clamp", rollout(level="max", mode="mask", statistic="tv",
                                                   high=0.1, log_ratio_clamp=None), False


def compile_losses() -> int:
    """Compile every loss variant's kernels; the number that failed (a loss of the registry
    whose kernels no variant launches counts as one)."""
    failed, seen = 0, set()
    for label, run, int64 in loss_variants():
        t0 = time.time()
        try:
            launches = loss_launches(run, int64)
            if not launches:
                raise AssertionError("no launch")
            seen.update(fn.fn.__module__.rpartition(".")[2] for fn, _, _ in launches)
            for fn, args, meta in launches:
                compile_kernel(fn, args, meta)
            print(f"ok      {label}: {len(launches)} kernels ({time.time() - t0:.1f} s)",
                  flush=True)
        except Exception as e:  # noqa: BLE001 - report every failure, then fail
            failed += 1
            print(f"FAILED  {label}: {type(e).__name__}: {str(e)[-400:]}", flush=True)
    missing = set(ops("loss")) - seen
    if missing:
        failed += 1
        print(f"FAILED  losses without a variant: {sorted(missing)}", flush=True)
    return failed


def main():
    """`python tests/compile_sm90.py [scan|whiten|losses] [K/N]`: every kernel, or one family's;
    with K/N, the family's variants K, K + N, K + 2N, ... (parallel test workers share them)."""
    part = sys.argv[1] if len(sys.argv) > 1 else None
    k, n = map(int, sys.argv[2].split("/")) if len(sys.argv) > 2 else (0, 1)
    failed = compile_scans(k, n) if part in (None, "scan") else 0
    if part in (None, "whiten"):
        failed += compile_whiten()
    if part in (None, "losses"):
        failed += compile_losses()
    sys.exit(1 if failed else 0)


def compile_scans(shard=0, shards=1):
    """The scan kernels of every estimator compile and keep their rules (variants `shard`,
    `shard + shards`, ...); returns the failures."""
    tiles._multiprocessors = lambda device: 132  # choose tiles as for an H200
    gpu_window, gpu_depth = tiles.window, tiles.depth  # look-back windows as on a GPU (CPU
    tiles.window = lambda least, block_b, warps, device: gpu_window(  # plans: any window)
        least, block_b, warps, torch.device("cuda"))
    tiles.depth = lambda window, block_b, device: gpu_depth(window, block_b, torch.device("cuda"))
    forward = (check_look_back, check_loads, check_register_cap, check_reverse_scans)
    rules = (check_look_back, check_register_cap)  # loads not tuned yet where only these apply
    jobs = [(label, lambda case=case, layout=layout: one(plans_of(case, layout)), forward)
            for label, case, layout in variants()]
    # masked kernels and packed rows (semantics §7)
    jobs += [(label, lambda case=case, layout=layout: one(plans_of(case, layout)), rules)
             for label, case, layout in mask_variants()]
    jobs += [(label, lambda plans=plans: one(plans()), (check_packed, *rules))
             for label, plans in packed_variants()]
    # backward kernels, and forward kernels with per-row discounts
    jobs += [(label, lambda c=case, lay=layout, p=per_row: plans_of(c, lay, grad=True, per_row=p),
              rules) for label, case, layout, per_row in grad_variants()]
    mine = jobs[shard::shards]
    print(f"variants: {len(mine)} of {len(jobs)}", flush=True)
    return sum(compile_checked(*job) for job in mine)


def one(plans: list) -> list:
    assert len(plans) == 1, f"{len(plans)} plans, expected one"
    return plans


def check_packed(plan, kernel):
    return None if plan.meta["SEGMENTS"] else "not the packed kernel"


def compile_checked(label, plans, checks) -> int:
    """Compile every launch plan of `plans()` for TARGET and apply `checks` (each
    (plan, kernel) -> a problem or None); print the outcome; 1 if anything failed."""
    t0 = time.time()
    try:
        for i, (plan, args) in enumerate(plans()):
            kernel = compile_plan(plan, *args)
            problem = next(filter(None, (check(plan, kernel) for check in checks)), None)
            if problem:
                raise AssertionError(f"plan {i}: {problem}")
        print(f"ok      {label} ({time.time() - t0:.1f} s)", flush=True)
        return 0
    except Exception as e:  # noqa: BLE001 - report every failure, then fail
        print(f"FAILED  {label}: {type(e).__name__}: {str(e)[-400:]}", flush=True)
        return 1


if __name__ == "__main__":
    main()
