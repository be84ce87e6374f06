"""The fused loss head (semantics §11): `token_log_probs` and `linear_policy_loss` against the
unfused composition of `rl_triton.reference` (float64 logits, log_softmax, gather, the loss),
values and gradients, on the torch backend and on the Triton kernels (the interpreter on the CPU,
compiled on CUDA); odd vocabularies and chunks, labels at both ends of the vocabulary, ignored
positions, packed rows, bad input."""
import pytest
import torch

import rl_triton
from rl_triton import reference

from conftest import DEVICE

BACKENDS = ["torch", "triton"]


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make(L, H, V, dtype=torch.float32, seed=0, bias=False, ignore=(3,), device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(L, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * H ** -0.5 * 2
    b = torch.randn(V, generator=g, dtype=torch.float64) if bias else None
    labels = torch.randint(0, V, (L,), generator=g)
    labels[0], labels[-1] = 0, V - 1  # both ends of the vocabulary
    for i in ignore:
        if i < L:
            labels[i] = -100
    to = dict(device=device, dtype=dtype)
    return (hidden.to(**to), weight.to(**to), labels.to(device),
            None if b is None else b.to(**to))


def leaves(*xs):
    return [None if x is None else x.detach().clone().requires_grad_() for x in xs]


def ref_lp(hidden, weight, labels, bias=None, **kw):
    h, w, b = leaves(*(None if x is None else x.double() for x in (hidden, weight, bias)))
    lp, ent = reference.token_log_probs(h, w, labels, bias=b, **kw)
    return lp, ent, (h, w, b)


# ---- token_log_probs -----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("L,H,V,chunk", [(13, 8, 37, 5), (1, 4, 37, 1), (40, 16, 333, 7),
                                         (17, 8, 333, 64), (9, 32, 400, None)])
@pytest.mark.parametrize("bias", [False, True])
def test_token_log_probs_matches_reference(backend, L, H, V, chunk, bias):
    dtype = torch.float64 if backend == "torch" else torch.float32
    hidden, weight, labels, b = make(L, H, V, dtype, bias=bias)
    h, w, bb = leaves(hidden, weight, b)
    lp, ent = rl_triton.token_log_probs(h, w, labels, bias=bb, temperature=0.7,
                                        return_entropy=True, chunk_size=chunk, backend=backend)
    assert lp.shape == ent.shape == labels.shape
    rlp, rent, (rh, rw, rb) = ref_lp(hidden, weight, labels, b, temperature=0.7)
    g = torch.Generator().manual_seed(1)
    g1, g2 = (torch.randn(L, generator=g, dtype=torch.float64).to(DEVICE) for _ in range(2))
    ((lp.double() * g1).sum() + (ent.double() * g2).sum()).backward()
    ((rlp * g1).sum() + (rent * g2).sum()).backward()
    tol = 1e-10 if dtype is torch.float64 else 2e-5
    assert rel(lp, rlp) < tol and rel(ent, rent) < tol
    if L > 3:  # the ignored position
        assert lp[3].item() == 0.0 and ent[3].item() == 0.0
    pairs = [(h.grad, rh.grad), (w.grad, rw.grad)] + ([(bb.grad, rb.grad)] if bias else [])
    for got, want in pairs:
        assert got.dtype == dtype
        assert rel(got, want) < tol * 5


def test_token_log_probs_vocabulary_1000_on_torch():
    hidden, weight, labels, b = make(50, 24, 1000, torch.float64, bias=True)
    lp, ent = rl_triton.token_log_probs(hidden, weight, labels, bias=b, return_entropy=True,
                                        chunk_size=17, backend="torch")
    rlp, rent, _ = ref_lp(hidden, weight, labels, b)
    assert rel(lp, rlp) < 1e-12 and rel(ent, rent) < 1e-12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_token_log_probs_half_inputs(dtype, backend):
    """bf16 / fp16 hidden and weight: float32 logits and statistics (the reference upcasts the
    same values exactly), gradients in the inputs' dtype, rounded once."""
    hidden, weight, labels, _ = make(21, 16, 333, dtype)
    h, w = leaves(hidden, weight)
    lp = rl_triton.token_log_probs(h, w, labels, chunk_size=8, backend=backend)
    assert lp.dtype is torch.float32
    rlp, _, (rh, rw, _) = ref_lp(hidden, weight, labels)
    lp.sum().backward()
    rlp.sum().backward()
    assert rel(lp, rlp) < 1e-5
    assert h.grad.dtype is dtype and w.grad.dtype is dtype
    assert rel(h.grad, rh.grad) < 1e-2 and rel(w.grad, rw.grad) < 1e-2


