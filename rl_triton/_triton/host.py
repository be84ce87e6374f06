"""The C++ host path of launch plans (`host.cpp`).

A plan's later calls allocate their outputs and launch the compiled kernel from C++: Triton's
Python launcher, the per-argument work of its C launcher (a Python `data_ptr()` call and a driver
query per pointer) and Python's tensor allocation cost 20-25 µs per call on the H200 machine
(docs/benchmarks.md), this path a few.

The extension is built with `torch.utils.cpp_extension` (a C++ compiler and ninja; the CUDA
toolkit is not needed) the first time a CUDA plan launches, and cached by torch under
`TORCH_EXTENSIONS_DIR`. Where it cannot be built (a warning says why), or with
`RL_TRITON_HOST=python`, plans keep the Python path.
"""
from __future__ import annotations

import os
import re
import threading
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

INPUT, OUTPUT, STATE, CONST, SCALAR = range(5)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host.cpp")
_LOCK = threading.Lock()
_STATE = {"tried": False, "module": None}


@dataclass(frozen=True)
class Src:
    """A kernel argument taken from the call: input tensor, output, scratch or scalar `index`."""
    kind: int
    index: int = 0


def module():
    """The built extension, or None (Python path). Built once per process, on first use."""
    if not _STATE["tried"]:
        with _LOCK:
            if not _STATE["tried"]:
                _STATE["module"] = _build()
                _STATE["tried"] = True
    return _STATE["module"]


def _build():
    choice = os.environ.get("RL_TRITON_HOST", "cpp")
    if choice == "python":
        return None
    if choice != "cpp":
        raise ValueError(f"RL_TRITON_HOST must be 'cpp' or 'python', got {choice!r}")
    try:
        from torch.utils import cpp_extension
        return cpp_extension.load(name="rl_triton_host", sources=[_SOURCE],
                                  extra_cflags=["-O2"],
                                  verbose=os.environ.get("RL_TRITON_HOST_VERBOSE") == "1")
    except Exception as e:  # no compiler, no ninja, no headers: the Python path still works
        warnings.warn(f"rl_triton: the C++ host path did not build ({type(e).__name__}: {e}); "
                      "launches take the Python path (about 20 us more per call). Set "
                      "RL_TRITON_HOST=python to silence this.", RuntimeWarning, stacklevel=3)
        return None


_WIDTH = {"i32": 4, "fp32": 4, "i64": 8, "u64": 8}  # bytes; pointers take 8


def parameters(signature: list, args: tuple) -> Optional[tuple]:
    """(kinds, values, widths in bytes) of the kernel's parameters, from its compiled signature
    (one type per argument, tuples for tuple arguments, "constexpr" for what the compiler folded)
    and the arguments (`Src` markers, ints, constexpr values); None when a parameter's type is
    not one this path passes."""
    kinds, values, widths = [], [], []

    def walk(sig, arg):
        if isinstance(sig, tuple):
            if not isinstance(arg, tuple) or len(arg) != len(sig):
                return False
            return all(walk(s, a) for s, a in zip(sig, arg))
        if sig == "constexpr":
            return True
        if isinstance(arg, Src):
            ok = sig == "fp32" if arg.kind == SCALAR else sig.startswith("*")
            kinds.append(arg.kind)
            values.append(arg.index)
            widths.append(4 if arg.kind == SCALAR else 8)
            return ok
        if isinstance(arg, int) and not isinstance(arg, bool) and sig in ("i32", "i64", "u64"):
            kinds.append(CONST)
            values.append(arg)
            widths.append(_WIDTH[sig])
            return True
        return False

    if len(signature) != len(args) or not all(walk(s, a) for s, a in zip(signature, args)):
        return None
    return kinds, values, widths


def ptx_parameter_widths(ptx: str) -> Optional[list]:
    """The byte widths of the parameters of the PTX's kernel entry, None without one."""
    m = re.search(r"\.entry\s+\w+\s*\((.*?)\)", ptx, re.S)
    if m is None:
        return None
    return [int(bits) // 8 for bits in re.findall(r"\.param\s+\.[a-z]+(\d+)", m.group(1))]


def make(kernel, grid: int, args: tuple, device_index: int, out_shape: tuple,
         out_dtype: torch.dtype, n_out: int):
    """The C++ plan of a compiled Triton kernel launched on `args` (see `parameters`), or None
    when the extension is missing or the kernel needs what this path does not do (launch
    attributes, scratch memory Triton allocates per launch, other parameter types)."""
    mod = module()
    md = getattr(kernel, "metadata", None)
    src = getattr(kernel, "src", None)
    if mod is None or md is None or src is None or getattr(kernel, "function", None) is None:
        return None
    plain = (getattr(md, "num_ctas", 1) == 1 and not getattr(md, "launch_cooperative_grid", False)
             and not getattr(md, "launch_pdl", False)
             and not getattr(md, "global_scratch_size", 0)
             and not getattr(md, "profile_scratch_size", 0)
             and not getattr(getattr(kernel, "_run", None), "gsan_enabled", False))
    params = parameters(list(src.signature.values()), args) if plain else None
    if params is None:
        return None
    kinds, values, widths = params
    # Triton's launchers pass two pointers after the arguments (global and profile scratch,
    # null when unused): the PTX entry says whether this build of the kernel has them.
    if ptx_parameter_widths(kernel.asm.get("ptx", "")) != widths + [8, 8]:
        return None
    try:
        return mod.make(kernel.function, grid, 32 * md.num_warps, md.shared, device_index,
                        tuple(out_shape), out_dtype, n_out, kinds + [CONST, CONST],
                        values + [0, 0])
    except (TypeError, ValueError, OverflowError, RuntimeError) as e:
        warnings.warn(f"rl_triton: no C++ launch for this plan ({type(e).__name__}: {e}); its "
                      "calls take the Python path", RuntimeWarning, stacklevel=2)
        return None
