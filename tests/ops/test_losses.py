"""What the losses (semantics §9) share, in tests that call several of them at once: masks and
aggregations, NaN and masked non-finite inputs, gradients, empty inputs, 64-bit indexing, offsets
read on every call, CleanRL's PPO lines, torch.compile, the custom ops, bad input; their large
shapes on a CUDA device (marked gpu_large). Each loss's own tests: tests/ops/test_<loss>.py."""
import pytest
import torch

import rl_triton
from cases import rel_err
from conftest import DEVICE
from op_checks.bounds import bounds_checked
from loss_cases import (AGGREGATIONS, BACKENDS, CU, SEQ_MODES, assert_close, both_ways,
                        check_against_spec, cleanrl_ppo, grads_of, leaves, ppo_case, randn,
                        random_mask, sac_case, spec_crr, spec_kl, spec_ppo, spec_sac, spec_value)

# ---- semantics -----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_empty_selection_is_zero(aggregation, backend, device):
    """No position counts: the loss is 0 (not NaN) and so are its gradients; a row without a
    position that counts is left out of the mean over sequences."""
    lp, old, adv = leaves(*ppo_case((3, 7), dtype=torch.float32, device=device))
    none = torch.zeros(3, 7, dtype=torch.bool, device=device)
    loss, clip, kl = rl_triton.ppo_policy_loss(lp, old, adv, none, aggregation=aggregation,
                                               backend=backend)
    assert loss.abs().sum().item() == 0 and clip.item() == 0 and kl.item() == 0
    (loss.sum() + kl).backward()
    assert lp.grad.abs().sum() == 0 and adv.grad.abs().sum() == 0
    v = rl_triton.value_loss(lp, old, mask=none, aggregation=aggregation, backend=backend)
    assert v.abs().sum().item() == 0
    if aggregation in SEQ_MODES:
        one_row = none.clone()
        one_row[1] = True
        full = rl_triton.ppo_policy_loss(lp, old, adv, one_row, aggregation=aggregation,
                                         backend=backend)[0]
        alone = rl_triton.ppo_policy_loss(lp[1:2], old[1:2], adv[1:2],
                                          aggregation=aggregation, backend=backend)[0]
        assert abs(full.item() - alone.item()) < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("packed_rows,aggregation", [(False, a) for a in AGGREGATIONS]
                         + [(True, a) for a in SEQ_MODES])
