"""`python -m rl_triton.bench`'s options, the run's environment (GPU, versions, copy bandwidth,
launch floor) and the suite they choose."""
from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

import rl_triton.bench
from rl_triton import testing

from . import anchor, registry, report, timing
from .registry import (ESTIMATORS, FRAMEWORK_CALLS_TIMED, FRAMEWORKS_MAX_SECONDS, HOST_SHAPES,
                       LAYOUTS, LOOP_MAX_T, LOSS_T, LOSS_TOKENS, SHAPES, TOKEN_SHAPES)
from .suites import grid, head, host, llm, losses, tokens

TILE_FIELDS = ("block_t", "block_b", "num_warps", "window", "depth", "sub", "max_registers",
               "walk")


def parse_tiles(s):
    """"block_t=64,num_warps=4,walk=0" -> {"block_t": 64, "num_warps": 4, "walk": False}"""
    fields = {}
    for item in s.split(","):
        key, _, value = item.partition("=")
        ok = key in TILE_FIELDS and value.isdigit() and (
            value in ("0", "1") if key == "walk" else int(value) >= 1)
        if not ok:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not one of {'|'.join(TILE_FIELDS[:-1])}=<positive int> or walk=0|1")
        fields[key] = bool(int(value)) if key == "walk" else int(value)
    return fields


def parse_rule(s):
    """"WALK_PROGRAMS_PER_SM=4,MAX_ROWS_TIME_MAJOR=32" -> {...}: constants of the tile rule."""
    from rl_triton.scan import tiles as config
    names, values = config.constants(), {}
    for item in s.split(","):
        key, _, value = item.partition("=")
        if key not in names or not value.isdigit():
            raise argparse.ArgumentTypeError(
                f"{item!r} is not NAME=<int> for a constant of rl_triton/scan/tiles.py "
                f"({', '.join(sorted(names))})")
        values[key] = int(value)
    return values


