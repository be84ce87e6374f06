"""`--suite llm`: the LLM zoo (semantics §10, docs/llm.md) against the frameworks' own functions,
on B responses x T tokens (default 512 x 4096 and 64 x 32768): verl 0.9.1's advantage estimators
(its registry) and OpenRLHF 0.11.2's two token loops, forward; verl's `kl_penalty` and OpenRLHF's
`compute_approx_kl`, forward plus backward; verl's rollout correction (weights, rejection mask) and
`rl_triton.rollout_correction` itself (its kernel launches counted); verl's policy losses
(POLICY_LOSS_REGISTRY) and OpenRLHF's `PolicyLoss`, forward plus backward. Each row: rl_triton's
drop-in (`rl_triton.integrations.<framework>`, with the framework's signature), the framework's
own function ("eager") and, for the KL estimators and the policy losses, `torch.compile` of it.

Every rl_triton result (and every compiled one) is checked against the eager framework's on the
same inputs before it is timed; a result that differs is not timed (its row says why) and the run
goes on. The frameworks come from `rl_triton.testing.import_frameworks` (--frameworks-path, else
$RL_TRITON_FRAMEWORKS, else .ci/frameworks). Timing is the harness's (`timing`): device, full
call and host time; the frameworks' Python loops (up to seconds a call) are timed in full call
only, one warm-up and up to FRAMEWORK_CALLS_TIMED calls within --frameworks-max-seconds
(`tokens.LoopBudget`). torch.compile of the estimators is not timed: most are Python loops over
the tokens (thousands of steps for dynamo to unroll) or over the responses' numpy prompt ids.

Targets (docs/benchmarks.md, "Targets"; stated at 512 x 4096, shown at every shape): every
estimator at least 100x the framework's function, full call; every policy loss, forward plus
backward, at least 3x the framework's eager function and no slower than torch.compile of it, full
call; rollout correction in one kernel launch forward. `--groups` picks some of the cells
(GROUPS): a run of every group at one shape holds 18 torch.compile builds.
"""
from __future__ import annotations

import importlib
import types
from dataclasses import dataclass

import numpy as np
import torch

from rl_triton import testing

from .. import registry, report, timing
from ..checks import rel_err
from . import losses
from .tokens import LoopBudget

NAN = float("nan")
LLM_SHAPES = ["512x4096", "64x32768"]
LLM_FRAMEWORKS_MAX_SECONDS = 300.0  # verl's GAE loop: 0.75 s a call at 512x4096, ~8x at T=32768
GROUP = 8  # responses per prompt (verl's rollout.n)
GAMMA, LAM = 1.0, 0.95  # outcome rewards, verl's lam
# drop-in against framework: float32 sums in another order (whitening over 2M tokens, segment
# sums) stay near 1e-6 of the norm; a wrong formula is off by O(1). Gradients jump where a ratio
# lands on the other side of a clip (registry.LOSS_GRAD_TOL says by how much)
OUTPUT_TOL, GRAD_TOL = 1e-4, registry.LOSS_GRAD_TOL
FAST_US = 10_000.0  # a framework call faster than this is also timed on the device
ESTIMATOR_SPEEDUP, LOSS_EAGER, LOSS_COMPILE, LAUNCHES = 100.0, 3.0, 1.0, 1
# --groups: the option's names of the cells' groups
GROUPS = {"estimators": "estimator", "kl": "kl", "rollout_correction": "rollout correction",
          "policy_losses": "policy loss"}


