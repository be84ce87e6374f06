"""`python -m rl_triton.bench`: the benchmark harness (one for the whole project).

For every estimator, shape (N envs x T steps), layout, input dtype and truncation setting it
1. checks rl_triton's result against a float64 computation of the same inputs,
2. times the call: device time (`triton.testing.do_bench`'s protocol: median, L2 flushed
   before every call; plus a GPU hold after the flush, see `device_time_us`) and
   full-call time (synchronize, host timer, call, synchronize; median of >= 200 calls),
3. reports the achieved bandwidth (minimal bytes / device time) as a fraction of the copy
   bandwidth measured in the same run (a 1 GiB copy), the device time of a copy that moves the
   same bytes (the faster of torch's `copy_` and a plain Triton copy: the floor at this size,
   since fixed launch and ramp costs weigh on small copies too), and the speedup over the
   baselines: the sequential loop (`backend="loop"`, CleanRL-style), the torch backend eager,
   and the torch backend under `torch.compile`.
With `--modes fwd,bwd,fwd+bwd` it also times gradients (semantics §6), every floating input
requiring grad: `bwd` the backward pass alone (`torch.autograd.grad` of the outputs against fixed
random output gradients, the forward done once; its minimal bytes: the output gradients, the flags
and the inputs its formula reads, the input gradients written) against the same-bytes copy of its
own bytes, and `fwd+bwd` forward plus backward, against autograd through the torch backend and
through TorchRL's estimators (where TorchRL has one and is installed).
It writes `bench.json`, `bench.md` and `bench.png` into `--out`.
`--suite tokens` times LLM token rows instead (`run_tokens`): GAE and discounted returns on
dense, padded, multi-turn and packed rows (with and without their mask) against the unmasked
call and the same-bytes copy, verl's and OpenRLHF's own token loops beside rl_triton's drop-ins,
masked_whiten and group_advantages; its plot is `tokens.png`.
`--suite losses` times semantics §9's losses (`run_losses`): PPO's surrogate, the value loss, the KL
penalty, SAC's targets and CRR's weights, forward plus backward where differentiable, against
their formula in eager PyTorch and under `torch.compile` and the same-bytes copy; its plot is
`losses.png`.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import json
import statistics
import sys
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

import rl_triton
from rl_triton import reference, testing

ESTIMATORS = ["gae", "vtrace", "retrace", "lambda_returns", "discounted_returns",
              "eligibility_traces", "episodic_cumsum"]
SHAPES = ["16384x16", "4096x128", "16384x1024", "128x128", "1024x1024", "512x4096",
          "64x32768", "16x131072", "4x1048576"]
LAYOUTS = ["time-major", "batch-major"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
N_ACTIONS = 18  # Atari
LOOP_MAX_T = 4096  # the sequential loop baseline is timed up to this many steps


@dataclass
class Row:
    estimator: str
    shape: str
    layout: str
    dtype: str
    truncation: bool
    impl: str  # "rl_triton", "torch", "compile" or "loop"
    bytes: int
    device_us: float
    full_us: float
    bandwidth_fraction: float
    rel_err: float
    copy_us: float = float("nan")  # device time of a copy moving the same bytes
    mode: str = "fwd"  # "fwd", "bwd" (the backward pass alone) or "fwd+bwd"


# ---- inputs ----------------------------------------------------------------------------------

def make_inputs(name, N, T, layout, dtype, truncation, device, seed=0):
    """Keyword arguments of `rl_triton.<name>` for an N x T problem (`rl_triton.testing`'s
    inputs: flags set at 1% of steps, 18 actions, the functions' default scalars), and the
    minimal bytes."""
    steps, extra = testing.make_inputs(name, T, (N,), dtype=dtype, trunc=truncation,
                                       device=device, seed=seed, n_act=N_ACTIONS, p_term=0.01,
                                       p_trunc=0.01, params=_DEFAULTS.get(name, {}))
    if name == "retrace":
        extra["return_advantages"] = False
    tm = layout == "time-major"
    kw = {k: v if tm or v is None else v.movedim(0, 1).contiguous() for k, v in steps.items()}
    kw.update(extra, time_dim=0 if tm else 1)
    n_out = 2 if name in ("gae", "vtrace") else 1
    tensors = [v for v in kw.values() if isinstance(v, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors) + n_out * N * T * 4
    return kw, nbytes


# the public functions' default scalars (the benchmark times the calls users make)
_DEFAULTS = {"gae": dict(gamma=0.99, lam=0.95), "lambda_returns": dict(gamma=0.99, lam=0.95),
             "discounted_returns": dict(gamma=0.99), "eligibility_traces": dict(gamma=0.99,
                                                                                lam=0.95),
             "vtrace": dict(gamma=0.99, lam=1.0, rho_clip=1.0, c_clip=1.0, pg_rho_clip=1.0),
             "retrace": dict(gamma=0.99, lam=1.0, c_clip=1.0)}


def float64_result(name, kw):
    """The same inputs through the vectorized torch implementation in float64, time-major."""
    td = kw["time_dim"]
    args = {k: (v.movedim(td, 0) if isinstance(v, torch.Tensor) and v.ndim >= 2 and k not in (
        "last_value", "last_q_values", "last_target_probs") else v)
        for k, v in kw.items() if k != "time_dim"}
    out = testing.vectorized(name, **args)
    return out[:1] if name == "retrace" and not kw.get("return_advantages") else out


def rel_err(outs, refs, td):
    outs = outs if isinstance(outs, tuple) else (outs,)
    worst = 0.0
    for o, r in zip(outs, refs):
        o = o.movedim(td, 0).double()
        worst = max(worst, ((o - r).norm() / r.norm().clamp_min(1e-30)).item())
    return worst


def check_result(err, tol, what):
    """Refuses to time a wrong result."""
    if not err < tol:
        raise SystemExit(f"{what}: relative error {err:.3g} >= {tol}; not timing a wrong result")


# ---- gradients ---------------------------------------------------------------------------------

NOT_DIFFERENTIABLE = ("terminated", "truncated", "dones", "actions")
# what each backward reads besides the output gradients and flags (semantics §6's formulas): inputs,
# and how many of the op's outputs it saves
BWD_READS = {"vtrace": (("rewards", "values", "target_log_probs", "behavior_log_probs",
                         "last_value"), 1),
             "retrace": (("q_values", "target_probs", "behavior_probs", "last_q_values",
                          "last_target_probs"), 1)}
N_OUT = {"gae": 2, "vtrace": 2}


def grad_inputs(kw):
    """kw with every floating input a leaf that requires grad, and those leaves."""
    kw = {k: v.detach().clone().requires_grad_() if isinstance(v, torch.Tensor)
          and v.is_floating_point() and k not in NOT_DIFFERENTIABLE else v
          for k, v in kw.items()}
    return kw, [v for v in kw.values() if isinstance(v, torch.Tensor) and v.requires_grad]


def bwd_bytes(name, kw, leaves) -> int:
    """The backward's minimal bytes: output gradients (float32) and flags read, the inputs its
    formula reads (`BWD_READS`) and its saved outputs, every input gradient written."""
    reads, saved = BWD_READS.get(name, ((), 0))
    ref = next(v for k, v in kw.items() if k in ("rewards", "x"))
    n = ref.numel()
    total = (N_OUT.get(name, 1) + saved) * n * 4
    for k, v in kw.items():
        if isinstance(v, torch.Tensor) and (k in NOT_DIFFERENTIABLE or k in reads):
            total += v.numel() * v.element_size()
    return total + sum(t.numel() * t.element_size() for t in leaves)


def as_tuple(outs) -> tuple:
    return outs if isinstance(outs, tuple) else (outs,)


def output_grads(outs, seed=0) -> list:
    """Fixed random float32 gradients of those of `outs` that require grad."""
    g = torch.Generator(device=outs[0].device).manual_seed(seed)
    return [torch.randn(o.shape, generator=g, device=o.device) for o in outs if o.requires_grad]


def backward_fn(outs, leaves, seed=0):
    """The backward pass of `outs` alone, repeatable: `torch.autograd.grad` of fixed output
    gradients, keeping the graph."""
    outs = as_tuple(outs)
    grads = output_grads(outs, seed)
    return lambda: torch.autograd.grad(outs, leaves, grads, retain_graph=True)


def fwd_bwd_fn(forward, leaves, grads=None):
    """Forward and backward: the gradients of the outputs' sum, or with `grads` (`output_grads`)
    those of the outputs that require grad against them."""
    def run():
        outs = as_tuple(forward())
        if grads is None:
            return torch.autograd.grad(sum(o.sum() for o in outs), leaves)
        return torch.autograd.grad([o for o in outs if o.requires_grad], leaves, grads)
    return run


def torchrl_fwd_bwd(name, kw):
    """TorchRL's estimator of `name` (its vectorized one, time axis -2 of [N, T, 1] tensors,
    from time-major inputs), forward and backward through autograd; None where TorchRL has
    none or is not installed. Built outside the timed call: only the estimator is timed."""
    try:
        from torchrl.objectives.value import functional as F
    except Exception:  # noqa: BLE001 - not installed, or not importable with this torch
        return None
    if name not in ("gae", "lambda_returns", "vtrace", "discounted_returns"):
        return None

    def bm(x):  # [T, N] -> [N, T, 1]
        return x.movedim(0, 1).unsqueeze(-1).contiguous()

    term = bm(kw["terminated"])
    done = term | bm(kw["truncated"]) if kw.get("truncated") is not None else term
    leaves = {k: bm(kw[k]).detach().requires_grad_() for k in (
        "rewards", "values", "target_log_probs", "behavior_log_probs") if k in kw}
    last = kw.get("last_value")
    last = None if last is None else last.detach().reshape(-1, 1, 1).requires_grad_()
    r = leaves["rewards"]
    ps = list(leaves.values()) + ([last] if last is not None else [])
    gamma = kw.get("gamma", 0.99)

    def next_values():
        return torch.cat([leaves["values"][:, 1:], last], 1)

    if name == "gae":
        def forward():
            return F.vec_generalized_advantage_estimate(
                gamma, kw["lam"], leaves["values"], next_values(), r, done, term)
    elif name == "lambda_returns":
        def forward():
            return F.vec_td_lambda_return_estimate(gamma, kw["lam"], next_values(), r, done,
                                                   term)
    elif name == "vtrace":
        def forward():
            return F.vtrace_advantage_estimate(
                gamma, leaves["target_log_probs"], leaves["behavior_log_probs"],
                leaves["values"], next_values(), r, done, term, kw["rho_clip"], kw["c_clip"])
    else:
        ps = [r]

        def forward():
            return F.reward2go(r, done, gamma)
    return fwd_bwd_fn(forward, ps)


# ---- timing ----------------------------------------------------------------------------------

_FLUSH_BYTES = 256 * 2**20  # what triton.testing.do_bench writes to flush the L2 cache
_HOLD_CYCLES = 200_000  # about 100 µs of GPU clock: longer than the host's part of any call
# ... of any forward call; a backward pass through torch's autograd engine takes 150-300 µs
# of host time on the H200 machine (the engine's device thread, its checks); and the token
# suite's calls: masked_whiten's three Triton launches from Python, the drop-ins' dozen ops,
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


def full_call_us(fn, calls=200, warmup=20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def device_and_full_us(fn, hold_cycles=_HOLD_CYCLES):
    """(device µs, full-call µs) of fn, the full call's median over fewer calls where one is
    slow."""
    dev = device_time_us(fn, hold_cycles=hold_cycles)
    return dev, full_call_us(fn, calls=200 if dev < 5000 else 25)


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
    (docs/bench_h200_copy_floors.json)."""
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
    x = torch.zeros(1, device=device)
    return device_time_us(lambda: x.add_(1)), full_call_us(lambda: x.add_(1), calls=1000)