def parser():
    p = argparse.ArgumentParser(prog="python -m rl_triton.bench",
                                description=rl_triton.bench.__doc__ + "\nTiming needs a CUDA GPU "
                                "(it exits without one); --report alone runs anywhere.\n",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="default",
                   choices=["default", "tokens", "losses", "host", "head", "llm"],
                   help="default: the estimators on RL rollouts (the options below); tokens: "
                        "LLM token rows [B, T] (masks, packing, whitening, group advantages, "
                        "the frameworks' own loops; --shapes, --dtypes, --out, --max-seconds, "
                        "--frameworks-max-seconds, --tiles, --rule apply), see `suites.tokens`; "
                        "losses: semantics §9's losses against eager PyTorch and torch.compile of "
                        "their formulas (--shapes, --dtypes, --out, --max-seconds apply), see "
                        "`suites.losses`; host: host and full-call time of the estimators "
                        "beside the bound (a bare launch of the same kernel) and rl-triton "
                        "0.1.3 (--anchor-path), then the other ops against GAE (--estimators, "
                        "--shapes, --layouts, --dtypes, --flags, --out, --max-seconds, --tiles, "
                        "--rule apply), see `suites.host`; head: the fused loss head (semantics §11) at "
                        "H x V = 4096 x 151936, bf16, forward plus backward against eager, "
                        "torch.compile and Liger-Kernel, time and peak memory (--shapes: token "
                        "counts; --out, --max-seconds apply), see `suites.head`; llm: the LLM "
                        "zoo (semantics §10) against verl's and OpenRLHF's own functions and "
                        "torch.compile of them (--shapes: B responses x T tokens, default %s; "
                        "--groups, --out, --max-seconds, --frameworks-max-seconds, "
                        "--frameworks-path apply), see `suites.llm`" % ",".join(llm.LLM_SHAPES))
    p.add_argument("--estimators", default=None,
                   help="comma list of the estimators to time (default: all %d of the op "
                        "registry: %s; with --suite host, those rl-triton 0.1.3 has)"
                        % (len(ESTIMATORS), ",".join(ESTIMATORS)))
    p.add_argument("--shapes", default=None,
                   help="comma list of N envs x T steps, e.g. 4096x128,16x131072 (default: "
                        "the nine shapes of the performance targets; with --suite tokens, "
                        "B responses x T tokens, default %s; with --suite losses, token "
                        "counts, multiples of %d, default %s; with --suite host, default %s)"
                        % (",".join(TOKEN_SHAPES), LOSS_T, ",".join(map(str, LOSS_TOKENS)),
                           ",".join(HOST_SHAPES)))
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help="comma list of time-major ([T, N], time_dim=0) and batch-major "
                        "([N, T], time_dim=1); the first one is the baselines' layout")
    p.add_argument("--dtypes", default=",".join(registry.DTYPES),
                   help="comma list of input dtypes, float32 and bfloat16 (outputs are float32);"
                        " the first one is the baselines' dtype")
    p.add_argument("--truncation", default="both", choices=["both", "yes", "no"],
                   help="time each configuration with truncation flags (yes), without (no) "
                        "or both")
    p.add_argument("--flags", default=",".join(registry.FLAG_DTYPES),
                   help="--suite host: comma list of the flags' dtypes, bool and float "
                        "(float32; the anchor's)")
    p.add_argument("--anchor-path", default=None,
                   help="--suite host: a folder holding rl-triton 0.1.3 as the package "
                        "rl_triton (e.g. .ab/paper/src), timed beside rl_triton in the same "
                        "process; without it the host suite has no anchor columns")
    p.add_argument("--baselines", default="torch,compile,loop",
                   help="comma list of torch, compile, loop, or 'none'; baselines are timed "
                        "on the first dtype (float32) in the first layout only, the loop only "
                        "up to T = %d" % LOOP_MAX_T)
    p.add_argument("--modes", default="fwd",
                   help="comma list of fwd (the forward call), bwd (the backward pass alone) "
                        "and fwd+bwd (forward and backward, against autograd through the "
                        "torch backend and TorchRL; baselines on the first dtype and layout)")
    p.add_argument("--out", default="bench_out",
                   help="folder for bench.json, bench.md and bench.png (created if missing)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop starting new configurations after this long; the reports cover "
                        "what was measured")
    p.add_argument("--frameworks-max-seconds", type=float, default=None,
                   help="--suite tokens and llm: seconds the frameworks' token loops may take "
                        "in all (one warm-up and up to %d calls a cell); a cell that would "
                        "overrun it is not timed (default %g, with --suite llm %g)"
                        % (FRAMEWORK_CALLS_TIMED, FRAMEWORKS_MAX_SECONDS,
                           llm.LLM_FRAMEWORKS_MAX_SECONDS))
    p.add_argument("--frameworks-path", default=None,
                   help="--suite llm: the folder holding verl and OpenRLHF at their pinned "
                        "versions (`rl_triton.testing.import_frameworks`; default "
                        "$RL_TRITON_FRAMEWORKS, else .ci/frameworks)")
    p.add_argument("--groups", default=",".join(llm.GROUPS),
                   help="--suite llm: comma list of the zoo's groups to time (default: all, "
                        "%(default)s)")
    p.add_argument("--report", default=None,
                   help="only write bench.md and bench.png (tokens.png for a --suite tokens "
                        "result, losses.png for a --suite losses one, host.png for a --suite "
                        "host one) into --out from this bench.json")
    p.add_argument("--tiles", default=None, type=parse_tiles,
                   help="replace the tile rule for every configuration, e.g. "
                        "block_t=64,block_b=32,num_warps=4 (for tuning "
                        "rl_triton/scan/tiles.py; fields: %s)" % ", ".join(TILE_FIELDS))
    p.add_argument("--rule", default=None, type=parse_rule,
                   help="change constants of the tile rule for every configuration, e.g. "
                        "WALK_PROGRAMS_PER_SM=4,MAX_ROWS_TIME_MAJOR=64 (to check the rule of "
                        "rl_triton/scan/tiles.py against measurements)")
    return p