def test_token_log_probs_batched_rows():
    """[B, T, H] hidden and [B, T] labels: the outputs have labels' shape."""
    hidden, weight, labels, _ = make(12, 8, 37, torch.float64)
    lp = rl_triton.token_log_probs(hidden.view(3, 4, 8), weight, labels.view(3, 4),
                                   backend="torch")
    assert lp.shape == (3, 4)
    assert rel(lp.reshape(-1), ref_lp(hidden, weight, labels)[0]) < 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_positions_ignored(backend):
    hidden, weight, labels, _ = make(9, 8, 37)
    labels[:] = -100
    h, w = leaves(hidden, weight)
    lp, ent = rl_triton.token_log_probs(h, w, labels, return_entropy=True, chunk_size=4,
                                        backend=backend)
    assert (lp == 0).all() and (ent == 0).all()
    (lp.sum() + ent.sum()).backward()
    assert (h.grad == 0).all() and (w.grad == 0).all()
    old, adv = torch.zeros(9, device=DEVICE), torch.ones(9, device=DEVICE)
    h.grad = w.grad = None
    loss, metrics = rl_triton.linear_policy_loss(h, w, labels, old, adv, chunk_size=4,
                                                 backend=backend)
    loss.backward()
    assert loss.item() == 0.0 and (h.grad == 0).all() and (w.grad == 0).all()
    assert metrics["entropy"].item() == 0.0


