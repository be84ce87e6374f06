"""Out-of-bounds accesses, found on the CPU: in Triton's interpreter a load past a tensor reads
whatever memory lies there (a GPU faults, and the fault poisons the process), so tests that
promise a kernel stays inside its tensors whatever its offsets hold run under `bounds_checked`."""
import contextlib
import os

import numpy as np
import pytest
import torch


@contextlib.contextmanager
def bounds_checked():
    """Every load, store and atomic of a kernel launched inside (Triton's interpreter) must touch
    only bytes of the launch's tensor arguments' storages: an IndexError naming the kernel
    otherwise. Outside the interpreter (compiled kernels) it checks nothing: a GPU faults."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from triton.runtime import interpreter
    if not hasattr(interpreter, "GridExecutor"):
        pytest.fail("Triton's interpreter changed: bounds_checked cannot watch it")
    ranges, names = [], []
    executor, builder = interpreter.GridExecutor, type(interpreter.interpreter_builder)
    init, call = executor._init_args_hst, executor.__call__

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = init(self, args_dev, kwargs)
        ranges.clear()

        def walk(arg):
            if isinstance(arg, (tuple, list)):
                for a in arg:
                    walk(a)
            elif isinstance(arg, torch.Tensor):
                s = arg.untyped_storage()
                ranges.append((s.data_ptr(), s.data_ptr() + s.nbytes()))

        walk(args_hst)
        walk(list(kwargs_hst.values()))
        return args_hst, kwargs_hst

    def launch(self, *args, **kwargs):
        names.append(getattr(self.fn, "__name__", str(self.fn)))
        try:
            return call(self, *args, **kwargs)
        finally:
            names.pop()

    def check(ptrs, mask, what):
        p = np.asarray(ptrs.data, dtype=np.uint64)
        if mask is not None:
            p = p[np.broadcast_to(np.asarray(mask.data, dtype=bool), p.shape)]
        size = max(ptrs.get_element_ty().primitive_bitwidth // 8, 1)
        ok = np.zeros(p.shape, bool)
        for lo, hi in ranges:
            ok |= (p >= lo) & (p + size <= hi)
        if not ok.all():
            raise IndexError(f"{names[-1] if names else 'a kernel'}: {what} of "
                             f"{int((~ok).sum())} element(s) outside its tensors")

    originals = {}

    def wrap(name, ptr_at, mask_at):
        f = getattr(builder, name)
        originals[name] = f

        def guarded(self, *args):
            check(args[ptr_at], None if mask_at is None else args[mask_at], name)
            return f(self, *args)
        setattr(builder, name, guarded)

    executor._init_args_hst, executor.__call__ = init_args, launch
    wrap("create_masked_load", 0, 1)
    wrap("create_masked_store", 0, 2)
    wrap("create_atomic_rmw", 1, 3)
    wrap("create_atomic_cas", 0, None)
    try:
        yield
    finally:
        executor._init_args_hst, executor.__call__ = init, call
        for name, f in originals.items():
            setattr(builder, name, f)
