"""Amdahl's law, read off the trainers' TensorBoard runs.

    python examples/compare_backends.py runs/ [--out FILE.png] [--baseline loop] [--skip 0.2]

The plot goes to `--out`, by default `compare_backends.png` inside the first folder given.

Every run directory under the given folders is named `{env_id}__{exp_name}__{credit_backend}__
{seed}__{time}` (trainers/*.py). Runs are grouped by (env_id, exp_name); within a group, each
credit backend gets the medians of its per-iteration timings after the first `--skip` fraction
of iterations (compilation and kernel warm-up), averaged over its seeds. Against the baseline
backend (CleanRL's loop by default) it prints:

- SPS: environment steps per second of a steady-state iteration (rollout + update);
- credit ms, and credit share: credit time over update time including credit (perf/credit_share)
  and over the whole iteration;
- Amdahl: the speedup Amdahl's law predicts for the whole iteration from the baseline's credit
  share p of the iteration and the measured credit speedup s, 1 / ((1 - p) + p / s), and its
  limit 1 / (1 - p) (infinitely fast credit assignment);
- measured: SPS over the baseline's SPS.
"""
import argparse
import collections
import os
import pathlib

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TAGS = ["perf/rollout_ms", "perf/credit_ms", "perf/update_ms", "perf/credit_share", "perf/iteration_ms"]
ORDER = ["loop", "compile", "auto", "triton"]


def run_dirs(roots):
    for root in roots:
        for events in sorted(pathlib.Path(root).rglob("events.out.tfevents.*")):
            parts = events.parent.name.split("__")
            if len(parts) == 5:
                yield events.parent, parts


def load_run(run_dir, skip):
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    if not set(TAGS) <= set(acc.Tags()["scalars"]):
        return None
    series = {tag: acc.Scalars(tag) for tag in TAGS}
    steps = np.array([e.step for e in series["perf/iteration_ms"]])
    start = int(len(steps) * skip)
    if len(steps) - start < 1:
        return None
    out = {tag: float(np.median([e.value for e in events[start:]])) for tag, events in series.items()}
    # environment steps per iteration: the global_step increments (the first one is the first step)
    out["steps_per_iteration"] = float(np.median(np.diff(steps))) if len(steps) > 1 else float(steps[0])
    out["sps"] = out["steps_per_iteration"] / (out["perf/iteration_ms"] / 1e3)
    out["iterations"] = len(steps) - start
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("roots", nargs="+", help="folders holding TensorBoard run directories")
    parser.add_argument("--baseline", default="loop", help="the credit backend speedups are measured against")
    parser.add_argument("--skip", type=float, default=0.2, help="fraction of first iterations left out (warm-up)")
    parser.add_argument("--out", help="where the plot goes (default: compare_backends.png in the "
                        "first folder given, beside the runs)")
    args = parser.parse_args()
    if args.out is None:
        args.out = os.path.join(args.roots[0], "compare_backends.png")

    groups = collections.defaultdict(lambda: collections.defaultdict(list))
    for run_dir, (env_id, exp_name, backend, seed, _) in run_dirs(args.roots):
        stats = load_run(run_dir, args.skip)
        if stats is not None:
            groups[(env_id, exp_name)][backend].append(stats)
    if not groups:
        raise SystemExit(f"no runs with perf/* tags under {', '.join(args.roots)}")

    rows = []
    for (env_id, exp_name), backends in sorted(groups.items()):
        mean = {b: {k: float(np.mean([r[k] for r in runs])) for k in runs[0]} | {"seeds": len(runs)}
                for b, runs in backends.items()}
        names = sorted(mean, key=lambda b: (ORDER.index(b) if b in ORDER else len(ORDER), b))
        base_name = args.baseline if args.baseline in mean else names[0]
        base = mean[base_name]
        p = base["perf/credit_ms"] / base["perf/iteration_ms"]
        print(f"\n{env_id} / {exp_name}: {base['steps_per_iteration']:.0f} steps per iteration, "
              f"baseline {base_name}, medians after the first {args.skip:.0%} of iterations")
        header = (f"{'backend':>8} {'seeds':>5} {'iters':>5} {'SPS':>10} {'rollout ms':>10} {'credit ms':>10} "
                  f"{'update ms':>10} {'share upd':>9} {'share it':>8} {'Amdahl':>7} {'limit':>6} {'measured':>8}")
        print(header)
        print("-" * len(header))
        for name in names:
            m = mean[name]
            s = base["perf/credit_ms"] / m["perf/credit_ms"]
            predicted = 1.0 / ((1.0 - p) + p / s)
            measured = m["sps"] / base["sps"]
            share_it = m["perf/credit_ms"] / m["perf/iteration_ms"]
            print(f"{name:>8} {m['seeds']:>5} {m['iterations']:>5.0f} {m['sps']:>10.0f} {m['perf/rollout_ms']:>10.2f} "
                  f"{m['perf/credit_ms']:>10.3f} {m['perf/update_ms']:>10.2f} {m['perf/credit_share']:>9.1%} "
                  f"{share_it:>8.1%} {predicted:>6.2f}x {1 / (1 - p):>5.2f}x {measured:>7.2f}x")
            rows.append(dict(group=f"{env_id}\n{exp_name}", backend=name, m=m, predicted=predicted,
                             measured=measured, baseline=base_name,
                             base_ms=base["perf/iteration_ms"]))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the baseline each group was measured against: --baseline, or its first backend where the
    # group has no run of --baseline
    baselines = list(dict.fromkeys(r["baseline"] for r in rows))
    if len(baselines) == 1:
        labels = [f"{r['group']}\n{r['backend']}" for r in rows]
    else:
        labels = [f"{r['group']}\n{r['backend']} (vs {r['baseline']})" for r in rows]
    x = np.arange(len(rows))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(6, 0.9 * len(rows) + 2), 6.5), sharex=True)
    # each group's times over its baseline's iteration: groups of any size side by side
    base_ms = np.array([r["base_ms"] for r in rows])
    rollout = np.array([r["m"]["perf/rollout_ms"] for r in rows]) / base_ms
    credit = np.array([r["m"]["perf/credit_ms"] for r in rows]) / base_ms
    rest = np.array([r["m"]["perf/update_ms"] - r["m"]["perf/credit_ms"] for r in rows]) / base_ms
    ax1.bar(x, rollout, label="rollout")
    ax1.bar(x, credit, bottom=rollout, label="credit assignment", color="tab:red")
    ax1.bar(x, rest, bottom=rollout + credit, label="rest of the update", color="tab:gray")
    for i, r in enumerate(rows):
        if r["backend"] == r["baseline"]:
            ax1.annotate(f"{r['base_ms']:.0f} ms", (x[i], 1.0), ha="center", va="bottom", fontsize=6)
    ax1.set_ylabel("iteration time / baseline's\n(medians)")
    ax1.legend(fontsize=8)
    ax2.bar(x - 0.2, [r["predicted"] for r in rows], width=0.4, label="Amdahl's prediction")
    ax2.bar(x + 0.2, [r["measured"] for r in rows], width=0.4, label="measured (SPS ratio)")
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_ylabel(f"speedup over {baselines[0]}" if len(baselines) == 1
                   else "speedup over the group's baseline")
    ax2.legend(fontsize=8)
    ax2.set_xticks(x, labels, fontsize=6, rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(args.out, dpi=80)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