@dataclass
class LlmRow:
    """The LLM zoo suite's (`suites.llm`)."""
    group: str  # "estimator", "kl", "rollout correction" or "policy loss"
    framework: str  # "verl" or "openrlhf"
    call: str  # the framework's function (a registry's key where it has one)
    variant: str  # its options (KL name, level, aggregation); "" where none
    mode: str  # "fwd", or "fwd+bwd": the call and d log_probs of the output (ones)
    shape: str  # B responses x T tokens
    impl: str  # "rl_triton" (the drop-in), "rl_triton op" (the bare rl_triton call), "eager" (the
    #            framework's own function) or "compile" (torch.compile of it)
    device_us: float = NAN  # not measured for a framework call slower than FAST_US
    full_us: float = NAN
    host_us: float = NAN
    rel_err: float = NAN  # outputs against eager's (0 for eager)
    grad_rel_err: float = NAN  # fwd+bwd: d log_probs against eager's
    launches: float = NAN  # device kernels of one call (rollout correction's op)
    note: str = ""  # why a row has no time


# ---- inputs ----------------------------------------------------------------------------------

def zoo_inputs(B, T, device, fw, seed=0):
    """The zoo's inputs on B x T multi-turn rows (`testing.token_rows`: right-padded responses of
    T/2..T tokens with masked tool spans, an outcome reward on each last token): rewards r,
    values v, the float mask m (the frameworks') and bool mb, verl's prompt ids (uuid-like
    strings, GROUP responses a prompt, no group of one), the policy's log-probabilities lp (of
    probabilities in (0.02, 0.98)), old ones ~0.3 away in log space (ratios past both clips),
    the rollout engine's (0.1 away), sum_pi_squared, per-token advantages, verl's ActorConfig
    and its rollout-correction helper."""
    rows = testing.token_rows(B, T, "multi-turn", torch.float32, "cpu", seed)
    g = torch.Generator().manual_seed(seed + 1)
    lp = torch.empty(B, T).uniform_(0.02, 0.98, generator=g).log()
    old = (lp + 0.3 * torch.randn(B, T, generator=g)).clamp(max=-0.02)
    roll = old + 0.1 * torch.randn(B, T, generator=g)
    spi = 0.5 * torch.rand(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    ids = torch.arange(B) // GROUP
    if B > 1 and B % GROUP == 1:  # Pass@k refuses a group of one
        ids[-1] = ids[-2]
    import verl.workers.config.actor as A  # importable once import_frameworks ran
    cfg = A.ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                        clip_ratio_high=0.28, policy_loss=A.PolicyLossConfig(dro_beta=0.1))
    t = {k: x.to(device) for k, x in dict(
        r=rows["rewards"], v=rows["values"], m=rows["mask"].float(), mb=rows["mask"], lp=lp,
        old=old, roll=roll, spi=spi, adv=adv).items()}
    return types.SimpleNamespace(
        **t, index=np.array([f"uid-{i}" for i in ids.tolist()], dtype=object), cfg=cfg,
        helper=importlib.import_module("verl.trainer.ppo.rollout_corr_helper"), fw=fw)


class AlgoConfig(dict):
    """verl's AlgoConfig as the estimators read it (`.get`, `.gamma`)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


# ---- the cells ---------------------------------------------------------------------------------

@dataclass
class Cell:
    """One row of the table: the framework's function and rl_triton's, each a callable without
    arguments returning (outputs, gradients), tuples of tensors."""
    group: str
    framework: str
    call: str
    variant: str
    mode: str
    eager: object
    ours: dict  # impl -> callable
    compile: object = None  # the framework's function to torch.compile, wrapped as `eager`
    wrap: object = None  # fn -> the callable of `compile`


def tensors(x) -> tuple:
    """The tensors of a call's result: a tensor, or those at the top of a tuple (metrics dicts
    and floats left out)."""
    if isinstance(x, torch.Tensor):
        return (x,)
    return tuple(t for t in x if isinstance(t, torch.Tensor))


def forward(f, *args, **kw):
    """f(*args, **kw) as a cell's callable."""
    return lambda: (tensors(f(*args, **kw)), ())


def fwd_bwd(f, leaf, seed=None):
    """f(leaf) and d leaf of its first output (ones as its gradient; a loss is a scalar), as a
    cell's callable. `seed`: torch.manual_seed first (clip_cov draws with torch.randperm on the
    default generator, in verl and in ours alike), so that both draw the same tokens."""
    def run():
        if seed is not None:
            torch.manual_seed(seed)
        out = tensors(f(leaf))[0]
        (g,) = torch.autograd.grad(out, leaf, torch.ones_like(out))
        return (out.detach(),), (g,)
    return run


