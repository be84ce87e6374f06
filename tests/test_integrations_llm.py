"""LLM post-training drop-ins (rl_triton.integrations.verl / .openrlhf) against the frameworks' own
functions, verl 0.9.1 and OpenRLHF 0.11.2 installed without their dependencies (.ci/run;
`rl_triton.testing.import_frameworks` stubs ray, transformers, deepspeed, tensordict and orjson,
which the functions called here never use), and the options table of docs/llm.md.
"""
import types

import numpy as np
import pytest
import torch

import rl_triton
from rl_triton.integrations import openrlhf as our_orl
from rl_triton.integrations import verl as our_verl
from rl_triton.testing import FRAMEWORKS, import_frameworks

try:
    FW = import_frameworks()
except ImportError as e:  # .ci/run installs them; elsewhere say how
    pytest.skip(f"{e}", allow_module_level=True)

BACKENDS = ["torch", "triton"]  # triton: the interpreter on CPU, the kernels on CUDA


def rows(B, T, device, seed=0, kind="multi-turn"):
    """rewards, values and a response mask [B, T]: right-padded responses of random length with,
    for "multi-turn", masked observation spans inside; row 0 is all masked where B > 2."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    if kind == "multi-turn":
        for b in range(B):
            for _ in range(2):
                s = int(torch.randint(0, T, (1,), generator=g))
                mask[b, s:s + int(torch.randint(1, 6, (1,), generator=g))] = False
    if B > 2:
        mask[0] = False
    mask[-1, :2] = True  # at least two tokens in the batch (T > 1), for verl's whitening
    r = torch.randn(B, T, generator=g)
    v = torch.randn(B, T, generator=g)
    return r.to(device), v.to(device), mask.to(device)


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setattr(our_verl, "backend", request.param)
    monkeypatch.setattr(our_orl, "backend", request.param)
    return request.param


def assert_same(got, want, tol=2e-6):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape,
                                                                 got.dtype, want.dtype)
    scale = max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() <= tol * scale


def test_pinned_versions():
    import importlib.metadata as md
    import os
    path = os.path.abspath(os.environ.get("RL_TRITON_FRAMEWORKS", ".ci/frameworks"))
    found = {d.metadata["Name"].lower(): d.version for d in md.distributions(path=[path])}
    assert {k: found.get(k) for k in FRAMEWORKS} == FRAMEWORKS
    assert FW.verl.__file__.startswith(path) and FW.verl_F.__file__.startswith(path)


SHAPES = [(1, 1), (5, 37), (7, 333)]
MASKS = [torch.float32, torch.int64, torch.bool]
NUMERIC = MASKS[:2]  # verl's GAE and REINFORCE++ compute 1 - mask: no bool masks there


def dtypes(backend, options):
    """Every mask dtype on the torch backend; one through the (slow) interpreter."""
    return options if backend == "torch" or torch.cuda.is_available() else options[:1]


def discounts(backend, pairs=((1.0, 0.95), (0.9, 0.7))):
    """Both (gamma, lam) on the torch backend; the second through the interpreter."""
    return pairs if backend == "torch" or torch.cuda.is_available() else pairs[1:]


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("kind", ["multi-turn", "padded"])
def test_verl_gae(B, T, kind, backend, device):
    r, v, m = rows(B, T, device, kind=kind)
    if m.sum() < 2:  # verl's whitening needs two tokens
        for theirs in (FW.verl, our_verl):
            with pytest.raises(ValueError):
                theirs.compute_gae_advantage_return(r, v, m.float(), 1.0, 1.0)
        return
    for gamma, lam in discounts(backend):
        for dtype in dtypes(backend, NUMERIC):
            want = FW.verl.compute_gae_advantage_return(r, v, m.to(dtype), gamma, lam)
            got = our_verl.compute_gae_advantage_return(r, v, m.to(dtype), gamma, lam)
            for g, w in zip(got, want):
                assert_same(g, w, 1e-5)


def test_verl_gae_tensor_discounts_and_errors(device):
    r, v, m = rows(5, 37, device)
    m = m.float()
    want = FW.verl.compute_gae_advantage_return(r, v, m, torch.tensor(0.9), torch.tensor(0.8))
    got = our_verl.compute_gae_advantage_return(r, v, m, torch.tensor(0.9), torch.tensor(0.8))
    for g, w in zip(got, want):
        assert_same(g, w, 1e-5)
    with pytest.raises(ValueError, match="gamma"):
        our_verl.compute_gae_advantage_return(r, v, m, torch.ones(2), 0.8)
    one = torch.zeros_like(m)
    one[2, 3] = 1
    for theirs in (FW.verl.compute_gae_advantage_return, our_verl.compute_gae_advantage_return):
        with pytest.raises(ValueError):  # verl's masked_var: one token cannot be whitened
            theirs(r, v, one, 1.0, 1.0)


@pytest.mark.parametrize("B,T", SHAPES[1:])
def test_verl_reinforce_plus_plus(B, T, backend, device):
    r, v, m = rows(B, T, device)
    for gamma, _ in discounts(backend):
        cfg = types.SimpleNamespace(gamma=gamma)
        for dtype in dtypes(backend, NUMERIC):
            want = FW.verl.compute_reinforce_plus_plus_outcome_advantage(r, m.to(dtype),
                                                                         config=cfg)
            got = our_verl.compute_reinforce_plus_plus_outcome_advantage(r, m.to(dtype),
                                                                         config=cfg)
            for g, w in zip(got, want):
                assert_same(g, w, 1e-5)
    with pytest.raises(ValueError, match="config"):
        our_verl.compute_reinforce_plus_plus_outcome_advantage(r, m)


def _index(B, seed=0, lone=True):
    """Prompt ids as verl keeps them (strings, any order), groups of 1 to 4."""
    g = np.random.default_rng(seed)
    ids = g.integers(0, max(1, B // 3), B)
    if lone:
        ids[0] = B + 7  # a group of one
    return np.array([f"uid-{i}" for i in ids], dtype=object)


def _blocks_index(B):
    """Indexes as verl's rollout lays them out (a prompt's responses side by side: blocks of 1
    and of a divisor of B, the group_size path), and blocks whose labels repeat apart (the
    general path)."""
    k = next(k for k in (3, 5, 1) if B % k == 0)
    out = [np.array([f"uid-{i // k}" for i in range(B)], dtype=object),
           np.array([f"uid-{i}" for i in range(B)], dtype=object)]
    if B > 2:
        out.append(np.array([f"uid-{(i // 2) % 2}" for i in range(B)], dtype=object))
    return out


def test_verl_blocks():
    """Which indexes take group_advantages' group_size path: consecutive blocks of one size, each
    block's label its own."""
    blocks = our_verl._blocks
    assert blocks(np.array(["a", "a", "b", "b", "c", "c"], dtype=object)) == 2
    assert blocks(np.array(["a", "b", "c"], dtype=object)) == 1
    assert blocks(np.array(["a"] * 4, dtype=object)) == 4
    assert blocks(np.array(["a", "a", "b", "b", "a", "a"], dtype=object)) == 0  # a repeats
    assert blocks(np.array(["a", "a", "b", "b", "b", "c"], dtype=object)) == 0  # sizes differ
    assert blocks(np.array([7, 7, 9, 9])) == 2 and blocks([]) == 0