def test_mask_is_binary(packed_rows, aggregation, backend, device):
    """The mask is set where nonzero: 0.5, 2.0 and -3.0 count as 1 (a weight goes in through
    the inputs, not the mask), the same losses, metrics and gradients bit for bit as a bool
    mask; a sequence without a set position (a masked-out row or segment, an empty segment)
    does not count in the mean over sequences."""
    shape = (37,) if packed_rows else (4, 9)
    lp, old, adv = ppo_case(shape, dtype=torch.float32, device=device)
    mask = random_mask(shape, 3, device)
    kw = dict(aggregation=aggregation)
    if packed_rows:
        kw["cu_seqlens"] = torch.tensor(CU, device=device)
        mask[5:20] = False  # segment 2 (segment 1 is empty)
    else:
        mask[2] = False
    weights = torch.tensor([0.5, 2.0, -3.0], device=device)[torch.arange(mask.numel(),
                                                                         device=device) % 3]
    results = []
    for m in (mask, torch.where(mask, weights.view(shape), 0.0)):
        xs = leaves(lp, old, adv)
        outs = rl_triton.ppo_policy_loss(*xs, m, **kw, backend=backend)
        v = leaves(lp, adv, old)
        outs = (*outs, rl_triton.value_loss(*v, m, clip=0.2, **kw, backend=backend))
        results.append([o.detach() for o in outs] + grads_of(outs, xs + v))
    for a, b in zip(*results):
        if backend == "torch" and a.is_cuda:  # its segment sums: index_add's atomics on CUDA
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
        else:
            assert torch.equal(a, b), (a, b)
    if aggregation in SEQ_MODES:  # the mean over the sequences with a set position
        l = -adv * torch.exp(lp - old)
        l = torch.maximum(l, -adv * torch.exp(lp - old).clamp(0.8, 1.2))
        seqs = ([slice(a, b) for a, b in zip(CU[:-1], CU[1:])] if packed_rows
                else [slice(b, b + 1) for b in range(4)])
        per = [l[s][mask[s]].sum() / (mask[s].sum() if aggregation.endswith("mean") else 1)
               for s in seqs if mask[s].any()]
        assert len(per) < len(seqs)
        assert abs(results[0][0].item() - (sum(per) / len(per)).item()) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan(backend, device):
    """A NaN at a position that counts gives NaN (a NaN ratio is never clipped); at a masked
    position it reaches nothing."""
    lp, old, adv = ppo_case((2, 6), dtype=torch.float32, device=device)
    lp[0, 2] = float("nan")
    mask = torch.ones(2, 6, dtype=torch.bool, device=device)
    per = rl_triton.ppo_policy_loss(lp, old, adv, mask, aggregation="none", backend=backend)[0]
    assert per[0, 2].isnan() and per.isnan().sum() == 1
    assert rl_triton.ppo_policy_loss(lp, old, adv, mask, backend=backend)[0].isnan()
    mask[0, 2] = False
    out = rl_triton.ppo_policy_loss(lp, old, adv, mask, dual_clip=3.0, backend=backend)
    assert all(o.isfinite() for o in out)
    assert rl_triton.value_loss(lp, old, old, mask, clip=0.2, backend=backend).isfinite()
    assert rl_triton.kl_penalty(lp, old, "k3", 10.0, backend=backend).isnan().sum() == 1
    case = sac_case(6, 2, device=device)
    case["next_q_values"][1, 0] = float("nan")
    case["terminated"][:] = False
    case["terminated"][3] = True
    case["next_q_values"][3, 1] = float("nan")  # terminal: its bootstrap is dropped (a select)
    y = rl_triton.sac_targets(**case, backend=backend)
    assert y[1].isnan() and y.isnan().sum() == 1
    q = torch.zeros(4, device=device)
    sampled = torch.randn(4, 3, device=device)
    sampled[2, 1] = float("nan")
    for kind in ("exp", "binary"):
        for baseline in ("mean", "max"):
            w = rl_triton.crr_weights(q, sampled, kind=kind, baseline=baseline,
                                      backend=backend)
            assert w[2].isnan() and w.isnan().sum() == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_input_gets_its_gradient_and_none_is_written(backend, device):
    """No silent detach; inputs never modified; outputs in out_dtype; second order refused."""
    lp, old, adv = ppo_case((4, 9), dtype=torch.float32, device=device)
    mask = random_mask((4, 9), 2, device)
    xs = leaves(lp, old, adv)
    before = [x.detach().clone() for x in xs]
    loss, clip, kl = rl_triton.ppo_policy_loss(*xs, mask, out_dtype=torch.float64,
                                               backend=backend)
    assert loss.dtype == clip.dtype == kl.dtype == torch.float64
    assert loss.requires_grad and kl.requires_grad and not clip.requires_grad
    (loss + kl).backward()
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in xs)
    assert all(torch.equal(x.detach(), b) for x, b in zip(xs, before))
    v, ret, vold = leaves(lp, adv, old)
    rl_triton.value_loss(v, ret, vold, mask, clip=0.1, backend=backend).backward()
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in (v, ret, vold))
    vold.grad = None  # without a clip the old values are unread: a zero gradient, not None
    rl_triton.value_loss(v.detach(), ret.detach(), vold, mask, backend=backend).backward()
    assert vold.grad is not None and not vold.grad.any()
    case = sac_case(9, 2, 3, device=device)
    floats = {k: leaves(t)[0] for k, t in case.items() if t.is_floating_point()}
    alpha = torch.tensor(0.2, device=device, requires_grad=True)
    rl_triton.sac_targets(**dict(case, **floats), alpha=alpha, backend=backend).sum().backward()
    assert all(t.grad is not None for t in floats.values()) and alpha.grad is not None
    a, b = leaves(lp, old)
    out = rl_triton.kl_penalty(a, b, backend=backend)
    with pytest.raises(RuntimeError, match="first-order"):
        torch.autograd.grad(out.sum(), a, create_graph=True)
    with pytest.raises(RuntimeError, match="mask requires grad"):
        rl_triton.ppo_policy_loss(lp, old, adv, mask.float().requires_grad_(), backend=backend)


