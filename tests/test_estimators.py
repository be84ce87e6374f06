"""Every estimator, every backend, against its float64 sequential reference."""
import itertools

import pytest
import torch

from rl_triton._core import plans as _plans
from rl_triton.ops import retrace as retrace_op
from rl_triton.scan import tiles
from cases import (BACKENDS, ESTIMATORS, FLAG_DTYPES, assert_close, make_case, rel_err,
                   to_layout)

SHAPES = [(1, (1,)), (37, (5,)), (333, (50,)), (16, (3, 4))]
LAYOUTS = ["time-major", "batch-major", "transposed-view"]


# The slow sequential loop runs its largest shape in one layout only.
GRID = [(b, shape, layout) for b in BACKENDS for shape in SHAPES for layout in LAYOUTS
        if not (b == "loop" and shape[0] * shape[1][0] > 2000 and layout != "time-major")]


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("backend,shape,layout", GRID)
def test_matches_reference(name, backend, shape, layout, device):
    T, batch = shape
    i = SHAPES.index(shape) + LAYOUTS.index(layout)
    case = make_case(name, T, batch, device=device, flag_dtype=FLAG_DTYPES[i % len(FLAG_DTYPES)],
                     trunc=i % 2 == 0, seed=i)
    assert_close(case.call(layout, backend=backend), case.reference())


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("flag_dtype", FLAG_DTYPES, ids=str)
def test_flag_dtypes(name, flag_dtype, device):
    case = make_case(name, 41, (3,), device=device, flag_dtype=flag_dtype, seed=7)
    ref = case.reference()
    for backend in ("torch", "triton"):
        assert_close(case.call(backend=backend), ref)


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_inputs_float32_math(name, dtype, device):
    """bf16 / f16 inputs, float32 arithmetic: the reference sees the same rounded inputs, so the
    error is float32 rounding, not half-precision rounding."""
    case = make_case(name, 77, (6,), dtype=dtype, device=device, seed=3)
    ref = case.reference()
    for backend in ("torch", "triton"):
        for layout in ("time-major", "batch-major"):
            assert_close(case.call(layout, backend=backend), ref, tol=1e-5)


@pytest.mark.parametrize("name", ["gae", "lambda_returns", "vtrace"])
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


