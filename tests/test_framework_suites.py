"""verl's and OpenRLHF's own test files (shipped in their wheels, installed in .ci/frameworks by
tools/install_extras.sh) pass with rl_triton's switch on as they pass without it (issue 50).

Each run is a subprocess (tests/framework_suites_runner.py: `pytest` on the files below, the
frameworks imported with rl_triton.testing's stub modules), once as shipped ("off") and after
`use_rl_triton()` of both integrations, with every drop-in counting its calls: "on" (the
drop-ins' default backend: Triton on CUDA, torch on the CPU) and "on-triton" (the Triton kernels
for every tensor, in Triton's interpreter). Checked: the same test ids with the same outcome in
every run (bar DIFFERENCES, documented in docs/llm.md), every test passing as shipped, the
registries holding ours with the switch on, and each file reaching exactly the drop-ins it is
selected for.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from rl_triton.testing import FRAMEWORKS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(REPO, "tests", "framework_suites_runner.py")
# "on-triton" runs the kernels in Triton's interpreter: on a CUDA machine "on" runs them compiled
# (the frameworks' tests put their tensors on the GPU where there is one)
MODES = ("off", "on") + (() if torch.cuda.is_available() else ("on-triton",))
PATH = os.path.abspath(os.environ.get("RL_TRITON_FRAMEWORKS",
                                      os.path.join(REPO, ".ci", "frameworks")))

# Every shipped test file whose tests reach a function the switch replaces (selected by reading
# them all), and the drop-ins each reaches (with the switch on, through the frameworks' own code)
REACHES = {
    "verl": {
        # GAE with observation tokens, GRPO / RLOO against their vectorized versions, KL names
        "tests/trainer/ppo/test_core_algos_on_cpu.py": {
            "compute_gae_advantage_return", "compute_grpo_outcome_advantage",
            "compute_grpo_vectorized_outcome_advantage", "compute_rloo_outcome_advantage",
            "compute_rloo_vectorized_outcome_advantage", "kl_penalty"},
        "tests/trainer/ppo/test_dynamic_policy_losses_on_cpu.py": {"compute_policy_loss_dro"},
        "tests/trainer/ppo/test_loss_aggregation_on_cpu.py": {"agg_loss"},
        "tests/trainer/ppo/test_reinforce_pp_multiturn_on_cpu.py": {
            "compute_reinforce_plus_plus_outcome_advantage"},
        "tests/trainer/ppo/test_rollout_corr.py": {
            "compute_rollout_correction_weights", "compute_rollout_rejection_mask"},
        "tests/trainer/ppo/test_rollout_corr_integration.py": {
            "compute_rollout_correction_weights", "compute_rollout_rejection_mask",
            "compute_policy_loss_vanilla"},
        # the critic's loss: ours aggregates in the value_loss kernel, not through agg_loss
        "tests/trainer/ppo/test_value_loss_normalization_on_cpu.py": {"compute_value_loss"},
        # the registry through ray_trainer.compute_advantage: not importable here (NOT_COLLECTED)
        "tests/trainer/test_multi_trajectories_advantage_on_cpu.py": set(),
    },
    "openrlhf": {
        "tests/test_kl_estimator_gradient.py": {"compute_approx_kl"},
        "tests/test_loss_aggregation.py": {"PolicyLoss"},
        # RemoteExperienceMaker.compute_advantages_and_returns, every estimator
        "tests/test_reward_shaping.py": {"get_advantages_and_returns", "get_cumulative_returns",
                                         "PolicyLoss"},
    },
}
# Files that fail to import identically with and without the switch, and why
NOT_COLLECTED = {
    # verl.trainer.ppo.v1's package imports transfer_queue and its agent loop, the ray trainer
    # torchdata and ray.util, and applies @ray.remote at import: a running Ray stack
    "tests/trainer/test_multi_trajectories_advantage_on_cpu.py": "transfer_queue",
}
# Tests that pass as shipped and fail with the switch on, each a documented difference
# (docs/llm.md, "Checked with the frameworks' own tests")
DIFFERENCES = {}


def _installed():
    for name, version in FRAMEWORKS.items():
        if not os.path.isdir(os.path.join(PATH, f"{name}-{version}.dist-info")):
            return f"{name}=={version} is not installed in {PATH} (tools/install_extras.sh)"
    if importlib.util.find_spec("tensordict") is None:  # verl's DataProto
        return "tensordict is not installed (pip install -e .[integrations])"
    return None


if _installed():  # .ci/run installs them; elsewhere say how
    pytest.skip(_installed(), allow_module_level=True)


def _run_all(out):
    """The three runs, side by side (2 CPU cores suffice): {mode: report}."""
    files = [os.path.join(PATH, f) for fw in REACHES.values() for f in fw]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    procs = {mode: subprocess.Popen(
        [sys.executable, RUNNER, mode, str(out / f"{mode}.json"),
         "--continue-on-collection-errors", *files],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
        for mode in MODES}
    reports = {}
    for mode, proc in procs.items():
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"the {mode} run did not finish:\n{log[-4000:]}"
        with open(out / f"{mode}.json") as f:
            reports[mode] = json.load(f)
        reports[mode]["log"] = log
    return reports


def _framework(nodeid):
    path = nodeid.split("::")[0]
    return next(fw for fw, files in REACHES.items() if path in files)


def _same_outcomes(runs, framework, mode):
    """The same test ids, every one passing as shipped, the same outcome with the switch on
    (bar DIFFERENCES, which must still differ). Returns the counts."""
    off, on = ({k: v["outcome"] for k, v in runs[m]["tests"].items()
                if _framework(k) == framework} for m in ("off", mode))
    assert off and sorted(off) == sorted(on), (framework, mode)
    assert {k: v for k, v in off.items() if v != "passed"} == {}, runs["off"]["log"][-4000:]
    changed = {k: (off[k], on[k]) for k in off if off[k] != on[k]}
    expected = {k: ("passed", "failed") for k, (_, modes) in DIFFERENCES.items()
                if _framework(k) == framework and mode in modes}
    assert changed == expected, runs[mode]["log"][-4000:]
    return (f"{framework} ({mode}): {len(off)} tests in {len({k.split('::')[0] for k in off})} "
            f"files, passed as shipped {sum(v == 'passed' for v in off.values())}, with the "
            f"switch {sum(v == 'passed' for v in on.values())}")


def _not_collected_identically(runs):
    """The files that cannot be imported here fail the same way in every run, for the reason
    given (and no other file fails to import)."""
    for mode in MODES:
        errors = runs[mode]["collect_errors"]
        assert len(errors) == len(NOT_COLLECTED), errors
        for path, reason in NOT_COLLECTED.items():
            assert any(e.startswith(path) and reason in e for e in errors), (path, errors)
        assert errors == runs["off"]["collect_errors"]


def _switch_reaches_drop_ins(runs, mode):
    """With the switch on, the frameworks' registries and modules hold ours, and each file's
    tests call exactly the drop-ins it was selected for."""
    assert runs[mode]["registry_wrong"] == [], mode
    called = {}
    for nodeid, entry in runs[mode]["tests"].items():
        framework, path = _framework(nodeid), nodeid.split("::")[0]
        assert all(n.startswith(framework + ".") for n in entry["calls"]), (nodeid, entry)
        called.setdefault(path, set()).update(n.split(".", 1)[1] for n in entry["calls"])
    want = {f: names for files in REACHES.values() for f, names in files.items()
            if f not in NOT_COLLECTED}
    assert called == want, mode


def test_framework_suites_pass_with_the_switch(tmp_path):
    """One test (the runs are shared by every check, and pytest-xdist would repeat them per
    worker): see the module's docstring."""
    runs = _run_all(tmp_path)
    _not_collected_identically(runs)
    # without the switch nothing of ours runs (the counters exist only with it)
    assert all(not v["calls"] for v in runs["off"]["tests"].values())
    for mode in MODES[1:]:
        _switch_reaches_drop_ins(runs, mode)
        for framework in sorted(REACHES):
            print(_same_outcomes(runs, framework, mode))
