"""`--suite tokens`: LLM token rows [B, T]. GAE and discounted returns on dense, padded,
multi-turn and packed rows (with and without their mask) against the unmasked call and the
same-bytes copy, verl's and OpenRLHF's own token loops beside rl_triton's drop-ins,
masked_whiten and group_advantages."""
from __future__ import annotations

import functools
import importlib
import importlib.util
import time
import types

import torch

import rl_triton
from rl_triton import reference, testing

from .. import registry, report, timing
from ..calls import call_of
from ..checks import check_result, float64_result, rel_err
from ..registry import FRAMEWORK_CALLS, FRAMEWORK_CALLS_TIMED, GROUPS, TOKEN_PARAMS
from ..report import TokenRow


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
    nbytes = (sum(t.numel() * t.element_size() for t in reads)
              + registry.n_out(name, kw) * r.numel() * 4)
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
            yield (name, kind, call_of(getattr(rl_triton, name), kw), rows["rewards"].numel(),
                   nbytes, ref)
        if kind == "multi-turn":  # x read, the mask read, float32 written
            x, m = rows["values"], rows["mask"]
            yield ("masked_whiten", kind, call_of(rl_triton.masked_whiten, dict(x=x, mask=m)),
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
        yield (kind, call_of(rl_triton.group_advantages, dict(scores=s, **kw)),
               8 * n + 8 * n * (kind == "group_index"), (group_float64(s, kw),))


def group_float64(scores, kw):
    """group_advantages of `scores` through the torch backend in float64, as `float64_result`
    (reference's loop over 8192 groups takes 20 s)."""
    return rl_triton.group_advantages(scores.double(), **kw, backend="torch",
                                      out_dtype=torch.float64)


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
        full = timing.full_call_us(fn, calls=n, warmup=0) if n else None
        self.per_step[name] = (warm if full is None else full * 1e-6) / T
        self.left -= time.perf_counter() - t0
        return full, out


def run_tokens(shapes, dtypes, env, device, out, max_seconds, frameworks_seconds):
    """`--suite tokens`: for every shape (B responses x T tokens) and input dtype, the calls of
    `token_cells`, checked against float64 and timed (device, full call, host) against the
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
              f"{row.impl:9s} {row.device_us:9.1f} us dev {row.full_us:11.1f} us full "
              f"{row.host_us:9.1f} us host{vs_copy}" + (f"  ({row.note})" if row.note else ""),
              flush=True)

    def timed(f):  # device, full call and host
        return timing.device_full_host_us(f, hold_cycles=timing._HOLD_CYCLES_GRAD)

    for i, (what, shape, dt), tag in timing.within_seconds(configs, max_seconds):
        if what == "tokens":
            B, T = registry.parse_shape(shape)
            for call, kind, f, tokens, nbytes, ref in token_cells(B, T, registry.DTYPES[dt],
                                                                  device,
                                                                  seed=shapes.index(shape)):
                err = rel_err(f(), ref, 0)
                check_result(err, 1e-5, f"{call} {shape} {dt} {kind}")
                dev, full, host = timed(f)
                add(TokenRow(call, shape, dt, kind, "rl_triton", tokens, nbytes, dev, full,
                             timing.same_bytes_copy_us(nbytes, device), err, host_us=host))
        elif what == "loops":
            B, T = registry.parse_shape(shape)
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
                    full, host = timing.call_times_us(mine)
                    add(TokenRow(name, shape, dt, "multi-turn", "drop-in", B * T, 0,
                                 float("nan"), full, rel_err=err, host_us=host))
        else:
            for kind, f, nbytes, ref in group_cells(device):
                err = rel_err(f(), ref, 0)
                check_result(err, 1e-5, f"group_advantages {kind}")
                dev, full, host = timed(f)
                add(TokenRow("group_advantages", shape, dt, kind, "rl_triton", GROUPS[0],
                             nbytes, dev, full, rel_err=err, host_us=host))
        # after every configuration, so that a run cut short keeps what it measured
        report.save_json(out, env, rows, "tokens")
    report.write_saved_reports(out)
