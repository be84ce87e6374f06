"""A/B of this checkout against an earlier revision of rl_triton, in one process, alternating:
the device time of every forward cell of the benchmark's grid (`rl_triton.bench`) at or above
a size, each result of both checked against float64 first; with `--bwd`, of the backward pass
alone (as `python -m rl_triton.bench --modes bwd`; gradients checked against float64).

    python tools/ab_base.py prepare 551440a          # here: the revision as .ab/rl_triton_base
    python tools/ab_base.py warm --shard 3/16        # compile one shard's kernels (both sides)
    python tools/ab_base.py time --out ab.json       # on the GPU: time them, A/B alternating
    python tools/ab_base.py full-call                # full-call µs of GAE at 4096x128
    python tools/ab_base.py time --bwd --dtypes float32 --truncation yes \\
        --shapes 512x4096,4x1048576 --only vtrace,retrace --min-mb 0   # backward passes

`prepare` copies the revision's package (`git archive`) to .ab/rl_triton_base/ as the package
`rl_triton_base` (its custom ops in the namespace rl_triton_base), so that both import in one
process; .ab/ is ignored by git (add `/.ab/` to .git/info/exclude), and the device tool carries
it. `warm` runs every cell of one shard once, so that shards in parallel processes fill
Triton's on-disk cache before `time` runs. The ratios are this checkout's time over the base's.
"""
import argparse
import functools
import inspect
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / ".ab"))

BASE_DIR = ROOT / ".ab" / "rl_triton_base"
NEW = "rl_triton"  # the package timed against the base (`--new`: another prepared revision)
ONLY = []  # label prefixes of the cells to time (`--only`; all when empty)
BWD = False  # time backward passes (`--bwd`)
DTYPES = None  # the dtypes' names to time (`--dtypes`; all when None)
TRUNCATION = (True, False)  # with truncation flags, without (`--truncation`)
SHAPES = None  # the shapes to time (`--shapes`; the benchmark's when None)


def prepare(rev: str, name: str = "rl_triton_base") -> None:
    global BASE_DIR
    BASE_DIR = ROOT / ".ab" / name
    import re
    import shutil
    import tarfile
    import tempfile
    if BASE_DIR.exists():
        shutil.rmtree(BASE_DIR)
    with tempfile.TemporaryDirectory() as tmp:
        tar = Path(tmp) / "base.tar"
        subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(tar), rev, "rl_triton"],
                       check=True)
        with tarfile.open(tar) as t:
            t.extractall(tmp)
        shutil.move(str(Path(tmp) / "rl_triton"), str(BASE_DIR))
    for path in BASE_DIR.rglob("*.py"):
        s = path.read_text()
        s = s.replace("rl_triton::", f"{name}::")
        s = re.sub(r"\b(import|from) rl_triton\b", rf"\1 {name}", s)
        path.write_text(s)
    (BASE_DIR / "REVISION").write_text(subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", rev], capture_output=True, text=True,
        check=True).stdout)
    print(f"{rev} -> {BASE_DIR}")


def cells(min_mb: float):
    from rl_triton.bench import registry
    out = []
    for name in registry.ESTIMATORS:
        for shape in SHAPES or registry.SHAPES:
            N, T = registry.parse_shape(shape)
            for layout in registry.LAYOUTS:
                for dt in DTYPES or registry.DTYPES:
                    for trunc in TRUNCATION:
                        if not trunc and name in ("eligibility_traces", "episodic_cumsum"):
                            continue  # their flags are the dones either way
                        # bytes are linear in the steps and the rows: from 1x1 and 1x2
                        one, two = (registry.make_inputs(name, 1, t, layout,
                                                         registry.DTYPES[dt], trunc, "cpu")[1]
                                    for t in (1, 2))
                        nbytes = N * T * (two - one) + N * (2 * one - two)
                        c = (name, N, T, layout, dt, trunc, nbytes)
                        if nbytes >= min_mb * 1e6 and (
                                not ONLY or any(_label(c).startswith(o) for o in ONLY)):
                            out.append(c)
    return out


def _label(c):
    name, N, T, layout, dt, trunc, _ = c
    return f"{name}:{N}x{T}:{'tm' if layout == 'time-major' else 'bm'}:{dt}" + (
        "" if trunc else ":notrunc")


