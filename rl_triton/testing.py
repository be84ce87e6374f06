"""Random inputs for every op, shared by the tests and the benchmark, and the float64 results
of the vectorized torch implementations (a fast check of shapes too large for the loops)."""
from __future__ import annotations

import os
import sys

import torch

from ._core.op import OPS, ops

# the registry's scans, linear_scan as the test's names for its two directions
NAMES = [n for n in ops("scan") if n != "linear_scan"] + ["linear_scan_reverse",
                                                            "linear_scan_forward"]
VALUE_ESTIMATORS = ("gae", "lambda_returns", "discounted_returns", "vtrace")


def make_inputs(name, T, batch=(5,), *, dtype=torch.float32, flag_dtype=torch.bool, trunc=True,
                device="cpu", seed=0, n_act=5, features=(), p_term=0.08, p_trunc=0.08,
                bootstrap="last_value", params=None):
    """Inputs of `rl_triton.<name>` (`name` as in NAMES), time-major: `(steps, extra)`, the
    per-step tensors `[T, *batch, ...]` and the other keyword arguments (bootstraps, scalars).
    `bootstrap`: "last_value" (or `initial` for the forward scans), "next_values", or None;
    `params` replaces the default scalars."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(shape, generator=gen, device=device)).to(dtype)

    def flags(p):
        return (torch.rand(shape, generator=gen, device=device) < p).to(flag_dtype)

    def probs(*shape):
        return torch.softmax(torch.randn(shape, generator=gen, device=device), -1).to(dtype)

    shape = (T, *batch)
    term = flags(p_term)
    truncated = flags(p_trunc) if trunc else None
    if name in VALUE_ESTIMATORS:
        steps = dict(rewards=rnd(*shape), values=rnd(*shape), terminated=term,
                     truncated=truncated)
        extra = {}
        if bootstrap == "last_value":
            extra["last_value"] = rnd(*batch)
        elif bootstrap == "next_values":
            steps["next_values"] = rnd(*shape)
        p = dict(gamma=0.97, lam=0.9)
        if name == "discounted_returns":
            del steps["values"]
            p = dict(gamma=0.97)
        if name == "vtrace":
            blp = rnd(*shape, scale=0.5) - 1.0
            steps.update(target_log_probs=(blp.float() + 0.4 * torch.randn(
                shape, generator=gen, device=device)).to(dtype), behavior_log_probs=blp)
            p = dict(gamma=0.97, lam=0.9, rho_clip=1.2, c_clip=0.9, pg_rho_clip=1.1)
        extra.update(params or p)
    elif name == "retrace":
        steps = dict(rewards=rnd(*shape), q_values=rnd(*shape, n_act),
                     actions=torch.randint(0, n_act, shape, generator=gen, device=device),
                     target_probs=probs(*shape, n_act),
                     behavior_probs=(0.2 + 0.8 * torch.rand(shape, generator=gen,
                                                            device=device)).to(dtype),
                     terminated=term, truncated=truncated)
        extra = dict(last_q_values=rnd(*batch, n_act), last_target_probs=probs(*batch, n_act),
                     return_advantages=True, **(params or dict(gamma=0.97, lam=0.9, c_clip=1.0)))
    elif name in ("eligibility_traces", "episodic_cumsum"):
        steps = dict(x=rnd(*shape, *features), dones=flags(p_term + p_trunc))
        extra = dict(initial=rnd(*batch, *features)) if bootstrap == "last_value" else {}
        if name == "eligibility_traces":
            extra.update(params or dict(gamma=0.97, lam=0.9))
    elif name.startswith("linear_scan"):
        beta = torch.rand(shape, generator=gen, device=device) * 1.2 - 0.1
        steps = dict(alpha=rnd(*shape), beta=beta.to(dtype))
        extra = dict(reverse=name.endswith("reverse"))
        if bootstrap == "last_value":
            extra["initial"] = rnd(*batch)
    else:
        raise ValueError(name)
    return steps, extra


def make_packed_inputs(name, lengths, **kw):
    """Inputs of `rl_triton.<name>` on packed rows (semantics §7): `(steps, extra, cu_seqlens)`, the
    per-step tensors `[L, ...]` (the rows of `make_inputs(name, max length, (S,), **kw)`, each cut
    to its length and concatenated), the bootstraps `[S, ...]` and the scalars, and the int64
    offsets [S + 1] of the S = len(lengths) segments."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    steps, extra = make_inputs(name, max(int(lengths.max()), 1) if len(lengths) else 1,
                               (len(lengths),), **kw)
    device = kw.get("device", "cpu")
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(device)
    seg = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device)
    pos = torch.arange(int(cu[-1]), device=device) - cu[:-1][seg]
    steps = {k: None if v is None else v[pos, seg] for k, v in steps.items()}
    return steps, extra, cu


def public_name(name: str) -> str:
    return "linear_scan" if name.startswith("linear_scan") else name


