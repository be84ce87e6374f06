"""Every kernel variant compiles for the GPU (sm_90) with the installed Triton, also on a machine
without one: the interpreter that runs the other tests on the CPU never runs the compiler. CI
(.ci/run) also installs the oldest supported Triton into .ci/triton-oldest, a virtual
environment over this one, and the build runs with that too."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
OLDEST = HERE.parent / ".ci" / "triton-oldest" / "bin" / "python"


@pytest.mark.parametrize("python", ["installed", "oldest"])
def test_every_variant_compiles_for_sm90(python):
    if python == "oldest" and not OLDEST.exists():
        pytest.skip("no .ci/triton-oldest here (made by .ci/run)")
    exe = sys.executable if python == "installed" else str(OLDEST)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    done = subprocess.run([exe, str(HERE / "compile_sm90.py")], env=env,
                          capture_output=True, text=True, timeout=900)
    report = done.stdout + done.stderr[-3000:]
    assert done.returncode == 0, report
    assert done.stdout.count("ok ") >= 68, report
