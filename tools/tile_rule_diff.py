"""Compare the tile rule of the working tree with the rule at another commit: every field of
every `config.choose` result, and the helpers around it, over the benchmark grid (every
estimator's kernel flags, both layouts, 2- 4- and 8-byte inputs) and a random sweep of shapes.
A rewrite of the tile rule (rl_triton/scan/tiles.py; rl_triton/_triton/config.py before) must change no decision that measurements back.

    python tools/tile_rule_diff.py [--rev 551440a] [--shapes 100000] [--seed 0] [--rules]

Devices: a CUDA device (a `torch.device` object only, nothing runs) of 132 multiprocessors (the
H200), and of 108 and 16 in the sweep, and the CPU (the interpreter's windows). `--rules` also
compares both rules with each constant they share halved and doubled, on the grid. Prints the
counts and the first differences; exits 1 if any."""
import argparse
import dataclasses
import importlib.util
import itertools
import os
import random
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PATH = "rl_triton/scan/tiles.py"
OLD_PATH = "rl_triton/_triton/config.py"  # where the rule lived at 551440a

GRID = [(16384, 16), (4096, 128), (16384, 1024), (128, 128), (1024, 1024), (512, 4096),
        (64, 32768), (16, 131072), (4, 1048576)]
# shapes named by the measurements behind the rule (docs/dev/tile-rule.md)
EXTRA = [(2, 2097152), (8, 524288), (1, 4194304), (8, 65536), (300, 4096), (768, 1024),
         (640, 4096), (8192, 256), (2048, 512), (896, 1024), (4096, 256), (1024, 2048),
         (1024, 512), (16384, 512), (128, 16384), (200, 16384), (256, 8192), (12, 262144),
         (8, 4096), (4, 8192), (64, 16), (16, 1024), (32, 131072), (3, 4096), (2, 1025),
         (1, 1), (7, 100), (5, 1048576), (16, 2**17), (4096, 65536), (2, 2**21), (3, 2**21)]
# (reverse, exclusive, aux, n_act) of every kernel (`scan.launch.Kernel`): GAE, lambda-returns and
# discounted returns and the reverse linear scan, V-trace, Retrace, the forward scans
KERNELS = [(True, False, True, 0), (True, False, False, 0), (True, True, True, 0),
           (False, False, False, 0)] + [(True, False, False, a) for a in (1, 2, 5, 18, 64, 1000)]
# every combination of the flags, for the sweep
FLAGS = [(r, e, a, n) for r, e, a in itertools.product((False, True), repeat=3)
         for n in (0, 1, 2, 3, 5, 8, 18, 64, 1000)]
ITEMSIZES = (4, 2, 8)


def load(source, name):
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, f.name)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    os.unlink(f.name)
    return mod


def rules(rev):
    old = subprocess.run(["git", "show", f"{rev}:{PATH}"], cwd=ROOT, capture_output=True,
                         text=True)
    if old.returncode:
        old = subprocess.run(["git", "show", f"{rev}:{OLD_PATH}"], cwd=ROOT,
                             capture_output=True, text=True, check=True)
    old = old.stdout
    with open(os.path.join(ROOT, PATH)) as f:
        new = f.read()
    return load(old, "tile_rule_old"), load(new, "tile_rule_new")


def on(mods, sms):
    for m in mods:
        m._multiprocessors = lambda device, sms=sms: sms if device.type == "cuda" else 1


def fields(cfg):
    return dataclasses.astuple(cfg)


def call(mod, T, B, tc, flags, itemsize, device):
    reverse, exclusive, aux, n_act = flags
    return fields(mod.choose(T, B, time_contiguous=tc, device=device, n_act=n_act,
                             exclusive=exclusive, reverse=reverse, aux=aux, itemsize=itemsize))


def helpers(old, new, cfg, T, B, tc, flags, device):
    """The helpers `ops` calls beside `choose`, on its result."""
    n_act, exclusive = flags[3], flags[1]
    out = []
    for m in (old, new):
        c = m.TileConfig(*cfg)
        out.append((m.even(T, B, c), m.vector_rows(B, tc, n_act > 0), m.sub_tiles(c, exclusive),
                    m.action_block(n_act or 1, 2), m.action_block(n_act or 1, 4),
                    m.window(16, c.block_b, c.num_warps, device),
                    m.depth(c.window, c.block_b, device), c.chunks(T)))
    return out


class Diff:
    def __init__(self):
        self.compared, self.differences = 0, []

    def check(self, old, new, T, B, tc, flags, itemsize, device, label=""):
        a = call(old, T, B, tc, flags, itemsize, device)
        b = call(new, T, B, tc, flags, itemsize, device)
        self.compared += 1
        if a != b:
            self.differences.append((label, T, B, tc, flags, itemsize, str(device), a, b))
            return
        ha, hb = helpers(old, new, a, T, B, tc, flags, device)
        if ha != hb:
            self.differences.append((label + " helpers", T, B, tc, flags, itemsize,
                                     str(device), ha, hb))


def log_uniform(rng, hi):
    n = int(2 ** rng.uniform(0, hi))
    return max(1, n + rng.choice((0, 0, -1, 1)) if rng.random() < 0.3 else n)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rev", default="551440a")
    p.add_argument("--shapes", type=int, default=100000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rules", action="store_true")
    args = p.parse_args()
    old, new = rules(args.rev)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    diff = Diff()
    if old.constants() != new.constants():
        diff.differences.append(("constants", old.constants(), new.constants()))

    on((old, new), 132)
    for (N, T), tc, flags, itemsize, device in itertools.product(
            GRID + EXTRA, (True, False), FLAGS, ITEMSIZES, (cuda, cpu)):
        diff.check(old, new, T, N, tc, flags, itemsize, device, "grid")
    grid = diff.compared
    print(f"grid and named shapes: {grid} configs, {len(diff.differences)} differences")

    rng = random.Random(args.seed)
    for i in range(args.shapes):
        sms = (132, 132, 108, 16)[i % 4]
        on((old, new), sms)
        T, B = log_uniform(rng, 24), log_uniform(rng, 20)
        for _ in range(4):
            flags = rng.choice(KERNELS if rng.random() < 0.7 else FLAGS)
            diff.check(old, new, T, B, rng.random() < 0.5, flags, rng.choice(ITEMSIZES),
                       cuda if rng.random() < 0.8 else cpu, f"sweep sms={sms}")
    print(f"random sweep: {args.shapes} shapes, {diff.compared - grid} configs, "
          f"{len(diff.differences)} differences so far")

    if args.rules:
        on((old, new), 132)
        shared = sorted(set(old.constants()) & set(new.constants()))
        before = diff.compared
        for name in shared:
            value = old.constants()[name]
            for v in {value * 2, value // 2} - {value}:
                with old.rule(**{name: v}), new.rule(**{name: v}):
                    for (N, T), tc, flags, itemsize in itertools.product(
                            GRID + EXTRA, (True, False), KERNELS, (4, 2)):
                        diff.check(old, new, T, N, tc, flags, itemsize, cuda, f"{name}={v}")
        only = sorted(set(old.constants()) ^ set(new.constants()))
        print(f"rule variants: {len(shared)} shared constants halved and doubled, "
              f"{diff.compared - before} configs; constants in one rule only: {only}")

    print(f"compared {diff.compared} configs: {len(diff.differences)} differences")
    for d in diff.differences[:20]:
        print(*d)
    sys.exit(1 if diff.differences else 0)


if __name__ == "__main__":
    main()