def vectorized(name, *, dtype=torch.float64, **kwargs):
    """The op's torch implementation on time-major keyword arguments (those of the public
    function, without time_dim), computing in `dtype`: a tuple of its outputs."""
    op = OPS[public_name(name)]
    pick = (lambda t: {f: kwargs.get(f) for f in t._fields})
    extra = op.extras(**pick(op.extras)) if op.extras is not None else ()
    out = op.torch(op.inputs(**pick(op.inputs)), op.scalars(**pick(op.scalars)), extra, dtype)
    return out if isinstance(out, tuple) else (out,)


# The frameworks that the LLM drop-ins (rl_triton.integrations.verl / .openrlhf) reproduce, at the
# versions they are checked against; tests and the benchmark call their own installed code.
FRAMEWORKS = {"verl": "0.9.1", "openrlhf": "0.11.2"}
# Imported by those packages' modules but unused by the functions called (see docs/dev/frameworks.md):
_STUBBED = ("ray", "tensordict", "tensordict.tensorclass", "transformers",
            "transformers.modeling_outputs", "orjson", "deepspeed")


def spawn_ranks(fn, make_args, nprocs: int = 2) -> None:
    """`torch.multiprocessing.spawn(fn, make_args(), nprocs)` for a test's gloo ranks, and once
    more, with fresh arguments (a new port or store), if a rank died of a signal rather than
    an exception: gloo's teardown aborted a rank once in CI ("terminate called without an active
    exception") after the training's last collective. A rank that raises, or that dies twice,
    fails the test."""
    import warnings

    from torch.multiprocessing import ProcessExitedException, spawn

    try:
        spawn(fn, args=make_args(), nprocs=nprocs)
    except ProcessExitedException as died:
        warnings.warn(f"{died}; spawning the ranks once more")
        spawn(fn, args=make_args(), nprocs=nprocs)


def leave_rank() -> None:
    """End a spawned test rank whose results are saved without the interpreter's teardown, the
    part of a rank's exit where gloo's threads can meet a finalizing interpreter."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def framework_modules(path, stubbed=_STUBBED):
    """The `sys.modules` entries that `import_frameworks` sets while it imports: a stub module
    for each name in `stubbed` (any attribute is a new empty class: annotations, isinstance,
    base classes), OpenRLHF's packages `openrlhf.models`, `openrlhf.utils` and
    `openrlhf.trainer.ray` bare (their `__init__`, which imports vLLM, DeepSpeed and flash-attn,
    not run; their modules load from `path`) and `openrlhf.trainer.ray.launcher` with the one
    name used (docs/dev/frameworks.md)."""
    import importlib.machinery
    import os
    import types

    def stub(name):
        def attribute(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return type(attr, (), {})

        m = types.ModuleType(name)
        m.__getattr__ = attribute
        # a spec, as an imported module has (torch._dynamo runs importlib.util.find_spec on
        # names it finds in sys.modules, tqdm among them)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        return m

    def bare(name):  # a package whose __init__ is not run
        m = types.ModuleType(name)
        m.__path__ = [os.path.join(path, *name.split("."))]
        return m

    fake = {n: stub(n) for n in stubbed}
    fake.update({n: bare(n) for n in ("openrlhf.models", "openrlhf.utils", "openrlhf.trainer.ray")})
    fake["openrlhf.trainer.ray.launcher"] = types.ModuleType("openrlhf.trainer.ray.launcher")
    fake["openrlhf.trainer.ray.launcher"].RayActorGroup = object
    return fake


def import_frameworks(path=None):
    """verl's `core_algos` and `torch_functional`, OpenRLHF's `RemoteExperienceMaker` and its
    modules `openrlhf.models.loss` (PolicyLoss, ValueLoss) and `openrlhf.models.utils`
    (compute_approx_kl), as `types.SimpleNamespace(verl=..., verl_F=..., openrlhf=...,
    openrlhf_loss=..., openrlhf_utils=...)`, imported from `path` (a folder that
    `pip install --no-deps --target` filled with the pinned wheels; default `$RL_TRITON_FRAMEWORKS`,
    else `.ci/frameworks`) with the heavy imports they never use (ray, transformers, deepspeed,
    tensordict, orjson) given stub modules while they import, and OpenRLHF's package `__init__`s
    (vLLM, DeepSpeed, flash-attn) skipped. sys.modules is restored afterwards, real packages
    included. Raises ImportError if the packages are not there or not at the pinned versions."""
    import importlib
    import os
    import sys
    import types

    path = os.path.abspath(path or os.environ.get("RL_TRITON_FRAMEWORKS", ".ci/frameworks"))
    for name, version in FRAMEWORKS.items():
        found = [d for d in os.listdir(path) if d.startswith(f"{name}-") and
                 d.endswith(".dist-info")] if os.path.isdir(path) else []
        if found != [f"{name}-{version}.dist-info"]:
            raise ImportError(f"{name}=={version} is not installed in {path} (found {found}); "
                              f"pip install --no-deps --target {path} {name}=={version}")

    fake = framework_modules(path)
    saved = {n: sys.modules.get(n) for n in fake}
    sys.modules.update(fake)
    sys.path.insert(0, path)
    try:
        verl = importlib.import_module("verl.trainer.ppo.core_algos")
        verl_F = importlib.import_module("verl.utils.torch_functional")
        em = importlib.import_module("openrlhf.trainer.ppo_utils.experience_maker")
        loss = importlib.import_module("openrlhf.models.loss")
        utils = importlib.import_module("openrlhf.models.utils")
    finally:
        sys.path.remove(path)
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    return types.SimpleNamespace(verl=verl, verl_F=verl_F, openrlhf=em.RemoteExperienceMaker,
                                 openrlhf_loss=loss, openrlhf_utils=utils)


TRL = "1.16.0"  # the TRL release rl_triton.integrations.trl reproduces (its TRL_VERSION)


def import_trl(path=None):
    """The `trl` package at the pinned version TRL, from `path` (default `$RL_TRITON_TRL`, else
    `.ci/trl`, where tools/install_extras.sh puts it with transformers, accelerate, datasets and
    what they need beyond this environment). The folder is appended to `sys.path` and stays there
    (transformers imports its dependencies lazily), after the environment's own folders, so that
    the environment's packages win. Raises ImportError if TRL is not there at that version."""
    import importlib
    import os
    import sys

    path = os.path.abspath(path or os.environ.get("RL_TRITON_TRL", ".ci/trl"))
    found = [d for d in os.listdir(path) if d.startswith("trl-") and
             d.endswith(".dist-info")] if os.path.isdir(path) else []
    if found != [f"trl-{TRL}.dist-info"]:
        raise ImportError(f"trl=={TRL} is not installed in {path} (found {found}); "
                          "bash tools/install_extras.sh")
    if path not in sys.path:
        sys.path.append(path)
    return importlib.import_module("trl")