GROUPED = ["compute_grpo_outcome_advantage", "compute_rloo_outcome_advantage",
           "compute_gpg_outcome_advantage", "compute_reinforce_plus_plus_baseline_outcome_advantage"]


@pytest.mark.parametrize("name", GROUPED)
@pytest.mark.parametrize("B", [1, 9, 50])
def test_verl_group_estimators(name, B, backend, device):
    r, _, m = rows(B, 11, device)
    m[-1, :2] = True
    theirs, ours = getattr(FW.verl, name), getattr(our_verl, name)
    kwargs = [{}] + ([{"norm_adv_by_std_in_grpo": False}, {"epsilon": 1e-3}]
                     if "grpo" in name else [])
    for index in (_index(B), torch.as_tensor(np.unique(_index(B), return_inverse=True)[1]),
                  *_blocks_index(B)):
        for kw in kwargs:
            for dtype in dtypes(backend, MASKS):
                want = theirs(r, m.to(dtype), index if isinstance(index, np.ndarray)
                              else index.numpy(), **kw)
                got = ours(r, m.to(dtype), index, **kw)
                for g, w in zip(got, want):
                    assert_same(g, w.to(g.device), 2e-6)


def test_verl_use_rl_triton():
    algos = FW.verl
    rows_ = [row for rows in our_verl.TABLES.values() for row in rows]
    before = {n: getattr(algos, n) for n, _, _ in rows_}
    registry = dict(algos.ADV_ESTIMATOR_REGISTRY)
    # every estimator of verl's registry has its drop-in
    assert sorted(registry) == sorted(key for _, key, _ in our_verl.ESTIMATORS)
    our_verl.use_rl_triton(algos)
    our_verl.use_rl_triton(algos)  # idempotent: revert still restores verl's own
    try:
        for table, rows in our_verl.TABLES.items():
            for n, key, fn in rows:
                assert getattr(algos, n) is fn
                if table is not None:
                    assert getattr(algos, table)[key] is fn
    finally:
        our_verl.revert_rl_triton(algos)
    assert {n: getattr(algos, n) for n, _, _ in rows_} == before
    assert dict(algos.ADV_ESTIMATOR_REGISTRY) == registry
    assert all(algos.POLICY_LOSS_REGISTRY[key] is before[n]
               for n, key, _ in our_verl.LOSSES)


