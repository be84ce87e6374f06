"""Every scan op, every backend, against its float64 sequential reference (shared checks, run
in each op's module: tests/ops/test_<op>.py)."""
import pytest
import torch

from rl_triton._core import plans as _plans
from rl_triton.scan import tiles
from cases import BACKENDS, ESTIMATORS, FLAG_DTYPES, assert_close, make_case, per_op, rel_err

SHAPES = [(1, (1,)), (37, (5,)), (333, (50,)), (16, (3, 4))]
LAYOUTS = ["time-major", "batch-major", "transposed-view"]


# The slow sequential loop runs its largest shape in one layout only.
GRID = [(b, shape, layout) for b in BACKENDS for shape in SHAPES for layout in LAYOUTS
        if not (b == "loop" and shape[0] * shape[1][0] > 2000 and layout != "time-major")]


@per_op("name", ESTIMATORS)
@pytest.mark.parametrize("backend,shape,layout", GRID)
def test_matches_reference(name, backend, shape, layout, device):
    T, batch = shape
    i = SHAPES.index(shape) + LAYOUTS.index(layout)
    case = make_case(name, T, batch, device=device, flag_dtype=FLAG_DTYPES[i % len(FLAG_DTYPES)],
                     trunc=i % 2 == 0, seed=i)
    assert_close(case.call(layout, backend=backend), case.reference())


@per_op("name", ESTIMATORS)
@pytest.mark.parametrize("flag_dtype", FLAG_DTYPES, ids=str)
def test_flag_dtypes(name, flag_dtype, device):
    case = make_case(name, 41, (3,), device=device, flag_dtype=flag_dtype, seed=7)
    ref = case.reference()
    for backend in ("torch", "triton"):
        assert_close(case.call(backend=backend), ref)


