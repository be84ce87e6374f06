"""Many runs of one trainer in one process: every combination of environment id, number of
environments, seed and credit backend, each a separate run (its own seed, agent, optimizer and
TensorBoard folder), as if started one by one from the command line.

    python examples/sweep.py ppo --env-ids CartPole-v1,Breakout-MinAtar --num-envs 4096,16384 \
        --credit-backends loop,compile,triton --seeds 1,2,3 -- --env-backend gymnax --num-steps 32

What follows `--` goes to the trainer's own command line (`trainers/<trainer>.py --help`). One
process pays the imports of torch, JAX and gymnax and their device start-up once instead of once
per run; the backends of an (environment, size, seed) run one after another, so a slow drift of
the machine touches them alike. Every run's first iterations still pay its own warm-up (JAX compiles
each new environment, `torch.compile` each new shape), which `compare_backends.py --skip` leaves
out of the timings it compares.
"""
import argparse
import importlib
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "trainers"))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trainer", choices=["ppo", "impala"], help="trainers/<trainer>.py")
    parser.add_argument("--env-ids", required=True, help="comma list of environment ids")
    parser.add_argument("--num-envs", required=True, help="comma list of environment counts")
    parser.add_argument("--credit-backends", default="loop,compile,triton", help="comma list")
    parser.add_argument("--seeds", default="1,2,3", help="comma list")
    args = parser.parse_args(ours)

    import tyro

    trainer = importlib.import_module(args.trainer)
    started = None  # the second the last run started in: a trainer names its run's folder by it
    for seed in args.seeds.split(","):  # seeds outermost: a sweep cut short still covers every group
        for env_id in args.env_ids.split(","):
            for num_envs in args.num_envs.split(","):
                for backend in args.credit_backends.split(","):
                    run = tyro.cli(trainer.Args, args=rest + [
                        "--env-id", env_id, "--num-envs", num_envs, "--seed", seed,
                        "--credit-backend", backend])
                    while started == int(time.time()):  # two runs in one second: one folder
                        time.sleep(0.05)
                    started = int(time.time())
                    start = time.time()
                    print(f"# {args.trainer} {env_id} num_envs={num_envs} seed={seed} "
                          f"credit_backend={backend}", flush=True)
                    trainer.train(run)
                    print(f"# {time.time() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
