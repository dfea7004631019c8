"""Wall time of labkit.launch vs torchrun for the same trivial 4-rank job, measured in the same run.

Both start 4 fresh rank interpreters, create a gloo process group, run a barrier, and tear down. Timed three
ways, the order alternating from repeat to repeat so machine noise hits all alike (medians compared):

* ``launch(trivial, 4)`` in this interpreter (what a notebook pays: its interpreter is already running);
* ``python <script> 4`` — the same launch from a fresh interpreter, as a subprocess;
* ``torchrun --standalone --nproc-per-node 4 <script>`` as a subprocess (its own interpreter start is part of
  what a torchrun user pays).

The headline compares the two that start the same way, each from a fresh interpreter: launch / torchrun (goal
<= 1.0), printed last. The in-process ratio is printed before it, labelled: it leaves out the interpreter start
that torchrun's time includes.
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

#: the same trivial job through labkit.launch, started from a fresh interpreter as torchrun's is
OURS = textwrap.dedent("""
    import sys

    import torch.distributed as dist

    from labkit import launch


    def trivial(ctx):
        dist.barrier()
        return ctx.rank


    if __name__ == "__main__":
        launch(trivial, int(sys.argv[1]), echo=False)
""")

WAYS = ("in-process", "fresh", "torchrun")


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
    n = str(args.world_size)
    torchrun = Path(sys.executable).with_name("torchrun")
    threads = max(1, (os.cpu_count() or 1) // args.world_size)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    root = str(Path(__file__).resolve().parent.parent)
    env_ours = dict(env, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    scripts = {}
    for key, text in (("torchrun", SCRIPT), ("ours", OURS)):
        with tempfile.NamedTemporaryFile("w", suffix=f"_{key}.py", delete=False) as f:
            f.write(text)
        scripts[key] = f.name
    runs = {
        "in-process": lambda: launch(trivial, args.world_size, echo=False),
        "fresh": lambda: subprocess.run([sys.executable, scripts["ours"], n], check=True, env=env_ours,
                                        capture_output=True),
        "torchrun": lambda: subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", n,
                                            scripts["torchrun"]], check=True, env=env, capture_output=True),
    }
    times: dict[str, list[float]] = {k: [] for k in WAYS}
    try:
        launch(trivial, args.world_size, echo=False)  # warm the OS file cache for all
        for rep in range(args.repeats):
            for key in WAYS if rep % 2 == 0 else tuple(reversed(WAYS)):
                t0 = time.perf_counter()
                runs[key]()
                times[key].append(time.perf_counter() - t0)
    finally:
        for path in scripts.values():
            os.unlink(path)
    fmt = lambda xs: f"median {statistics.median(xs):.2f} s (min {min(xs):.2f}, max {max(xs):.2f})"  # noqa: E731
    print(f"world_size={args.world_size}, repeats={args.repeats}, cores={os.cpu_count()} (all measured)")
    print(f"labkit.launch in this interpreter         : {fmt(times['in-process'])}")
    print(f"labkit.launch from a fresh interpreter    : {fmt(times['fresh'])}")
    print(f"torchrun --standalone (fresh interpreter) : {fmt(times['torchrun'])}")
    inproc = statistics.median(a / b for a, b in zip(times["in-process"], times["torchrun"]))
    print(f"ratio in-process launch/torchrun = {inproc:.3f} (not like for like: torchrun's time includes an "
          "interpreter start that an already running notebook does not pay)")
    line, met = ratio_verdict("ratio launch/torchrun wall time, both from a fresh interpreter, per repeat",
                              [a / b for a, b in zip(times["fresh"], times["torchrun"])], 1.0,
                              higher_is_better=False)
    print(line)
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(run_main("launch_overhead", main))