def test_gradcheck_token_log_probs():
    hidden, weight, labels, b = make(5, 3, 7, torch.float64, bias=True, ignore=(2,))
    h, w, bb = leaves(hidden, weight, b)

    def f(h, w, bb):
        return rl_triton.token_log_probs(h, w, labels, bias=bb, temperature=1.3,
                                         return_entropy=True, chunk_size=2, backend="torch")

    assert torch.autograd.gradcheck(f, (h, w, bb))


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_against_eager_moderate_shape(backend):
    """float32 at L = 512, V = 1000: both backends against eager PyTorch's
    log_softmax(hidden @ weight.T), within float32 rounding (relative 1e-5)."""
    hidden, weight, labels, _ = make(512, 64, 1000, torch.float32, ignore=())
    h, w = leaves(hidden, weight)
    lp = rl_triton.token_log_probs(h, w, labels, chunk_size=100, backend=backend)
    eh, ew = leaves(hidden, weight)
    elp = (eh @ ew.T).log_softmax(-1).gather(-1, labels[:, None]).squeeze(-1)
    g = torch.randn(512, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    (lp * g).sum().backward()
    (elp * g).sum().backward()
    assert rel(lp, elp) < 1e-5
    assert rel(h.grad, eh.grad) < 1e-5 and rel(w.grad, ew.grad) < 1e-5


# ---- linear_policy_loss --------------------------------------------------------------------------

def policy_inputs(B, T, H, V, dtype, seed=0, packed=False):
    L = B * T
    hidden, weight, labels, _ = make(L, H, V, dtype, seed=seed, ignore=(2, 7))
    g = torch.Generator().manual_seed(seed + 1)
    lp, _, _ = ref_lp(hidden, weight, labels)
    old = (lp.detach() + 0.5 * torch.randn(L, generator=g, dtype=torch.float64).to(DEVICE))
    adv = torch.randn(L, generator=g, dtype=torch.float64).to(DEVICE)
    ref = old + 0.3 * torch.randn(L, generator=g, dtype=torch.float64).to(DEVICE)
    mask = (torch.rand(L, generator=g) < 0.75).to(DEVICE)
    shape = (L,) if packed else (B, T)
    per = [x.to(dtype).reshape(shape) for x in (old, adv, ref)]
    return (hidden.reshape(*shape, H), weight, labels.reshape(shape), *per,
            mask.reshape(shape))


CASES = [
    dict(),
    dict(loss_type="grpo"),
    dict(dual_clip=3.0, clip_high=0.28, kl_coef=0.1, kl_kind="k3", entropy_coef=0.01),
    dict(loss_type="grpo", kl_coef=0.05, kl_kind="k2", kl_clamp=0.5, temperature=0.8),
    dict(aggregation="seq-mean-token-sum", kl_coef=0.2, kl_kind="abs", entropy_coef=-0.02),
    dict(aggregation="sum", kl_coef=0.1, kl_kind="k1", log_ratio_clamp=0.3),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("packed", [False, True])
def test_linear_policy_loss_matches_reference(backend, case, packed):
    kw = dict(CASES[case])
    dtype = torch.float64 if backend == "torch" else torch.float32
    hidden, weight, labels, old, adv, ref, mask = policy_inputs(3, 7, 8, 37, dtype,
                                                                packed=packed)
    if packed:
        kw["cu_seqlens"] = torch.tensor([0, 5, 5, 12, 21], device=DEVICE)
    h, w = leaves(hidden, weight)
    rh, rw = leaves(hidden.double(), weight.double())
    rold, radv = leaves(old.double(), adv.double())
    o, a = leaves(old, adv)  # gradients to the per-token inputs too: no silent detach
    loss, metrics = rl_triton.linear_policy_loss(h, w, labels, o, a, mask, ref_log_probs=ref,
                                                 chunk_size=4, backend=backend, **kw)
    want, wmetrics = rl_triton.linear_policy_loss(rh, rw, labels, rold, radv, mask,
                                                  ref_log_probs=ref.double(), backend="loop",
                                                  **kw)
    loss.backward()
    want.backward()
    tol = 1e-10 if dtype is torch.float64 else 3e-5
    assert abs(loss.item() - want.item()) <= tol * max(1.0, abs(want.item()))
    for got, exp in [(h.grad, rh.grad), (w.grad, rw.grad), (o.grad, rold.grad),
                     (a.grad, radv.grad)]:
        assert got.dtype == dtype
        assert rel(got, exp) < tol * 10
    assert set(metrics) == set(wmetrics)
    for k in metrics:
        assert abs(metrics[k].item() - wmetrics[k].item()) < 1e-5, k


# every loss type of policy_loss (semantics §10) through loss_type, with its options
TYPE_CASES = [
    dict(loss_type="vanilla", delta=2.0, clip_high=0.28),
    dict(loss_type="grpo", ratio_level="sequence"),
    dict(loss_type="dapo", clip_high=0.28),
    dict(loss_type="bnpo"),
    dict(loss_type="ppo", dual_clip=3.0),
    dict(loss_type="gspo", clip_low=3e-4, clip_high=4e-4),
    dict(loss_type="sapo", tau_pos=1.0, tau_neg=1.05),
    dict(loss_type="sapo", ratio_level="sequence", aggregation="seq-mean-token-sum"),
    dict(loss_type="gpg", aggregation="sum"),
    dict(loss_type="clip_cov", cov_ratio=0.2, cov_bounds=(-10.0, 10.0)),
    dict(loss_type="kl_cov", cov_ratio=0.2, kl_cov_coef=0.7),
    dict(loss_type="geo_mean", clip_low=0.3, clip_high=0.4),
    dict(loss_type="cispo", clip_low=10.0, clip_high=0.28),
    dict(loss_type="cispo", ratio_level="sequence", aggregation="seq-mean-token-mean"),
    dict(loss_type="dppo_tv", clip_low=0.1, clip_high=0.1),
    dict(loss_type="dppo_kl", clip_low=0.05, clip_high=0.05, truncation=1.5),
    dict(loss_type="dro", dro_beta=0.5, log_ratio_clamp=None),
]
EXTRAS = dict(kl_coef=0.1, kl_kind="k3", entropy_coef=0.01)


def composed(hidden, weight, bias, labels, old, adv, ref, mask, cu, kw):
    """The unfused composition: the reference's log-probabilities, `policy_loss` on them (loop
    backend), the KL and entropy terms aggregated by hand, all in float64."""
    kw = dict(kw)
    kl_coef, kl_kind, ent_coef = (kw.pop(k) for k in ("kl_coef", "kl_kind", "entropy_coef"))
    name = kw.pop("loss_type")
    default = "seq-mean-token-mean" if name in ("grpo", "geo_mean") else "token-mean"
    agg = kw.pop("aggregation", default)
    lp, ent = rl_triton.token_log_probs(hidden, weight, labels, bias=bias,
                                        return_entropy=True, backend="loop")
    keep = mask & (labels != -100)
    pg, _ = rl_triton.policy_loss(
        lp, old, adv, keep,
        loss_type="vanilla" if name in ("grpo", "bnpo", "dapo", "ppo") else name,
        aggregation="seq-mean" if name == "geo_mean" else agg, cu_seqlens=cu,
        generator=torch.Generator().manual_seed(5), backend="loop", out_dtype=torch.float64,
        **kw)
    extra = kl_coef * reference.kl_penalty(lp, ref, kl_kind) - ent_coef * ent
    return pg + reference._aggregate(extra, keep, agg, cu)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(TYPE_CASES)))