def _listed(p, option, given, known):
    """The comma list `given` of an option, each item one of `known`."""
    items = given.split(",")
    for item in items:
        if item not in known:
            p.error(f"{option}: {item!r} is not one of {', '.join(known)}")
    return items


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report:
        report.write_reports(json.loads(Path(args.report).read_text()), out)
        return
    default_shapes = {"tokens": TOKEN_SHAPES, "losses": list(map(str, LOSS_TOKENS)),
                      "host": HOST_SHAPES, "head": list(map(str, head.HEAD_TOKENS)),
                      "llm": llm.LLM_SHAPES}.get(
        args.suite, SHAPES)
    shapes = (args.shapes or ",".join(default_shapes)).split(",")
    if args.suite == "losses":
        for s in shapes:
            if not (s.isdigit() and int(s) > 0 and int(s) % LOSS_T == 0):
                p.error(f"--shapes: {s!r} is not a token count, a positive multiple of {LOSS_T}")
    if args.suite == "head":
        for s in shapes:
            if not (s.isdigit() and int(s) > 0 and int(s) % head.HEAD_ROW == 0):
                p.error(f"--shapes: {s!r} is not a token count, a positive multiple of "
                        f"{head.HEAD_ROW}")
    if args.suite == "llm":
        for s in shapes:
            B, _, T = s.partition("x")
            if not (B.isdigit() and T.isdigit() and int(B) > 0 and int(T) >= 24):
                p.error(f"--shapes: {s!r} is not B x T, B responses of T >= 24 tokens")
        groups = _listed(p, "--groups", args.groups, list(llm.GROUPS))
        try:  # before anything is timed
            testing.import_frameworks(args.frameworks_path)
        except ImportError as e:
            p.error(f"--frameworks-path: {e}")
    if args.suite == "host":
        estimators = (args.estimators.split(",") if args.estimators else
                      [e for e in ESTIMATORS if e in anchor.CALLS])
        flags = _listed(p, "--flags", args.flags, list(registry.FLAG_DTYPES))
        paper = None
        if args.anchor_path:  # before anything is timed
            try:
                paper = anchor.load(args.anchor_path)
            except ImportError as e:
                p.error(f"--anchor-path: {e}")
    else:
        estimators = (args.estimators or ",".join(ESTIMATORS)).split(",")
    if not torch.cuda.is_available():
        sys.exit("rl_triton.bench needs a CUDA device")
    device = torch.device("cuda")
    layouts = args.layouts.split(",")
    dtypes = args.dtypes.split(",")
    truncs = {"both": [False, True], "yes": [True], "no": [False]}[args.truncation]
    baselines = [] if args.baselines == "none" else args.baselines.split(",")
    modes = args.modes.split(",")
    for m in modes:
        if m not in ("fwd", "bwd", "fwd+bwd"):
            p.error(f"--modes: {m!r} is not fwd, bwd or fwd+bwd")

    import triton
    env = dict(gpu=torch.cuda.get_device_name(device), torch=torch.__version__,
               triton=triton.__version__, date=time.strftime("%Y-%m-%d"),
               driver=_driver_version())
    bw = timing.copy_bandwidth(device)
    floor_dev, floor_full, floor_host = timing.launch_floor(device)
    env.update(copy_bandwidth_gbs=bw / 1e9, launch_floor_device_us=floor_dev,
               launch_floor_full_us=floor_full, launch_floor_host_us=floor_host,
               tiles=args.tiles, rule=args.rule)
    print(f"# {env['gpu']} driver {env['driver']}, torch {env['torch']}, triton "
          f"{env['triton']}: copy {bw / 1e9:.0f} GB/s, launch floor {floor_dev:.1f} us device /"
          f" {floor_full:.1f} us full call / {floor_host:.1f} us host", flush=True)

    tile_rule = contextlib.ExitStack()
    from rl_triton.scan import tiles as tile_config
    if args.tiles:
        tile_rule.enter_context(tile_config.override(**args.tiles))
    if args.rule:
        tile_rule.enter_context(tile_config.rule(**args.rule))
    with tile_rule:
        if args.suite == "tokens":
            tokens.run_tokens(shapes, dtypes, env, device, out, args.max_seconds,
                              _or(args.frameworks_max_seconds, FRAMEWORKS_MAX_SECONDS))
        elif args.suite == "llm":
            llm.run_llm(shapes, env, device, out, args.max_seconds,
                        _or(args.frameworks_max_seconds, llm.LLM_FRAMEWORKS_MAX_SECONDS),
                        args.frameworks_path, groups)
        elif args.suite == "losses":
            losses.run_losses([int(s) for s in shapes], dtypes, env, device, out,
                              args.max_seconds)
        elif args.suite == "head":
            head.run_head([int(s) for s in shapes], env, device, out, args.max_seconds)
        elif args.suite == "host":
            if paper is not None:
                env.update(anchor=dict(path=args.anchor_path, version=paper.__version__))
            host.run_host(estimators, shapes, layouts, dtypes, flags, env, device, out,
                          args.max_seconds, paper)
        else:
            grid.run_grid(estimators, shapes, layouts, dtypes, truncs, baselines, modes, env, bw,
                          device, out, args.max_seconds)


def _or(value, default):
    return default if value is None else value


def _driver_version():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - informational only
        return "unknown"
