"""Learning curves of trainer runs: the mean episodic return per iteration and the average over
the last 100 episodes, against environment steps.

    python examples/plot_learning_curves.py RUN_DIR [RUN_DIR ...] --out curve.png [--threshold 475]
    python examples/plot_learning_curves.py runs/h200_gymnax/* --out curves.png --by-group

With --by-group, one panel per (environment, experiment name) of the run folders' names, one
line per run (the average of the last 100 episodes), coloured by credit backend. Prints, per
run, the final average over the last 100 episodes and the first step where it reached
`--threshold` (if given).
"""
import argparse
import pathlib

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--threshold", type=float, default=None)
    parser.add_argument("--title", default=None)
    parser.add_argument("--labels", nargs="*", default=None, help="one legend label per run")
    parser.add_argument("--by-group", action="store_true",
                        help="a panel per (environment, experiment), a colour per credit backend")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(args.runs) if args.by_group else args.runs
    names = [pathlib.Path(run).name.split("__") for run in runs]
    groups = list(dict.fromkeys(tuple(n[:2]) for n in names)) if args.by_group else [None]
    cols = min(len(groups), 2)
    fig, axes = plt.subplots((len(groups) + cols - 1) // cols, cols, squeeze=False,
                             figsize=(6 * cols, 3.6 * ((len(groups) + cols - 1) // cols)))
    backends = list(dict.fromkeys(n[2] for n in names if len(n) == 5))
    for i, (run, name) in enumerate(zip(runs, names)):
        acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
        acc.Reload()
        label = f"{name[1]} ({name[2]}, seed {name[3]})" if len(name) == 5 else pathlib.Path(run).name
        if args.labels:
            label = args.labels[i]
        if "charts/avg_return_100" not in acc.Tags()["scalars"]:
            print(f"{run}: no episode ended")
            continue
        ep = acc.Scalars("charts/episodic_return")
        avg = acc.Scalars("charts/avg_return_100")
        if args.by_group:
            ax = axes.flat[groups.index(tuple(name[:2]))]
            ax.set_title(f"{name[0]}, {name[1]}", fontsize=9)
            first = name[3] == min(n[3] for n in names if n[:3] == name[:3])
            ax.plot([e.step for e in avg], [e.value for e in avg], lw=1,
                    color=f"C{backends.index(name[2])}", label=name[2] if first else None)
        else:
            ax = axes.flat[0]
            line, = ax.plot([e.step for e in avg], [e.value for e in avg], label=f"{label}: last 100")
            ax.plot([e.step for e in ep], [e.value for e in ep], color=line.get_color(), alpha=0.25, lw=0.8)
        reached = next((e.step for e in avg if args.threshold is not None and e.value >= args.threshold), None)
        print(f"{run}: {avg[-1].step} steps, final average of the last 100 episodes {avg[-1].value:.1f}, "
              f"best {max(e.value for e in avg):.1f}"
              + (f", first >= {args.threshold:g} at step {reached}" if args.threshold is not None else ""))
    for ax in axes.flat[:len(groups)]:
        if args.threshold is not None:
            ax.axhline(args.threshold, color="k", ls="--", lw=0.8)
        ax.set_xlabel("environment steps")
        ax.set_ylabel("episodic return" + (" (last 100)" if args.by_group else ""))
        ax.legend(fontsize=7)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    if args.title:
        fig.suptitle(args.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=80)


if __name__ == "__main__":
    main()
