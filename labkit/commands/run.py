"""``labkit run``: execute the chapter notebooks headless with papermill and print a summary."""

from __future__ import annotations

import sys
from pathlib import Path

NAME = "run"
HELP = "execute chapter notebooks headless (papermill) into runs/<stamp>/ and print a summary"


def add_arguments(p) -> None:
    p.add_argument("--chapters", default=None,
                   help="comma-separated chapter numbers, e.g. 00,02 (default: every chapter)")
    p.add_argument("--out", default=None, help="folder for executed notebooks (default runs/<stamp>/)")
    p.add_argument("-p", "--parameter", action="append", default=[], metavar="NAME=VALUE",
                   help="override a parameter in every chapter that declares it (repeatable), e.g. -p world_size=4")
    p.add_argument("--cell-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="per-cell timeout; a cell running longer fails its notebook (default 600)")
    p.add_argument("--kernel", default="python3", help="Jupyter kernel name (default python3)")


def run(args) -> int:
    import pandas as pd

    from labkit.checks import positive_float
    from labkit.notebooks import check_parameters, discover, parse_parameters, refused_chapters, run_chapters

    chapters = None
    if args.chapters is not None:
        chapters = [c for c in args.chapters.split(",") if c.strip()]
        if not chapters:
            raise ValueError(f"--chapters {args.chapters!r} names no chapter; give numbers like 00,02")
    params = parse_parameters(args.parameter)
    if "world_size" in params:  # refused here, before any notebook starts ranks (override: $LABKIT_MAX_WORLD_SIZE)
        from labkit.checks import positive_int
        from labkit.runtime.limits import check_world_size

        check_world_size(positive_int("-p world_size", params["world_size"]), name="-p world_size")
    from labkit.chapters.common import as_emulate

    if as_emulate(params.get("emulate")) is not None:  # a bad profile fails here, before any chapter runs
        from labkit.runtime.emulate import resolve

        ws = params.get("world_size")
        try:
            resolve(params["emulate"], ws if isinstance(ws, int) and not isinstance(ws, bool) else None)
        except ValueError as e:
            raise ValueError(f"-p emulate={params['emulate']!r}: {e} (or None / null / off: no emulation)") from None
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a file, not a folder: name a folder for the executed notebooks")
    timeout = positive_float("--cell-timeout", args.cell_timeout)
    refused = {}
    if params:  # a parameter no chosen chapter declares is a typo: refused before anything runs
        paths = discover(chapters)
        check_parameters(paths, params)
        refused = refused_chapters(paths, params)  # each chapter's own check of the values, before any kernel
        if len(refused) == len(paths):  # refused by every chapter chosen: bad input, not a run
            raise ValueError("; ".join(refused.values()))
    df = run_chapters(chapters, out=args.out, parameters=params, cell_timeout_s=timeout, kernel_name=args.kernel,
                      progress=sys.stderr.isatty(), refused=refused)
    table = df[["notebook", "status", "seconds", "error"]].copy()
    table["error"] = table["error"].map(lambda e: (e.splitlines() or [""])[0])  # whole errors: summary.csv
    with pd.option_context("display.max_colwidth", 100, "display.width", 200):
        print(table.to_string(index=False))
    ran = df[df["status"] != "refused"]
    out = ran["output"].iloc[0].rsplit("/", 1)[0] if len(ran) else args.out
    n_bad = int((ran["status"] != "ok").sum())
    skipped = f" ({len(df) - len(ran)} refused these parameters: not run)" if len(ran) < len(df) else ""
    print(f"\n{len(ran) - n_bad}/{len(ran)} chapters ok{skipped}, {df['seconds'].sum():.0f} s in all; "
          f"executed notebooks in {out}")
    return 1 if n_bad else 0
