"""Wall time of an emulated run vs the same run unemulated (same world size), and of a 16-rank emulated
chapter-06-sized run.

The run: the data-parallel experiment of chapter 03 (labkit.experiments.data.run_rank: bucketed DP and torch DDP
training the lab's model, real compute) on ``--world-size`` ranks, launched alternately with and without
``emulate=--profile`` so machine noise hits both alike; the ratio emulated / unemulated is taken per repeat. The
emulated launch pays for tracing every operation inside the ranks (a Python dispatch mode) and for the replay.
Then chapter 06's fixed-compute pipeline jobs (GPipe, 1F1B, interleaved, ZB-H1; m = 2 x pp micro-batches of
``--op-ms`` stand-in ops) on ``--big-world-size`` ranks, emulated once: its wall time, and its emulated bubble
beside the simulator's.

Each emulated run's losses and gradients are checked against its unemulated twin first (the tracer must not
change what the program computes); a difference is printed and exits 1 before any ratio. Prints the ratio last
(goal <= 1.3); exit status 1 when the goal is missed or the results differ, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from labkit.checks import positive_float, positive_int
from labkit.cli import run_main
from labkit.experiments.common import ratio_verdict

GOAL = 1.3


def _timed_launch(world_size: int, emulate, steps: int):
    from labkit.experiments.data import run_rank
    from labkit.runtime.launcher import launch

    t0 = time.perf_counter()
    # chapter 03's global batch of 8, or one sequence per rank where the world is larger (dp must divide it)
    res = launch(run_rank, world_size, runs=[{"variant": "bucket"}, {"variant": "ddp"}], steps=steps,
                 global_batch_size=max(8, world_size), emulate=emulate, echo=False, timeout_s=600)
    return time.perf_counter() - t0, res


def results_differ(plain, emulated) -> str | None:
    """Where the emulated run's results differ from the unemulated run's (the same program must compute the
    same losses and gradients, else the ratio compares two different runs), or None: losses within 1e-6
    relative, gradients ``torch.allclose`` at rtol 1e-5, per rank and variant."""
    import math

    import torch

    for rank, (a, b) in enumerate(zip(plain, emulated, strict=True)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if not all(math.isclose(u, v, rel_tol=1e-6) for u, v in zip(x["losses"], y["losses"], strict=True)):
                return f"rank {rank}, run {i}: losses {x['losses']} unemulated vs {y['losses']} emulated"
            for name, g in x.get("grads", {}).items():
                if not torch.allclose(g, y["grads"][name], rtol=1e-5, atol=1e-7):
                    return f"rank {rank}, run {i}: gradient of {name} differs between the two runs"
    return None


def _pipeline_entry():
    try:  # after the pipeline split
        from labkit.experiments.pipeline import bubble_from_timeline, run_pipelines
    except ImportError:
        from labkit.parallel.pipeline import bubble_from_timeline, run_pipelines
    return run_pipelines, bubble_from_timeline


def big_run(world_size: int, profile: str, op_ms: float) -> list[str]:
    """Chapter 06's fixed-compute jobs on ``world_size`` ranks, emulated on ``profile``: lines to print."""
    from labkit.runtime import emulate as em
    from labkit.theory.simulate import OpCosts

    run_pipelines, bubble_from_timeline = _pipeline_entry()
    op = op_ms / 1e3
    m = 2 * world_size
    jobs = [{"schedule": s, "n_microbatches": m, "steps": 1, "warmup_steps": 0,
             "costs": OpCosts(op / 2, op / 2, op / 2) if s == "interleaved" else OpCosts(op, op, op)}
            for s in ("gpipe", "1f1b", "interleaved", "zb-h1")]
    t0 = time.perf_counter()
    with em.emulation(profile) as session:
        runs = run_pipelines(jobs, world_size, echo=False, timeout_s=600)
    wall = time.perf_counter() - t0
    e = session.last
    lines = [f"{world_size}-rank chapter-06-sized run (4 schedules, m={m}, {op_ms:g} ms ops), emulated on "
             f"{profile}: wall {wall:.1f} s (measured; replay {e.replay_s:.2f} s of it)"]
    for run in runs:
        b = bubble_from_timeline(e.retime(run.timeline), world_size)["bubble_fraction"].iloc[0]
        lines.append(f"  {run.job['schedule']:12s} bubble {e.label} {b:.4f}   simulated "
                     f"{run.predicted.bubble_fraction:.4f}   measured {run.bubble_measured:.4f}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4, help="ranks of the ratio runs (default 4)")
    ap.add_argument("--repeats", type=int, default=3, help="emulated/unemulated pairs (default 3)")
    ap.add_argument("--steps", type=int, default=3, help="timed training steps per variant (default 3)")
    ap.add_argument("--profile", default="dgx-h100", help="cluster profile (default dgx-h100)")
    ap.add_argument("--big-world-size", type=int, default=16, help="ranks of the chapter-06-sized run (default 16)")
    ap.add_argument("--op-ms", type=float, default=20.0, help="chapter 06's stand-in op cost, ms (default 20)")
    ap.add_argument("--skip-big", action="store_true", help="skip the chapter-06-sized run")
    args = ap.parse_args(argv)
    for name in ("world_size", "repeats", "steps", "big_world_size"):
        positive_int(name, getattr(args, name))
    positive_float("op_ms", args.op_ms)
    from labkit.runtime.emulate import resolve

    resolve(args.profile, args.world_size)  # ValueError (exit 2) before any rank starts
    if not args.skip_big:
        resolve(args.profile, args.big_world_size)
    _timed_launch(args.world_size, None, 1)  # warm the OS file cache
    plain, emulated, ratios = [], [], []
    for _ in range(args.repeats):
        a, ref = _timed_launch(args.world_size, None, args.steps)
        b, res = _timed_launch(args.world_size, args.profile, args.steps)
        why = results_differ(list(ref), list(res))
        if why is not None:  # the two runs computed different things: no ratio to print
            print(f"the emulated run's results differ from the unemulated run's: {why}")
            return 1
        plain.append(a)
        emulated.append(b)
        ratios.append(b / a)
    fmt = lambda xs: f"median {statistics.median(xs):.2f} s (min {min(xs):.2f}, max {max(xs):.2f})"  # noqa: E731
    print(f"world_size={args.world_size}, repeats={args.repeats}, cores={os.cpu_count()}; chapter 03's DP run "
          f"(bucket + ddp, {args.steps} steps), wall times measured")
    print(f"unemulated               : {fmt(plain)}")
    print(f"emulated ({args.profile})      : {fmt(emulated)}  (replay {res.emulation.replay_s:.2f} s, "
          f"{sum(len(t) for t in res.emulation.traces)} trace events)")
    if not args.skip_big:
        for line in big_run(args.big_world_size, args.profile, args.op_ms):
            print(line)
    line, met = ratio_verdict("ratio emulated/unemulated wall time, per repeat", ratios, GOAL,
                              higher_is_better=False)
    print(line)
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(run_main("emulate_overhead", main))