def _differentiable_calls(backend, device):
    """(name, leaves, outputs) of every op of semantics §8 to 11 with a gradient."""
    lp, old, adv = leaves(*ppo_case((4, 9), dtype=torch.float32, device=device))
    mask = random_mask((4, 9), 2, device)
    yield "ppo_policy_loss", [lp, old, adv], rl_triton.ppo_policy_loss(
        lp, old, adv, mask, backend=backend)
    yield "policy_loss", [lp, old, adv], rl_triton.policy_loss(
        lp, old, adv, mask, backend=backend)[:1]
    yield "value_loss", [lp, old, adv], rl_triton.value_loss(lp, old, adv, mask, clip=0.1,
                                                             backend=backend)
    yield "kl_penalty", [lp, old], rl_triton.kl_penalty(lp, old, backend=backend)
    case = sac_case(9, 2, 3, device=device)
    floats = {k: leaves(t)[0] for k, t in case.items() if t.is_floating_point()}
    yield "sac_targets", list(floats.values()), rl_triton.sac_targets(**dict(case, **floats),
                                                                      backend=backend)
    yield "masked_whiten", [lp], rl_triton.masked_whiten(lp, mask, backend=backend)
    s = leaves(randn((6,), 3, device=device))[0]
    yield "group_advantages", [s], rl_triton.group_advantages(s, group_size=3, backend=backend)
    if backend != "loop":  # (the fused head has the torch and triton backends)
        h, w = leaves(randn((7, 8), 4, device=device), randn((11, 8), 5, device=device))
        labels = torch.randint(0, 11, (7,), generator=torch.Generator().manual_seed(0))
        yield "token_log_probs", [h, w], rl_triton.token_log_probs(
            h, w, labels.to(device), return_entropy=True, backend=backend)
        yield "linear_policy_loss", [h, w], rl_triton.linear_policy_loss(
            h, w, labels.to(device), lp[0, :7].detach(), adv[0, :7].detach(),
            entropy_coef=0.1, backend=backend)[:1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_undefined_output_gradients(backend, device):
    """Outputs whose gradients are undefined (autograd's None, as gradcheck's
    check_undefined_grad passes) count as zeros: no input gets a nonzero gradient, and no
    backward fails or reads another tensor in the gradient's place."""
    undefined = torch._C._functions.UndefinedGrad()
    for name, xs, out in _differentiable_calls(backend, device):
        out = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
        got = torch.autograd.grad([undefined(o) for o in out], xs,
                                  [torch.ones_like(o) for o in out], allow_unused=True)
        assert all(g is None or not g.any() for g in got), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_second_order_refused_everywhere(backend, device):
    """Second-order gradients raise on every backend (the torch and loop backends'
    autograd through torch ops included)."""
    for name, xs, out in _differentiable_calls(backend, device):
        out = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
        with pytest.raises(RuntimeError, match="first-order gradients only"):
            torch.autograd.grad(sum(o.sum() for o in out), xs[0], create_graph=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_metrics_edited_in_place_leave_the_backward(backend, device):
    """A returned metric (no gradient) edited in place, as a trainer's all-reduce or scaling
    does, neither breaks the backward nor changes the gradients: the backward keeps none of
    them."""
    lp, old, adv = ppo_case((4, 9), dtype=torch.float32, device=device)
    mask = random_mask((4, 9), 2, device)
    for fn in (lambda *x: rl_triton.ppo_policy_loss(*x, mask, backend=backend),
               lambda *x: rl_triton.policy_loss(*x, mask, dual_clip=3.0, backend=backend)):
        grads = []
        for edit in (False, True):
            xs = leaves(lp, old, adv)
            loss, *rest = fn(*xs)
            metrics = list(rest[0].values()) if isinstance(rest[0], dict) else rest
            kept = [m.clone() for m in metrics]
            if edit:
                for m in metrics:
                    if not m.requires_grad:
                        m.mul_(2.0)
            loss.backward()
            grads.append([x.grad for x in xs])
            if edit:
                assert any(not torch.equal(m, k) for m, k in zip(metrics, kept))
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_non_finite_reaches_no_gradient(backend, device):
    """An inf advantage (PPO) or a NaN return (value loss) at a masked position: the loss and
    every gradient are those of a finite value there, the masked positions' gradients 0."""
    lp, old, adv = ppo_case((3, 7), dtype=torch.float32, device=device)
    mask = random_mask((3, 7), 4, device)
    mask[1, 2] = False
    for op, inputs, spoilt in [
            (lambda x: rl_triton.ppo_policy_loss(*x, mask, backend=backend)[::2],
             (lp, old, adv), 2),
            (lambda x: (rl_triton.value_loss(*x, mask, clip=0.2, backend=backend),),
             (lp, old, adv), 1)]:
        results = []
        for value in (0.5, float("inf"), float("nan")):
            xs = [t.clone() for t in inputs]
            xs[spoilt][1, 2] = value
            xs = leaves(*xs)
            outs = op(xs)
            results.append([o.detach() for o in outs] + grads_of(outs, xs))
        for got in results[1:]:
            for a, b in zip(got, results[0]):
                assert a.isfinite().all() and torch.equal(a, b), (a, b)
        assert all((g[~mask] == 0).all() for g in results[0][-3:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_inputs(backend, device):
    for shape in [(0,), (2, 0)]:
        xs = leaves(*ppo_case(shape, dtype=torch.float32, device=device))
        for aggregation in AGGREGATIONS:
            if aggregation in SEQ_MODES and len(shape) == 1:
                continue
            loss, clip, kl = rl_triton.ppo_policy_loss(*xs, aggregation=aggregation,
                                                       backend=backend)
            assert loss.shape == (shape if aggregation == "none" else ())
            (loss.sum() + kl).backward()
            assert xs[0].grad.shape == shape
            assert rl_triton.value_loss(*xs[:2], aggregation=aggregation,
                                        backend=backend).sum().item() == 0
        assert rl_triton.kl_penalty(*xs[:2], backend=backend).shape == shape
    case = sac_case(0, 2, 3, device=device)
    assert rl_triton.sac_targets(**case, backend=backend).shape == (0,)
    assert rl_triton.crr_weights(torch.zeros(0, device=device), torch.zeros(0, 4, device=device),
                                 backend=backend).shape == (0,)


def test_last_program_finish(device):
    """The forward kernels add their programs' partial sums in their last program, which puts
    its stream's ticket back to 0: one program, several (more than a pass of the finish's rows
    on a GPU), none; results as the torch backend's, and the same bits on a second call."""
    from rl_triton.ops import _last_program

    sizes = [(1, 5), (7, 333), (0, 4)] + ([(1100, 2048)] if device == "cuda" else [(3, 2048)])
    for B, T in sizes:
        lp, old, adv = (torch.randn(B, T, generator=torch.Generator().manual_seed(i)).to(device)
                        for i in range(3))
        mask = torch.rand(B, T, generator=torch.Generator().manual_seed(3)).to(device) < 0.7

        def run(backend):
            return (*rl_triton.ppo_policy_loss(lp, old, adv, mask, backend=backend),
                    rl_triton.value_loss(lp, old, adv, mask, backend=backend),
                    *rl_triton.policy_loss(lp, old, adv, mask, loss_type="sapo",
                                           backend=backend, out_dtype=torch.float32)[1].values(),
                    rl_triton.policy_loss(lp, old, adv, mask, backend=backend)[0])

        first, again, want = run("triton"), run("triton"), run("torch")
        for a, b, w in zip(first, again, want):
            assert torch.equal(a, b)
            # (float32 sums in another order: up to 2.25M positions on a GPU)
            torch.testing.assert_close(a, w.to(a.dtype), rtol=1e-4, atol=1e-6)
    tickets = [t for key, (_, t) in _last_program._SCRATCH.items() if key[0].type == device]
    assert tickets and all(t.item() == 0 for t in tickets)


def test_64_bit_indexing(monkeypatch, device):
    """The kernels' 64-bit indexing (tensors past 2^31 elements), taken here at small shapes."""
    from rl_triton.ops import _losses
    monkeypatch.setattr(_losses, "INT32_MAX", 16)
    xs = leaves(*ppo_case((5, 50), dtype=torch.float32, device=device))
    mask = random_mask((5, 50), 1, device)
    check_against_spec(
        lambda *xs: rl_triton.ppo_policy_loss(*xs, mask, aggregation="seq-mean-token-mean",
                                              backend="triton"),
        lambda *xs: spec_ppo(*xs, mask, aggregation="seq-mean-token-mean"), xs)
    check_against_spec(lambda *xs: rl_triton.value_loss(*xs, mask, clip=0.2, backend="triton"),
                       lambda *xs: spec_value(*xs, mask, clip=0.2), xs)
    check_against_spec(lambda a, b: rl_triton.kl_penalty(a, b, backend="triton"),
                       lambda a, b: spec_kl(a, b, "k3"), xs[:2])
    case = sac_case(37, 2, 5, device=device)
    names = [k for k, v in case.items() if v.is_floating_point()]
    check_against_spec(
        lambda *xs: rl_triton.sac_targets(**dict(case, **dict(zip(names, xs))), backend="triton"),
        lambda *xs: spec_sac(xs[0], case["terminated"], *xs[1:3], gamma=0.99, alpha=0.2,
                             probs=xs[3]), leaves(*(case[k] for k in names)))
    q, sampled = randn((37,), 1, device=device), randn((37, 5), 2, device=device)
    assert_close(rl_triton.crr_weights(q, sampled, backend="triton"), spec_crr(q, sampled), 1e-6)


# ---- CleanRL's PPO lines -------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cleanrl_ppo(backend, device):
    """CleanRL's pg_loss, v_loss and approx_kl (its clipfracs counts |ratio - 1| > clip_coef
    whatever the advantage's sign: not ours, not compared)."""
    lp, old, adv = ppo_case((256,), seed=2, dtype=torch.float32)
    v, ret = randn((256,), 3), randn((256,), 4)
    old_v = v + randn((256,), 5, 0.3)

    def ours(lp, old, adv, v, old_v, ret):
        pg, _, kl = rl_triton.ppo_policy_loss(lp, old, adv, backend=backend)
        return pg, rl_triton.value_loss(v, ret, old_v, clip=0.2, backend=backend), kl
    both_ways(ours, lambda *xs: cleanrl_ppo(*xs, clip_coef=0.2), (lp, old, adv, v, old_v, ret), device)


# ---- torch.compile -------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fullgraph_compile(backend, device):
    """Every loss inside one compiled step, forward and backward, without graph breaks (the
    kernels as custom ops; aot_eager on the CPU), equal to the eager step."""
    lp0, old, adv = ppo_case((5, 50), dtype=torch.float32, device=device)
    mask = random_mask((5, 50), 1, device)
    sac = sac_case(37, 2, 4, device=device)
    q, sampled = randn((37,), 2, device=device), randn((37, 5), 3, device=device)
    packed_x = ppo_case((37,), seed=5, dtype=torch.float32, device=device)
    cu = torch.tensor(CU, device=device)

    def step(lp, q_next, alpha):
        pg, clip, kl = rl_triton.ppo_policy_loss(lp, old, adv, mask, dual_clip=3.0,
                                                 aggregation="seq-mean-token-mean",
                                                 backend=backend)
        v = rl_triton.value_loss(lp, adv, old, mask, clip=0.2, kind="huber", backend=backend)
        k = rl_triton.kl_penalty(lp, old, "k3", 10.0, backend=backend)
        y = rl_triton.sac_targets(sac["rewards"], sac["terminated"], q_next,
                                  sac["next_log_probs"], alpha=alpha,
                                  next_probs=sac["next_probs"], backend=backend)
        w = rl_triton.crr_weights(q, sampled, backend=backend)
        packed_loss = rl_triton.ppo_policy_loss(*packed_x, cu_seqlens=cu,
                                                aggregation="seq-mean-token-sum",
                                                backend=backend)[0]
        return pg + v + (k * mask).mean() + kl + y.sum() + packed_loss, clip, w

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (step, compiled):
        xs = leaves(lp0, sac["next_q_values"], torch.tensor(0.2, device=device))
        total, clip, w = fn(*xs)
        total.backward()
        results.append([total.detach(), clip, w] + [x.grad for x in xs])
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_the_hot_path_still_checks(backend, device):
    """A repeated call finds its plan (one per signature), and still checks what its signature
    does not fix: the offsets' values; a new option value or type is a new signature, checked
    (docs/dev/op-framework.md)."""
    from rl_triton._core import plans
    lp, old, adv = (torch.randn(12, device=device) for _ in range(3))
    cu = torch.tensor([0, 5, 12], device=device)
    kw = dict(cu_seqlens=cu, aggregation="seq-mean-token-mean", backend=backend)
    plans.clear_plans()
    first = rl_triton.ppo_policy_loss(lp, old, adv, **kw)
    again = rl_triton.ppo_policy_loss(lp, old, adv, **kw)
    assert len(plans._PLANS) == 1
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    cu[1] = 13  # in place: no signature changes
    with pytest.raises(ValueError, match="never decrease"):
        rl_triton.ppo_policy_loss(lp, old, adv, **kw)
    cu[1] = 5
    with pytest.raises(ValueError, match="clip_low"):
        rl_triton.ppo_policy_loss(lp, old, adv, clip_low=2.0, **kw)
    with pytest.raises(TypeError, match="check_offsets"):
        rl_triton.ppo_policy_loss(lp, old, adv, check_offsets=1, **kw)
    with pytest.raises(ValueError, match="clip needs old_values"):
        rl_triton.value_loss(lp, adv, clip=0.2, backend=backend)
    # old_values unread without a clip: set aside by the check, on the hot path too
    for _ in range(2):
        torch.testing.assert_close(rl_triton.value_loss(lp, adv, old, backend=backend),
                                   rl_triton.value_loss(lp, adv, backend=backend))


def test_custom_ops_are_registered():
    from rl_triton._core.op import OPS, ops
    assert ops("loss") == ["ppo_policy_loss", "policy_loss", "value_loss", "kl_penalty",
                           "sac_targets", "crr_weights", "rollout_correction"]
    for name in ops("loss"):
        assert hasattr(torch.ops.rl_triton, name)
        assert hasattr(torch.ops.rl_triton, name + "_backward") == (
            name not in ("crr_weights", "rollout_correction"))
        assert OPS[name].function is getattr(rl_triton, name)


# ---- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input(backend):
    lp, old, adv = ppo_case((3, 7), dtype=torch.float32)

    def raises(exc, match, fn, *args, **kw):
        with pytest.raises(exc, match=match):
            fn(*args, **kw, backend=backend)

    ppo = rl_triton.ppo_policy_loss
    raises(ValueError, r"old_log_probs has shape \(3, 6\) but log_probs has shape \(3, 7\)", ppo,
           lp, old[:, :6], adv)
    raises(ValueError, r"mask has shape \(7,\)", ppo, lp, old, adv, torch.ones(7))
    raises(TypeError, "advantages has dtype torch.int64", ppo, lp, old, adv.long())
    raises(TypeError, "log_probs must be a torch.Tensor", ppo, [0.0], old, adv)
    raises(ValueError, "old_log_probs is on meta but log_probs is on cpu", ppo, lp,
           old.to("meta"), adv)
    raises(ValueError, "aggregation must be one of", ppo, lp, old, adv, aggregation="mean")
    raises(ValueError, r"clip_low=1.5 is outside \[0.0, 1.0\]", ppo, lp, old, adv,
           clip_low=1.5)
    raises(ValueError, r"dual_clip=1.0 is outside \(1.0, inf\)", ppo, lp, old, adv,
           dual_clip=1.0)
    raises(ValueError, "log_ratio_clamp=0.0 is outside", ppo, lp, old, adv, log_ratio_clamp=0.0)
    raises(ValueError, "averages over sequences", ppo, lp[0], old[0], adv[0],
           aggregation="seq-mean-token-mean")
    raises(ValueError, r"with cu_seqlens the inputs are packed sequences \[L\]", ppo, lp, old,
           adv, cu_seqlens=torch.tensor([0, 21]))
    raises(ValueError, "cu_seqlens must start at 0, end at L = 7", ppo, lp[0], old[0], adv[0],
           cu_seqlens=torch.tensor([0, 3, 6]))
    raises(ValueError, "and it decreases", ppo, lp[0], old[0], adv[0],
           cu_seqlens=torch.tensor([0, 5, 3, 7]))
    raises(TypeError, "cu_seqlens has dtype torch.float32", ppo, lp[0], old[0], adv[0],
           cu_seqlens=torch.tensor([0.0, 7.0]))
    with pytest.raises(ValueError, match="backend must be one of"):
        ppo(lp, old, adv, backend="cuda")
    vl = rl_triton.value_loss
    raises(ValueError, "clip needs old_values", vl, lp, old, clip=0.2)
    raises(ValueError, "kind must be one of", vl, lp, old, kind="l1")
    raises(ValueError, "huber_delta=0.0 is outside", vl, lp, old, kind="huber", huber_delta=0.0)
    raises(ValueError, r"returns has shape \(7,\)", vl, lp, old[0])
    raises(ValueError, "kind must be one of", rl_triton.kl_penalty, lp, old, "k4")
    raises(ValueError, "clamp=-1.0 is outside", rl_triton.kl_penalty, lp, old, "k3", -1.0)
    raises(ValueError, r"ref_log_probs has shape \(3, 6\)", rl_triton.kl_penalty, lp, old[:, :6])
    sac = sac_case(5, 2, 3)
    raises(ValueError, "next_q_values has shape .* next_probs has 3 actions",
           rl_triton.sac_targets, **dict(sac, next_q_values=torch.randn(5, 4, 2)))
    raises(ValueError, r"next_log_probs has shape \(5,\)", rl_triton.sac_targets,
           **dict(sac, next_log_probs=torch.randn(5)))
    raises(ValueError, r"next_q_values has shape \(5,\)", rl_triton.sac_targets,
           **dict(sac_case(5, 2), next_q_values=torch.randn(5)))
    raises(ValueError, "no critic", rl_triton.sac_targets,
           **dict(sac_case(5, 2), next_q_values=torch.randn(5, 0)))
    raises(ValueError, r"alpha must be a number or a tensor of one element; got shape \(2,\)",
           rl_triton.sac_targets, **sac, alpha=torch.ones(2))
    raises(TypeError, "alpha is a tensor of dtype torch.int64", rl_triton.sac_targets, **sac,
           alpha=torch.tensor(1))
    raises(TypeError, "alpha must be a number or a tensor", rl_triton.sac_targets, **sac,
           alpha="0.2")
    raises(ValueError, "gamma=1.5 is outside", rl_triton.sac_targets, **sac, gamma=1.5)
    raises(TypeError, "terminated has dtype torch.complex64", rl_triton.sac_targets,
           **dict(sac, terminated=torch.zeros(5, dtype=torch.complex64)))
    raises(RuntimeError, "terminated requires grad", rl_triton.sac_targets,
           **dict(sac, terminated=torch.zeros(5).requires_grad_()))
    q, sampled = torch.randn(4), torch.randn(4, 3)
    raises(ValueError, "beta=0.0 is outside", rl_triton.crr_weights, q, sampled, beta=0.0)
    raises(ValueError, "kind must be one of", rl_triton.crr_weights, q, sampled, kind="soft")
    raises(ValueError, "baseline must be one of", rl_triton.crr_weights, q, sampled,
           baseline="median")
    raises(ValueError, "no sampled action", rl_triton.crr_weights, q, sampled[:, :0])
    raises(ValueError, r"sampled_q_values has shape \(3, 4\)", rl_triton.crr_weights, q,
           sampled.t())


@pytest.mark.parametrize("backend", ["loop", "torch", "triton"])
def test_loss_offsets_checked_on_every_call(backend):
    """The losses that take cu_seqlens read their offsets on every call too (edits through a
    NumPy view included); check_offsets=False skips the read of offsets on a GPU (these, on the
    CPU, are read all the same), and must be a bool."""
    g = torch.Generator().manual_seed(0)
    dev = DEVICE if backend == "triton" else "cpu"  # offsets on the CPU (a NumPy view edits them)
    lp, old, adv, v, ret = (torch.randn(7, generator=g).to(dev) for _ in range(5))
    cu = torch.tensor([0, 3, 7])
    calls = [lambda **kw: rl_triton.ppo_policy_loss(lp, old, adv, cu_seqlens=cu,
                                                    aggregation="seq-mean-token-mean",
                                                    backend=backend, **kw)[0],
             lambda **kw: rl_triton.value_loss(v, ret, cu_seqlens=cu,
                                               aggregation="seq-mean-token-sum",
                                               backend=backend, **kw)]
    for call in calls:
        want = call()
        cu.numpy()[1] = 9
        for _ in range(2):
            with pytest.raises(ValueError, match="cu_seqlens"):
                call()
        with pytest.raises(ValueError, match="cu_seqlens"):
            call(check_offsets=False)
        with pytest.MonkeyPatch.context() as mp, bounds_checked():  # unread, as a GPU's
            mp.setattr(rl_triton.ops._losses, "check_offsets",
                       lambda cu, L, device, data=True: cu.to(device))
            assert call(check_offsets=False).isfinite()
            if backend == "triton":  # inside the tensors, whatever the values
                kept = cu.clone()
                for bad in ([3, 1, 2], [0, -4, 7], [0, 99, 200], [0, 10**12, 7]):
                    cu.numpy()[:] = bad
                    call(check_offsets=False)
                cu.numpy()[:] = kept.numpy()
        cu.numpy()[1] = 3
        torch.testing.assert_close(call(check_offsets=False), want)
        with pytest.raises(TypeError, match="check_offsets must be a bool"):
            call(check_offsets="no")


# ---- on a CUDA device only (gpu_large): token shapes (2^20 to 2^24 positions) against the torch
# backend in float64, inside torch.compile with Inductor, forward plus backward in a captured CUDA
# graph, and on any device index

DEV = "cuda"
G = torch.Generator(device=DEV) if torch.cuda.is_available() else None  # none on a CPU machine


def rnd(*shape, scale=1.0, seed=0):
    return scale * torch.randn(shape, generator=G.manual_seed(seed), device=DEV)


def inputs(B, T, seed=0):
    lp = rnd(B, T, scale=0.3, seed=seed)
    mask = torch.rand(B, T, generator=G.manual_seed(seed + 3), device=DEV) < 0.8
    return [lp, lp + rnd(B, T, scale=0.4, seed=seed + 1), rnd(B, T, seed=seed + 2)], mask


def calls(xs, mask, aggregation, backend, cu_seqlens=None):
    """Every differentiable loss of the same inputs, as one list of outputs."""
    lp, old, adv = xs
    loss, _, kl = rl_triton.ppo_policy_loss(lp, old, adv, mask, clip_high=0.28, dual_clip=3.0,
                                            aggregation=aggregation, cu_seqlens=cu_seqlens,
                                            backend=backend)
    v = rl_triton.value_loss(adv, lp, old, mask, clip=0.2, kind="huber",
                             aggregation=aggregation, cu_seqlens=cu_seqlens, backend=backend)
    k = rl_triton.kl_penalty(lp, old, "k3", 10.0, backend=backend)
    return [loss, kl, v, k]


def weights(outs, seed=9):
    return [torch.randn(o.shape, generator=G.manual_seed(seed + i), device=DEV,
                        dtype=torch.float64) for i, o in enumerate(outs)]


def weighted(outs, seed=9, ws=None):
    """A random weighting of the outputs (`ws`, drawn beforehand inside a CUDA graph capture,
    which cannot reseed a generator)."""
    return sum((o.double() * w).sum() for o, w in zip(outs, ws or weights(outs, seed)))


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean",
                                         "seq-mean-token-sum", "none"])
@pytest.mark.parametrize("B,T", [(1, 2**24), (2**16, 16), (512, 4096), (3, 333_333)])
@pytest.mark.gpu_large
def test_token_shapes(B, T, aggregation):
    """Outputs and gradients against autograd through the torch backend in float64 (loose
    where float32 and float64 sides of a clip's kink differ among millions of positions)."""
    xs, mask = inputs(B, T)
    a = [x.clone().requires_grad_() for x in xs]
    b = [x.double().requires_grad_() for x in xs]
    got, want = calls(a, mask, aggregation, "triton"), calls(b, mask, aggregation, "torch")
    for i, (o, w) in enumerate(zip(got, want)):
        assert rel_err(o, w) < 1e-4, i
    for i, (x, y) in enumerate(zip(torch.autograd.grad(weighted(got), a),
                                   torch.autograd.grad(weighted(want), b))):
        assert rel_err(x, y) < 1e-3, i


@pytest.mark.gpu_large
def test_packed_token_shapes():
    L = 2**22
    cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.randint(
        0, L, (4095,), generator=torch.Generator().manual_seed(1)).sort().values,
        torch.tensor([L])]).to(DEV)
    xs, mask = inputs(1, L)
    xs, mask = [x[0] for x in xs], mask[0]
    for aggregation in ("seq-mean-token-mean", "seq-mean-token-sum"):
        got = calls(xs, mask, aggregation, "triton", cu)
        want = calls([x.double() for x in xs], mask, aggregation, "torch", cu)
        for o, w in zip(got, want):
            assert rel_err(o, w) < 1e-4


