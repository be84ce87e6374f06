"""Argument checks, shared by every op, run on every call before any cache or backend.

An op describes its arguments to a `Call`, which checks them (type, dtype, device, shape, time
axis, gradients, scalars, option strings) and returns the tensors to use: the caller's own, or
for a lazily negated or conjugated view its values. While checking, a `Call` also collects the
signature that launch plans are cached under (`rl_triton._core.plans`): every tensor's shape,
strides, dtype and 16-byte alignment, so that the one pass over the arguments serves both.
"""
from __future__ import annotations

import numbers

import torch

Tensor = torch.Tensor
# float64 too: gradcheck runs the torch and loop backends in float64 (the kernels compute in
# float32 whatever they read)
VALUE_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16, torch.float64))
FLAG_DTYPES = frozenset((torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32,
                         torch.int64, torch.float32, torch.float64, torch.bfloat16,
                         torch.float16))  # the common ones; `_check_dtype` decides the rest
# (torch reduces no wider unsigned integers: aminmax, unique)
INDEX_DTYPES = frozenset((torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64))
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
BACKENDS = ("auto", "triton", "torch", "loop")

VALUE = "value"  # float32 / bfloat16 / float16 / float64
FLAG = "flag"  # bool, any integer dtype, or a float dtype of VALUE_DTYPES (set where nonzero)
INDEX = "index"  # an integer dtype of INDEX_DTYPES (action indices, labels)


def resolved(x: Tensor) -> Tensor:
    """`x`, a lazily negated view's values where it is one: kernels read memory, the negated
    bits (traced by torch.compile, tensors are no such views)."""
    return x.resolve_neg() if not torch.compiler.is_compiling() and x.is_neg() else x


def _check_dtype(name: str, dt: torch.dtype, kind: str) -> None:
    if kind == VALUE:
        if dt in VALUE_DTYPES:
            return
        want = "float32, bfloat16, float16 or float64"
    elif kind == FLAG:
        if not dt.is_complex and (not dt.is_floating_point or dt in VALUE_DTYPES):
            return
        want = "bool, an integer dtype or float32, bfloat16, float16 or float64"
    else:
        if dt in INDEX_DTYPES:
            return
        want = "an integer dtype: int64, int32, int16, int8 or uint8"
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



def check_clips(clip_low, clip_high, dual_clip, log_ratio_clamp) -> tuple:
    """PPO's clip options checked (semantics §9): clip_low in [0, 1], clip_high >= 0 (default
    clip_low), dual_clip > 1 or None, log_ratio_clamp > 0; returned as floats."""
    clip_low = check_scalar("clip_low", clip_low)
    clip_high = clip_low if clip_high is None else check_scalar("clip_high", clip_high,
                                                                high=None)
    if dual_clip is not None:
        dual_clip = check_scalar("dual_clip", dual_clip, low=1.0, high=None, low_open=True)
    log_ratio_clamp = check_scalar("log_ratio_clamp", log_ratio_clamp, high=None,
                                   low_open=True)
    return clip_low, clip_high, dual_clip, log_ratio_clamp

def check_bool(name: str, value) -> bool:
    if type(value) is not bool:
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_backend(backend) -> str:
    if type(backend) is not str or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}; got {backend!r}")
    return backend


def check_out_dtype(out_dtype) -> torch.dtype:
    if type(out_dtype) is not torch.dtype or out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {', '.join(map(str, OUT_DTYPES))}; got {out_dtype!r}")
    return out_dtype


def check_choice(name: str, value, options: tuple) -> str:
    """An option string among `options`."""
    if type(value) is not str or value not in options:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, options))}; got {value!r}")
    return value


def check_discount(name: str, value):
    """gamma or lam: a Python number in [0, 1], or a floating tensor (one per row, semantics §6),
    returned as it is; its shape and device are checked against the call (`Call.discount`)."""
    if isinstance(value, Tensor):
        if not value.is_floating_point():
            raise TypeError(f"{name} is a tensor of dtype {value.dtype}; a per-row {name} must "
                            "be a floating tensor")
        return value
    return check_scalar(name, value)