@pytest.mark.parametrize("B,T", SHAPES)
@pytest.mark.parametrize("kind", ["multi-turn", "padded"])
def test_openrlhf(B, T, kind, backend, device):
    r, v, m = rows(B, T, device, kind=kind)
    REM = FW.openrlhf
    for dtype in dtypes(backend, MASKS + [None]):
        am = None if dtype is None else m.to(dtype)
        for gamma, lambd in discounts(backend):
            want = REM.get_advantages_and_returns(None, v, r, am, gamma, lambd)
            got = our_orl.get_advantages_and_returns(None, v, r, am, gamma, lambd)
            for g, w in zip(got, want):
                assert_same(g, w, 1e-5)
            assert_same(our_orl.get_cumulative_returns(None, r, am, gamma),
                        REM.get_cumulative_returns(None, r, am, gamma), 1e-5)


def _openrlhf_maker(estimator, n, gamma=1.0):
    """A RemoteExperienceMaker without its __init__ (Ray actors, vLLM engines): the attributes
    that `compute_advantages_and_returns` reads, as `train_ppo_ray.py` sets them."""
    maker = object.__new__(FW.openrlhf)
    adv = types.SimpleNamespace(estimator=estimator, gamma=gamma, lambd=0.95, no_std_norm=False)
    args = types.SimpleNamespace(algo=types.SimpleNamespace(advantage=adv),
                                 rollout=types.SimpleNamespace(n_samples_per_prompt=n),
                                 reward=types.SimpleNamespace(clip_range=None))
    maker.strategy = types.SimpleNamespace(args=args)
    maker.kl_ctl = types.SimpleNamespace(value=0.01)
    maker.advantage_estimator = estimator
    return maker


def _experiences(B, T, device, chunks=2, seed=0, kind="padded"):
    r, v, m = rows(B, T, device, seed=seed, kind=kind)
    m[:, 0] = True  # OpenRLHF places each score on its response's last token
    g = torch.Generator().manual_seed(seed + 1)
    scores = torch.randn(B, generator=g).to(device)
    kl = 0.1 * torch.randn(B, T, generator=g).to(device)
    order = torch.randperm(B, generator=g)  # experiences arrive in any order; index says where
    out = []
    for idx in order.chunk(chunks):
        out.append(types.SimpleNamespace(rewards=scores[idx].clone(), index=idx.tolist(), info={},
                                         kl=kl[idx].clone(), action_mask=m[idx].clone(),
                                         values=v[idx].clone()))
    return out, scores, m, kl


@pytest.mark.parametrize("estimator", ["gae", "reinforce", "reinforce_baseline", "rloo",
                                       "group_norm", "dr_grpo", "flash_reinforce"])
def test_openrlhf_pipeline_with_use_rl_triton(estimator, backend, device):
    """OpenRLHF's own `compute_advantages_and_returns` (shaping, KL, whitening) gives the same
    advantages and returns with its methods replaced by ours."""
    n = 3
    want = _experiences(12, 17, device, kind="multi-turn")[0]
    FW.openrlhf.compute_advantages_and_returns(_openrlhf_maker(estimator, n, 0.9), want)
    got = _experiences(12, 17, device, kind="multi-turn")[0]
    our_orl.use_rl_triton(FW.openrlhf)
    try:
        assert FW.openrlhf.get_cumulative_returns is our_orl.get_cumulative_returns
        FW.openrlhf.compute_advantages_and_returns(_openrlhf_maker(estimator, n, 0.9), got)
    finally:
        our_orl.revert_rl_triton(FW.openrlhf)
    assert FW.openrlhf.get_cumulative_returns is not our_orl.get_cumulative_returns
    for g, w in zip(got, want):
        assert_same(g.advantages, w.advantages, 1e-5)
        assert_same(g.returns, w.returns, 1e-5)


