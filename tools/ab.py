"""A/B device times of variants of the tile rule, in one process, alternating (for checking
rl_triton/scan/tiles.py against measurements: docs/dev/tile-rule.md):

    python tools/ab.py [--rounds 5] retrace:1024x1024:bm vtrace:4x1048576:bm:bf16:notrunc \\
        -- base 'walk|rule:WALK_PROGRAMS_PER_SM_ACTIONS=1' 'w2|tiles:num_warps=2,max_registers=0'

A problem is estimator:NxT:tm|bm, then optionally :bf16, :notrunc (no truncation flags), :mask
(a mask of ~70% decision steps, semantics §7) and :bwd (the backward pass alone, every floating
input requiring grad, as `python -m rl_triton.bench --modes bwd` times it), as for
`tools/registers.py`; its inputs are the benchmark's (`rl_triton.bench.registry.make_inputs`). A
variant is a label, then optionally |rule:NAME=value,... (constants of the rule, as
`python -m rl_triton.bench --rule`) and |tiles:field=value,... (tile fields forced, as
`--tiles`); the first variant is the reference of the ratios. Every variant's plan is printed
and its result checked against float64 before any timing; then each round times every variant
once (`rl_triton.bench.timing.device_time_us`, a fresh plan each time), and the medians are printed
with their ratio to the first variant's. Without a GPU (`TRITON_INTERPRET=1`), only the plans
and the checks."""
import argparse
import contextlib
import functools
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import rl_triton  # noqa: E402
from rl_triton._core import plans as _plans  # noqa: E402
from rl_triton.bench import calls, checks, cli, registry, timing  # noqa: E402
from rl_triton.scan import tiles  # noqa: E402

PLAN_FIELDS = ("BLOCK_T", "BLOCK_B", "num_warps", "maxnreg", "WALK", "LOOKBACK", "WINDOW",
               "DEPTH", "SUB", "EVEN")


def parse_problem(s):
    name, shape, layout, *extra = s.split(":")
    if layout not in ("tm", "bm") or not set(extra) <= {"bf16", "notrunc", "mask", "bwd"}:
        raise argparse.ArgumentTypeError(
            f"{s!r} is not estimator:NxT:tm|bm[:bf16][:notrunc][:mask][:bwd]")
    N, T = registry.parse_shape(shape)
    return dict(name=name, N=N, T=T, layout="time-major" if layout == "tm" else "batch-major",
                dtype=torch.bfloat16 if "bf16" in extra else torch.float32,
                truncation="notrunc" not in extra, mask="mask" in extra, bwd="bwd" in extra)


def parse_variant(s):
    label, *parts = s.split("|")
    rule, forced = {}, {}
    for part in parts:
        kind, _, body = part.partition(":")
        if kind == "rule":
            rule.update(cli.parse_rule(body))
        elif kind == "tiles":
            forced.update(cli.parse_tiles(body))
        else:
            raise argparse.ArgumentTypeError(f"{part!r} is not rule:... or tiles:...")
    return label, rule, forced


@contextlib.contextmanager
def variant(rule, forced):
    """The rule's constants and tile fields of a variant, with no plan built before it."""
    _plans._PLANS.clear()
    with tiles.rule(**rule), tiles.override(**forced):
        yield
    _plans._PLANS.clear()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        sys.exit(__doc__)
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="tools/ab.py")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("problems", nargs="+", type=parse_problem)
    args = p.parse_args(argv[:split])
    variants = [parse_variant(v) for v in argv[split + 1:]]
    if not variants:
        sys.exit("no variants after --")
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    for prob in args.problems:
        spec = (f"{prob['name']}:{prob['N']}x{prob['T']}:{prob['layout']}:"
                f"{str(prob['dtype'])[6:]}{'' if prob['truncation'] else ':notrunc'}"
                f"{':mask' if prob['mask'] else ''}{':bwd' if prob['bwd'] else ''}")
        kw, nbytes = registry.make_inputs(prob["name"], prob["N"], prob["T"], prob["layout"],
                                          prob["dtype"], prob["truncation"], device, seed=1)
        if prob["mask"]:  # one byte a step more
            first = kw.get("rewards", next(iter(kw.values())))
            kw["mask"] = torch.rand(first.shape, generator=torch.Generator(device).manual_seed(2),
                                    device=device) < 0.7
            nbytes += kw["mask"].numel()
        name = prob["name"]
        call = functools.partial(getattr(rl_triton, name), **({} if gpu else
                                                               {"backend": "triton"}))
        if prob["bwd"]:  # the backward alone, on the forward's graph (`calls.backward_fn`)
            kw, leaves = calls.grad_inputs(kw)
            nbytes = registry.bwd_bytes(name, kw, leaves)

            def timed():
                return calls.backward_fn(call(**kw), leaves)
        else:
            refs = checks.float64_result(name, kw)

            def timed():
                return functools.partial(call, **kw)
        for label, rule, forced in variants:
            with variant(rule, forced):
                if prob["bwd"]:  # exits on a wrong gradient
                    checks.check_gradients(call, kw, leaves, name, spec)
                    err = 0.0
                else:
                    err = checks.rel_err(timed()(), refs, kw["time_dim"])
                plan = list(_plans._PLANS.values())[-1]  # the backward's after the forward's
            meta = " ".join(f"{k}={plan.meta[k]}" for k in PLAN_FIELDS if k in plan.meta)
            print(f"  {spec} {label}: relative error {err:.1e}, grid {plan.grid[0]}, {meta}",
                  flush=True)
            if not err < 1e-5:
                sys.exit(f"{spec} {label}: relative error {err:.3g}; not timing a wrong result")
        if not gpu:
            continue
        hold = timing._HOLD_CYCLES_GRAD if prob["bwd"] else timing._HOLD_CYCLES
        times = {label: [] for label, _, _ in variants}
        for _ in range(args.rounds):
            for label, rule, forced in variants:
                with variant(rule, forced):
                    fn = timed()
                    fn()
                    times[label].append(timing.device_time_us(fn, hold_cycles=hold))
        ref = statistics.median(times[variants[0][0]])
        line = (f"{spec}: {nbytes / 1e6:.1f} MB, same-bytes copy "
                f"{timing.same_bytes_copy_us(nbytes, device):.1f} us")
        for label, _, _ in variants:
            m = statistics.median(times[label])
            line += f" | {label} {m:.1f} ({m / ref:.3f})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
