"""labkit's collective sweep vs a bare timing loop of the same ops and sizes, in the same run.

Both run inside one launch, interleaved repeat by repeat (the order alternating), so they share the machine's
state. The bare loop is the minimum honest timing: barrier, clock, one call, device synchronise, clock.
labkit's sweep adds buffer set-up, value checks and bookkeeping outside the timed region; inside it, the
two should cost the same. Each round gives both one untimed warm-up call on their fresh buffers, then one
timed repeat.

Both paths' values are checked every round, outside the timed region (the output against what the op must
produce, computed without it); a wrong value on either path prints no ratio and exits 1.

Prints a table per size: measured busbw of both (median of the repeats) and two ratios labkit/bare — of the
medians, and of the least-disturbed (fastest) repeats, which load on a shared machine cannot make faster.
Then the spread of the per-size ratios, and, last, the headline: the geometric mean over sizes of the
least-disturbed ratio (goal >= 0.95). Exit status 0 when the goal is met, 1 when it is missed, 2 for bad
arguments.

    PYTHONPATH=. python benchmarks/collectives_overhead.py [--world-size 2] [--ops all_reduce,all_gather]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import pandas as pd

from labkit import launch
from labkit.checks import positive_int
from labkit.cli import run_main
from labkit.experiments import collectives as col
from labkit.theory.collectives import parse_ops, plan, size_range

GOAL = 0.95


def bare_rank(ctx, op, count, warmup, repeats, verify=False):
    """A bare loop: the op called directly on plain buffers, timed between a barrier and a synchronize.
    Returns (the seconds of each repeat, wrong elements): with ``verify``, one untimed call first on buffers
    with the check pattern (:func:`labkit.experiments.collectives.make_buffers`), its output compared with
    :func:`~labkit.experiments.collectives.expected_output` (computed without the collective); 0 otherwise."""
    import torch
    import torch.distributed as dist

    from labkit.parallel.comm import all_gather_tensor, reduce_scatter_tensor

    n = ctx.world_size
    x = torch.ones(count // n if op == "all_gather" else count, device=ctx.device)
    out = torch.empty(count // n if op == "reduce_scatter" else count, device=ctx.device)

    def call(x, out):
        if op == "all_reduce":
            dist.all_reduce(x)
        elif op == "all_gather":
            all_gather_tensor(out, x)  # all_gather_single, or all_gather_into_tensor on older torch
        elif op == "reduce_scatter":
            reduce_scatter_tensor(out, x)
        elif op == "broadcast":
            dist.broadcast(x, 0)
        else:
            dist.all_to_all_single(out, x)

    for _ in range(warmup):
        call(x, out)
    wrong = 0
    if verify:  # outside the timed region, as labkit's sweep does it
        vx, vout = col.make_buffers(op, count, ctx.rank, n, "float32", ctx.device)
        ctx.barrier()
        call(vx, vout)
        ctx.sync()
        wrong = col.count_wrong(vout, col.expected_output(op, count, ctx.rank, n, "float32", ctx.device), "float32")
    times = []
    for _ in range(repeats):
        ctx.barrier()
        t0 = time.perf_counter_ns()
        call(x, out)
        ctx.sync()
        times.append((time.perf_counter_ns() - t0) / 1e9)
    return times, wrong


def both_rank(ctx, cases, warmup, repeats):
    """Per case: ``warmup`` untimed calls of each path, then ``repeats`` rounds of one labkit repeat and one
    bare repeat (each after one untimed call on its fresh buffers, and one untimed value check), the order
    alternating from round to round. Rows ``(op, bytes, count, repeat, time_s, wrong)``: ``wrong`` is the
    number of output elements that check found wrong on this rank (both paths are checked, never assumed)."""
    labkit_rows, bare_rows = [], []
    for i, (op, nbytes, count) in enumerate(cases):
        col.sweep_rank(ctx, [(op, nbytes, count)], warmup=warmup, repeats=1, verify=False)
        bare_rank(ctx, op, count, warmup, 1)
        for rep in range(repeats):
            for name in ("labkit", "bare") if (i + rep) % 2 == 0 else ("bare", "labkit"):
                if name == "labkit":
                    (row,) = col.sweep_rank(ctx, [(op, nbytes, count)], warmup=1, repeats=1, verify=True)
                    labkit_rows.append((op, nbytes, count, rep, row[4], row[5]))
                else:
                    (t,), wrong = bare_rank(ctx, op, count, 1, 1, verify=True)
                    bare_rows.append((op, nbytes, count, rep, t, wrong))
    return labkit_rows, bare_rows


def compare(lab: pd.DataFrame, bare: pd.DataFrame) -> pd.DataFrame:
    """Per (op, bytes): measured busbw of both (median repeat), ``ratio_median`` (labkit/bare busbw of the
    median repeats) and ``ratio_best`` (of the fastest repeats: bare time_min / labkit time_min)."""
    cols = ["op", "bytes", "busbw_gbps", "time_s", "time_min_s"]
    t = lab[cols].merge(bare[cols], on=["op", "bytes"], suffixes=("_labkit", "_bare"))
    t["ratio_median"] = t["busbw_gbps_labkit"] / t["busbw_gbps_bare"]
    t["ratio_best"] = t["time_min_s_bare"] / t["time_min_s_labkit"]
    return t[["op", "bytes", "busbw_gbps_labkit", "busbw_gbps_bare", "ratio_median", "ratio_best"]]


def headline(t: pd.DataFrame) -> tuple[float, str]:
    """(geometric mean of ``ratio_best``, the spread line printed before it)."""
    gmean = math.exp(sum(math.log(r) for r in t["ratio_best"]) / len(t))
    spread = (f"per-size ratio labkit/bare, least-disturbed repeats: min {t['ratio_best'].min():.3f}, median "
              f"{statistics.median(t['ratio_best']):.3f}, max {t['ratio_best'].max():.3f}; of the median repeats: "
              f"min {t['ratio_median'].min():.3f}, median {statistics.median(t['ratio_median']):.3f}, max "
              f"{t['ratio_median'].max():.3f} ({len(t)} sizes)")
    return gmean, spread


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
        ops = parse_ops(args.ops)
        if "send_recv" in ops:
            raise ValueError("op='send_recv' has no bare loop here; choose from the other ops")
        cases = plan(ops, size_range(args.min_size, args.max_size, 4), args.world_size, align=True)
        warmup = positive_int("warmup", args.warmup, minimum=0)
        repeats = positive_int("repeats", args.repeats)
    except ValueError as e:
        print(f"collectives_overhead: error: {e}", file=sys.stderr)
        return 2
    res = launch(both_rank, args.world_size, cases, warmup, repeats, backend=args.backend, echo=False)
    raw = {"labkit": col.raw_frame([r[0] for r in res]), "bare": col.raw_frame([r[1] for r in res])}
    wrong = pd.concat([f.assign(path=k) for k, f in raw.items()])
    wrong = wrong[wrong["wrong"] != 0].groupby(["path", "op", "bytes"])["wrong"].sum().reset_index()
    if len(wrong):  # a fast path that computes the wrong values must not get a ratio
        print(f"collectives_overhead: wrong values (elements, summed over ranks and repeats), no ratio: "
              f"{wrong.to_dict('records')}", file=sys.stderr)
        return 1
    lab = col.summarize(raw["labkit"], args.world_size, backend=res.backend)
    bare = col.summarize(raw["bare"], args.world_size, backend=res.backend)
    t = compare(lab, bare)
    with pd.option_context("display.width", 140):
        print(f"# measured on {res.backend}, world_size={args.world_size}, {repeats} repeats per path (slowest "
              "rank), interleaved repeat by repeat; busbw of the median repeat")
        print(t.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    gmean, spread = headline(t)
    print(spread)
    met = gmean >= GOAL
    print(f"busbw ratio labkit/bare: {gmean:.3f} (geometric mean over {len(t)} sizes of the least-disturbed "
          f"repeats; goal >= {GOAL}: {'met' if met else 'MISSED'})")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(run_main("collectives_overhead", main))