# docs/llm.md, "Group advantages in the frameworks": the options that reproduce each framework
@pytest.mark.parametrize("estimator,options", [
    ("group_norm", dict(scale="std", eps=1e-9)),
    ("dr_grpo", dict(scale="none")),
    ("rloo", dict(baseline="leave_one_out", scale="none")),
])
def test_table_openrlhf(estimator, options, device):
    """OpenRLHF's shaped score (no KL, gamma 1, right padding) reaches every response token
    unchanged: `group_advantages(scores, group_size=n, **options, mask=action_mask)`."""
    n, B, T = 4, 12, 9
    exps, scores, m, kl = _experiences(B, T, device, kind="padded")
    for e in exps:
        e.kl = torch.zeros_like(e.kl)
    FW.openrlhf.compute_advantages_and_returns(_openrlhf_maker(estimator, n), exps)
    theirs = torch.empty(B, T, device=device)
    for e in exps:
        theirs[e.index] = e.advantages
    ours = rl_triton.group_advantages(scores, group_size=n, **options, mask=m)
    assert_same(ours, theirs, 1e-5)


@pytest.mark.parametrize("options,kwargs", [
    (dict(scale="std", eps=1e-6), {}),
    (dict(scale="none"), {"norm_adv_by_std_in_grpo": False}),
])
def test_table_verl_grpo(options, kwargs, device):
    """verl's GRPO and Dr. GRPO, every group of more than one response."""
    r, _, m = rows(12, 7, device)
    index = np.repeat(np.arange(4), 3)
    theirs, _ = FW.verl.compute_grpo_outcome_advantage(r, m, index, **kwargs)
    ours = rl_triton.group_advantages(r.sum(-1), torch.as_tensor(index, device=device),
                                      **options, mask=m)
    assert_same(ours, theirs, 2e-6)


def test_table_verl_rloo(device):
    r, _, m = rows(12, 7, device)
    index = np.repeat(np.arange(3), 4)
    theirs, _ = FW.verl.compute_rloo_outcome_advantage(r, m, index)
    ours = rl_triton.group_advantages(r.sum(-1), group_size=4, baseline="leave_one_out",
                                      scale="none", mask=m)
    assert_same(ours, theirs, 2e-6)


def test_worked_example_of_the_docs(device):
    """docs/llm.md's multi-turn row: the semantics' mask equals verl on the decision tokens,
    OpenRLHF steps through the masked span with zero rewards and values."""
    m = torch.tensor([[1, 1, 0, 0, 1, 0]], dtype=torch.bool, device=device)
    v = torch.arange(1.0, 7.0, device=device)[None]
    r = torch.tensor([[0, 0, 0, 0, 1.0, 0]], device=device)
    zero, no_flags = torch.zeros(1, device=device), torch.zeros_like(m)
    spec, _ = rl_triton.gae(r, v, no_flags, mask=m, last_value=zero, gamma=0.9, lam=0.8,
                            time_dim=1)
    table = {"spec": [0.526, -0.380, 0, 0, -4, 0], "verl": [0.526, -0.380, -4, -4, -4, 0],
             "openrlhf": [-0.035, -1.160, 1.166, 1.620, -4, 0]}
    _, verl_returns = FW.verl.compute_gae_advantage_return(r, v, m.float(), 0.9, 0.8)
    orl, _ = FW.openrlhf.get_advantages_and_returns(None, v, r, m.float(), 0.9, 0.8)
    for name, got in [("spec", spec), ("verl", verl_returns - v), ("openrlhf", orl)]:
        want = torch.tensor([table[name]], device=device)
        assert (got - want).abs().max() < 6e-4, name
    g_spec = rl_triton.discounted_returns(r, no_flags, mask=m, gamma=0.5, time_dim=1)
    g_verl = FW.verl.compute_reinforce_plus_plus_outcome_advantage(
        r, m.float(), config=types.SimpleNamespace(gamma=0.5))[1]
    g_orl = FW.openrlhf.get_cumulative_returns(None, r, m.float(), 0.5)
    assert torch.equal(g_spec, g_verl) and torch.equal(g_spec, torch.tensor(
        [[0.25, 0.5, 0, 0, 1, 0]], device=device))
    assert torch.equal(g_orl, torch.tensor([[0.0625, 0.125, 0.25, 0.5, 1, 0]], device=device))
