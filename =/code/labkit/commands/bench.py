"""``labkit bench BENCH ...``: measurements printed as tables (or CSV / JSON).

Each benchmark is one entry of :data:`BENCHES`: a name, a one-line help, ``add_arguments(parser)`` and
``run(args) -> int``. Add a benchmark by adding an entry; ``labkit bench --help`` lists them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

NAME = "bench"
HELP = "run a benchmark (collectives: an nccl-tests-like sweep with algbw and busbw)"


@dataclass(frozen=True)
class Bench:
    """One benchmark: its one-line help, ``add_arguments(parser)`` and ``run(args) -> exit status``."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ------------------------------------------------------------------------------------------------------
# labkit bench collectives
# ------------------------------------------------------------------------------------------------------
def _collectives_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=int, default=2, help="ranks (>= 2; default 2)")
    p.add_argument("--ops", default="all",
                   help="comma-separated: all_reduce, all_gather, reduce_scatter, broadcast, all_to_all, "
                        "send_recv, or 'all' (default)")
    p.add_argument("--min-size", default="1K",
                   help="smallest S in bytes, K/M/G = 2^10/2^20/2^30 (default 1K)")
    p.add_argument("--max-size", default="4M", help="largest S in bytes (default 4M; nccl-tests goes to 1G+)")
    p.add_argument("--step-factor", type=int, default=2,
                   help="multiply the size by this each step (default 2)")
    p.add_argument("--sizes", default=None,
                   help="explicit comma-separated sizes instead of the range; each must suit every op")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16, float64")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per size (default 5)")
    p.add_argument("--repeats", type=int, default=10, help="timed repeats per size (default 10)")
    p.add_argument("--iters", type=int, default=1, help="calls per timed repeat (default 1)")
    p.add_argument("--backend", default="auto", help="auto (default: nccl with a GPU per rank, else gloo), "
                                                     "gloo or nccl")
    p.add_argument("--timeout-s", type=float, default=600.0, help="limit for the whole run (default 600)")
    p.add_argument("--emulate", default=None, metavar="PROFILE",
                   help="time the sweep as the named GPU cluster would (labkit.runtime.emulate; e.g. dgx-h100): "
                        "real collectives on small CPU buffers, each charged its S; rows labelled emulated")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--csv", action="store_true", help="print CSV instead of the table")
    fmt.add_argument("--json", action="store_true",
                     help="print a JSON list of rows (op, world_size, bytes, time_s, algbw_gbps, "
                          "busbw_gbps, ...)")


def _collectives_run(args: argparse.Namespace) -> int:
    """Validate, sweep, print. Bad input raises ValueError before any rank starts; a failed or timed-out run
    raises :class:`labkit.LaunchError` and a closed stdout ``BrokenPipeError``: all are left to
    :mod:`labkit.cli`, which turns each into one line on stderr and exit status 2 (never caught here)."""
    from labkit.checks import positive_float
    from labkit.experiments import collectives as col
    from labkit.theory.collectives import parse_ops, parse_size, size_range

    positive_float("timeout_s", args.timeout_s)
    sizes = [parse_size(s, "sizes") for s in args.sizes.split(",")] if args.sizes else None
    if args.emulate:
        return _collectives_emulated(args, parse_ops(args.ops),
                                     sizes or size_range(args.min_size, args.max_size, args.step_factor))
    df = col.sweep(args.ops, sizes, args.world_size, min_size=args.min_size, max_size=args.max_size,
                   factor=args.step_factor, dtype=args.dtype, warmup=args.warmup, repeats=args.repeats,
                   iters=args.iters, backend=args.backend, timeout_s=args.timeout_s)
    if args.json:
        print(json.dumps(col.to_rows(df), indent=1))
    elif args.csv:
        df[col.ROW_FIELDS].to_csv(sys.stdout, index=False)
    else:
        sys.stdout.write(col.format_table(df))
    wrong = int(df["wrong"].sum())
    if wrong:
        print(f"labkit bench collectives: {wrong} wrong element(s): a collective returned wrong values",
              file=sys.stderr)
        return 1
    return 0


def _collectives_emulated(args: argparse.Namespace, ops: list, sizes: list) -> int:
    """``--emulate PROFILE``: :func:`labkit.experiments.emulate.emulated_sweep` (the profile and world size are
    checked before any rank starts), printed with the link each op crossed and the cost model beside it."""
    from labkit.experiments.emulate import emulated_sweep

    df = emulated_sweep(ops, sizes, args.world_size, args.emulate, timeout_s=args.timeout_s)
    if args.json:
        print(json.dumps(df.to_dict("records"), indent=1))
    elif args.csv:
        df.to_csv(sys.stdout, index=False)
    else:
        print(df.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    return 0


BENCHES: dict[str, Bench] = {
    "collectives": Bench("sweep collectives over message sizes: time, algbw, busbw (measured)",
                         _collectives_arguments, _collectives_run),
}


# ------------------------------------------------------------------------------------------------------
# the subcommand
# ------------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """One sub-parser per entry of :data:`BENCHES`."""
    sub = p.add_subparsers(dest="bench", metavar="BENCH", parser_class=type(p))
    for name, bench in BENCHES.items():
        q = sub.add_parser(name, help=bench.help, description=bench.help)
        bench.add_arguments(q)
        q.set_defaults(_bench_run=bench.run)


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark; exit status 2 when none is named."""
    fn = getattr(args, "_bench_run", None)
    if fn is None:
        print(f"labkit bench: error: name a benchmark: {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    return fn(args)
