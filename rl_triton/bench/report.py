"""The benchmark's results: the rows bench.json holds (one dataclass per suite), and bench.md's
tables and each suite's plot from a bench.json (also `--report bench.json`, anywhere).

A result written before host time was measured (rows without `host_us`) renders as it did then.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from . import registry
from .registry import (CRR_SAMPLES, FRAMEWORK_CALLS, FRAMEWORK_CALLS_TIMED, LOSS_T, N_ACTIONS,
                       SAC_CRITICS, TOKEN_PARAMS, parse_shape)

NAN = float("nan")


@dataclass
class Row:
    """The grid's (`suites.grid`, `suites.gradients`)."""
    estimator: str
    shape: str
    layout: str
    dtype: str
    truncation: bool
    impl: str  # "rl_triton", "torch", "compile" or "loop"; fwd+bwd: also "torchrl"
    bytes: int
    device_us: float
    full_us: float
    bandwidth_fraction: float
    rel_err: float
    copy_us: float = NAN  # device time of a copy moving the same bytes
    mode: str = "fwd"  # "fwd", "bwd" (the backward pass alone) or "fwd+bwd"
    host_us: float = NAN


@dataclass
class TokenRow:
    """The token suite's (`suites.tokens`)."""
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
    copy_us: float = NAN  # device time of a copy moving the same bytes
    rel_err: float = NAN  # against float64; a drop-in: against its framework
    note: str = ""  # why a cell has no time
    host_us: float = NAN  # not measured for the frameworks' loops (one to three calls)


@dataclass
class LossRow:
    """The losses suite's (`suites.losses`)."""
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
    grad_rel_err: float = NAN  # fwd+bwd: input gradients against rl_triton's
    host_us: float = NAN


@dataclass
class HostRow:
    """The host-path suite's (`suites.host`)."""
    part: str  # "grid" (the estimators against the anchor) or "others" (against GAE's host)
    call: str  # rl_triton's function (the anchor's rows: the one its call computes)
    variant: str  # the losses' case, group_advantages' groups; "" elsewhere
    shape: str  # N x T
    layout: str  # "time-major", "batch-major"; "" where the call has no time axis
    dtype: str  # of the inputs
    flags: str  # "bool" or "float" (float32); "" where the call takes none
    impl: str  # "rl_triton", "bound" (its plan's compiled kernel launched bare) or "anchor"
    host_us: float
    full_us: float
    rel_err: float = NAN  # rl_triton: against float64; the bound, the anchor: against rl_triton


def save_json(out: Path, env: dict, rows: list, suite=None):
    """bench.json of a suite's rows so far (the grid's has no "suite")."""
    result = dict(env=env) | ({} if suite is None else dict(suite=suite))
    (Path(out) / "bench.json").write_text(json.dumps(
        dict(result, rows=[asdict(r) for r in rows]), indent=1))


def write_saved_reports(out: Path):
    """`write_reports` of the bench.json in `out`."""
    write_reports(json.loads((Path(out) / "bench.json").read_text()), out)


# suite -> (render, draw or None, plot file) of the suites whose reports live in their own
# module (they register here when imported: this module imports no suite)
RENDERERS: dict = {}


def write_reports(result, out: Path):
    """bench.md and the suite's plot (bench.png; the token suite tokens.png, the losses
    losses.png, the host path host.png, a registered suite its own: `RENDERERS`) from a
    bench.json result (also: `--report bench.json`)."""
    render, draw, png = {"tokens": (token_markdown, token_plot, "tokens.png"),
                         "losses": (loss_markdown, loss_plot, "losses.png"),
                         "host": (host_markdown, host_plot, "host.png"),
                         **RENDERERS}.get(result.get("suite"), (markdown, plot, "bench.png"))
    md = render(result)
    (Path(out) / "bench.md").write_text(md)
    if draw is not None:
        draw(result, Path(out) / png)
    print(md)


def measured(x) -> bool:
    return x is not None and x == x  # older results have none, or NaN


