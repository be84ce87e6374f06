"""The primitive `linear_scan` (docs/semantics.md §2), both directions: against its float64 reference
(rl_triton/reference.py), forward and backward; its masks, packed rows, non-finite inputs and
boundaries; its large shapes on a CUDA device (marked gpu_large). The checks it shares with
other ops (tests/ops/op_checks) run here for it too."""
import pytest
import torch

import op_checks
import rl_triton
from rl_triton.testing import NAMES

OPS = [n for n in NAMES if n.startswith("linear_scan")]
