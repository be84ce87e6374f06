"""The scan engine the scan ops share, through them: look-back tags and ends, row vectors, the
backends agreeing with each other, offsets unread when asked, and on a CUDA device (marked
gpu_large) streams, cold launches and launch hooks. Each op's own tests: tests/ops/test_<op>.py."""
import itertools
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rl_triton
from rl_triton._core import plans as _plans
from rl_triton.scan import tiles
from cases import BACKENDS, ESTIMATORS, FLAGGED, assert_close, make_case, rel_err, subprocess_env
from conftest import DEVICE
from op_checks.bounds import bounds_checked
from op_checks.large import float64_vectorized
from op_checks.large_masks import packed_against_float64, random_lengths
from op_checks.masks import packed_call

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

DEV = "cuda"  # the gpu_large tests' device


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


def test_backends_agree_with_each_other(device):
    for name in ESTIMATORS:
        case = make_case(name, 90, (7,), device=device, seed=31)
        outs = {b: case.call(backend=b) for b in BACKENDS}
        for a, b in itertools.combinations(BACKENDS, 2):
            for x, y in zip(outs[a], outs[b]):
                assert rel_err(x, y) < 2e-6, (name, a, b)


@pytest.mark.parametrize("backend", ["loop", "torch", "triton"])
def test_check_offsets_false_reads_nothing(backend, monkeypatch):
    """check_offsets=True reads the offsets' values on every call, check_offsets=False asks for
    no read (their type and shape still checked), which skips it on a GPU: offsets on the CPU
    are read all the same (it costs nothing). It must be a bool. Whatever unread offsets hold,
    the call stays inside its tensors and returns outputs of the packed shape."""
    reads = []
    real = rl_triton._args.check_offsets

    def spy(*args, data=True, **kwargs):
        reads.append(data)
        return real(*args, data=data, **kwargs)

    monkeypatch.setattr(rl_triton._core.scan, "check_offsets", spy)
    cu = torch.tensor([0, 3, 7])
    want = packed_call("gae", [3, 4], True, cu, backend)
    for _ in range(2):
        packed_call("gae", [3, 4], True, cu, backend)
    got = packed_call("gae", [3, 4], True, cu, backend, check_offsets=False)
    assert reads == [True, True, True, False]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    bads = ([0, 9, 7], [0, 5, 2, 7], [3, 1, 2], [0, -4, 7], [0, 2, 3], [0, 99, 200],
            [0, 10**12, 7])
    for bad in bads:
        with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
            packed_call("gae", [3, 4], True, torch.tensor(bad), backend, check_offsets=False)
    def unread(cu, L, device, data=True, dtypes=(torch.int64,)):  # a GPU's, unchecked
        return cu.to(device, cu.dtype if cu.dtype in dtypes else torch.int64)

    with pytest.MonkeyPatch.context() as mp, bounds_checked():
        mp.setattr(rl_triton._core.scan, "check_offsets", unread)
        for bad in bads:
            for name in FLAGGED:
                outs = packed_call(name, [3, 4], True, torch.tensor(bad), backend,
                                   check_offsets=False)
                for o in outs if isinstance(outs, tuple) else (outs,):
                    assert o.shape[0] == 7
    for flag in ("yes", 1, None):
        with pytest.raises(TypeError, match="check_offsets must be a bool"):
            packed_call("gae", [3, 4], True, cu, backend, check_offsets=flag)
        with pytest.raises(TypeError, match="check_offsets must be a bool"):
            z = torch.zeros(3, device=DEVICE if backend == "triton" else "cpu")
            rl_triton.gae(z, z, z, last_value=z[0], backend=backend, check_offsets=flag)
    with pytest.raises(ValueError, match="no segment"):
        packed_call("gae", [3, 4], True, torch.tensor([0]), backend, check_offsets=False)


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's check (a GPU faults instead)")
def test_bounds_checked_sees_reads_and_writes_past_a_tensor():
    """`bounds_checked`, which the offsets tests lean on, refuses a load and a store outside the
    launch's tensors (in Triton's interpreter, which reads and writes them silently)."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy(x, y, n, m):
        i = tl.arange(0, 8)
        tl.store(y + i, tl.load(x + i, mask=i < n, other=0.0), mask=i < m)

    x, y = torch.ones(4), torch.zeros(8)
    with bounds_checked():
        copy[(1,)](x, y, 4, 8)
        with pytest.raises(Exception, match="copy: create_masked_load of 1 element"):
            copy[(1,)](x, y, 5, 8)
        with pytest.raises(Exception, match="copy: create_masked_store of 2 element"):
            copy[(1,)](x, torch.zeros(4), 4, 6)
    copy[(1,)](x, y, 4, 8)  # outside, nothing is watched
    assert y.tolist() == [1.0] * 4 + [0.0] * 4


LOOK_BACK = r'''
import os, struct, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch, triton, triton.language as tl
from rl_triton.scan import kernel as scan

@triton.jit
def probe(words, out, order, tag, n_chunks, WINDOW: tl.constexpr, DEPTH: tl.constexpr):
    r = tl.arange(0, 2)[:, None]
    carry_in = tl.zeros(r.shape, tl.float32)
    acc = scan.look_back(words, words + n_chunks * 2, 0, order, 1, r, r < 2, tag, carry_in, 1,
                         WINDOW, DEPTH, 2)
    tl.store(out + r, acc)

def word(value, tag):
    return struct.unpack("<I", struct.pack("<f", value))[0] | (tag << 32)

tag = 4
# tiles 0..2 in scan order, as tile 3 finds them: tile 0 published its outgoing value (a constant
# map), tiles 1 and 2 their maps a + b * A; one row per column
cases = {"nan map": [(5.0, None), (float("nan"), float("nan")), (2.0, 3.0)],
         "cut": [(float("nan"), None), (2.0, 0.0), (1.0, 2.0)],
         "inf before a cut": [(float("inf"), None), (7.0, 0.0), (0.5, 0.5)]}
for window, depth in ((1, 1), (4, 4), (4, 1)):
    for label, tiles in cases.items():
        a = [word(v, tag + (2 if b is None else 1)) for v, b in tiles for _ in range(2)]
        b = [word(0.0 if bb is None else bb, tag + 1) for _, bb in tiles for _ in range(2)]
        words = torch.tensor(a + [0, 0] + b + [0, 0], dtype=torch.int64)
        out = torch.zeros(2)
        probe[(1,)](words, out, 3, tag, 4, window, depth)
        print(window, depth, label, out.tolist(), flush=True)
'''


def test_look_back_ends_and_selects():
    """The look-back composes the maps its predecessors published until the composition no longer
    depends on anything earlier. A map holding NaN (a NaN ratio in the tile) never becomes
    constant by multiplication (NaN * 0 is NaN): the look-back still ends at the initial carry,
    at the latest (it used to loop forever on a GPU, where it can find such a map). A map with
    b = 0 (a cut) selects its own value, whatever the tiles before it hold (inf or NaN). Run in
    a subprocess, so that a look-back that never ends fails the test instead of hanging it."""
    done = subprocess.run([sys.executable, "-c", LOOK_BACK], capture_output=True, text=True,
                          timeout=900, cwd=Path(__file__).parents[2], env=subprocess_env())
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.strip().split("\n")
    assert len(lines) == 9, lines
    for line in lines:
        window, depth, rest = line.split(" ", 2)
        label, values = rest.rsplit(" [", 1)
        values = [float(v) for v in values.rstrip("]").split(",")]
        # tile 2's map over tile 1's over tile 0's value
        want = {"nan map": math.nan, "cut": 1.0 + 2.0 * 2.0, "inf before a cut": 0.5 + 0.5 * 7.0}
        for v in values:
            assert (math.isnan(v) and math.isnan(want[label])) or v == want[label], line


@pytest.mark.gpu_large
def test_one_signature_on_two_streams():
    """Look-back scratch is kept per stream: concurrent launches of one plan do not mix."""
    case = make_case("gae", 8192, (4,), device=DEV, seed=9)
    ref = case.reference()
    streams = [torch.cuda.Stream() for _ in range(2)]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = []
    for _ in range(4):
        for s in streams:
            with torch.cuda.stream(s):
                outs.append(case.call(backend="triton"))
    torch.cuda.synchronize()
    for out in outs:
        assert_close(out, ref)


@pytest.mark.parametrize("T,n,layout,rows", [
    (2**20, 4, "time-major", (1, 4)), (2**17, 32, "time-major", (2, 8, 32)),
    (2**17, 16, "batch-major", (1,)), (2**20, 4, "batch-major", (1,))])
@pytest.mark.gpu_large
def test_look_back_on_cold_launches(T, n, layout, rows):
    """Fresh plans, first launches: with look-back windows that replicated words across threads,
    replicas read at different moments gave relative errors of 1e-3 to 2e-2 on exactly these
    launches (docs/dev/kernel-decisions.md#the-window-no-word-held-by-two-threads). Every
    launch is checked, for tiles of one to 32 rows (the rule's window for each: one warp's worth
    for several rows, one word per thread for one)."""
    from rl_triton._core import plans as _plans
    from rl_triton.scan import tiles

    case = make_case("gae", T, (n,), device=DEV, seed=11, p_term=0.01, p_trunc=0.01)
    ref = float64_vectorized(case)
    for block_b in rows:
        for _ in range(3):
            _plans._PLANS.clear()
            with tiles.override(block_b=block_b, block_t=2048 // block_b, walk=False):
                for _ in range(3):
                    assert_close(case.call(layout, backend="triton"), ref)


@pytest.mark.gpu_large
def test_launch_hooks_see_every_launch():
    """Profilers install Triton launch hooks; plans launch the compiled kernel directly and must
    call them as Triton's own launch path does."""
    from triton import knobs

    from rl_triton._core import plans as _plans

    seen = []

    def hook(metadata):
        seen.append(metadata)

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # a chain of hooks (newer Triton)
        chain.add(hook)
    else:
        knobs.runtime.launch_enter_hook = hook
    try:
        _plans._PLANS.clear()
        case = make_case("gae", 4096, (4,), device=DEV)
        for _ in range(3):
            case.call(backend="triton")
    finally:
        if hasattr(chain, "add"):
            chain.remove(hook)
        else:
            knobs.runtime.launch_enter_hook = chain
    assert len(seen) == 3
    case.call(backend="triton")
    assert len(seen) == 3  # removed: not called


@pytest.mark.gpu_large
def test_packed_in_place_bf16_features_and_walk():
    """bf16 GAE with next_values; eligibility traces of 16-vectors (time-major tiles); episodic
    sums walked (tiles forced to walk one row)."""
    lengths = random_lengths(64, 2**20, seed=4, empty_every=9)
    assert all(e < 1e-5 for e in packed_against_float64(
        "gae", lengths, True, dtype=torch.bfloat16, bootstrap="next_values"))
    assert all(e < 1e-5 for e in packed_against_float64("eligibility_traces", lengths[:16],
                                                        True, features=(16,)))
    with tiles.override(walk=True):
        assert all(e < 1e-5 for e in packed_against_float64("episodic_cumsum", lengths, True))


@pytest.mark.parametrize("compiling", [False, True])
def test_launch_caches_only_a_compiled_kernel(monkeypatch, compiling):
    """`launch` keeps (and later replays) a launch's result only where it is a compiled kernel:
    a launch traced by torch.compile (dynamo) returns None, which replayed was
    `'NoneType' object has no attribute 'run'` (Retrace's action check on CUDA under the
    trainer's `compile` backend, then every later launch of that specialization). While
    compiling, the launch is Triton's own, uncached. The CUDA path with a stand-in kernel."""
    from rl_triton.scan import launch as L

    calls = []

    class Kernel:  # `fn[(grid,)](*args, **meta)`: what torch.compile's trace returns
        arg_names = ["x", "n", "BLOCK"]

        def __getitem__(self, grid):
            return lambda *args, **meta: calls.append(grid)

    monkeypatch.setattr(L, "HAS_TRITON", True)
    monkeypatch.setattr(L, "_current_device", lambda: 0)
    monkeypatch.setattr(L, "_COMPILED", {})
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    x = torch.zeros(4)
    for _ in range(2):
        L.launch(Kernel(), 1, (x, 4), torch.device("cuda", 0), BLOCK=4)
    assert calls == [(1,), (1,)] and not L._COMPILED