# ---- the run ---------------------------------------------------------------------------------

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


def parse_shape(s):
    n, t = s.lower().split("x")
    return int(n), int(t)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m rl_triton.bench",
                                description=__doc__ + "\nTiming needs a CUDA GPU (it exits "
                                "without one); --report alone runs anywhere.\n",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="default", choices=["default", "tokens", "losses"],
                   help="default: the estimators on RL rollouts (the options below); tokens: "
                        "LLM token rows [B, T] (masks, packing, whitening, group advantages, "
                        "the frameworks' own loops; --shapes, --dtypes, --out, --max-seconds, "
                        "--frameworks-max-seconds, --tiles, --rule apply), see `run_tokens`; "
                        "losses: semantics §9's losses against eager PyTorch and torch.compile of "
                        "their formulas (--shapes, --dtypes, --out, --max-seconds apply), see "
                        "`run_losses`")
    p.add_argument("--estimators", default=",".join(ESTIMATORS),
                   help="comma list of the estimators to time (default: all seven)")
    p.add_argument("--shapes", default=None,
                   help="comma list of N envs x T steps, e.g. 4096x128,16x131072 (default: "
                        "the nine shapes of the performance targets; with --suite tokens, "
                        "B responses x T tokens, default %s; with --suite losses, token "
                        "counts, multiples of %d, default %s)"
                        % (",".join(TOKEN_SHAPES), LOSS_T, ",".join(map(str, LOSS_TOKENS))))
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help="comma list of time-major ([T, N], time_dim=0) and batch-major "
                        "([N, T], time_dim=1); the first one is the baselines' layout")
    p.add_argument("--dtypes", default=",".join(DTYPES),
                   help="comma list of input dtypes, float32 and bfloat16 (outputs are float32);"
                        " the first one is the baselines' dtype")
    p.add_argument("--truncation", default="both", choices=["both", "yes", "no"],
                   help="time each configuration with truncation flags (yes), without (no) "
                        "or both")
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
    p.add_argument("--frameworks-max-seconds", type=float, default=FRAMEWORKS_MAX_SECONDS,
                   help="--suite tokens: seconds the frameworks' token loops may take in all "
                        "(one warm-up and up to %d calls a cell); a cell that would overrun it "
                        "is not timed (default %%(default)s)" % FRAMEWORK_CALLS_TIMED)
    p.add_argument("--report", default=None,
                   help="only write bench.md and bench.png (tokens.png for a --suite tokens "
                        "result, losses.png for a --suite losses one) into --out from this "
                        "bench.json")
    p.add_argument("--tiles", default=None, type=parse_tiles,
                   help="replace the tile rule for every configuration, e.g. "
                        "block_t=64,block_b=32,num_warps=4 (for tuning "
                        "rl_triton/scan/tiles.py; fields: %s)" % ", ".join(TILE_FIELDS))
    p.add_argument("--rule", default=None, type=parse_rule,
                   help="change constants of the tile rule for every configuration, e.g. "
                        "WALK_PROGRAMS_PER_SM=4,MAX_ROWS_TIME_MAJOR=64 (to check the rule of "
                        "rl_triton/scan/tiles.py against measurements)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report:
        write_reports(json.loads(Path(args.report).read_text()), out)
        return
    shapes = (args.shapes or ",".join({"tokens": TOKEN_SHAPES, "losses": map(str, LOSS_TOKENS)}
                                      .get(args.suite, SHAPES))).split(",")
    if args.suite == "losses":
        for s in shapes:
            if not (s.isdigit() and int(s) > 0 and int(s) % LOSS_T == 0):
                p.error(f"--shapes: {s!r} is not a token count, a positive multiple of {LOSS_T}")
    if not torch.cuda.is_available():
        sys.exit("rl_triton.bench needs a CUDA device")
    device = torch.device("cuda")
    estimators = args.estimators.split(",")
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
    bw = copy_bandwidth(device)
    floor_dev, floor_full = launch_floor(device)
    env.update(copy_bandwidth_gbs=bw / 1e9, launch_floor_device_us=floor_dev,
               launch_floor_full_us=floor_full, tiles=args.tiles, rule=args.rule)
    print(f"# {env['gpu']} driver {env['driver']}, torch {env['torch']}, triton "
          f"{env['triton']}: copy {bw / 1e9:.0f} GB/s, launch floor {floor_dev:.1f} us device /"
          f" {floor_full:.1f} us full call", flush=True)

    tiles = contextlib.ExitStack()
    from rl_triton.scan import tiles as tile_config
    if args.tiles:
        tiles.enter_context(tile_config.override(**args.tiles))
    if args.rule:
        tiles.enter_context(tile_config.rule(**args.rule))
    if args.suite == "tokens":
        with tiles:
            run_tokens(shapes, dtypes, env, device, out, args.max_seconds,
                       args.frameworks_max_seconds)
        return
    if args.suite == "losses":
        run_losses([int(s) for s in shapes], dtypes, env, device, out, args.max_seconds)
        return
    rows: list[Row] = []
    (out / "bench.json").write_text(json.dumps(dict(env=env, rows=[]), indent=1))
    configs = [(e, s, lay, dt, tr) for e in estimators for s in shapes for lay in layouts
               for dt in dtypes for tr in truncs]
    t_start = time.time()
    for i, (name, shape, layout, dt, tr) in enumerate(configs):
        if args.max_seconds is not None and time.time() - t_start > args.max_seconds:
            print(f"# stopped after {i} of {len(configs)} configurations (--max-seconds)")
            break
        N, T = parse_shape(shape)
        kw, nbytes = make_inputs(name, N, T, layout, DTYPES[dt], tr, device, seed=i)
        fn = getattr(rl_triton, name)
        if "bwd" in modes or "fwd+bwd" in modes:
            rows += time_gradients(name, shape, layout, dt, tr, kw, modes,
                                   dt == dtypes[0] and layout == layouts[0], bw, device,
                                   f"[{i + 1}/{len(configs)} {time.time() - t_start:6.0f}s]")
            (out / "bench.json").write_text(json.dumps(
                dict(env=env, rows=[asdict(r) for r in rows]), indent=1))
        if "fwd" not in modes:
            continue
        refs = float64_result(name, kw)
        impls = [("rl_triton", _partial(fn, kw))]
        if dt == dtypes[0] and layout == layouts[0]:
            torch_fn = _partial(fn, kw, backend="torch")
            for b in baselines:
                if b == "torch":
                    impls.append(("torch", torch_fn))
                elif b == "compile":
                    impls.append(("compile", _compiled(name, kw)))
                elif b == "loop" and T <= LOOP_MAX_T:
                    impls.append(("loop", _partial(fn, kw, backend="loop")))
        for impl, f in impls:
            err = rel_err(f(), refs, kw["time_dim"])
            check_result(err, 1e-5 if impl != "loop" else 1e-4,
                         f"{impl} {name} {shape} {layout} {dt} trunc={tr}")
            dev, full = device_and_full_us(f)
            row = Row(name, shape, layout, dt, tr, impl, nbytes, dev, full,
                      nbytes / (dev * 1e-6) / bw, err, same_bytes_copy_us(nbytes, device))
            rows.append(row)
            print(f"[{i + 1}/{len(configs)} {time.time() - t_start:6.0f}s] {name:18s} {shape:>10s}"
                  f" {layout:11s} {dt:8s} trunc={int(tr)} {impl:9s} {dev:9.1f} us dev "
                  f"{full:9.1f} us full  {row.bandwidth_fraction:5.2f} of copy bw, "
                  f"{row.copy_us / dev:4.2f} of a same-bytes copy", flush=True)
        del kw, refs
        # after every configuration, so that a run cut short keeps what it measured
        (out / "bench.json").write_text(json.dumps(dict(env=env, rows=[asdict(r) for r in rows]),
                                                   indent=1))
    tiles.close()
    write_reports(json.loads((out / "bench.json").read_text()), out)


def time_gradients(name, shape, layout, dt, tr, kw, modes, baselines, bw, device, tag):
    """The gradient rows of one configuration (`--modes bwd` and `fwd+bwd`), after a check of
    rl_triton's gradients against those of the torch backend in float64."""
    fn = getattr(rl_triton, name)
    kw_g, leaves = grad_inputs(kw)
    check_gradients(fn, kw_g, leaves, name, shape)
    rows = []
    timed = []
    if "bwd" in modes:
        nbytes = bwd_bytes(name, kw_g, leaves)
        timed.append(("bwd", "rl_triton", backward_fn(fn(**kw_g), leaves), nbytes))
    if "fwd+bwd" in modes:
        timed.append(("fwd+bwd", "rl_triton", fwd_bwd_fn(lambda: fn(**kw_g), leaves), 0))
        if baselines:
            timed.append(("fwd+bwd", "torch",
                          fwd_bwd_fn(lambda: fn(**kw_g, backend="torch"), leaves), 0))
            if layout == "time-major":
                f = torchrl_fwd_bwd(name, kw_g)
                if f is not None:
                    timed.append(("fwd+bwd", "torchrl", f, 0))
    for mode, impl, f, nbytes in timed:
        dev, full = device_and_full_us(f, hold_cycles=_HOLD_CYCLES_GRAD)
        copy = same_bytes_copy_us(nbytes, device) if nbytes else float("nan")
        frac = nbytes / (dev * 1e-6) / bw if nbytes else float("nan")
        rows.append(Row(name, shape, layout, dt, tr, impl, nbytes, dev, full, frac, 0.0, copy,
                        mode))
        ratio = f"{copy / dev:4.2f} of a same-bytes copy" if nbytes else ""
        print(f"{tag} {name:18s} {shape:>10s} {layout:11s} {dt:8s} trunc={int(tr)} {mode:7s} "
              f"{impl:9s} {dev:9.1f} us dev {full:9.1f} us full  {ratio}", flush=True)
    return rows


def check_gradients(fn, kw_g, leaves, name, shape):
    """rl_triton's gradients against autograd through the torch backend in float64 (the same
    inputs); refuses to time wrong ones."""
    outs = fn(**kw_g)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator(device=outs[0].device).manual_seed(1)
    ws = [torch.randn(o.shape, generator=g, device=o.device) for o in outs]
    got = torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, ws)), leaves,
                              allow_unused=True)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    swap = dict(zip(map(id, leaves), leaves64))
    kw64 = {k: swap.get(id(v), v) for k, v in kw_g.items()}
    ref = fn(**kw64, backend="torch", out_dtype=torch.float64)
    ref = ref if isinstance(ref, tuple) else (ref,)
    want = torch.autograd.grad(sum((o * w.double()).sum() for o, w in zip(ref, ws)), leaves64,
                               allow_unused=True)
    # V-trace and Retrace clip ratios: where a float32 ratio and its float64 twin fall on two
    # sides of a clip, that step's gradient jumps, so their tolerance is looser
    tol = 1e-3 if name in ("vtrace", "retrace") else 1e-4
    for i, (a, b) in enumerate(zip(got, want)):
        a = torch.zeros_like(b) if a is None else a.double()
        b = torch.zeros_like(a) if b is None else b
        err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        if not err < tol:
            raise SystemExit(f"{name} {shape}: gradient {i} relative error {err:.3g} >= {tol}; "
                             "not timing a wrong gradient")


