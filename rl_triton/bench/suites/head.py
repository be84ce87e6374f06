"""`--suite head`: the fused loss head (semantics §11) at an LLM's shape: forward plus backward of
a clipped token-mean loss from hidden states and the LM head, bf16, H x V = 4096 x 151936 (a Qwen
vocabulary) at L = 4096, 16384 and 32768 tokens. For each implementation: the time of one call
(forward and backward, synchronized; median of a few after a warm-up) and the peak memory beyond
the inputs and their gradients (`torch.cuda.max_memory_allocated` after a reset, less what the
inputs and the gradients hold). Implementations: rl_triton's `linear_policy_loss`, and
`token_log_probs` followed by `ppo_policy_loss` (the composition any loss can use); eager PyTorch
(logits, float32 log_softmax, gather, the loss), `torch.compile` of the same function, and
Liger-Kernel's `LigerFusedLinearGRPOLoss` (loss_type "bnpo": the same token mean) where
`liger_kernel` imports ("not available" otherwise); plus plain `torch.matmul` of the three
matmul shapes (forward logits, d hidden, d weight), whose rate bounds any implementation's.
Every implementation's loss and gradients are compared with rl_triton's before it is timed."""
from __future__ import annotations

import statistics
import time

import torch

import rl_triton

from .. import report

HEAD_H, HEAD_V = 4096, 151936
HEAD_TOKENS = [4096, 16384, 32768]
HEAD_ROW = 1024  # tokens per response: Liger's inputs are [B, T] rows with one advantage each
HEAD_CALLS, HEAD_WARMUP = 3, 1  # a call takes 0.05-2 s at these shapes
# bf16 logits (eager, compile) against float32 logits (ours): the log-probabilities differ by
# the rounding of logits of magnitude ~3, a few 1e-3; a wrong gradient is off by O(1)
HEAD_LOSS_TOL, HEAD_GRAD_TOL = 2e-2, 5e-2
CLIP = 0.2


