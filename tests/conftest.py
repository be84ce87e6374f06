"""Test set-up: compiled kernels on a CUDA machine, Triton's interpreter everywhere else.

The interpreter must be chosen before triton is imported, so this runs first.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# JAX (the gymnax tests) takes 75% of the GPU's memory at its first use unless told not to:
# with one GPU shared by the pytest-xdist workers that starves every torch test beside it
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device():
    return DEVICE


if torch.cuda.is_available():
    @pytest.fixture(autouse=True)
    def _return_cached_gpu_memory():
        """The workers share one GPU: a large test's cached blocks go back to the driver after
        it, not kept by its worker's allocator while the others run out."""
        yield
        if torch.cuda.memory_reserved() > 2**30:
            torch.cuda.empty_cache()


def pytest_generate_tests(metafunc):
    """A shared check (`cases.per_op`) runs the rows of the ops of the module it is installed in."""
    spec = getattr(metafunc.function, "per_op", None)
    if spec is None:
        return
    keep = [i for i, row in enumerate(spec.rows) if spec.op(row) in metafunc.module.OPS]
    metafunc.parametrize(spec.argnames, [spec.rows[i] for i in keep],
                         ids=None if spec.ids is None else [spec.ids[i] for i in keep])


def pytest_collection_modifyitems(config, items):
    """Large-shape tests (marked gpu_large) need a CUDA device: skipped elsewhere."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu_large: needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu_large") is not None:
            item.add_marker(skip)