def _flag_grad_error(name: str) -> RuntimeError:
    return RuntimeError(
        f"{name} requires grad, but flags and actions are not differentiable (rl_triton never "
        f"detaches an input silently); pass {name}.detach()")


class Call:
    """The checked arguments of one op call.

    `ref` (named `ref_name`) fixes the layout: its shape is `step_shape`, its axis `time_dim`
    (negative counts from the end of `ref`) is the time axis. Per-step tensors must have
    `step_shape` followed by their own trailing axes; bootstrap tensors the batch shape (the step
    shape without its time axis) followed by theirs. `key` is the calls's signature so far.
    With `time_dim=None` (an elementwise op: the losses) there is no time axis, and `ref` may
    have any shape, 0-d included. With `segments` (packed rows, semantics §7: S segments of `ref`'s
    time axis) bootstraps have one entry per segment: `[S, *batch, *trailing]`.
    """

    __slots__ = ("ref_name", "time_dim", "step_shape", "T", "batch_shape", "device", "index",
                 "key", "grad", "needs_grad", "float64", "segments")

    def __init__(self, ref_name: str, ref, time_dim, kind: str = VALUE, segments=None):
        self.segments = segments
        if not isinstance(ref, Tensor):
            raise TypeError(f"{ref_name} must be a torch.Tensor, got {type(ref).__name__}")
        if time_dim is None:  # an elementwise op (the losses, semantics §9): any shape, no time
            self._common(ref_name, ref, None, ref.shape)
            return
        if ref.ndim == 0:
            raise ValueError(f"{ref_name} must have a time axis; got a 0-d tensor")
        if type(time_dim) is not int:
            if isinstance(time_dim, bool) or not isinstance(time_dim, numbers.Integral):
                raise TypeError(f"time_dim must be an int, got {type(time_dim).__name__}")
            time_dim = int(time_dim)
        if not -ref.ndim <= time_dim < ref.ndim:
            raise ValueError(f"time_dim={time_dim} is out of range for {ref_name} with shape "
                             f"{tuple(ref.shape)} ({ref.ndim} dimensions)")
        time_dim %= ref.ndim
        self._common(ref_name, ref, time_dim, ref.shape[:time_dim] + ref.shape[time_dim + 1:])

    def _common(self, ref_name, ref, time_dim, batch_shape):
        self.ref_name = ref_name
        self.time_dim = time_dim
        self.step_shape = ref.shape
        self.T = None if time_dim is None else ref.shape[time_dim]
        self.batch_shape = batch_shape
        self.device = ref.device
        self.index = ref.get_device() if ref.is_cuda else -1
        self.key = None if torch.compiler.is_compiling() else [time_dim, ref.device]
        self.grad = torch.is_grad_enabled()
        self.needs_grad = False  # an input of a differentiable kind requires grad
        self.float64 = False  # a value input is float64 (the torch and loop backends follow it)

    def _check(self, name: str, x, kind: str) -> Tensor:
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        # a CUDA device's index is enough to tell it (an int, cheaper than a torch.device)
        if (x.get_device() != self.index if self.index >= 0 else x.device != self.device):
            raise ValueError(f"{name} is on {x.device} but {self.ref_name} is on {self.device}; "
                             "all tensors must be on one device")
        dt = x.dtype
        if not (dt in VALUE_DTYPES if kind == VALUE else dt in FLAG_DTYPES if kind == FLAG
                else False):
            _check_dtype(name, dt, kind)
        if x.requires_grad and self.grad:
            if kind != VALUE:
                raise _flag_grad_error(name)
            self.needs_grad = True
        if dt is torch.float64 and kind == VALUE:
            self.float64 = True
        if self.key is not None:  # None while torch.compile traces (the custom op checks)
            x = resolved(x)  # (the dtypes above are real, so no conjugate bit)
            self.key.append((x.shape, x.stride(), dt, x.data_ptr() % 16 == 0))
        return x

    def step(self, name: str, x, kind: str = VALUE, *, trailing: int = 0,
             trailing_shape: tuple | None = None, optional: bool = False):
        """A per-step tensor `[*step_shape, *trailing]` (or None), checked."""
        if x is None:
            if optional:
                if self.key is not None:
                    self.key.append(None)
                return None
            raise ValueError(f"{name} is required")
        x = self._check(name, x, kind)
        shape = x.shape
        if trailing_shape is None and not trailing:
            ok = shape == self.step_shape
        elif trailing_shape is not None:
            ok = shape == self.step_shape + tuple(trailing_shape)
        else:
            n = len(self.step_shape)
            ok = len(shape) == n + trailing and shape[:n] == self.step_shape
        if not ok:
            want = tuple(self.step_shape) + (tuple(trailing_shape) if trailing_shape is not None
                                             else ("...",) * trailing)
            raise ValueError(f"{name} has shape {tuple(shape)} but {self.ref_name} has shape "
                             f"{tuple(self.step_shape)}; {name} must have shape "
                             f"{_fmt_shape(want)}")
        return x

    def bootstrap(self, name: str, x, kind: str = VALUE, *, trailing_shape: tuple = (),
                  optional: bool = True):
        """A tensor without time axis, shape `[*batch, *trailing_shape]` (or None), checked."""
        if x is None:
            if optional:
                if self.key is not None:
                    self.key.append(None)
                return None
            raise ValueError(f"{name} is required")
        x = self._check(name, x, kind)
        want = self.batch_shape + tuple(trailing_shape) if trailing_shape else self.batch_shape
        if self.segments is not None:
            want = torch.Size((self.segments,)) + want
            if x.shape != want:
                raise ValueError(f"{name} has shape {tuple(x.shape)} but cu_seqlens has "
                                 f"{self.segments} segments; {name} must have shape "
                                 f"{_fmt_shape(tuple(want))} (one per segment)")
        if x.shape != want:
            raise ValueError(f"{name} has shape {tuple(x.shape)} but {self.ref_name} has shape "
                             f"{tuple(self.step_shape)} with time_dim={self.time_dim}; {name} "
                             f"must have shape {_fmt_shape(tuple(want))} ({self.ref_name}'s "
                             "shape without its time axis)")
        return x

    def discount(self, name: str, value):
        """A per-row gamma or lam (`check_discount`): broadcastable to the batch shape, on the
        call's device (a 0-d CPU tensor is moved there), as a float32 / float64 tensor of
        exactly the batch shape."""
        if not isinstance(value, Tensor):
            return value
        try:
            ok = torch.broadcast_shapes(value.shape, self.batch_shape) == self.batch_shape
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"{name} has shape {tuple(value.shape)}, which does not broadcast "
                             f"to the batch shape {_fmt_shape(tuple(self.batch_shape))} "
                             f"({self.ref_name}'s shape {tuple(self.step_shape)} without its "
                             f"time axis {self.time_dim})")
        return self.adopt_discount(name, value).expand(self.batch_shape)

    def adopt_discount(self, name: str, value: Tensor) -> Tensor:
        """A tensor discount whose shape was checked, on the call's device (a 0-d CPU one is
        moved there) as float32 / float64; its gradient and dtype are recorded in the call."""
        if value.device != self.device and not (value.ndim == 0 and value.device.type == "cpu"):
            raise ValueError(f"{name} is on {value.device} but {self.ref_name} is on "
                             f"{self.device}; all tensors must be on one device")
        if value.requires_grad and self.grad:
            self.needs_grad = True
        if value.dtype is torch.float64:
            self.float64 = True
        return value.to(self.device, torch.float64 if value.dtype is torch.float64
                        else torch.float32)

    def empty(self) -> bool:
        return self.T == 0 or 0 in self.step_shape

    def tm(self, x):
        """The time-major view `[T, *batch, ...]` of a per-step tensor (None stays None)."""
        return None if x is None else x.movedim(self.time_dim, 0)

    def output(self, dtype: torch.dtype, trailing_shape: tuple = ()):
        """A new output in the caller's layout."""
        return torch.empty(tuple(self.step_shape) + tuple(trailing_shape), dtype=dtype,
                           device=self.device)


