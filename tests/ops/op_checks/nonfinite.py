"""Float flags and non-finite inputs (semantics §1, "Flags" and "Non-finite inputs"), checks
shared by the ops (run in each op's module, tests/ops/test_<op>.py), on every backend, in both
layouts, at small odd shapes, through the public functions.

A flag is set wherever it is nonzero, whatever its dtype. A NaN or inf reaches only the outputs
that depend on it through the formula and never crosses an episode boundary: a cut is a select,
not a multiplication by zero (0 * inf is NaN), so the outputs of the steps before a boundary are
those of the same call with the bad value replaced by a finite one, bit for bit. A NaN ratio or
probability gives NaN (it is never clipped into a finite number), and every backend gives the same
NaN pattern.
"""
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
import torch

import rl_triton
from rl_triton._core import plans as _plans
from rl_triton.scan import tiles as tiles_rule
from rl_triton.testing import make_inputs, make_packed_inputs
from cases import BACKENDS, FLAGGED, Case, make_case, per_op

# numpy's warnings on inf - inf and 0 * inf in Triton's interpreter
# (a mark on each check: a module's pytestmark does not go with the checks it installs)
INTERPRETER_WARNINGS = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

LAYOUTS = ["time-major", "batch-major"]
SHAPES = [(1, 1), (1, 5), (7, 1), (7, 5), (37, 1), (37, 5)]
FLAG_NAMES = ("terminated", "truncated", "dones")


def clone(case: Case) -> Case:
    copy = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.steps.items()}
    extra = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.extra.items()}
    return Case(case.name, case.fn, case.ref, copy, extra)


# --- 1. Float flags are set wherever they are nonzero -------------------------------------------

@INTERPRETER_WARNINGS
@per_op("name", FLAGGED)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("T,N", SHAPES)
def test_float_flags_are_set_where_nonzero(name, backend, layout, T, N, device):
    """Flags given as float 0.5, 2.0 or -1.0 behave exactly as True (and 0.0 as False): the same
    outputs, bit for bit, as the call with bool flags."""
    case = make_case(name, T, (N,), device=device, seed=T * 10 + N)
    t = torch.arange(T)[:, None]
    n = torch.arange(N)[None, :]
    patterns = {"terminated": (3 * t + n) % 4 == 0, "truncated": (t + 2 * n) % 3 == 1,
                "dones": (t + n) % 3 == 0}
    dtype = (torch.float32, torch.float16, torch.float64)[SHAPES.index((T, N)) % 3]
    weights = torch.tensor([0.5, 2.0, -1.0], dtype=dtype)[(t + n) % 3]
    floats = clone(case)
    for key in FLAG_NAMES:
        if case.steps.get(key) is not None:
            case.steps[key] = patterns[key].to(device)
            floats.steps[key] = torch.where(patterns[key], weights, 0.0).to(dtype).to(device)
    assert any(floats.steps[k].abs().max() > 0 for k in FLAG_NAMES if k in floats.steps
               and floats.steps[k] is not None)
    want = case.call(layout, backend=backend)
    got = floats.call(layout, backend=backend)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), (i, g, w)


# --- 2. Non-finite inputs stay in their episode; every backend gives the same pattern ----------