def _leaf(x):
    return x.detach().clone().requires_grad_()


def estimator_cells(x, ours_verl, ours_orl):
    """verl's registry (14 estimators) and OpenRLHF's token loops, forward."""
    r, m, ix = x.r, x.m, x.index
    args = {"compute_gae_advantage_return": ((r, x.v, m, GAMMA, LAM), {}),
            "compute_reinforce_plus_plus_outcome_advantage": (
                (r, m), dict(config=AlgoConfig(gamma=GAMMA))),
            "compute_remax_outcome_advantage": ((r, 0.5 * r.sum(-1), m), {}),
            "compute_grpo_passk_outcome_advantage": (
                (r, m, ix), dict(config=AlgoConfig(norm_adv_by_std_in_grpo=True))),
            "compute_optimal_token_baseline_advantage": ((r, m, ix, x.old, x.spi), {}),
            "compute_multi_turn_optimal_token_baseline_advantage": (
                (r, m, ix, x.old, x.spi), {})}
    for name, key, _ in ours_verl.ESTIMATORS:
        a, k = args.get(name, ((r, m, ix), {}))
        yield Cell("estimator", "verl", key, "", "fwd", forward(getattr(x.fw.verl, name), *a, **k),
                   {"rl_triton": forward(getattr(ours_verl, name), *a, **k)})
    for name, a in (("get_advantages_and_returns", (None, x.v, r, m, GAMMA, LAM)),
                    ("get_cumulative_returns", (None, r, m, GAMMA))):
        yield Cell("estimator", "openrlhf", name, "", "fwd",
                   forward(getattr(x.fw.openrlhf, name), *a),
                   {"rl_triton": forward(getattr(ours_orl, name), *a)})


def kl_cells(x, ours_verl, ours_orl):
    """verl's kl_penalty (k3 by both its names' clamps, its straight-through k3+, k1) and
    OpenRLHF's compute_approx_kl (k3, with and without its unbiased gradient), forward plus
    backward (d log_probs)."""
    lp = _leaf(x.lp)
    for name in ("low_var_kl", "k3+", "k1"):
        def call(fn, name=name):
            return lambda leaf: fn(leaf, x.roll, name)
        yield Cell("kl", "verl", "kl_penalty", name, "fwd+bwd",
                   fwd_bwd(call(x.fw.verl.kl_penalty), lp),
                   {"rl_triton": fwd_bwd(call(ours_verl.kl_penalty), lp)},
                   compile=call(x.fw.verl.kl_penalty), wrap=lambda f: fwd_bwd(f, lp))
    for unbiased in (False, True):
        def call(fn, unbiased=unbiased):
            return lambda leaf: fn(leaf, x.roll, x.old, "k3", unbiased)
        yield Cell("kl", "openrlhf", "compute_approx_kl", f"k3, unbiased_gradient={unbiased}",
                   "fwd+bwd", fwd_bwd(call(x.fw.openrlhf_utils.compute_approx_kl), lp),
                   {"rl_triton": fwd_bwd(call(ours_orl.compute_approx_kl), lp)},
                   compile=call(x.fw.openrlhf_utils.compute_approx_kl),
                   wrap=lambda f: fwd_bwd(f, lp))


