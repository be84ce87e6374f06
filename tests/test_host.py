"""The C++ host path of launch plans (rl_triton/_triton/host.py, host.cpp), everywhere: the
kernel's parameter list is derived from Triton's compiled signature as Triton's launcher derives
it, checked against the PTX entry, and the extension builds. On a CUDA device, test_gpu_host.py
checks that later calls take the C++ path and give exactly what the Python path gives.
"""
import pytest
import torch

from rl_triton._triton import host

Src = host.Src


def test_parameters_follow_the_signature():
    """Tuples are flattened, constexpr entries dropped; markers and integers keep their order."""
    sig = [("*fp32", "constexpr", "*i8"), ("i32", "constexpr"), "*fp32", "*i64",
           ("fp32", "fp32"), "i64", "constexpr", "constexpr"]
    args = ((Src(host.INPUT, 0), Src(host.OUTPUT, 0), Src(host.INPUT, 2)), (7, 1),
            Src(host.OUTPUT, 1), Src(host.STATE), (Src(host.SCALAR, 0), Src(host.SCALAR, 1)),
            2**40, True, "meta")
    kinds, values, widths = host.parameters(sig, args)
    assert kinds == [host.INPUT, host.INPUT, host.CONST, host.OUTPUT, host.STATE, host.SCALAR,
                     host.SCALAR, host.CONST]
    assert values == [0, 2, 7, 1, 0, 0, 1, 2**40]
    assert widths == [8, 8, 4, 8, 8, 4, 4, 8]


@pytest.mark.parametrize("sig,arg", [
    ("fp64", Src(host.SCALAR, 0)),  # scalars travel as float32 only
    ("i32", Src(host.SCALAR, 0)),
    ("fp32", Src(host.INPUT, 0)),  # a tensor where the kernel takes a number
    ("i1", True),  # a bool argument the compiler kept
    ("fp32", 0.5),  # a float not given per call
    ("*fp32", 3),
])
def test_parameters_refuse_what_the_path_does_not_pass(sig, arg):
    assert host.parameters(["i32", sig], (5, arg)) is None


def test_parameters_need_matching_arity():
    assert host.parameters(["i32", "i32"], (1,)) is None
    assert host.parameters([("i32", "i32")], ((1, 2, 3),)) is None


def test_ptx_parameter_widths():
    ptx = """
.visible .entry scan_kernel(
\t.param .u64 .ptr .global .align 1 scan_kernel_param_0,
\t.param .u32 scan_kernel_param_1,
\t.param .f32 scan_kernel_param_2,
\t.param .u64 scan_kernel_param_3
)
.reqntid 64, 1, 1
{
\t.param .b32 retval0;
}"""
    assert host.ptx_parameter_widths(ptx) == [8, 4, 4, 8]
    assert host.ptx_parameter_widths("no kernel here") is None


def test_extension_builds():
    """The C++ source builds against the installed torch (CI: the newest one pinned)."""
    assert host.module() is not None


def test_table_finds_plans_by_the_python_signature():
    """The C++ table finds a plan exactly when the Python plan cache would: same shapes,
    strides, dtypes, devices, 16-byte alignment and None pattern (other data: same plan)."""
    from rl_triton import estimators

    mod = host.module()
    # A plan for CUDA device 99: running it fails at once (no such device, or no CUDA at all).
    plan = mod.make(0, 1, 32, 0, 99, (3,), torch.float32, 1, [host.CONST], [0])
    table = mod.table()
    base, other = torch.zeros(6, 4), torch.ones(6, 4)
    tensors = (base, None, base[:, :2])
    mod.table_add(table, tensors, plan)

    def found(ts):
        try:
            return mod.call(table, ts, ()) is not None
        except RuntimeError:  # found, and run
            return True

    calls = [
        tensors,
        (other, None, other[:, :2]),  # other data, same signature
        (torch.zeros(6, 5), None, base[:, :2]),  # shape
        (base.t().contiguous().t(), None, base[:, :2]),  # strides
        (base.double(), None, base[:, :2]),  # dtype
        (base, base, base[:, :2]),  # a tensor where there was None
        (base, None, torch.zeros(25)[1:].view(6, 4)[:, :2]),  # 4-byte offset: alignment
        (base, None),  # count
        (base, None, 3.0),  # not a tensor
    ]
    same = [estimators._signature("x", ts, ()) == estimators._signature("x", tensors, ())
            for ts in calls]
    assert same == [True, True] + [False] * 7
    assert [found(ts) for ts in calls] == same
    mod.table_clear(table)
    assert not found(tensors)


class _Module:
    """Stands in for the extension: records what `make` receives."""

    def __init__(self, error=None):
        self.error, self.calls = error, []

    def make(self, *args):
        if self.error is not None:
            raise self.error
        self.calls.append(args)
        return "plan"


def _kernel(ptx_params=(".u64", ".u32", ".u64", ".u64"), **metadata):
    from types import SimpleNamespace
    md = dict(num_ctas=1, num_warps=4, shared=512, launch_cooperative_grid=False,
              launch_pdl=False, global_scratch_size=0, profile_scratch_size=0)
    md.update(metadata)
    params = ",\n".join(f"\t.param {t} k_param_{i}" for i, t in enumerate(ptx_params))
    return SimpleNamespace(metadata=SimpleNamespace(**md), function=1234,
                           src=SimpleNamespace(signature={"x": "*fp32", "n": "i32",
                                                          "BLOCK": "constexpr"}),
                           asm={"ptx": f".visible .entry k(\n{params}\n)\n{{\n}}"})


def _make(monkeypatch, module, kernel):
    monkeypatch.setitem(host._STATE, "tried", True)
    monkeypatch.setitem(host._STATE, "module", module)
    return host.make(kernel, 7, (Src(host.INPUT, 0), 5, 64), 0, (3,), torch.float32, 1)


def test_make_passes_the_scratch_pointers_and_launch_shape(monkeypatch):
    mod = _Module()
    assert _make(monkeypatch, mod, _kernel()) == "plan"
    ((function, grid, block, shared, device, shape, dtype, n_out, kinds, values),) = mod.calls
    assert (function, grid, block, shared, device, shape, n_out) == (1234, 7, 128, 512, 0, (3,), 1)
    assert kinds == [host.INPUT, host.CONST, host.CONST, host.CONST]
    assert values == [0, 5, 0, 0]  # the two null scratch pointers last


@pytest.mark.parametrize("kernel", [
    _kernel(ptx_params=(".u64", ".u32")),  # a Triton without the two scratch parameters
    _kernel(ptx_params=(".u64", ".u64", ".u64", ".u64")),  # widths that do not match
    _kernel(launch_pdl=True), _kernel(num_ctas=2), _kernel(global_scratch_size=64),
    _kernel(profile_scratch_size=64),
])
def test_make_leaves_other_kernels_to_the_python_path(monkeypatch, kernel):
    mod = _Module()
    assert _make(monkeypatch, mod, kernel) is None
    assert mod.calls == []


def test_make_falls_back_with_a_warning(monkeypatch):
    with pytest.warns(RuntimeWarning, match="Python path"):
        assert _make(monkeypatch, _Module(OverflowError("too large")), _kernel()) is None