# Where a bad value in slot j of an input is read, besides the trace through the recurrence:
#   own:   by step j only;
#   succ:  by step j - 1 too, as a successor (v'[j-1], E[j-1], Q(s_j, a_j)): dropped at a
#          termination at j - 1, used at a truncation there;
#   trace: by step j - 1 too, through its trace only (c[j], vs[j]): dropped at any cut at j - 1;
#   boot:  a bootstrap (slot T), read by step T - 1 as its successor;
#   init:  a forward scan's initial value (slot -1).
# (estimator, bootstrap of the case, [(input, role), ...])
GROUPS = [
    ("gae", "last_value", [("rewards", "own"), ("values", "succ"), ("last_value", "boot")]),
    ("gae", "next_values", [("next_values", "own"), ("values", "own")]),
    ("lambda_returns", "last_value",
     [("rewards", "own"), ("values", "succ"), ("last_value", "boot")]),
    ("lambda_returns", "next_values", [("next_values", "own")]),
    ("discounted_returns", "last_value", [("rewards", "own"), ("last_value", "boot")]),
    ("discounted_returns", "next_values", [("next_values", "own")]),
    ("vtrace", "last_value", [("rewards", "own"), ("values", "succ"), ("last_value", "boot"),
                              ("target_log_probs", "own"), ("behavior_log_probs", "own")]),
    ("vtrace", "next_values", [("next_values", "own"), ("values", "trace")]),
    ("retrace", "last_value", [("rewards", "own"), ("q_values", "succ"),
                               ("target_probs", "succ"), ("behavior_probs", "trace"),
                               ("last_q_values", "boot"), ("last_target_probs", "boot")]),
    ("linear_scan_reverse", "last_value", [("alpha", "own"), ("beta", "own"), ("initial", "boot")]),
    ("eligibility_traces", "last_value", [("x", "own"), ("initial", "init")]),
    ("episodic_cumsum", "last_value", [("x", "own"), ("initial", "init")]),
    ("linear_scan_forward", "last_value", [("alpha", "own"), ("beta", "own"), ("initial", "init")]),
]
GROUP_IDS = [f"{name}-{boot}" for name, boot, _ in GROUPS]
VALUES = (math.inf, math.nan, -math.inf)
KINDS = ("terminated", "truncated")


