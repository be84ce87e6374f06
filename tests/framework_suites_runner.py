"""Runs verl's and OpenRLHF's own test files under pytest, with rl_triton's switch off or on, and
writes each test's outcome (and, with the switch on, which of rl_triton's drop-ins it called) to
a JSON file. tests/test_framework_suites.py runs it in subprocesses and compares the runs.

    python tests/framework_suites_runner.py {off,on,on-triton} REPORT.json PYTEST_ARGS...

The frameworks come from `$RL_TRITON_FRAMEWORKS` or `.ci/frameworks` (tools/install_extras.sh),
imported as `rl_triton.testing.import_frameworks` imports them (its stub modules and OpenRLHF
package shim, docs/dev/frameworks.md), here left in place for the whole run, with two changes:
the real tensordict (verl's DataProto is one), and stubs for aiohttp and tqdm, which OpenRLHF's
tests/test_agent.py (whose fixture tests/test_reward_shaping.py uses) imports at module level.

"on" ("on-triton": the drop-ins' backend "triton"): `use_rl_triton()` of both integrations runs
before the test files are collected (a trainer calls it at start-up, so names imported from
verl's modules later are ours). OpenRLHF's test files load private copies of its modules
(`spec_from_file_location` under other names); the switch is applied to each copy as it is
executed (`use_rl_triton(RemoteExperienceMaker)` of the copy, and the switch's table of module
functions on the copies of `openrlhf/models/*.py`). Every drop-in is wrapped in a call counter
first, so the report says which ones ran.
"""
from __future__ import annotations

import collections
import functools
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALLS: collections.Counter = collections.Counter()
# modules stubbed beyond rl_triton.testing._STUBBED: imported at module level by the test files'
# helpers, never used by the tests run here (tqdm by samples_generator.py, aiohttp by
# openrlhf/utils/agent.py and tests/test_agent.py)
EXTRA_STUBS = ("aiohttp", "aiohttp.web", "aiohttp.test_utils", "tqdm")
# stubbed by import_frameworks, real here: verl's DataProto (rollout correction's results) is a
# TensorDict; the integrations extra installs it (pyproject)
REAL = ("tensordict",)
# "on": the drop-ins' default backend (Triton on CUDA, torch on the CPU); "on-triton": the Triton
# kernels for every tensor, in Triton's interpreter
MODES = ("off", "on", "on-triton")


def frameworks_path() -> str:
    return os.path.abspath(os.environ.get("RL_TRITON_FRAMEWORKS",
                                          os.path.join(REPO, ".ci", "frameworks")))


def install_stubs(path: str) -> None:
    """import_frameworks' stub modules and OpenRLHF shim, for the whole process."""
    from rl_triton.testing import _STUBBED, framework_modules

    stubbed = tuple(n for n in _STUBBED if n.split(".")[0] not in REAL) + EXTRA_STUBS
    sys.modules.update(framework_modules(path, stubbed))
    sys.path.insert(0, path)


def counted(name, fn):
    """`fn` (a function, or PolicyLoss, a module class) counting its calls in CALLS[name]."""
    if isinstance(fn, type):
        forward = fn.forward

        def counted_forward(self, *args, **kwargs):
            CALLS[name] += 1
            return forward(self, *args, **kwargs)

        return type(fn.__name__, (fn,), {"forward": counted_forward,
                                         "__module__": fn.__module__})

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        CALLS[name] += 1
        return fn(*args, **kwargs)

    return wrapper


def switch_on(backend="auto") -> dict:
    """Wrap every row of both switches' tables in a counter, then turn both switches on, the
    drop-ins calling `backend`. Returns the wrappers by name (the registry check reads them)."""
    import importlib.machinery

    from rl_triton.integrations import openrlhf as our_orl
    from rl_triton.integrations import verl as our_verl

    our_verl.backend = our_orl.backend = backend

    ours = {}
    for table in (our_verl.ESTIMATORS, our_verl.LOSSES, our_verl.FUNCTIONS):
        for i, (name, key, fn) in enumerate(table):
            table[i] = (name, key, counted(f"verl.{name}", fn))
            ours[f"verl.{name}"] = table[i][2]
    for table, prefix in ((our_verl.ROLLOUT_CORRECTION, "verl"),
                          (our_orl.METHODS, "openrlhf"), (our_orl.FUNCTIONS, "openrlhf")):
        for i, (name, fn) in enumerate(table):
            table[i] = (name, counted(f"{prefix}.{name}", fn))
            ours[f"{prefix}.{name}"] = table[i][1]
    our_verl.use_rl_triton()
    our_orl.use_rl_triton()

    # OpenRLHF's tests execute private copies of its files: the switch goes on in each copy
    root = os.path.join(frameworks_path(), "openrlhf")
    maker = os.path.join(root, "trainer", "ppo_utils", "experience_maker.py")
    models = (os.path.join(root, "models", "utils.py"), os.path.join(root, "models", "loss.py"))
    exec_module = importlib.machinery.SourceFileLoader.exec_module

    def exec_and_switch(loader, module):
        exec_module(loader, module)
        origin = os.path.abspath(getattr(module, "__file__", "") or "")
        if origin == maker:
            our_orl.use_rl_triton(module.RemoteExperienceMaker)
        elif origin in models:
            for name, fn in our_orl.FUNCTIONS:
                if name in vars(module):
                    setattr(module, name, fn)

    importlib.machinery.SourceFileLoader.exec_module = exec_and_switch
    return ours