def rollout_cells(x, ours_verl):
    """verl's rollout correction: the truncated IS weights at token and sequence level (beside
    `rl_triton.rollout_correction` with the same options, one kernel) and a rejection mask."""
    import rl_triton
    log_ratio = x.old - x.roll
    for level in ("token", "sequence"):
        name = "compute_rollout_correction_weights"
        yield Cell("rollout correction", "verl", name, f"{level}, threshold 2",
                   "fwd", forward(getattr(x.helper, name), log_ratio, x.m, level),
                   {"rl_triton": forward(getattr(ours_verl, name), log_ratio, x.m, level),
                    # the weights alone (the drop-in adds verl's metrics), on its backend
                    "rl_triton op": lambda level=level: (rl_triton.rollout_correction(
                        x.old, x.roll, x.mb, level=level, backend=ours_verl.backend)[:1], ())})
    name = "compute_rollout_rejection_mask"
    yield Cell("rollout correction", "verl", name, "seq_mean_k3, threshold 0.01", "fwd",
               forward(getattr(x.helper, name), log_ratio, x.m, "seq_mean_k3", 0.01),
               {"rl_triton": forward(getattr(ours_verl, name), log_ratio, x.m, "seq_mean_k3",
                                     0.01)})


def policy_loss_cells(x, ours_verl, ours_orl):
    """verl's POLICY_LOSS_REGISTRY (token-mean; sapo and geo_mean aggregate as verl makes them,
    bypass_mode left out: verl's rollout-correction helper, then gpg or vanilla) and OpenRLHF's
    PolicyLoss (ppo with dual clip 3, gspo), forward plus backward (d log_probs)."""
    lp = _leaf(x.lp)
    for name, ours in ours_verl.POLICY_LOSSES.items():
        if name == "bypass_mode":
            continue
        seed = 7 if name == "clip_cov" else None
        # sapo and geo_mean aggregate their own way whatever loss_agg_mode says, in verl and ours
        agg = {"sapo": "seq-mean-token-mean", "geo_mean": "seq-mean"}.get(name, "token-mean")

        def call(fn):
            return lambda leaf: fn(x.old, leaf, x.adv, x.m, "token-mean", x.cfg, None)
        yield Cell("policy loss", "verl", name, agg, "fwd+bwd",
                   fwd_bwd(call(x.fw.verl.POLICY_LOSS_REGISTRY[name]), lp, seed),
                   {"rl_triton": fwd_bwd(call(ours), lp, seed)},
                   compile=call(x.fw.verl.POLICY_LOSS_REGISTRY[name]),
                   wrap=lambda f, seed=seed: fwd_bwd(f, lp, seed))
    for typ, dual in (("ppo", 3.0), ("gspo", None)):
        def module(cls, typ=typ, dual=dual):
            mod = cls(0.2, 0.28, dual_clip=dual, policy_loss_type=typ)
            return lambda leaf: mod(leaf, x.old, x.adv, x.m)
        yield Cell("policy loss", "openrlhf", "PolicyLoss",
                   typ + (f", dual_clip={dual:g}" if dual else ""), "fwd+bwd",
                   fwd_bwd(module(x.fw.openrlhf_loss.PolicyLoss), lp),
                   {"rl_triton": fwd_bwd(module(ours_orl.PolicyLoss), lp)},
                   compile=module(x.fw.openrlhf_loss.PolicyLoss), wrap=lambda f: fwd_bwd(f, lp))


def zoo_cells(x, groups=tuple(GROUPS)):
    """The cells of `groups` (GROUPS' names) on the inputs `x` (`zoo_inputs`), in the table's
    order."""
    from rl_triton.integrations import openrlhf as ours_orl
    from rl_triton.integrations import verl as ours_verl
    cells = [*estimator_cells(x, ours_verl, ours_orl), *kl_cells(x, ours_verl, ours_orl),
             *rollout_cells(x, ours_verl), *policy_loss_cells(x, ours_verl, ours_orl)]
    return [c for c in cells if c.group in {GROUPS[g] for g in groups}]


# ---- measuring ---------------------------------------------------------------------------------

def errors(got, want) -> tuple:
    """(outputs' relative error, gradients') of a cell's result against eager's: the harness's
    `rel_err`, each tensor flattened (a loss is a scalar)."""
    def one(a, b):
        if not b:
            return NAN
        return rel_err(tuple(t.reshape(-1) for t in a),
                       tuple(t.reshape(-1).double() for t in b), 0)
    return one(got[0], want[0]), one(got[1], want[1])


