"""Learning curves of trainer runs: the mean episodic return per iteration and the average over
the last 100 episodes, against environment steps.

    python examples/plot_learning_curves.py RUN_DIR [RUN_DIR ...] --out curve.png [--threshold 475]

Prints, per run, the final average over the last 100 episodes and the first step where it reached
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
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for i, run in enumerate(args.runs):
        acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
        acc.Reload()
        name = pathlib.Path(run).name.split("__")
        label = f"{name[1]} ({name[2]}, seed {name[3]})" if len(name) == 5 else pathlib.Path(run).name
        if args.labels:
            label = args.labels[i]
        ep = acc.Scalars("charts/episodic_return")
        avg = acc.Scalars("charts/avg_return_100")
        line, = ax.plot([e.step for e in avg], [e.value for e in avg], label=f"{label}: last 100")
        ax.plot([e.step for e in ep], [e.value for e in ep], color=line.get_color(), alpha=0.25, lw=0.8)
        reached = next((e.step for e in avg if args.threshold is not None and e.value >= args.threshold), None)
        print(f"{run}: {avg[-1].step} steps, final average of the last 100 episodes {avg[-1].value:.1f}, "
              f"best {max(e.value for e in avg):.1f}"
              + (f", first >= {args.threshold:g} at step {reached}" if args.threshold is not None else ""))
    if args.threshold is not None:
        ax.axhline(args.threshold, color="k", ls="--", lw=0.8)
    ax.set_xlabel("environment steps")
    ax.set_ylabel("episodic return")
    if args.title:
        ax.set_title(args.title, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=80)


if __name__ == "__main__":
    main()
