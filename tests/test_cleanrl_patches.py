"""CleanRL patches: the code each patch adds computes what the loop it removes computed.

The patches in patches/cleanrl/ are checked against the real upstream files by hand (see
patches/README.md); here, offline, each patch's removed GAE loop and its added `rl_triton.gae` call
run on the same random time-major buffers, with `dones` / `next_done` as CleanRL fills them, and
must agree, and both must agree with an independent float64 statement of CleanRL's recurrence.
"""
import functools
import re
import textwrap
import types
from pathlib import Path


import pytest
import torch

import rl_triton

PATCHES = Path(__file__).resolve().parent.parent / "patches" / "cleanrl"
NAMES = ["ppo", "ppo_continuous_action", "ppo_atari_envpool"]
COMMIT = "fe8d8a03c41a7ef5b523e2e354bd01c363e786bb"


def _hunks(text):
    """[(old_start, old_len, new_start, new_len, lines)] of a one-file unified diff."""
    hunks, cur = [], None
    for line in text.splitlines():
        m = re.match(r"@@ -(\d+),(\d+) \+(\d+),(\d+) @@", line)
        if m:
            cur = (*map(int, m.groups()), [])
            hunks.append(cur)
        elif cur is not None:
            cur[4].append(line)
    return hunks


def _blocks(name):
    """The removed and the added code of the patch's GAE hunk, dedented."""
    hunk = next(h for h in _hunks((PATCHES / f"{name}.patch").read_text())
                if any("lastgaelam" in ln for ln in h[4]))
    removed = [ln[1:] for ln in hunk[4] if ln.startswith("-")]
    added = [ln[1:] for ln in hunk[4] if ln.startswith("+")]
    return textwrap.dedent("\n".join(removed)), textwrap.dedent("\n".join(added))


def _buffers(T, N, p_done, seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(T, N, generator=g)
    values = torch.randn(T, N, generator=g)
    # dones[t] is stored with obs[t]: it says that step t - 1 ended an episode; dones[0] is the
    # next_done carried over from the previous iteration
    dones = (torch.rand(T, N, generator=g) < p_done).float()
    next_done = (torch.rand(N, generator=g) < 0.5).float()
    next_value = torch.randn(1, N, generator=g)  # agent.get_value(next_obs).reshape(1, -1)
    return rewards, values, dones, next_done, next_value


def _cleanrl_reference(rewards, values, dones, next_done, next_value, gamma, lam):
    """CleanRL's recurrence, restated in float64: step t ends where dones[t + 1] says so."""
    T = rewards.shape[0]
    r, v, d = rewards.double(), values.double(), dones.double()
    adv = torch.zeros_like(r)
    carry = torch.zeros_like(r[0])
    for t in range(T - 1, -1, -1):
        cont = 1.0 - (next_done.double() if t == T - 1 else d[t + 1])
        succ = next_value.double().reshape(-1) if t == T - 1 else v[t + 1]
        carry = r[t] + gamma * cont * succ - v[t] + gamma * lam * cont * carry
        adv[t] = carry
    return adv, adv + v


def _run(code, bufs, gamma, lam, gae=rl_triton.gae, device="cpu"):
    rewards, values, dones, next_done, next_value = (b.to(device) for b in bufs)
    ns = {"torch": torch, "rl_triton": types.SimpleNamespace(gae=gae), "device": device,
          "args": types.SimpleNamespace(num_steps=rewards.shape[0], gamma=gamma, gae_lambda=lam),
          "rewards": rewards.clone(), "values": values.clone(), "dones": dones.clone(),
          "next_done": next_done.clone(), "next_value": next_value.clone()}
    exec(compile(code, "<patch>", "exec"), ns)
    return ns["advantages"], ns["returns"]


@pytest.mark.parametrize("name", NAMES)
def test_patch_header_and_shape(name):
    text = (PATCHES / f"{name}.patch").read_text()
    assert COMMIT in text.split("diff --git")[0]  # named in the header
    assert f"diff --git a/cleanrl/{name}.py b/cleanrl/{name}.py" in text
    assert text.count("diff --git") == 1
    for old_start, old_len, new_start, new_len, lines in _hunks(text):
        body = [ln for ln in lines if not ln.startswith("\\")]
        assert old_len == sum(1 for ln in body if ln[:1] in (" ", "-", ""))
        assert new_len == sum(1 for ln in body if ln[:1] in (" ", "+", ""))
    added = [ln[1:].strip() for h in _hunks(text) for ln in h[4] if ln.startswith("+")]
    assert "import rl_triton" in added
    assert sum("rl_triton.gae(" in ln for ln in added) == 1
    removed, new = _blocks(name)
    assert "for t in reversed(range(args.num_steps))" in removed and "for " not in new


def test_patches_add_the_same_code():
    assert len({_blocks(n) for n in NAMES}) == 1
    assert COMMIT in (PATCHES.parent / "README.md").read_text()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("T,N,p_done,seed", [(128, 4, 0.05, 0), (37, 5, 0.3, 1), (1, 3, 0.5, 2),
                                             (16, 1, 1.0, 3)])
def test_added_code_equals_removed_loop(name, T, N, p_done, seed):
    removed, added = _blocks(name)
    bufs = _buffers(T, N, p_done, seed)
    gamma, lam = 0.99, 0.95
    adv_loop, ret_loop = _run(removed, bufs, gamma, lam)
    adv, ret = _run(added, bufs, gamma, lam)
    assert adv.shape == ret.shape == (T, N) and adv.dtype == ret.dtype == torch.float32
    torch.testing.assert_close(adv, adv_loop, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, ret_loop, rtol=1e-5, atol=1e-5)
    adv_ref, ret_ref = _cleanrl_reference(*bufs, gamma, lam)
    torch.testing.assert_close(adv.double(), adv_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.double(), ret_ref, rtol=1e-5, atol=1e-5)


def test_added_code_with_triton_backend(device):
    """The kernels (on the GPU, or in Triton's interpreter) behind the patched lines."""
    removed, added = _blocks("ppo")
    bufs = _buffers(64, 3, 0.1, 4)
    adv_loop, ret_loop = _run(removed, bufs, 0.97, 0.9, device=device)
    adv, ret = _run(added, bufs, 0.97, 0.9, device=device,
                    gae=functools.partial(rl_triton.gae, backend="triton"))
    torch.testing.assert_close(adv, adv_loop, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, ret_loop, rtol=1e-5, atol=1e-5)