def registry_is_ours(ours: dict) -> list:
    """The switch's entries that verl's registries and modules and OpenRLHF's modules do not
    hold (empty: all ours)."""
    import verl.trainer.ppo.core_algos as algos
    from openrlhf.models import loss, utils
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    from rl_triton.integrations import verl as our_verl

    wrong = []
    for registry, rows in (("ADV_ESTIMATOR_REGISTRY", our_verl.ESTIMATORS),
                           ("POLICY_LOSS_REGISTRY", our_verl.LOSSES)):
        for name, key, _ in rows:
            if getattr(algos, registry)[key] is not ours[f"verl.{name}"]:
                wrong.append(f"{registry}[{key!r}]")
    for name, _, _ in our_verl.FUNCTIONS:
        if getattr(algos, name) is not ours[f"verl.{name}"]:
            wrong.append(f"core_algos.{name}")
    for module, name in ((utils, "compute_approx_kl"), (loss, "PolicyLoss")):
        if getattr(module, name) is not ours[f"openrlhf.{name}"]:
            wrong.append(f"{module.__name__}.{name}")
    helper = sys.modules["verl.trainer.ppo.rollout_corr_helper"]
    for name, _ in our_verl.ROLLOUT_CORRECTION:
        if getattr(helper, name) is not ours[f"verl.{name}"]:
            wrong.append(f"rollout_corr_helper.{name}")
    for name in ("get_advantages_and_returns", "get_cumulative_returns"):
        if RemoteExperienceMaker.__dict__[name] is not ours[f"openrlhf.{name}"]:
            wrong.append(f"RemoteExperienceMaker.{name}")
    return wrong


class Recorder:
    """Each test's outcome ("passed", "failed", "skipped", "xfailed", "xpassed"; a failed
    set-up or teardown is "error") and the drop-in calls made while it ran."""

    def __init__(self, mode, ours):
        self.mode, self.ours = mode, ours
        self.tests: dict = {}
        self.errors: list = []
        self.registry_wrong = None
        self._before = collections.Counter()

    def pytest_collectreport(self, report):
        if report.failed:
            self.errors.append(f"{report.nodeid}: {report.longreprtext.splitlines()[-1:]}")

    def pytest_collection_finish(self, session):
        if self.mode != "off":
            self.registry_wrong = registry_is_ours(self.ours)

    def pytest_runtest_logreport(self, report):
        entry = self.tests.setdefault(report.nodeid, {"outcome": "passed", "calls": {}})
        if hasattr(report, "wasxfail"):
            entry["outcome"] = "xfailed" if report.skipped else "xpassed"
        elif report.failed:
            entry["outcome"] = "failed" if report.when == "call" else "error"
            entry["message"] = report.longreprtext.strip().splitlines()[-1:] \
                if report.longreprtext else []
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"
        if report.when == "teardown":
            entry["calls"] = dict(CALLS - self._before)

    def pytest_runtest_setup(self, item):
        self._before = CALLS.copy()

    def write(self, path):
        with open(path, "w") as f:
            json.dump({"mode": self.mode, "tests": self.tests, "collect_errors": self.errors,
                       "registry_wrong": self.registry_wrong}, f, indent=1, sort_keys=True)


def main(argv):
    mode, report, *args = argv
    if mode not in MODES:
        raise SystemExit(f"mode must be one of {MODES}, got {mode!r}")
    os.chdir(REPO)
    # this script's folder (the repository's tests/) is no package of the frameworks' tests
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]
    if mode == "on-triton":  # Triton's interpreter (the tests' tensors are mostly on the CPU),
        os.environ["TRITON_INTERPRET"] = "1"  # chosen before rl_triton imports triton
    install_stubs(frameworks_path())
    ours = {} if mode == "off" else switch_on(backend=mode.partition("-")[2] or "auto")
    import pytest

    recorder = Recorder(mode, ours)
    # the frameworks' own rootdir and no configuration file: the repository's pytest options
    # (and its tests/conftest.py) stay out of the frameworks' run
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly",
                        "--rootdir", frameworks_path(), "-c", os.devnull, *args],
                       plugins=[recorder])
    recorder.write(report)
    return 0 if code in (0, 1) else int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
