"""Checks shared by several ops, each parametrized over the ops it applies to (`cases.per_op`).

A test module of one op (tests/ops/test_<op>.py) sets `OPS`, the names `rl_triton.testing` gives
its calls (linear_scan: `linear_scan_reverse` and `linear_scan_forward`), and ends with
`op_checks.install(globals(), OPS)`: the checks that apply to one of its ops, and the fixtures
they use, become its own, run for its ops only.
"""
from __future__ import annotations

import importlib
import pkgutil

import pytest

_FIXTURE = type(pytest.fixture(lambda: None))


def install(namespace: dict, ops) -> None:
    """Put the shared checks that apply to any of `ops`, and every shared fixture, into
    `namespace` (a test module's globals); a name the module already has is an error."""
    for name in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        module = importlib.import_module(f"{__name__}.{name}")
        for key, value in vars(module).items():
            if key.startswith("test_") and callable(value):
                spec = getattr(value, "per_op", None)
                assert spec is not None, f"{module.__name__}.{key}: a shared check needs per_op"
                if not any(spec.op(row) in ops for row in spec.rows):
                    continue
            elif not isinstance(value, _FIXTURE) or value.__module__ != module.__name__:
                continue  # not a fixture, or one the check module imported
            if namespace.get(key, value) is not value:
                raise AssertionError(f"{key} of {module.__name__} is already in the test module")
            namespace[key] = value