@pytest.mark.parametrize("packed", [False, True])
def test_every_loss_type_matches_the_composition(backend, case, packed):
    """Every loss type against token_log_probs -> policy_loss in float64 (and the loop backend):
    values and gradients to hidden, weight, bias and the per-token inputs, with a mask, ignored
    labels, the KL and entropy terms, rows and packed sequences."""
    kw = {**TYPE_CASES[case], **EXTRAS}
    dtype = torch.float64 if backend == "torch" else torch.float32
    hidden, weight, labels, old, adv, ref, mask = policy_inputs(3, 7, 8, 37, dtype,
                                                                packed=packed)
    bias = (0.1 * torch.arange(37, dtype=torch.float64, device=DEVICE)).to(dtype)
    cu = torch.tensor([0, 5, 5, 12, 21], device=DEVICE) if packed else None
    h, w, b, o, a = leaves(hidden, weight, bias, old, adv)
    rh, rw, rb, ro, ra = leaves(*(x.double() for x in (hidden, weight, bias, old, adv)))
    ch, cw, cb, co, ca = leaves(*(x.double() for x in (hidden, weight, bias, old, adv)))
    loss, metrics = rl_triton.linear_policy_loss(
        h, w, labels, o, a, mask, ref_log_probs=ref, bias=b, cu_seqlens=cu, chunk_size=4,
        generator=torch.Generator().manual_seed(5), backend=backend, **kw)
    want = composed(ch, cw, cb, labels, co, ca, ref.double(), mask, cu, kw)
    loss.backward()
    want.backward()
    tol = 1e-10 if dtype is torch.float64 else 3e-5
    assert abs(loss.item() - want.item()) <= tol * max(1.0, abs(want.item()))
    for got, exp in [(h.grad, ch.grad), (w.grad, cw.grad), (b.grad, cb.grad),
                     (o.grad, co.grad), (a.grad, ca.grad)]:
        if exp is None:  # (gspo's ratio: the old log-probabilities' mean as a constant)
            assert got is None or not got.any()
            continue
        assert got.dtype == dtype
        assert rel(got, exp) < tol * 10
    # the loop backend (the unfused reference) and its metrics
    loop, lmetrics = rl_triton.linear_policy_loss(
        rh, rw, labels, ro, ra, mask, ref_log_probs=ref.double(), bias=rb, cu_seqlens=cu,
        generator=torch.Generator().manual_seed(5), backend="loop", **kw)
    assert abs(loop.item() - want.item()) <= 1e-10 * max(1.0, abs(want.item()))
    assert set(metrics) == set(lmetrics) >= {"pg_loss", "approx_kl", "entropy", "kl",
                                            "clip_fraction"}
    for k in metrics:
        assert metrics[k].dtype == torch.float32 and not metrics[k].requires_grad
        assert abs(metrics[k].item() - lmetrics[k].item()) < 1e-5, k


def test_grpo_is_the_per_sequence_mean():
    """loss_type="grpo": each row's token mean, then the mean over rows with a token that
    counts, of the same per-token loss as "vanilla"."""
    hidden, weight, labels, old, adv, _, mask = policy_inputs(3, 7, 8, 37, torch.float64)
    mask[1] = False  # a row without a counted token does not count
    mask[0] = False
    mask[0, 4:] = True  # three tokens (4, 5, 6; 2 is ignored anyway)
    per_row = []
    for r in (0, 2):
        m = torch.zeros_like(mask)
        m[r] = mask[r]
        per_row.append(rl_triton.linear_policy_loss(hidden, weight, labels, old, adv, m,
                                                    backend="torch")[0])
    grpo = rl_triton.linear_policy_loss(hidden, weight, labels, old, adv, mask,
                                        loss_type="grpo", backend="torch")[0]
    assert abs(grpo.item() - sum(per_row).item() / 2) < 1e-12


