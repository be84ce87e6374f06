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


# CUDA errors after which the process's context is lost: every later CUDA call of the worker
# fails too, so the worker leaves and pytest-xdist starts a fresh one (the test is reported as
# the crash it is, not hidden among hundreds of failures it did not cause)
STICKY_CUDA_ERRORS = ("illegal memory access", "misaligned address", "unspecified launch failure",
                      "illegal instruction", "device-side assert triggered")

if torch.cuda.is_available():
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        yield
        if call.excinfo is not None and any(e in str(call.excinfo.value)
                                            for e in STICKY_CUDA_ERRORS):
            import sys
            print(f"\n{item.nodeid}: {call.excinfo.value}\nthe CUDA context is lost; this "
                  "worker stops", file=sys.stderr, flush=True)
            os._exit(3)

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
