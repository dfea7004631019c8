"""Wall time of a trivial 4-rank run (one all_reduce) started cold (labkit.launch: fresh interpreters) vs warm
(labkit.Pool: ranks already up), measured in the same run.

Cold: ``launch(one_all_reduce, 4)`` with no pool open, ``--repeats`` times (each starts 4 interpreters, imports
torch, rendezvous, runs, tears down). Warm: the same call inside ``with labkit.Pool(4)``, after the pool is up
(``Pool.ready``) and one untimed run, ``--repeats`` times. Both are timed from the call to the returned result
(argument checks, shipping the function, the run, results back). The cold runs come first: while a pool of
that shape is open every launch of it is warm.

Prints the ratio last: median warm / median cold (goal <= 0.1); exit 1 when it is missed, 2 on bad arguments.
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

GOAL = 0.1


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
    cold = [_timed(ws) for _ in range(repeats)]
    with labkit.Pool(ws) as pool:
        if not pool.ready():
            raise RuntimeError("the pool's ranks did not come up")
        _timed(ws)  # the first run on a pool imports what the run needs
        warm = [_timed(ws) for _ in range(repeats)]
        assert pool.starts == 1 and pool.runs == repeats + 1, pool
    fmt = lambda xs: f"median {statistics.median(xs):.3f} s (min {min(xs):.3f}, max {max(xs):.3f})"  # noqa: E731
    print(f"world_size={ws}, repeats={repeats}, cores={os.cpu_count()} (all measured)")
    print(f"cold launch (fresh ranks): {fmt(cold)}")
    print(f"warm (labkit.Pool)       : {fmt(warm)}")
    median_cold = statistics.median(cold)
    line, met = ratio_verdict("ratio warm/cold wall time (each warm run / median cold)",
                              [w / median_cold for w in warm], GOAL, higher_is_better=False)
    print(line)
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(run_main("warm_launch", main))