@pytest.mark.gpu_large
def test_sac_and_crr_large():
    N, A = 2**20, 18
    r, q = rnd(N), rnd(N, A, 2, seed=1)
    logits = rnd(N, A, seed=2)
    term = torch.rand(N, generator=G.manual_seed(3), device=DEV) < 0.01
    args = (r, term, q, torch.log_softmax(logits, -1))
    kw = dict(next_probs=torch.softmax(logits, -1), gamma=0.99, alpha=0.2)
    assert rel_err(rl_triton.sac_targets(*args, **kw, backend="triton"),
                   rl_triton.sac_targets(*(t.double() if t.is_floating_point() else t
                                           for t in args), **kw, backend="torch",
                                         out_dtype=torch.float64)) < 1e-5
    sampled = rnd(N, 10, seed=4)
    assert rel_err(rl_triton.crr_weights(r, sampled, backend="triton"),
                   rl_triton.crr_weights(r.double(), sampled.double(), backend="torch")) < 1e-5


@pytest.mark.gpu_large
def test_inductor_fullgraph():
    xs, mask = inputs(64, 1000)
    alpha = torch.tensor(0.2, device=DEV, requires_grad=True)
    q = rnd(4096, 2, seed=5).requires_grad_()
    r, log_pi = rnd(4096, seed=6), rnd(4096, seed=7)
    term = torch.zeros(4096, dtype=torch.bool, device=DEV)
    weights = [torch.randn(shape, generator=G.manual_seed(9 + i), device=DEV)
               for i, shape in enumerate([(), (), (), (64, 1000)])]

    def step(lp, q, alpha):
        outs = calls([lp, xs[1], xs[2]], mask, "seq-mean-token-mean", "triton")
        y = rl_triton.sac_targets(r, term, q, log_pi, alpha=alpha)
        return sum((o * w).sum() for o, w in zip(outs, weights)) + y.sum()

    lp = xs[0].clone().requires_grad_()
    eager = torch.autograd.grad(step(lp, q, alpha), [lp, q, alpha])
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(step, fullgraph=True)(lp, q, alpha), [lp, q, alpha])
    for e, g in zip(eager, got):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.gpu_large
