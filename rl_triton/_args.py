"""Argument normalization, shared by every estimator.

Each public function describes its arguments to a `Call`, which checks them (type, dtype, device,
shape, time axis, scalars, option strings) before any backend runs and hands the backends
time-major views: `[T, *batch]` for per-step tensors, `[*batch]` for bootstraps. Views, never
copies: the Triton backend reads the caller's memory in place through the views' strides.
"""
from __future__ import annotations

import numbers

import torch

VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
BACKENDS = ("auto", "triton", "torch", "loop")

VALUE = "value"  # float32 / bfloat16 / float16
FLAG = "flag"  # bool, any integer dtype, or any float dtype holding 0/1
INDEX = "index"  # any integer dtype (action indices)


def _describe(x) -> str:
    return f"a {type(x).__name__}" if not isinstance(x, torch.Tensor) else f"dtype {x.dtype}"


def _check_dtype(name: str, x: torch.Tensor, kind: str) -> None:
    dt = x.dtype
    if kind == VALUE:
        ok = dt in VALUE_DTYPES
        want = "float32, bfloat16 or float16"
    elif kind == FLAG:
        ok = not dt.is_complex
        want = "bool, an integer dtype or a float dtype"
    else:
        ok = dt != torch.bool and not dt.is_floating_point and not dt.is_complex
        want = "an integer dtype"
    if not ok:
        raise TypeError(f"{name} has dtype {dt}; expected {want}")


def check_scalar(name: str, value, *, low: float = 0.0, high: float | None = 1.0,
                 low_open: bool = False) -> float:
    """A Python number in [low, high] (or (low, high] when low_open), returned as float."""
    if type(value) is float and (low < value if low_open else low <= value) and (
            high is None or value <= high):
        return value  # the common case, first: this runs on every call
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    v = float(value)
    if v != v or (v <= low if low_open else v < low) or (high is not None and v > high):
        lo = "(" if low_open else "["
        hi = f"{high}]" if high is not None else "inf)"
        raise ValueError(f"{name}={value!r} is outside {lo}{low}, {hi}")
    return v


def check_backend(backend, device: torch.device) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}; got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def check_out_dtype(out_dtype) -> torch.dtype:
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {', '.join(map(str, OUT_DTYPES))}; got {out_dtype!r}")
    return out_dtype


class Call:
    """The checked arguments of one estimator call.

    `ref` (named `ref_name`) fixes the layout: its shape is `step_shape`, its axis `time_dim`
    (negative counts from the end of `ref`) is the time axis. Per-step tensors must have
    `step_shape` followed by their own trailing axes; bootstrap tensors the batch shape (the step
    shape without its time axis) followed by theirs.
    """

    def __init__(self, ref_name: str, ref, time_dim, kind: str = VALUE):
        if not isinstance(ref, torch.Tensor):
            raise TypeError(f"{ref_name} must be a torch.Tensor, got {type(ref).__name__}")
        if ref.ndim == 0:
            raise ValueError(f"{ref_name} must have a time axis; got a 0-d tensor")
        if isinstance(time_dim, bool) or not isinstance(time_dim, int):
            raise TypeError(f"time_dim must be an int, got {type(time_dim).__name__}")
        if not -ref.ndim <= time_dim < ref.ndim:
            raise ValueError(f"time_dim={time_dim} is out of range for {ref_name} with shape "
                             f"{tuple(ref.shape)} ({ref.ndim} dimensions)")
        self.ref_name = ref_name
        self.time_dim = time_dim % ref.ndim
        self.step_shape = tuple(ref.shape)
        self.T = ref.shape[self.time_dim]
        self.batch_shape = self.step_shape[:self.time_dim] + self.step_shape[self.time_dim + 1:]
        self.device = ref.device
        self._check(ref_name, ref, kind)

    def _check(self, name: str, x, kind: str) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.device != self.device:
            raise ValueError(f"{name} is on {x.device} but {self.ref_name} is on {self.device}; "
                             "all tensors must be on one device")
        _check_dtype(name, x, kind)

    def step(self, name: str, x, kind: str = VALUE, *, trailing: int = 0,
             trailing_shape: tuple | None = None, optional: bool = False):
        """A per-step tensor as a time-major view `[T, *batch, *trailing]` (or None)."""
        if x is None:
            if optional:
                return None
            raise ValueError(f"{name} is required")
        self._check(name, x, kind)
        if trailing_shape is not None:
            trailing = len(trailing_shape)
        lead = tuple(x.shape[:len(self.step_shape)])
        tail = tuple(x.shape[len(self.step_shape):])
        if lead != self.step_shape or len(tail) != trailing or (
                trailing_shape is not None and tail != tuple(trailing_shape)):
            want = self.step_shape + (tuple(trailing_shape) if trailing_shape is not None
                                      else ("...",) * trailing)
            raise ValueError(f"{name} has shape {tuple(x.shape)} but {self.ref_name} has shape "
                             f"{self.step_shape}; {name} must have shape "
                             f"{_fmt_shape(want)}")
        return x.detach().movedim(self.time_dim, 0)

    def bootstrap(self, name: str, x, kind: str = VALUE, *, trailing_shape: tuple = (),
                  optional: bool = True):
        """A tensor without time axis, shape `[*batch, *trailing_shape]` (or None)."""
        if x is None:
            if optional:
                return None
            raise ValueError(f"{name} is required")
        self._check(name, x, kind)
        want = self.batch_shape + tuple(trailing_shape)
        if tuple(x.shape) != want:
            raise ValueError(f"{name} has shape {tuple(x.shape)} but {self.ref_name} has shape "
                             f"{self.step_shape} with time_dim={self.time_dim}; {name} must have "
                             f"shape {_fmt_shape(want)} ({self.ref_name}'s shape without its time "
                             "axis)")
        return x.detach()

    def require_bootstrap(self, next_values, last_value) -> None:
        if next_values is None and last_value is None:
            raise ValueError("pass last_value (the value of the state after the last step) or "
                             "next_values (the successor value of every step); a silent zero "
                             "bootstrap is refused")
        if next_values is not None and last_value is not None:
            raise ValueError("pass either last_value or next_values, not both")

    def output(self, dtype: torch.dtype, trailing_shape: tuple = ()):
        """A new output in the caller's layout, and its time-major view."""
        out = torch.empty(self.step_shape + tuple(trailing_shape), dtype=dtype, device=self.device)
        return out, out.movedim(self.time_dim, 0)


def _fmt_shape(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