# ---- the token-level suite (--suite tokens) ----------------------------------------------------

TOKEN_SHAPES = ["256x1024", "512x4096", "128x16384", "32x131072"]
# outcome rewards end each response: gamma 1 and verl's lam, as the LLM trainers call them
TOKEN_PARAMS = {"gae": dict(gamma=1.0, lam=0.95), "discounted_returns": dict(gamma=1.0)}
# the frameworks' own token loops, by function: (framework, the rl_triton estimator it computes)
FRAMEWORK_CALLS = {"compute_gae_advantage_return": ("verl", "gae"),
                   "compute_reinforce_plus_plus_outcome_advantage": ("verl", "discounted_returns"),
                   "get_advantages_and_returns": ("openrlhf", "gae"),
                   "get_cumulative_returns": ("openrlhf", "discounted_returns")}
FRAMEWORK_CALLS_TIMED = 3  # after one warm-up: at T = 131072 one call takes seconds
# the suite's other cells, compiles included, take 2-3 minutes on the H200: ~5 minutes in all
FRAMEWORKS_MAX_SECONDS = 120.0
GROUPS = (65536, 8192)  # group_advantages: scores, groups


@dataclass
class TokenRow:
    call: str  # rl_triton's function, or the framework's
    shape: str  # B x T (packed: the padded rows'); group_advantages: scores x groups
    dtype: str  # of the inputs (outputs are float32)
    kind: str  # testing.TOKEN_KINDS, "dense-packed" (packed's tokens as one unmasked row) or
    #            "packed-unmasked" (packed without its mask);
    #            group_advantages: "group_size" or "group_index" (shuffled ids)
    impl: str  # "rl_triton", "drop-in" (rl_triton.integrations.<framework>) or the framework
    tokens: int
    bytes: int  # minimal bytes; 0 where not counted
    device_us: float
    full_us: float
    copy_us: float = float("nan")  # device time of a copy moving the same bytes
    rel_err: float = float("nan")  # against float64; a drop-in: against its framework
    note: str = ""  # why a cell has no time


def token_kwargs(name, rows):
    """Keyword arguments of `rl_triton.<name>` (gae, discounted_returns) on `testing.token_rows`
    rows, as an LLM trainer passes them, and the minimal bytes. No episode ends inside a
    response: `terminated` is a stride-0 False (no bytes), and `last_value=0` ends each row."""
    r, cu = rows["rewards"], rows["cu_seqlens"]
    batch = r.shape[:-1] if cu is None else (cu.shape[0] - 1,)
    kw = dict(rewards=r, terminated=torch.zeros((), dtype=torch.bool,
                                                device=r.device).expand(r.shape),
              mask=rows["mask"], cu_seqlens=cu, time_dim=r.ndim - 1, **TOKEN_PARAMS[name])
    if name == "gae":
        kw.update(values=rows["values"], last_value=torch.zeros(batch, device=r.device))
    reads = [v for k, v in kw.items() if isinstance(v, torch.Tensor) and k != "terminated"]
    nbytes = sum(t.numel() * t.element_size() for t in reads) + N_OUT.get(name, 1) * r.numel() * 4
    return kw, nbytes