def head_inputs(L, device, H=HEAD_H, V=HEAD_V, seed=0, dtype=torch.bfloat16):
    """hidden [L, H], weight [V, H] (logits ~ N(0, 1)), labels, old log-probabilities near the
    policy's (ratios exp(N(0, 0.3)): some past each clip), one advantage per row of HEAD_ROW
    tokens, and a mask with the last tenth of each row off (padding)."""
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(L, H, generator=g, device=device).to(dtype)
    weight = (torch.randn(V, H, generator=g, device=device) * H ** -0.5).to(dtype)
    labels = torch.randint(0, V, (L,), generator=g, device=device)
    with torch.no_grad():
        lp = rl_triton.token_log_probs(hidden, weight, labels)
    old = lp + 0.3 * torch.randn(L, generator=g, device=device)
    rows = max(1, L // HEAD_ROW)
    adv = torch.randn(rows, generator=g, device=device)
    advantages = adv.repeat_interleave(L // rows)
    mask = (torch.arange(L, device=device) % (L // rows)) < 0.9 * (L // rows)
    return dict(hidden=hidden, weight=weight, labels=labels, old_log_probs=old,
                advantages=advantages, mask=mask, row_advantages=adv)


def eager_loss(hidden, weight, labels, old_log_probs, advantages, mask):
    """The unfused composition, as a user writes it: [L, V] logits."""
    logits = hidden @ weight.T
    lp = logits.float().log_softmax(-1).gather(-1, labels[:, None]).squeeze(-1)
    ratio = (lp - old_log_probs).clamp(-20.0, 20.0).exp()
    l = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - CLIP, 1 + CLIP))
    return torch.where(mask, l, 0.0).sum() / mask.sum().clamp_min(1)


def ours_loss(hidden, weight, labels, old_log_probs, advantages, mask):
    return rl_triton.linear_policy_loss(hidden, weight, labels, old_log_probs, advantages, mask,
                                        clip_low=CLIP)[0]


def composed_loss(hidden, weight, labels, old_log_probs, advantages, mask):
    """`token_log_probs` then `ppo_policy_loss`: the route of any loss on the log-probabilities
    (four matmuls: its backward recomputes the logits)."""
    lp = rl_triton.token_log_probs(hidden, weight, labels)
    return rl_triton.ppo_policy_loss(lp, old_log_probs, advantages, mask, clip_low=CLIP)[0]


def liger_module():
    """Liger-Kernel's fused GRPO loss, or None where liger_kernel does not import."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except Exception:  # noqa: BLE001 - absent or broken: reported as not available
        return None
    # token mean over the batch (bnpo), no KL, no reference model; chunk_size 1 (one row a
    # chunk) and compiled=False: its compiled path failed at L >= 16384 under torch 2.11
    return LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="bnpo",
                                    epsilon_low=CLIP, epsilon_high=CLIP, chunk_size=1,
                                    compiled=False)


def liger_loss_fn(module, rows):
    def fn(hidden, weight, labels, old_log_probs, advantages, mask):
        B = rows
        out = module(hidden.view(B, -1, hidden.shape[-1]), weight, labels.view(B, -1),
                     mask.view(B, -1).long(), advantages.view(B, -1)[:, 0],
                     old_per_token_logps=old_log_probs.view(B, -1))
        return out[0] if isinstance(out, tuple) else out
    return fn


def _time_call(fn, calls=HEAD_CALLS, warmup=HEAD_WARMUP):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _fwd_bwd(loss_fn, kw, leaves):
    def fn():
        for t in leaves:
            t.grad = None
        loss = loss_fn(**kw)
        loss.backward()
        return loss
    return fn


def _peak_extra_gib(fn, leaves):
    """Peak memory of one call beyond what was allocated before it (the inputs) and the
    gradients it leaves."""
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    grads = sum(t.grad.numel() * t.grad.element_size() for t in leaves if t.grad is not None)
    return (torch.cuda.max_memory_allocated() - before - grads) / 2**30


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def head_cells(L, device, seed=0):
    """The rows of one token count: (impl, ms, peak GiB, loss rel err, grad rel err, note)."""
    kw = head_inputs(L, device, seed=seed)
    adv_rows = kw.pop("row_advantages")
    hidden, weight = kw["hidden"].requires_grad_(), kw["weight"].requires_grad_()
    leaves = [hidden, weight]
    impls = {"rl_triton": ours_loss, "rl_triton token_log_probs + ppo_policy_loss": composed_loss,
             "eager": eager_loss,
             "compile": torch.compile(eager_loss, dynamic=False)}
    liger = liger_module()
    rows = []
    if liger is not None:
        impls["liger"] = liger_loss_fn(liger, len(adv_rows))
    else:
        rows.append(("liger", float("nan"), float("nan"), float("nan"), float("nan"),
                     "not available (liger_kernel does not import)"))
    ref = None
    for name, loss_fn in impls.items():
        fn = _fwd_bwd(loss_fn, kw, leaves)
        note = ""
        try:
            loss = fn()
            got = (loss.detach().float(), hidden.grad.clone(), weight.grad.clone())
            if ref is None:
                ref, err, gerr = got, 0.0, 0.0
            else:
                err = _rel(got[0], ref[0])
                gerr = max(_rel(got[1], ref[1]), _rel(got[2], ref[2]))
                if err > HEAD_LOSS_TOL or gerr > HEAD_GRAD_TOL:
                    note = f"differs from rl_triton (loss {err:.1e}, gradients {gerr:.1e})"
            del got, loss
            ms = _time_call(fn)
            peak = _peak_extra_gib(fn, leaves)
        except torch.OutOfMemoryError as e:
            ms = peak = err = gerr = float("nan")
            note = f"out of memory: {str(e).splitlines()[0][:80]}"
        for t in leaves:
            t.grad = None
        torch.cuda.empty_cache()
        rows.append((name, ms, peak, err, gerr, note))
    # the three matmuls alone, bf16, at torch.matmul's rate: the time floor
    h, w = hidden.detach(), weight.detach()
    dlogits = torch.empty(L, HEAD_V, dtype=h.dtype, device=device).normal_()
    mm = {"matmul fwd (hidden @ weight.T)": lambda: h @ w.T,
          "matmul d hidden (dlogits @ weight)": lambda: dlogits @ w,
          "matmul d weight (dlogits.T @ hidden)": lambda: dlogits.T @ h}
    flops = 2 * L * HEAD_H * HEAD_V
    for name, f in mm.items():
        ms = _time_call(f, calls=5, warmup=2)
        rows.append((name, ms, float("nan"), float("nan"), float("nan"),
                     f"{flops / ms / 1e9:.0f} TFLOP/s"))
    mm.clear()  # the lambdas hold dlogits ([L, V] bf16): freed before the next size
    torch.cuda.empty_cache()
    return rows


def head_markdown(env, results) -> str:
    lines = [f"Fused loss head (`--suite head`, semantics §11): forward + backward of a clipped "
             f"token-mean loss, bf16, H = {HEAD_H}, V = {HEAD_V}. {env}", "",
             "| tokens | implementation | ms | peak GiB beyond inputs and gradients | loss rel "
             "err | grad rel err | note |", "|---|---|---|---|---|---|---|"]
    for L, rows in results:
        for name, ms, peak, err, gerr, note in rows:
            lines.append(f"| {L} | {name} | {ms:.1f} | {peak:.2f} | {err:.1e} | {gerr:.1e} | "
                         f"{note} |")
    return "\n".join(lines) + "\n"


def head_rows(result):
    """[(tokens, rows)] of a bench.json of this suite."""
    out: dict = {}
    for r in result["rows"]:
        out.setdefault(r["tokens"], []).append((r["impl"], r["ms"], r["peak_gib"], r["rel_err"],
                                                r["grad_rel_err"], r["note"]))
    return list(out.items())


def run_head(tokens, env, device, out, max_seconds):
    """`--suite head`: every token count, head.json and bench.md into `out`."""
    import json
    start = time.time()
    results = []
    line = report.env_line(env)
    for L in tokens:
        if max_seconds is not None and time.time() - start > max_seconds:
            print(f"# stopped before L = {L} (--max-seconds)")
            break
        rows = head_cells(L, device)
        results.append((L, rows))
        for r in rows:
            print(f"L={L:6d} {r[0]:38s} {r[1]:9.1f} ms {r[2]:7.2f} GiB  err {r[3]:.1e} / "
                  f"{r[4]:.1e} {r[5]}", flush=True)
        (out / "bench.json").write_text(json.dumps(dict(env=env, suite="head", rows=[
            dict(tokens=L, impl=r[0], ms=r[1], peak_gib=r[2], rel_err=r[3], grad_rel_err=r[4],
                 note=r[5]) for L, rs in results for r in rs]), indent=1))
        (out / "bench.md").write_text(head_markdown(line, results))
    print(head_markdown(line, results))


def head_report(result) -> str:
    """bench.md of a bench.json of this suite."""
    return head_markdown(report.env_line(result["env"]), head_rows(result))


def head_plot(result, path):
    """head.png: time and peak memory against the token count, one line per implementation
    (log-log), the three bare matmuls' summed time dashed beside the times."""
    plt = report._pyplot()
    if plt is None:
        return
    lines: dict = {}
    matmuls: dict = {}
    for r in result["rows"]:
        if r["impl"].startswith("matmul"):
            matmuls[r["tokens"]] = matmuls.get(r["tokens"], 0.0) + r["ms"]
        elif report.measured(r["ms"]):
            lines.setdefault(r["impl"], []).append((r["tokens"], r["ms"], r["peak_gib"]))
    if not lines:
        return
    fig, (t_ax, m_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for name, points in lines.items():
        L, ms, gib = zip(*sorted(points))
        t_ax.loglog(L, ms, "o-", ms=4, label=name)
        m_ax.loglog(L, gib, "o-", ms=4, label=name)
    if matmuls:
        t_ax.loglog(*zip(*sorted(matmuls.items())), "k--", lw=1, label="three bare matmuls")
    t_ax.set_ylabel("forward + backward, ms")
    m_ax.set_ylabel("peak GiB beyond inputs and gradients")
    for ax in (t_ax, m_ax):
        ax.set_xlabel("tokens L")
        ax.grid(True, which="both", lw=0.3)
    t_ax.legend(fontsize=7)
    report._save(fig, f"Fused loss head, bf16, H = {HEAD_H}, V = {HEAD_V}, on "
                      f"{result['env']['gpu']} ({result['env']['date']})", path)


report.RENDERERS["head"] = (head_report, head_plot, "head.png")