def signature(tensors) -> tuple:
    """What an op's argument checks read of each tensor argument (None stays None): its type,
    shape, strides, dtype, device, whether it requires grad, its negation bit, and whether its
    data is 16-byte aligned (which launch plans specialize on). Every check a `Call` makes is a
    function of these, so a call whose signature (with the call's options) equals one that
    passed them passes them too: `rl_triton._core.plans` caches plans under it. A non-tensor
    raises AttributeError (then the checks run, and name the argument)."""
    return tuple([None if t is None else
                  (type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.is_neg(),
                   t.data_ptr() % 16 == 0) for t in tensors])


def require_bootstrap(next_values, last_value) -> None:
    if next_values is None and last_value is None:
        raise ValueError("pass last_value (the value of the state after the last step) or "
                         "next_values (the successor value of every step); a silent zero "
                         "bootstrap is refused")
    if next_values is not None and last_value is not None:
        raise ValueError("pass either last_value or next_values, not both")


def check_actions(actions: Tensor, n_act: int) -> None:
    """Every action in [0, n_act): one reduction (and, on CUDA, one sync)."""
    if actions.numel() == 0:
        return
    lo, hi = torch.stack(torch.aminmax(actions)).tolist()  # one sync
    check_action_range(lo, hi, n_act)


def check_action_range(lo: int, hi: int, n_act: int) -> None:
    """The actions' smallest and largest value in [0, n_act), else `ValueError` naming them."""
    if lo < 0 or hi >= n_act:
        bad = lo if lo < 0 else hi
        raise ValueError(f"actions holds {bad}, outside [0, {n_act}) (q_values has {n_act} "
                         "actions); pass check_actions=False only where the actions are known "
                         "to be in range (the kernel then clamps them)")