def token_cells(B, T, dtype, device, seed=0):
    """The suite's rl_triton calls on B x T token rows of one input dtype, in timing order:
    (call, kind, fn, tokens, minimal bytes, fn's result in float64 to check it against). Every
    kind holds the same tokens (`testing.token_rows`)."""
    refs = {}
    for kind in testing.TOKEN_KINDS + ("dense-packed", "packed-unmasked"):
        rows = testing.token_rows(B, T, "packed" if kind in ("dense-packed", "packed-unmasked")
                                  else kind, dtype, device, seed)
        if kind == "dense-packed":  # the unmasked call on packed's tokens: one row [L]
            rows = dict(rows, mask=None, cu_seqlens=None)
        if kind == "packed-unmasked":  # the segments alone: packed's call without its mask
            rows = dict(rows, mask=None)
        for name in TOKEN_PARAMS:
            kw, nbytes = token_kwargs(name, rows)
            if kind in ("packed", "packed-unmasked"):  # the padded rows without their padding
                response = torch.arange(T, device=device) < rows["cu_seqlens"].diff()[:, None]
                padded = "multi-turn" if kind == "packed" else "padded"
                ref = tuple(r[response] for r in refs[padded, name])
            else:
                ref = refs[kind, name] = tuple(r.movedim(0, kw["time_dim"])
                                               for r in float64_result(name, kw))
            yield (name, kind, _partial(getattr(rl_triton, name), kw), rows["rewards"].numel(),
                   nbytes, ref)
        if kind == "multi-turn":  # x read, the mask read, float32 written
            x, m = rows["values"], rows["mask"]
            yield ("masked_whiten", kind, _partial(rl_triton.masked_whiten, dict(x=x, mask=m)),
                   x.numel(), x.numel() * (x.element_size() + 1 + 4),
                   (reference.masked_whiten(x, m),))


