"""Wall time of a trivial 4-rank run (one all_reduce) started three ways, measured in the same run: cold from
fresh interpreters, cold forked from the rank template, and warm (labkit.Pool: ranks already up).

Fresh: ``launch(one_all_reduce, 4)`` with ``LABKIT_RANK_START=spawn`` (each launch starts 4 interpreters that
import torch, rendezvous, run, tear down). Forked: the same launch as every launch makes it by default — the
4 ranks forked from the caller's template (labkit.runtime.zygote), which imported torch once; the template is
started (untimed) first. Warm: the same call inside ``with labkit.Pool(4)``, after the pool is up
(``Pool.ready``) and one untimed run. Each ``--repeats`` times, timed from the call to the returned result
(argument checks, shipping the function, the run, results back). The cold runs come first: while a pool of
that shape is open every launch of it is warm.

Prints two ratios last: median warm / median fresh (goal <= 0.1) and median forked / median fresh (goal <=
0.3); exit 1 when either is missed, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import labkit
from labkit import launch
from labkit.checks import positive_int
from labkit.cli import run_main
from labkit.experiments.common import ratio_verdict
from labkit.runtime import pool as pool_mod
from labkit.runtime.limits import check_world_size

GOAL = 0.1  # warm / fresh
GOAL_FORKED = 0.3  # forked from the template / fresh


def one_all_reduce(ctx):
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _timed(world_size: int) -> float:
    t0 = time.perf_counter()
    res = launch(one_all_reduce, world_size, echo=False)
    seconds = time.perf_counter() - t0
    if list(res) != [float(world_size)] * world_size:
        raise RuntimeError(f"wrong all_reduce results: {list(res)}")
    return seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    ws = positive_int("world_size", args.world_size)
    repeats = positive_int("repeats", args.repeats)
    check_world_size(ws)
    pool_mod.close_all()
    os.environ["LABKIT_RANK_START"] = "spawn"
    try:
        fresh = [_timed(ws) for _ in range(repeats)]
    finally:
        os.environ.pop("LABKIT_RANK_START")
    _timed(ws)  # starts the template (once per caller) and forks the ranks from it
    forked = [_timed(ws) for _ in range(repeats)]
    with labkit.Pool(ws) as pool:
        if not pool.ready():
            raise RuntimeError("the pool's ranks did not come up")
        _timed(ws)  # the first run on a pool imports what the run needs
        warm = [_timed(ws) for _ in range(repeats)]
        assert pool.starts == 1 and pool.runs == repeats + 1, pool
    fmt = lambda xs: f"median {statistics.median(xs):.3f} s (min {min(xs):.3f}, max {max(xs):.3f})"  # noqa: E731
    print(f"world_size={ws}, repeats={repeats}, cores={os.cpu_count()} (all measured)")
    print(f"cold, fresh interpreters   : {fmt(fresh)}")
    print(f"cold, forked from template : {fmt(forked)}")
    print(f"warm (labkit.Pool)         : {fmt(warm)}")
    median_fresh = statistics.median(fresh)
    line, met = ratio_verdict("ratio warm/fresh wall time (each warm run / median fresh)",
                              [w / median_fresh for w in warm], GOAL, higher_is_better=False)
    print(line)
    line2, met2 = ratio_verdict("ratio forked/fresh wall time (each forked launch / median fresh)",
                                [f / median_fresh for f in forked], GOAL_FORKED, higher_is_better=False)
    print(line2)
    return 0 if met and met2 else 1


if __name__ == "__main__":
    raise SystemExit(run_main("warm_launch", main))