def _fns(c, device):
    """(new, base, check): the cell's call with this checkout's package and the base's (`--bwd`:
    their backward passes, on graphs built here), and `check()`, which names the sides whose
    results (gradients) do not match float64 (a cell where this checkout's is wrong is reported,
    not timed; one where only the base's is, timed and marked)."""
    import rl_triton_base
    from rl_triton.bench import calls, checks, registry
    rl_triton = __import__(NEW)
    name, N, T, layout, dt, trunc, nbytes = c
    kw, _ = registry.make_inputs(name, N, T, layout, registry.DTYPES[dt], trunc, device, seed=1)
    # Retrace's action check (a reduction and a sync) is timed apart (`full-call`): kernel
    # against kernel here, on both sides where the base has the option
    extra = {"check_actions": False} if name == "retrace" else {}
    fn_new = functools.partial(getattr(rl_triton, name), **extra)
    fn_base = getattr(rl_triton_base, name)
    if extra and "check_actions" in inspect.signature(fn_base).parameters:
        fn_base = functools.partial(fn_base, **extra)
    if BWD:
        kw, leaves = calls.grad_inputs(kw)
        new = calls.backward_fn(fn_new(**kw), leaves)
        base = calls.backward_fn(fn_base(**kw), leaves)

        def check():  # the sides whose gradients are wrong, and how (none: time the cell)
            wrong = []
            for side, fn in (("new", fn_new), ("base", fn_base)):
                try:
                    checks.check_gradients(fn, kw, leaves, name, _label(c))
                except SystemExit as e:
                    wrong.append(f"{side}: {e}")
            return wrong
    else:
        new = functools.partial(fn_new, **kw)
        base = functools.partial(fn_base, **kw)

        def check():
            refs = checks.float64_result(name, kw)
            errs = [checks.rel_err(f(), refs, kw["time_dim"]) for f in (new, base)]
            return [f"{side}: relative error {e:.3g} >= 1e-5"
                    for side, e in zip(("new", "base"), errs) if not e < 1e-5]
    return new, base, check


def warm(shard: str, min_mb: float) -> None:
    import torch
    k, n = map(int, shard.split("/"))
    for i, c in enumerate(cells(min_mb)):
        if i % n == k:
            new, base, _ = _fns(c, "cuda")
            new(), base()
    torch.cuda.synchronize()


def time_cells(min_mb: float, rounds: int, rep_ms: float, out: str) -> None:
    import torch
    from rl_triton.bench import timing
    rows = []
    for c in cells(min_mb):
        new, base, check = _fns(c, "cuda")
        wrong = check()
        if any(w.startswith("new") for w in wrong):  # reported, not timed; the others go on
            rows.append(dict(cell=_label(c), mb=c[-1] / 1e6, wrong=wrong))
            print(f"{_label(c)}: not timed, a wrong result: {'; '.join(wrong)}", flush=True)
            del new, base, check
            continue
        if wrong:  # only the base's result is wrong (a defect fixed since): timed, and said
            print(f"{_label(c)}: timed, the base's result wrong: {'; '.join(wrong)}", flush=True)
        hold = timing._HOLD_CYCLES_GRAD if BWD else timing._HOLD_CYCLES
        t_new, t_base = [], []
        for _ in range(rounds):
            t_new.append(timing.device_time_us(new, rep_ms=rep_ms, hold_cycles=hold))
            t_base.append(timing.device_time_us(base, rep_ms=rep_ms, hold_cycles=hold))
        row = dict(cell=_label(c), mb=c[-1] / 1e6, new_us=statistics.median(t_new),
                   base_us=statistics.median(t_base))
        row["ratio"] = row["new_us"] / row["base_us"]
        if wrong:
            row["base_wrong"] = wrong
        rows.append(row)
        print(f"{row['cell']}: {row['mb']:.1f} MB new {row['new_us']:.2f} base "
              f"{row['base_us']:.2f} us ratio {row['ratio']:.3f}", flush=True)
        del new, base, check
        torch.cuda.empty_cache()
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    ratios = ratios or [float("nan")]  # (no cell timed)
    summary = dict(cells=len(rows), wrong=sum("wrong" in r for r in rows),
                   base_wrong=sum("base_wrong" in r for r in rows),
                   median=statistics.median(ratios), worst=max(ratios), best=min(ratios),
                   over_1_05=sum(r > 1.05 for r in ratios),
                   over_1_10=sum(r > 1.10 for r in ratios),
                   base=(BASE_DIR / "REVISION").read_text().strip(),
                   torch=torch.__version__, gpu=torch.cuda.get_device_name())
    print(json.dumps(summary))
    if out:
        Path(out).write_text(json.dumps(dict(summary=summary, rows=rows), indent=1))