def test_cuda_graph_forward_and_backward(aggregation):
    """Forward and backward of every loss in one captured graph, replayed on new inputs: no
    host sync anywhere (the mask's counts stay on the device)."""
    xs, mask = inputs(64, 1000)
    static = [x.clone().requires_grad_() for x in xs]
    static_mask = mask.clone()
    alpha = torch.tensor(0.2, device=DEV, requires_grad=True)
    sac = [rnd(4096, seed=5), torch.zeros(4096, dtype=torch.bool, device=DEV),
           rnd(4096, 2, seed=6).requires_grad_(), rnd(4096, seed=7)]

    ws = weights(calls(static, static_mask, aggregation, "triton"))

    def step():
        outs = calls(static, static_mask, aggregation, "triton")
        y = rl_triton.sac_targets(*sac, alpha=alpha, backend="triton")
        w = rl_triton.crr_weights(sac[0], sac[2].detach(), backend="triton")
        return torch.autograd.grad(weighted(outs, ws=ws) + (y * w).sum(),
                                   static + [sac[2], alpha])

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (11, 12):
        new, new_mask = inputs(64, 1000, seed=seed)
        for s, n in zip(static, new):
            s.data.copy_(n)
        static_mask.copy_(new_mask)
        graph.replay()
        torch.cuda.synchronize()
        want = step()
        for c, w in zip(captured, want):
            torch.testing.assert_close(c, w, rtol=1e-6, atol=0)