def has_host(rows) -> bool:
    """Whether a result measured host time (older ones did not: they render as they did)."""
    return any(measured(r.get("host_us")) for r in rows)


HOST_NOTE = ("Host µs: what the CPU spends in the call before it returns (synchronize, host "
             "timer, call, host timer; median of the full call's calls).")


def env_line(env) -> str:
    host = env.get("launch_floor_host_us")
    return (f"{env['gpu']}, driver {env['driver']}, torch {env['torch']}, triton {env['triton']}, "
            f"{env['date']}. Copy bandwidth {env['copy_bandwidth_gbs']:.0f} GB/s; launch floor "
            f"{env['launch_floor_device_us']:.1f} us device, {env['launch_floor_full_us']:.1f} us "
            "full call" + (f", {host:.1f} us host" if measured(host) else "") + "."
            + (f" Tile rule replaced by {env['tiles']} (--tiles)." if env.get("tiles") else "")
            + (f" Rule constants changed: {env['rule']} (--rule)." if env.get("rule") else ""))


def _times(r, host: bool) -> str:
    """"device / full" µs, and " / host" where the result has host times."""
    return f"{r['device_us']:.0f} / {r['full_us']:.0f}" + (
        f" / {r['host_us']:.0f}" if host else "")


def markdown(result) -> str:
    rows = [r for r in result["rows"] if r.get("mode", "fwd") == "fwd"]
    grads = [r for r in result["rows"] if r.get("mode", "fwd") != "fwd"]
    shapes = list(dict.fromkeys(r["shape"] for r in result["rows"]))
    host = has_host(result["rows"])
    lines = [env_line(result["env"]), "",
             f"rl_triton, device / full-call{' / host' if host else ''} µs (bandwidth fraction "
             "of copy):", "",
             "| estimator | layout | dtype | trunc | " + " | ".join(shapes) + " |",
             "|---" * (4 + len(shapes)) + "|"]
    mine = [r for r in rows if r["impl"] == "rl_triton"]
    keys = list(dict.fromkeys((r["estimator"], r["layout"], r["dtype"], r["truncation"])
                              for r in mine))
    cell = {(r["estimator"], r["layout"], r["dtype"], r["truncation"], r["shape"]): r
            for r in mine}

    def rows_of(fmt):
        """One table line per key, fmt(row) in every shape's cell ("" where not measured)."""
        for k in keys:
            cells = [fmt(cell[k + (s,)]) if k + (s,) in cell else "" for s in shapes]
            lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {'yes' if k[3] else 'no'} | "
                         + " | ".join(cells) + " |")

    rows_of(lambda r: f"{_times(r, host)} ({r['bandwidth_fraction']:.2f})")
    if any(measured(r.get("copy_us")) for r in mine):
        lines += ["", "The same, as the device time of a copy that moves the same bytes divided "
                  "by rl_triton's device time (1.00: as fast as copying those bytes):", "",
                  "| estimator | layout | dtype | trunc | " + " | ".join(shapes) + " |",
                  "|---" * (4 + len(shapes)) + "|"]
        rows_of(lambda r: f"{r['copy_us'] / r['device_us']:.2f}" if measured(r.get("copy_us"))
                else "")
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
        lines += gradient_tables(grads, shapes, host)
    if host:
        lines += ["", HOST_NOTE]
    return "\n".join(lines) + "\n"


def gradient_tables(rows, shapes, host=False) -> list:
    """`--modes bwd` and `fwd+bwd`: the backward pass against the same-bytes copy of its own
    bytes, and forward plus backward against the baselines."""
    lines = []
    cell = {(r["mode"], r["impl"], r["estimator"], r["layout"], r["dtype"], r["truncation"],
             r["shape"]): r for r in rows}
    keys = list(dict.fromkeys((r["estimator"], r["layout"], r["dtype"], r["truncation"])
                              for r in rows if r["impl"] == "rl_triton"))
    times = f"device / full-call{' / host' if host else ''} µs"

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

    table(f"Backward pass alone (every floating input requires grad), {times} "
          "(device time of a copy of its minimal bytes / its device time):", "bwd", "rl_triton",
          lambda r, k, s: f"{_times(r, host)} ({r['copy_us'] / r['device_us']:.2f})")
    table(f"Forward plus backward, rl_triton, {times}:", "fwd+bwd", "rl_triton",
          lambda r, k, s: _times(r, host))
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