def group_cells(device, n=GROUPS[0], groups=GROUPS[1], seed=0):
    """group_advantages (GRPO's defaults) on n float32 scores in `groups` groups of one size,
    given by `group_size` and by a shuffled `group_index`: (kind, fn, minimal bytes: the scores
    read, the advantages written and the int64 ids read, the float64 result)."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(n, generator=gen).to(device)
    shuffled = (torch.arange(n) // (n // groups))[torch.randperm(n, generator=gen)].to(device)
    for kind, kw in (("group_size", dict(group_size=n // groups)),
                     ("group_index", dict(group_index=shuffled))):
        # the torch backend in float64, as `float64_result` (reference's loop over 8192 groups
        # takes 20 s)
        ref = rl_triton.group_advantages(s.double(), **kw, backend="torch",
                                         out_dtype=torch.float64)
        yield (kind, _partial(rl_triton.group_advantages, dict(scores=s, **kw)),
               8 * n + 8 * n * (kind == "group_index"), (ref,))


def drop_ins() -> dict:
    """rl_triton's drop-ins for the frameworks' functions, by framework: the modules
    `rl_triton.integrations.<framework>` that exist."""
    return {fw: importlib.import_module(f"rl_triton.integrations.{fw}")
            for fw in dict.fromkeys(fw for fw, _ in FRAMEWORK_CALLS.values())
            if importlib.util.find_spec(f"rl_triton.integrations.{fw}") is not None}


def framework_cells(rows, frameworks, ours):
    """The frameworks' own token loops on `testing.token_rows` rows (`import_frameworks()`'s
    namespace) and rl_triton's drop-ins (`drop_ins()`): (function, framework, its call, the
    drop-in's call or None), each called with the framework's arguments (OpenRLHF's functions
    are methods of RemoteExperienceMaker, whose `self` they do not use: None)."""
    r, v = rows["rewards"], rows["values"]
    m = rows["mask"].float()  # verl steps with 1 - mask: the frameworks' float masks
    gamma, lam = TOKEN_PARAMS["gae"]["gamma"], TOKEN_PARAMS["gae"]["lam"]
    args = {"compute_gae_advantage_return": ((r, v, m, gamma, lam), {}),
            "compute_reinforce_plus_plus_outcome_advantage": (
                (r, m), dict(config=types.SimpleNamespace(gamma=gamma))),
            "get_advantages_and_returns": ((None, v, r, m, gamma, lam), {}),
            "get_cumulative_returns": ((None, r, m, gamma), {})}
    owners = {"verl": frameworks.verl, "openrlhf": frameworks.openrlhf}
    for name, (fw, _) in FRAMEWORK_CALLS.items():
        a, k = args[name]
        yield (name, fw, functools.partial(getattr(owners[fw], name), *a, **k),
               functools.partial(getattr(ours[fw], name), *a, **k) if fw in ours else None)


class LoopBudget:
    """The seconds left to the frameworks' token loops (--frameworks-max-seconds), and each
    loop's seconds per token step so far, from which a longer row's cost is foreseen."""

    def __init__(self, seconds):
        self.left, self.per_step = seconds, {}

    def full_call_us(self, name, fn, T):
        """(fn's full-call µs, its result): one warm-up, then up to FRAMEWORK_CALLS_TIMED calls
        (median), as many as the budget affords; (None, None) where even the warm-up and one
        call would overrun it."""
        if self.left <= 0 or 2 * self.per_step.get(name, 0.0) * T > self.left:
            return None, None
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        warm = time.perf_counter() - t0
        n = max(0, min(FRAMEWORK_CALLS_TIMED, int((self.left - warm) / warm)))
        full = full_call_us(fn, calls=n, warmup=0) if n else None
        self.per_step[name] = (warm if full is None else full * 1e-6) / T
        self.left -= time.perf_counter() - t0
        return full, out


def run_tokens(shapes, dtypes, env, device, out, max_seconds, frameworks_seconds):
    """`--suite tokens`: for every shape (B responses x T tokens) and input dtype, the calls of
    `token_cells`, checked against float64 and timed (device and full call) against the
    same-bytes copy; on the float32 multi-turn rows of every shape, the frameworks' own token
    loops (full call, within --frameworks-max-seconds) beside rl_triton's drop-ins, where those
    exist; then `group_cells` against the launch floor. Writes bench.json (suite "tokens"),
    bench.md and tokens.png."""
    try:
        frameworks = testing.import_frameworks()
    except ImportError as e:
        frameworks = None
        print(f"# the frameworks' loops are not timed: {e}", flush=True)
    ours = drop_ins()
    budget = LoopBudget(frameworks_seconds)
    rows: list[TokenRow] = []
    configs = []
    for s in shapes:
        configs += [("tokens", s, dt) for dt in dtypes]
        if frameworks is not None:
            configs.append(("loops", s, "float32"))
    configs.append(("groups", "x".join(map(str, GROUPS)), "float32"))

    def add(row):
        rows.append(row)
        vs_copy = ("" if row.copy_us != row.copy_us else
                   f"  {row.copy_us / row.device_us:4.2f} of a same-bytes copy")
        print(f"{tag} {row.call:46s} {row.shape:>10s} {row.dtype:8s} {row.kind:12s} "
              f"{row.impl:9s} {row.device_us:9.1f} us dev {row.full_us:11.1f} us full{vs_copy}"
              + (f"  ({row.note})" if row.note else ""), flush=True)

    t_start = time.time()
    for i, (what, shape, dt) in enumerate(configs):
        if max_seconds is not None and time.time() - t_start > max_seconds:
            print(f"# stopped after {i} of {len(configs)} configurations (--max-seconds)")
            break
        tag = f"[{i + 1}/{len(configs)} {time.time() - t_start:6.0f}s]"
        if what == "tokens":
            B, T = parse_shape(shape)
            for call, kind, f, tokens, nbytes, ref in token_cells(B, T, DTYPES[dt], device,
                                                                  seed=shapes.index(shape)):
                err = rel_err(f(), ref, 0)
                check_result(err, 1e-5, f"{call} {shape} {dt} {kind}")
                dev, full = device_and_full_us(f, hold_cycles=_HOLD_CYCLES_GRAD)
                add(TokenRow(call, shape, dt, kind, "rl_triton", tokens, nbytes, dev, full,
                             same_bytes_copy_us(nbytes, device), err))
        elif what == "loops":
            B, T = parse_shape(shape)
            tokens = testing.token_rows(B, T, "multi-turn", torch.float32, device,
                                        seed=shapes.index(shape))
            for name, fw, theirs, mine in framework_cells(tokens, frameworks, ours):
                full, result = budget.full_call_us(name, theirs, T)
                add(TokenRow(name, shape, dt, "multi-turn", fw, B * T, 0, float("nan"),
                             float("nan") if full is None else full,
                             note="" if full is not None else "over --frameworks-max-seconds"))
                if mine is not None:
                    err = float("nan")  # unchecked where the framework was not run
                    if result is not None:
                        result = result if isinstance(result, tuple) else (result,)
                        err = rel_err(mine(), tuple(t.double() for t in result), 0)
                        check_result(err, 1e-4, f"drop-in {name} {shape}")
                    add(TokenRow(name, shape, dt, "multi-turn", "drop-in", B * T, 0,
                                 float("nan"), full_call_us(mine), rel_err=err))
        else:
            for kind, f, nbytes, ref in group_cells(device):
                err = rel_err(f(), ref, 0)
                check_result(err, 1e-5, f"group_advantages {kind}")
                dev, full = device_and_full_us(f, hold_cycles=_HOLD_CYCLES_GRAD)
                add(TokenRow("group_advantages", shape, dt, kind, "rl_triton", GROUPS[0],
                             nbytes, dev, full, rel_err=err))
        # after every configuration, so that a run cut short keeps what it measured
        (out / "bench.json").write_text(json.dumps(
            dict(env=env, suite="tokens", rows=[asdict(r) for r in rows]), indent=1))
    write_reports(json.loads((out / "bench.json").read_text()), out)


# ---- the losses suite (--suite losses) ---------------------------------------------------------

LOSS_TOKENS = [2**20, 2**22, 2**24]
LOSS_T = 1024  # tokens per row of the [B, T] losses (PPO, value, KL)
SAC_CRITICS = 2  # twin target critics
CRR_SAMPLES = 4  # actions sampled from the policy per state (CRR's m)
# (loss, variant, options beyond the inputs, modes timed): SAC's targets are differentiable
# (semantics §9) but usually computed under no_grad, so both; CRR's weights have no gradient
LOSS_CASES = [
    ("ppo_policy_loss", "mask", {}, ("fwd+bwd",)),
    ("ppo_policy_loss", "mask, dual_clip=3", dict(dual_clip=3.0), ("fwd+bwd",)),
    ("value_loss", "mask, clip=0.2", dict(clip=0.2), ("fwd+bwd",)),
    ("kl_penalty", "k3, clamp=10", dict(clamp=10.0), ("fwd+bwd",)),
    ("sac_targets", "continuous K=2", {}, ("fwd", "fwd+bwd")),
    ("sac_targets", "discrete A=18 K=2", {}, ("fwd", "fwd+bwd")),
    ("crr_weights", "exp J=4", {}, ("fwd",)),
]
# eager and compile against rl_triton: outputs are float32 sums in another order; a gradient
# jumps where a ratio lands on the other side of a clip (tl.exp and torch.exp differ by ulps),
# by about 4e-4 of the norm per such position at 2^24 tokens; a wrong branch gives far more
LOSS_OUTPUT_TOL, LOSS_GRAD_TOL = 1e-4, 1e-2


def loss_kwargs(case, tokens, dtype, device, seed=0, row=LOSS_T):
    """Keyword arguments of `rl_triton.<loss>` and of its formula (`LOSS_FORMULAS`) for one of
    LOSS_CASES on `tokens` positions: [tokens / row, row] rows with a ~70% mask (PPO, value,
    KL: no mask) or `tokens` samples (SAC, CRR); floating inputs of `dtype`."""
    loss, variant, options, _ = case
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=g, device=device)

    def rand(*shape):
        return torch.rand(shape, generator=g, device=device)

    shape = (tokens // row, row)
    N = tokens
    if loss == "ppo_policy_loss":
        old = -rand(*shape)  # log-probabilities of sampled tokens
        # ratios exp(N(0, 0.5)): about a third past each clip, 1.4% past the dual clip
        kw = dict(log_probs=old + 0.5 * randn(*shape), old_log_probs=old,
                  advantages=randn(*shape), mask=rand(*shape) < 0.7)
    elif loss == "value_loss":
        values = randn(*shape)
        kw = dict(values=values, returns=randn(*shape), old_values=values + 0.3 * randn(*shape),
                  mask=rand(*shape) < 0.7)
    elif loss == "kl_penalty":
        ref = -rand(*shape)
        # d ~ N(0, 1): the clamp binds where d < -2.61, at 0.5% of the tokens
        kw = dict(log_probs=ref + randn(*shape), ref_log_probs=ref)
    elif loss == "sac_targets":
        kw = dict(rewards=randn(N), terminated=rand(N) < 0.05)
        if variant.startswith("discrete"):
            logits = randn(N, N_ACTIONS)
            kw.update(next_q_values=randn(N, N_ACTIONS, SAC_CRITICS),
                      next_log_probs=logits.log_softmax(-1), next_probs=logits.softmax(-1))
        else:
            kw.update(next_q_values=randn(N, SAC_CRITICS), next_log_probs=randn(N))
    else:
        kw = dict(q_values=randn(N), sampled_q_values=randn(N, CRR_SAMPLES))
    kw = {k: v.to(dtype) if v.is_floating_point() else v for k, v in kw.items()}
    return dict(kw, **options)


# semantics §9's formulas as a user writes them in PyTorch (float32 arithmetic, as rl_triton's),
# with the options LOSS_CASES uses and the functions' defaults: the eager and torch.compile
# baselines

def _ppo_formula(log_probs, old_log_probs, advantages, mask, clip_low=0.2, clip_high=0.2,
                 dual_clip=None, log_ratio_clamp=20.0):
    a = advantages.float()
    d = (log_probs.float() - old_log_probs.float()).clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = d.exp()
    unclipped, clipped = -a * ratio, -a * ratio.clamp(1 - clip_low, 1 + clip_high)
    l = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        l = torch.where(a < 0, torch.minimum(l, -a * dual_clip), l)
    n = mask.sum().clamp_min(1)
    return (torch.where(mask, l, 0.0).sum() / n,
            torch.where(mask, (clipped > unclipped).float(), 0.0).sum() / n,
            torch.where(mask, ratio - 1 - d, 0.0).sum() / n)


def _value_formula(values, returns, old_values, mask, clip):
    v, r, old = values.float(), returns.float(), old_values.float()
    l = torch.maximum(0.5 * (v - r) ** 2, 0.5 * (old + (v - old).clamp(-clip, clip) - r) ** 2)
    return torch.where(mask, l, 0.0).sum() / mask.sum().clamp_min(1)


def _kl_formula(log_probs, ref_log_probs, clamp):
    d = log_probs.float() - ref_log_probs.float()
    return (torch.exp(-d) + d - 1).clamp(-clamp, clamp)


def _sac_formula(rewards, terminated, next_q_values, next_log_probs, gamma=0.99, alpha=0.2,
                 next_probs=None):
    # min with indices: at a tie the gradient goes to the first critic, as rl_triton's (amin
    # splits it, and bfloat16 critics tie often)
    v = next_q_values.float().min(-1).values - alpha * next_log_probs.float()
    if next_probs is not None:
        v = (next_probs.float() * v).sum(-1)
    return rewards.float() + gamma * (1 - terminated.float()) * v


def _crr_formula(q_values, sampled_q_values, beta=1.0, max_weight=20.0):
    adv = q_values.float() - sampled_q_values.float().mean(-1)
    return torch.exp(adv / beta).clamp(max=max_weight)


LOSS_FORMULAS = {"ppo_policy_loss": _ppo_formula, "value_loss": _value_formula,
                 "kl_penalty": _kl_formula, "sac_targets": _sac_formula,
                 "crr_weights": _crr_formula}


def compiled_formula(formula):
    """torch.compile of a formula, mode default, static shapes: compiled per size and dtype, the
    best kernels at each (dynamic shapes would size the reductions' splits from the first size
    compiled). After a reset, so that each compiled formula holds one size's cache entries: no
    guards of other sizes walked per call, no recompile limit hit."""
    torch._dynamo.reset()
    return torch.compile(formula, dynamic=False)


def loss_bytes(kw, outs, grads, leaves) -> int:
    """Minimal bytes of a call: every input tensor read once (flags and masks included), the
    outputs written; forward plus backward also the output gradients read and one gradient per
    leaf written (a leaf's size)."""
    return sum(t.numel() * t.element_size() for t in (
        *(v for v in kw.values() if isinstance(v, torch.Tensor)), *outs, *grads, *leaves))


@dataclass
class LossRow:
    loss: str
    variant: str
    mode: str  # "fwd", or "fwd+bwd": the call and the input gradients of random output gradients
    tokens: int  # positions: B x T tokens, or N samples (SAC, CRR)
    dtype: str  # of the floating inputs (outputs are float32)
    impl: str  # "rl_triton", "eager" (LOSS_FORMULAS) or "compile" (torch.compile of the formula)
    bytes: int  # loss_bytes
    device_us: float
    full_us: float
    copy_us: float  # device time of a copy moving the same bytes
    rel_err: float  # outputs against rl_triton's (0 for rl_triton)
    grad_rel_err: float = float("nan")  # fwd+bwd: input gradients against rl_triton's


def loss_cells(case, tokens, dtype, device, seed=0):
    """The rows of one case at one size and input dtype: for each of its modes rl_triton, the
    eager formula and its torch.compile on the same inputs, each baseline's outputs (and
    gradients) checked against rl_triton's before it is timed; the compile happens in that
    check."""
    loss, variant, _, modes = case
    kw = loss_kwargs(case, tokens, DTYPES[dtype], device, seed)
    formula = LOSS_FORMULAS[loss]
    impls = {"rl_triton": functools.partial(getattr(rl_triton, loss), backend="triton"),
             "eager": formula, "compile": compiled_formula(formula)}
    for mode in modes:
        args, leaves = (kw, []) if mode == "fwd" else grad_inputs(kw)
        ref = as_tuple(impls["rl_triton"](**args))
        grads = output_grads(ref, seed) if leaves else []
        nbytes = loss_bytes(args, ref, grads, leaves)
        ref_grads = None
        for impl, f in impls.items():
            call = _partial(f, args)
            timed = fwd_bwd_fn(call, leaves, grads) if leaves else call
            err, grad_err = 0.0, (0.0 if leaves else float("nan"))
            what = f"{impl} {loss} {variant} {mode} {tokens} tokens {dtype}"
            if impl == "rl_triton":
                ref_grads = timed() if leaves else None
            else:
                err = rel_err(as_tuple(call()), ref, 0)
                check_result(err, LOSS_OUTPUT_TOL, what)
                if leaves:
                    grad_err = rel_err(timed(), ref_grads, 0)
                    check_result(grad_err, LOSS_GRAD_TOL, what + " gradients")
            # the eager formulas launch 10-40 kernels: more host time than the forward hold
            dev, full = device_and_full_us(timed, hold_cycles=_HOLD_CYCLES_GRAD)
            yield LossRow(loss, variant, mode, tokens, dtype, impl, nbytes, dev, full,
                          same_bytes_copy_us(nbytes, device), err, grad_err)


def run_losses(tokens, dtypes, env, device, out, max_seconds):
    """`--suite losses`: every case of LOSS_CASES at every size (`tokens`) and input dtype,
    `loss_cells`; bench.json (suite "losses") after each, then bench.md and losses.png."""
    rows: list[LossRow] = []

    def save():
        (out / "bench.json").write_text(json.dumps(
            dict(env=env, suite="losses", rows=[asdict(r) for r in rows]), indent=1))

    save()
    configs = [(n, dt, case) for n in tokens for dt in dtypes for case in LOSS_CASES]
    t_start = time.time()
    for i, (n, dt, case) in enumerate(configs):
        if max_seconds is not None and time.time() - t_start > max_seconds:
            print(f"# stopped after {i} of {len(configs)} configurations (--max-seconds)")
            break
        tag = f"[{i + 1}/{len(configs)} {time.time() - t_start:6.0f}s]"
        for r in loss_cells(case, n, dt, device, seed=i):
            rows.append(r)
            print(f"{tag} {r.loss:15s} {r.variant:18s} {r.mode:7s} {tokens_label(n):>5s} "
                  f"{dt:8s} {r.impl:9s} {r.device_us:9.1f} us dev {r.full_us:9.1f} us full  "
                  f"{r.copy_us / r.device_us:4.2f} of a same-bytes copy", flush=True)
        save()  # after every configuration, so that a run cut short keeps what it measured
    write_reports(json.loads((out / "bench.json").read_text()), out)


def tokens_label(n: int) -> str:
    """2^20 for 1048576; other counts as they are."""
    return f"2^{n.bit_length() - 1}" if n > 0 and n & (n - 1) == 0 else str(n)


def write_reports(result, out: Path):
    """bench.md and the suite's plot (bench.png; the token suite tokens.png, the losses
    losses.png) from a bench.json result (also: `--report bench.json`)."""
    render, draw, png = {"tokens": (token_markdown, token_plot, "tokens.png"),
                         "losses": (loss_markdown, loss_plot, "losses.png")}.get(
        result.get("suite"), (markdown, plot, "bench.png"))
    md = render(result)
    (out / "bench.md").write_text(md)
    draw(result, out / png)
    print(md)


def _driver_version():
    try:
        import subprocess
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - informational only
        return "unknown"


def _partial(fn, kw, **extra):
    return lambda: fn(**kw, **extra)


def _compiled(name, kw):
    fn = torch.compile(getattr(rl_triton, name), dynamic=False)
    return lambda: fn(**kw, backend="torch")


# ---- reports ---------------------------------------------------------------------------------

def env_line(env) -> str:
    return (f"{env['gpu']}, driver {env['driver']}, torch {env['torch']}, triton {env['triton']}, "
            f"{env['date']}. Copy bandwidth {env['copy_bandwidth_gbs']:.0f} GB/s; launch floor "
            f"{env['launch_floor_device_us']:.1f} us device, {env['launch_floor_full_us']:.1f} us "
            "full call." + (f" Tile rule replaced by {env['tiles']} (--tiles)."
                            if env.get("tiles") else "")
            + (f" Rule constants changed: {env['rule']} (--rule)." if env.get("rule") else ""))


def markdown(result) -> str:
    rows = [r for r in result["rows"] if r.get("mode", "fwd") == "fwd"]
    grads = [r for r in result["rows"] if r.get("mode", "fwd") != "fwd"]
    shapes = list(dict.fromkeys(r["shape"] for r in result["rows"]))
    lines = [env_line(result["env"]), "",
             "rl_triton, device / full-call µs (bandwidth fraction of copy):", "",
             "| estimator | layout | dtype | trunc | " + " | ".join(shapes) + " |",
             "|---" * (4 + len(shapes)) + "|"]
    mine = [r for r in rows if r["impl"] == "rl_triton"]
    keys = list(dict.fromkeys((r["estimator"], r["layout"], r["dtype"], r["truncation"])
                              for r in mine))
    cell = {(r["estimator"], r["layout"], r["dtype"], r["truncation"], r["shape"]): r
            for r in mine}
    def has_copy(r):
        c = r.get("copy_us")
        return c is not None and c == c  # measured (older results have none, or NaN)

    def rows_of(fmt):
        """One table line per key, fmt(row) in every shape's cell ("" where not measured)."""
        for k in keys:
            cells = [fmt(cell[k + (s,)]) if k + (s,) in cell else "" for s in shapes]
            lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {'yes' if k[3] else 'no'} | "
                         + " | ".join(cells) + " |")

    rows_of(lambda r: f"{r['device_us']:.0f} / {r['full_us']:.0f} ({r['bandwidth_fraction']:.2f})")
    if any(has_copy(r) for r in mine):
        lines += ["", "The same, as the device time of a copy that moves the same bytes divided "
                  "by rl_triton's device time (1.00: as fast as copying those bytes):", "",
                  "| estimator | layout | dtype | trunc | " + " | ".join(shapes) + " |",
                  "|---" * (4 + len(shapes)) + "|"]
        rows_of(lambda r: f"{r['copy_us'] / r['device_us']:.2f}" if has_copy(r) else "")
    base = [r for r in rows if r["impl"] != "rl_triton"]
    if base:
        lines += ["", "Speedup of rl_triton over the baselines (same inputs), full-call time "
                  "(device time in brackets):", "",
                  "| estimator | baseline | layout | trunc | " + " | ".join(shapes) + " |",
                  "|---" * (4 + len(shapes)) + "|"]
        bkeys = list(dict.fromkeys((r["estimator"], r["impl"], r["layout"], r["dtype"],
                                    r["truncation"]) for r in base))
        bcell = {(r["estimator"], r["impl"], r["layout"], r["dtype"], r["truncation"],
                  r["shape"]): r for r in base}
        for k in bkeys:
            cells = []
            for s in shapes:
                b, m = bcell.get(k + (s,)), cell.get((k[0], k[2], k[3], k[4], s))
                cells.append("" if b is None or m is None else
                             f"{b['full_us'] / m['full_us']:.1f}x ({b['device_us'] / m['device_us']:.1f}x)")
            lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {'yes' if k[4] else 'no'} | "
                         + " | ".join(cells) + " |")
    if grads:
        lines += gradient_tables(grads, shapes)
    return "\n".join(lines) + "\n"


