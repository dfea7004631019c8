"""labkit's collective sweep vs a bare timing loop of the same ops and sizes, in the same run.

Both run inside one launch, interleaved case by case (and in alternating order), so they share the machine's
state. The bare loop is the minimum honest timing: barrier, clock, one call, device synchronise, clock.
labkit's sweep adds buffer set-up, value checks and bookkeeping outside the timed region; inside it, the
two should cost the same. Prints a table (measured busbw of both, per size) and, last, the busbw ratio
labkit/bare (geometric mean over sizes; goal >= 0.95).

    PYTHONPATH=. python benchmarks/collectives_overhead.py [--world-size 2] [--ops all_reduce,all_gather]
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import pandas as pd

from labkit import collectives as col
from labkit import launch


def bare_rank(ctx, op, count, warmup, repeats):
    """A bare loop: the op called directly on plain buffers, timed between a barrier and a synchronize.
    Returns the seconds of each repeat."""
    import torch
    import torch.distributed as dist

    n = ctx.world_size
    x = torch.ones(count // n if op == "all_gather" else count, device=ctx.device)
    out = torch.empty(count // n if op == "reduce_scatter" else count, device=ctx.device)

    def call():
        if op == "all_reduce":
            dist.all_reduce(x)
        elif op == "all_gather":
            col._all_gather(out, x)  # all_gather_single, or all_gather_into_tensor on older torch
        elif op == "reduce_scatter":
            col._reduce_scatter(out, x)
        elif op == "broadcast":
            dist.broadcast(x, 0)
        else:
            dist.all_to_all_single(out, x)

    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        ctx.barrier()
        t0 = time.perf_counter_ns()
        call()
        ctx.sync()
        times.append((time.perf_counter_ns() - t0) / 1e9)
    return times


def both_rank(ctx, cases, warmup, repeats):
    """Per case, labkit's sweep and the bare loop, the order alternating from case to case."""
    labkit_rows, bare_rows = [], []
    for i, (op, nbytes, count) in enumerate(cases):
        for name in ("labkit", "bare") if i % 2 == 0 else ("bare", "labkit"):
            if name == "labkit":
                labkit_rows += col.sweep_rank(ctx, [(op, nbytes, count)], warmup=warmup, repeats=repeats,
                                              verify=False)
            else:
                times = bare_rank(ctx, op, count, warmup, repeats)
                bare_rows += [(op, nbytes, count, rep, t, 0) for rep, t in enumerate(times)]
    return labkit_rows, bare_rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--ops", default="all_reduce,all_gather",
                    help="comma-separated: all_reduce, all_gather, reduce_scatter, broadcast, all_to_all")
    ap.add_argument("--min-size", default="64K")
    ap.add_argument("--max-size", default="4M")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args(argv)
    try:
        ops = col.parse_ops(args.ops)
        if "send_recv" in ops:
            raise ValueError("op='send_recv' has no bare loop here; choose from the other ops")
        cases = col.plan(ops, col.size_range(args.min_size, args.max_size, 4), args.world_size, align=True)
    except ValueError as e:
        print(f"collectives_overhead: error: {e}", file=sys.stderr)
        return 2
    res = launch(both_rank, args.world_size, cases, args.warmup, args.repeats, backend=args.backend,
                 echo=False)
    lab = col.summarize(col.raw_frame([r[0] for r in res]), args.world_size, backend=res.backend)
    bare = col.summarize(col.raw_frame([r[1] for r in res]), args.world_size, backend=res.backend)
    t = lab[["op", "bytes", "busbw_gbps"]].merge(bare[["op", "bytes", "busbw_gbps"]], on=["op", "bytes"],
                                                  suffixes=("_labkit", "_bare"))
    t["ratio"] = t["busbw_gbps_labkit"] / t["busbw_gbps_bare"]
    with pd.option_context("display.width", 120):
        print(f"# measured on {res.backend}, world_size={args.world_size}, median of {args.repeats} repeats "
              "(slowest rank), interleaved case by case")
        print(t.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    gmean = math.exp(sum(math.log(r) for r in t["ratio"]) / len(t))
    print(f"busbw ratio labkit/bare: {gmean:.3f} (geometric mean over {len(t)} sizes; goal >= 0.95)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
