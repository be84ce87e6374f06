"""rl-triton 0.1.3, the paper's library: the anchor of the host-path targets (`suites.host`).

Its package is named `rl_triton` too: `load` imports it from a folder while ours steps aside in
`sys.modules`, then puts ours back; each package's modules keep their own globals, so both run
in one process. It takes batch-major [N, T] float32 tensors with float32 flags only.
"""
from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import torch


def _ours(name: str) -> bool:
    return name == "rl_triton" or name.startswith("rl_triton.")


def load(path):
    """The package `rl_triton` in the folder `path` (e.g. `.ab/paper/src`), imported from there
    (never from sys.path) beside ours; ImportError where the folder holds none."""
    init = Path(path) / "rl_triton" / "__init__.py"
    if not init.is_file():
        raise ImportError(f"no package rl_triton in {path}")
    spec = importlib.util.spec_from_file_location("rl_triton", init,
                                                  submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    ours = {k: sys.modules.pop(k) for k in list(sys.modules) if _ours(k)}
    try:
        sys.modules["rl_triton"] = module  # its modules import each other by that name
        spec.loader.exec_module(module)
    finally:
        for k in [k for k in sys.modules if _ours(k)]:
            del sys.modules[k]
        sys.modules.update(ours)
    return module


def _bootstrap_columns(kw):
    """The anchor's per-step bootstrap tensor for our `last_value`: it at the last step, zero
    elsewhere (built outside the timed call, as its users hold it)."""
    b = torch.zeros_like(kw["rewards"])
    b[:, -1] = kw["last_value"]
    return b


def _next_values(kw):
    """values[t + 1], and `last_value` at the last step (batch-major)."""
    return torch.cat([kw["values"][:, 1:], kw["last_value"][:, None]], 1)


# the anchor's call computing what `rl_triton.<name>(**kw)` computes, by name, for our batch-major
# float32 keyword arguments with float32 flags and no truncation flags (`registry.make_inputs`):
# (its call, and for each of its outputs the index of ours it equals). Retrace has none: the
# anchor's takes the taken action's Q and the next step's Q of every action, another contract.
CALLS = {
    "gae": lambda a, kw: (functools.partial(
        a.compute_gae, kw["rewards"], kw["values"], kw["terminated"], gamma=kw["gamma"],
        lambda_=kw["lam"], last_value=kw["last_value"]), (0,)),
    "lambda_returns": lambda a, kw: (functools.partial(
        a.compute_lambda_returns, kw["rewards"], _next_values(kw), kw["terminated"],
        gamma=kw["gamma"], lambda_=kw["lam"], bootstrap_values=_bootstrap_columns(kw)), (0,)),
    "discounted_returns": lambda a, kw: (functools.partial(
        a.compute_discounted_returns, kw["rewards"], kw["terminated"], gamma=kw["gamma"],
        bootstrap_values=_bootstrap_columns(kw)), (0,)),
    # its lam is 1 and one clip serves both rhos: ours at its defaults
    "vtrace": lambda a, kw: (functools.partial(
        a.compute_vtrace, kw["target_log_probs"], kw["behavior_log_probs"], kw["values"],
        kw["rewards"], kw["terminated"], gamma=kw["gamma"], rho_bar=kw["rho_clip"],
        c_bar=kw["c_clip"], last_value=kw["last_value"]), (0, 1)),
    "eligibility_traces": lambda a, kw: (functools.partial(
        a.compute_eligibility_traces, kw["x"], kw["dones"], kw["gamma"], kw["lam"],
        seed_values=kw["initial"]), (0,)),
    "episodic_cumsum": lambda a, kw: (functools.partial(
        a.compute_episodic_prefix_sum, kw["x"], kw["dones"], seed_values=kw["initial"]), (0,)),
}
