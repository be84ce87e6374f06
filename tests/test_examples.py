"""examples/: a sweep of trainer runs in one process, then the Amdahl table and the learning
curves read back from its TensorBoard folders (tiny CPU runs)."""
import pathlib
import subprocess
import sys

from cases import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(*args):
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=subprocess_env(),
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_sweep_then_compare_and_curves(tmp_path):
    logs = tmp_path / "runs"
    out = run("examples/sweep.py", "ppo", "--env-ids", "CartPole-v1", "--num-envs", "2,3",
              "--credit-backends", "loop,auto", "--seeds", "1,2", "--",
              "--env-backend", "gymnasium", "--num-steps", "32", "--total-timesteps", "192",
              "--exp-name", "tiny", "--log-dir", str(logs))
    folders = sorted(p.name.split("__")[1:4] for p in logs.iterdir())
    # every combination, each its own run: the trainer's own command line took what follows --
    assert folders == sorted([["tiny", b, s] for b in ("loop", "auto") for s in ("1", "2")] * 2)
    assert out.count("# ppo CartPole-v1") == 8

    table = run("examples/compare_backends.py", str(logs), "--out", str(tmp_path / "a.png"))
    assert "CartPole-v1 / tiny" in table and "    auto     4 " in table  # 4 runs of auto: 2 sizes x 2 seeds
    assert (tmp_path / "a.png").stat().st_size > 0

    curves = run("examples/plot_learning_curves.py", *map(str, logs.iterdir()), "--by-group",
                 "--out", str(tmp_path / "c.png"))
    assert curves.count("final average of the last 100 episodes") == 8
    assert (tmp_path / "c.png").stat().st_size > 0
