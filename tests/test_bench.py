"""The benchmark harness's own logic, on the CPU: inputs, its correctness check, its reports.
(Timing needs a CUDA device: `python -m rl_triton.bench` on the GPU.)"""
import argparse
import json
from dataclasses import asdict

import pytest
import torch

import rl_triton
from rl_triton import testing
from rl_triton.bench import anchor, calls, checks, cli, registry, report, timing
from rl_triton.bench.suites import gradients
from rl_triton.bench.suites import head as head_suite
from rl_triton.bench.suites import host as host_suite
from rl_triton.bench.suites import llm as llm_suite
from rl_triton.bench.suites import losses as loss_suite
from rl_triton.bench.suites import tokens as token_suite

try:
    import torchrl  # noqa: F401
    HAS_TORCHRL = True
except Exception:  # noqa: BLE001 - not installed on the GPU machine
    HAS_TORCHRL = False


@pytest.mark.parametrize("name", registry.ESTIMATORS)
@pytest.mark.parametrize("layout", registry.LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_inputs_and_check(name, layout, dtype):
    kw, nbytes = registry.make_inputs(name, 5, 37, layout, dtype, True, "cpu")
    refs = checks.float64_result(name, kw)
    out = getattr(rl_triton, name)(**kw, backend="torch")
    assert checks.rel_err(out, refs, kw["time_dim"]) < 1e-5
    wrong = out[0] + 1e-2 if isinstance(out, tuple) else out + 1e-2
    assert checks.rel_err(wrong, refs[:1], kw["time_dim"]) > 1e-5  # the check can fail
    tensors = [v for v in kw.values() if isinstance(v, torch.Tensor)]
    assert nbytes > sum(t.numel() * t.element_size() for t in tensors)  # outputs counted


def test_reports(tmp_path):
    env = dict(gpu="GPU", driver="1", torch="t", triton="tr", date="2026-11-29",
               copy_bandwidth_gbs=4000.0, launch_floor_device_us=4.0, launch_floor_full_us=13.0)
    rows = [report.Row("gae", s, "time-major", "float32", True, impl, 10**6, dev, dev + 10,
                       0.5, 1e-7, copy_us=4.0)
            for s, base in (("128x128", 1.0), ("4096x128", 2.0))
            for impl, dev in (("rl_triton", 5.0 * base), ("torch", 50.0 * base))]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(dict(env=env, rows=[asdict(r) for r in rows])))
    cli.main(["--report", str(path), "--out", str(tmp_path / "r")])
    md = (tmp_path / "r" / "bench.md").read_text()
    assert "| gae | time-major | float32 | yes | 5 / 15 (0.50) | 10 / 20 (0.50) |" in md
    assert "| gae | torch | time-major | yes | 4.0x (10.0x) | 5.5x (10.0x) |" in md
    assert "| gae | time-major | float32 | yes | 0.80 | 0.40 |" in md  # against a same-bytes copy
    assert (tmp_path / "r" / "bench.png").stat().st_size > 1000


@pytest.mark.parametrize("n", [1, 1000, 5003])
def test_copies_copy(n, device):
    """Both copies whose faster one is the benchmark's same-bytes floor copy every value."""
    src = torch.randn(n, device=device)
    dst = torch.zeros_like(src)
    for name, copy in timing.copies(src, dst).items():
        copy()
        assert torch.equal(dst, src), name
        dst.zero_()


