"""A digest of the SASS of every kernel variant that tests/compile_sm90.py builds (the scan's
forward, masked, packed, backward and per-row; the losses' forward and backward), compiled for
sm_90 without a GPU: to show that a change leaves the compiled code of the variants it does not
target as it was.

    python tools/sass_digest.py > before.txt; (change); python tools/sass_digest.py > after.txt
    diff before.txt after.txt

One line per kernel: its label, its instruction count and a hash of its SASS instructions (cuobjdump
-sass; line information is not in it). Run without TRITON_INTERPRET."""
import hashlib
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import compile_sm90 as c  # noqa: E402
import registers  # noqa: E402

def sass(kernel) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([registers.CUOBJDUMP, "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout

def instructions(text: str) -> str:
    """The instruction lines of a SASS dump (with their encodings), nothing else."""
    return "\n".join(m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(.*)", text))

def labelled():
    """(label, plans()) of every variant: forward, masked, packed, backward."""
    for label, case, layout in [*c.variants(), *c.mask_variants()]:
        yield label, lambda case=case, layout=layout: c.plans_of(case, layout)
    yield from c.packed_variants()
    for label, case, layout, per_row in c.grad_variants():
        yield label, lambda case=case, layout=layout, per_row=per_row: c.plans_of(
            case, layout, grad=True, per_row=per_row)

def compiled():
    """(label, compiled kernels) of every scan variant, then of every loss variant."""
    for label, plans in labelled():
        yield label, lambda plans=plans: [c.compile_plan(plan, *args) for plan, args in plans()]
    for label, run, int64 in c.loss_variants():
        yield f"loss {label}", lambda run=run, int64=int64: [
            c.compile_kernel(*launch) for launch in c.loss_launches(run, int64)]

def main():
    assert os.environ.get("TRITON_INTERPRET") != "1", "run without TRITON_INTERPRET"
    registers.as_on_the_gpu()
    only = sys.argv[1] if len(sys.argv) > 1 else ""
    for label, kernels in compiled():
        if only not in label:
            continue
        for i, kernel in enumerate(kernels()):
            text = instructions(sass(kernel))
            digest = hashlib.sha1(text.encode()).hexdigest()[:16]
            print(f"{label} [{i}]: {len(text.splitlines())} instructions {digest}", flush=True)

if __name__ == "__main__":
    main()
