"""Read back the scaling points that examples/slurm/scaling.sbatch (or any torchrun of
``labkit.experiments.scaling:torchrun_point``) wrote, print the series with every speedup's baseline, and optionally
record it as a reference series for chapter 11.

    python examples/slurm/collect.py runs/slurm-123/n1x1 runs/slurm-123/n1x8 runs/slurm-123/n2x8 \
        [--record data/reference/scaling/h100-slurm-123.json]

Run it where the GPUs are (the batch script's node) so the recorded identity names them.
"""

from __future__ import annotations

import argparse
import sys

from labkit.chapters.ch11_scaling import format_table
from labkit.experiments import scaling
from labkit.runtime import records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", help="torchrun --out folders, one per world size")
    ap.add_argument("--record", default=None, help="write the series here (format labkit.scaling/v1)")
    args = ap.parse_args(argv)
    try:
        df = scaling.from_torchrun(args.dirs)
    except ValueError as e:
        print(f"collect.py: {e}", file=sys.stderr)
        return 2
    print(format_table(df))
    if args.record:
        ident = records.identity("scaling", world_size=int(df["world_size"].max()), backend=str(df["backend"].iloc[0]))
        ident["n_nodes"] = int(df["n_nodes"].max())
        ident["points"] = list(args.dirs)
        try:
            print(f"recorded: {scaling.write_reference(df, ident, args.record)}")
        except ValueError as e:  # a row that must not become reference numbers: nothing written
            print(f"collect.py: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
