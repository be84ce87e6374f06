"""Every kernel variant compiles for the GPU (sm_90) with the installed Triton, also on a machine
without one: the interpreter that runs the other tests on the CPU never runs the compiler. CI
(.ci/run) also installs the oldest supported Triton into the folder .ci/triton-oldest (`pip
install --target`), and the build runs with that too: this interpreter with that folder first on
its path, so that it works from a virtual environment as from a system Python."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cases import subprocess_env

HERE = Path(__file__).parent
OLDEST = HERE.parent / ".ci" / "triton-oldest"
OLDEST_VERSION = "3.6.0"


def compiler_env(*first):
    """The environment of a compiling subprocess: without the interpreter, with this checkout
    (and `first` before it) importable."""
    env = subprocess_env()
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, first), env["PYTHONPATH"]])
    return env


# the scan family's variants in parallel test workers (minutes in one): more on a GPU machine's
# many cores, fewer where each shard's start-up counts (2 cores)
SCAN_SHARDS = 12 if torch.cuda.is_available() else 6
PARTS = [(f"scan {k}/{SCAN_SHARDS}", 69) for k in range(SCAN_SHARDS)] + [("whiten", 8),
                                                                         ("losses", 43)]


@pytest.mark.parametrize("part,least", PARTS)
@pytest.mark.parametrize("python", ["installed", "oldest"])
def test_every_variant_compiles_for_sm90(python, part, least):
    """`least`: the variants the family has at least (a shard of it compiles its share)."""
    if python == "oldest" and not (OLDEST / "triton").exists():
        import triton
        if triton.__version__ == OLDEST_VERSION:
            pytest.skip(f"the installed Triton is the oldest supported ({OLDEST_VERSION}): "
                        "the 'installed' case builds with it")
        pytest.skip("no .ci/triton-oldest here (made by .ci/run)")
    env = compiler_env(*([OLDEST] if python == "oldest" else []))
    if python == "oldest":  # that folder's Triton, not the installed one
        version = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__)"],
                                 env=env, capture_output=True, text=True).stdout.strip()
        assert version == OLDEST_VERSION, version
    # no time limit: a loaded machine may take many minutes, and slowness is not a failure
    done = subprocess.run([sys.executable, str(HERE / "compile_sm90.py"), *part.split()],
                          env=env, capture_output=True, text=True)
    report = done.stdout + done.stderr[-3000:]
    assert done.returncode == 0, report
    counts = re.search(r"variants: (\d+) of (\d+)", done.stdout)
    mine, total = (int(counts[1]), int(counts[2])) if counts else (least, least)
    assert total >= least and done.stdout.count("ok ") == mine, report


def test_registers_tool_reads_the_h200_plan():
    """tools/registers.py (registers, spills and occupancy without a GPU) builds the plan the
    H200 would run, not the interpreter's: GAE's float32 time-major tiles at 128x128 span the
    rows' 128 steps in 2 rows on one warp (`config.choose` with 132 multiprocessors; with the
    interpreter's one, 16 rows on 4 warps), the register counts are ones a kernel can have, and
    a register cap far below the compiler's count shows as spilled values (stack bytes)."""
    done = subprocess.run([sys.executable, str(HERE.parent / "tools" / "registers.py"),
                           "gae:128x128:tm", "gae:16384x1024:tm:block_t=64,num_warps=4",
                           "gae:16384x1024:tm:block_t=64,num_warps=4,max_registers=32"],
                          env=compiler_env(), capture_output=True, text=True, timeout=None)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.strip().split("\n")
    assert "tile 128x2, 1 warp," in lines[0], lines
    assert "tile 64x32, 4 warps" in lines[1] and "tile 64x32, 4 warps" in lines[2], lines
    registers = [int(x) for x in re.findall(r"; (\d+) registers", done.stdout)]
    stack = [int(x) for x in re.findall(r"registers, (\d+) B stack", done.stdout)]
    assert len(registers) == len(stack) == 3, lines
    assert all(16 <= r <= 255 for r in registers), lines
    assert registers[0] < registers[1], lines  # the smaller tile holds fewer values per thread
    assert registers[2] <= 32 < registers[1] and stack[2] > stack[1], lines  # capped: spills
    rounds = [[int(x) for x in r.split(" + ")] for r in re.findall(r"rounds \(([\d +]+)\)",
                                                                    done.stdout)]
    assert len(rounds) == 3 and all(sum(r) >= 4 for r in rounds), lines  # its global loads


def test_load_rounds_follow_the_first_consumers():
    """tools/registers.py's load rounds: a load belongs to the round in which an in-order warp
    issues it; an instruction that reads a register a load of the current round writes opens
    the next round (one of an earlier round is back by then). The look-back's `.STRONG` loads
    are not counted, predicated loads are, and a store's operands are all sources."""
    sass = """
        /*0000*/                   LDG.E R2, desc[UR4][R4.64] ;            /* 0x0 */
        /*0010*/                   LDG.E.64 R6, desc[UR4][R8.64] ;         /* 0x0 */
        /*0020*/                   FADD R10, R2, R3 ;                      /* 0x0 */
        /*0030*/              @!P0 LDG.E R12, desc[UR4][R14.64] ;          /* 0x0 */
        /*0040*/                   FADD R11, R7, R12 ;                     /* 0x0 */
        /*0050*/                   LDG.E.STRONG.SYS R16, desc[UR4][R20.64] ;  /* 0x0 */
        /*0060*/                   STG.E desc[UR4][R18.64], R16 ;          /* 0x0 */
        /*0070*/                   LDG.E.128 R20, desc[UR4][R22.64] ;      /* 0x0 */
        /*0080*/                   STG.E desc[UR4][R24.64], R23 ;          /* 0x0 */
    """
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import registers; "
            "print(registers.load_rounds(sys.stdin.read()))")
    done = subprocess.run([sys.executable, "-c", code, str(HERE.parent / "tools")], input=sass,
                          env=compiler_env(), capture_output=True, text=True, timeout=None)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[2, 1, 1]", done.stdout