def _save(fig, title, path):
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


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
    _save(fig, f"rl_triton on {result['env']['gpu']} ({result['env']['date']})", path)


# ---- the token suite ---------------------------------------------------------------------------

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


def _host_cell(r) -> list:
    return [f"{r['host_us']:.1f}" if measured(r.get("host_us")) else ""]


def token_markdown(result) -> str:
    """bench.md of the token suite: one table of the calls and the frameworks' loops, one of
    group_advantages against the launch floor."""
    env, rows = result["env"], result["rows"]
    host = has_host(rows)
    hosts = _host_cell if host else (lambda r: [])  # a host µs column where measured
    order = {k: {v: i for i, v in enumerate(dict.fromkeys(r[k] for r in rows))}
             for k in ("call", "shape", "dtype", "kind")}
    mine = {(r["call"], r["shape"], r["dtype"], r["kind"]): r for r in rows
            if r["impl"] == "rl_triton"}
    drop = {(r["call"], r["shape"]): r for r in rows if r["impl"] == "drop-in"}
    lines = [env_line(env), "", TOKEN_TABLE] + (["", HOST_NOTE] if host else []) + [
        "", "| call | shape | dtype | kind | device µs | full-call µs | "
        + ("host µs | " if host else "") + "of copy | vs dense | framework µs | speedup |",
        "|---" * (10 + host) + "|"]
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
            cells = [r["call"], f"{r['device_us']:.1f}", f"{r['full_us']:.1f}", *hosts(r),
                     f"{r['copy_us'] / r['device_us']:.2f}", vs, "", ""]
        else:
            ours = drop.get((r["call"], r["shape"]))
            estimator = FRAMEWORK_CALLS[r["call"]][1]
            base = ours or mine.get((estimator, r["shape"], r["dtype"], r["kind"]))
            timed = r["full_us"] == r["full_us"]
            speedup = "" if base is None or not timed else (
                f"{r['full_us'] / base['full_us']:.0f}x" + ("" if ours else f" ({estimator})"))
            cells = [f"{r['impl']} {r['call']}", "", "" if ours is None else
                     f"{ours['full_us']:.1f}", *([""] * host if ours is None else hosts(ours)),
                     "", "", f"{r['full_us']:.0f}" if timed else r["note"], speedup]
        lines.append(f"| {cells[0]} | {r['shape']} | {r['dtype']} | {r['kind']} | "
                     + " | ".join(cells[1:]) + " |")
    groups = [r for r in rows if r["call"] == "group_advantages"]
    if groups:
        lines += ["", "group_advantages (GRPO's: mean baseline, std scale) on float32 scores, "
                  "groups by group_size and by a shuffled group_index (which syncs once); full "
                  "call / launch floor: its full call over the launch floor's:", "",
                  "| call | scores x groups | kind | device µs | full-call µs | "
                  + ("host µs | " if host else "") + "full call / launch floor |",
                  "|---" * (6 + host) + "|"]
        for r in groups:
            lines.append(f"| group_advantages | {r['shape']} | {r['kind']} | "
                         f"{r['device_us']:.1f} | {r['full_us']:.1f} | "
                         + "".join(c + " | " for c in hosts(r))
                         + f"{r['full_us'] / env['launch_floor_full_us']:.2f} |")
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
    _save(fig, f"Token rows on {result['env']['gpu']} ({result['env']['date']})", path)


# ---- the losses suite --------------------------------------------------------------------------