def spoil(case: Case, name: str, rows, T: int):
    """The case with one bad value in each row n: rows[n] = (input, role, combo), the combo
    choosing the value (inf, NaN, -inf) and the boundary (termination or truncation), which is
    set in the same place in the clean case. Returns (clean, bad, safe), safe[t, n] marking the
    steps that must not see the bad value."""
    clean, bad = clone(case), clone(case)
    safe = torch.zeros(T, len(rows), dtype=torch.bool)
    forward = name in ("eligibility_traces", "episodic_cumsum", "linear_scan_forward")
    for n, (inp, role, c) in enumerate(rows):
        kind = KINDS[(c // 3) % 2]
        value = math.nan if inp == "beta" else VALUES[c % 3]  # inf betas: see the report
        if not forward:
            if role == "boot":
                j, k = T, T - 1 - (kind == "truncated")
            else:
                k = T // 3 + n % 2
                j = k + (2 if role == "succ" and kind == "truncated" else 1)
                if j > T - 1:
                    j, k = T - 1, -1
            if k >= 0:
                for x in (clean, bad):
                    boundary(x, name, kind, k, n)
                safe[:k + 1, n] = True
        else:
            j = -1 if role == "init" else min(T - 1, T // 3 + n % 2)
            m = j + 1 + (kind == "truncated")  # the first step that must not see it
            if name != "linear_scan_forward":
                m = max(m, 1)
            if m <= T - 1:
                for x in (clean, bad):
                    boundary(x, name, kind, m, n)
                safe[m:, n] = True
        put(bad, inp, j, n, value)
    return clean, bad, safe


def boundary(case: Case, name: str, kind: str, k: int, n: int):
    """A boundary in row n: a termination or truncation at step k (reverse estimators), a done at
    step k - 1 (forward ones: step k starts afresh), or beta = 0 at step k (linear scans)."""
    s = case.steps
    if name.startswith("linear_scan"):
        s["beta"][k, n] = 0.0
    elif "dones" in s:
        s["dones"][k - 1, n] = True
    elif kind == "terminated":
        s["terminated"][k, n] = True
    else:
        s["terminated"][k, n] = False
        s["truncated"][k, n] = True


def put(case: Case, inp: str, j: int, n: int, value: float):
    x = case.steps.get(inp)
    if x is not None:
        if x.ndim == 3:  # [T, N, A]: the entry of the action taken at step j
            x[j, n, case.steps["actions"][j, n]] = value
        else:
            x[j, n] = value
    else:
        x = case.extra[inp]
        if x.ndim == 2:  # [N, A]
            x[n, 0] = value
        else:
            x[n] = value


def check(clean: Case, bad: Case, safe, layout, backends=BACKENDS, tiles=None):
    """Each backend: the safe steps finite and equal to the clean call's; then the same NaN and inf
    pattern on every backend. `tiles`: tile overrides for the Triton backend."""
    patterns = {}
    for backend in backends:
        if backend == "triton" and tiles is not None:
            _plans._PLANS.clear()
            with tiles_rule.override(**tiles):
                got, want = bad.call(layout, backend=backend), clean.call(layout, backend=backend)
            _plans._PLANS.clear()
        else:
            got, want = bad.call(layout, backend=backend), clean.call(layout, backend=backend)
        for i, (g, w) in enumerate(zip(got, want)):
            g, w = g.cpu(), w.cpu()
            assert torch.isfinite(g[safe]).all(), (backend, i, g, safe)
            assert torch.equal(g[safe], w[safe]), (backend, i, g, w, safe)
        patterns[backend] = [(torch.isnan(g.cpu()), torch.isposinf(g.cpu()),
                              torch.isneginf(g.cpu())) for g in got]
    first = backends[0]
    for backend in backends[1:]:
        for i, (p, q) in enumerate(zip(patterns[first], patterns[backend])):
            for what, a, b in zip(("NaN", "+inf", "-inf"), p, q):
                assert torch.equal(a, b), f"output {i}: {what} on {first}\n{a}\non {backend}\n{b}"


MAIN_SHAPES = [(1, 5), (7, 1), (7, 5), (37, 5)]


@INTERPRETER_WARNINGS
@per_op("name,bootstrap,inputs", GROUPS, ids=GROUP_IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("T,N", MAIN_SHAPES)
def test_non_finite_inputs_stay_in_their_episode(name, bootstrap, inputs, layout, T, N, device):
    """inf, NaN or -inf in one input of one step (or a bootstrap) per row, the inputs taking the
    rows in turn, after a termination or truncation (reverse scans: GAE, TD(lambda), returns,
    V-trace, Retrace, linear_scan with beta = 0) or before a done (forward scans): the steps on
    the other side are finite and unchanged, and every backend gives the same NaN / inf pattern
    everywhere."""
    case = make_case(name, T, (N,), device=device, seed=T + N, bootstrap=bootstrap)
    i0 = MAIN_SHAPES.index((T, N)) + LAYOUTS.index(layout)
    rows = [(*inputs[(n + i0) % len(inputs)], n + 2 * i0) for n in range(N)]
    clean, bad, safe = spoil(case, name, rows, T)
    check(clean, bad, safe, layout)


SPLITS = [("look-back, sub-tiles", "time-major",
           dict(block_t=16, block_b=2, walk=False, window=2, sub=4)),
          ("look-back", "batch-major", dict(block_t=16, block_b=2, walk=False, window=1)),
          ("walk", "batch-major", dict(block_t=16, block_b=2, walk=True))]


@INTERPRETER_WARNINGS
@per_op("name,bootstrap,inputs", GROUPS, ids=GROUP_IDS)
@pytest.mark.parametrize("split,layout,tiles", SPLITS, ids=[f"{s}-{l}" for s, l, _ in SPLITS])
def test_non_finite_inputs_across_tiles(name, bootstrap, inputs, split, layout, tiles, device):
    """Rows of 47 steps in tiles of 16, the boundaries at steps 15-16 and the bad values just
    past them, in the next tile: carried by look-back (time-major tiles in 4 sub-tiles), or by
    walking the rows, the Triton kernels keep the boundaries as the loop does."""
    T, N = 47, len(inputs)
    case = make_case(name, T, (N,), device=device, seed=3, bootstrap=bootstrap)
    i0 = [s for s, _, _ in SPLITS].index(split)
    rows = [(*inputs[n], 2 * n + i0) for n in range(N)]
    clean, bad, safe = spoil(case, name, rows, T)
    check(clean, bad, safe, layout, backends=["loop", "triton"], tiles=tiles)


# --- 3. NaN ratios and probabilities give NaN (tests/ops/test_vtrace.py, test_retrace.py) -------

def quiet(case: Case):
    """No flags: every step is in one episode."""
    for key in FLAG_NAMES:
        if case.steps.get(key) is not None:
            case.steps[key] = torch.zeros_like(case.steps[key])


# --- 5. What a mask, a clamp or a zero probability removes reaches nothing ------------------------
#
# Wherever a mask (estimators, semantics §7; losses, group advantages and whitening, semantics §8
# and 9), a clamp that binds (KL penalties, PPO's log-ratio clamp, CRR's max_weight), a zero
# probability or a termination (SAC's discrete expectation and its bootstrap) removes a position, a
# NaN or an inf put there reaches neither an output nor a gradient: the outputs are those of the
# call with a finite filler there, bit for bit, and so are the gradients of every differentiable
# input, finite, and 0 at the removed positions. (The torch backend is where a NaN leaks most
# easily: 0 * NaN in the backward of a product whose result a select dropped.)

@dataclass
class Removal:
    """One call of an op. `run(inputs, backend)` returns its outputs (a tuple); `inputs` are
    the floating tensors the sweep puts values into (finite: the clean call's), `diff` those
    that get gradients, `removed[name]` where the call drops input `name` (the sweep's targets:
    its keys); `values[name]` the non-finite values it is tried with there (all three by
    default: what a clamp removes depends on the sign) and `filler(name, value)` the finite
    value the clean call has at those positions (None: the random inputs' own)."""
    run: Callable
    inputs: dict
    diff: tuple
    removed: dict
    values: dict = field(default_factory=dict)
    filler: Optional[Callable] = None


NONFINITE = {"nan": math.nan, "+inf": math.inf, "-inf": -math.inf}
INFS = ("+inf", "-inf")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _mask(shape, seed, device, p=0.6):
    """A mask with some positions set and some not in every row."""
    m = torch.rand(shape, generator=_gen(seed)) < p
    m.view(-1, shape[-1])[:, 0] = True
    m.view(-1, shape[-1])[:, 1] = False
    return m.to(device)


def _pattern(shape, device):
    """Every third position, for the clamps."""
    return (torch.arange(math.prod(shape)) % 3 == 1).view(shape).to(device)


ESTIMATOR_SWEEP = [("gae", "last_value"), ("gae", "next_values"),
                   ("lambda_returns", "last_value"), ("lambda_returns", "next_values"),
                   ("discounted_returns", "last_value"), ("discounted_returns", "next_values"),
                   ("vtrace", "last_value"), ("vtrace", "next_values"),
                   ("retrace", "last_value"), ("eligibility_traces", "last_value"),
                   ("episodic_cumsum", "last_value")]
LENGTHS = [4, 0, 7, 1, 5]  # packed rows: five segments, one empty, one of one step


def estimator_removal(name, bootstrap, packed, device):
    """A masked call of estimator `name` on [7, 3] rows (eligibility traces: of 2-vectors), or
    on packed rows with a mask: the masked steps of every per-step input are removed."""
    kw = dict(device=device, seed=5, bootstrap=bootstrap, p_term=0.15, p_trunc=0.15)
    if name == "eligibility_traces":
        kw["features"] = (2,)
    if packed:
        steps, extra, cu = make_packed_inputs(name, LENGTHS, **kw)
        extra["cu_seqlens"] = cu
    else:
        steps, extra = make_inputs(name, 7, (3,), **kw)
    flag = steps.get("terminated", steps.get("dones"))
    m = _mask(tuple(flag.shape) if not packed else (1, flag.shape[0]), 6, device)
    m = m.view(flag.shape)
    floats = {k: v for k, v in {**steps, **extra}.items()
              if isinstance(v, torch.Tensor) and v.is_floating_point() and k not in FLAG_NAMES}
    removed = {k: (~m).view(m.shape + (1,) * (floats[k].ndim - m.ndim)).expand(floats[k].shape)
               for k in steps if k in floats}

    def run(inputs, backend):
        args = {**steps, **extra, **inputs}
        out = getattr(rl_triton, name)(**args, mask=m, backend=backend)
        return out if isinstance(out, tuple) else (out,)

    return Removal(run, floats, tuple(floats), removed)


def ppo_removal(kind, device):
    shape = (21,) if kind == "packed" else (3, 7)
    lp = 0.3 * torch.randn(shape, generator=_gen(1))
    inputs = dict(log_probs=lp, old_log_probs=lp + 0.4 * torch.randn(shape, generator=_gen(2)),
                  advantages=torch.randn(shape, generator=_gen(3)))
    inputs = {k: v.to(device) for k, v in inputs.items()}
    opts, mask = {}, None
    if kind == "clamp":  # log-ratios beyond +-2: the clamp binds
        opts = dict(log_ratio_clamp=2.0, aggregation="sum")
        where = _pattern(shape, device)
        removed = {"log_probs": where, "old_log_probs": where}
    else:
        mask = _mask(shape if kind != "packed" else (1, 21), 7, device).view(shape)
        opts = {"mask": dict(aggregation="token-mean"),
                "dual": dict(dual_clip=3.0, clip_high=0.3, aggregation="seq-mean-token-mean"),
                "packed": dict(aggregation="seq-mean-token-sum",
                               cu_seqlens=torch.tensor([0, 5, 5, 12, 14, 21], device=device))}[kind]
        removed = {k: ~mask for k in inputs}

    def run(x, backend):
        return rl_triton.ppo_policy_loss(x["log_probs"], x["old_log_probs"], x["advantages"],
                                         mask, **opts, backend=backend)

    values = {k: INFS for k in removed} if kind == "clamp" else {}
    return Removal(run, inputs, tuple(inputs), removed, values,
                   (lambda name, v: math.copysign(10.0, v)) if kind == "clamp" else None)


def value_removal(kind, device):
    shape = (21,) if kind == "packed" else (3, 7)
    inputs = {k: torch.randn(shape, generator=_gen(i + 10)).to(device)
              for i, k in enumerate(("values", "returns", "old_values"))}
    mask = _mask(shape if kind != "packed" else (1, 21), 8, device).view(shape)
    opts = {"mse": dict(aggregation="seq-mean-token-mean"),
            "clip": dict(clip=0.2, kind="huber", huber_delta=0.5, aggregation="none"),
            "packed": dict(clip=0.2, aggregation="seq-mean-token-sum",
                           cu_seqlens=torch.tensor([0, 5, 5, 12, 14, 21], device=device))}[kind]
    if kind == "mse":
        del inputs["old_values"]

    def run(x, backend):
        return (rl_triton.value_loss(x["values"], x["returns"], x.get("old_values"), mask,
                                     **opts, backend=backend),)

    return Removal(run, inputs, tuple(inputs), {k: ~mask for k in inputs})


def kl_removal(kind, device):
    """Log-ratios of +-inf (the filler: +-30) where k(d) is beyond the clamp, every kind."""
    shape = (3, 7)
    inputs = {"log_probs": torch.randn(shape, generator=_gen(20)).to(device),
              "ref_log_probs": torch.randn(shape, generator=_gen(21)).to(device)}
    where = _pattern(shape, device)

    def run(x, backend):
        return (rl_triton.kl_penalty(x["log_probs"], x["ref_log_probs"], kind, clamp=10.0,
                                     backend=backend),)

    return Removal(run, inputs, tuple(inputs), {k: where for k in inputs},
                   {k: INFS for k in inputs}, lambda name, v: math.copysign(30.0, v))


def sac_removal(kind, device):
    """Discrete actions of probability 0 (`zero-prob`), or the next state of a terminal step
    (`terminal`, continuous or discrete actions)."""
    N, A, K = 7, 5, 2
    discrete = kind != "terminal-continuous"
    g = _gen(30)
    term = torch.tensor([0, 1, 0, 0, 1, 0, 0], dtype=torch.bool)
    if discrete:
        probs = torch.softmax(torch.randn(N, A, generator=g), -1)
        zero = _pattern((N, A), "cpu") | (torch.arange(A) == 3)
        probs = torch.where(zero, 0.0, probs)
        probs = probs / probs.sum(-1, keepdim=True)
        inputs = dict(rewards=torch.randn(N, generator=g),
                      next_q_values=torch.randn(N, A, K, generator=g),
                      next_log_probs=torch.where(zero, -5.0, probs.log()), next_probs=probs)
    else:
        inputs = dict(rewards=torch.randn(N, generator=g),
                      next_q_values=torch.randn(N, K, generator=g),
                      next_log_probs=torch.randn(N, generator=g))
    inputs["alpha"] = torch.tensor(0.3)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    term = term.to(device)
    if kind == "zero-prob":
        zero = zero.to(device)
        removed = {"next_q_values": zero[..., None].expand(N, A, K), "next_log_probs": zero}
    else:
        removed = {k: term.view((N,) + (1,) * (inputs[k].ndim - 1)).expand(inputs[k].shape)
                   for k in ("next_q_values", "next_log_probs", "next_probs") if k in inputs}

    def run(x, backend):
        return (rl_triton.sac_targets(x["rewards"], term, x["next_q_values"], x["next_log_probs"],
                                      gamma=0.9, alpha=x["alpha"], next_probs=x.get("next_probs"),
                                      backend=backend),)

    return Removal(run, inputs, tuple(inputs), removed)


def crr_removal(device):
    """Advantages of +inf (q_values +inf, or a sampled value -inf under the mean): the weight
    is max_weight, whatever lies beyond (the filler: q 50, a sampled value -100)."""
    g = _gen(40)
    inputs = {"q_values": torch.randn(7, generator=g).to(device),
              "sampled_q_values": torch.randn(7, 4, generator=g).to(device)}
    rows = _pattern((7,), device)
    first = torch.zeros(7, 4, dtype=torch.bool, device=device)
    first[:, 0] = rows

    def run(x, backend):
        return (rl_triton.crr_weights(x["q_values"], x["sampled_q_values"], beta=1.0,
                                      max_weight=20.0, backend=backend),)

    return Removal(run, inputs, (), {"q_values": rows, "sampled_q_values": first},
                   {"q_values": ("+inf",), "sampled_q_values": ("-inf",)},
                   lambda name, v: 50.0 if name == "q_values" else -100.0)


def whiten_removal(shift_mean, device):
    x = (3.0 * torch.randn(5, 37, generator=_gen(50)) + 2.0).to(device)
    mask = _mask((5, 37), 51, device)

    def run(inputs, backend):
        return (rl_triton.masked_whiten(inputs["x"], mask, shift_mean=shift_mean,
                                        backend=backend),)

    return Removal(run, {"x": x}, ("x",), {"x": ~mask})


def group_removal(by, device):
    """Response 3 alone in its group (baseline 0, scale 1) and masked out entirely: its score
    reaches nothing. `by`: group ids, or group_size=1 (the Triton kernel's path)."""
    scores = torch.randn(6, generator=_gen(60)).to(device)
    mask = _mask((6, 5), 61, device)
    mask[3] = False
    kw = (dict(group_index=torch.tensor([0, 0, 1, 2, 1, 0], device=device)) if by == "index"
          else dict(group_size=1))

    def run(x, backend):
        return (rl_triton.group_advantages(x["scores"], **kw, mask=mask, backend=backend),)

    removed = torch.zeros(6, dtype=torch.bool, device=device)
    removed[3] = True
    return Removal(run, {"scores": scores}, ("scores",), {"scores": removed})


REMOVALS = {
    **{f"{name}-{boot}-{'packed' if packed else 'mask'}":
       (lambda device, a=name, b=boot, p=packed: estimator_removal(a, b, p, device))
       for name, boot in ESTIMATOR_SWEEP for packed in (False, True)},
    **{f"group_advantages-{by}": (lambda device, b=by: group_removal(b, device))
       for by in ("index", "size1")},
    **{f"masked_whiten-shift_mean={s}": (lambda device, s=s: whiten_removal(s, device))
       for s in (True, False)},
    **{f"ppo_policy_loss-{k}": (lambda device, k=k: ppo_removal(k, device))
       for k in ("mask", "dual", "packed", "clamp")},
    **{f"value_loss-{k}": (lambda device, k=k: value_removal(k, device)) for k in ("mse", "clip", "packed")},
    **{f"kl_penalty-{k}": (lambda device, k=k: kl_removal(k, device))
       for k in ("k1", "abs", "k2", "k3")},
    **{f"sac_targets-{k}": (lambda device, k=k: sac_removal(k, device))
       for k in ("zero-prob", "terminal-discrete", "terminal-continuous")},
    "crr_weights-max_weight": crr_removal,
}


def _sweep_cases():
    cases = []
    for label, build in REMOVALS.items():
        r = build("cpu")
        for name in r.removed:
            for value in r.values.get(name, tuple(NONFINITE)):
                cases.append((label, name, value))
    return cases


SWEEP = _sweep_cases()


def _outputs_and_grads(r: Removal, inputs: dict, backend: str):
    leaves = {k: v.clone().requires_grad_(k in r.diff) for k, v in inputs.items()}
    outs = r.run(leaves, backend)
    live = [o for o in outs if o.requires_grad]
    grads = {}
    if live and r.diff:
        total = sum((o.double() * torch.randn(o.shape, generator=_gen(i), dtype=torch.float64)
                     .to(o.device)).sum() for i, o in enumerate(live))
        found = torch.autograd.grad(total, [leaves[k] for k in r.diff], allow_unused=True)
        grads = {k: torch.zeros_like(inputs[k]) if d is None else d
                 for k, d in zip(r.diff, found)}
    return [o.detach() for o in outs], grads


@pytest.mark.parametrize("backend", BACKENDS)
@INTERPRETER_WARNINGS
@per_op("label,target,value", SWEEP, ids=["-".join(c) for c in SWEEP],
        op=lambda row: row[0].split("-")[0])  # the label names its op
def test_removed_positions_reach_nothing(label, target, value, backend, device):
    """A NaN, +inf or -inf at the positions of `target` that the call removes (a mask, a clamp
    that binds, a zero probability, a termination): the outputs of the call with a finite value
    there, bit for bit, without gradients (the Triton kernels, masked ones included) and with;
    every gradient finite, equal to the clean call's, and 0 at the removed positions."""
    r = REMOVALS[label](device)
    v = NONFINITE[value]
    where = r.removed[target]
    clean = dict(r.inputs)
    fill = r.filler(target, v) if r.filler is not None else None
    if fill is not None:
        clean[target] = clean[target].masked_fill(where, fill)
    dirty = dict(clean, **{target: clean[target].masked_fill(where, v)})
    with torch.no_grad():
        want, got = r.run(clean, backend), r.run(dirty, backend)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.isfinite(w).all(), (i, w)
        assert torch.equal(g, w), (f"output {i} without gradients", g, w)
    want, want_grads = _outputs_and_grads(r, clean, backend)
    got, got_grads = _outputs_and_grads(r, dirty, backend)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), (f"output {i}", g, w)
    for name, w in want_grads.items():
        g = got_grads[name]
        assert torch.isfinite(g).all(), (name, g)
        assert torch.equal(g, w), (name, g, w)
        if name in r.removed:
            assert (g[r.removed[name]] == 0).all(), (name, g)