@pytest.mark.parametrize("kw", [dict(loss_type="grpo", clip_low=0.3),
                                dict(loss_type="sapo"),  # fused, another formula
                                dict(loss_type="geo_mean", clip_low=0.3, clip_high=0.3)])
def test_gradcheck_linear_policy_loss(kw):
    hidden, weight, labels, old, adv, ref, mask = policy_inputs(2, 3, 3, 7, torch.float64)
    b = torch.randn(7, dtype=torch.float64, device=DEVICE)
    xs = leaves(hidden, weight, b, old, adv, ref)

    def f(h, w, bb, o, a, r):
        return rl_triton.linear_policy_loss(h, w, labels, o, a, mask, bias=bb, ref_log_probs=r,
                                            kl_coef=0.3, entropy_coef=0.1, chunk_size=4,
                                            backend="torch", **kw)[0]

    assert torch.autograd.gradcheck(f, tuple(xs))


@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_never_modified(backend):
    hidden, weight, labels, old, adv, ref, mask = policy_inputs(2, 5, 8, 37, torch.float32)
    xs = leaves(hidden, weight, old, adv, ref)
    before = [x.detach().clone() for x in xs] + [labels.clone(), mask.clone()]
    loss, _ = rl_triton.linear_policy_loss(xs[0], xs[1], labels, xs[2], xs[3], mask,
                                           ref_log_probs=xs[4], kl_coef=0.1, chunk_size=3,
                                           backend=backend)
    loss.backward()
    lp = rl_triton.token_log_probs(xs[0], xs[1], labels, chunk_size=3, backend=backend)
    lp.sum().backward()
    for x, b in zip(xs + [labels, mask], before):
        assert torch.equal(x.detach(), b)


def test_no_input_needs_grad_saves_nothing():
    hidden, weight, labels, old, adv, _, mask = policy_inputs(2, 5, 8, 37, torch.float32)
    loss, metrics = rl_triton.linear_policy_loss(hidden, weight, labels, old, adv, mask,
                                                 backend="torch")
    assert loss.grad_fn is None and not loss.requires_grad
    with torch.no_grad():
        lp = rl_triton.token_log_probs(*leaves(hidden, weight), labels)
    assert lp.grad_fn is None


def test_second_order_refused():
    hidden, weight, labels, old, adv, _, mask = policy_inputs(2, 5, 8, 37, torch.float64)
    h, w = leaves(hidden, weight)
    loss, _ = rl_triton.linear_policy_loss(h, w, labels, old, adv, mask, backend="torch")
    with pytest.raises(RuntimeError, match="first-order"):
        torch.autograd.grad(loss, h, create_graph=True)


# ---- bad input -----------------------------------------------------------------------------------