LOSS_TABLE = """Losses (`--suite losses`, semantics §9): PPO's surrogate, the value loss and the \
KL penalty on batch-major rows [tokens / %d, %d] with a random ~70%% mask (the KL penalty takes \
none), SAC's targets and CRR's weights on N = tokens samples (%d target critics; discrete: %d \
actions; CRR: %d sampled actions); the functions' defaults otherwise, float32 or bfloat16 \
inputs, float32 outputs. fwd+bwd: the call, then `torch.autograd.grad` of its outputs against \
fixed random output gradients, every floating input requiring grad; fwd: the call alone. Three \
implementations of one formula: rl_triton (backend="triton"), eager (semantics §9's formula in \
plain PyTorch, `rl_triton.bench.suites.losses.LOSS_FORMULAS`, its outputs and gradients checked \
against rl_triton's first) and compile (`torch.compile` of it, mode default, static shapes: \
compiled per size and dtype, outside the timing).

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


def tokens_label(n: int) -> str:
    """2^20 for 1048576; other counts as they are."""
    return f"2^{n.bit_length() - 1}" if n > 0 and n & (n - 1) == 0 else str(n)


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
    host = has_host(result["rows"])
    lines = [env_line(result["env"]), "", LOSS_TABLE] + (["", HOST_NOTE] if host else []) + [
        "", "| loss | variant | mode | tokens | dtype | MB | device µs | full µs | "
        + ("host µs | " if host else "") + "of copy | eager µs | vs eager | compile µs | "
        "vs compile |", "|---" * (13 + host) + "|"]
    for (loss, variant, mode, tokens, dtype), c in cells.items():
        ours = c["rl_triton"]
        cols = [f"{ours['bytes'] / 1e6:.1f}", f"{ours['device_us']:.1f}",
                f"{ours['full_us']:.1f}", *(_host_cell(ours) if host else []),
                f"{ours['copy_us'] / ours['device_us']:.2f}"]
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
    _save(fig, f"Losses on {result['env']['gpu']} ({result['env']['date']})", path)


# ---- the host-path suite -----------------------------------------------------------------------

HOST_TABLE = """Host path (`--suite host`): host µs, what the CPU spends in one call before it \
returns (synchronize, host timer, call, host timer), and full-call µs (synchronize, timer, call, \
synchronize, timer), medians of the same 210 calls after 20: the calls of one estimator and \
shape (ours, the bound's, the anchor's), or the other ops with GAE, timed together in 7 rounds \
of 30 calls each, so that the host's drift falls on all alike. The estimators on N x T rollouts \
without truncation flags (terminations at 1%, `last_value` or `initial`, the functions' \
defaults), time-major ([T, N], time_dim=0) and batch-major ([N, T], time_dim=1), bool or float32 \
flags; each against the anchor (rl-triton 0.1.3, the paper's library: batch-major float32 with \
float32 flags only, its result checked against rl_triton's on the same inputs) and against \
the bound: the same compiled kernel as rl_triton's call (its cached plan) launched bare \
from Python after its outputs' `torch.empty`, nothing else (its outputs checked equal to the \
call's). Then the other ops at {shape}, against the host time of \
GAE timed among them (float32, bool flags, the same layout; batch-major where the op has no \
time axis).

Columns: host / anchor and full / anchor: rl_triton's over the anchor's (targets <= 0.6 and \
<= 0.75); host bm / tm: batch-major's host time over time-major's (target within 10%); bound: \
its host / full-call µs."""
# the host path's targets (docs/benchmarks.md, "Targets"): rl_triton's over the anchor's, host and
# full call; the layouts' host ratio's distance from 1; GAE's host µs; other ops' over GAE's
HOST_ANCHOR_HOST, HOST_ANCHOR_FULL, HOST_LAYOUTS = 0.6, 0.75, 0.1
HOST_GAE_US, HOST_OTHERS = 25.0, 2.0


def _host_cells(rows):
    """The host rows by (impl, call, shape, layout, dtype, flags); the anchor's by (call,
    shape)."""
    cells = {}
    for r in rows:
        key = (r["call"], r["shape"]) if r["impl"] == "anchor" else (
            r["call"], r["variant"], r["shape"], r["layout"], r["dtype"], r["flags"])
        cells[(r["impl"],) + key] = r
    return cells


def _other_layout(layout):
    return "batch-major" if layout == "time-major" else "time-major"


def host_markdown(result) -> str:
    """bench.md of the host-path suite: the estimators against the anchor and the bound, the
    other ops against GAE, and the targets met."""
    env, rows = result["env"], result["rows"]
    cells = _host_cells([r for r in rows if r["part"] == "grid"])
    # GAE as timed among the other ops (an older bench.json has it in the grid only)
    yardstick = _host_cells([r for r in rows if r["part"] == "others"])
    anchor = env.get("anchor")
    shape = registry.HOST_OTHERS_SHAPE
    lines = [env_line(env), "", HOST_TABLE.format(shape=shape), "",
             f"Anchor: rl-triton {anchor['version']} from {anchor['path']}." if anchor else
             "Anchor: none (--anchor-path not given).", ""]

    def ratio(a, b, key):
        return a[key] / b[key] if a is not None and b is not None else NAN

    def fmt(x, spec=".2f"):
        return "" if not measured(x) else format(x, spec)

    grid = [r for r in rows if r["part"] == "grid" and r["impl"] == "rl_triton"]
    # per grid cell: (label, its rows by impl, the two layouts' host ratio and the bound's)
    cell_of = {}
    for r in grid:
        key = (r["call"], r["variant"], r["shape"], r["layout"], r["dtype"], r["flags"])
        pair = {lay: cells.get(("rl_triton",) + key[:3] + (lay,) + key[4:])
                for lay in ("batch-major", "time-major")}
        bounds = {lay: cells.get(("bound",) + key[:3] + (lay,) + key[4:])
                  for lay in ("batch-major", "time-major")}
        cell_of[key] = dict(
            label=f"{r['call']} {r['shape']} {r['layout']} {r['dtype']} {r['flags']} flags",
            ours=r, bound=cells.get(("bound",) + key), anchor=cells.get(("anchor", r["call"],
                                                                          r["shape"])),
            layouts=ratio(pair["batch-major"], pair["time-major"], "host_us"),
            bound_layouts=ratio(bounds["batch-major"], bounds["time-major"], "host_us"))
    if grid:
        lines += ["| estimator | shape | layout | dtype | flags | host µs | anchor host µs | "
                  "host / anchor | full µs | anchor full µs | full / anchor | host bm / tm | "
                  "bound host / full µs |", "|---" * 13 + "|"]
        for c in cell_of.values():
            r, a, b = c["ours"], c["anchor"], c["bound"]
            lines.append(
                f"| {r['call']} | {r['shape']} | {r['layout']} | {r['dtype']} | {r['flags']} | "
                f"{r['host_us']:.1f} | {fmt(a and a['host_us'], '.1f')} | "
                f"{fmt(ratio(r, a, 'host_us'))} | {r['full_us']:.1f} | "
                f"{fmt(a and a['full_us'], '.1f')} | {fmt(ratio(r, a, 'full_us'))} | "
                f"{fmt(c['layouts'])} | "
                + ("" if b is None else f"{b['host_us']:.1f} / {b['full_us']:.1f}") + " |")
    others = [r for r in rows if r["part"] == "others"]

    def gae_of(r):  # GAE's host row beside another op's
        key = ("rl_triton", "gae", "", shape, r["layout"] or "batch-major", "float32", "bool")
        return yardstick.get(key) or cells.get(key)

    if others:
        lines += ["", f"The other ops at {shape}, host time over GAE's:", "",
                  "| call | variant | layout | dtype | flags | host µs | full µs | "
                  "host / GAE's |",
                  "|---" * 8 + "|"]
        for r in others:
            lines.append(f"| {r['call']} | {r['variant']} | {r['layout']} | {r['dtype']} | "
                         f"{r['flags']} | {r['host_us']:.1f} | {r['full_us']:.1f} | "
                         f"{fmt(ratio(r, gae_of(r), 'host_us'))} |")
    # the targets: (name, [(value, label, the bound's value there)], met(value), worst first)
    targets = []
    with_anchor = [c for c in cell_of.values() if c["anchor"] is not None]
    for name, key, limit in ((f"host <= {HOST_ANCHOR_HOST}x the anchor's", "host_us",
                              HOST_ANCHOR_HOST),
                             (f"full call <= {HOST_ANCHOR_FULL}x the anchor's", "full_us",
                              HOST_ANCHOR_FULL)):
        targets.append((name, [(ratio(c["ours"], c["anchor"], key), c["label"],
                                ratio(c["bound"], c["anchor"], key)) for c in with_anchor],
                        lambda v, limit=limit: v <= limit, lambda v: v))
    targets.append((f"host bm / tm within {HOST_LAYOUTS:.0%}",
                    [(c["layouts"], c["label"], c["bound_layouts"]) for c in cell_of.values()
                     if c["ours"]["layout"] == "batch-major" and measured(c["layouts"])],
                    lambda v: abs(v - 1) <= HOST_LAYOUTS, lambda v: abs(v - 1)))
    targets.append((f"GAE at {shape}: host <= {HOST_GAE_US:.0f} µs",
                    [(c["ours"]["host_us"], c["label"], c["bound"] and c["bound"]["host_us"])
                     for c in cell_of.values() if c["ours"]["call"] == "gae"
                     and c["ours"]["shape"] == shape],
                    lambda v: v <= HOST_GAE_US, lambda v: v))
    targets.append((f"other ops: host <= {HOST_OTHERS:.0f}x GAE's",
                    [(ratio(r, gae_of(r), "host_us"), f"{r['call']} {r['variant']}".strip(),
                      NAN) for r in others if r["call"] != "gae" and gae_of(r) is not None],
                    lambda v: v <= HOST_OTHERS, lambda v: v))
    lines += ["", "The targets (docs/benchmarks.md, \"Targets\"): cells that meet each, the "
              "worst, and the bound's value at that cell (a target below the bound is out of "
              "reach of any Python host path):", "", "| target | met | worst | the bound there |",
              "|---" * 4 + "|"]
    for name, values, met, badness in targets:
        if not values:
            continue
        value, label, bound = max(values, key=lambda v: badness(v[0]))
        lines.append(f"| {name} | {sum(met(v) for v, _, _ in values)} of {len(values)} | "
                     f"{value:.2f} ({label}) | {fmt(bound)} |")
    return "\n".join(lines) + "\n"


def host_plot(result, path):
    """host.png: host time per shape, one panel per estimator: rl_triton float32 with bool flags
    in both layouts, the bound (batch-major) and the anchor."""
    plt = _pyplot()
    if plt is None:
        return
    rows = [r for r in result["rows"] if r["part"] == "grid"]
    names = list(dict.fromkeys(r["call"] for r in rows))
    if not names:
        return
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.8), squeeze=False)
    series = (("rl_triton", "time-major", "rl_triton time-major"),
              ("rl_triton", "batch-major", "rl_triton batch-major"),
              ("bound", "batch-major", "bound batch-major"), ("anchor", None, "anchor"))
    for ax, name in zip(axes[0], names):
        for (impl, layout, label), marker in zip(series, "os^v"):
            points = [(shapes.index(r["shape"]), r["host_us"]) for r in rows
                      if r["call"] == name and r["impl"] == impl
                      and (impl == "anchor" or (r["layout"], r["dtype"], r["flags"])
                           == (layout, "float32", "bool"))]
            if points:
                ax.plot(*zip(*sorted(points)), marker + "-", ms=4, label=label)
        ax.set_xticks(range(len(shapes)), shapes, fontsize=7)
        ax.set_ylim(bottom=0)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("N x T (float32, bool flags)")
    axes[0][0].set_ylabel("host time per call (µs)")
    axes[0][0].legend(fontsize=6)
    _save(fig, f"Host path on {result['env']['gpu']} ({result['env']['date']})", path)