def kernel_launches(fn) -> int:
    """The device kernels (and memsets, copies) one call of fn runs, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())


def _timed(fn):
    return timing.device_full_host_us(fn, hold_cycles=timing._HOLD_CYCLES_GRAD)


def cell_rows(cell, shape, budget):
    """The rows of one cell: eager (its result the reference; a slow call timed in full call
    within the budget), each rl_triton impl and the compiled framework function, each checked
    against eager's result before it is timed."""
    T = registry.parse_shape(shape)[1]
    key = (cell.framework, cell.call, cell.variant)

    def row(impl, **kw):
        return LlmRow(cell.group, cell.framework, cell.call, cell.variant, cell.mode, shape,
                      impl, **kw)

    full, want = budget.full_call_us(key, cell.eager, T)
    if want is None:
        yield row("eager", note="over --frameworks-max-seconds")
        for impl in cell.ours:
            yield row(impl, note="not timed: no framework result to check it against")
        return
    dev = host = NAN
    if full < FAST_US:
        dev, full, host = _timed(cell.eager)
    yield row("eager", device_us=dev, full_us=full, host_us=host, rel_err=0.0,
              grad_rel_err=0.0 if want[1] else NAN)
    impls = dict(cell.ours)
    if cell.compile is not None:
        impls["compile"] = None
    for impl, fn in impls.items():
        extra = {}
        try:
            if fn is None:  # compiled on its first call, here
                fn = cell.wrap(losses.compiled_formula(cell.compile))
            err, gerr = errors(fn(), want)
        except Exception as e:  # noqa: BLE001 - a compile that fails is a result
            if impl != "compile":
                raise
            yield row(impl, note=f"compile failed: {type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:100] if str(e) else ''}")
            continue
        if not (err < OUTPUT_TOL and (gerr != gerr or gerr < GRAD_TOL)):
            yield row(impl, rel_err=err, grad_rel_err=gerr,
                      note=f"not timed: differs from the framework (outputs {err:.2g}, "
                           f"gradients {gerr:.2g})")
            continue
        if impl == "rl_triton op":
            try:
                n = kernel_launches(fn)
                extra = dict(launches=float(n)) if n else dict(note="the profiler saw no kernel")
            except Exception as e:  # noqa: BLE001 - no profiler (CUPTI) on the machine
                extra = dict(note=f"kernels not counted: {type(e).__name__}")
        dev, full, host = _timed(fn)
        yield row(impl, device_us=dev, full_us=full, host_us=host, rel_err=err,
                  grad_rel_err=gerr, **extra)


def run_llm(shapes, env, device, out, max_seconds, frameworks_seconds, frameworks_path=None,
            groups=tuple(GROUPS)):
    """`--suite llm`: every cell of `zoo_cells` of `groups` at every shape (B x T), `cell_rows`;
    bench.json (suite "llm") after each cell, then bench.md and llm.png."""
    fw = testing.import_frameworks(frameworks_path)  # ImportError: the caller says why
    rows: list[LlmRow] = []
    budget = LoopBudget(frameworks_seconds)
    report.save_json(out, env, rows, "llm")
    inputs = {}

    def cells_of(shape):  # built once a shape, when its first cell is reached
        if shape not in inputs:
            inputs.clear()  # one shape's tensors at a time
            B, T = registry.parse_shape(shape)
            inputs[shape] = zoo_cells(zoo_inputs(B, T, device, fw, seed=shapes.index(shape)),
                                      groups)
        return inputs[shape]

    n_cells = len(zoo_cells(zoo_inputs(GROUP, 64, "cpu", fw), groups))  # the same at every shape
    configs = [(s, i) for s in shapes for i in range(n_cells)]
    for _, (shape, i), tag in timing.within_seconds(configs, max_seconds):
        for r in cell_rows(cells_of(shape)[i], shape, budget):
            rows.append(r)
            print(f"{tag} {r.group:18s} {r.framework:8s} {r.call:45s} {r.variant:28s} "
                  f"{r.shape:>9s} {r.impl:12s} {r.device_us:10.1f} us dev {r.full_us:11.1f} us "
                  f"full {r.host_us:9.1f} us host" + (f"  ({r.note})" if r.note else ""),
                  flush=True)
        # after every cell, so that a run cut short keeps what it measured
        report.save_json(out, env, rows, "llm")
    report.write_saved_reports(out)