@pytest.mark.gpu_large
def test_captured_graphs_leave_no_scratch_behind():
    """The partial sums and ticket a capture makes (`_last_program.scratch`) belong to its graph:
    captures made and dropped one after another leave the memory allocated as they found it."""
    xs, mask = inputs(64, 1000)

    def step():
        return calls(xs, mask, "token-mean", "triton")[:3] + [
            rl_triton.policy_loss(*xs, mask, loss_type="sapo")[0],
            rl_triton.masked_whiten(xs[2], mask)]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    allocated = []
    for _ in range(3):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
        graph.replay()
        torch.cuda.synchronize()
        del graph, outs
        allocated.append(torch.cuda.memory_allocated())
    assert allocated[1] == allocated[0] and allocated[2] == allocated[0], allocated


@pytest.mark.gpu_large
def test_last_program_finish_on_two_streams():
    """Two streams calling the losses at once, each with its own partial sums and ticket: every
    result the same bits as one call alone (2048 programs a forward, two passes of the finish's
    rows in the last one)."""
    xs, mask = inputs(1024, 4096)

    def run():
        return calls(xs, mask, "token-mean", "triton")[:3] + [
            rl_triton.policy_loss(*xs, mask, loss_type="sapo", out_dtype=torch.float32)[0]]

    want = run()
    streams = [torch.cuda.Stream() for _ in range(2)]
    got = [[] for _ in streams]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for _ in range(20):
        for s, out in zip(streams, got):
            with torch.cuda.stream(s):
                out.append(run())
    torch.cuda.synchronize()
    for out in got:
        for results in out:
            for g, w in zip(results, want):
                assert torch.equal(g, w)


@pytest.mark.gpu_large
def test_other_device_index():
    idx = torch.cuda.device_count() - 1
    dev = f"cuda:{idx}"
    xs, mask = inputs(5, 50)
    xs, mask = [x.to(dev).requires_grad_() for x in xs], mask.to(dev)
    got = rl_triton.ppo_policy_loss(*xs, mask, aggregation="seq-mean-token-mean",
                                    backend="triton")
    want = rl_triton.ppo_policy_loss(*xs, mask, aggregation="seq-mean-token-mean",
                                     backend="torch")
    for o, w in zip(got, want):
        assert o.device == torch.device(dev) and rel_err(o, w) < 1e-5
