"""Wall time of labkit.launch vs torchrun for the same trivial 4-rank job, measured in the same run.

Both start 4 fresh interpreters, create a gloo process group, run a barrier, and tear down. We time
``launch(trivial, 4)`` in-process, and ``torchrun --standalone --nproc-per-node 4 <script>`` as a
subprocess (its own interpreter start is part of what a torchrun user pays). Repeats alternate the two so
machine noise hits both alike; medians are compared.

Prints the ratio last: launch / torchrun (goal <= 1.0).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch.distributed as dist

from labkit import launch
from labkit.checks import positive_int
from labkit.cli import run_main
from labkit.experiments.common import ratio_verdict

SCRIPT = textwrap.dedent("""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()
    dist.destroy_process_group()
""")


def trivial(ctx):
    dist.barrier()
    return ctx.rank


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    positive_int("world_size", args.world_size)
    positive_int("repeats", args.repeats)
    torchrun = Path(sys.executable).with_name("torchrun")
    threads = max(1, (os.cpu_count() or 1) // args.world_size)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(SCRIPT)
    ours, theirs = [], []
    launch(trivial, args.world_size, echo=False)  # warm the OS file cache for both
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        launch(trivial, args.world_size, echo=False)
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", str(args.world_size), f.name],
                       check=True, env=env, capture_output=True)
        theirs.append(time.perf_counter() - t0)
    os.unlink(f.name)
    fmt = lambda xs: f"median {statistics.median(xs):.2f} s (min {min(xs):.2f}, max {max(xs):.2f})"  # noqa: E731
    print(f"world_size={args.world_size}, repeats={args.repeats}, cores={os.cpu_count()} (all measured)")
    print(f"labkit.launch           : {fmt(ours)}")
    print(f"torchrun --standalone   : {fmt(theirs)}")
    line, met = ratio_verdict("ratio launch/torchrun wall time, per repeat", [a / b for a, b in zip(ours, theirs)],
                              1.0, higher_is_better=False)
    print(line)
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(run_main("launch_overhead", main))