def _fmt_shape(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def check_offsets(cu, L: int, device: torch.device, *, data: bool = True,
                  dtypes: tuple = (torch.int64,)) -> Tensor:
    """`cu_seqlens` (semantics §7) checked, on `device`, in its own dtype where that is one of
    `dtypes`, else as int64: an integer tensor [S + 1] with 0 = cu[0] <= ... <= cu[S] = L.
    `data=False` checks only the type and shape of offsets on a GPU (`check_offsets=False`,
    CUDA-graph capture: where the host must not read the device); CPU offsets cost nothing to
    read and are read whatever `data` says, but while torch.compile traces. The values are read
    on every call, never cached: an edit through `.data` or a NumPy view bumps no version
    counter. CPU offsets are read through NumPy (no torch op, about 2 µs), CUDA ones with one
    stacked `.tolist()` (one sync)."""
    if not isinstance(cu, Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype is torch.bool:
        raise TypeError(f"cu_seqlens has dtype {cu.dtype}; expected an integer dtype")
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"cu_seqlens must have shape (S + 1,); got {tuple(cu.shape)}")
    if cu.shape[0] == 1 and L != 0:  # no segment: a shape, no value, tells
        raise ValueError(f"cu_seqlens has no segment (shape (1,)) but there are L = {L} packed "
                         "steps")
    cpu = cu.device.type == "cpu"
    if cu.device.type == "meta" and device.type != "meta":  # (no values to read or move)
        raise ValueError(f"cu_seqlens is on {cu.device} but the data is on {device}; pass the "
                         "offsets on the data's device or on the CPU")
    cu = resolved(cu)
    if data or (cpu and not torch.compiler.is_compiling()):
        if cpu:  # read where it lies, without a torch op
            c = cu.numpy()
            first, last, rising = int(c[0]), int(c[-1]), bool((c[1:] >= c[:-1]).all())
        else:
            first, last, rising = torch.stack([cu[0].long(), cu[-1].long(),
                                               (cu[1:] >= cu[:-1]).all().long()]).tolist()
        if first != 0 or last != L or not rising:
            raise ValueError(f"cu_seqlens must start at 0, end at L = {L} (the packed "
                             f"steps) and never decrease; got cu[0] = {first}, cu[-1] = {last}"
                             + ("" if rising else ", and it decreases"))
    if cu.device == device and cu.dtype in dtypes:
        return cu
    return cu.to(device, cu.dtype if cu.dtype in dtypes else torch.int64)
