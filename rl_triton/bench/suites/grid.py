"""The default suite: every estimator over the shape grid (N envs x T steps), layouts, input
dtypes and truncation settings; each result checked against float64, then timed (device, full
call, host) against the same-bytes copy and the baselines: the torch backend eager and under
`torch.compile`, and the sequential loop. Gradients (`--modes`) in `suites.gradients`."""
from __future__ import annotations


import torch

import rl_triton

from .. import registry, report, timing
from ..calls import call_of
from ..checks import check_result, float64_result, rel_err
from ..report import Row
from .gradients import time_gradients


def run_grid(estimators, shapes, layouts, dtypes, truncs, baselines, modes, env, bw, device,
             out, max_seconds):
    """Every configuration of the grid, `--modes` fwd (rl_triton and the baselines on the first
    dtype and layout) and the gradient modes; bench.json after each, then bench.md and
    bench.png."""
    rows: list[Row] = []
    report.save_json(out, env, rows)
    configs = [(e, s, lay, dt, tr) for e in estimators for s in shapes for lay in layouts
               for dt in dtypes for tr in truncs]
    for i, (name, shape, layout, dt, tr), tag in timing.within_seconds(configs, max_seconds):
        N, T = registry.parse_shape(shape)
        kw, nbytes = registry.make_inputs(name, N, T, layout, registry.DTYPES[dt], tr, device,
                                          seed=i)
        fn = getattr(rl_triton, name)
        if "bwd" in modes or "fwd+bwd" in modes:
            rows += time_gradients(name, shape, layout, dt, tr, kw, modes,
                                   dt == dtypes[0] and layout == layouts[0], bw, device, tag)
            report.save_json(out, env, rows)
        if "fwd" not in modes:
            continue
        refs = float64_result(name, kw)
        impls = [("rl_triton", call_of(fn, kw))]
        if dt == dtypes[0] and layout == layouts[0]:
            torch_fn = call_of(fn, kw, backend="torch")
            for b in baselines:
                if b == "torch":
                    impls.append(("torch", torch_fn))
                elif b == "compile":
                    impls.append(("compile", _compiled(name, kw)))
                elif b == "loop" and T <= registry.LOOP_MAX_T:
                    impls.append(("loop", call_of(fn, kw, backend="loop")))
        for impl, f in impls:
            err = rel_err(f(), refs, kw["time_dim"])
            check_result(err, 1e-5 if impl != "loop" else 1e-4,
                         f"{impl} {name} {shape} {layout} {dt} trunc={tr}")
            dev, full, host = timing.device_full_host_us(f)
            row = Row(name, shape, layout, dt, tr, impl, nbytes, dev, full,
                      nbytes / (dev * 1e-6) / bw, err, timing.same_bytes_copy_us(nbytes, device),
                      host_us=host)
            rows.append(row)
            print(f"{tag} {name:18s} {shape:>10s}"
                  f" {layout:11s} {dt:8s} trunc={int(tr)} {impl:9s} {dev:9.1f} us dev "
                  f"{full:9.1f} us full {host:9.1f} us host  {row.bandwidth_fraction:5.2f} of "
                  f"copy bw, {row.copy_us / dev:4.2f} of a same-bytes copy", flush=True)
        del kw, refs
        # after every configuration, so that a run cut short keeps what it measured
        report.save_json(out, env, rows)
    report.write_saved_reports(out)


def _compiled(name, kw):
    fn = torch.compile(getattr(rl_triton, name), dynamic=False)
    return lambda: fn(**kw, backend="torch")