@pytest.mark.parametrize("name", ["gae", "lambda_returns", "vtrace", "discounted_returns"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_same_step_autoreset_next_values(name, backend, device):
    """next_values that differ from values[t+1] at truncations (same-step autoreset)."""
    case = make_case(name, 61, (5,), device=device, seed=5, bootstrap="next_values",
                     p_trunc=0.2)
    assert_close(case.call("batch-major", backend=backend), case.reference())


@pytest.mark.parametrize("name", ["eligibility_traces", "episodic_cumsum"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_trailing_feature_axes(name, backend, layout, device):
    case = make_case(name, 29, (4,), features=(3, 2), device=device, seed=9)
    assert_close(case.call(layout, backend=backend), case.reference())


@pytest.mark.parametrize("backend", BACKENDS)
def test_retrace_many_actions(backend, device):
    case = make_case("retrace", 45, (3,), n_act=37, device=device, seed=2)
    assert_close(case.call("batch-major", backend=backend), case.reference())


@pytest.mark.parametrize("n_act", [2, 8, 18])
@pytest.mark.parametrize("storage", ["contiguous", "offset", "padded", "batch-major"])
def test_retrace_action_vectors(n_act, storage, device):
    """Rows of an even number of actions are loaded several actions at a time
    (`ops.action_vector`: float32 pairs for 18 actions, fours for 8), when the data is 16-byte
    aligned and every stride even; q-values and target probabilities that start 4 bytes into
    their storage, or whose rows are padded to n_act + 1 values, are loaded one action at a
    time. The same results every way (each its own plan)."""
    case = make_case("retrace", 37, (5,), n_act=n_act, device=device, seed=n_act)
    for k in ("q_values", "target_probs"):
        x = case.steps[k]
        if storage == "offset":
            y = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:].view(x.shape)
        elif storage == "padded":
            y = torch.empty(*x.shape[:-1], n_act + 1, dtype=x.dtype, device=x.device)[..., :n_act]
        else:
            continue
        case.steps[k] = y.copy_(x)
    layout = "batch-major" if storage == "batch-major" else "time-major"
    assert_close(case.call(layout), case.reference())


@pytest.mark.parametrize("layout", ["batch-major", "time-major"])
def test_retrace_action_blocks_bound_the_vectors(layout, device):
    """2-byte rows walk their actions in blocks of 2, 4-byte rows in blocks of 8
    (`tiles.action_block`); a vector along actions never spans more than a block, although
    rows of 16 bfloat16 actions could load 8 at a time."""
    case = make_case("retrace", 37, (5,), dtype=torch.bfloat16, device=device, seed=7, n_act=16)
    _plans._PLANS.clear()
    assert_close(case.call(layout, backend="triton"), case.reference(), tol=1e-5)
    (plan,) = _plans._PLANS.values()
    assert (plan.meta["BLOCK_A"], plan.meta["ACT_BLOCKS"], plan.meta["ACT_VEC"]) == (2, 8, 2)


def test_action_vector_rule():
    from rl_triton.scan.launch import action_vector
    f32 = torch.zeros(6, 4, 18)
    assert action_vector([f32, f32[0]], 18) == 2  # per-step rows and the bootstrap row
    assert action_vector([torch.zeros(6, 4, 8)], 8) == 4
    assert action_vector([torch.zeros(6, 4, 16, dtype=torch.bfloat16)], 16) == 8  # 16 bytes
    assert action_vector([torch.zeros(6, 4, 19)[..., :18]], 18) == 1  # rows 19 values apart
    assert action_vector([torch.zeros(6 * 4 * 18 + 1)[1:].view(6, 4, 18)], 18) == 1  # 4 bytes in
    assert action_vector([torch.zeros(6, 18, 4).transpose(1, 2)], 18) == 1  # actions strided
    assert action_vector([torch.zeros(6, 4, 5)], 5) == 1
    assert action_vector([f32, torch.zeros(6, 4, 19)[..., :18]], 18) == 1  # all or none


def test_row_vector_rule():
    from rl_triton.scan.launch import row_vector
    f32 = torch.zeros(6, 300)
    assert row_vector([f32, torch.zeros(6, 300, dtype=torch.bool)], 300, 1) == 4
    assert row_vector([torch.zeros(6, 50)], 50, 1) == 2
    assert row_vector([torch.zeros(6, 64)], 64, 1) == 1  # the compiler knows 64 already
    assert row_vector([torch.zeros(6, 301)[:, :300]], 300, 1) == 1  # time stride 301
    assert row_vector([f32], 300, 4) == 1  # rows in two groups
    assert row_vector([torch.zeros(6, 302)[:, :300]], 300, 1) == 2
    assert row_vector([f32, torch.zeros(6, 302)[:, :300]], 300, 1) == 2  # all tensors


@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
@pytest.mark.parametrize("last_dtype", [None, torch.bfloat16], ids=["same-dtype", "bfloat16"])
def test_retrace_bootstrap_state(layout, last_dtype, device):
    """E[T-1] comes from the bootstrap state. Where every tile spans its rows' whole window
    (`retrace_op.coef_whole`), the action blocks read the bootstrap's rows at
    t = T-1 when they share Q's and pi's dtypes, else a pass of its own does (bfloat16 bootstrap
    tensors); where rows span several tiles, the tile holding T-1 does: all against the
    reference, in one-row tiles (batch-major 128 x 1) and tiles of several rows."""
    for T, n, block_t, block_b in ((37, 5, 64, 4), (37, 5, 64, 1), (37, 5, 16, 2),
                                   (100, 3, 128, 1)):
        case = make_case("retrace", T, (n,), device=device, seed=T + block_b, n_act=18)
        if last_dtype is not None:
            case.extra.update({k: case.extra[k].to(last_dtype)
                               for k in ("last_q_values", "last_target_probs")})
        _plans._PLANS.clear()
        with tiles.override(block_t=block_t, block_b=block_b):
            assert_close(case.call(layout, backend="triton"), case.reference())
            (plan,) = _plans._PLANS.values()
        whole = block_t >= T
        assert (plan.meta["COEF"] is retrace_op.coef_whole) is whole


@pytest.mark.parametrize("name", ESTIMATORS)
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


@pytest.mark.parametrize("name", ESTIMATORS)
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


@pytest.mark.parametrize("name", ESTIMATORS)
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
                # a GPU keeps the masks where dropping them costs warps (test_gpu.py)
                assert plan.meta["EVEN"] is full or (device != "cpu" and not plan.meta["EVEN"])


@pytest.mark.parametrize("name", ["lambda_returns", "retrace", "gae"])
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


def test_look_back_tags_name_the_launch(device):
    """Every launch tags every tile's words with one new tag base (the last one + 2, from 0 in
    fresh scratch), which each tile reads from the word it wrote itself the launch before;
    a tile that derived another base would wait forever for its predecessors' words."""
    case = make_case("gae", 5 * 16 + 7, (3,), device=device, seed=5)
    ref = case.reference()
    _plans._PLANS.clear()
    with tiles.override(block_t=16, block_b=2, walk=False):
        for launch in range(3):
            assert_close(case.call("time-major", backend="triton"), ref)
            (plan,) = _plans._PLANS.values()
            ((state, _),) = plan.states.values()
            tags = (state.cpu() >> 32)[: state.numel() // 2]  # the words_a of every tile row
            assert set(tags.tolist()) == {2 * launch + 1, 2 * launch + 2}, (launch, tags)


@pytest.mark.parametrize("name", ["gae", "vtrace", "retrace", "episodic_cumsum"])
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


@pytest.mark.parametrize("name", ["gae", "retrace", "eligibility_traces", "linear_scan_forward"])
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


@pytest.mark.parametrize("name", ESTIMATORS)
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


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_inputs(name, backend, device):
    for T, batch in [(0, (3,)), (5, (0,))]:
        case = make_case(name, T, batch, device=device)
        outs = case.call(backend=backend)
        for o in outs:
            assert o.shape[:2] == (T, *batch)[:2] and o.numel() == 0


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_out_dtype(out_dtype, backend, device):
    case = make_case("gae", 21, (4,), device=device)
    outs = case.call(backend=backend, out_dtype=out_dtype)
    assert all(o.dtype == out_dtype for o in outs)
    tol = 1e-2 if out_dtype == torch.bfloat16 else 1e-5
    assert_close(outs, case.reference(), tol=tol)


def test_outputs_in_caller_layout(device):
    case = make_case("gae", 12, (7,), device=device)
    adv, ret = case.fn(**{k: to_layout(v, "transposed-view") for k, v in case.steps.items()},
                       **case.extra, time_dim=-1, backend="triton")
    assert adv.shape == (7, 12) and adv.is_contiguous() and ret.is_contiguous()


def test_backends_agree_with_each_other(device):
    for name in ESTIMATORS:
        case = make_case(name, 90, (7,), device=device, seed=31)
        outs = {b: case.call(backend=b) for b in BACKENDS}
        for a, b in itertools.combinations(BACKENDS, 2):
            for x, y in zip(outs[a], outs[b]):
                assert rel_err(x, y) < 2e-6, (name, a, b)