# ---- the report --------------------------------------------------------------------------------

LLM_TABLE = """LLM zoo (`--suite llm`, semantics §10): B responses x T tokens, float32, \
multi-turn rows (`rl_triton.testing.token_rows`: right-padded responses of T/2 to T tokens with \
masked tool spans; prompts of %d responses), the framework's own function ("eager") against \
rl_triton's drop-in with its signature (`rl_triton.integrations.<framework>`) and, for the KL \
estimators and the policy losses, `torch.compile` of the framework's function (mode default, \
static shapes). Estimators and rollout correction: forward; KL and policy losses: forward plus d \
log_probs. Every result was checked against eager's before it was timed.

Columns: rl_triton µs: device (L2 flushed, the GPU held) / full call / host, medians; eager µs, \
compile µs: full call (a framework call slower than %.0f ms: one warm-up and the median of up to \
%d calls); vs eager, vs compile: their full call over rl_triton's (device times' ratio in \
brackets where both were measured); err: outputs' (gradients') relative error against eager's; \
target: docs/benchmarks.md's (stated at 512x4096, shown at every shape): estimators >= %gx \
eager, policy losses >= %gx eager and >= %gx compile, rollout correction's op in %d launch."""


def _num(x, spec=".1f"):
    return format(x, spec) if report.measured(x) else ""


def _ratio(b, m, key):
    return b[key] / m[key] if b and m and report.measured(b[key]) and report.measured(m[key]) \
        else NAN


def llm_cells(rows) -> dict:
    """{(group, framework, call, variant, mode, shape): {impl: row}}, in the order run."""
    cells = {}
    for r in rows:
        cells.setdefault((r["group"], r["framework"], r["call"], r["variant"], r["mode"],
                          r["shape"]), {})[r["impl"]] = r
    return cells


def llm_targets(key, impl, c) -> list:
    """[(target, value, met)] of one rl_triton row; [] where PERFORMANCE states none (the KL
    estimators, the rollout-correction drop-ins). A policy loss whose compile failed has the
    eager target alone."""
    group, ours = key[0], c[impl]
    if impl == "rl_triton op":
        return [(f"{LAUNCHES} launch", ours["launches"], ours["launches"] == LAUNCHES)]
    if impl != "rl_triton":
        return []
    e = _ratio(c.get("eager"), ours, "full_us")
    if group == "estimator":
        return [(f">= {ESTIMATOR_SPEEDUP:g}x eager", e, e >= ESTIMATOR_SPEEDUP)]
    if group != "policy loss":
        return []
    k = _ratio(c.get("compile"), ours, "full_us")
    return [(f">= {LOSS_EAGER:g}x eager", e, e >= LOSS_EAGER)] + (
        [(f">= {LOSS_COMPILE:g}x compile", k, k >= LOSS_COMPILE)] if report.measured(k) else [])


