"""Every public op has its test module, tests/ops/test_<op>.py, or the one module named for it in
SHARED; and every scan op of `rl_triton.testing.NAMES` is in its module's OPS: the checks shared
by the ops run for it."""
import importlib
from pathlib import Path

import rl_triton
from rl_triton.testing import NAMES, public_name

# ops tested together in one module, relative to tests/: the fused loss head's two functions
# share its chunked kernels and reference; rollout_correction is tested with the verl and
# OpenRLHF drop-ins it serves (the zoo)
SHARED = {"token_log_probs": "ops/test_loss_head.py",
          "linear_policy_loss": "ops/test_loss_head.py",
          "rollout_correction": "test_zoo.py"}


def test_every_op_has_its_module():
    here = Path(__file__).parent
    assert set(SHARED) <= set(rl_triton.__all__), set(SHARED) - set(rl_triton.__all__)
    assert not [op for op in SHARED if op not in (here.parent / SHARED[op]).read_text()]
    assert not [op for op in rl_triton.__all__
                if op not in SHARED and not (here / f"test_{op}.py").exists()]
    missing = [n for n in NAMES
               if n not in importlib.import_module(f"test_{public_name(n)}").OPS]
    assert not missing, f"not in their modules' OPS: {missing}"