@per_op("name", ESTIMATORS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_inputs_float32_math(name, dtype, device):
    """bf16 / f16 inputs, float32 arithmetic: the reference sees the same rounded inputs, so the
    error is float32 rounding, not half-precision rounding."""
    case = make_case(name, 77, (6,), dtype=dtype, device=device, seed=3)
    ref = case.reference()
    for backend in ("torch", "triton"):
        for layout in ("time-major", "batch-major"):
            assert_close(case.call(layout, backend=backend), ref, tol=1e-5)


@per_op("name", ["gae", "lambda_returns", "vtrace"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_next_values_equals_last_value_path(name, backend, device):
    """next_values = values shifted by one with last_value appended gives the same result."""
    case = make_case(name, 53, (4,), device=device, seed=11)
    with_last = case.call(backend=backend)
    lv = case.extra.pop("last_value")
    case.steps["next_values"] = torch.cat([case.steps["values"][1:], lv[None]])
    with_next = case.call(backend=backend)
    for a, b in zip(with_next, with_last):
        assert rel_err(a, b) < 1e-6
    assert_close(with_last, case.reference())


@per_op("name", ["gae", "lambda_returns", "vtrace", "discounted_returns"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_same_step_autoreset_next_values(name, backend, device):
    """next_values that differ from values[t+1] at truncations (same-step autoreset)."""
    case = make_case(name, 61, (5,), device=device, seed=5, bootstrap="next_values",
                     p_trunc=0.2)
    assert_close(case.call("batch-major", backend=backend), case.reference())


@per_op("name", ["eligibility_traces", "episodic_cumsum"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_trailing_feature_axes(name, backend, layout, device):
    case = make_case(name, 29, (4,), features=(3, 2), device=device, seed=9)
    assert_close(case.call(layout, backend=backend), case.reference())


@per_op("name", ESTIMATORS)
@pytest.mark.parametrize("time_major", [True, False])
def test_long_rows_split_across_programs(name, time_major, device):
    """T = 5 * block + 7: six tiles per row. One tile per program: each finds its carry by
    look-back, reading one, two or sixteen tiles per step of the look-back (windows that end
    before, at and past the start), or one or three of a window of sixteen (GPU one-row tiles
    read one). One program per row tile, walking its six tiles."""
    T = 5 * 16 + 7
    case = make_case(name, T, (3,), device=device, seed=13)
    layout = "time-major" if time_major else "batch-major"
    ref = case.reference()
    for window, depth, walk in ((1, 0, False), (2, 0, False), (16, 0, False), (16, 1, False),
                                (16, 3, False), (16, 0, True)):
        with tiles.override(block_t=16, block_b=2, window=window, depth=depth, walk=walk):
            assert_close(case.call(layout, backend="triton"), ref)
            assert_close(case.call(layout, backend="triton"), ref)  # a second launch, same scratch


@per_op("name", ESTIMATORS)
def test_time_major_sub_tiles(name, device):
    """Time-major tiles run as 1 to 16 sub-tiles of every sub-th step (each thread holds
    consecutive steps, `scan.scan_chunk`), with their tiles' carries found by look-back or by
    walking: the same results. Rows of 5 (odd time strides) and of 4 (loaded 4 at a time,
    `ops.row_vector`). Retrace's tiles are 3-D (the rule gives them one sub-tile)."""
    T = 5 * 16 + 7
    for n, runs in ((5, ((2, 2, False), (4, 8, False), (16, 8, False))),
                    (4, ((4, 2, True), (8, 8, True), (4, 4, False)))):
        case = make_case(name, T, (n,), device=device, seed=17, p_term=0.1, p_trunc=0.1)
        ref = case.reference()
        for sub, block_b, walk in runs:
            with tiles.override(block_t=16, block_b=block_b, sub=sub, walk=walk):
                assert_close(case.call("time-major", backend="triton"), ref)


@per_op("name", ESTIMATORS)
def test_full_tiles_drop_their_masks(name, device):
    """Plans whose tiles divide the problem (T and the rows multiples of the tile) compile
    without masks (`tiles.even`, `EVEN`; a GPU keeps them where dropping them costs warps),
    others with: the same results, in one tile per row, looking back and walking, in both
    layouts. Retrace's action axis keeps its own mask (5 actions in a block of 8)."""
    for T, n in ((32, 4), (32, 5), (35, 4)):
        case = make_case(name, T, (n,), device=device, seed=23, p_term=0.1, p_trunc=0.1)
        ref = case.reference()
        for layout, block_t, block_b, walk in (("time-major", 16, 4, False),
                                               ("time-major", 32, 2, False),
                                               ("batch-major", 16, 2, False),
                                               ("batch-major", 16, 1, True)):
            _plans._PLANS.clear()
            with tiles.override(block_t=block_t, block_b=block_b, walk=walk):
                assert_close(case.call(layout, backend="triton"), ref)
                (plan,) = _plans._PLANS.values()
                full = T % block_t == 0 and n % block_b == 0
                # a GPU keeps the masks where dropping them costs warps (op_checks/large.py)
                assert plan.meta["EVEN"] is full or (device != "cpu" and not plan.meta["EVEN"])


@per_op("name", ["lambda_returns", "retrace", "gae"])
def test_calls_without_truncations_read_the_terminations_twice(name, device):
    """Lambda-returns' and Retrace's time-major calls without truncation flags pass their
    terminations in the truncation slot too (`ops.Kernel.trunc_slot_always`: the compiler then
    issues their loads up front; cut = terminated | truncated is unchanged): the same results as
    the kernel without the slot (bit for bit in the interpreter, where no look-back order
    varies). Batch-major calls and the other estimators build without the slot."""
    case = make_case(name, 37, (5,), device=device, seed=29, trunc=False)
    ref = case.reference()
    slot = 6 if name == "retrace" else 3  # the truncation slot; the terminations' is slot - 1
    for layout in ("time-major", "batch-major"):
        outs = []
        for on in (1, 0):
            _plans._PLANS.clear()
            with tiles.rule(TRUNCATION_SLOT_ALWAYS=on):
                outs.append(case.call(layout, backend="triton"))
            (plan,) = _plans._PLANS.values()
            twice = bool(on) and layout == "time-major" and name != "gae"
            assert plan.meta["HAS_TRUNC"] is twice, (layout, on)
            assert plan.src[slot] == (slot - 1 if twice else None), (layout, on)
        assert_close(outs[0], ref)
        assert_close(outs[0], outs[1])
        if device == "cpu":
            assert all(torch.equal(a, b) for a, b in zip(*outs))


@per_op("name", ["gae", "vtrace", "retrace", "episodic_cumsum"])
def test_strided_inputs_read_in_place(name, device):
    """Slices of larger buffers and mixed layouts across arguments."""
    case = make_case(name, 40, (6,), device=device, seed=17)
    ref = case.reference()
    for k, v in list(case.steps.items()):
        if v is None:
            continue
        big = torch.zeros((v.shape[0] * 2, v.shape[1] + 3) + v.shape[2:], dtype=v.dtype,
                          device=device)
        big[::2, 1:1 + v.shape[1]] = v
        case.steps[k] = big[::2, 1:1 + v.shape[1]]  # non-contiguous in both axes
        assert not case.steps[k].is_contiguous()
    assert_close(case.call(backend="triton"), ref)
    assert_close(case.call(backend="torch"), ref)


def permuted_memory(x, order):
    """The same logical tensor, stored with its axes in memory order `order` (outermost first)."""
    inverse = [order.index(i) for i in range(len(order))]
    return x.permute(*order).contiguous().permute(*inverse)


@per_op("name", ["gae", "retrace", "eligibility_traces", "linear_scan_forward"])
@pytest.mark.parametrize("batch,order", [((3, 4), (2, 0, 1)), ((2, 3, 2), (3, 1, 0, 2))])
def test_batch_axes_in_any_memory_order(name, batch, order, device):
    """Several batch axes stored in a permuted order; with three axes that no two strides can
    describe the launcher takes its contiguous fallback."""
    case = make_case(name, 23, batch, device=device, seed=19)
    ref = case.reference()
    for k, v in case.steps.items():
        if v is not None:
            extra = tuple(range(len(order), v.ndim))
            case.steps[k] = permuted_memory(v, list(order) + list(extra))
    assert_close(case.call(backend="triton"), ref)
    # the middle-time-axis layout [N1, T, N2] of the caller
    steps = {k: (None if v is None else v.movedim(0, 1).contiguous())
             for k, v in case.steps.items()}
    out = case.fn(**steps, **case.extra, time_dim=1, backend="triton")
    out = out if isinstance(out, tuple) else (out,)
    assert_close(tuple(o.movedim(1, 0) for o in out), ref)


@per_op("name", ESTIMATORS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_not_modified(name, backend, device):
    case = make_case(name, 19, (3,), device=device, seed=23)
    before = {k: (None if v is None else v.clone()) for k, v in case.steps.items()}
    extra_before = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                    for k, v in case.extra.items()}
    case.call("batch-major", backend=backend)
    case.call(backend=backend)
    for k, v in case.steps.items():
        if v is not None:
            assert torch.equal(v, before[k]), k
    for k, v in case.extra.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, extra_before[k]), k


@per_op("name", ESTIMATORS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_inputs(name, backend, device):
    for T, batch in [(0, (3,)), (5, (0,))]:
        case = make_case(name, T, batch, device=device)
        outs = case.call(backend=backend)
        for o in outs:
            assert o.shape[:2] == (T, *batch)[:2] and o.numel() == 0
