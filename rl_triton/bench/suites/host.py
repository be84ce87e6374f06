"""`--suite host`: the host path, what the CPU spends in one call before it returns.

For every estimator and shape (N x T), both layouts, every input dtype and bool and float32
flags: host time and full-call time of rl_triton's public call, beside
- the bound: the same compiled scan kernel (the plan the call cached) launched bare from Python,
  its arguments precomputed, after its outputs' `torch.empty`, nothing else (`bare_launch`): what
  no Python host path can beat;
- the anchor: rl-triton 0.1.3, the paper's library (`--anchor-path`, `bench.anchor`), once per
  estimator and shape in the only layout and dtype it takes (batch-major float32, float32 flags);
then Retrace, group_advantages, masked_whiten, every loss, policy_loss and rollout_correction
(`registry.HOST_ZOO`) at 4096x128, against GAE's host time (GAE timed again among them). The
launch floor (`x.add_(1)`, host and full call) is in the run's environment. Every result is
checked before it is timed: rl_triton's against float64, the bound's and the anchor's against
rl_triton's. The calls of one estimator and shape (or the other ops) are timed together, in
rounds (`timing.interleaved_call_times_us`), so that the host's drift falls on all alike.
"""
from __future__ import annotations

import contextlib
import inspect
import itertools

import torch

import rl_triton
from rl_triton import reference, testing
from rl_triton.scan import launch as scan_launch

from .. import anchor, registry, report, timing
from ..calls import as_tuple, call_of
from ..checks import check_result, float64_result, rel_err
from ..registry import LOSS_OUTPUT_TOL
from ..report import HostRow
from .losses import LOSS_FORMULAS, loss_kwargs
from .tokens import group_float64

ANCHOR_TOL = 1e-4  # the anchor against rl_triton: two float32 scans, in other orders


@contextlib.contextmanager
def launches():
    """The scan launches made inside the block (`rl_triton.scan.launch.Launch.run`), as (plan,
    its arguments by name)."""
    seen = []
    run = scan_launch.Launch.run
    signature = inspect.signature(run)

    def record(plan, *args, **kwargs):
        bound = signature.bind(plan, *args, **kwargs)
        bound.apply_defaults()
        seen.append((plan, bound.arguments))
        return run(plan, *args, **kwargs)

    scan_launch.Launch.run = record
    try:
        yield seen
    finally:
        scan_launch.Launch.run = run


def bare_launch(fn, kw, what=""):
    """(launch, the call's outputs): `launch()` runs the compiled kernel of the plan that
    `fn(**kw)` launches (one scan launch) on the same inputs: its outputs allocated as the plan
    allocates them (`torch.empty`, or `empty_like` of an input they match; two for GAE and
    V-trace), then the kernel's launcher with every other argument computed here
    once, as the plan's own replay (`Launch._replay`) passes them. Refuses a call that is not
    one compiled launch."""
    fn(**kw)  # the plan built and its kernel compiled
    with launches() as seen:
        outs = as_tuple(fn(**kw))
    if len(seen) != 1:
        raise SystemExit(f"{what}: {len(seen)} scan launches in one call; the bound is one")
    plan, a = seen[0]
    kernel = plan.compiled
    if kernel is None:
        raise SystemExit(f"{what}: the bound needs the compiled kernel (a GPU, not Triton's "
                         "interpreter)")
    x, rows, cu = a["x"], a["rows"], a["cu"]
    stream = scan_launch._stream(plan.device_index)
    _, state = plan._state(stream)
    slot = object()  # where the outputs' addresses go
    args = plan._args(tuple(0 if i is None else x[i].data_ptr() for i in plan.src), slot,
                      0 if plan.init_src is None else x[plan.init_src].data_ptr(), state,
                      a["scalars"], 0 if rows is None else rows.data_ptr(),
                      None if cu is None else cu.data_ptr())
    k = next(i for i, v in enumerate(args) if v is slot)
    head = (plan.grid[0], plan.grid[1], 1, stream, kernel.function, kernel.packed_metadata,
            None, None, None, *args[:k])  # no launch metadata, no hooks
    tail = (*args[k + 1:], *plan.tail)
    shapes, dtype, device, run = plan.output_shapes(), plan.out_dtype, plan.device, kernel.run
    like = None if plan.like is None else x[plan.like]  # the allocation `Launch.run` makes

    def launch(_inputs=(x, rows, cu)):  # kept alive: their addresses are in `head`
        new = ([torch.empty(s, dtype=dtype, device=device) for s in shapes] if like is None
               else [torch.empty_like(like) for _ in shapes])
        run(*head, tuple([o.data_ptr() for o in new]), *tail)
        return new

    return launch, outs