def gradient_tables(rows, shapes) -> list:
    """`--modes bwd` and `fwd+bwd`: the backward pass against the same-bytes copy of its own
    bytes, and forward plus backward against the baselines."""
    lines = []
    cell = {(r["mode"], r["impl"], r["estimator"], r["layout"], r["dtype"], r["truncation"],
             r["shape"]): r for r in rows}
    keys = list(dict.fromkeys((r["estimator"], r["layout"], r["dtype"], r["truncation"])
                              for r in rows if r["impl"] == "rl_triton"))

    def table(title, mode, impl, fmt):
        found = [k for k in keys if any((mode, impl) + k + (s,) in cell for s in shapes)]
        if not found:
            return
        lines.extend(["", title, "", "| estimator | layout | dtype | trunc | "
                      + " | ".join(shapes) + " |", "|---" * (4 + len(shapes)) + "|"])
        for k in found:
            cells = [fmt(cell[(mode, impl) + k + (s,)], k, s)
                     if (mode, impl) + k + (s,) in cell else "" for s in shapes]
            lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {'yes' if k[3] else 'no'} | "
                         + " | ".join(cells) + " |")

    table("Backward pass alone (every floating input requires grad), device / full-call µs "
          "(device time of a copy of its minimal bytes / its device time):", "bwd", "rl_triton",
          lambda r, k, s: f"{r['device_us']:.0f} / {r['full_us']:.0f} "
                          f"({r['copy_us'] / r['device_us']:.2f})")
    table("Forward plus backward, rl_triton, device / full-call µs:", "fwd+bwd", "rl_triton",
          lambda r, k, s: f"{r['device_us']:.0f} / {r['full_us']:.0f}")
    for impl, name in (("torch", "autograd through the torch backend"),
                       ("torchrl", "autograd through TorchRL's estimator")):
        def speedup(r, k, s, impl=impl):
            m = cell.get(("fwd+bwd", "rl_triton") + k + (s,))
            return "" if m is None else (f"{r['full_us'] / m['full_us']:.1f}x "
                                         f"({r['device_us'] / m['device_us']:.1f}x)")
        table(f"Forward plus backward: speedup of rl_triton over {name}, full call (device "
              "time in brackets):", "fwd+bwd", impl, speedup)
    return lines


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return None
    return plt


