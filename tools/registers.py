"""Registers per thread, stack bytes per thread (spilled values), theoretical occupancy and load
rounds of the kernels the H200 would run, on a machine without a GPU: the plan is built as on an
H200 (132 multiprocessors), compiled for sm_90 with the installed Triton, and its cubin read
with the cuobjdump that Triton ships.

    python tools/registers.py gae:16384x1024:tm vtrace:1024x1024:bm:bf16 \\
        gae:16384x1024:tm:block_t=64,num_warps=4 lambda_returns:4096x128:tm:notrunc

An argument is estimator:NxT:tm|bm, then optionally :bf16, :notrunc (no truncation flags),
:adv (Retrace's advantages too; the benchmark times its targets only), :bwd (the backward
kernel, every floating input requiring grad, output gradients laid out as the outputs, as the
benchmark's), :mask (a mask of ~70% decision steps, semantics §7), :packed (the N rows of T steps
packed into one [N*T] stream with cu_seqlens, semantics §7; the layout is then that stream's), :next
(next_values instead of last_value) and :field=value,...
(tile fields forced as with `python -m rl_triton.bench --tiles`). Registers match ncu's on the
H200 when the installed Triton is the GPU machine's
(docs/dev/kernel-decisions.md#registers-and-load-rounds-offline;
`PYTHONPATH=.ci/triton-oldest python tools/registers.py ...` runs Triton 3.6, the GPU machine's).
Load rounds: the global loads of the SASS in the order an in-order warp issues them, a new round
opening at each instruction that consumes a load not yet back; loads issued in several rounds
wait on memory one round after another (the same page). Run
without TRITON_INTERPRET."""
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import triton  # noqa: E402

import compile_sm90  # noqa: E402
from cases import make_case  # noqa: E402
from rl_triton.scan import launch, tiles  # noqa: E402

MULTIPROCESSORS = 132  # H200
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "cuobjdump")


def as_on_the_gpu():
    """Make `tiles` choose as on an H200: its multiprocessor count and the look-back windows of
    a GPU (the interpreter's differ)."""
    window, depth, cuda = tiles.window, tiles.depth, torch.device("cuda")
    tiles._multiprocessors = lambda device: MULTIPROCESSORS
    tiles.window = lambda least, block_b, warps, device: window(least, block_b, warps, cuda)
    tiles.depth = lambda win, block_b, device: depth(win, block_b, cuda)


def compiled(plan, tensors, scalars, meta, rows=None, cu=None):
    """The plan's kernel for sm_90 with `meta` (now the plan's), with its registers per thread
    as `n_regs` (as a kernel loaded on a GPU has them) and its stack bytes per thread as
    `stack` (values spilled from registers: a register cap too low spills)."""
    plan.meta = meta
    kernel = compile_sm90.compile_plan(plan, tensors, scalars, rows, cu)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        dump = subprocess.run([CUOBJDUMP, "--dump-resource-usage", "-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    kernel.n_regs = int(re.search(r"REG:(\d+)", dump).group(1))
    kernel.stack = int(re.search(r"STACK:(\d+)", dump).group(1))
    kernel.rounds = load_rounds(dump)
    return kernel


def load_rounds(sass: str) -> list:
    """Global loads (not the look-back's, `.STRONG`) per round of issue: an in-order warp issues
    every instruction until one reads a register that a load still in flight writes, then waits
    for that load; the loads issued after the wait form the next round."""
    pending, now, rounds = {}, 0, []
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(.*?);", line)
        if not m:
            continue
        parts = m.group(1).split()
        if parts[0].startswith("@"):  # predicate
            parts = parts[1:]
        op, operands = parts[0], " ".join(parts[1:])
        # sources: all operands but a non-store's first (its destination)
        sources = operands if op.startswith("ST") else operands.partition(",")[2]
        for reg in re.findall(r"\bR(\d+)\b", sources):
            if pending.get(int(reg), -1) >= now:
                now = pending[int(reg)] + 1
        if op.startswith("LDG") and "STRONG" not in op:
            first = int(re.match(r"R(\d+)", operands).group(1))
            width = 4 if ".128" in op else 2 if ".64" in op else 1
            for r in range(first, first + width):
                pending[r] = now
            rounds.append(now)
    return [rounds.count(r) for r in range(max(rounds) + 1)] if rounds else []


def report(spec: str) -> str:
    name, shape, layout, *rest = spec.split(":")
    forced = {}
    for part in rest:
        if "=" in part:
            forced.update({k: int(v) for k, v in (kv.split("=") for kv in part.split(","))})
    n, t = map(int, shape.split("x"))
    boot = {"bootstrap": "next_values"} if "next" in rest else {}
    case = make_case(name, t, (n,), n_act=18, trunc="notrunc" not in rest,
                     dtype=torch.bfloat16 if "bf16" in rest else torch.float32, **boot)
    if name == "retrace":  # targets only, as `python -m rl_triton.bench` times it
        case.extra["return_advantages"] = "adv" in rest
    with tiles.override(**forced):
        if "packed" in rest:
            plans = compile_sm90.packed_plans(
                name, [t] * n, "mask" in rest, trunc="notrunc" not in rest,
                dtype=torch.bfloat16 if "bf16" in rest else torch.float32, **boot)
        else:
            if "mask" in rest:
                case.steps["mask"] = torch.rand(t, n) < 0.7
            plans = compile_sm90.plans_of(case, "time-major" if layout == "tm" else "batch-major",
                                          grad="bwd" in rest)
    plan, (tensors, scalars, rows, cu) = plans[-1]  # :bwd: the backward's (after the forward's)
    built = {}  # kernels by EVEN: the choice below compiles both

    def build(meta):
        built[meta["EVEN"]] = compiled(plan, tensors, scalars, meta, rows, cu)
        return built[meta["EVEN"]]

    m = dict(plan.meta)
    if m["EVEN"]:  # as the plan's first launch on the GPU chooses (ops)
        m["EVEN"] = launch.even_keeps_occupancy(None, None, m, compile=build)
    kernel = built.get(m["EVEN"]) or build(m)
    registers, shared = kernel.n_regs, kernel.metadata.shared
    programs, fraction = tiles.occupancy(registers, m["num_warps"], shared)
    warps = f"{m['num_warps']} warp" + ("s" if m["num_warps"] > 1 else "")
    masks = "no masks" if m["EVEN"] else "masks"
    return (f"{spec}: tile {m['BLOCK_T']}x{m['BLOCK_B']}, {warps}, "
            f"{m['SUB']} sub-tiles, {masks}; {registers} registers, {kernel.stack} B stack, "
            f"{shared} B shared; "
            f"{programs} programs per multiprocessor, occupancy {fraction:.0%}; loads in "
            f"{len(kernel.rounds)} rounds ({' + '.join(map(str, kernel.rounds))})")


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") != "1", "run without TRITON_INTERPRET"
    as_on_the_gpu()
    for arg in sys.argv[1:]:
        print(report(arg), flush=True)
