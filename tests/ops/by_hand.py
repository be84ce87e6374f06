"""Helpers of the hand-computed boundary cases and identities between ops (tests/ops/test_<op>.py),
run on every backend."""
import pytest
import torch

from cases import BACKENDS

G, L = 0.5, 0.5


def t(*rows):
    """A [T, 1] float tensor from T numbers."""
    return torch.tensor(rows, dtype=torch.float32)[:, None]


def flags(*rows):
    return torch.tensor(rows, dtype=torch.bool)[:, None]


def close(a, expected):
    assert torch.allclose(a.cpu(), t(*expected), atol=1e-6, rtol=1e-6), (a.flatten(), expected)


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Every backend, for the tests that take `backend` without parametrizing it."""
    return request.param


R, V, LAST = t(1.0, 2.0, 3.0), t(0.5, 1.0, 1.5), torch.tensor([2.0])


def successor(values, last_value):
    return torch.cat([values[1:], last_value[None]])