def estimator_cells(name, shape, layouts, dtypes, flags, device, seed=0, anchor_module=None):
    """The timed calls of one estimator and shape, each checked first: (layout, dtype, flags,
    impl, fn, relative error) of rl_triton's call and its bound (`bare_launch`) in every layout,
    dtype and flags, then the anchor's call where there is one."""
    N, T = registry.parse_shape(shape)
    fn = getattr(rl_triton, name)
    for layout, dt, fl in itertools.product(layouts, dtypes, flags):
        what = f"{name} {shape} {layout} {dt} {fl} flags"
        kw, _ = registry.make_inputs(name, N, T, layout, registry.DTYPES[dt], False, device,
                                     seed, flag_dtype=registry.FLAG_DTYPES[fl])
        f = call_of(fn, kw)
        err = rel_err(f(), float64_result(name, kw), kw["time_dim"])
        check_result(err, 1e-5, what)
        yield layout, dt, fl, "rl_triton", f, err
        bound, want = bare_launch(fn, kw, what)
        # equal to rounding, not bit for bit: tiles that look back over several predecessors
        # compose their maps in whatever order the launch's timing gives (scan.kernel.look_back)
        got = bound()
        if not all(torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6, equal_nan=True)
                   for a, b in zip(got, want)):
            worst = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want))
            raise SystemExit(f"{what}: the bare launch's outputs differ from the call's (by up "
                             f"to {worst:.3g}); not timing it")
        yield layout, dt, fl, "bound", bound, 0.0
    if anchor_module is None:
        return
    # the only layout, dtype and flags it takes
    kw, _ = registry.make_inputs(name, N, T, "batch-major", torch.float32, False, device, seed,
                                 flag_dtype=torch.float32)
    if name in anchor.CALLS:
        f, pairs = anchor.CALLS[name](anchor_module, kw)
        ours = as_tuple(fn(**kw))
        err = rel_err(as_tuple(f()), tuple(ours[j].double() for j in pairs), 0)
        check_result(err, ANCHOR_TOL, f"the anchor's {name} {shape}")
        yield "batch-major", "float32", "float", "anchor", f, err