def full_call(package: str, calls: int) -> None:
    """Full-call µs (sync, call, sync; median) of GAE at 4096x128, float32, both layouts, with
    `package` ("rl_triton", "rl_triton_base", or "paper": rl-triton 0.1.3's compute_gae,
    batch-major only, importable as rl_triton from PAPER_PATH)."""
    import torch
    from rl_triton.bench import anchor, registry, timing
    N, T = 4096, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    for layout in ("batch-major", "time-major"):
        shape = (N, T) if layout == "batch-major" else (T, N)
        r, v = (torch.randn(shape, generator=g, device="cuda") for _ in range(2))
        term = torch.rand(shape, generator=g, device="cuda") < 0.01
        lv = torch.randn(N, generator=g, device="cuda")
        if package == "paper":
            if layout != "batch-major":
                continue
            paper = anchor.load(os.environ["PAPER_PATH"])  # also named rl_triton
            fn = functools.partial(paper.compute_gae, r, v, term.float(), gamma=0.99,
                                   lambda_=0.95, last_value=lv)
        else:
            mod = __import__(package)
            fn = functools.partial(mod.gae, r, v, term, last_value=lv,
                                   time_dim=1 if layout == "batch-major" else 0)
        us = timing.full_call_us(fn, calls=calls, warmup=50)
        one = torch.zeros(1, device="cuda")
        floor = timing.full_call_us(lambda: one.add_(1), calls=calls)
        print(json.dumps(dict(package=package, host=os.environ.get("RL_TRITON_HOST", ""),
                              layout=layout, full_call_us=us, launch_floor_us=floor)),
              flush=True)
    if package == "rl_triton":  # the cost of Retrace's action check, full call and device time
        kw, _ = registry.make_inputs("retrace", N, T, "batch-major", torch.float32, True, "cuda")
        for check in (True, False):
            fn = functools.partial(mod.retrace, **kw, check_actions=check)
            print(json.dumps(dict(retrace_4096x128_check_actions=check,
                                  full_call_us=timing.full_call_us(fn, calls=calls, warmup=50),
                                  device_us=timing.device_time_us(fn))), flush=True)


def main():
    p = argparse.ArgumentParser(prog="tools/ab_base.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("prepare")
    pr.add_argument("rev")
    pr.add_argument("--as", dest="name", default="rl_triton_base",
                    help="the package's name under .ab/ (rl_triton_base: the base)")
    for name in ("warm", "time"):
        s = sub.add_parser(name)
        s.add_argument("--min-mb", type=float, default=4.0)
        s.add_argument("--new", default="rl_triton",
                       help="the package timed against the base (one prepared with --as)")
        s.add_argument("--bwd", action="store_true",
                       help="the backward passes (`python -m rl_triton.bench --modes bwd`)")
        s.add_argument("--dtypes", default="", help="comma list (default: all)")
        s.add_argument("--truncation", default="both", choices=["both", "yes", "no"])
        s.add_argument("--shapes", default="", help="comma list of NxT (default: the grid's)")
        s.add_argument("--only", default="",
                       help="comma list of cell label prefixes, e.g. vtrace:4x1048576")
    sub.choices["warm"].add_argument("--shard", default="0/1")
    sub.choices["time"].add_argument("--rounds", type=int, default=2)
    sub.choices["time"].add_argument("--rep-ms", type=float, default=40.0)
    sub.choices["time"].add_argument("--out", default="")
    f = sub.add_parser("full-call")
    f.add_argument("--package", default="rl_triton")
    f.add_argument("--calls", type=int, default=300)
    a = p.parse_args()
    global NEW, ONLY, BWD, DTYPES, TRUNCATION, SHAPES
    NEW = getattr(a, "new", NEW)
    ONLY = [o for o in getattr(a, "only", "").split(",") if o]
    BWD = getattr(a, "bwd", False)
    DTYPES = [d for d in getattr(a, "dtypes", "").split(",") if d] or None
    TRUNCATION = {"both": (True, False), "yes": (True,), "no": (False,)}[
        getattr(a, "truncation", "both")]
    SHAPES = [x for x in getattr(a, "shapes", "").split(",") if x] or None
    if a.cmd == "prepare":
        prepare(a.rev, a.name)
    elif a.cmd == "warm":
        warm(a.shard, a.min_mb)
    elif a.cmd == "time":
        time_cells(a.min_mb, a.rounds, a.rep_ms, a.out)
    else:
        full_call(a.package, a.calls)


if __name__ == "__main__":
    main()
