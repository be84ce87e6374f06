"""On a CUDA device only: the losses (semantics §9) at token shapes (2^20 to 2^24 positions) against
the torch backend in float64, inside torch.compile with Inductor, forward plus backward in a
captured CUDA graph, and on any device index."""
import pytest
import torch

import rl_triton
from cases import rel_err

DEV = "cuda"
G = torch.Generator(device=DEV)


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