def test_bad_input_names_the_argument():
    hidden, weight, labels, old, adv, _, mask = policy_inputs(2, 5, 8, 37, torch.float32)
    tlp = rl_triton.token_log_probs
    bad = labels.clone()
    bad[0, 1] = 37
    with pytest.raises(ValueError, match="labels holds 37"):
        tlp(hidden, weight, bad)
    bad[0, 1] = -5
    with pytest.raises(ValueError, match="labels holds -5"):
        tlp(hidden, weight, bad)
    with pytest.raises(ValueError, match="hidden has shape"):
        tlp(hidden[:, :4], weight, labels)
    with pytest.raises(ValueError, match="weight has shape"):
        tlp(hidden, weight[:, :4], labels)
    with pytest.raises(TypeError, match="weight has dtype"):
        tlp(hidden, weight.double(), labels)
    with pytest.raises(TypeError, match="labels has dtype"):
        tlp(hidden, weight, labels.float())
    with pytest.raises(ValueError, match="bias has shape"):
        tlp(hidden, weight, labels, bias=torch.zeros(36, device=DEVICE))
    with pytest.raises(ValueError, match="temperature"):
        tlp(hidden, weight, labels, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        tlp(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="weight is on meta"):
        tlp(hidden, weight.to("meta"), labels)
    lpl = rl_triton.linear_policy_loss
    with pytest.raises(ValueError, match="loss_type must be one of"):
        lpl(hidden, weight, labels, old, adv, loss_type="ppo2")
    with pytest.raises(ValueError, match="dual_clip and delta apply"):
        lpl(hidden, weight, labels, old, adv, loss_type="sapo", dual_clip=3.0)
    with pytest.raises(ValueError, match="ratio_level='sequence' applies"):
        lpl(hidden, weight, labels, old, adv, loss_type="gpg", ratio_level="sequence")
    with pytest.raises(ValueError, match="ratio_level must be one of"):
        lpl(hidden, weight, labels, old, adv, ratio_level="batch")
    with pytest.raises(ValueError, match="dro_beta"):
        lpl(hidden, weight, labels, old, adv, loss_type="dro")
    with pytest.raises(ValueError, match="tau_pos"):
        lpl(hidden, weight, labels, old, adv, loss_type="sapo", tau_pos=0.0)
    with pytest.raises(TypeError, match="generator must be"):
        lpl(hidden, weight, labels, old, adv, loss_type="clip_cov", generator=5)
    with pytest.raises(ValueError, match="advantages has shape"):
        lpl(hidden, weight, labels, old, adv[:1])
    with pytest.raises(ValueError, match="aggregation='none'"):
        lpl(hidden, weight, labels, old, adv, aggregation="none")
    with pytest.raises(ValueError, match="ref_log_probs"):
        lpl(hidden, weight, labels, old, adv, kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_kind must be one of"):
        lpl(hidden, weight, labels, old, adv, kl_kind="k4")
    with pytest.raises(RuntimeError, match="mask requires grad"):
        lpl(hidden, weight, labels, old, adv, mask.float().requires_grad_())


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_scales_by_the_loss_gradient(backend):
    """linear_policy_loss stores its gradients in the forward; the backward multiplies them by
    the loss's gradient (here 2.5, through a product and a sum with another term)."""
    hidden, weight, labels, old, adv, _, mask = policy_inputs(2, 5, 8, 37, torch.float32)
    h1, w1, h2, w2 = leaves(hidden, weight, hidden, weight)
    loss, _ = rl_triton.linear_policy_loss(h1, w1, labels, old, adv, mask, backend=backend)
    (2.5 * loss + h1.sum() * 0).backward()
    loss2, _ = rl_triton.linear_policy_loss(h2, w2, labels, old, adv, mask, backend=backend)
    loss2.backward()
    assert rel(h1.grad, 2.5 * h2.grad) < 1e-6 and rel(w1.grad, 2.5 * w2.grad) < 1e-6


def test_inside_torch_compile():
    """Inside torch.compile the calls run (eagerly, between graphs) with their gradients."""
    hidden, weight, labels, old, adv, _, mask = policy_inputs(2, 5, 8, 37, torch.float32)
    h1, w1, h2, w2 = leaves(hidden, weight, hidden, weight)

    def f(h, w):
        loss, metrics = rl_triton.linear_policy_loss(h, w, labels, old, adv, mask,
                                                     backend="torch")
        return 2 * loss + rl_triton.token_log_probs(h, w, labels, backend="torch").sum()

    torch.compile(f, backend="eager")(h1, w1).backward()
    f(h2, w2).backward()
    assert rel(h1.grad, h2.grad) < 1e-6 and rel(w1.grad, w2.grad) < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", ["sapo", "gspo"])
def test_loss_types_inside_torch_compile(backend, loss_type):
    """The ops' custom ops inside torch.compile (the fused loop, and the two passes' head):
    the eager call's values and gradients."""
    hidden, weight, labels, old, adv, ref, mask = policy_inputs(2, 5, 8, 37, torch.float32)
    h1, w1, h2, w2 = leaves(hidden, weight, hidden, weight)

    def f(h, w):
        loss, metrics = rl_triton.linear_policy_loss(
            h, w, labels, old, adv, mask, ref_log_probs=ref, kl_coef=0.1, entropy_coef=0.01,
            loss_type=loss_type, chunk_size=3, backend=backend)
        return loss, metrics["entropy"]

    got = torch.compile(f, backend="eager")(h1, w1)
    want = f(h2, w2)
    got[0].backward()
    want[0].backward()
    assert rel(got[0], want[0]) < 1e-6 and rel(got[1], want[1]) < 1e-6
    assert rel(h1.grad, h2.grad) < 1e-6 and rel(w1.grad, w2.grad) < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_labels_and_bias(backend):
    """Views with strides (every other element) are read as their values."""
    hidden, weight, labels, b = make(11, 8, 37, bias=True)
    wide_labels = torch.stack([labels, torch.zeros_like(labels)], -1).reshape(-1)[::2]
    wide_bias = torch.stack([b, torch.full_like(b, 99.0)], -1).reshape(-1)[::2]
    assert not wide_labels.is_contiguous() and not wide_bias.is_contiguous()
    got = rl_triton.token_log_probs(hidden, weight, wide_labels, bias=wide_bias, chunk_size=4,
                                    backend=backend)
    want = rl_triton.token_log_probs(hidden, weight, labels, bias=b, chunk_size=4,
                                     backend=backend)
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_at_a_masked_token_reaches_no_loss(backend):
    """A masked token's inputs (its old log-probability, advantage, and its logits through the
    bias-free head of a NaN hidden state) reach neither the loss nor d hidden."""
    hidden, weight, labels, old, adv, _, mask = policy_inputs(2, 5, 8, 37, torch.float32)
    mask[0, 1] = False
    hidden, old, adv = hidden.clone(), old.clone(), adv.clone()
    hidden[0, 1] = float("nan")
    old[0, 1] = adv[0, 1] = float("nan")
    h, = leaves(hidden)
    loss, metrics = rl_triton.linear_policy_loss(h, weight, labels, old, adv, mask,
                                                 entropy_coef=0.1, chunk_size=3, backend=backend)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
    assert torch.isfinite(h.grad).all() and (h.grad[0, 1] == 0).all()


def test_nan_hidden_state_where_it_counts():
    """A NaN hidden state at a token that counts: its log-probability and entropy are NaN on
    every backend (the torch backend's 0 log 0 = 0 select read a NaN probability as 0), the
    other tokens' as without it."""
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(4, 6, generator=g), torch.randn(11, 6, generator=g)
    labels = torch.tensor([1, 2, 3, 4])
    clean = rl_triton.token_log_probs(h, w, labels, return_entropy=True, backend="loop")
    h[1] = float("nan")
    for backend in BACKENDS + ["loop"]:
        lp, ent = rl_triton.token_log_probs(h.to(DEVICE), w.to(DEVICE), labels.to(DEVICE),
                                            return_entropy=True, backend=backend)
        for got, want in zip((lp.cpu(), ent.cpu()), clean):
            assert got[1].isnan() and not got[[0, 2, 3]].isnan().any(), backend
            torch.testing.assert_close(got[[0, 2, 3]], want[[0, 2, 3]].float())


@pytest.mark.parametrize("backend", BACKENDS + ["loop"])
def test_no_tokens(backend):
    h, w = leaves(torch.randn(0, 4, device=DEVICE), torch.randn(9, 4, device=DEVICE))
    labels, empty = torch.zeros(0, dtype=torch.long, device=DEVICE), torch.zeros(0, device=DEVICE)
    lp, ent = rl_triton.token_log_probs(h, w, labels, return_entropy=True, backend=backend)
    assert lp.shape == ent.shape == (0,)
    loss, metrics = rl_triton.linear_policy_loss(h, w, labels, empty, empty, backend=backend)
    loss.backward()
    assert loss.item() == 0.0 and (w.grad == 0).all() and h.grad.shape == (0, 4)
    assert set(metrics) == {"clip_fraction", "approx_kl", "entropy", "pg_loss"}
    assert all(v.item() == 0.0 for v in metrics.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_transposed_hidden_and_weight(backend):
    """hidden and weight as transposed views (column-major): read in place, the same values and
    gradients as their contiguous copies."""
    hidden, weight, labels, _ = make(10, 8, 37)
    h1, w1 = (x.detach().t().contiguous().t().requires_grad_() for x in (hidden, weight))
    assert not h1.is_contiguous() and not w1.is_contiguous()
    h2, w2 = leaves(hidden, weight)
    lp1 = rl_triton.token_log_probs(h1, w1, labels, chunk_size=3, backend=backend)
    lp2 = rl_triton.token_log_probs(h2, w2, labels, chunk_size=3, backend=backend)
    lp1.sum().backward()
    lp2.sum().backward()
    assert rel(lp1, lp2) < 1e-6 and rel(h1.grad, h2.grad) < 1e-6 and rel(w1.grad, w2.grad) < 1e-6