def other_cells(device, seed=0):
    """The other ops at `registry.HOST_OTHERS_SHAPE` (N x T), float32, each checked first:
    (call, variant, layout, flags, fn, relative error). GAE and Retrace in each layout;
    group_advantages on N x T scores in groups of T; masked_whiten on N x T multi-turn rows;
    every loss case on [N, T] rows (PPO, value, KL) or N x T samples (SAC, CRR), against its
    eager formula; then `registry.HOST_ZOO` on the PPO case's rows."""
    shape = registry.HOST_OTHERS_SHAPE
    N, T = registry.parse_shape(shape)

    def checked(call, variant, layout, flags, f, want, td=0, tol=1e-5):
        err = rel_err(f(), want, td)
        check_result(err, tol, f"{call} {variant} {shape}")
        return call, variant, layout, flags, f, err

    for name in ("gae", "retrace"):  # GAE: the others' yardstick, timed among them
        for layout in registry.LAYOUTS:
            kw, _ = registry.make_inputs(name, N, T, layout, torch.float32, False, device, seed)
            yield checked(name, "", layout, "bool", call_of(getattr(rl_triton, name), kw),
                          float64_result(name, kw), kw["time_dim"])
    scores = torch.randn(N * T, generator=torch.Generator().manual_seed(seed)).to(device)
    groups = dict(group_size=T)
    yield checked("group_advantages", f"group_size={T}", "", "",
                  call_of(rl_triton.group_advantages, dict(scores=scores, **groups)),
                  (group_float64(scores, groups),))
    rows = testing.token_rows(N, T, "multi-turn", torch.float32, device, seed)
    x, m = rows["values"], rows["mask"]
    yield checked("masked_whiten", "multi-turn mask", "", "",
                  call_of(rl_triton.masked_whiten, dict(x=x, mask=m)),
                  (reference.masked_whiten(x, m),))
    for case in registry.LOSS_CASES:
        kw = loss_kwargs(case, N * T, torch.float32, device, seed, row=T)
        want = tuple(o.double() for o in as_tuple(LOSS_FORMULAS[case[0]](**kw)))
        yield checked(case[0], case[1], "", "", call_of(getattr(rl_triton, case[0]), kw), want,
                      tol=LOSS_OUTPUT_TOL)
    # the zoo's ops on the PPO case's rows: policy_loss's loss against PPO's formula (vanilla
    # with a dual clip is PPO's surrogate), rollout_correction's weights against float64
    ppo = next(case for case in registry.LOSS_CASES if case[0] == "ppo_policy_loss")
    rows = loss_kwargs(ppo, N * T, torch.float32, device, seed, row=T)
    for call, variant, options in registry.HOST_ZOO:
        if call == "policy_loss":
            kw = dict(rows, **options)
            want = (LOSS_FORMULAS["ppo_policy_loss"](**kw)[0].double(),)
        else:
            kw = dict(log_probs=rows["log_probs"], rollout_log_probs=rows["old_log_probs"],
                      mask=rows["mask"], **options)
            want = (reference.rollout_correction(**kw)[0],)
        yield checked(call, variant, "", "", call_of(getattr(rl_triton, call), kw), want,
                      tol=LOSS_OUTPUT_TOL)


def run_host(estimators, shapes, layouts, dtypes, flags, env, device, out, max_seconds,
             anchor_module=None):
    """`--suite host`: `estimator_cells` of every estimator and shape, then `other_cells`, each
    timed (host and full call); bench.json (suite "host") after each estimator and shape, then
    bench.md and host.png."""
    rows: list[HostRow] = []
    report.save_json(out, env, rows, "host")
    configs = ([(name, shape) for name in estimators for shape in shapes]
               + [("others", registry.HOST_OTHERS_SHAPE)])
    for i, (name, shape), tag in timing.within_seconds(configs, max_seconds):
        if name == "others":
            cells = (("others", call, variant, shape, layout, "float32", fl, "rl_triton", f, err)
                     for call, variant, layout, fl, f, err in other_cells(device, i))
        else:
            cells = (("grid", name, "", shape, layout, dt, fl, impl, f, err)
                     for layout, dt, fl, impl, f, err in estimator_cells(
                         name, shape, layouts, dtypes, flags, device, i, anchor_module))
        # checked first, then timed together (`timing.interleaved_call_times_us`): a cell's
        # ratio to the anchor, the bound or GAE compares calls timed in the same rounds
        cells = list(cells)
        for (*key, _, err), (full, host) in zip(
                cells, timing.interleaved_call_times_us([c[-2] for c in cells])):
            row = HostRow(*key, host, full, err)
            rows.append(row)
            print(f"{tag} {row.call:18s} {row.variant:18s} {row.shape:>10s} {row.layout:11s} "
                  f"{row.dtype:8s} {row.flags:5s} {row.impl:9s} {host:8.1f} us host "
                  f"{full:8.1f} us full", flush=True)
        # after every estimator and shape, so that a run cut short keeps what it measured
        report.save_json(out, env, rows, "host")
    report.write_saved_reports(out)