def plot(result, path):
    plt = _pyplot()
    if plt is None:
        return
    rows = [r for r in result["rows"] if r["impl"] == "rl_triton"
            and r.get("mode", "fwd") == "fwd"]
    names = list(dict.fromkeys(r["estimator"] for r in rows))
    if not names:
        return
    fig, axes = plt.subplots(2, len(names), figsize=(3.2 * len(names), 6), squeeze=False)
    for j, name in enumerate(names):
        for (layout, dt, tr), marker in zip(
                sorted({(r["layout"], r["dtype"], r["truncation"]) for r in rows}),
                "os^v<>dp*h"):
            sel = sorted((r for r in rows if r["estimator"] == name and (
                r["layout"], r["dtype"], r["truncation"]) == (layout, dt, tr)),
                key=lambda r: r["bytes"])
            label = f"{layout[:5]} {dt[:4]}{' tr' if tr else ''}"
            x = [r["bytes"] / 1e6 for r in sel]
            axes[0][j].loglog(x, [r["device_us"] for r in sel], marker, ms=3, label=label)
            axes[1][j].semilogx(x, [r["bandwidth_fraction"] for r in sel], marker, ms=3)
        axes[0][j].set_title(name, fontsize=9)
        axes[1][j].set_ylim(0, 1.05)
        axes[1][j].set_xlabel("minimal MB moved")
    axes[0][0].set_ylabel("device time (µs)")
    axes[1][0].set_ylabel("fraction of copy bandwidth")
    axes[0][0].legend(fontsize=6)
    fig.suptitle(f"rl_triton on {result['env']['gpu']} ({result['env']['date']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)



TOKEN_TABLE = """Token-level suite (`--suite tokens`): B LLM responses x T tokens, batch-major \
(time_dim=1), gamma=1, lam=0.95, `last_value=0`, no termination. Kinds \
(`rl_triton.testing.token_rows`, the same tokens in each): dense (no mask), padded \
(right-padded responses of T/2 to T tokens), multi-turn (padded, and 2-4 masked observation spans \
inside each response), packed (the multi-turn responses concatenated into [L] with cu_seqlens, \
scanned in place; the offsets' values are read once per offsets tensor, so the timed calls, which \
reuse theirs, never sync: a trainer with new offsets every step syncs once per step), \
packed-unmasked (packed without its mask: the segments alone), dense-packed (packed's tokens as \
one unmasked row [L]).

Columns: device µs (L2 flushed, the GPU held) and full-call µs, medians; of copy: the device \
time of a copy of the call's minimal bytes over the call's; vs dense: the call's time over the \
dense call's on the same tokens (dense for padded and multi-turn, dense-packed for packed and \
packed-unmasked), \
device / full call; framework µs: the framework's own token loop, full call, on the float32 \
multi-turn rows (one warm-up, then the median of up to %d calls); speedup: framework / \
rl_triton's drop-in (`rl_triton.integrations.<framework>`, its full call in the full-call \
column), or where none is installed framework / the rl_triton call it computes (named in \
brackets), on the same rows.""" \
    % FRAMEWORK_CALLS_TIMED


def token_markdown(result) -> str:
    """bench.md of the token suite: one table of the calls and the frameworks' loops, one of
    group_advantages against the launch floor."""
    env, rows = result["env"], result["rows"]
    order = {k: {v: i for i, v in enumerate(dict.fromkeys(r[k] for r in rows))}
             for k in ("call", "shape", "dtype", "kind")}
    mine = {(r["call"], r["shape"], r["dtype"], r["kind"]): r for r in rows
            if r["impl"] == "rl_triton"}
    drop = {(r["call"], r["shape"]): r for r in rows if r["impl"] == "drop-in"}
    lines = [env_line(env), "", TOKEN_TABLE, "",
             "| call | shape | dtype | kind | device µs | full-call µs | of copy | vs dense | "
             "framework µs | speedup |", "|---" * 10 + "|"]
    calls = sorted((r for r in rows if r["impl"] == "rl_triton"
                    and r["call"] != "group_advantages"),
                   key=lambda r: tuple(order[k][r[k]] for k in ("call", "shape", "dtype", "kind")))
    loops = [r for r in rows if r["impl"] not in ("rl_triton", "drop-in")]  # by shape, as run
    for r in calls + loops:
        if r["impl"] == "rl_triton":
            dense = mine.get((r["call"], r["shape"], r["dtype"], "dense-packed"
                              if r["kind"] in ("packed", "packed-unmasked") else "dense"))
            vs = ("" if dense is None or r["kind"] in ("dense", "dense-packed") else
                  f"{r['device_us'] / dense['device_us']:.2f} / "
                  f"{r['full_us'] / dense['full_us']:.2f}")
            cells = [r["call"], f"{r['device_us']:.1f}", f"{r['full_us']:.1f}",
                     f"{r['copy_us'] / r['device_us']:.2f}", vs, "", ""]
        else:
            ours = drop.get((r["call"], r["shape"]))
            estimator = FRAMEWORK_CALLS[r["call"]][1]
            base = ours or mine.get((estimator, r["shape"], r["dtype"], r["kind"]))
            timed = r["full_us"] == r["full_us"]
            speedup = "" if base is None or not timed else (
                f"{r['full_us'] / base['full_us']:.0f}x" + ("" if ours else f" ({estimator})"))
            cells = [f"{r['impl']} {r['call']}", "", "" if ours is None else
                     f"{ours['full_us']:.1f}", "", "", f"{r['full_us']:.0f}" if timed
                     else r["note"], speedup]
        lines.append(f"| {cells[0]} | {r['shape']} | {r['dtype']} | {r['kind']} | "
                     + " | ".join(cells[1:]) + " |")
    groups = [r for r in rows if r["call"] == "group_advantages"]
    if groups:
        lines += ["", "group_advantages (GRPO's: mean baseline, std scale) on float32 scores, "
                  "groups by group_size and by a shuffled group_index (which syncs once); full "
                  "call / launch floor: its full call over the launch floor's:", "",
                  "| call | scores x groups | kind | device µs | full-call µs | "
                  "full call / launch floor |", "|---" * 6 + "|"]
        for r in groups:
            lines.append(f"| group_advantages | {r['shape']} | {r['kind']} | "
                         f"{r['device_us']:.1f} | {r['full_us']:.1f} | "
                         f"{r['full_us'] / env['launch_floor_full_us']:.2f} |")
    return "\n".join(lines) + "\n"


def token_plot(result, path):
    """tokens.png: full-call time against tokens per row, log-log, rl_triton's float32 calls
    against the frameworks' loops (and the drop-ins), one panel per estimator."""
    plt = _pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(TOKEN_PARAMS), figsize=(10, 4.5), squeeze=False)
    for ax, estimator in zip(axes[0], TOKEN_PARAMS):
        curves = {}
        for r in result["rows"]:
            if (r["call"] == estimator and r["dtype"] == "float32"
                    and r["kind"] in ("multi-turn", "packed")):
                label = f"rl_triton.{estimator} {r['kind']}"
            elif FRAMEWORK_CALLS.get(r["call"], (None, None))[1] == estimator:
                label = f"{r['impl']} {r['call']}"
            else:
                continue
            if r["full_us"] == r["full_us"]:
                curves.setdefault(label, []).append((parse_shape(r["shape"])[1], r["full_us"]))
        for (label, points), marker in zip(curves.items(), "os^v<>dp*hx+"):
            ax.loglog(*zip(*sorted(points)), marker + "-", ms=4, label=label)
        shapes = {parse_shape(r["shape"])[1]: r["shape"] for r in result["rows"]
                  if r["call"] == estimator}
        ax.set_xticks(list(shapes), list(shapes.values()), fontsize=7)
        ax.minorticks_off()
        ax.set_title(estimator, fontsize=9)
        ax.set_xlabel("B responses x T tokens (log T)")
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("full-call time (µs)")
    fig.suptitle(f"Token rows on {result['env']['gpu']} ({result['env']['date']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


LOSS_TABLE = """Losses (`--suite losses`, semantics §9): PPO's surrogate, the value loss and the \
KL penalty on batch-major rows [tokens / %d, %d] with a random ~70%% mask (the KL penalty takes \
none), SAC's targets and CRR's weights on N = tokens samples (%d target critics; discrete: %d \
actions; CRR: %d sampled actions); the functions' defaults otherwise, float32 or bfloat16 \
inputs, float32 outputs. fwd+bwd: the call, then `torch.autograd.grad` of its outputs against \
fixed random output gradients, every floating input requiring grad; fwd: the call alone. Three \
implementations of one formula: rl_triton (backend="triton"), eager (semantics §9's formula in \
plain PyTorch, `rl_triton.bench.LOSS_FORMULAS`, its outputs and gradients checked against \
rl_triton's first) and compile (`torch.compile` of it, mode default, static shapes: compiled per size and \
dtype, outside the timing).

Columns: MB: the call's minimal bytes (every input read once, the outputs written; fwd+bwd also \
the output gradients read and the input gradients written: rl_triton's backward kernel reads the \
inputs again, uncounted); device µs (L2 flushed, the GPU held) and full-call µs of rl_triton, \
medians; of copy: the device time of a copy of the minimal bytes over rl_triton's; eager µs, \
compile µs: their full calls; vs: their full call over rl_triton's (device times' ratio in \
brackets).""" % (LOSS_T, LOSS_T, SAC_CRITICS, N_ACTIONS, CRR_SAMPLES)
# the losses' targets (docs/benchmarks.md, "Targets"): (name, what it compares, threshold)
LOSS_TARGETS = (("of copy >= 0.6 at >= 32 MB", "copy", 0.6),
                ("vs eager >= 3x, full call", "eager", 3.0),
                ("vs compile >= 1x, full call", "compile", 1.0))


def group_loss_rows(rows) -> dict:
    """{(loss, variant, mode, tokens, dtype): {impl: row}}, in table order: the cases and their
    modes as run, then tokens, then dtype."""
    cases = {k: i for i, k in enumerate(dict.fromkeys((r["loss"], r["variant"], r["mode"])
                                                      for r in rows))}
    dtypes = {k: i for i, k in enumerate(dict.fromkeys(r["dtype"] for r in rows))}
    cells = {}
    for r in rows:
        cells.setdefault((r["loss"], r["variant"], r["mode"], r["tokens"], r["dtype"]),
                         {})[r["impl"]] = r
    return dict(sorted(cells.items(), key=lambda kv: (cases[kv[0][:3]], kv[0][3],
                                                      dtypes[kv[0][4]])))


def loss_markdown(result) -> str:
    """bench.md of the losses suite: one table of the cells, one of the targets met."""
    cells = group_loss_rows(result["rows"])
    lines = [env_line(result["env"]), "", LOSS_TABLE, "",
             "| loss | variant | mode | tokens | dtype | MB | device µs | full µs | of copy | "
             "eager µs | vs eager | compile µs | vs compile |", "|---" * 13 + "|"]
    for (loss, variant, mode, tokens, dtype), c in cells.items():
        ours = c["rl_triton"]
        cols = [f"{ours['bytes'] / 1e6:.1f}", f"{ours['device_us']:.1f}",
                f"{ours['full_us']:.1f}", f"{ours['copy_us'] / ours['device_us']:.2f}"]
        for impl in ("eager", "compile"):
            b = c.get(impl)
            cols += ["", ""] if b is None else [
                f"{b['full_us']:.1f}", f"{b['full_us'] / ours['full_us']:.1f}x "
                f"({b['device_us'] / ours['device_us']:.1f}x)"]
        lines.append(f"| {loss} | {variant} | {mode} | {tokens_label(tokens)} | {dtype} | "
                     + " | ".join(cols) + " |")
    lines += ["", "The targets (docs/benchmarks.md, \"Targets\"): cells that meet each, of those it "
              "applies to, and the lowest:", "", "| target | mode | met | lowest |",
              "|---" * 4 + "|"]
    for name, what, threshold in LOSS_TARGETS:
        for mode in dict.fromkeys(k[2] for k in cells):
            values = []
            for k, c in cells.items():
                ours, base = c["rl_triton"], c.get(what)
                if k[2] != mode or (what == "copy" and ours["bytes"] < 32e6) or (
                        what != "copy" and base is None):
                    continue
                value = (ours["copy_us"] / ours["device_us"] if what == "copy"
                         else base["full_us"] / ours["full_us"])
                values.append((value, k))
            if values:
                low, k = min(values)
                lines.append(f"| {name} | {mode} | {sum(v >= threshold for v, _ in values)} of "
                             f"{len(values)} | {low:.2f} ({k[0]} {k[1]}, {tokens_label(k[3])}, "
                             f"{k[4]}) |")
    return "\n".join(lines) + "\n"


def loss_plot(result, path):
    """losses.png: full-call time against tokens, log-log, one panel per loss (its first variant
    on the first dtype, forward plus backward where timed), rl_triton, eager and compile."""
    plt = _pyplot()
    if plt is None:
        return
    rows = result["rows"]
    losses = list(dict.fromkeys(r["loss"] for r in rows))
    if not losses:
        return
    dtype = rows[0]["dtype"]
    fig, axes = plt.subplots(1, len(losses), figsize=(3.2 * len(losses), 3.8), squeeze=False)
    for ax, loss in zip(axes[0], losses):
        mine = [r for r in rows if r["loss"] == loss and r["dtype"] == dtype]
        variant, mode = max(dict.fromkeys((r["variant"], r["mode"]) for r in mine),
                            key=lambda vm: vm[1] == "fwd+bwd")  # the first such
        for impl, marker in zip(("rl_triton", "eager", "compile"), "os^"):
            points = sorted((r["tokens"], r["full_us"]) for r in mine
                            if (r["variant"], r["mode"], r["impl"]) == (variant, mode, impl))
            if points:
                ax.loglog(*zip(*points), marker + "-", ms=4, label=impl)
        sizes = sorted({r["tokens"] for r in mine})
        ax.set_xticks(sizes, [tokens_label(n) for n in sizes], fontsize=7)
        ax.minorticks_off()
        ax.set_title(f"{loss}\n{variant}, {mode}, {dtype}", fontsize=8)
        ax.set_xlabel("tokens (samples: SAC, CRR)")
    axes[0][0].set_ylabel("full-call time (µs)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Losses on {result['env']['gpu']} ({result['env']['date']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


if __name__ == "__main__":
    main()