def test_rule_option():
    assert cli.parse_rule("WALK_PROGRAMS_PER_SM=4,WINDOW=32") == dict(
        WALK_PROGRAMS_PER_SM=4, WINDOW=32)
    for bad in ("walk_programs_per_sm=4", "WINDOW=x", "NO_SUCH=1", "WINDOW"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not NAME=<int>"):
            cli.parse_rule(bad)


def test_tiles_option():
    assert cli.parse_tiles("block_t=64,block_b=32,num_warps=4") == dict(
        block_t=64, block_b=32, num_warps=4)
    assert cli.parse_tiles("walk=0,window=32") == dict(walk=False, window=32)
    assert cli.parse_tiles("walk=1") == dict(walk=True)
    assert cli.parse_tiles("sub=4,depth=1") == dict(sub=4, depth=1)
    assert cli.parse_tiles("max_registers=80") == dict(max_registers=80)  # maxnreg
    for bad in ("block_t=0", "blockt=64", "num_warps=four", "window", "walk=2"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not one of"):
            cli.parse_tiles(bad)
    env = dict(gpu="GPU", driver="1", torch="t", triton="tr", date="2026-11-29",
               copy_bandwidth_gbs=4000.0, launch_floor_device_us=4.0, launch_floor_full_us=13.0,
               tiles=dict(block_t=64))
    row = report.Row("gae", "128x128", "time-major", "float32", True, "rl_triton", 10**6, 5.0,
                     15.0, 0.5, 1e-7)
    md = report.markdown(dict(env=env, rows=[asdict(row)]))
    assert "Tile rule replaced by {'block_t': 64}" in md
    assert "--rule" not in md
    assert "Rule constants changed: {'WINDOW': 32} (--rule)" in report.markdown(
        dict(env=dict(env, tiles=None, rule={"WINDOW": 32}), rows=[asdict(row)]))
    assert "same bytes" not in md  # no copy time measured: no such table


def test_ab_tool_checks_every_variant_and_names_its_plan():
    """tools/ab.py (A/B device times of variants of the tile rule, on the GPU): without one it
    builds each variant's plan, checks its result against float64 and prints the plan; a
    forced tile that changes the plan shows in it, and a malformed problem is refused; with
    :bwd, the backward pass's (its gradients checked); with :mask, a masked call."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).parent.parent / "tools" / "ab.py"
    # the tool's CPU path (plans and checks, no timing) on a GPU machine too
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, str(tool), "gae:3x40:bm:notrunc", "--", "base",
                           "cut|tiles:block_t=16,walk=0"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    base, cut = done.stdout.strip().split("\n")
    assert "gae:3x40:batch-major:float32:notrunc base: relative error" in base
    assert "LOOKBACK=False" in base and "BLOCK_T=64" in base, base
    assert "LOOKBACK=True" in cut and "BLOCK_T=16 BLOCK_B=4" in cut and "grid 3," in cut, cut
    bad = subprocess.run([sys.executable, str(tool), "gae:3x40:xm", "--", "base"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "estimator:NxT:tm|bm" in bad.stderr
    # :bwd, the backward pass: its gradients checked, the backward's plan printed
    done = subprocess.run([sys.executable, str(tool), "vtrace:3x40:tm:bwd", "--", "base",
                           "cut|tiles:block_t=16"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    base, cut = done.stdout.strip().split("\n")
    assert "vtrace:3x40:time-major:float32:bwd base: relative error" in base
    assert "LOOKBACK=False" in base and "LOOKBACK=True" in cut and "BLOCK_T=16" in cut, cut
    # :mask, a masked call (semantics §7) checked against the float64 reference of the same mask
    done = subprocess.run([sys.executable, str(tool), "gae:3x40:bm:mask", "--", "base"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "gae:3x40:batch-major:float32:mask base: relative error" in done.stdout


@pytest.mark.parametrize("name", registry.ESTIMATORS)
def test_gradient_helpers(name):
    """`--modes bwd,fwd+bwd`: every floating input a leaf, the backward's minimal bytes, the
    gradient check (which can fail), and TorchRL's estimator giving our gradients."""
    kw, _ = registry.make_inputs(name, 3, 17, "time-major", torch.float32, True, "cpu")
    kw_g, leaves = calls.grad_inputs(kw)
    assert leaves and all(t.requires_grad for t in leaves)
    tensors = {k: v for k, v in kw_g.items() if isinstance(v, torch.Tensor)}
    flags = [k for k, v in tensors.items() if not v.is_floating_point()]
    assert flags and not any(tensors[k].requires_grad for k in flags)  # flags, actions
    assert len(leaves) == len(tensors) - len(flags)
    n = kw["rewards" if "rewards" in kw else "x"].numel()
    # output gradients, one flag
    grads_and_flags = registry.n_out(name, kw) * n * 4 + n
    assert registry.bwd_bytes(name, kw_g, leaves) > grads_and_flags
    fn = getattr(rl_triton, name)
    checks.check_gradients(fn, kw_g, leaves, name, "3x17")
    with pytest.raises(SystemExit, match="not timing a wrong gradient"):
        checks.check_gradients(lambda **k: fn(**k) if k.get("backend") else tuple(
            2 * o for o in (fn(**k) if isinstance(fn(**k), tuple) else (fn(**k),))),
            kw_g, leaves, name, "3x17")
    # bfloat16 inputs: their gradients rounded to bfloat16 pass, wrong ones still fail
    kw16, leaves16 = calls.grad_inputs(registry.make_inputs(name, 5, 333, "batch-major",
                                                            torch.bfloat16, True, "cpu")[0])
    checks.check_gradients(fn, kw16, leaves16, name, "5x333")
    with pytest.raises(SystemExit, match="not timing a wrong gradient"):
        checks.check_gradients(lambda **k: fn(**k) if k.get("backend") else tuple(
            1.1 * o for o in (fn(**k) if isinstance(fn(**k), tuple) else (fn(**k),))),
            kw16, leaves16, name, "5x333")
    assert len(calls.backward_fn(fn(**kw_g), leaves)()) == len(leaves)
    f = gradients.torchrl_fwd_bwd(name, kw_g)
    if not HAS_TORCHRL:
        assert f is None
    elif name in ("gae", "lambda_returns", "vtrace", "discounted_returns"):
        assert f is not None and all(g is not None for g in f())
    else:
        assert f is None


@pytest.mark.skipif(not HAS_TORCHRL, reason="TorchRL not installed (the CPU suite has it)")
def test_torchrl_baseline_computes_our_gradients():
    """The fwd+bwd baseline times the same gradients: TorchRL's GAE against ours."""
    kw, _ = registry.make_inputs("gae", 3, 17, "time-major", torch.float32, True, "cpu")
    kw_g, leaves = calls.grad_inputs(kw)
    ours = calls.fwd_bwd_fn(lambda: rl_triton.gae(**kw_g), leaves)()
    theirs = gradients.torchrl_fwd_bwd("gae", kw_g)()  # d rewards, d values, d last_value
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(b.reshape(a.shape[::-1]).T if a.ndim == 2 else
                                   b.reshape(a.shape), a, rtol=1e-5, atol=1e-5)


def test_gradient_reports(tmp_path):
    env = dict(gpu="GPU", driver="1", torch="t", triton="tr", date="2026-12-02",
               copy_bandwidth_gbs=4000.0, launch_floor_device_us=4.0, launch_floor_full_us=13.0)
    rows = [report.Row("gae", "4096x128", "time-major", "float32", True, "rl_triton", 10**6,
                       10.0, 30.0, 0.5, 0.0, 8.0, "bwd"),
            report.Row("gae", "4096x128", "time-major", "float32", True, "rl_triton", 0,
                       20.0, 60.0, 0.0, 0.0, float("nan"), "fwd+bwd"),
            report.Row("gae", "4096x128", "time-major", "float32", True, "torch", 0,
                       400.0, 1200.0, 0.0, 0.0, float("nan"), "fwd+bwd")]
    md = report.markdown(dict(env=env, rows=[asdict(r) for r in rows]))
    assert "| gae | time-major | float32 | yes | 10 / 30 (0.80) |" in md
    assert "| gae | time-major | float32 | yes | 20 / 60 |" in md
    assert "| gae | time-major | float32 | yes | 20.0x (20.0x) |" in md


# ---- the token-level suite (--suite tokens) ----------------------------------------------------

def _runs(m):
    """Starts and ends of the runs of False in each row of a bool [B, T] mask."""
    edges = torch.diff(torch.nn.functional.pad((~m).int(), (1, 1)), dim=1)
    return [(torch.nonzero(e == 1).flatten(), torch.nonzero(e == -1).flatten()) for e in edges]


@pytest.mark.parametrize("B,T,seed", [(6, 64, 0), (9, 37, 1), (3, 500, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_token_rows(B, T, seed, dtype):
    """testing.token_rows: right-padded responses of T/2..T tokens, 2-4 observation spans inside
    each (its first and last tokens decisions), rewards only on decision tokens with the
    outcome on the last, and packed rows that are the multi-turn ones without padding."""
    rows = {k: testing.token_rows(B, T, k, dtype, seed=seed) for k in testing.TOKEN_KINDS}
    for k, r in rows.items():
        assert r["rewards"].dtype == r["values"].dtype == dtype, k
        assert r["mask"] is None if k == "dense" else r["mask"].dtype == torch.bool, k
        assert (r["cu_seqlens"] is not None) == (k == "packed"), k
    dense, padded, multi = rows["dense"], rows["padded"]["mask"], rows["multi-turn"]["mask"]
    for k in ("padded", "multi-turn"):  # the same tokens under every mask
        assert torch.equal(rows[k]["rewards"], dense["rewards"])
        assert torch.equal(rows[k]["values"], dense["values"])
    lengths = padded.sum(1)
    assert torch.equal(padded, torch.arange(T) < lengths[:, None])  # right padding
    assert ((lengths >= T // 2) & (lengths <= T)).all()
    assert not (multi & ~padded).any()  # spans inside the responses
    ends = torch.arange(B), lengths - 1
    assert multi[:, 0].all() and multi[ends].all()
    for (starts, stops), n in zip(_runs(multi), lengths.tolist()):
        inside = stops <= n  # the spans; the padding is the run ending at T
        assert 2 <= int(inside.sum()) <= 4 and (starts[inside] >= 1).all()
    r = dense["rewards"].float()
    assert not r[~multi].any()  # rewards on decision tokens only
    assert (r[ends] - r[ends].round()).abs().max() < 0.1  # the outcome (0 or 1) on the last
    packed = rows["packed"]
    cu = packed["cu_seqlens"]
    assert cu.dtype == torch.int32 and cu[0] == 0 and torch.equal(cu.diff().long(), lengths)
    assert torch.equal(packed["rewards"], dense["rewards"][padded])
    assert torch.equal(packed["values"], dense["values"][padded])
    assert torch.equal(packed["mask"], multi[padded])
    again = testing.token_rows(B, T, "multi-turn", dtype, seed=seed)
    assert torch.equal(again["mask"], multi) and torch.equal(again["rewards"], dense["rewards"])
    assert not torch.equal(testing.token_rows(B, T, "dense", dtype, seed=seed + 1)["values"],
                           dense["values"])
    with pytest.raises(ValueError, match="kind"):
        testing.token_rows(B, T, "ragged")
    with pytest.raises(ValueError, match="no room"):
        testing.token_rows(B, 23, "dense")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_token_cells_check(dtype):
    """Every call of the token suite gives its float64 result (packed: the multi-turn one
    without padding; packed-unmasked: the padded one), and the check refuses a wrong one;
    minimal bytes as documented."""
    B, T = 5, 48
    cells = list(token_suite.token_cells(B, T, dtype, "cpu", seed=3))
    assert [(c[0], c[1]) for c in cells] == [
        (call, kind) for kind in testing.TOKEN_KINDS + ("dense-packed", "packed-unmasked")
        for call in ("gae", "discounted_returns") + (("masked_whiten",) if kind == "multi-turn"
                                                     else ())]
    size = 2 if dtype is torch.bfloat16 else 4
    for call, kind, f, tokens, nbytes, ref in cells:
        out = f()
        assert checks.rel_err(out, ref, 0) < 1e-5, (call, kind)
        with pytest.raises(SystemExit, match="not timing a wrong result"):
            wrong = out[0] if isinstance(out, tuple) else out
            checks.check_result(checks.rel_err(wrong + 1e-2, ref[:1], 0), 1e-5, call)
        packed = kind in ("packed", "dense-packed", "packed-unmasked")
        assert tokens == (B * T if not packed else int(testing.token_rows(
            B, T, "packed", seed=3)["cu_seqlens"][-1]))
        mask = kind not in ("dense", "dense-packed", "packed-unmasked")
        per_token = {"gae": 2 * size + 8, "discounted_returns": size + 4,
                     "masked_whiten": size + 4}[call] + mask
        rows = (1 if kind == "dense-packed" else B) if call == "gae" else 0  # last_value
        cu = 4 * (B + 1) if kind in ("packed", "packed-unmasked") else 0
        assert nbytes == tokens * per_token + 4 * rows + cu, (call, kind)
    groups = list(token_suite.group_cells("cpu", n=96, groups=12))
    assert [g[0] for g in groups] == ["group_size", "group_index"]
    for kind, f, nbytes, ref in groups:
        assert checks.rel_err(f(), ref, 0) < 1e-5 and nbytes == 96 * (16 if kind ==
                                                                      "group_index" else 8)


def _frameworks():
    try:
        return testing.import_frameworks()
    except ImportError as e:
        pytest.skip(f"the frameworks are not installed: {e}")


def test_framework_loops_compute_the_timed_calls(monkeypatch):
    """On the multi-turn rows verl's loops give what the suite's rl_triton calls give on the
    decision tokens (GAE returns, REINFORCE++ returns; its advantages: masked_whiten of ours),
    and a drop-in module, where one exists, is called with the frameworks' arguments."""
    fw = _frameworks()
    rows = testing.token_rows(6, 80, "multi-turn", seed=4)
    m = rows["mask"]
    cells = {name: (theirs, mine) for name, _, theirs, mine in
             token_suite.framework_cells(rows, fw, {})}
    assert list(cells) == list(registry.FRAMEWORK_CALLS) and all(
        mine is None for _, mine in cells.values())
    gae_kw, _ = token_suite.token_kwargs("gae", rows)
    adv, ret = rl_triton.gae(**gae_kw)
    v_adv, v_ret = cells["compute_gae_advantage_return"][0]()
    torch.testing.assert_close(v_ret[m], ret[m], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_adv[m], rl_triton.masked_whiten(adv, m)[m], rtol=1e-4,
                               atol=1e-4)
    g = rl_triton.discounted_returns(**token_suite.token_kwargs("discounted_returns", rows)[0])
    _, rf_ret = cells["compute_reinforce_plus_plus_outcome_advantage"][0]()
    torch.testing.assert_close(rf_ret, g, rtol=1e-5, atol=1e-5)
    for name, _ in cells.values():  # OpenRLHF's: called with self=None
        assert name() is not None

    import importlib.machinery
    import sys
    import types
    for framework, owner in (("verl", fw.verl), ("openrlhf", fw.openrlhf)):
        module = types.ModuleType(f"rl_triton.integrations.{framework}")
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
        for name, (f, _) in registry.FRAMEWORK_CALLS.items():
            if f == framework:
                setattr(module, name, getattr(owner, name))
        monkeypatch.setitem(sys.modules, module.__name__, module)
    ours = token_suite.drop_ins()
    assert sorted(ours) == ["openrlhf", "verl"]
    for name, _, theirs, mine in token_suite.framework_cells(rows, fw, ours):
        a, b = theirs(), mine()
        assert checks.rel_err(b, tuple(t.double() for t in (a if isinstance(a, tuple) else (a,))),
                              0) == 0, name


def test_loop_budget(monkeypatch):
    """The frameworks' loops: one warm-up and FRAMEWORK_CALLS_TIMED calls while they fit in
    --frameworks-max-seconds, and no call where a row's foreseen cost would overrun it."""
    import time
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = []

    def loop(T):
        def run():
            calls.append(T)
            time.sleep(2e-6 * T)  # 2 µs a token step
            return T
        return run

    budget = token_suite.LoopBudget(0.3)
    full, out = budget.full_call_us("loop", loop(1000), 1000)
    assert out == 1000 and calls == [1000] * 4 and 2000 <= full < 20000
    full, _ = budget.full_call_us("loop", loop(10000), 10000)  # 80 ms of the 290 left
    assert calls[4:] == [10000] * 4 and full >= 20000
    assert budget.full_call_us("loop", loop(100000), 100000) == (None, None)  # 0.4 s > 0.2
    assert len(calls) == 8
    assert token_suite.LoopBudget(0).full_call_us("new", loop(10), 10) == (None, None)
    assert len(calls) == 8


def _token_env():
    return dict(gpu="GPU", driver="1", torch="t", triton="tr", date="2026-12-03",
                copy_bandwidth_gbs=4000.0, launch_floor_device_us=4.0, launch_floor_full_us=13.0)


def test_token_reports(tmp_path):
    """bench.md's token tables and tokens.png from a token-suite bench.json."""
    def row(call, kind, impl, dev, full, shape="512x4096", dtype="float32", **kw):
        return asdict(report.TokenRow(call, shape, dtype, kind, impl, 2**21, 10**7 if
                                      impl == "rl_triton" else 0, dev, full, **kw))
    nan = float("nan")
    rows = [row(c, k, "rl_triton", dev, full, shape=s, copy_us=6.0)
            for s, scale in (("256x1024", 0.5), ("512x4096", 1.0))
            for c in ("gae", "discounted_returns")
            for k, dev, full in (("dense", 10.0, 20.0), ("padded", 11.0, 22.0),
                                 ("multi-turn", 12.0, 30.0), ("packed", 30.0, 90.0),
                                 ("dense-packed", 8.0, 18.0))]
    rows += [row("masked_whiten", "multi-turn", "rl_triton", 15.0, 25.0, dtype="bfloat16",
                 copy_us=12.0),
             row("compute_gae_advantage_return", "multi-turn", "verl", nan, 755000.0),
             row("compute_gae_advantage_return", "multi-turn", "drop-in", nan, 30.2),
             row("get_advantages_and_returns", "multi-turn", "openrlhf", nan, 300000.0),
             row("get_cumulative_returns", "multi-turn", "openrlhf", nan, nan,
                 note="over --frameworks-max-seconds"),
             row("group_advantages", "group_size", "rl_triton", 9.0, 26.0, shape="65536x8192"),
             row("group_advantages", "group_index", "rl_triton", 40.0, 65.0,
                 shape="65536x8192")]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(dict(env=_token_env(), suite="tokens", rows=rows)))
    cli.main(["--report", str(path), "--out", str(tmp_path / "r")])
    md = (tmp_path / "r" / "bench.md").read_text()
    assert "| gae | 512x4096 | float32 | dense | 10.0 | 20.0 | 0.60 |  |  |  |" in md
    assert "| gae | 512x4096 | float32 | multi-turn | 12.0 | 30.0 | 0.50 | 1.20 / 1.50 |" in md
    assert "| gae | 512x4096 | float32 | packed | 30.0 | 90.0 | 0.20 | 3.75 / 5.00 |" in md
    assert "| masked_whiten | 512x4096 | bfloat16 | multi-turn | 15.0 | 25.0 | 0.80 |" in md
    assert ("| verl compute_gae_advantage_return | 512x4096 | float32 | multi-turn |  | 30.2 "
            "|  |  | 755000 | 25000x |") in md  # against the drop-in
    assert ("| openrlhf get_advantages_and_returns | 512x4096 | float32 | multi-turn |  |  |  "
            "|  | 300000 | 10000x (gae) |") in md  # no drop-in: against rl_triton.gae
    assert "| over --frameworks-max-seconds |  |" in md
    assert "| group_advantages | 65536x8192 | group_index | 40.0 | 65.0 | 5.00 |" in md
    assert md.index("| gae | 256x1024") < md.index("| gae | 512x4096") < md.index(
        "| discounted_returns | 256x1024") < md.index("| verl")
    assert (tmp_path / "r" / "tokens.png").stat().st_size > 1000
    assert not (tmp_path / "r" / "bench.png").exists()


def test_token_suite_runs(tmp_path, monkeypatch):
    """`run_tokens` end to end on the CPU, with timing stubbed (it needs CUDA): every cell
    checked, the frameworks' loops beside the calls, bench.json marked as the token suite."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "device_full_host_us",
                        lambda f, hold_cycles=0: (10.0, 20.0, 8.0))
    monkeypatch.setattr(timing, "same_bytes_copy_us", lambda nbytes, device: 5.0)
    token_suite.run_tokens(["4x64", "2x256"], ["bfloat16", "float32"], _token_env(), "cpu",
                           tmp_path, None, 60.0)
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["suite"] == "tokens"
    rows = result["rows"]
    cells = {(r["call"], r["shape"], r["dtype"], r["kind"]) for r in rows
             if r["impl"] == "rl_triton"}
    for shape in ("4x64", "2x256"):
        for dt in ("bfloat16", "float32"):
            for kind in testing.TOKEN_KINDS + ("dense-packed",):
                assert {("gae", shape, dt, kind), ("discounted_returns", shape, dt, kind)} <= cells
            assert ("masked_whiten", shape, dt, "multi-turn") in cells
    assert {r["kind"] for r in rows if r["call"] == "group_advantages"} == {"group_size",
                                                                           "group_index"}
    try:
        testing.import_frameworks()
    except ImportError:
        assert not [r for r in rows if r["call"] in registry.FRAMEWORK_CALLS]
    else:
        loops = [r for r in rows if r["call"] in registry.FRAMEWORK_CALLS]
        # 4 framework functions x 2 shapes, each beside its drop-in
        assert len(loops) == 16 and all(r["full_us"] > 0 for r in loops)
        assert sum(r["impl"] == "drop-in" for r in loops) == 8
    assert "Token-level suite" in (tmp_path / "bench.md").read_text()
    assert (tmp_path / "tokens.png").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the suite would run")
def test_token_suite_cli(tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        cli.main(["--suite", "tokens", "--shapes", "4x64", "--frameworks-max-seconds", "5",
                  "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        cli.main(["--suite", "rollouts", "--out", str(tmp_path)])
    assert e.value.code == 2


# ---- the losses suite (--suite losses) ---------------------------------------------------------

def _loss_case(loss, variant):
    return next(c for c in registry.LOSS_CASES if c[:2] == (loss, variant))


def _small_loss_inputs(case, dtype, seed=0):
    """The suite's inputs at a small, odd size: 6 rows of 37 tokens, or 222 samples."""
    return loss_suite.loss_kwargs(case, 6 * 37, dtype, "cpu", seed=seed, row=37)


@pytest.mark.parametrize("case", registry.LOSS_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_loss_formulas_match_torch_backend(case, dtype):
    """The eager baselines compute rl_triton's losses: each formula of LOSS_FORMULAS gives the
    torch backend's outputs and, where differentiable, its input gradients against the same
    random output gradients."""
    loss = case[0]
    kw = _small_loss_inputs(case, dtype)
    fn, formula = getattr(rl_triton, loss), loss_suite.LOSS_FORMULAS[loss]
    ours = calls.as_tuple(fn(**kw, backend="torch"))
    assert checks.rel_err(calls.as_tuple(formula(**kw)), ours, 0) < 1e-6
    if loss == "crr_weights":
        return
    kw_g, leaves = calls.grad_inputs(kw)
    grads = calls.output_grads(calls.as_tuple(fn(**kw_g, backend="torch")))
    names = [k for k, v in kw_g.items() if any(v is t for t in leaves)]

    def per_sample(gs):
        """At a tie between critics (bfloat16 ones tie) the torch backend's amin splits the
        gradient, the formula gives it to the first, as the kernels (next test): their sum."""
        return tuple(g.float().sum(-1) if k == "next_q_values" else g for k, g in zip(names, gs))

    want = calls.fwd_bwd_fn(lambda: fn(**kw_g, backend="torch"), leaves, grads)()
    got = calls.fwd_bwd_fn(lambda: formula(**kw_g), leaves, grads)()
    assert len(got) == len(leaves) == len(want)
    assert checks.rel_err(per_sample(got), per_sample(want), 0) < 1e-6


@pytest.mark.parametrize("variant", ["continuous K=2", "discrete A=18 K=2"])
def test_sac_formula_breaks_ties_as_the_kernel(variant, device):
    """At a tie between critics the SAC formula's gradient goes to the first critic, as
    rl_triton's kernel's (float32: the same values without bfloat16's rounding)."""
    kw = loss_suite.loss_kwargs(_loss_case("sac_targets", variant), 300, torch.float32, device)
    q = kw["next_q_values"]
    q[::2, ..., 1] = q[::2, ..., 0]
    kw, leaves = calls.grad_inputs(kw)
    grads = calls.output_grads((rl_triton.sac_targets(**kw),))
    want = calls.fwd_bwd_fn(lambda: rl_triton.sac_targets(**kw, backend="triton"), leaves,
                            grads)()
    got = calls.fwd_bwd_fn(lambda: loss_suite.LOSS_FORMULAS["sac_targets"](**kw), leaves, grads)()
    assert (got[1][::2, ..., 1] == 0).all()
    assert checks.rel_err(got, want, 0) < 1e-6


def test_loss_inputs_reach_every_branch():
    """The inputs exercise what each variant adds: the masks hold ~70% of the tokens, PPO's
    ratios fall past both clips and the dual clip, the value clip and the KL clamp bind, and
    bfloat16 critics tie (where the gradient goes to the first)."""
    kw = loss_suite.loss_kwargs(_loss_case("ppo_policy_loss", "mask, dual_clip=3"), 64 * 37,
                                torch.float32, "cpu", row=37)
    assert 0.6 < kw["mask"].float().mean() < 0.8 and kw["dual_clip"] == 3.0
    ratio = (kw["log_probs"] - kw["old_log_probs"]).exp()
    assert (ratio < 0.8).any() and (ratio > 1.2).any()
    assert ((ratio > kw["dual_clip"]) & (kw["advantages"] < 0)).any()
    kw = loss_suite.loss_kwargs(_loss_case("value_loss", "mask, clip=0.2"), 64 * 37, torch.float32,
                                "cpu", row=37)
    assert ((kw["values"] - kw["old_values"]).abs() > kw["clip"]).any()
    kw = loss_suite.loss_kwargs(_loss_case("kl_penalty", "k3, clamp=10"), 64 * 37, torch.float32,
                                "cpu", row=37)
    assert (loss_suite.LOSS_FORMULAS["kl_penalty"](kw["log_probs"], kw["ref_log_probs"], 1e9)
            > kw["clamp"]).any()
    for variant, shape in (("continuous K=2", (4096, 2)), ("discrete A=18 K=2", (4096, 18, 2))):
        kw = loss_suite.loss_kwargs(_loss_case("sac_targets", variant), 4096, torch.bfloat16, "cpu")
        q = kw["next_q_values"]
        assert q.shape == shape and (q[..., 0] == q[..., 1]).any()
        assert 0 < kw["terminated"].float().mean() < 0.1
    kw = loss_suite.loss_kwargs(_loss_case("sac_targets", "discrete A=18 K=2"), 5, torch.float32,
                                "cpu")
    torch.testing.assert_close(kw["next_probs"].sum(-1), torch.ones(5))
    torch.testing.assert_close(kw["next_log_probs"].exp(), kw["next_probs"])


def test_loss_bytes():
    """Minimal bytes: inputs read once, outputs written; forward plus backward also the output
    gradients read and the input gradients written."""
    kw = _small_loss_inputs(_loss_case("ppo_policy_loss", "mask"), torch.bfloat16)
    n = 6 * 37
    outs = calls.as_tuple(rl_triton.ppo_policy_loss(**kw))
    assert loss_suite.loss_bytes(kw, outs, [], []) == n * (3 * 2 + 1) + 3 * 4
    kw_g, leaves = calls.grad_inputs(kw)
    outs = calls.as_tuple(rl_triton.ppo_policy_loss(**kw_g))
    grads = calls.output_grads(outs)
    assert len(grads) == 2  # loss and approx_kl; clip_fraction has no gradient
    assert loss_suite.loss_bytes(kw_g, outs, grads, leaves) == (n * (3 * 2 + 1 + 3 * 2) + 3 * 4
                                                                 + 2 * 4)
    case = _loss_case("sac_targets", "discrete A=18 K=2")
    kw = loss_suite.loss_kwargs(case, 10, torch.float32, "cpu")
    y = rl_triton.sac_targets(**kw)
    per_sample = 4 + 1 + 18 * 2 * 4 + 18 * 4 + 18 * 4 + 4  # r, term, Q, log pi, pi; y
    assert loss_suite.loss_bytes(kw, (y,), [], []) == 10 * per_sample


@pytest.mark.parametrize("case", registry.LOSS_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_loss_formulas_trace_whole(case):
    """The compile baseline compiles each formula into one graph (no graph break), forward and
    backward: dynamo and AOT autograd (backend aot_eager: no code generation on the CPU)."""
    loss = case[0]
    formula = loss_suite.LOSS_FORMULAS[loss]
    torch._dynamo.reset()
    compiled = torch.compile(formula, backend="aot_eager", fullgraph=True, dynamic=False)
    kw = _small_loss_inputs(case, torch.float32)
    if loss != "crr_weights":
        kw, leaves = calls.grad_inputs(kw)
    want = calls.as_tuple(formula(**kw))
    assert checks.rel_err(calls.as_tuple(compiled(**kw)), want, 0) < 1e-6
    if loss != "crr_weights":
        grads = calls.output_grads(want)
        assert checks.rel_err(calls.fwd_bwd_fn(lambda: compiled(**kw), leaves, grads)(),
                              calls.fwd_bwd_fn(lambda: formula(**kw), leaves, grads)(), 0) < 1e-6


def _stub_timing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "device_full_host_us",
                        lambda f, hold_cycles=0: (10.0, 20.0, 8.0))
    monkeypatch.setattr(timing, "same_bytes_copy_us", lambda nbytes, device: 5.0)
    # inductor would build C++ on the CPU (minutes): the formulas' graphs are tested above
    monkeypatch.setattr(loss_suite, "compiled_formula", lambda formula: formula)


def test_loss_suite_runs(tmp_path, monkeypatch, device):
    """`run_losses` end to end on the CPU (rl_triton's kernels in Triton's interpreter, timing
    and torch.compile stubbed): one row per case, mode, size, dtype and implementation, every
    baseline checked against rl_triton, bench.json marked as the losses suite."""
    _stub_timing(monkeypatch)
    loss_suite.run_losses([1024], ["bfloat16", "float32"], _token_env(), device, tmp_path, None)
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["suite"] == "losses"
    rows = result["rows"]
    want = {(loss, variant, mode, 1024, dt, impl) for loss, variant, _, modes in registry.LOSS_CASES
            for mode in modes for dt in ("bfloat16", "float32")
            for impl in ("rl_triton", "eager", "compile")}
    assert len(rows) == len(want) == 2 * 3 * 9
    assert {(r["loss"], r["variant"], r["mode"], r["tokens"], r["dtype"], r["impl"])
            for r in rows} == want
    for r in rows:
        assert r["rel_err"] < registry.LOSS_OUTPUT_TOL, r
        # bfloat16 gradients: the interpreter rounds float32 to bfloat16 toward zero (the GPU
        # to nearest), about one unit in the last place on half the values
        assert (r["grad_rel_err"] < registry.LOSS_GRAD_TOL) == (r["mode"] == "fwd+bwd"), r
        assert r["bytes"] > 1024
    md = (tmp_path / "bench.md").read_text()
    assert "Losses (`--suite losses`" in md and "| ppo_policy_loss | mask | fwd+bwd | 2^10 |" in md
    assert (tmp_path / "losses.png").stat().st_size > 1000


def test_loss_suite_refuses_a_wrong_formula_and_stops_in_time(tmp_path, monkeypatch, device):
    _stub_timing(monkeypatch)
    monkeypatch.setattr(registry, "LOSS_CASES", [_loss_case("value_loss", "mask, clip=0.2")])
    formula = loss_suite.LOSS_FORMULAS["value_loss"]
    monkeypatch.setitem(loss_suite.LOSS_FORMULAS, "value_loss",
                        lambda clip, **kw: formula(clip=2 * clip, **kw))
    with pytest.raises(SystemExit, match="eager value_loss .* not timing a wrong result"):
        loss_suite.run_losses([1024], ["float32"], _token_env(), device, tmp_path, None)
    loss_suite.run_losses([1024], ["float32"], _token_env(), device, tmp_path, 0.0)  # --max-seconds
    assert json.loads((tmp_path / "bench.json").read_text())["rows"] == []


def test_loss_reports(tmp_path):
    """bench.md's losses table and targets and losses.png from a losses-suite bench.json."""
    def row(loss, variant, mode, tokens, dtype, impl, dev, full, nbytes=2**26):
        return asdict(report.LossRow(loss, variant, mode, tokens, dtype, impl, nbytes, dev, full,
                                     0.8 * dev if impl == "rl_triton" else 1.0, 0.0))
    rows = []
    for tokens, scale in ((2**20, 1.0), (2**22, 4.0)):
        for dtype in ("float32", "bfloat16"):
            for loss, variant, mode in (("ppo_policy_loss", "mask", "fwd+bwd"),
                                        ("sac_targets", "continuous K=2", "fwd"),
                                        ("sac_targets", "continuous K=2", "fwd+bwd"),
                                        ("crr_weights", "exp J=4", "fwd")):
                for impl, dev, full in (("rl_triton", 10.0, 40.0), ("eager", 50.0, 160.0),
                                        ("compile", 9.0, 50.0)):
                    rows.append(row(loss, variant, mode, tokens, dtype, impl, scale * dev,
                                    scale * full, nbytes=int(scale * 2**24)))
    rows[0]["full_us"] = 30.0  # ppo at 2^20 float32: 5.3x eager, 1.7x compile
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(dict(env=_token_env(), suite="losses", rows=rows)))
    cli.main(["--report", str(path), "--out", str(tmp_path / "r")])
    md = (tmp_path / "r" / "bench.md").read_text()
    assert ("| loss | variant | mode | tokens | dtype | MB | device µs | full µs | of copy | "
            "eager µs | vs eager | compile µs | vs compile |") in md
    assert ("| ppo_policy_loss | mask | fwd+bwd | 2^20 | float32 | 16.8 | 10.0 | 30.0 | 0.80 | "
            "160.0 | 5.3x (5.0x) | 50.0 | 1.7x (0.9x) |") in md
    assert ("| sac_targets | continuous K=2 | fwd | 2^22 | bfloat16 | 67.1 | 40.0 | 160.0 | "
            "0.80 | 640.0 | 4.0x (5.0x) | 200.0 | 1.2x (0.9x) |") in md
    lines = md.splitlines()
    first = [lines.index(next(x for x in lines if x.startswith(p))) for p in (
        "| ppo_policy_loss | mask | fwd+bwd | 2^20 | float32", "| ppo_policy_loss | mask | "
        "fwd+bwd | 2^20 | bfloat16", "| ppo_policy_loss | mask | fwd+bwd | 2^22 | float32",
        "| sac_targets | continuous K=2 | fwd | 2^20", "| sac_targets | continuous K=2 | fwd+bwd",
        "| crr_weights")]
    assert first == sorted(first)  # by case, mode, tokens, dtype
    # of copy over the cells of >= 32 MB only: the 2^22 ones (67 MB)
    assert "| of copy >= 0.6 at >= 32 MB | fwd+bwd | 4 of 4 | 0.80 (" in md
    assert "| vs eager >= 3x, full call | fwd+bwd | 8 of 8 | 4.00 (" in md
    assert ("| vs compile >= 1x, full call | fwd+bwd | 8 of 8 | 1.25 (ppo_policy_loss mask, "
            "2^20, bfloat16) |") in md
    assert "| vs compile >= 1x, full call | fwd | 8 of 8 |" in md
    assert (tmp_path / "r" / "losses.png").stat().st_size > 1000
    assert not (tmp_path / "r" / "bench.png").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the suite would run")
def test_loss_suite_cli(tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        cli.main(["--suite", "losses", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        cli.main(["--suite", "losses", "--shapes", "1024,4096", "--dtypes", "float32",
                  "--max-seconds", "60", "--out", str(tmp_path)])
    for bad in ("1000", "4096x128", "0"):
        with pytest.raises(SystemExit) as e:
            cli.main(["--suite", "losses", "--shapes", bad, "--out", str(tmp_path)])
        assert e.value.code == 2



# the default suite's bench.md of `_default_rows`, as the harness wrote it before the losses suite
DEFAULT_REPORT = """\
GPU, driver 1, torch t, triton tr, 2026-12-05. Copy bandwidth 4000 GB/s; launch floor 4.0 us device, 13.0 us full call.

rl_triton, device / full-call µs (bandwidth fraction of copy):

| estimator | layout | dtype | trunc | 128x128 | 4096x128 |
|---|---|---|---|---|---|
| gae | time-major | float32 | yes | 5 / 15 (0.50) | 8 / 20 (0.60) |
| vtrace | batch-major | bfloat16 | no | 6 / 16 (0.40) |  |

The same, as the device time of a copy that moves the same bytes divided by rl_triton's device time (1.00: as fast as copying those bytes):

| estimator | layout | dtype | trunc | 128x128 | 4096x128 |
|---|---|---|---|---|---|
| gae | time-major | float32 | yes | 0.80 | 0.75 |
| vtrace | batch-major | bfloat16 | no | 0.75 |  |

Speedup of rl_triton over the baselines (same inputs), full-call time (device time in brackets):

| estimator | baseline | layout | trunc | 128x128 | 4096x128 |
|---|---|---|---|---|---|
| gae | torch | time-major | yes | 10.0x (10.0x) |  |
| gae | compile | time-major | yes |  | 3.0x (2.0x) |

Backward pass alone (every floating input requires grad), device / full-call µs (device time of a copy of its minimal bytes / its device time):

| estimator | layout | dtype | trunc | 128x128 | 4096x128 |
|---|---|---|---|---|---|
| gae | time-major | float32 | yes |  | 10 / 30 (0.80) |

Forward plus backward, rl_triton, device / full-call µs:

| estimator | layout | dtype | trunc | 128x128 | 4096x128 |
|---|---|---|---|---|---|
| gae | time-major | float32 | yes |  | 20 / 60 |

Forward plus backward: speedup of rl_triton over autograd through the torch backend, full call (device time in brackets):

| estimator | layout | dtype | trunc | 128x128 | 4096x128 |
|---|---|---|---|---|---|
| gae | time-major | float32 | yes |  | 20.0x (20.0x) |

Forward plus backward: speedup of rl_triton over autograd through TorchRL's estimator, full call (device time in brackets):

| estimator | layout | dtype | trunc | 128x128 | 4096x128 |
|---|---|---|---|---|---|
| gae | time-major | float32 | yes |  | 15.0x (15.0x) |
"""


def _default_rows():
    R = report.Row
    nan = float("nan")
    tm = ("time-major", "float32", True)
    return [R("gae", "128x128", *tm, "rl_triton", 10**6, 5.0, 15.0, 0.5, 1e-7, 4.0),
            R("gae", "4096x128", *tm, "rl_triton", 4 * 10**6, 8.0, 20.0, 0.6, 1e-7, 6.0),
            R("gae", "128x128", *tm, "torch", 10**6, 50.0, 150.0, 0.05, 1e-7, 4.0),
            R("gae", "4096x128", *tm, "compile", 4 * 10**6, 16.0, 60.0, 0.3, 1e-7, 6.0),
            R("vtrace", "128x128", "batch-major", "bfloat16", False, "rl_triton", 10**6, 6.0,
              16.0, 0.4, 1e-7, 4.5),
            R("gae", "4096x128", *tm, "rl_triton", 10**6, 10.0, 30.0, 0.5, 0.0, 8.0, "bwd"),
            R("gae", "4096x128", *tm, "rl_triton", 0, 20.0, 60.0, 0.0, 0.0, nan, "fwd+bwd"),
            R("gae", "4096x128", *tm, "torch", 0, 400.0, 1200.0, 0.0, 0.0, nan, "fwd+bwd"),
            R("gae", "4096x128", *tm, "torchrl", 0, 300.0, 900.0, 0.0, 0.0, nan, "fwd+bwd")]


def test_default_report_unchanged(tmp_path):
    """A default-suite bench.json (no "suite") renders as before the other suites: the same
    bench.md, word for word, and bench.png."""
    env = dict(_token_env(), date="2026-12-05")
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(dict(env=env, rows=[asdict(r) for r in _default_rows()])))
    cli.main(["--report", str(path), "--out", str(tmp_path / "r")])
    assert (tmp_path / "r" / "bench.md").read_text() == DEFAULT_REPORT
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["bench.md", "bench.png"]


# ---- the registry, host time and the host-path suite (--suite host) ----------------------------

def test_registry_follows_the_op_registry():
    """The benchmark's estimators are the registered scans of the tests (a new one needs no edit
    of bench), in the API's order; each call's output count and default scalars and options are
    the registry's and the public signature's."""
    import inspect
    assert set(registry.ESTIMATORS) == {testing.public_name(n) for n in testing.NAMES} - {
        "linear_scan"}
    assert registry.ESTIMATORS == [n for n in rl_triton.__all__ if n in registry.ESTIMATORS]
    for name in registry.ESTIMATORS:
        kw, _ = registry.make_inputs(name, 3, 9, "batch-major", torch.float32, True, "cpu")
        assert len(calls.as_tuple(getattr(rl_triton, name)(**kw))) == registry.n_out(name, kw)
        params = inspect.signature(getattr(rl_triton, name)).parameters
        for k, v in registry.public_defaults(name).items():
            assert kw.get(k, v) == v and params[k].default in (v, inspect.Parameter.empty), k
    assert registry.public_defaults("eligibility_traces") == dict(gamma=0.99, lam=0.95)  # GAE's
    kw, _ = registry.make_inputs("retrace", 3, 9, "time-major", torch.float32, True, "cpu")
    assert kw["return_advantages"] is False and registry.n_out("retrace", kw) == 1
    assert registry.n_out("retrace", dict(kw, return_advantages=True)) == 2


@pytest.mark.parametrize("name", registry.ESTIMATORS)
def test_float_flags(name, device):
    """The host suite's float flags: the same flags in float32, the float64 check passing on
    the Triton backend."""
    bools, _ = registry.make_inputs(name, 4, 21, "batch-major", torch.float32, True, device,
                                    seed=2)
    floats, _ = registry.make_inputs(name, 4, 21, "batch-major", torch.float32, True, device,
                                     seed=2, flag_dtype=torch.float32)
    flags = [k for k, v in bools.items() if isinstance(v, torch.Tensor) and v.dtype == torch.bool]
    assert flags and all(floats[k].dtype == torch.float32 and torch.equal(floats[k].bool(),
                                                                          bools[k]) for k in flags)
    out = getattr(rl_triton, name)(**floats, backend="triton")
    assert checks.rel_err(out, checks.float64_result(name, floats), 1) < 1e-5


def test_call_times_split_host_from_full(monkeypatch):
    """Host time ends where the call returns, the full call after the synchronize: a slow
    synchronize shows in the full call alone."""
    import time
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: time.sleep(2e-3))
    full, host = timing.call_times_us(lambda: time.sleep(1e-3), calls=20, warmup=2)
    assert 1000 <= host and full >= host + 1900


def test_interleaved_call_times(monkeypatch):
    """Every fn timed in every round, the order rotated a round, each fn's medians its own: a
    slow fn shows in its times alone."""
    import time
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    order = []

    def fn(name, seconds=0.0):
        def f():
            order.append(name)
            if seconds:
                time.sleep(seconds)
        return f

    times = timing.interleaved_call_times_us([fn("a"), fn("slow", 2e-3), fn("c")], rounds=3,
                                             calls=4, warmup=2)
    assert order[:6] == ["a", "a", "slow", "slow", "c", "c"]
    timed = order[6:][::4]  # the first call of each fn's batch
    assert timed == ["a", "slow", "c", "slow", "c", "a", "c", "a", "slow"]
    assert all(order[6:][i:i + 4] == [timed[i // 4]] * 4 for i in range(0, 36, 4))
    (full_a, host_a), (full_s, host_s), (full_c, host_c) = times
    assert host_s >= 2000 and max(host_a, host_c) < 1000 and full_s >= host_s


def test_bare_launch(device):
    """The bound: the plan a call caches, its compiled kernel launched bare, gives the call's
    outputs; refused where no kernel is compiled (Triton's interpreter) and where the call is
    not one scan launch."""
    import functools
    fn = functools.partial(rl_triton.gae, backend="triton")
    kw, _ = registry.make_inputs("gae", 6, 40, "batch-major", torch.float32, False, device)
    with host_suite.launches() as seen:
        fn(**kw)
    assert len(seen) == 1 and seen[0][1]["x"][0].data_ptr() == kw["rewards"].data_ptr()
    if device == "cpu":
        with pytest.raises(SystemExit, match="gae: the bound needs the compiled kernel"):
            host_suite.bare_launch(fn, kw, "gae")
    else:
        launch, want = host_suite.bare_launch(fn, kw, "gae")
        got = launch()
        assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(SystemExit, match="0 scan launches in one call"):
        host_suite.bare_launch(functools.partial(rl_triton.gae, backend="torch"), kw, "torch")


def test_bare_launch_passes_the_replays_arguments(device, monkeypatch):
    """The bound launches the plan's compiled kernel with the arguments the plan's own replay
    (`Launch._replay`) passes it, the outputs' addresses aside: a stand-in compiled kernel
    records both (on the CPU too, where Triton compiles none)."""
    import functools
    from rl_triton.scan import launch as scan_launch

    class Compiled:  # what `Launch` uses of a compiled kernel
        function, packed_metadata = "function", "metadata"

        def __init__(self):
            self.calls = []

        def run(self, *args):
            self.calls.append(args)

    fn = functools.partial(rl_triton.gae, backend="triton")
    kw, _ = registry.make_inputs("gae", 6, 40, "batch-major", torch.float32, False, device,
                                 seed=5)
    fn(**kw)
    with host_suite.launches() as seen:
        fn(**kw)
    plan, args = seen[0]
    stand_in = Compiled()
    monkeypatch.setattr(plan, "compiled", stand_in)
    monkeypatch.setattr(plan, "tail", ("the constexprs",))
    monkeypatch.setattr(scan_launch, "_stream", lambda index: 7)
    monkeypatch.setattr(scan_launch, "_current_device", lambda: plan.device_index)
    outs = [torch.empty(s, dtype=plan.out_dtype, device=plan.device) for s in plan.output_shapes()]
    plan._replay(args["x"], outs, args["scalars"], None, None)
    launch, _ = host_suite.bare_launch(fn, kw, "gae")
    new = launch()

    def replaced(call, outputs):  # the outputs' addresses as a name
        ptrs = tuple(o.data_ptr() for o in outputs)
        assert sum(a == ptrs for a in call) == 1
        return tuple("outputs" if a == ptrs else a for a in call)

    assert len(new) == 2 and stand_in.calls[-1][-1] == "the constexprs"
    assert replaced(stand_in.calls[-1], new) == replaced(stand_in.calls[0], outs)


def _fake_anchor(folder, shift=0.0):
    """A folder holding a package named rl_triton that plays rl-triton 0.1.3's compute_gae
    (batch-major, float32 flags only), through ours, plus `shift`."""
    package = folder / "rl_triton"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('''
__version__ = "0.1.3"
from rl_triton.ops import compute_gae
''')
    (package / "ops.py").write_text(f'''
import sys
import torch


def compute_gae(rewards, values, terminateds, truncateds=None, gamma=0.99, lambda_=0.95,
                bootstrap_values=None, last_value=None):
    assert terminateds.dtype == torch.float32 and last_value.shape == rewards.shape[:1]
    ours = sys.modules["rl_triton"]  # at call time ours again
    return ours.gae(rewards, values, terminateds, last_value=last_value, gamma=gamma,
                    lam=lambda_, time_dim=1)[0] + {shift}
''')
    return folder


def test_anchor_load(tmp_path):
    """The anchor's package, also named rl_triton, imported from its folder beside ours: ours
    stays in sys.modules, the anchor's modules import each other."""
    import sys
    paper = anchor.load(_fake_anchor(tmp_path / "paper"))
    assert paper.__version__ == "0.1.3" and paper is not rl_triton
    assert sys.modules["rl_triton"] is rl_triton and sys.modules["rl_triton.bench.anchor"] is anchor
    # its own rl_triton.ops is out of sys.modules again, and its function keeps it
    assert sys.modules["rl_triton.ops"] is rl_triton.ops
    assert paper.compute_gae.__module__ == "rl_triton.ops"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ImportError, match="no package rl_triton in"):
        anchor.load(tmp_path / "empty")
    assert sys.modules["rl_triton"] is rl_triton


def _stub_host_timing(monkeypatch):
    """Timing stubbed, and the bound a plain call (no compiled kernel on the CPU)."""
    monkeypatch.setattr(timing, "interleaved_call_times_us",
                        lambda fns, rounds=7, calls=30, warmup=20: [(30.0, 20.0)] * len(fns))
    monkeypatch.setattr(host_suite, "bare_launch", lambda fn, kw, what="": (
        lambda: calls.as_tuple(fn(**kw)), calls.as_tuple(fn(**kw))))
    monkeypatch.setattr(registry, "HOST_OTHERS_SHAPE", "8x64")


def test_host_suite_runs(tmp_path, monkeypatch):
    """`run_host` end to end on the CPU: every cell checked (rl_triton against float64, the
    anchor against rl_triton) and timed, the anchor beside GAE only (it has no Retrace of our
    contract), the other ops after, bench.json marked as the host suite; a wrong anchor and a
    bound that computes something else are refused."""
    _stub_host_timing(monkeypatch)
    paper = anchor.load(_fake_anchor(tmp_path / "paper"))
    env = dict(_token_env(), launch_floor_host_us=6.0)
    host_suite.run_host(["gae", "retrace"], ["3x40", "8x64"], registry.LAYOUTS,
                        ["float32", "bfloat16"], ["bool", "float"], env, "cpu", tmp_path, None,
                        paper)
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["suite"] == "host"
    rows = result["rows"]
    grid = {(r["call"], r["shape"], r["layout"], r["dtype"], r["flags"], r["impl"])
            for r in rows if r["part"] == "grid"}
    want = {(name, shape, layout, dt, fl, impl) for name in ("gae", "retrace")
            for shape in ("3x40", "8x64") for layout in registry.LAYOUTS
            for dt in ("float32", "bfloat16") for fl in ("bool", "float")
            for impl in ("rl_triton", "bound")}
    want |= {("gae", shape, "batch-major", "float32", "float", "anchor")
             for shape in ("3x40", "8x64")}
    # GAE and Retrace twice, group, whiten, the losses, the zoo's
    assert len(rows) - len(grid) == 6 + len(registry.LOSS_CASES) + len(registry.HOST_ZOO)
    assert grid == want
    others = [r["call"] for r in rows if r["part"] == "others"]
    assert others == ["gae", "gae", "retrace", "retrace", "group_advantages", "masked_whiten"] + [
        case[0] for case in registry.LOSS_CASES] + [call for call, _, _ in registry.HOST_ZOO]
    assert all(r["rel_err"] < 1e-4 and r["host_us"] == 20.0 for r in rows)
    md = (tmp_path / "bench.md").read_text()
    assert "Host path (`--suite host`)" in md and "| gae | 8x64 | batch-major | float32 | float " \
        "| 20.0 | 20.0 | 1.00 | 30.0 | 30.0 | 1.00 | 1.00 | 20.0 / 30.0 |" in md
    assert (tmp_path / "host.png").exists()
    with pytest.raises(SystemExit, match="the anchor's gae 3x40: .* not timing a wrong result"):
        host_suite.run_host(["gae"], ["3x40"], ["time-major"], ["float32"], ["bool"], env, "cpu",
                            tmp_path, None, anchor.load(_fake_anchor(tmp_path / "bad", 1e-2)))
    monkeypatch.setattr(host_suite, "bare_launch", lambda fn, kw, what="": (
        lambda: [o + 1 for o in calls.as_tuple(fn(**kw))], calls.as_tuple(fn(**kw))))
    with pytest.raises(SystemExit, match="bare launch's outputs differ"):
        host_suite.run_host(["gae"], ["3x40"], ["time-major"], ["float32"], ["bool"], env, "cpu",
                            tmp_path, None)


def _host_rows():
    R = report.HostRow
    rows = []
    for layout, host, full in (("time-major", 20.0, 30.0), ("batch-major", 23.0, 33.0)):
        for flags in ("bool", "float"):
            rows += [R("grid", "gae", "", "4096x128", layout, "float32", flags, "rl_triton", host,
                       full, 1e-7),
                     R("grid", "gae", "", "4096x128", layout, "float32", flags, "bound", 10.0,
                       20.0, 0.0)]
    rows.append(R("grid", "gae", "", "4096x128", "batch-major", "float32", "float", "anchor",
                  40.0, 50.0, 1e-7))
    rows += [R("others", "gae", "", "4096x128", "time-major", "float32", "bool", "rl_triton",
               25.0, 35.0, 1e-7),
             R("others", "retrace", "", "4096x128", "time-major", "float32", "bool", "rl_triton",
               50.0, 60.0, 1e-7),
             R("others", "masked_whiten", "multi-turn mask", "4096x128", "", "float32", "",
               "rl_triton", 46.0, 70.0, 1e-7)]
    return [asdict(r) for r in rows]


def test_host_reports(tmp_path):
    """bench.md's host tables and host.png from a host-suite bench.json: each cell against the
    anchor and the bound, the layouts' ratio, the other ops against GAE, the targets."""
    env = dict(_token_env(), launch_floor_host_us=6.0,
               anchor=dict(path=".ab/paper/src", version="0.1.3"))
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(dict(env=env, suite="host", rows=_host_rows())))
    cli.main(["--report", str(path), "--out", str(tmp_path / "r")])
    md = (tmp_path / "r" / "bench.md").read_text()
    assert "launch floor 4.0 us device, 13.0 us full call, 6.0 us host." in md
    assert "Anchor: rl-triton 0.1.3 from .ab/paper/src." in md
    assert ("| gae | 4096x128 | batch-major | float32 | bool | 23.0 | 40.0 | 0.57 | 33.0 | 50.0 | "
            "0.66 | 1.15 | 10.0 / 20.0 |") in md
    assert ("| gae | 4096x128 | time-major | float32 | float | 20.0 | 40.0 | 0.50 | 30.0 | 50.0 | "
            "0.60 | 1.15 | 10.0 / 20.0 |") in md
    # against GAE's host in the same layout, batch-major where the op has none; GAE as timed
    # among the other ops where it was (time-major), else the grid's
    assert "| gae |  | time-major | float32 | bool | 25.0 | 35.0 | 1.00 |" in md
    assert "| retrace |  | time-major | float32 | bool | 50.0 | 60.0 | 2.00 |" in md
    assert "| masked_whiten | multi-turn mask |  | float32 |  | 46.0 | 70.0 | 2.00 |" in md
    worst = "(gae 4096x128 batch-major float32 bool flags)"
    assert f"| host <= 0.6x the anchor's | 4 of 4 | 0.57 {worst} | 0.25 |" in md
    assert f"| full call <= 0.75x the anchor's | 4 of 4 | 0.66 {worst} | 0.40 |" in md
    assert f"| host bm / tm within 10% | 0 of 2 | 1.15 {worst} | 1.00 |" in md
    assert f"| GAE at 4096x128: host <= 25 µs | 4 of 4 | 23.00 {worst} | 10.00 |" in md
    assert "| other ops: host <= 2x GAE's | 2 of 2 | 2.00 (retrace) |  |" in md
    assert (tmp_path / "r" / "host.png").stat().st_size > 1000
    without = [r for r in _host_rows() if r["impl"] != "anchor"]
    md = report.host_markdown(dict(env=_token_env(), suite="host", rows=without))
    assert "Anchor: none (--anchor-path not given)." in md and "the anchor's |" not in md
    assert ("| gae | 4096x128 | batch-major | float32 | bool | 23.0 |  |  | 33.0 |  |  | 1.15 | "
            "10.0 / 20.0 |") in md


def test_reports_with_host_time():
    """A result with host times shows them beside device and full-call time in every suite's
    tables (older results render as before: `test_default_report_unchanged`)."""
    env = dict(_token_env(), launch_floor_host_us=6.0)
    rows = [asdict(r) for r in _default_rows()]
    for r in rows:
        r["host_us"] = r["full_us"] - 6
    md = report.markdown(dict(env=env, rows=rows))
    assert "rl_triton, device / full-call / host µs (bandwidth fraction of copy):" in md
    assert "| gae | time-major | float32 | yes | 5 / 15 / 9 (0.50) | 8 / 20 / 14 (0.60) |" in md
    assert "| gae | time-major | float32 | yes |  | 10 / 30 / 24 (0.80) |" in md  # bwd
    assert md.endswith(report.HOST_NOTE + "\n")
    tokens_md = report.token_markdown(dict(env=env, rows=[
        asdict(report.TokenRow("gae", "512x4096", "float32", "dense", "rl_triton", 2**21, 10**7,
                               10.0, 20.0, 6.0, host_us=12.0)),
        asdict(report.TokenRow("group_advantages", "65536x8192", "float32", "group_size",
                               "rl_triton", 65536, 0, 9.0, 26.0, host_us=15.0))]))
    assert "| gae | 512x4096 | float32 | dense | 10.0 | 20.0 | 12.0 | 0.60 |  |  |  |" in tokens_md
    assert "| group_advantages | 65536x8192 | group_size | 9.0 | 26.0 | 15.0 | 2.00 |" in tokens_md
    loss_md = report.loss_markdown(dict(env=env, rows=[asdict(report.LossRow(
        "kl_penalty", "k3, clamp=10", "fwd+bwd", 2**20, "float32", "rl_triton", 2**24, 10.0,
        40.0, 8.0, 0.0, 0.0, 30.0))]))
    assert "| kl_penalty | k3, clamp=10 | fwd+bwd | 2^20 | float32 | 16.8 | 10.0 | 40.0 | 30.0 " \
        "| 0.80 |  |  |  |  |" in loss_md


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the suite would run")
def test_host_suite_cli(tmp_path):
    """Without a GPU the host suite refuses cleanly; its options (the anchor's folder too) are
    checked first."""
    paper = str(_fake_anchor(tmp_path / "paper"))
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        cli.main(["--suite", "host", "--anchor-path", paper, "--out", str(tmp_path)])
    for bad in (["--flags", "bool,int8"], ["--anchor-path", str(tmp_path / "out")]):
        with pytest.raises(SystemExit) as e:
            cli.main(["--suite", "host", *bad, "--out", str(tmp_path / "out")])
        assert e.value.code == 2
    # its default estimators: those rl-triton 0.1.3 has
    assert [e for e in registry.ESTIMATORS if e in anchor.CALLS] == [
        "gae", "lambda_returns", "discounted_returns", "vtrace", "eligibility_traces",
        "episodic_cumsum"]


# ---- the fused loss head (--suite head) ---------------------------------------------------------

def test_head_formulas_agree():
    """The suite's eager composition and token_log_probs + ppo_policy_loss compute
    linear_policy_loss's loss and gradients (float32 on the CPU, a small head)."""
    kw = head_suite.head_inputs(2048, "cpu", H=16, V=301, dtype=torch.float32)
    kw.pop("row_advantages")
    grads = {}
    for name, fn in (("ours", head_suite.ours_loss), ("eager", head_suite.eager_loss),
                     ("composed", head_suite.composed_loss)):
        h, w = (kw[k].detach().clone().requires_grad_() for k in ("hidden", "weight"))
        loss = fn(**dict(kw, hidden=h, weight=w))
        loss.backward()
        grads[name] = (loss.detach(), h.grad, w.grad)
    for other in ("eager", "composed"):
        for a, b in zip(grads["ours"], grads[other]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert kw["mask"].float().mean() < 0.95  # the padding is off


def test_head_reports(tmp_path):
    rows = [dict(tokens=4096, impl="rl_triton", ms=29.6, peak_gib=2.32, rel_err=0.0,
                 grad_rel_err=0.0, note=""),
            dict(tokens=4096, impl="liger", ms=float("nan"), peak_gib=float("nan"),
                 rel_err=float("nan"), grad_rel_err=float("nan"), note="not available")]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(dict(env=_token_env(), suite="head", rows=rows)))
    cli.main(["--report", str(path), "--out", str(tmp_path / "r")])
    md = (tmp_path / "r" / "bench.md").read_text()
    assert "| 4096 | rl_triton | 29.6 | 2.32 | 0.0e+00 | 0.0e+00 |  |" in md
    assert "| 4096 | liger | nan | nan | nan | nan | not available |" in md
    assert (tmp_path / "r" / "head.png").stat().st_size > 1000


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the suite would run")
def test_head_suite_cli(tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        cli.main(["--suite", "head", "--out", str(tmp_path)])
    for bad in ("1000", "4096x128", "0"):
        with pytest.raises(SystemExit) as e:
            cli.main(["--suite", "head", "--shapes", bad, "--out", str(tmp_path)])
        assert e.value.code == 2


# ---- the LLM zoo (--suite llm) -----------------------------------------------------------------

def _stub_llm(monkeypatch):
    """Timing, torch.compile (inductor builds C++ on the CPU: minutes) and the kernel count
    (torch.profiler's CUDA activity) stubbed; the drop-ins on the Triton backend (the
    interpreter on the CPU), as they run on the GPU."""
    from rl_triton.integrations import openrlhf as our_orl
    from rl_triton.integrations import verl as our_verl
    _stub_timing(monkeypatch)
    # the frameworks' calls too: a loop slower than FAST_US is timed in full call only, which
    # on a GPU (a 37-step Python loop of launches) it is
    monkeypatch.setattr(timing, "full_call_us", lambda fn, calls=200, warmup=20: 20.0)
    monkeypatch.setattr(llm_suite, "kernel_launches", lambda fn: 1)
    for module in (our_verl, our_orl):
        monkeypatch.setattr(module, "backend", "triton")
    return our_verl


def _llm_keys(rows):
    return {(r["group"], r["framework"], r["call"], r["variant"], r["impl"]) for r in rows}


def test_llm_suite_runs(tmp_path, monkeypatch, device):
    """`run_llm` end to end at a small, odd shape: every zoo entry's drop-in beside the
    framework's own function (and torch.compile of it for the KL estimators and the losses),
    each checked against the framework's result, bench.json marked as the llm suite, its table
    and plot written."""
    fw = _frameworks()
    _stub_llm(monkeypatch)
    llm_suite.run_llm(["9x37"], _token_env(), device, tmp_path, None, 60.0)
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["suite"] == "llm"
    rows = result["rows"]
    keys = _llm_keys(rows)
    from rl_triton.integrations import verl as our_verl
    for _, key, _ in our_verl.ESTIMATORS:  # verl's whole registry
        assert {("estimator", "verl", key, "", impl) for impl in ("eager", "rl_triton")} <= keys
    for name in ("get_advantages_and_returns", "get_cumulative_returns"):
        assert ("estimator", "openrlhf", name, "", "rl_triton") in keys
    losses = [k for k in fw.verl.POLICY_LOSS_REGISTRY if k != "bypass_mode"]
    for name in losses:
        assert {("policy loss", "verl", name, impl) for impl in ("eager", "rl_triton", "compile")} \
            <= {k[:3] + k[4:] for k in keys}
    assert {k[3] for k in keys if k[2] == "PolicyLoss"} == {"ppo, dual_clip=3", "gspo"}
    assert {k[3] for k in keys if k[2] == "kl_penalty" and k[4] == "compile"} == {
        "low_var_kl", "k3+", "k1"}
    assert sum(k[4] == "rl_triton op" for k in keys) == 2  # rollout_correction, two levels
    assert len(rows) == 16 * 2 + 5 * 3 + 3 * 2 + 2 + (len(losses) + 2) * 3
    for r in rows:
        assert r["note"] == "" and r["full_us"] > 0, r
        assert r["rel_err"] < llm_suite.OUTPUT_TOL, r
        assert (r["grad_rel_err"] < llm_suite.GRAD_TOL) == (r["mode"] == "fwd+bwd"), r
        assert (r["launches"] == 1) == (r["impl"] == "rl_triton op"), r
    md = (tmp_path / "bench.md").read_text()
    assert "LLM zoo (`--suite llm`" in md
    assert "| estimator | verl | gae |  | fwd | 9x37 | rl_triton | 10.0 / 20.0 / 8.0 | 20.0 | " \
        "1.0x (1.0x) |  |  |" in md
    assert "| >= 100x eager | 9x37 | 0 of 16 |" in md  # the stubbed times: all equal
    assert "| >= 3x eager | 9x37 | 0 of 13 |" in md and "| >= 1x compile | 9x37 | 13 of 13 |" in md
    assert "| 1 launch | 9x37 | 2 of 2 |" in md
    assert (tmp_path / "llm.png").stat().st_size > 1000


def test_llm_suite_refuses_wrong_results_and_keeps_going(tmp_path, monkeypatch, device):
    """A drop-in that differs from its framework is not timed (its row says by how much) and
    the other cells are; a compile that fails is a row that says so; without the budget for the
    frameworks' calls nothing is timed (no reference to check against); --max-seconds stops."""
    _frameworks()
    our_verl = _stub_llm(monkeypatch)
    rloo = our_verl.compute_rloo_vectorized_outcome_advantage
    monkeypatch.setattr(our_verl, "compute_rloo_vectorized_outcome_advantage",
                        lambda *a, **k: tuple(1.01 * t for t in rloo(*a, **k)))

    def no_compile(f):
        raise RuntimeError("inductor: no C++ compiler\nmore")
    monkeypatch.setattr(loss_suite, "compiled_formula", no_compile)
    llm_suite.run_llm(["9x37"], _token_env(), device, tmp_path, None, 60.0)
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    wrong = [r for r in rows if r["note"].startswith("not timed: differs")]
    assert [(r["call"], r["impl"]) for r in wrong] == [("rloo_vectorized", "rl_triton")]
    assert 9e-3 < wrong[0]["rel_err"] < 1.1e-2 and wrong[0]["full_us"] != wrong[0]["full_us"]
    failed = [r for r in rows if r["impl"] == "compile"]
    assert failed and all(r["note"] == "compile failed: RuntimeError: inductor: no C++ compiler"
                          for r in failed)
    md = (tmp_path / "bench.md").read_text()
    assert "| estimator | verl | rloo_vectorized |  | fwd | 9x37 | rl_triton |  | 20.0 |  |" in md
    assert "compile failed: RuntimeError" in md

    llm_suite.run_llm(["9x37"], _token_env(), device, tmp_path, None, 0.0)
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert rows and all(r["full_us"] != r["full_us"] for r in rows)
    assert {r["note"] for r in rows} == {"over --frameworks-max-seconds",
                                         "not timed: no framework result to check it against"}
    llm_suite.run_llm(["9x37"], _token_env(), device, tmp_path, 0.0, 60.0)  # --max-seconds 0
    assert json.loads((tmp_path / "bench.json").read_text())["rows"] == []
    llm_suite.run_llm(["9x37", "8x24"], _token_env(), device, tmp_path, None, 60.0,
                      groups=["rollout_correction"])  # --groups
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert {(r["group"], r["shape"]) for r in rows} == {("rollout correction", "9x37"),
                                                       ("rollout correction", "8x24")}


def test_llm_reports(tmp_path):
    """bench.md's zoo table from a bench.json: speed-ups over eager and compile, each row's
    target met or missed, the targets' summary; llm.png."""
    def row(group, fw, call, variant, mode, impl, dev, full, shape="512x4096", **kw):
        return asdict(llm_suite.LlmRow(group, fw, call, variant, mode, shape, impl, dev, full,
                                       full / 2, 0.0, **kw))
    nan = float("nan")
    rows = [row("estimator", "verl", "gae", "", "fwd", "eager", nan, 755000.0),
            row("estimator", "verl", "gae", "", "fwd", "rl_triton", 10.0, 30.0),
            row("estimator", "verl", "grpo_vectorized", "", "fwd", "eager", 100.0, 900.0),
            row("estimator", "verl", "grpo_vectorized", "", "fwd", "rl_triton", 10.0, 30.0),
            row("policy loss", "verl", "vanilla", "token-mean", "fwd+bwd", "eager", 400.0,
                600.0, grad_rel_err=0.0),
            row("policy loss", "verl", "vanilla", "token-mean", "fwd+bwd", "rl_triton", 50.0,
                150.0, grad_rel_err=1e-7),
            row("policy loss", "verl", "vanilla", "token-mean", "fwd+bwd", "compile", 60.0,
                200.0, grad_rel_err=1e-7),
            row("policy loss", "verl", "gspo", "token-mean", "fwd+bwd", "eager", 400.0, 600.0,
                grad_rel_err=0.0),
            row("policy loss", "verl", "gspo", "token-mean", "fwd+bwd", "rl_triton", 50.0,
                300.0, grad_rel_err=1e-7),
            row("policy loss", "verl", "gspo", "token-mean", "fwd+bwd", "compile", nan, nan,
                note="compile failed: X"),
            row("rollout correction", "verl", "compute_rollout_correction_weights", "token",
                "fwd", "eager", 200.0, 800.0),
            row("rollout correction", "verl", "compute_rollout_correction_weights", "token",
                "fwd", "rl_triton op", 8.0, 20.0, launches=1.0),
            row("estimator", "verl", "gae", "", "fwd", "eager", nan, nan, shape="64x32768",
                note="over --frameworks-max-seconds")]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(dict(env=_token_env(), suite="llm", rows=rows)))
    cli.main(["--report", str(path), "--out", str(tmp_path / "r")])
    md = (tmp_path / "r" / "bench.md").read_text()
    assert ("| estimator | verl | gae |  | fwd | 512x4096 | rl_triton | 10.0 / 30.0 / 15.0 | "
            "755000.0 | 25166.7x |  |  | 0.0e+00 | >= 100x eager | met (2.52e+04) |  |") in md
    assert ("| estimator | verl | grpo_vectorized |  | fwd | 512x4096 | rl_triton | "
            "10.0 / 30.0 / 15.0 | 900.0 | 30.0x (10.0x) |") in md
    assert "| >= 100x eager | missed (30) |" in md
    assert ("| 50.0 / 150.0 / 75.0 | 600.0 | 4.0x (8.0x) | 200.0 | 1.3x (1.2x) | "
            "0.0e+00 (1.0e-07) | >= 3x eager; >= 1x compile | met (4); met (1.33) |  |") in md
    # no compiled time: the eager target alone, the failure in the note
    assert "| 2.0x (8.0x) |  |  | 0.0e+00 (1.0e-07) | >= 3x eager | missed (2) " \
        "| compile failed: X |" in md
    assert "| rl_triton op | 8.0 / 20.0 / 10.0 | 800.0 | 40.0x (25.0x) |" in md
    assert "| 1 launch | met (1) |" in md
    assert "| >= 100x eager | 512x4096 | 1 of 2 | 30 (verl grpo_vectorized) |" in md
    assert "| >= 3x eager | 512x4096 | 1 of 2 | 2 (verl gspo token-mean) |" in md
    assert "| >= 1x compile | 512x4096 | 1 of 1 | 1.33 (verl vanilla token-mean) |" in md
    assert "| 1 launch | 512x4096 | 1 of 1 | 1 (verl compute_rollout_correction_weights token) |" \
        in md
    assert "64x32768" not in md.split("The targets:")[1]  # nothing measured there
    assert (tmp_path / "r" / "llm.png").stat().st_size > 1000


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the suite would run")
def test_llm_suite_cli(tmp_path):
    """Without a GPU the suite refuses cleanly, after its options: shapes B x T, the frameworks'
    folder."""
    _frameworks()
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        cli.main(["--suite", "llm", "--shapes", "9x37", "--out", str(tmp_path)])
    for bad in (["--shapes", "4096"], ["--shapes", "8x16"], ["--groups", "kl,losses"],
                ["--frameworks-path", str(tmp_path / "none")]):
        with pytest.raises(SystemExit) as e:
            cli.main(["--suite", "llm", *bad, "--out", str(tmp_path)])
        assert e.value.code == 2
