"""Every public op has its test module, tests/ops/test_<op>.py, and every scan op of
`rl_triton.testing.NAMES` is in its module's OPS: the checks shared by the ops run for it."""
import importlib
from pathlib import Path

import rl_triton
from rl_triton.testing import NAMES, public_name


def test_every_op_has_its_module():
    here = Path(__file__).parent
    assert not [op for op in rl_triton.__all__ if not (here / f"test_{op}.py").exists()]
    missing = [n for n in NAMES
               if n not in importlib.import_module(f"test_{public_name(n)}").OPS]
    assert not missing, f"not in their modules' OPS: {missing}"