TOKEN_KINDS = ("dense", "padded", "multi-turn", "packed")


def token_rows(B, T, kind, dtype=torch.float32, device="cpu", seed=0):
    """LLM token rows (semantics §7), batch-major: `dict(rewards, values, mask, cu_seqlens)`.

    Every kind holds the same tokens: B responses of random lengths in [T/2, T], right-padded to
    T, each with 2-4 observation (tool-output) spans of random length strictly inside it; an
    outcome reward (0 or 1) on each response's last token, a decision token, plus small per-token
    KL-like terms on the decision tokens; random values. "dense": `[B, T]`, no mask; "padded":
    `[B, T]`, mask 1 on the responses; "multi-turn": the same, the spans masked out too;
    "packed": the responses concatenated without padding into `[L]`, `cu_seqlens` `[B + 1]`
    (int32, FlashAttention's), the mask 0 on the spans. Masks are bool, None where absent.
    Drawn on the CPU, so that every device gets the same rows."""
    if kind not in TOKEN_KINDS:
        raise ValueError(f"kind must be one of {TOKEN_KINDS}, got {kind!r}")
    if T < 24:
        raise ValueError(f"T={T} leaves no room for 4 spans inside a response of T/2 tokens")
    gen = torch.Generator().manual_seed(seed)

    def uniform_int(lo, hi):  # integers in [lo, hi], elementwise
        return lo + (torch.rand(lo.shape, generator=gen) * (hi - lo + 1)).long().clamp_max(hi - lo)

    zeros = torch.zeros(B, dtype=torch.long)
    lengths = uniform_int(zeros + T // 2, zeros + T)
    # spans k < n_spans, one in each of n_spans equal chunks of [1, length - 1): they never
    # overlap, and each response's first and last tokens stay decision tokens
    n_spans = uniform_int(zeros + 2, zeros + 4)
    chunk = (lengths - 2) // n_spans
    t = torch.arange(T)
    response = t < lengths[:, None]
    span = torch.zeros(B, T, dtype=torch.bool)
    for k in range(4):
        size = uniform_int(zeros + 1, chunk // 2)
        start = 1 + k * chunk + uniform_int(zeros, chunk - size)
        inside = (t >= start[:, None]) & (t < (start + size)[:, None]) & (k < n_spans)[:, None]
        span |= inside
    decision = response & ~span
    rewards = 0.01 * torch.randn(B, T, generator=gen) * decision
    rewards[torch.arange(B), lengths - 1] += (torch.rand(B, generator=gen) < 0.5).float()
    values = torch.randn(B, T, generator=gen)
    mask = {"dense": None, "padded": response, "multi-turn": decision, "packed": decision}[kind]
    cu_seqlens = None
    if kind == "packed":
        rewards, values, mask = rewards[response], values[response], decision[response]
        cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int()

    def move(x, dt=None):
        return None if x is None else x.to(device, dt)

    return dict(rewards=move(rewards, dtype), values=move(values, dtype), mask=move(mask),
                cu_seqlens=move(cu_seqlens))