def llm_markdown(result) -> str:
    """bench.md of the LLM zoo suite: one line per rl_triton row, then the targets met."""
    cells = llm_cells(result["rows"])
    lines = [report.env_line(result["env"]), "",
             LLM_TABLE % (GROUP, FAST_US / 1e3, registry.FRAMEWORK_CALLS_TIMED,
                          ESTIMATOR_SPEEDUP, LOSS_EAGER, LOSS_COMPILE, LAUNCHES), "",
             "| group | framework | call | variant | mode | shape | impl | rl_triton µs | "
             "eager µs | vs eager | compile µs | vs compile | err | target | met | note |",
             "|---" * 16 + "|"]
    targets = {}
    for key, c in cells.items():
        eager, comp = c.get("eager"), c.get("compile")
        for impl in ("rl_triton", "rl_triton op"):
            ours = c.get(impl)
            if ours is None:
                continue
            ts = llm_targets(key, impl, c) if report.measured(ours["full_us"]) else []
            for t in ts:
                targets.setdefault((t[0], key[5]), []).append((t[1], t[2], key))

            def vs(b):
                d = _ratio(b, ours, "device_us")
                f = _ratio(b, ours, "full_us")
                return "" if not report.measured(f) else f"{f:.1f}x" + (
                    f" ({d:.1f}x)" if report.measured(d) else "")
            times = " / ".join(_num(ours[k]) for k in ("device_us", "full_us", "host_us")) \
                if report.measured(ours["full_us"]) else ""
            err = _num(ours["rel_err"], ".1e") + (
                f" ({ours['grad_rel_err']:.1e})" if report.measured(ours["grad_rel_err"]) else "")
            note = "; ".join(n for n in (eager and eager["note"], comp and comp["note"],
                                         ours["note"]) if n)
            target = "; ".join(t[0] for t in ts)
            met = "; ".join(("met" if t[2] else "missed") + (
                f" ({t[1]:.3g})" if report.measured(t[1]) else "") for t in ts)
            lines.append(
                f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {key[4]} | {key[5]} | {impl} | "
                f"{times} | {_num(eager and eager['full_us'])} | {vs(eager)} | "
                f"{_num(comp and comp['full_us'])} | {vs(comp)} | {err} | {target} | {met} | "
                f"{note} |")
    lines += ["", "The targets: rows that meet each, of those measured, and the lowest "
              "(launches: the highest):", "", "| target | shape | met | worst |", "|---" * 4 + "|"]
    for (name, shape), values in targets.items():
        measured = [v for v in values if report.measured(v[0])]
        if not measured:
            continue
        worst = (max if name.endswith("launch") else min)(measured, key=lambda v: v[0])
        lines.append(f"| {name} | {shape} | {sum(v[1] for v in measured)} of {len(measured)} | "
                     f"{worst[0]:.3g} ({worst[2][1]} {worst[2][2]} {worst[2][3]}".rstrip()
                     + ") |")
    return "\n".join(lines) + "\n"


def llm_plot(result, path):
    """llm.png: rl_triton's speed-up over eager (and compile) per call, full call, log scale, one
    panel per shape, the targets' thresholds drawn."""
    plt = report._pyplot()
    if plt is None:
        return
    cells = llm_cells(result["rows"])
    shapes = list(dict.fromkeys(k[5] for k in cells))
    if not shapes:
        return
    labels = list(dict.fromkeys(" ".join(p for p in (k[1], k[2], k[3]) if p) for k in cells))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 0.22 * len(labels) + 1.5),
                             squeeze=False, sharey=True)
    for ax, shape in zip(axes[0], shapes):
        for base, marker in (("eager", "o"), ("compile", "^")):
            points = []
            for k, c in cells.items():
                v = _ratio(c.get(base), c.get("rl_triton"), "full_us")
                if k[5] == shape and report.measured(v):
                    points.append((v, labels.index(" ".join(p for p in (k[1], k[2], k[3]) if p))))
            if points:
                ax.semilogx(*zip(*points), marker, ms=4, label=f"vs {base}")
        for threshold in (1.0, LOSS_EAGER, ESTIMATOR_SPEEDUP):
            ax.axvline(threshold, color="grey", lw=0.5, ls="--")
        ax.set_yticks(range(len(labels)), labels, fontsize=6)
        ax.invert_yaxis()
        ax.set_title(shape, fontsize=9)
        ax.set_xlabel("speed-up of rl_triton, full call")
    if axes[0][0].get_legend_handles_labels()[0]:
        axes[0][0].legend(fontsize=7)
    report._save(fig, f"LLM zoo on {result['env']['gpu']} ({result['env']['date']})", path)


report.RENDERERS["llm"] = (llm_markdown, llm_plot, "llm.png")
