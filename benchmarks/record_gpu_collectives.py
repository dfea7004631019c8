"""Record a collective sweep on a GPU node (NCCL, one rank per GPU) into data/reference/collectives/, so
laptop users see real GPU numbers beside their CPU ones in chapter 02.

    PYTHONPATH=. python benchmarks/record_gpu_collectives.py                  # every visible GPU, 1K..1G
    PYTHONPATH=. python benchmarks/record_gpu_collectives.py --world-size 4 --max-size 256M

Writes ``data/reference/collectives/<gpu>-<n>gpu-<yyyymmdd>.json`` (format ``labkit.collectives/v1``:
``{"format", "identity", "rows"}``; identity = host, GPUs, torch, CUDA, NCCL, git sha, UTC time; rows =
the sweep table's columns). Add ``--unsynchronised`` to record, beside the real rows, rows timed without
synchronisation (the field bug the chapter shows; they carry ``timing="unsynchronised"`` and get flagged).
Commit the file. Without at least two GPUs it records nothing and exits 2: it never writes CPU numbers
as GPU ones. When a row came out wrong (values, or a synchronised row flagged flat or beyond the hardware:
labkit.experiments.collectives.bad_reference_rows) it prints the table and those rows, records nothing and
exits 1.
"""

from __future__ import annotations

import argparse
import re
import sys
import time

import torch

from labkit.experiments import collectives as col
from labkit.runtime import records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=None, help="GPUs to use (default: all visible)")
    ap.add_argument("--ops", default="all")
    ap.add_argument("--min-size", default="1K")
    ap.add_argument("--max-size", default="1G")
    ap.add_argument("--step-factor", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--iters", type=int, default=20, help="calls per timed repeat (nccl-tests uses 20)")
    ap.add_argument("--unsynchronised", action="store_true", help="also record rows timed the wrong way")
    ap.add_argument("--out", default=None, help="output file (default data/reference/collectives/...)")
    args = ap.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    n = args.world_size or gpus
    if gpus < 2 or n > gpus:
        print(f"record_gpu_collectives: error: needs at least 2 visible GPUs and world_size <= GPUs "
              f"(found {gpus} GPU(s), world_size={n}); nothing recorded", file=sys.stderr)
        return 2
    timings = ("synchronised", "unsynchronised") if args.unsynchronised else ("synchronised",)
    try:
        df = col.sweep(args.ops, None, n, min_size=args.min_size, max_size=args.max_size,
                       factor=args.step_factor, dtype=args.dtype, warmup=args.warmup, repeats=args.repeats,
                       iters=args.iters, backend="nccl", timings=timings, timeout_s=3600)
    except ValueError as e:
        print(f"record_gpu_collectives: error: {e}", file=sys.stderr)
        return 2
    bad = col.bad_reference_rows(df)
    if len(bad):
        sys.stdout.write(col.format_table(df))
        print(f"record_gpu_collectives: error: {len(bad)} row(s) must not become reference numbers; nothing "
              f"recorded:\n" + bad[["op", "bytes", "timing", "busbw_gbps", "why"]].to_string(index=False),
              file=sys.stderr)
        return 1
    ident = records.identity("collectives", {"ops": args.ops, "dtype": args.dtype}, world_size=n, backend="nccl")
    ident["command"] = " ".join(["benchmarks/record_gpu_collectives.py", *(argv or sys.argv[1:])])
    ident.update({"iters": args.iters, "warmup": args.warmup, "repeats": args.repeats})
    gpu = re.sub(r"[^a-z0-9]+", "-", ident["gpus"][0].lower()).strip("-")
    out = args.out or col.reference_dir() / f"{gpu}-{n}gpu-{time.strftime('%Y%m%d')}.json"
    path = col.write_reference(df, ident, out)
    sys.stdout.write(col.format_table(df))
    print(f"recorded {len(df)} rows to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
